"""The disk tier without a model: the block store's files, bounds and integrity checks, and the I/O
thread's writes and restores over plain arrays standing in for the KV cache tensors."""

import hashlib
import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from service.engine.disk_store import ABANDONED_AFTER_SECONDS, HEADER, DiskStore
from service.engine.kv_tier import KVDiskTier, LoadResult
from tests.support.disk import Reports, wait_written

IDENTITY = hashlib.sha256(b"engine").digest()


def digest(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=32).digest()


def opened(root: Path, capacity: int = 1 << 20, ttl: float = 0.0, identity: bytes = IDENTITY) -> DiskStore:
    store = DiskStore(root, identity, capacity, ttl)
    store.open()
    return store


def test_write_read_and_chain(tmp_path):
    store = opened(tmp_path)
    for i in range(3):
        store.write(digest(i), bytes([i]) * 100)
    assert bytes(store.read(digest(1), 100)) == b"\x01" * 100
    assert store.count_chain([digest(0), digest(1), digest(2), digest(3)]) == 3
    assert store.count_chain([digest(5), digest(0)]) == 0
    assert store.read(digest(9), 100) is None
    assert store.num_blocks == 3 and store.num_bytes == 3 * (HEADER.size + 100)


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],  # truncated
        lambda data: data[:-1] + bytes([data[-1] ^ 1]),  # one bit flipped in the payload
        lambda data: b"",  # empty
        lambda data: data.replace(IDENTITY, hashlib.sha256(b"other model").digest()),  # foreign
    ],
    ids=["truncated", "flipped", "empty", "foreign"],
)
def test_damaged_file_is_removed_not_loaded(tmp_path, damage):
    store = opened(tmp_path)
    store.write(digest(0), b"x" * 1000)
    path = store.folder / (digest(0).hex() + ".kvb")
    path.write_bytes(damage(path.read_bytes()))
    assert store.read(digest(0), 1000) is None
    assert not path.exists() and digest(0) not in store and store.counters.num_corrupt == 1


@pytest.mark.parametrize("kind", ["fifo", "symlink", "larger", "folder"])
def test_a_block_name_given_to_something_else_is_never_read(tmp_path, kind):
    # replaced while the store runs: a pipe's read never returns (as a hung network mount's would), a symlink
    # leads anywhere, and a large file would be read whole; each was read by its name before
    store = opened(tmp_path)
    store.write(digest(0), b"x" * 1000)
    path = store.folder / (digest(0).hex() + ".kvb")
    data = path.read_bytes()
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        (tmp_path / "elsewhere").write_bytes(data)
        path.symlink_to(tmp_path / "elsewhere")
    elif kind == "larger":
        path.write_bytes(data + b"\0" * (1 << 20))
    else:
        path.mkdir()
    result: list[object] = []
    reader = threading.Thread(target=lambda: result.append(store.read(digest(0), 1000)), daemon=True)
    reader.start()
    reader.join(5)
    assert result == [None], "the read waited or returned something"
    assert digest(0) not in store and store.counters.num_corrupt == 1
    assert kind != "symlink" or (tmp_path / "elsewhere").read_bytes() == data  # a symlink's target is left alone
    assert not path.exists() and not path.is_symlink()  # a folder too: a later write of the block must land
    store.write(digest(0), b"x" * 1000)
    assert bytes(store.read(digest(0), 1000)) == b"x" * 1000


@pytest.mark.parametrize("code", ["EIO", "EMFILE"])
def test_a_block_the_disk_cannot_read_now_is_kept(tmp_path, monkeypatch, code):
    # an error of the disk's is not the file's: it was removed as corrupt before. The file stays; a lasting
    # error (EIO) forgets the block until the next start, a passing one (out of file handles) keeps it indexed
    import errno

    import service.engine.disk_store as disk_store

    store = opened(tmp_path)
    store.write(digest(0), b"x" * 100)
    real_open = os.open

    def failing_open(path, *args, **kwargs):
        if str(path).endswith(".kvb"):
            raise OSError(getattr(errno, code), code, str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(disk_store.os, "open", failing_open)
    with pytest.raises(OSError):
        store.read(digest(0), 100)
    monkeypatch.undo()
    assert store.counters.num_corrupt == 0 and (digest(0) in store) == (code == "EMFILE")
    assert bytes(opened(tmp_path).read(digest(0), 100)) == b"x" * 100  # the file is whole


def test_file_under_another_digest_is_not_loaded(tmp_path):
    store = opened(tmp_path)
    store.write(digest(0), b"x" * 10)
    os.replace(store.folder / (digest(0).hex() + ".kvb"), store.folder / (digest(1).hex() + ".kvb"))
    store = opened(tmp_path)  # reindexed: the renamed file is listed under digest 1
    assert digest(1) in store
    assert store.read(digest(1), 10) is None and store.counters.num_corrupt == 1


def test_engines_of_different_identity_keep_apart(tmp_path):
    a, b = opened(tmp_path), opened(tmp_path, identity=hashlib.sha256(b"other").digest())
    a.write(digest(0), b"a")
    assert digest(0) not in b and b.read(digest(0), 1) is None
    assert bytes(a.read(digest(0), 1)) == b"a"


def test_least_recently_used_go_first(tmp_path):
    size = HEADER.size + 100
    store = opened(tmp_path, capacity=3 * size)
    for i in range(3):
        store.write(digest(i), b"x" * 100)
    store.read(digest(0), 100)  # 0 is now the most recently used
    store.write(digest(3), b"x" * 100)
    assert [digest(i) in store for i in range(4)] == [True, False, True, True]
    assert store.counters.num_evicted == 1 and store.num_bytes == 3 * size
    assert not (store.folder / (digest(1).hex() + ".kvb")).exists()


def test_a_chains_head_is_evicted_last(tmp_path):
    """Blocks are used in chain order, but a chain is only reachable from its head: touching marks the
    head as the most recently used, so eviction takes tails first."""
    store = opened(tmp_path, capacity=3 * (HEADER.size + 10))
    chain = [digest(i) for i in range(3)]
    for d in chain:
        store.write(d, b"x" * 10)
    store.touch(chain)
    store.write(digest(9), b"y" * 10)
    assert store.count_chain(chain) == 2 and chain[2] not in store


def test_a_block_larger_than_the_store_is_not_written(tmp_path):
    store = opened(tmp_path, capacity=100)
    store.write(digest(0), b"x" * 10)
    store.write(digest(1), b"x" * 200)
    assert digest(0) in store and digest(1) not in store


def test_idle_blocks_expire(tmp_path):
    store = opened(tmp_path, ttl=0.2)
    store.write(digest(0), b"x")
    assert digest(0) in store
    time.sleep(0.3)
    assert digest(0) not in store and store.count_chain([digest(0)]) == 0
    store.write(digest(1), b"y")  # any write sweeps expired blocks
    assert store.num_blocks == 1 and not (store.folder / (digest(0).hex() + ".kvb")).exists()


def test_reopen_rebuilds_the_index_and_clears_leftovers(tmp_path):
    store = opened(tmp_path)
    for i in range(4):
        store.write(digest(i), bytes([i]) * 10)
        time.sleep(0.01)  # distinct modification times: recency survives the restart
    store.read(digest(0), 10)
    (store.folder / "half-written.kvb.tmp").write_bytes(b"junk")
    (store.folder / "notes.txt").write_text("not ours")
    (store.folder / (digest(7).hex().upper() + ".kvb")).write_text("not a name we write")
    again = opened(tmp_path, capacity=3 * (HEADER.size + 10))  # smaller: the oldest go at once
    assert [digest(i) in again for i in range(4)] == [True, False, True, True]
    assert not (again.folder / "half-written.kvb.tmp").exists()
    assert bytes(again.read(digest(3), 10)) == b"\x03" * 10


def test_unusable_folder_raises(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(OSError):
        opened(tmp_path / "file" / "kv")


# -- the I/O thread over arrays standing in for the KV cache ------------------------------------------------


def cache_arrays(num_blocks: int = 8) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        rng.integers(0, 255, (num_blocks, 2, 5, 4), dtype=np.uint8),
        rng.standard_normal((num_blocks, 2, 4, 4)).astype(np.float16),
    ]


def test_blocks_round_trip_byte_for_byte(tmp_path):
    cache, reports = cache_arrays(), Reports()
    tier = KVDiskTier(DiskStore(tmp_path, IDENTITY, 1 << 20), cache, reports)
    tier.start()
    tier.save([(digest(0), 1), (digest(1), 2)])
    wait_written(tier.store, 2)
    originals = [a[[1, 2]].copy() for a in cache]
    tier.load(7, [digest(0), digest(1)], [5, 6])
    assert reports.wait() == LoadResult(7, 2, reports.results[-1].seconds)
    for array, original in zip(cache, originals, strict=True):
        assert array[[5, 6]].tobytes() == original.tobytes()
    tier.save([(digest(0), 5)])  # already stored: not even queued
    assert tier.pending_bytes == 0
    tier.close(5)
    assert tier.store.counters.num_written == 2


def test_a_restore_stops_at_the_first_bad_block(tmp_path):
    cache, reports = cache_arrays(), Reports()
    tier = KVDiskTier(DiskStore(tmp_path, IDENTITY, 1 << 20), cache, reports)
    tier.start()
    tier.save([(digest(i), i) for i in range(3)])
    wait_written(tier.store, 3)
    bad = tier.store.folder / (digest(1).hex() + ".kvb")
    bad.write_bytes(bad.read_bytes()[:-3])
    before = [a[[6, 7]].copy() for a in cache]
    tier.load(1, [digest(0), digest(1), digest(2)], [5, 6, 7])
    assert reports.wait().num_loaded == 1
    assert all(a[[6, 7]].tobytes() == b.tobytes() for a, b in zip(cache, before, strict=True))  # untouched
    assert digest(1) not in tier.store and tier.store.counters.num_corrupt == 1
    tier.close(5)


def test_writes_that_fall_behind_are_skipped_not_queued(tmp_path):
    cache = cache_arrays()
    block_bytes = sum(a[0].nbytes for a in cache)
    tier = KVDiskTier(DiskStore(tmp_path, IDENTITY, 1 << 20), cache, Reports(), max_pending_bytes=2 * block_bytes)
    tier.start()
    tier.save([(digest(i), i) for i in range(3)])  # one more than may wait: the chain's tail is skipped
    tier.close(5)
    assert tier.counters.num_skipped == 1 and tier.store.counters.num_written == 2
    assert tier.store.count_chain([digest(0), digest(1), digest(2)]) == 2


def test_an_unusable_folder_leaves_the_tier_off(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    tier = KVDiskTier(DiskStore(tmp_path / "file" / "kv", IDENTITY, 1 << 20), cache_arrays(), Reports())
    tier.start()
    assert not tier.enabled and "kv disk tier off" in caplog.text
    assert tier.count_chain([digest(0)]) == 0
    tier.save([(digest(0), 0)])
    tier.close(1)


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_turns_the_tier_off_with_one_warning(small_tmpfs, caplog):
    cache = [np.zeros((64, 16 << 10), dtype=np.uint8)]  # 16 KiB blocks: the 64 KiB disk holds three
    tier = KVDiskTier(DiskStore(small_tmpfs, IDENTITY, 1 << 30), cache, Reports())
    tier.start()
    for i in range(8):
        tier.save([(digest(i), i)])
        time.sleep(0.02)
    tier.close(5)
    assert not tier.writable and tier.enabled  # what was stored can still be restored
    assert caplog.text.count("writing to") == 1
    assert 1 <= tier.store.counters.num_written < 8
    assert not list(small_tmpfs.rglob("*.tmp")), "a failed write leaves no temporary file"


class HungDisk(DiskStore):
    """A store on a disk that stops answering (a hung network mount) at one block: its read never returns."""

    def __init__(self, *args, hangs_at: bytes) -> None:
        super().__init__(*args)
        self.hangs_at = hangs_at
        self.released = threading.Event()

    def read(self, digest, payload_bytes):
        if digest == self.hangs_at:
            self.released.wait()
        return super().read(digest, payload_bytes)


def test_a_disk_that_stops_answering_turns_the_tier_off_and_every_load_is_reported(tmp_path, caplog):
    cache, reports = cache_arrays(), Reports()
    store = HungDisk(tmp_path, IDENTITY, 1 << 20, hangs_at=digest(1))
    tier = KVDiskTier(store, cache, reports, disk_timeout=0.5)
    tier.start()
    tier.save([(digest(i), i) for i in range(3)])
    wait_written(store, 3)
    tier.load(1, [digest(0), digest(1), digest(2)], [5, 6, 7])
    tier.load(2, [digest(0)], [4])  # queued behind the hung read
    deadline = time.monotonic() + 5
    while len(reports.results) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    first, second = reports.results
    assert (first.request_id, first.num_loaded) == (1, 1)  # the blocks read before the disk stopped
    assert (second.request_id, second.num_loaded) == (2, 0)  # ended at once, not after another timeout
    assert not tier.enabled and not tier.writable and tier.count_chain([digest(0)]) == 0
    assert caplog.text.count("has not answered") == 1
    before = [a[6].copy() for a in cache]
    store.released.set()  # the read returns at last: nothing is copied into blocks the engine took back
    time.sleep(0.2)
    assert all(a[6].tobytes() == b.tobytes() for a, b in zip(cache, before, strict=True))
    started = time.monotonic()
    tier.close(5)
    assert time.monotonic() - started < 1


def test_idle_blocks_expire_without_any_write(tmp_path):
    """The TTL is a privacy promise: an idle server's I/O thread removes expired blocks on its own."""
    cache = cache_arrays()
    tier = KVDiskTier(DiskStore(tmp_path, IDENTITY, 1 << 20, ttl_seconds=0.3), cache, Reports())
    tier.start()
    tier.save([(digest(0), 0)])
    wait_written(tier.store, 1)
    deadline = time.monotonic() + 10
    while list(tmp_path.rglob("*.kvb")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list(tmp_path.rglob("*.kvb")) and tier.store.num_blocks == 0
    tier.close(5)


def test_blocks_expire_while_the_tier_is_busy(tmp_path):
    """The sweep ran only when the I/O thread waited a tenth of the TTL with nothing to do: loads every few
    milliseconds kept expired blocks (users' text) on disk for good."""
    cache, reports = cache_arrays(), Reports()
    tier = KVDiskTier(DiskStore(tmp_path, IDENTITY, 1 << 20, ttl_seconds=0.3), cache, reports)
    tier.start()
    tier.save([(digest(0), 0)])
    wait_written(tier.store, 1)
    deadline = time.monotonic() + 10
    while list(tmp_path.rglob("*.kvb")) and time.monotonic() < deadline:
        tier.load(1, [digest(9)], [3])  # a block never stored: reported at once, the thread busy all the while
        reports.wait()
        time.sleep(0.005)
    assert not list(tmp_path.rglob("*.kvb"))
    tier.close(5)


def test_folders_of_other_engines_are_removed_once_abandoned(tmp_path):
    other, recent = hashlib.sha256(b"old model").digest(), hashlib.sha256(b"other live model").digest()
    old_store, live_store = opened(tmp_path, identity=other), opened(tmp_path, identity=recent)
    for store in (old_store, live_store):
        store.write(digest(1), b"x" * 100)
    long_ago = time.time() - ABANDONED_AFTER_SECONDS - 60
    for f in [*old_store.folder.iterdir(), old_store.folder]:
        os.utime(f, (long_ago, long_ago))
    (tmp_path / "notes").mkdir()  # not an identity folder: never touched
    opened(tmp_path)
    assert not old_store.folder.exists()
    assert (live_store.folder / (digest(1).hex() + ".kvb")).exists() and (tmp_path / "notes").exists()
