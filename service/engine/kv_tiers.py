"""The prefix cache's tiers below RAM as one: local disk first, then the fleet's remote store.

This is what the scheduler asks (how much of a chain the disk holds, how much to try remotely) and what the
engine hands filled blocks and planned loads to. A load restores the chain's head from disk on the disk tier's
thread and continues, from the first block the disk could not give, on the remote tier's fetcher thread; blocks
fetched remotely are also queued for the local disk before the load is reported, while their request is still
loading and no step can touch them. The engine hears of a load once, with how many blocks came from where.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from service.engine.kv_tier import KVDiskTier, LoadResult
from service.engine.remote_tier import KVRemoteTier


class KVTiers:
    def __init__(
        self, disk: KVDiskTier | None, remote: KVRemoteTier | None, report: Callable[[LoadResult], None]
    ) -> None:
        self.disk = disk
        self.remote = remote
        self.report = report

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

    def load(self, request_id: int, digests: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """Restore digests into block_ids from disk, then from the remote tier; report is called once."""
        start = time.perf_counter()
        on_disk = self.count_chain(digests)
        if self.disk is not None and on_disk:

            def restored(result: LoadResult) -> None:
                self._continue(request_id, digests, block_ids, result.num_loaded, start)

            self.disk.load(request_id, digests[:on_disk], block_ids[:on_disk], restored)
        else:
            self._continue(request_id, digests, block_ids, 0, start)

    # -- the tiers' threads --------------------------------------------------------------------------------
    def _continue(
        self, request_id: int, digests: Sequence[bytes], block_ids: Sequence[int], num_restored: int, start: float
    ) -> None:
        """num_restored blocks came from disk: fetch the rest remotely, if there is a remote tier and a rest."""
        if self.remote is None or num_restored == len(digests):
            self.report(LoadResult(request_id, num_restored, time.perf_counter() - start))
            return

        def fetched(result: LoadResult) -> None:
            got = slice(num_restored, num_restored + result.num_loaded)
            if self.disk is not None and result.num_loaded:
                self.disk.save(list(zip(digests[got], block_ids[got], strict=True)))
            total = num_restored + result.num_loaded
            self.report(LoadResult(request_id, total, time.perf_counter() - start, num_remote=result.num_loaded))

        self.remote.load(request_id, digests[num_restored:], block_ids[num_restored:], fetched)
