"""The prefix cache's tiers below RAM as one: local disk first, then the fleet's remote store.

This is what the scheduler asks (how much of a chain the disk holds, how much to try remotely) and what the
engine hands filled blocks and planned loads to. A load restores the chain's head from disk on the disk tier's
thread and continues, from the first block the disk could not give, on the remote tier's fetcher thread; blocks
fetched remotely are also queued for the local disk before the load is reported, while their request is still
loading and no step can touch them. The engine hears of a load once, with how many blocks came from where.
build_tiers makes the tiers a config asks for; kv_identity is what every tier (RAM's digests too) keys blocks by.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from service.core.config import EngineConfig
from service.engine.disk_store import DiskStore
from service.engine.kv_tier import KVDiskTier, LoadResult
from service.engine.model_files import ModelFiles
from service.engine.remote_store import RemoteStore, read_password
from service.engine.remote_tier import KVRemoteTier

log = logging.getLogger(__name__)


class KVTiers:
    def __init__(
        self, disk: KVDiskTier | None, remote: KVRemoteTier | None, report: Callable[[LoadResult], None]
    ) -> None:
        self.disk = disk
        self.remote = remote
        self.report = report
        # the loads under way, by request id: each one's "its request ended", set by cancel and read by the tier
        # that works on it (dict operations are atomic: the engine thread adds and cancels, the tiers' remove)
        self._ended: dict[int, threading.Event] = {}

    def start(self) -> None:
        for tier in (self.disk, self.remote):
            if tier is not None:
                tier.start()

    def close(self, timeout: float) -> None:
        for tier in (self.disk, self.remote):
            if tier is not None:
                tier.close(timeout)

    # -- engine thread -------------------------------------------------------------------------------------
    def count_chain(self, digests: Sequence[bytes]) -> int:
        """How many of digests, from the first on, the local disk holds."""
        return self.disk.count_chain(digests) if self.disk is not None else 0

    def count_remote(self, digests: Sequence[bytes]) -> int:
        """How many of digests, from the first on, to try fetching from the remote tier."""
        return self.remote.count_chain(digests) if self.remote is not None else 0

    def touch(self, digests: Sequence[bytes]) -> None:
        if self.disk is not None:
            self.disk.touch(digests)

    def save(self, blocks: Sequence[tuple[bytes, int]]) -> None:
        """Newly filled blocks (digest, block id), in chain order: written to disk and published."""
        for tier in (self.disk, self.remote):
            if tier is not None:
                tier.save(blocks)

    def load(
        self, request_id: int, digests: Sequence[bytes], block_ids: Sequence[int], deadline: float | None = None
    ) -> None:
        """Restore digests into block_ids from disk, then from the remote tier (by the request's deadline, if it
        has one); report is called once."""
        start = time.perf_counter()
        ended = self._ended[request_id] = threading.Event()
        on_disk = self.count_chain(digests)
        if self.disk is not None and on_disk:

            def restored(result: LoadResult) -> None:
                self._continue(request_id, digests, block_ids, result.num_loaded, start, deadline, ended)

            self.disk.load(request_id, digests[:on_disk], block_ids[:on_disk], restored, deadline, ended)
        else:
            self._continue(request_id, digests, block_ids, 0, start, deadline, ended)

    def cancel(self, request_id: int) -> None:
        """The request ended while loading: its restore and fetch stop before their next block or round trip
        (a fetch not yet asked for, after the restore, is not asked for)."""
        ended = self._ended.get(request_id)
        if ended is not None:
            ended.set()

    # -- the tiers' threads --------------------------------------------------------------------------------
    def _continue(
        self,
        request_id: int,
        digests: Sequence[bytes],
        block_ids: Sequence[int],
        num_restored: int,
        start: float,
        deadline: float | None,
        ended: threading.Event,
    ) -> None:
        """num_restored blocks came from disk: fetch the rest remotely, if there is a remote tier, a rest, and the
        request has not ended."""

        def fetched(result: LoadResult) -> None:
            got = slice(num_restored, num_restored + result.num_loaded)
            if self.disk is not None and result.num_loaded:
                try:  # kept on disk too; whatever fails there, the load is reported, or its blocks stay held
                    self.disk.save(list(zip(digests[got], block_ids[got], strict=True)))
                except Exception:
                    log.exception("kv tiers: keeping fetched blocks on disk failed")
            total = num_restored + result.num_loaded
            self._reported(LoadResult(request_id, total, time.perf_counter() - start, num_remote=result.num_loaded))

        if self.remote is not None and num_restored < len(digests) and not ended.is_set():
            # a cancel from here on is seen by the fetch before its first round trip
            self.remote.load(request_id, digests[num_restored:], block_ids[num_restored:], fetched, deadline, ended)
            return
        self._reported(LoadResult(request_id, num_restored, time.perf_counter() - start))

    def _reported(self, result: LoadResult) -> None:
        self._ended.pop(result.request_id, None)
        self.report(result)


def build_tiers(
    config: EngineConfig, identity: bytes, cache: list[np.ndarray], report: Callable[[LoadResult], None]
) -> KVTiers | None:
    """The tiers below RAM the config asks for, over the KV cache's arrays; None without any. report takes the
    loads' results (the engine's command queue)."""
    disk = None
    if config.kv_disk_dir:
        size, ttl = int(config.kv_disk_gb * 2**30), config.kv_disk_ttl_seconds
        disk = KVDiskTier(DiskStore(Path(config.kv_disk_dir), identity, size, ttl), cache, report)
    remote = remote_tier(config, identity, cache)
    if disk is None and remote is None:
        return None
    return KVTiers(disk, remote, report)


def remote_tier(config: EngineConfig, identity: bytes, cache: list[np.ndarray]) -> KVRemoteTier | None:
    """The remote tier the config asks for; None without one, or (with a warning) when its password file cannot
    be read: the server serves without it rather than not at all."""
    if not config.kv_remote_url:
        return None
    password = None
    if config.kv_remote_password_file:
        try:
            password = read_password(config.kv_remote_password_file)
        except OSError as exc:
            log.warning("kv remote tier off: cannot read --kv-remote-password-file: %s", exc)
            return None
    try:
        store = RemoteStore(
            config.kv_remote_url,
            identity,
            sum(a[0].nbytes for a in cache),
            password=password,
            ttl_seconds=config.kv_remote_ttl_seconds,
            timeout=config.kv_remote_timeout_seconds,
            ca_cert=config.kv_remote_ca_cert,
        )
    except ValueError as exc:  # the URL's text: its message never quotes a password (redis-py names the part)
        log.warning("kv remote tier off: --kv-remote-url cannot be used: %s", exc)
        return None
    return KVRemoteTier(store, cache)


# The CPU's vector instruction sets that choose OpenVINO's kernels (AVX2, AVX-512 and its VNNI, BF16 and FP16
# parts, AMX): replicas of a fleet on different CPUs may compute other bits for the same tokens
KERNEL_FLAGS = frozenset(
    ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")
)


def cpu_kind() -> str:
    """The KERNEL_FLAGS this CPU has, as text ("unknown" where /proc/cpuinfo cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.partition(":")[2].split() for line in f if line.startswith("flags")), None)
    except OSError:
        flags = None
    return "unknown" if flags is None else " ".join(sorted(KERNEL_FLAGS.intersection(flags)))


def kv_identity(model: ModelFiles, config: EngineConfig, cache_format: str) -> bytes:
    """Everything that changes what a KV block holds: the model's content, the cache's format (runtime,
    precision, block shape, the activations' precision, how steps feed tokens), the CPU's kind (its kernels) and
    the settings that change the numbers written (dynamic quantization). Thread counts and the step budget are
    left out: they did not change a block's bytes (docs/API.md, Reproducible replies)."""
    parts = {
        "model": model.digest,
        "cache_format": cache_format,
        "cpu": cpu_kind(),
        "kv_cache_precision": config.kv_cache_precision,
        "dq_group_size": config.dq_group_size,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).digest()
