"""The disk tier trusts nothing in its folder: links are never followed, nothing outside --kv-disk-dir is
written or removed, an entry under a block's name that is not a regular file it can read is one corrupt block
(skipped, counted, one warning) while the tier goes on, and a folder belongs to one running server."""

import hashlib
import logging
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import service.engine.disk_store as disk_store
from service.engine.disk_store import ABANDONED_AFTER_SECONDS, HEADER, DiskStore
from service.engine.kv_tier import KVDiskTier
from tests.support.disk import Reports, wait_written

IDENTITY = hashlib.sha256(b"engine").digest()
OTHER_IDENTITY = hashlib.sha256(b"another model").digest()
PAYLOAD = 100


def digest(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=32).digest()


def name(i: int) -> str:
    return digest(i).hex() + ".kvb"


def folder_of(root: Path, identity: bytes = IDENTITY) -> Path:
    return root / identity.hex()[:32]


def opened(root: Path, capacity: int = 1 << 20, identity: bytes = IDENTITY) -> DiskStore:
    store = DiskStore(root, identity, capacity)
    store.open()
    return store


def written(root: Path, n: int) -> None:
    """What an earlier run left: blocks 0..n-1."""
    store = opened(root)
    for i in range(n):
        store.write(digest(i), bytes([i]) * PAYLOAD)


def read_soon(store: DiskStore, i: int) -> memoryview | None:
    """store.read, failing the test instead of hanging when the read waits (a pipe with no writer)."""
    result: list[memoryview | None] = []
    reader = threading.Thread(target=lambda: result.append(store.read(digest(i), PAYLOAD)), daemon=True)
    reader.start()
    reader.join(5)
    assert len(result) == 1, "the read waited"
    return result[0]


def warnings_naming(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


def tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


# -- links: the identity folder ------------------------------------------------------------------------------


def test_an_identity_folder_that_is_a_symlink_is_not_followed(tmp_path):
    # another folder (another server's, a backup's) that a link under the identity's name points to: its
    # temporary file was removed by the crash cleanup, and blocks were written into it
    root, elsewhere = tmp_path / "kv", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (elsewhere / "theirs.kvb.tmp").write_bytes(b"a write in progress")
    (elsewhere / name(5)).write_bytes(b"their block")
    folder_of(root).symlink_to(elsewhere, target_is_directory=True)
    before = tree(elsewhere)
    store = opened(root, capacity=3 * (HEADER.size + PAYLOAD))
    for i in range(6):  # beyond the capacity: evictions too
        store.write(digest(i), bytes([i]) * PAYLOAD)
    assert tree(elsewhere) == before
    assert not folder_of(root).is_symlink() and folder_of(root).is_dir()
    assert len(list(folder_of(root).glob("*.kvb"))) == 3 and bytes(store.read(digest(5), PAYLOAD)) == b"\5" * PAYLOAD


def test_an_identity_folder_swapped_for_a_symlink_while_open_is_not_followed(tmp_path):
    root, elsewhere = tmp_path / "kv", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    store = opened(root, capacity=2 * (HEADER.size + PAYLOAD))
    store.write(digest(0), b"\0" * PAYLOAD)
    (elsewhere / name(0)).write_bytes(b"not this store's")  # what an eviction by name would remove
    (elsewhere / "theirs.kvb.tmp").write_bytes(b"a write in progress")
    folder_of(root).rename(root / "moved")
    folder_of(root).symlink_to(elsewhere, target_is_directory=True)
    before = tree(elsewhere)
    for i in range(1, 4):
        store.write(digest(i), bytes([i]) * PAYLOAD)
    store.evict(0)
    assert tree(elsewhere) == before


# -- entries under a block's name ----------------------------------------------------------------------------


def make_odd_entry(path: Path, kind: str, tmp_path: Path) -> None:
    """Put something that is not a block file under path's name."""
    path.unlink(missing_ok=True)
    if kind == "symlink":
        path.symlink_to("/etc/passwd")
    elif kind == "symlink to a block":
        (tmp_path / "a block elsewhere").write_bytes(b"\0" * (HEADER.size + PAYLOAD))
        path.symlink_to(tmp_path / "a block elsewhere")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        os.mknod(path, stat.S_IFSOCK | 0o600)
    elif kind == "empty folder":
        path.mkdir()
    elif kind == "folder":
        path.mkdir()
        (path / "inside").write_text("not the tier's")
        (path / "link").symlink_to(tmp_path)


ODD = ["symlink", "symlink to a block", "fifo", "socket", "empty folder", "folder"]


@pytest.mark.parametrize("kind", ODD)
def test_an_odd_entry_found_at_start_is_one_corrupt_block(tmp_path, caplog, kind):
    written(tmp_path, 3)
    path = folder_of(tmp_path) / name(1)
    make_odd_entry(path, kind, tmp_path)
    caplog.set_level(logging.WARNING)
    store = opened(tmp_path)
    assert store.counters.num_corrupt == 1 and len(warnings_naming(caplog, name(1))) == 1
    assert digest(1) not in store and read_soon(store, 1) is None
    assert [bytes(store.read(digest(i), PAYLOAD)) for i in (0, 2)] == [b"\0" * PAYLOAD, b"\2" * PAYLOAD]
    assert Path("/etc/passwd").exists() and tmp_path.exists()
    if kind == "folder":  # never emptied: it may hold anything, reached through anything
        assert (path / "inside").read_text() == "not the tier's" and (path / "link").is_symlink()
    else:  # removed (a link, not its target): the block can be stored again
        assert not path.exists() and not path.is_symlink()
    store.write(digest(1), b"\1" * PAYLOAD)
    assert (read_soon(store, 1) is not None) == (kind != "folder")
    store.write(digest(3), b"\3" * PAYLOAD)  # writes go on either way
    assert bytes(store.read(digest(3), PAYLOAD)) == b"\3" * PAYLOAD
    assert store.counters.num_corrupt == 1 and len(warnings_naming(caplog, name(1))) == 1  # once per entry


def test_a_file_it_cannot_read_is_one_corrupt_block(tmp_path, caplog, monkeypatch):
    written(tmp_path, 3)
    path = folder_of(tmp_path) / name(1)
    path.chmod(0)  # unreadable, but not for root: the refusal is also made certain below
    real_open = os.open

    def refusing_open(file, flags, *args, **kwargs):
        if os.fspath(file).endswith(name(1)):
            raise PermissionError(13, "Permission denied", os.fspath(file))
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(disk_store.os, "open", refusing_open)
    caplog.set_level(logging.WARNING)
    store = opened(tmp_path)
    assert store.read(digest(1), PAYLOAD) is None  # refused, not raised as the disk's failure
    assert store.counters.num_corrupt == 1 and len(warnings_naming(caplog, name(1))) == 1
    assert [bytes(store.read(digest(i), PAYLOAD)) for i in (0, 2)] == [b"\0" * PAYLOAD, b"\2" * PAYLOAD]
    monkeypatch.undo()
    store.write(digest(1), b"\1" * PAYLOAD)
    assert bytes(store.read(digest(1), PAYLOAD)) == b"\1" * PAYLOAD


# -- the tier goes on --------------------------------------------------------------------------------------


def cache_arrays(num_blocks: int = 8) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 255, (num_blocks, 2, 5, 4), dtype=np.uint8)]


@pytest.mark.parametrize("when", ["before start", "while running"])
@pytest.mark.parametrize("kind", ["empty folder", "folder"])
def test_a_folder_under_a_blocks_name_never_stops_writes(tmp_path, caplog, kind, when):
    # it turned every write off, and again after every restart
    cache, reports = cache_arrays(), Reports()
    folder = folder_of(tmp_path)
    folder.mkdir()
    if when == "before start":
        make_odd_entry(folder / name(1), kind, tmp_path)
    for restart in range(2):
        tier = KVDiskTier(DiskStore(tmp_path, IDENTITY, 1 << 20), cache, reports)
        tier.start()
        if when == "while running" and restart == 0:
            make_odd_entry(folder / name(1), kind, tmp_path)
        tier.save([(digest(i), i) for i in range(4)])
        tier.save([(digest(10 + restart), 5)])  # and a block after it
        tier.close(5)
        assert tier.writable and tier.enabled
        stored = {i for i in [*range(4), 10 + restart] if digest(i) in tier.store}
        assert stored == {0, 2, 3, 10 + restart} | ({1} if kind == "empty folder" else set())
        assert tier.store.counters.num_corrupt == (1 if restart == 0 or kind == "folder" else 0)
    assert "no more writes" not in caplog.text
    tier = KVDiskTier(DiskStore(tmp_path, IDENTITY, 1 << 20), cache, reports)
    tier.start()
    tier.load(1, [digest(0)], [7])
    assert reports.wait().num_loaded == 1
    tier.close(5)


# -- one server per folder ---------------------------------------------------------------------------------


def test_a_second_server_on_the_folder_refuses_to_start(tmp_path):
    # two servers sharing a folder each kept it within their own bound: together it grew past either
    first = KVDiskTier(DiskStore(tmp_path, IDENTITY, 1 << 20), cache_arrays(), Reports())
    first.start()
    second = KVDiskTier(DiskStore(tmp_path, IDENTITY, 1 << 20), cache_arrays(), Reports())
    with pytest.raises(RuntimeError) as refused:
        second.start()
    message = str(refused.value)
    assert str(folder_of(tmp_path)) in message and "--kv-disk-dir" in message and "\n" not in message
    other_model = KVDiskTier(DiskStore(tmp_path, OTHER_IDENTITY, 1 << 20), cache_arrays(), Reports())
    other_model.start()  # servers of other models keep folders of their own beside it
    first.save([(digest(0), 0)])
    wait_written(first.store, 1)
    first.close(5)
    other_model.close(5)
    again = KVDiskTier(DiskStore(tmp_path, IDENTITY, 1 << 20), cache_arrays(), Reports())
    again.start()  # the first one stopped: the folder is free
    assert digest(0) in again.store
    again.close(5)


HOLD = """
import sys, time
import numpy as np
from pathlib import Path
from service.engine.disk_store import DiskStore
from service.engine.kv_tier import KVDiskTier
tier = KVDiskTier(DiskStore(Path(sys.argv[1]), bytes.fromhex(sys.argv[2]), 1 << 20), [np.zeros((1, 4))], print)
tier.start()
print("started", flush=True)
time.sleep(60)
"""


def test_a_folder_held_by_a_live_process_is_refused_and_freed_by_its_death(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path), IDENTITY.hex()],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "started"
        tier = KVDiskTier(DiskStore(tmp_path, IDENTITY, 1 << 20), cache_arrays(), Reports())
        with pytest.raises(RuntimeError, match="--kv-disk-dir"):
            tier.start()
    finally:
        holder.kill()  # as kill -9 or a crash: nothing is cleaned up
        holder.wait()
    tier = KVDiskTier(DiskStore(tmp_path, IDENTITY, 1 << 20), cache_arrays(), Reports())
    tier.start()
    assert tier.enabled and tier.writable
    tier.close(5)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "empty folder"])
def test_a_lock_file_that_is_not_a_file_is_replaced_not_followed(tmp_path, kind):
    (tmp_path / "target").write_text("not the tier's")
    folder_of(tmp_path).mkdir()
    lock = folder_of(tmp_path) / disk_store.LOCK_NAME
    if kind == "symlink":
        lock.symlink_to(tmp_path / "target")
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()
    tier = KVDiskTier(DiskStore(tmp_path, IDENTITY, 1 << 20), cache_arrays(), Reports())
    tier.start()
    assert tier.enabled and lock.is_file() and not lock.is_symlink()
    assert (tmp_path / "target").read_text() == "not the tier's"
    with pytest.raises(RuntimeError, match="--kv-disk-dir"):  # and it holds the folder
        KVDiskTier(DiskStore(tmp_path, IDENTITY, 1 << 20), cache_arrays(), Reports()).start()
    tier.close(5)


@pytest.mark.parametrize("live", [True, False])
def test_a_live_servers_folder_is_never_removed_as_abandoned(tmp_path, live):
    other = KVDiskTier(DiskStore(tmp_path, OTHER_IDENTITY, 1 << 20), cache_arrays(), Reports())
    other.start()
    other.save([(digest(0), 0)])
    wait_written(other.store, 1)
    if not live:
        other.close(5)
    long_ago = time.time() - ABANDONED_AFTER_SECONDS - 60
    for f in [*folder_of(tmp_path, OTHER_IDENTITY).iterdir(), folder_of(tmp_path, OTHER_IDENTITY)]:
        os.utime(f, (long_ago, long_ago))  # idle for longer than the horizon
    opened(tmp_path)
    assert folder_of(tmp_path, OTHER_IDENTITY).exists() == live
    if live:
        assert digest(0) in other.store and other.store.read(digest(0), other.block_bytes) is not None
        other.close(5)


def test_blocks_are_keyed_by_the_cpus_kind(tmp_path, monkeypatch):
    """A fleet sharing a store across CPUs of other kinds (AVX2 against AVX-512 or AMX: other kernels, other bits)
    never reads another kind's blocks; the same kind, the same key."""
    from service.core.config import EngineConfig
    from service.engine import kv_tiers
    from service.engine.model_files import ModelFiles

    model = ModelFiles(tmp_path, {}, {}, {"ir_digest": "d"})
    avx2, avx512 = "avx2", "avx2 avx512_bf16 avx512_vnni avx512f"
    identity: dict[str, set[bytes]] = {}
    for kind in (avx2, avx512, avx2):
        monkeypatch.setattr(kv_tiers, "cpu_kind", lambda kind=kind: kind)
        identity.setdefault(kind, set()).add(kv_tiers.kv_identity(model, EngineConfig(), "format"))
    assert len(identity[avx2]) == 1 and identity[avx2] != identity[avx512]
