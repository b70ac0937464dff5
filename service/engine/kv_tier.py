"""The disk tier of the prefix cache: blocks written to a DiskStore and restored from it, on its own I/O thread.

Which blocks and when: every block that fills and enters the RAM prefix cache is written once, as soon
as it fills (write-through). The engine thread only copies the block's bytes out of the KV cache (a
memcpy between steps) and queues them; the I/O thread writes. So a crash loses only the blocks still
queued (a second or so of work; a power loss may also damage files the OS had not flushed, which their
checksums catch), and a graceful stop, which flushes the queue, loses nothing. Writing
at eviction from RAM instead would lose everything on a crash and put the copy on the critical path of
the allocation that evicts. When writes fall behind (more than max_pending_bytes queued), the blocks
that do not fit are skipped and counted rather than stalling a step.

Restores run on the same I/O thread, ahead of any write: the thread reads and checks each file and
copies it straight into the pool blocks the scheduler set aside for it. Those blocks belong to a
request in the loading state, which no step touches until the load is reported done, so the engine
keeps stepping other requests meanwhile.

A disk that refuses a write (full, read-only, gone) stops the writing with one warning; blocks already
stored are still restored, and serving goes on. A disk that stops answering (a hung network mount: a read
that never returns) turns the whole tier off: every file operation runs on a thread of its own and is
waited for at most disk_timeout seconds, so a load is always reported and the blocks it holds are freed.

Recency: a chain is only useful from its first block on, so whenever a chain is used (written, restored,
or hit in RAM) its blocks are marked used from the last to the first, and the least recently used end of
the store always holds chain tails, never the heads that make them reachable.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from queue import SimpleQueue
from typing import TypeVar

import numpy as np

from service.engine.disk_store import DiskStore

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_MAX_PENDING_BYTES = 256 << 20
# A block's read or write takes well under a millisecond on a local disk; one that has not returned in this
# long means the disk stopped answering.
DEFAULT_DISK_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class LoadResult:
    """num_loaded blocks, from the first on, now hold their restored content; the last num_remote of them came
    from the remote tier (the others from local disk)."""

    request_id: int
    num_loaded: int
    seconds: float
    num_remote: int = 0


@dataclass(frozen=True)
class _Load:
    request_id: int
    digests: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    report: Callable[[LoadResult], None] | None = None  # instead of the tier's on_loaded
    deadline: float | None = None  # time.monotonic() by which the restore ends: its request's deadline
    ended: threading.Event | None = None  # set when its request ends: the restore stops before its next block


@dataclass(frozen=True)
class BlockCopies:
    """Blocks copied out of the KV cache, to be written or published while the pool reuses the originals."""

    digests: tuple[bytes, ...]
    copies: tuple[np.ndarray, ...]  # per cache tensor: the blocks' content, [num_blocks, ...]

    @classmethod
    def of(cls, cache: Sequence[np.ndarray], blocks: Sequence[tuple[bytes, int]]) -> BlockCopies:
        """Copies of blocks (digest, block id) of the cache tensors."""
        ids = np.array([b for _, b in blocks], dtype=np.int64)
        return cls(tuple(d for d, _ in blocks), tuple(a[ids] for a in cache))

    @property
    def num_bytes(self) -> int:
        return sum(c.nbytes for c in self.copies)

    def payload(self, i: int) -> bytes:
        """The i-th block's bytes of every cache tensor, in the cache's order."""
        return b"".join(copy[i].tobytes() for copy in self.copies)


@dataclass
class TierCounters:
    num_skipped: int = 0  # full blocks not written because writes had fallen behind
    num_restores: int = 0
    num_restored_blocks: int = 0
    restore_seconds_total: float = 0.0


class KVDiskTier:
    def __init__(
        self,
        store: DiskStore,
        cache: Sequence[np.ndarray],
        on_loaded: Callable[[LoadResult], None],
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        disk_timeout: float = DEFAULT_DISK_TIMEOUT_SECONDS,
    ) -> None:
        """cache: the KV cache tensors as arrays of [num_blocks, ...], in a fixed order."""
        self.store = store
        self.cache = list(cache)
        self.block_bytes = sum(a[0].nbytes for a in self.cache)
        self.on_loaded = on_loaded
        self.max_pending_bytes = max_pending_bytes
        self.disk_timeout = disk_timeout
        self.counters = TierCounters()
        self.enabled = False  # the store opened and the disk answers: restores work
        self.writable = False  # no write has failed yet
        self._files: _FileThread | None = None  # started with the tier: an operation that never returns blocks it
        self._stuck: Future[object] | None = None  # the operation the disk has not answered
        self._loads: deque[_Load] = deque()
        self._writes: deque[BlockCopies] = deque()
        self._pending_bytes = 0
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kv-disk", daemon=True)

    def start(self) -> None:
        """Open the store, holding its folder: raises FolderInUse when another running server holds it (the
        server must not start on it). A folder that cannot be used leaves the tier off, with one warning."""
        try:
            self.store.open(exclusive=True)
        except OSError as exc:
            log.warning("kv disk tier off: cannot use %s: %s", self.store.folder, exc)
            return
        self.enabled = self.writable = True
        self._files = _FileThread()
        self._thread.start()

    def close(self, timeout: float) -> None:
        """Write what is queued (for at most timeout seconds), then end the thread."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._files is not None:
            self._files.stop()
        if not self._thread.is_alive() and (self._stuck is None or self._stuck.done()):
            self.store.close()  # no file operation is left running: the folder (and its lock) can go
        if self._writes:
            num_left = sum(len(w.digests) for w in self._writes)
            log.warning("kv disk tier: %d queued blocks not written at shutdown", num_left)

    @property
    def pending_bytes(self) -> int:
        """Bytes of blocks queued for writing."""
        return self._pending_bytes

    # -- engine thread -------------------------------------------------------------------------------------
    def count_chain(self, digests: Sequence[bytes]) -> int:
        return self.store.count_chain(digests) if self.enabled else 0

    def touch(self, digests: Sequence[bytes]) -> None:
        """A chain's blocks were used (found in RAM): keep their disk copies from going first."""
        if self.enabled:
            self.store.touch(digests)

    def save(self, blocks: Sequence[tuple[bytes, int]]) -> None:
        """Queue newly filled blocks (digest, block id), in chain order, for writing; their content is copied
        now. What does not fit under max_pending_bytes is skipped, from the end: a chain's head is what
        makes the rest of it reachable. Called on the engine thread, and on the remote tier's fetcher thread for
        blocks it fetched (whose request is loading: no step touches them)."""
        if not self.writable:
            return
        new = [(d, b) for d, b in blocks if d not in self.store]
        with self._wake:
            room = max(0, (self.max_pending_bytes - self._pending_bytes) // self.block_bytes)
            self.counters.num_skipped += max(0, len(new) - room)
        new = new[:room]
        if not new:
            return
        write = BlockCopies.of(self.cache, new)
        with self._wake:
            self._writes.append(write)
            self._pending_bytes += write.num_bytes
            self._wake.notify()

    def load(
        self,
        request_id: int,
        digests: Sequence[bytes],
        block_ids: Sequence[int],
        report: Callable[[LoadResult], None] | None = None,
        deadline: float | None = None,
        ended: threading.Event | None = None,
    ) -> None:
        """Restore digests into block_ids, in order, stopping at the first block that cannot be read, at the
        request's deadline or once `ended` is set; report (by default on_loaded) is called (on the I/O thread) with
        how many were."""
        with self._wake:
            self._loads.append(_Load(request_id, tuple(digests), tuple(block_ids), report, deadline, ended))
            self._wake.notify()

    # -- I/O thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        # with a TTL, expired blocks go even when nothing is written (an idle server, a tier that stopped
        # writing): their files hold users' text. The sweep is due every tenth of the TTL, busy or not, and runs
        # off the lock (the engine's save and load take it).
        sweep_every = self.store.ttl_seconds / 10 if self.store.ttl_seconds else None
        next_sweep = time.monotonic() + (sweep_every or 0.0)
        while True:
            job: _Load | BlockCopies | None = None
            with self._wake:
                if not (self._loads or self._writes or self._closing):
                    self._wake.wait(max(next_sweep - time.monotonic(), 0.0) if sweep_every else None)
                if self._loads:
                    job = self._loads.popleft()
                elif self._writes:
                    job = self._writes.popleft()
                elif self._closing:
                    return  # closing, and nothing left to write
            if sweep_every and time.monotonic() >= next_sweep:
                self._sweep()
                next_sweep = time.monotonic() + sweep_every
            if job is None:
                continue
            if isinstance(job, _Load):
                try:
                    result = self._restore(job)
                except Exception:  # a load must always be reported, or its blocks would never be freed
                    log.exception("kv disk tier: restoring a prefix failed; it will be computed")
                    result = LoadResult(job.request_id, 0, 0.0)
                (job.report or self.on_loaded)(result)
            else:
                try:
                    self._write(job)
                except Exception:
                    log.exception("kv disk tier: writing a block failed; no more writes")
                    self.writable = False
                with self._wake:
                    self._pending_bytes -= job.num_bytes

    def _sweep(self) -> None:
        """Remove expired blocks. Their files hold users' text, so this goes on after writes stopped, and
        after a disk that stopped answering answers again (restores and writes stay off until a restart)."""
        if self._stuck is not None:
            if not self._stuck.done():
                return  # still not answering: another operation would only queue behind it
            log.info("kv disk tier: %s answers again; expired blocks are swept", self.store.folder)
            self._stuck = None
        with contextlib.suppress(TimeoutError, OSError):
            self._on_disk(self.store.evict, 0)

    def _on_disk(self, operation: Callable[..., T], *args: object) -> T:
        """operation(*args) on the file operations' thread, waited for at most disk_timeout seconds. A disk
        that has not answered by then turns the tier off (TimeoutError), with one warning."""
        assert self._files is not None  # started with the tier
        future = self._files.submit(operation, *args)
        try:
            return future.result(self.disk_timeout)
        except TimeoutError:
            self._stuck = future  # type: ignore[assignment]
            if self.enabled:
                log.warning(
                    "kv disk tier: %s has not answered for %.0f s; the tier is off (prefixes are computed, "
                    "nothing more is written)",
                    self.store.folder,
                    self.disk_timeout,
                )
            self.enabled = self.writable = False
            raise

    def _restore(self, load: _Load) -> LoadResult:
        start = time.perf_counter()
        num_loaded = 0
        for digest, block_id in zip(load.digests, load.block_ids, strict=True):
            if not self.enabled:  # the disk stopped answering: loads queued behind it end at once
                break
            if (load.ended is not None and load.ended.is_set()) or (
                load.deadline is not None and time.monotonic() >= load.deadline
            ):
                break
            try:
                payload = self._on_disk(self.store.read, digest, self.block_bytes)
            except TimeoutError:
                break
            except OSError as exc:
                log.warning("kv disk tier: cannot read a block: %s", exc)
                payload = None
            if payload is None or len(payload) != self.block_bytes:
                break
            put_block(self.cache, block_id, payload)
            num_loaded += 1
        self.store.touch(load.digests[:num_loaded])
        seconds = time.perf_counter() - start
        self.counters.num_restores += 1
        self.counters.num_restored_blocks += num_loaded
        self.counters.restore_seconds_total += seconds
        return LoadResult(load.request_id, num_loaded, seconds)

    def _write(self, write: BlockCopies) -> None:
        if not self.writable:
            return
        for i, digest in enumerate(write.digests):
            payload = write.payload(i)
            try:
                self._on_disk(self.store.write, digest, payload)
            except TimeoutError:
                return
            except OSError as exc:
                log.warning(
                    "kv disk tier: writing to %s failed: %s; no more writes (stored blocks are still restored)",
                    self.store.folder,
                    exc,
                )
                self.writable = False
                return
        self.store.touch(write.digests)


def put_block(cache: Sequence[np.ndarray], block_id: int, payload: bytes | memoryview) -> None:
    """Copy a payload (as BlockCopies.payload lays it out) into a pool block of every cache tensor."""
    offset = 0
    for array in cache:
        block = array[block_id]
        block[...] = np.frombuffer(payload, array.dtype, block.size, offset).reshape(block.shape)
        offset += block.nbytes


class _FileThread:
    """A daemon thread that runs file operations in turn and hands back their results as futures. Daemon,
    unlike a ThreadPoolExecutor's: the process must be able to exit while an operation never returns."""

    def __init__(self) -> None:
        self._jobs: SimpleQueue[tuple[Callable[..., object], tuple[object, ...], Future[object]] | None]
        self._jobs = SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kv-disk-files", daemon=True)
        self._thread.start()

    def submit(self, operation: Callable[..., T], *args: object) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((operation, args, future))  # type: ignore[arg-type]
        return future

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            operation, args, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(operation(*args))
                except BaseException as exc:
                    future.set_exception(exc)
