"""A step's logits rows to each sampled request's tokens: one sampled row, or a verify chunk's run."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.core.outputs import TokenLogprob
from service.core.sampler import sample, verify
from service.core.scheduler import ScheduledChunk

Runs = tuple[list[list[int]], list[list[TokenLogprob | None]], dict[int, Exception]]


def sample_step(logits: np.ndarray, sampled: Sequence[ScheduledChunk], masks: Sequence[np.ndarray | None]) -> Runs:
    """Each sampled chunk's tokens and logprobs from its logits rows (masks[i]: its grammar's, or None), and the
    chunks whose sampling raised, by index: a failure is that request's alone."""
    ends = np.cumsum([c.num_logits for c in sampled], dtype=np.int64)
    plain = [i for i, c in enumerate(sampled) if not c.drafts]
    plain_masks = [masks[i] for i in plain] if any(m is not None for m in masks) else []
    result = sample(logits[ends[plain] - 1], [sampled[i].request for i in plain], plain_masks)
    runs: list[list[int]] = [[] for _ in sampled]
    logprobs: list[list[TokenLogprob | None]] = [[] for _ in sampled]
    failed: dict[int, Exception] = {}
    for i, token_id, logprob, error in zip(plain, result.token_ids, result.logprobs, result.errors, strict=True):
        if error is not None:
            failed[i] = error
        runs[i], logprobs[i] = [token_id], [logprob]
    for i, chunk in enumerate(sampled):
        if chunk.drafts:  # the k+1 rows of a verify chunk
            rows = logits[ends[i] - chunk.num_logits : ends[i]]
            try:
                run = verify(rows, chunk.request, chunk.drafts, masks[i])
            except Exception as exc:
                failed[i] = exc
                continue
            runs[i], logprobs[i] = run.token_ids, run.logprobs
    return runs, logprobs, failed
