"""Turns logits rows into tokens: one row per sampled request, vectorized over the batch where it pays,
or a verify step's rows for one request's draft tokens.

Greedy rows take an argmax over the whole batch at once. Penalties, logit biases and the min_new_tokens
mask touch only the rows that ask for them (a bias is added after the penalties, so that a repetition
penalty does not scale it; added to a grammar's -inf it stays -inf: it never lets a forbidden token through).
Random rows draw from each request's own generator, so a seeded request gives the same tokens whatever else
shares its batch. A request with a response format brings a bitmask of the tokens its grammar allows (one
per row): the others get -inf before anything else, in one vectorized pass over the rows that have one.

Verification (speculative decoding) samples each position of a draft run exactly as a normal step would
(penalties and masks as if the earlier drafts had been generated, one draw from the request's generator
per emitted token) and stops at the first token that differs from its draft. For a deterministic proposal
this is the speculative-sampling rule: draft x is kept with probability p(x), and on a rejection the token
is distributed as p without x, renormalized. It also spends the generator exactly as plain decoding does,
so a seeded reply does not depend on what was proposed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from service.core.grammar import allowed
from service.core.outputs import TokenLogprob
from service.core.params import SamplingParams
from service.core.request import Request
from service.core.spec import accept_greedy

# The logprob reported for a token that cannot be chosen (a grammar or min_new_tokens rules it out, or a
# penalty sent it below float32's range): JSON has no -inf, and OpenAI reports such tokens with this value.
LOGPROB_FLOOR = -9999.0
FLOAT32_MAX = float(np.finfo(np.float32).max)


class NonFiniteLogits(ArithmeticError):
    """The model computed NaN or +inf for a row: its argmax would be a meaningless token (NaN compares as the
    largest), its probabilities NaN. Its request fails; the other rows of the step stand."""

    def __init__(self) -> None:
        super().__init__("the model's logits for this position are not finite (NaN or inf)")


def _check_top(value: float) -> None:
    """value: the row's chosen logit (argmax picks a NaN or +inf first), or its largest."""
    if np.isnan(value) or value == np.inf:
        raise NonFiniteLogits()


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    # per request: why its row could not be sampled (then its token id means nothing), else None. A row that
    # fails is its own request's failure: the others' rows, and the draws of their generators, stand.
    errors: list[Exception | None] = field(default_factory=list)  # sample(): one per request; verify(): none


def sample(logits: np.ndarray, requests: Sequence[Request], masks: Sequence[np.ndarray | None] = ()) -> SampleResult:
    """logits: [len(requests), vocab] float32, modified in place. masks: per request, None or its grammar's
    bitmask of the next position ([1, words] int32); empty when no request has one."""
    logits = logits.astype(np.float32, copy=False)
    constrained = [row for row, m in enumerate(masks) if m is not None]
    if constrained:
        bits = allowed(np.concatenate([m for m in masks if m is not None]), logits.shape[-1])
        logits[constrained] = np.where(bits, logits[constrained], -np.inf)
    errors: list[Exception | None] = [None] * len(requests)
    for row, request in enumerate(requests):
        try:
            _adjust_logits(logits[row], request.params, request.output_token_ids, request.all_token_ids)
        except Exception as exc:
            errors[row] = exc
    for i, row in enumerate(constrained):
        _keep_one_allowed(logits[row], bits[i])
    token_ids = np.argmax(logits, axis=-1)
    tops = logits[np.arange(len(requests)), token_ids]
    logprobs: list[TokenLogprob | None] = [None] * len(requests)
    for row, request in enumerate(requests):
        if errors[row] is not None:
            continue
        try:
            _check_top(tops[row])
            if not request.params.greedy:
                token_ids[row] = _sample_row(logits[row], request)
            if request.params.logprobs:
                logprobs[row] = _logprobs(logits[row], int(token_ids[row]), request.params.logprobs)
        except Exception as exc:
            errors[row] = exc
    return SampleResult([int(t) for t in token_ids], logprobs, errors)


def verify(rows: np.ndarray, request: Request, drafts: Sequence[int], masks: np.ndarray | None = None) -> SampleResult:
    """rows: [len(drafts) + 1, vocab], row i the logits after the request's tokens and drafts[:i]; modified in
    place. masks: the grammar's bitmask for each row, if the request has one. Returns the emitted tokens (the
    drafts kept, then the first token that is not its draft, or a bonus token after the last draft) with
    their logprobs, as len(result) plain steps would have sampled them given those tokens."""
    rows = rows.astype(np.float32, copy=False)
    p = request.params
    bits = None
    if masks is not None:
        bits = allowed(masks, rows.shape[-1])
        rows[~bits] = -np.inf
    if bits is None and _argmax_only(request):  # no per-position state to track: one vectorized argmax
        picks = np.argmax(rows, axis=-1)
        tokens = accept_greedy(drafts, [int(t) for t in picks])
        for i in range(len(tokens)):
            _check_top(rows[i, picks[i]])
        return SampleResult(tokens, [None] * len(tokens))
    token_ids: list[int] = []
    logprobs: list[TokenLogprob | None] = []
    for i, row in enumerate(rows):
        earlier = list(drafts[:i])  # the tokens before this position are the kept drafts
        _adjust_logits(row, p, [*request.output_token_ids, *earlier], [*request.all_token_ids, *earlier])
        if bits is not None:
            _keep_one_allowed(row, bits[i])
        _check_top(row.max())
        token = int(np.argmax(row)) if p.greedy else _sample_row(row, request)
        token_ids.append(token)
        logprobs.append(_logprobs(row, token, p.logprobs) if p.logprobs else None)
        if i == len(drafts) or token != drafts[i]:
            break
    return SampleResult(token_ids, logprobs)


def _argmax_only(request: Request) -> bool:
    """Greedy with nothing that changes a row: no penalties, no logprobs, eos no longer masked."""
    p = request.params
    return (
        p.greedy
        and not p.logprobs
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
        and not p.logit_bias
        and request.num_output_tokens >= p.min_new_tokens
    )


def _keep_one_allowed(row: np.ndarray, allowed_row: np.ndarray) -> None:
    """The grammar wins over min_new_tokens: when the ban of eos left nothing the grammar allows (it admits
    only eos), its allowed tokens come back, equally likely."""
    if row.max() == -np.inf:  # a NaN or +inf is the model's failure, left for _check_top
        row[allowed_row] = 0.0


def _adjust_logits(
    row: np.ndarray, p: SamplingParams, output_token_ids: Sequence[int], all_token_ids: Sequence[int]
) -> None:
    if len(output_token_ids) < p.min_new_tokens:
        banned = [t for t in (*p.eos_token_ids, *p.stop_token_ids) if t < row.shape[0]]
        row[banned] = -np.inf
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(all_token_ids, dtype=np.int64))
        vals = row[seen].astype(np.float64)  # a penalty below float32's smallest number is not 0 here
        # a penalty far below 1 can lift a logit past float32's range: an inf would make the row's
        # probabilities NaN (inf - inf), so the top is held at the largest finite value
        with np.errstate(over="ignore"):
            penalized = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        row[seen] = np.minimum(penalized, FLOAT32_MAX)
    if (p.presence_penalty or p.frequency_penalty) and output_token_ids:
        ids, counts = np.unique(np.asarray(output_token_ids, dtype=np.int64), return_counts=True)
        row[ids] -= p.presence_penalty + p.frequency_penalty * counts
    if p.logit_bias:
        _add_bias(row, p.logit_bias)


def _add_bias(row: np.ndarray, logit_bias: Sequence[tuple[int, float]]) -> None:
    """OpenAI's logit_bias: each value added to its token's logit (ids are unique and in the vocabulary:
    SamplingParams.validate checked them). A logit a grammar or min_new_tokens set to -inf stays -inf."""
    ids = np.fromiter((t for t, _ in logit_bias), dtype=np.int64, count=len(logit_bias))
    row[ids] += np.fromiter((b for _, b in logit_bias), dtype=np.float32, count=len(logit_bias))


def _sample_row(row: np.ndarray, request: Request) -> int:
    p = request.params
    # shifted before it is scaled, in float64: a tiny temperature then sends the other logits to -inf, where
    # scaling first would send the top one to inf (and the probabilities to NaN), and in float32 a temperature
    # below its smallest number would be 0
    with np.errstate(over="ignore"):
        scaled = (row - row.max()).astype(np.float64) / p.temperature
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
        logprob=max(float(shifted[chosen] - log_z), LOGPROB_FLOOR),
        top=tuple((int(t), max(float(shifted[t] - log_z), LOGPROB_FLOOR)) for t in top),
    )
