"""The remote tier without a model: keys, the integrity check of values, and the tier's publishing and fetching
over plain arrays standing in for the KV cache tensors, against a real redis-server that the tests stop, refill
with hostile values, lock with a password and fill up."""

import contextlib
import hashlib
import logging
import socket
import threading
import time

import numpy as np
import pytest

from service.core.config import EngineConfig
from service.engine.disk_store import DiskStore, block_header
from service.engine.kv_tier import KVDiskTier
from service.engine.kv_tiers import KVTiers
from service.engine.remote_store import RemoteStore, redacted
from service.engine.remote_tier import BATCH_BLOCKS, KVRemoteTier
from tests.support.disk import Reports
from tests.support.redis_server import RedisServer

IDENTITY = hashlib.sha256(b"engine").digest()
OTHER = hashlib.sha256(b"another model").digest()


def digest(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=32).digest()


def cache_arrays(num_blocks: int = 24, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, 255, (num_blocks, 2, 5, 4), dtype=np.uint8),
        rng.standard_normal((num_blocks, 2, 4, 4)).astype(np.float16),
    ]


def payload_bytes(cache) -> int:
    return sum(a[0].nbytes for a in cache)


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path)
    yield s
    s.stop()


def store_for(server: RedisServer, cache, identity: bytes = IDENTITY, **kw) -> RemoteStore:
    return RemoteStore(server.url, identity, payload_bytes(cache), timeout=0.5, **kw)


def started(store: RemoteStore, cache) -> KVRemoteTier:
    tier = KVRemoteTier(store, cache)
    tier.start()
    wait_for(lambda: store.up)
    return tier


def wait_for(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


def fetch_into(tier: KVRemoteTier, digests, block_ids) -> int:
    reports = Reports()
    tier.load(1, digests, block_ids, reports)
    return reports.wait().num_loaded


# -- without a store ----------------------------------------------------------------------------------------
def test_the_address_in_logs_never_holds_a_password():
    assert redacted("redis://user:s3cret@cache.internal:6380/2") == "redis://cache.internal:6380/2"
    assert redacted("rediss://:s3cret@cache") == "rediss://cache"
    config = EngineConfig(kv_remote_url="redis://:s3cret@cache:6379/0")
    assert "s3cret" not in repr(config) and not config.problems()


def test_keys_have_one_prefix_per_engine_identity_and_the_digest():
    cache = cache_arrays()
    ours = RemoteStore("redis://127.0.0.1:1/0", IDENTITY, payload_bytes(cache))
    theirs = RemoteStore("redis://127.0.0.1:1/0", OTHER, payload_bytes(cache))
    key = ours.key(digest(0))
    assert key == b"ovkv:" + IDENTITY.hex()[:32].encode() + b":" + digest(0).hex().encode()
    assert theirs.key(digest(0)) != key


@pytest.mark.parametrize(
    ("url", "problem"),
    [("http://cache:6379", "kv_remote_url must start with"), ("redis://cache", None), ("unix:///run/r.sock", None)],
)
def test_the_url_scheme_is_checked(url, problem):
    problems = EngineConfig(kv_remote_url=url).problems()
    assert (problem in problems[0]) if problem else not problems


def test_a_store_that_is_not_there_is_down_at_once_with_one_warning(caplog):
    cache = cache_arrays()
    store = RemoteStore("redis://127.0.0.1:1/0", IDENTITY, payload_bytes(cache), timeout=0.2)
    tier = KVRemoteTier(store, cache)
    with caplog.at_level(logging.WARNING):
        tier.start()
        wait_for(lambda: store.counters.num_errors >= 1)
    assert not store.up and tier.count_chain([digest(0)]) == 0
    tier.save([(digest(0), 0)])
    assert tier.counters.num_skipped == 1  # never queued for a store that does not answer
    start = time.monotonic()
    assert fetch_into(tier, [digest(0)], [0]) == 0 and time.monotonic() - start < 1
    tier.close(1)
    assert caplog.text.count("does not answer") == 1


def test_an_endpoint_that_speaks_something_else_is_a_store_that_is_down(caplog):
    """Every command answered `+OK` (not what the client's handshake expects: it fails outside its own errors).
    Before, that killed the publisher thread, the only one that pings the store, so the tier never came back."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def answer_ok() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:  # the listener was closed: the test is over
                return
            with conn:
                conn.settimeout(0.5)
                with contextlib.suppress(OSError):
                    while conn.recv(65536):
                        conn.sendall(b"+OK\r\n")

    threading.Thread(target=answer_ok, daemon=True).start()
    cache = cache_arrays()
    url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    store = RemoteStore(url, IDENTITY, payload_bytes(cache), timeout=0.2)
    tier = KVRemoteTier(store, cache)
    try:
        with caplog.at_level(logging.WARNING):
            tier.start()
            wait_for(lambda: store.counters.num_errors >= 1)
        assert not store.up and "does not answer" in caplog.text
        wait_for(lambda: store.counters.num_errors >= 2)  # pinged again after its backoff: the tier lives on
    finally:
        tier.close(1)
        stop.set()
        listener.close()


class SlowStore:
    """A store that answers, a batch every `seconds`, with every block present (zeros): what a slow store's
    fetches look like to the tier."""

    up = True

    def __init__(self, cache, seconds: float) -> None:
        self.payload, self.seconds = memoryview(bytes(payload_bytes(cache))), seconds

    def check(self) -> bool:
        return True

    def fetch(self, digests) -> list[memoryview]:
        time.sleep(self.seconds)
        return [self.payload] * len(digests)

    def close(self) -> None:
        pass


def test_a_fetch_ends_by_its_deadline_from_when_it_was_asked_for_not_from_its_turn():
    cache = cache_arrays(num_blocks=64)
    tier = KVRemoteTier(SlowStore(cache, 0.2), cache, load_deadline=0.5)  # type: ignore[arg-type]
    tier.start()
    first, second = Reports(), Reports()
    tier.load(1, [digest(i) for i in range(48)], list(range(48)), first)  # 6 round trips: cut at 0.5 s
    tier.load(2, [digest(i) for i in range(48, 56)], list(range(48, 56)), second)
    assert 0 < first.wait().num_loaded < 48
    assert second.wait().num_loaded == 0  # its 0.5 s had passed while it waited: the request computes instead
    tier.load(3, [digest(i) for i in range(8)], list(range(8)), third := Reports(), deadline=time.monotonic())
    assert third.wait().num_loaded == 0  # the request's own deadline, sooner than load_deadline
    tier.close(1)


def test_an_aborted_requests_fetch_ends_before_its_next_round_trip():
    cache = cache_arrays(num_blocks=64)
    tier = KVRemoteTier(SlowStore(cache, 0.2), cache, load_deadline=30)  # type: ignore[arg-type]
    tier.start()
    reports, ended = Reports(), threading.Event()
    tier.load(1, [digest(i) for i in range(48)], list(range(48)), reports, ended=ended)
    time.sleep(0.1)
    ended.set()  # what KVTiers.cancel does
    assert reports.wait().num_loaded <= 2 * BATCH_BLOCKS  # not all six round trips
    tier.load(1, [digest(i) for i in range(8)], list(range(8)), again := Reports(), ended=threading.Event())
    assert again.wait().num_loaded == 8  # the same request id's next load is its own
    tier.close(1)


def test_a_fetch_is_reported_even_when_keeping_its_blocks_on_disk_fails(tmp_path, caplog):
    """Else the fetcher thread would die: no later load reported, their blocks and places held for good."""
    cache = cache_arrays(num_blocks=64)
    reports = Reports()
    disk = KVDiskTier(DiskStore(tmp_path / "disk", IDENTITY, 1 << 20), cache, reports)

    def broken_save(blocks) -> None:
        raise MemoryError("no room to copy the blocks")

    disk.save = broken_save  # type: ignore[method-assign]
    remote = KVRemoteTier(SlowStore(cache, 0.0), cache)  # type: ignore[arg-type]
    remote.start()
    tiers = KVTiers(disk, remote, reports)
    for request_id in (1, 2):  # the second load is reported too: the thread lives on
        tiers.load(request_id, [digest(i) for i in range(4)], list(range(4)))
        assert reports.wait().num_loaded == 4
    assert "keeping fetched blocks on disk failed" in caplog.text
    tiers.close(5)


class SlowDisk(DiskStore):
    """A disk that answers each read after `seconds` (within the tier's timeout: the tier stays on)."""

    seconds = 0.1

    def read(self, digest: bytes, payload_bytes: int):
        time.sleep(self.seconds)
        return super().read(digest, payload_bytes)


def test_a_restore_and_the_fetch_after_it_end_when_their_request_ends(tmp_path):
    cache = cache_arrays(num_blocks=64)
    reports = Reports()
    disk = KVDiskTier(SlowDisk(tmp_path / "disk", IDENTITY, 1 << 20), cache, reports)
    disk.start()
    disk.save([(digest(i), i) for i in range(20)])
    wait_for(lambda: disk.store.counters.num_written == 20)
    remote = KVRemoteTier(SlowStore(cache, 0.0), cache)  # type: ignore[arg-type]
    remote.start()
    tiers = KVTiers(disk, remote, reports)
    tiers.load(1, [digest(i) for i in range(28)], list(range(28)))  # 20 on disk, 8 more tried remotely
    time.sleep(0.25)
    tiers.cancel(1)
    result = reports.wait()
    assert result.num_loaded < 20 and result.num_remote == 0  # the restore stopped; no fetch was asked for
    tiers.load(2, [digest(i) for i in range(28)], list(range(28)), deadline=time.monotonic())
    assert reports.wait().num_loaded == 0  # its request's deadline had passed
    tiers.cancel(2)  # after the load ended: nothing to stop
    tiers.load(3, [digest(i) for i in range(4)], list(range(4)))
    assert reports.wait().num_loaded == 4
    tiers.close(5)


# -- against redis-server ------------------------------------------------------------------------------------
def test_published_blocks_come_back_byte_for_byte_in_another_tier(server):
    cache = cache_arrays()
    publisher = started(store_for(server, cache), cache)
    publisher.save([(digest(i), i) for i in range(12)])
    wait_for(lambda: publisher.store.counters.num_published == 12)
    assert len(server.keys()) == 12
    other = cache_arrays(seed=1)  # another replica's cache
    fetcher = started(store_for(server, other), other)
    assert fetch_into(fetcher, [digest(i) for i in range(12)], list(range(12, 24))) == 12  # two batches
    assert all(a[:12].tobytes() == b[12:24].tobytes() for a, b in zip(cache, other, strict=True))
    assert fetcher.store.counters.num_fetched == 12 and fetcher.counters.num_fetches == 1
    publisher.save([(digest(i), i) for i in range(12)])  # known as stored: not sent again
    publisher.close(5)
    fetcher.close(5)
    assert publisher.store.counters.num_published == 12


def test_a_fetch_stops_at_the_first_missing_block(server):
    cache = cache_arrays()
    tier = started(store_for(server, cache), cache)
    tier.save([(digest(i), i) for i in (0, 1, 3)])
    wait_for(lambda: tier.store.counters.num_published == 3)
    assert fetch_into(tier, [digest(i) for i in range(4)], [10, 11, 12, 13]) == 2
    assert tier.store.counters.num_missed == 1
    tier.close(5)


def hostile_values(server: RedisServer, store: RemoteStore, cache):
    """Under the keys of blocks 0..5, what a broken or hostile store could hold."""
    good = b"".join(a[0].tobytes() for a in cache)
    valid = block_header(IDENTITY, digest(0), good) + good
    client = server.client()
    flipped = bytearray(valid)
    flipped[-1] ^= 1
    client.set(store.key(digest(0)), bytes(flipped))  # checksum
    client.set(store.key(digest(1)), valid[:-10])  # truncated
    client.set(store.key(digest(2)), valid + b"\0" * (1 << 20))  # longer: only one byte more is read
    client.set(store.key(digest(3)), valid)  # another block's value (its digest)
    foreign = block_header(OTHER, digest(4), good) + good
    client.set(store.key(digest(4)), foreign)  # another engine's identity
    client.hset(store.key(digest(5)), "a", "b")  # a key of another type


@pytest.mark.parametrize("index", range(6), ids=["checksum", "truncated", "longer", "swapped", "foreign", "hash"])
def test_hostile_values_are_counted_deleted_and_never_loaded(server, caplog, index):
    cache = cache_arrays()
    store = store_for(server, cache)
    tier = started(store, cache)
    hostile_values(server, store, cache)
    before = [a.copy() for a in cache]
    with caplog.at_level(logging.WARNING):
        assert fetch_into(tier, [digest(index)], [7]) == 0
    assert all(a.tobytes() == b.tobytes() for a, b in zip(cache, before, strict=True))  # untouched
    assert store.counters.num_corrupt == 1 and store.counters.num_fetched == 0
    assert not server.client().exists(store.key(digest(index)))  # deleted: a good copy can take its place
    assert caplog.text.count("kv remote tier: the value of") == 1
    assert store.up  # the store is not at fault: it stays in use
    tier.close(5)


def test_corrupt_values_warn_once_in_all(server, caplog):
    cache = cache_arrays()
    store = store_for(server, cache)
    tier = started(store, cache)
    hostile_values(server, store, cache)
    with caplog.at_level(logging.WARNING):
        for i in range(6):
            fetch_into(tier, [digest(i)], [7])
    assert store.counters.num_corrupt == 6 and caplog.text.count("kv remote tier: the value of") == 1
    tier.close(5)


def test_a_store_that_goes_away_and_comes_back(server, caplog):
    cache = cache_arrays()
    store = store_for(server, cache)
    tier = started(store, cache)
    tier.save([(digest(0), 0)])
    wait_for(lambda: store.counters.num_published == 1)
    server.stop()
    with caplog.at_level(logging.WARNING):
        start = time.monotonic()
        assert fetch_into(tier, [digest(0)], [5]) == 0  # the failure is found out, quickly
        assert time.monotonic() - start < 2
        assert not store.up and tier.count_chain([digest(0)]) == 0
        assert fetch_into(tier, [digest(0)], [5]) == 0  # not asked again while down
    assert store.counters.num_outages == 1 and caplog.text.count("does not answer") == 1
    server.start()  # empty: a restarted store has lost its keys
    wait_for(lambda: store.up)  # the publisher's ping, after its backoff
    tier.save([(digest(1), 1)])
    wait_for(lambda: store.counters.num_published == 2)
    assert fetch_into(tier, [digest(1)], [5]) == 1
    tier.close(5)


def test_a_store_that_hangs_costs_a_timeout_once_then_nothing(server, caplog):
    cache = cache_arrays()
    store = store_for(server, cache)
    tier = started(store, cache)
    tier.save([(digest(0), 0)])
    wait_for(lambda: store.counters.num_published == 1)
    server.pause()
    try:
        with caplog.at_level(logging.WARNING):
            start = time.monotonic()
            assert fetch_into(tier, [digest(0)], [5]) == 0
            assert time.monotonic() - start < 2  # the 0.5 s timeout, not a hang
            assert not store.up and tier.count_chain([digest(0)]) == 0
            tier.save([(digest(1), 1)])  # skipped: nothing queues up for a store that hangs
        assert tier.counters.num_skipped == 1 and caplog.text.count("does not answer") == 1
    finally:
        server.resume()
    wait_for(lambda: store.up)
    assert fetch_into(tier, [digest(0)], [5]) == 1
    tier.close(5)


def test_a_wrong_password_is_a_clear_warning_and_the_right_one_works(tmp_path, caplog):
    server = RedisServer(tmp_path, password="right horse battery")
    try:
        cache = cache_arrays()
        with caplog.at_level(logging.WARNING):
            wrong = KVRemoteTier(store_for(server, cache, password="xyzzy-guess"), cache)
            wrong.start()
            wait_for(lambda: wrong.store.counters.num_errors >= 1)
        assert not wrong.up and "refused the credentials" in caplog.text and "xyzzy" not in caplog.text
        wrong.close(1)
        right = started(store_for(server, cache, password="right horse battery"), cache)
        right.save([(digest(0), 0)])
        wait_for(lambda: right.store.counters.num_published == 1)
        right.close(5)
        assert "right horse" not in caplog.text
    finally:
        server.stop()


def test_tls_to_the_store_with_its_ca_and_a_clear_warning_without(tmp_path, caplog):
    from tests.support.servers import self_signed_cert

    key, cert = self_signed_cert(tmp_path)
    server = RedisServer(tmp_path, tls=(key, cert))
    try:
        cache = cache_arrays()
        with caplog.at_level(logging.WARNING):
            unverified = KVRemoteTier(store_for(server, cache), cache)  # the system's CAs do not know it
            unverified.start()
            wait_for(lambda: unverified.store.counters.num_errors >= 1)
        assert not unverified.up and "does not answer" in caplog.text and "certificate" in caplog.text
        unverified.close(1)
        tier = started(store_for(server, cache, ca_cert=str(cert)), cache)
        tier.save([(digest(0), 0)])
        wait_for(lambda: tier.store.counters.num_published == 1)
        assert fetch_into(tier, [digest(0)], [5]) == 1
        tier.close(5)
    finally:
        server.stop()


def test_a_full_store_evicts_by_its_own_policy(tmp_path):
    server = RedisServer(tmp_path, maxmemory="2mb")
    try:
        cache = [np.zeros((24, 64, 1024), dtype=np.uint8)]  # 64 KiB blocks: 2 MiB hold about 25
        tier = started(store_for(server, cache), cache)
        for start in range(0, 96, 24):
            tier.save([(digest(start + i), i) for i in range(24)])
            wait_for(lambda start=start: tier.pending_bytes == 0)
        assert tier.store.counters.num_published == 96 and tier.store.counters.num_errors == 0
        assert len(server.keys()) < 40  # allkeys-lru made room
        tier.close(5)
    finally:
        server.stop()


def test_a_store_that_refuses_writes_is_one_warning_and_fetches_go_on(tmp_path, caplog):
    server = RedisServer(tmp_path, maxmemory="2mb", policy="noeviction")  # full: it refuses instead of evicting
    try:
        cache = [np.zeros((24, 64, 1024), dtype=np.uint8)]
        tier = started(store_for(server, cache), cache)
        with caplog.at_level(logging.WARNING):
            for start in range(0, 96, 24):
                tier.save([(digest(start + i), i) for i in range(24)])
                wait_for(lambda: tier.pending_bytes == 0)
        stored = tier.store.counters.num_published
        assert 0 < stored < 96 and tier.counters.num_skipped > 0
        assert caplog.text.count("refuses writes") == 1 and tier.up
        assert fetch_into(tier, [digest(0), digest(1)], [0, 1]) == 2  # what it holds is still fetched
        tier.close(5)
    finally:
        server.stop()


def test_a_ttl_expires_unused_blocks(server):
    cache = cache_arrays()
    store = store_for(server, cache, ttl_seconds=60)
    tier = started(store, cache)
    tier.save([(digest(0), 0)])
    wait_for(lambda: store.counters.num_published == 1)
    assert 0 < server.client().pttl(store.key(digest(0))) <= 60_000
    tier.close(5)


def test_publishing_that_falls_behind_skips_blocks(server):
    cache = cache_arrays()
    tier = KVRemoteTier(store_for(server, cache), cache, max_pending_bytes=2 * payload_bytes(cache))
    tier.store.up = True  # as if connected, before the publisher thread runs: nothing is sent yet
    tier.save([(digest(i), i) for i in range(3)])  # one more than may wait: the chain's tail is skipped
    assert tier.counters.num_skipped == 1 and tier.pending_bytes == 2 * payload_bytes(cache)
    tier.start()
    wait_for(lambda: tier.store.counters.num_published == 2)
    tier.close(5)


def test_a_chain_continues_from_disk_into_the_store_and_lands_on_disk(server, tmp_path):
    cache = cache_arrays()
    publisher = started(store_for(server, cache), cache)
    publisher.save([(digest(i), i) for i in range(BATCH_BLOCKS + 2)])
    wait_for(lambda: publisher.store.counters.num_published == BATCH_BLOCKS + 2)
    other = cache_arrays(seed=1)
    reports = Reports()
    disk = KVDiskTier(DiskStore(tmp_path / "disk", IDENTITY, 1 << 20), other, reports)
    remote = started(store_for(server, other), other)
    tiers = KVTiers(disk, remote, reports)
    disk.start()
    n = BATCH_BLOCKS + 2
    disk.save([(digest(0), 0)])  # the chain's head on this replica's disk (its content as computed here)
    wait_for(lambda: disk.store.counters.num_written == 1)
    tiers.load(1, [digest(i) for i in range(n)], list(range(12, 12 + n)))
    result = reports.wait()
    assert (result.num_loaded, result.num_remote) == (n, n - 1)
    assert all(a[13 : 12 + n].tobytes() == b[1:n].tobytes() for a, b in zip(other, cache, strict=True))
    wait_for(lambda: disk.store.counters.num_written == n)  # what came from the store is on disk now
    tiers.close(5)
    publisher.close(5)


def test_the_http_usage_names_the_fetched_prompt_tokens():
    from service.core.outputs import Usage
    from service.http.openai_out import usage

    details = usage(Usage(400, 16, 384, 32, remote_prompt_tokens=320))["prompt_tokens_details"]
    assert details == {"cached_tokens": 384, "disk_tokens": 32, "remote_tokens": 320, "shared_tokens": 0}
