"""The remote tier of the prefix cache: blocks published to the fleet's store as they fill, fetched by any replica.

Publishing: every block that fills is copied out of the KV cache on the engine thread (a memcpy between steps,
as for the disk tier) and queued; the publisher thread sends them in pipelined batches. When publishing falls
behind (more than max_pending_bytes queued) or the store is down, the blocks that do not fit are skipped and
counted: a step never waits for the store. Blocks this replica published or fetched recently are not sent again.

Fetching: a request's chain continues past RAM and local disk into the store without asking first whether the
blocks are there: the fetch itself finds out, in pipelined batches of BATCH_BLOCKS from the chain's head,
stopping at the first block absent or refused. It runs on the fetcher thread, straight into the pool blocks the
scheduler set aside for the request, which waits in the loading state while every other request keeps stepping.
Fetches run one at a time, each ending by its deadline: load_deadline seconds after it was asked for (not after
the fetches before it), or the request's own deadline if sooner, checked between round trips; and as soon as its
request is aborted or expires (`ended`, set by KVTiers.cancel). A store that is down is not asked at all
(count_chain is 0), and the publisher pings it again after a backoff.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from service.engine.kv_tier import BlockCopies, LoadResult, put_block
from service.engine.remote_store import FIRST_BACKOFF_SECONDS, RemoteStore

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_BYTES = 256 << 20
BATCH_BLOCKS = 8  # blocks per pipelined round trip: a chain that breaks early costs at most this many transfers
KNOWN_DIGESTS = 1 << 16  # digests remembered as stored in the remote tier, so that they are not sent again
DEFAULT_LOAD_DEADLINE_SECONDS = 10.0

Report = Callable[[LoadResult], None]


@dataclass(frozen=True)
class _Fetch:
    request_id: int
    digests: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    report: Report
    deadline: float  # time.monotonic() by which the fetch ends
    ended: threading.Event | None  # set when its request ends: the fetch stops before its next round trip


@dataclass
class RemoteTierCounters:
    num_skipped: int = 0  # full blocks not published: publishing had fallen behind, or the store was down
    num_fetches: int = 0  # loads that asked the store
    num_fetched_blocks: int = 0
    fetch_seconds_total: float = 0.0


class KVRemoteTier:
    def __init__(
        self,
        store: RemoteStore,
        cache: Sequence[np.ndarray],
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        load_deadline: float = DEFAULT_LOAD_DEADLINE_SECONDS,
    ) -> None:
        """cache: the KV cache tensors as arrays of [num_blocks, ...], in a fixed order."""
        self.store = store
        self.cache = list(cache)
        self.block_bytes = sum(a[0].nbytes for a in self.cache)
        self.max_pending_bytes = max_pending_bytes
        self.load_deadline = load_deadline
        self.counters = RemoteTierCounters()
        self._known: OrderedDict[bytes, None] = OrderedDict()  # least recently seen first
        self._fetches: deque[_Fetch] = deque()
        self._publishes: deque[BlockCopies] = deque()
        self._pending_bytes = 0
        self._lock = threading.Condition()
        self._closing = False
        self._fetcher = threading.Thread(target=self._fetch_loop, name="kv-remote-fetch", daemon=True)
        self._publisher = threading.Thread(target=self._publish_loop, name="kv-remote-publish", daemon=True)

    def start(self) -> None:
        """Start the threads; the publisher connects (a store that does not answer leaves the tier waiting for it,
        with one warning: the server starts and serves without it)."""
        self._fetcher.start()
        self._publisher.start()

    def close(self, timeout: float) -> None:
        """Publish what is queued (for at most timeout seconds while the store answers), then end the threads."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        deadline = time.monotonic() + timeout
        for thread in (self._fetcher, self._publisher):
            if thread.is_alive():
                thread.join(max(deadline - time.monotonic(), 0.0))
        self.store.close()

    @property
    def up(self) -> bool:
        return self.store.up

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    # -- engine thread -------------------------------------------------------------------------------------
    def count_chain(self, digests: Sequence[bytes]) -> int:
        """How many of digests to try fetching: all of them while the store answers (the fetch finds out)."""
        return len(digests) if self.store.up else 0

    def save(self, blocks: Sequence[tuple[bytes, int]]) -> None:
        """Queue newly filled blocks (digest, block id), in chain order, for publishing; their content is copied
        now. What does not fit under max_pending_bytes, or meets a store that is down, is skipped and counted."""
        with self._lock:
            new = [(d, b) for d, b in blocks if d not in self._known]
            room = max(0, (self.max_pending_bytes - self._pending_bytes) // self.block_bytes)
            if not self.store.up:
                room = 0
            self.counters.num_skipped += max(0, len(new) - room)
        new = new[:room]
        if not new:
            return
        publish = BlockCopies.of(self.cache, new)
        with self._lock:
            self._publishes.append(publish)
            self._pending_bytes += publish.num_bytes
            self._lock.notify_all()

    def load(
        self,
        request_id: int,
        digests: Sequence[bytes],
        block_ids: Sequence[int],
        report: Report,
        deadline: float | None = None,
        ended: threading.Event | None = None,
    ) -> None:
        """Fetch digests into block_ids, in order, stopping at the first block absent or refused, at the fetch's
        deadline (load_deadline from now, or `deadline`, the request's, if sooner) or once `ended` is set; report
        is called (on the fetcher thread) with how many were."""
        ends = time.monotonic() + self.load_deadline
        ends = ends if deadline is None else min(ends, deadline)
        with self._lock:
            self._fetches.append(_Fetch(request_id, tuple(digests), tuple(block_ids), report, ends, ended))
            self._lock.notify_all()

    # -- fetcher thread ------------------------------------------------------------------------------------
    def _fetch_loop(self) -> None:
        while True:
            with self._lock:
                while not (self._fetches or self._closing):
                    self._lock.wait()
                if not self._fetches:
                    return
                job = self._fetches.popleft()
            try:
                result = self._fetch(job)
            except Exception:  # a load must always be reported, or its blocks would never be freed
                log.exception("kv remote tier: fetching a prefix failed; it will be computed")
                result = LoadResult(job.request_id, 0, 0.0)
            job.report(result)

    def _fetch(self, job: _Fetch) -> LoadResult:
        start = time.perf_counter()
        num_loaded = 0
        while (
            num_loaded < len(job.digests)
            and self.store.up
            and not self._closing
            and time.monotonic() < job.deadline
            and not (job.ended is not None and job.ended.is_set())
        ):
            batch = job.digests[num_loaded : num_loaded + BATCH_BLOCKS]
            payloads = self.store.fetch(batch)
            for payload in payloads:
                put_block(self.cache, job.block_ids[num_loaded], payload)
                num_loaded += 1
            if len(payloads) < len(batch):
                break
        self._remember(job.digests[:num_loaded])
        seconds = time.perf_counter() - start
        with self._lock:
            self.counters.num_fetches += 1
            self.counters.num_fetched_blocks += num_loaded
            self.counters.fetch_seconds_total += seconds
        return LoadResult(job.request_id, num_loaded, seconds, num_remote=num_loaded)

    def _remember(self, digests: Sequence[bytes]) -> None:
        with self._lock:
            for digest in digests:
                self._known[digest] = None
                self._known.move_to_end(digest)
            while len(self._known) > KNOWN_DIGESTS:
                self._known.popitem(last=False)

    # -- publisher thread ----------------------------------------------------------------------------------
    def _publish_loop(self) -> None:
        """Publish what is queued while the store answers. Wakes up at least every FIRST_BACKOFF_SECONDS, so that
        a store found down (by either thread) is pinged again after its backoff; while it is down, what is queued
        is dropped (nothing waits for it)."""
        self.store.check()  # connect now: fetches are tried only once the store has answered
        while True:
            with self._lock:
                if not (self._publishes or self._closing):
                    self._lock.wait(FIRST_BACKOFF_SECONDS)
                if self._closing and (not self._publishes or not self.store.up):
                    return
                job = self._publishes.popleft() if self._publishes and self.store.up else None
            if job is None:
                if not self.store.check():
                    self._drop_queue()
                continue
            try:
                self._publish(job)
            except Exception:
                log.exception("kv remote tier: publishing blocks failed")
            with self._lock:
                self._pending_bytes -= job.num_bytes

    def _publish(self, job: BlockCopies) -> None:
        for first in range(0, len(job.digests), BATCH_BLOCKS):
            digests = job.digests[first : first + BATCH_BLOCKS]
            blocks = [(d, job.payload(first + i)) for i, d in enumerate(digests)]
            if not self.store.publish(blocks):
                with self._lock:
                    self.counters.num_skipped += len(job.digests) - first
                return
            self._remember(digests)

    def _drop_queue(self) -> None:
        with self._lock:
            dropped, self._publishes = self._publishes, deque()
            self._pending_bytes -= sum(p.num_bytes for p in dropped)
            self.counters.num_skipped += sum(len(p.digests) for p in dropped)
