"""Turns one logits row per sampled request into a token, vectorized over the batch where it pays.

Greedy rows take an argmax over the whole batch at once. Penalties and the min_new_tokens mask touch
only the rows that ask for them. Random rows draw from each request's own generator, so a seeded
request gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from service.core.outputs import TokenLogprob
from service.core.request import Request


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def sample(logits: np.ndarray, requests: Sequence[Request]) -> SampleResult:
    """logits: [len(requests), vocab] float32, modified in place."""
    logits = logits.astype(np.float32, copy=False)
    for row, request in enumerate(requests):
        _apply_penalties(logits[row], request)
    token_ids = np.argmax(logits, axis=-1)
    for row, request in enumerate(requests):
        if not request.params.greedy:
            token_ids[row] = _sample_row(logits[row], request)
    chosen = [int(t) for t in token_ids]
    logprobs = [
        _logprobs(logits[row], chosen[row], r.params.logprobs) if r.params.logprobs else None
        for row, r in enumerate(requests)
    ]
    return SampleResult(chosen, logprobs)


def _apply_penalties(row: np.ndarray, request: Request) -> None:
    p = request.params
    if request.num_output_tokens < p.min_new_tokens:
        banned = [t for t in (*p.eos_token_ids, *p.stop_token_ids) if t < row.shape[0]]
        row[banned] = -np.inf
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(request.all_token_ids, dtype=np.int64))
        vals = row[seen]
        row[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and request.output_token_ids:
        ids, counts = np.unique(np.asarray(request.output_token_ids, dtype=np.int64), return_counts=True)
        row[ids] -= p.presence_penalty + p.frequency_penalty * counts


def _sample_row(row: np.ndarray, request: Request) -> int:
    p = request.params
    scaled = row / p.temperature
    if p.top_k and p.top_k < scaled.shape[0]:
        candidates = np.argpartition(scaled, -p.top_k)[-p.top_k :]
    else:
        candidates = np.arange(scaled.shape[0])
    # Candidates in descending order of probability.
    candidates = candidates[np.argsort(-scaled[candidates], kind="stable")]
    values = scaled[candidates]
    probs = np.exp(values - values[0])
    probs /= probs.sum()
    keep = len(probs)
    if p.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
    if p.min_p > 0.0:
        keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0]))))
    probs = probs[:keep] / probs[:keep].sum()
    assert request.rng is not None
    return int(candidates[request.rng.choice(keep, p=probs)])


def _logprobs(row: np.ndarray, chosen: int, top_n: int) -> TokenLogprob:
    finite = np.where(np.isfinite(row), row, -np.inf)
    shifted = finite - finite.max()
    log_z = np.log(np.exp(shifted).sum())
    top = np.argpartition(-shifted, top_n)[:top_n]
    top = top[np.argsort(-shifted[top])]
    return TokenLogprob(
        token_id=chosen,
        logprob=float(shifted[chosen] - log_z),
        top=tuple((int(t), float(shifted[t] - log_z)) for t in top),
    )
