"""The grammars' token masks for a step, computed on a thread of their own while the model runs (both release the
GIL). A mask depends only on the tokens accepted so far; the engine thread hands the matchers over before the
model step and takes them back with the result, and is their only user otherwise."""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from service.core.scheduler import ScheduledChunk

MASK_TIMES_KEPT = 10_000


class MaskThread:
    def __init__(self) -> None:
        # seconds spent computing masks, per step that had any: benchmarks read their distribution
        self.seconds: deque[float] = deque(maxlen=MASK_TIMES_KEPT)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    def start(self, chunks: list[ScheduledChunk]) -> Future[dict[int, np.ndarray]] | None:
        """Start computing the masks of the chunks that have a grammar, by request id; None when none has."""
        constrained = [c for c in chunks if c.request.matcher is not None]
        return self._pool.submit(self._masks, constrained) if constrained else None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)

    def _masks(self, chunks: list[ScheduledChunk]) -> dict[int, np.ndarray]:
        """On the grammar thread: each constrained chunk's masks, by request id."""
        start = time.perf_counter()
        masks = {}
        for c in chunks:
            assert c.request.matcher is not None
            masks[c.request.id] = c.request.matcher.masks(c.drafts)
        self.seconds.append(time.perf_counter() - start)
        return masks
