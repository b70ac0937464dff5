"""Speculative decoding: prompt lookup, greedy acceptance and the scheduler's planning and rollback without a
model; then on a real model, greedy output with speculation equals greedy output without it."""

import asyncio
import dataclasses
import itertools
import random
from collections.abc import Callable

import httpx
import numpy as np
import openvino as ov
import pytest

from service.api.ovserve.v1 import ovserve_pb2 as pb
from service.client import Client, build_request
from service.config import parse_args
from service.core import scheduler as scheduler_module
from service.core.config import EngineConfig
from service.core.kv_cache import KVCacheManager
from service.core.outputs import FinishReason
from service.core.params import SamplingParams
from service.core.request import Request
from service.core.sampler import sample, verify
from service.core.scheduler import ScheduledChunk, Scheduler
from service.core.speculative import (
    CALIBRATION_BOUNDS,
    CALIBRATION_DECAY,
    CALIBRATION_PRIOR,
    PRIOR_ACCEPTANCE,
    DraftStats,
    Guess,
    GuessRecord,
    PromptLookup,
    ShapeRegret,
    StepCost,
    accept_greedy,
    choose_drafts,
)
from service.core.step_times import DraftCosts, StepTimes
from service.engine import Engine, GenerationRequest
from service.engine.core import step_inputs
from service.engine.runner import ModelRunner, StepInput
from service.errors import InvalidArgument
from service.rpc import wire
from tests.test_server import TIMEOUT, Running, base_config, free_port

IDS = itertools.count()
BS = 4


def test_prompt_lookup_continues_the_latest_match_of_the_longest_suffix():
    lookup = PromptLookup(max_ngram=3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 1, 2, 3, 4]
    assert lookup.propose(tokens, 2).tokens == (6, 7)  # [2, 3, 4] last seen before 6, 7
    assert lookup.propose([5, 6, 7, 8, 6], 3).tokens == (7, 8, 6)  # only a 1-gram matches
    assert lookup.propose([1, 2, 3], 4) == Guess()  # nothing repeats
    assert lookup.propose([7, 7], 5).tokens == (7,)  # the continuation may be short
    assert lookup.propose([4], 2) == Guess()


def test_prompt_lookup_finds_what_a_scan_of_the_tokens_finds():
    """The lookup searches the tokens as bytes: a match must start at a token, however the bytes of other
    tokens line up (ids chosen so that they often do)."""

    def scan(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[int, ...]:
        end = len(tokens)
        for n in range(min(max_ngram, end - 1), min_ngram - 1, -1):
            for start in range(end - n - 1, -1, -1):
                if tokens[start : start + n] == tokens[end - n :]:
                    return tuple(tokens[start + n : start + n + k])
        return ()

    rng = random.Random(7)
    alphabet = [1, 257, 0x01010101, 0x00000101, 0x01010000, 151_642]
    for _ in range(2000):
        tokens = [rng.choice(alphabet) for _ in range(rng.randrange(1, 60))]
        for max_ngram, min_ngram in ((3, 1), (4, 2), (1, 1)):
            guess = PromptLookup(max_ngram, min_ngram).propose(tokens, 5)
            assert guess.tokens == scan(tokens, 5, max_ngram, min_ngram)


def test_a_guess_is_of_the_kind_of_its_match_length():
    lookup = PromptLookup(max_ngram=3)
    passage = list(range(100, 120))
    assert lookup.propose([5, 6, 7, 8, 6], 3).kind == 1  # a 1-token match
    assert lookup.propose([1, 2, 3, 9, 2, 3], 1).kind == 2  # 2 tokens
    assert lookup.propose([1, 2, 3, 4, 5, 9, 2, 3, 4, 5], 1).kind == 3  # [2, 3, 4, 5]: 4 tokens, beyond the 3-gram
    copying = passage + [0] + passage[:9]  # a reply copying the passage: the match is 9 tokens long
    assert lookup.propose(copying, 4) == Guess((109, 110, 111, 112), 4)
    assert lookup.propose(passage + [0] + passage[:18], 1).kind == 5  # measured up to 16 tokens


def test_accept_greedy_keeps_the_agreeing_run_and_the_models_token():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all agree: a bonus token
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_greedy([5, 6, 7], [4, 6, 7, 8]) == [4]  # none agree: still one token
    assert accept_greedy([], [3]) == [3]


def scheduler(k=3, max_seqs=4, num_blocks=32, max_model_len=64, overhead=1000.0) -> Scheduler:
    """overhead: a step's fixed cost in tokens; large, drafts always pay (tests of the mechanics)."""
    config = EngineConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        speculation="auto",
        speculative_tokens=k,
        speculative_max_seqs=max_seqs,
    )
    return Scheduler(config, KVCacheManager(num_blocks, BS), max_model_len, step_times=StepTimes(overhead))


def decoding(s: Scheduler, prompt, **params) -> Request:
    """A request whose prompt is computed and which has its first token, ready to decode."""
    request = Request(next(IDS), list(prompt), SamplingParams(**params))
    s.add(request)
    plan = s.schedule()
    s.update(plan, [[prompt[len(prompt) // 2]] for _ in plan.sampled])
    return request


def test_a_decoding_request_gets_drafts_from_its_own_tokens():
    s = scheduler()
    r = decoding(s, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # first token 5: lookup proposes what followed 5
    chunk = s.schedule().chunks[0]
    assert chunk.drafts == (6, 7, 8)
    assert (chunk.start, chunk.num_tokens, chunk.num_logits) == (9, 4, 4)
    assert chunk.token_ids == [5, 6, 7, 8]
    assert len(s.kv.block_ids(r.id)) == 4  # room for 13 tokens


def test_update_keeps_accepted_drafts_and_rolls_back_the_rest():
    s = scheduler(k=5)
    r = decoding(s, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])  # first token 7
    plan = s.schedule()
    assert plan.chunks[0].drafts == (8, 9, 10, 11, 12)
    s.update(plan, [accept_greedy(plan.chunks[0].drafts, [8, 9, 42, 0, 0, 0])])
    assert r.output_token_ids == [7, 8, 9, 42]
    assert r.num_tokens == 16 and r.num_computed_tokens == 15  # 7, 8, 9 computed; 42 is fed next
    assert len(s.kv.block_ids(r.id)) == 4  # blocks past the new length were given back
    assert (s.num_draft_tokens, s.num_accepted_tokens, s.num_verify_steps, r.num_accepted_drafts) == (5, 2, 1, 2)
    assert s.schedule().chunks[0].start == 15


def test_a_stop_inside_the_accepted_run_ends_the_request_there():
    s = scheduler()
    r = decoding(s, [1, 2, 3, 4, 5, 6, 7, 8, 9], stop_token_ids=(7,))
    plan = s.schedule()
    assert s.update(plan, [[6, 7, 8, 9]]) == [r]
    assert r.output_token_ids == [5, 6, 7] and r.finish_reason is FinishReason.STOP
    assert r.num_accepted_drafts == 2  # the model kept 6, 7 and 8, but 8 came after the stop
    assert s.kv.pool.num_free == 32


@pytest.mark.parametrize(
    "params",
    [{"temperature": 0.8}, {"repetition_penalty": 1.2}, {"presence_penalty": 0.5}, {"logprobs": 2}],
    ids=["sampled", "repetition", "presence", "logprobs"],
)
def test_sampled_and_penalized_requests_speculate_too(params):
    s = scheduler()
    decoding(s, [1, 2, 3, 4, 5, 6, 7, 8, 9], **params)
    assert s.schedule().chunks[0].drafts == (6, 7, 8)


def test_drafts_respect_token_limits_and_load():
    s = scheduler(k=5)
    decoding(s, [1, 2, 3, 4, 5, 6, 7, 8, 9], max_new_tokens=3)
    assert len(s.schedule().chunks[0].drafts) == 1  # 1 token out, at most 3: one draft and a model token
    busy = scheduler(max_seqs=1)
    for start in (1, 101):
        decoding(busy, [start + i for i in range(9)])
    assert all(c.drafts == () for c in busy.schedule().chunks)  # two running > speculative_max_seqs
    full = scheduler(k=5, max_model_len=12)
    decoding(full, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(full.schedule().chunks[0].drafts) == 1  # 10 tokens, context 12


# -- verification of sampled requests, without a model ----------------------------------------------------
V = 6


def rows_for(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(scale=1.5, size=(n, V)).astype(np.float32)


def request(prompt=(1, 2, 3), **params) -> Request:
    return Request(next(IDS), list(prompt), SamplingParams(**params))


PARAMS = [
    {"temperature": 0.0, "logprobs": 2},
    {"temperature": 0.0, "repetition_penalty": 1.5, "presence_penalty": 0.7},
    {"temperature": 1.0, "seed": 3},
    {"temperature": 0.7, "top_k": 3, "seed": 4, "logprobs": 3},
    {"temperature": 1.3, "top_p": 0.8, "min_p": 0.05, "seed": 5},
    {"temperature": 1.0, "presence_penalty": 1.5, "frequency_penalty": 0.8, "seed": 6},
    {"temperature": 1.0, "repetition_penalty": 2.0, "seed": 7},
    {"temperature": 1.0, "min_new_tokens": 3, "eos_token_ids": (0,), "seed": 8},
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: ",".join(p))
def test_verify_emits_what_plain_steps_would(params):
    """Each position is sampled as a plain step would, given the drafts before it as generated tokens (their
    penalties, the min_new_tokens mask, one draw from the request's generator), and the run stops at the
    first token that differs from its draft."""
    rows = rows_for(5, seed=len(params))
    rows[:, 0] += 2.0  # eos likely: masked while min_new_tokens is pending
    plain = request(**params)
    steps = []
    for row in rows:
        out = sample(row[None].copy(), [plain])
        steps.append((out.token_ids[0], out.logprobs[0]))
        plain.append_token(out.token_ids[0])
    tokens = [t for t, _ in steps]
    for mismatch in range(5):  # drafts agree up to position mismatch, then one differs (4: all agree, a bonus)
        drafts = [*tokens[:mismatch], (tokens[mismatch] + 1) % V][:4]
        out = verify(rows.copy(), request(**params), drafts)
        assert out.token_ids == tokens[: mismatch + 1]
        assert out.logprobs == [lp for _, lp in steps[: mismatch + 1]]


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# chi-square critical values at p = 0.001 by degrees of freedom (a fixed seed makes the test deterministic;
# the bound says the counts would pass for almost any seed)
CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52}


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_speculative_sampling_keeps_the_distribution():
    """Accepting draft x with probability p(x), and otherwise sampling p without x, must emit tokens distributed
    as p; after an accepted draft the bonus token follows p at the next position, whose presence penalty
    counts the draft."""
    rows = np.array([[1.0, 0.5, 0.0, -0.5, 0.8, -1.0], [0.3, 0.9, -0.2, 0.4, 0.0, 0.6]], dtype=np.float32)
    draft, temperature, presence = 4, 0.9, 0.7
    p0 = softmax(rows[0] / temperature)
    penalized = rows[1].copy()
    penalized[draft] -= presence
    p1 = softmax(penalized / temperature)
    r = request(temperature=temperature, presence_penalty=presence, seed=2026)
    first, bonus = np.zeros(V, dtype=np.int64), np.zeros(V, dtype=np.int64)
    trials = 20_000
    for _ in range(trials):
        out = verify(rows.copy(), r, [draft])
        first[out.token_ids[0]] += 1
        if len(out.token_ids) == 2:
            bonus[out.token_ids[1]] += 1
    assert chi_square(first, p0) < CHI2_999[V - 1]
    # the rejection path alone: p without the draft, renormalized
    rejected = first.copy()
    rejected[draft] = 0
    without = p0.copy()
    without[draft] = 0
    assert chi_square(rejected, without / without.sum()) < CHI2_999[V - 2]
    assert bonus.sum() == first[draft]  # a bonus exactly when the draft was kept
    assert chi_square(bonus, p1) < CHI2_999[V - 1]


def test_verify_with_top_k_never_emits_a_cut_token():
    rows = rows_for(3, seed=11)
    top2 = [set(np.argsort(-row)[:2].tolist()) for row in rows]
    outside = next(t for t in range(V) if t not in top2[0])
    r = request(temperature=2.0, top_k=2, seed=1)
    for _ in range(200):
        out = verify(rows.copy(), r, [outside, 0])
        assert out.token_ids[0] in top2[0] and len(out.token_ids) == 1  # a draft outside top-k is never kept


# -- on a real model -------------------------------------------------------------------------------------
def outputs(model, prompts, max_new, params=None, proposer=None, **config) -> tuple[list[list[int]], object]:
    """The tokens of each prompt, all submitted at once; params[i] for prompt i (default: greedy). With
    logprobs, each token comes as (token, its logprob's token id, logprob). proposer replaces prompt lookup."""
    defaults = {
        "kv_cache_gb": 0.02,
        "max_num_batched_tokens": 64,
        "kv_cache_precision": "f16",
        "inference_precision": "f32",
    }
    engine = Engine(model, EngineConfig(**(defaults | config)))
    if proposer is not None:
        engine.core.scheduler.proposer = proposer
    engine.start()
    greedy = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    accepted = []

    async def one(prompt, p):
        tokens = []
        async for out in engine.generate(GenerationRequest(prompt, p)):
            if out.usage is not None:
                accepted.append(out.usage.accepted_draft_tokens)
            if p.logprobs:
                assert len(out.logprobs) == len(out.token_ids)
                tokens += [(t, lp.token_id, lp.logprob) for t, lp in zip(out.token_ids, out.logprobs, strict=True)]
            else:
                tokens += out.token_ids
        return tokens

    async def main():
        wanted = params or [greedy] * len(prompts)
        return await asyncio.gather(*(one(p, q) for p, q in zip(prompts, wanted, strict=True)))

    try:
        result = asyncio.run(main())
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        assert sum(accepted) <= stats.num_accepted_tokens  # less when a stop dropped kept drafts
        return result, stats
    finally:
        engine.shutdown()


TEXT = [1000 + (i * 7) % 50 for i in range(60)]  # a prompt with repeats, so lookup has something to offer


class Oracle:
    """Proposes the tokens that follow in known replies, every WRONG-th one changed: a random model's replies
    seldom copy their prompt, and these drafts are kept in runs and rejected now and then, deterministically."""

    WRONG = 5

    def __init__(self, prompts, replies) -> None:
        self.sequences = [
            [*p, *(t[0] if isinstance(t, tuple) else t for t in r)] for p, r in zip(prompts, replies, strict=True)
        ]

    def propose(self, token_ids, k):
        n = len(token_ids)
        for sequence in self.sequences:
            if sequence[:n] == list(token_ids):
                return Guess(tuple(t if (n + i) % self.WRONG else t ^ 1 for i, t in enumerate(sequence[n : n + k])))
        return Guess()


@pytest.fixture
def every_draft(monkeypatch):
    """Every speculating request gets all the drafts it may have. The cost rule reads the machine's step times,
    and on the tiny models (steps of a few ms, on a CI machine busy with other tests) it sometimes found
    drafts too dear and offered none; these tests are about what drafts do, not about when they pay."""
    monkeypatch.setattr(
        scheduler_module,
        "choose_drafts",
        lambda cost, requests, fits=None, regret=None: [limit for _, limit, _ in requests],
    )


@pytest.mark.parametrize("verify_drafts", ["rows", "sequence"])
def test_speculation_gives_exactly_the_greedy_tokens(tiny_qwen3_fp16_ir, verify_drafts, every_draft):
    """Uncompressed weights and an f16 cache: a k+1-token verify step must reproduce one-token decoding, its
    drafts fed as one-token rows (auto's choice where one compiled copy runs every step) or as one sequence
    (beside auto's bf16 copy, or asked for)."""
    prompts = [TEXT, TEXT[10:] + TEXT[:10], [5, 6, 7] * 12]
    plain, _ = outputs(tiny_qwen3_fp16_ir, prompts, 40)
    spec = {"speculative_tokens": 4, "speculation": "auto", "verify_drafts": verify_drafts}
    fast, stats = outputs(tiny_qwen3_fp16_ir, prompts, 40, proposer=Oracle(prompts, plain), **spec)
    assert fast == plain
    looked_up, _ = outputs(tiny_qwen3_fp16_ir, prompts, 40, **spec)  # prompt lookup's drafts, mostly rejected
    assert looked_up == plain
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats
    # each verify step yields its kept drafts and one token; every other step one token per request
    assert 0 < stats.num_verify_steps <= stats.num_generated_tokens - stats.num_accepted_tokens


@pytest.mark.parametrize("verify_drafts", ["rows", "sequence"])
def test_speculation_through_preemption_gives_exactly_the_greedy_tokens(tiny_qwen3_fp16_ir, verify_drafts, every_draft):
    """Four requests of 100 tokens (prompt and reply) in a cache of 6 blocks of 32 tokens: requests are preempted
    while they speculate and recomputed later, and still reply what plain decoding with room for all does."""
    prompts = [[1000 + (i * (7 + j)) % 50 for i in range(60)] for j in range(4)]
    plain, _ = outputs(tiny_qwen3_fp16_ir, prompts, 40)
    sizing = Engine(tiny_qwen3_fp16_ir, EngineConfig(kv_cache_gb=0.02, kv_cache_precision="f16"))
    block_bytes = sizing.info.kv_cache_bytes / sizing.info.num_kv_blocks
    sizing.shutdown()
    spec = {"speculative_tokens": 4, "speculation": "auto", "verify_drafts": verify_drafts}
    fast, stats = outputs(
        tiny_qwen3_fp16_ir, prompts, 40, proposer=Oracle(prompts, plain), kv_cache_gb=6 * block_bytes / 2**30, **spec
    )
    assert stats.num_preemptions > 0 and stats.num_accepted_tokens > 0, stats
    assert fast == plain


def test_drafts_are_fed_as_rows_where_decoding_rows_run_in_f32_unless_asked_otherwise(tiny_qwen3_ir):
    """verify_drafts: auto takes one-token rows where they make speculation exact (decoding rows in f32), and
    either form can be asked for (sequence: faster at long contexts, where rows read the context each). In
    bf16 a row depends on its step's size, so auto takes one sequence there (on a CPU without bf16 the plugin
    runs f32 for it: rows)."""
    for precision, verify_drafts, rows in (
        ("auto", "auto", True),  # f32 rows; long prompt pieces apart on the bf16 copy where there is one
        ("f32", "auto", True),
        ("f32", "rows", True),
        ("f32", "sequence", False),
        ("bf16", "auto", None),
    ):
        config = EngineConfig(kv_cache_gb=0.02, inference_precision=precision, verify_drafts=verify_drafts)
        engine = Engine(tiny_qwen3_ir, config)
        try:
            if rows is None:
                rows = engine.core.runner.compiled.get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32
            assert engine.core.draft_rows is rows
        finally:
            engine.shutdown()
    # with --fast-single-stream a lone request's plain steps run on another copy: rows would make it no more exact
    engine = Engine(tiny_qwen3_ir, EngineConfig(kv_cache_gb=0.02, inference_precision="f32", fast_single_stream=True))
    try:
        assert engine.core.draft_rows
        assert not engine.core.drafts_as_rows(1)
        assert engine.core.drafts_as_rows(2)
    finally:
        engine.shutdown()
    assert EngineConfig(verify_drafts="sideways").problems() == ["verify_drafts must be one of auto, rows, sequence"]


def test_drafts_rows_are_computed_as_decode_steps_compute_them(tiny_qwen3_ir):
    """int8 weights and a u8 cache: a verify step's rows are the rows one-token decode steps give, bit for
    bit, when the drafts run as one-token sequences on the request's block table (step_inputs, where all
    steps run on one copy). Fed as one many-token sequence they are not (the check that the test can tell)."""
    runner = ModelRunner(
        tiny_qwen3_ir / "openvino_model.xml", EngineConfig(kv_cache_gb=0.02, inference_precision="f32")
    )
    rng = np.random.default_rng(1)
    prompt, other = rng.integers(10, 1000, 30).tolist(), rng.integers(10, 1000, 20).tolist()
    table, other_table = [0, 1], [2]
    runner.execute([StepInput(prompt, 0, table, 1), StepInput(other, 0, other_table, 1)])
    fed = rng.integers(10, 1000, 6).tolist()  # the request's last token and five drafts
    beside = StepInput([other[-1]], 20, other_table, 1)  # decode steps of two sequences, as in a batch
    decoded = np.stack(
        [runner.execute([StepInput([t], 30 + i, table, 1), beside])[0].copy() for i, t in enumerate(fed)]
    )
    request = Request(1, prompt, SamplingParams())
    chunk = ScheduledChunk(request, 30, 6, table, sample=True, drafts=tuple(fed[1:]))
    request.append_token(fed[0])
    rows = step_inputs(chunk, one_token_rows=True)
    assert [r.token_ids for r in rows] == [[t] for t in fed]
    np.testing.assert_array_equal(runner.execute([*rows, beside])[:6], decoded)
    one_sequence = runner.execute([StepInput(fed, 30, table, 6), beside])[:6]
    assert not np.array_equal(one_sequence, decoded)


def test_a_lone_decoding_row_is_computed_as_beside_other_sequences(tiny_qwen3_ir):
    """int8 weights and a u8 cache: a request decoding alone gets the very logits its row gets beside another
    sequence. Without the runner's empty sequence the plugin sums a lone row's attention in per-block partials,
    which moved these logits by about 1e-5 (the dynamic quantization of activations can amplify that at a
    near tie, to 0.6 on SmolLM2)."""
    runner = ModelRunner(
        tiny_qwen3_ir / "openvino_model.xml",
        EngineConfig(kv_cache_gb=0.02, inference_precision="f32", kv_cache_precision="u8"),
    )
    rng = np.random.default_rng(2)
    prompt, other = rng.integers(10, 1000, 90).tolist(), rng.integers(10, 1000, 20).tolist()
    table, other_table = [0, 1, 2], [3]
    runner.execute([StepInput(prompt, 0, table, 1), StepInput(other, 0, other_table, 1)])
    for position, token in enumerate(rng.integers(10, 1000, 4).tolist(), start=90):
        alone = runner.execute([StepInput([token], position, table, 1)]).copy()
        beside = runner.execute([StepInput([token], position, table, 1), StepInput([other[-1]], 19, other_table, 1)])
        np.testing.assert_array_equal(alone[0], beside[0])


def test_speculation_on_int8_weights_alone_gives_the_greedy_tokens_and_logprobs_of_plain_decoding(
    tiny_qwen3_ir, every_draft
):
    """int8 weights, a u8 cache and auto precision, as served: a request decoding alone gets with drafts the tokens
    and log-probabilities it gets without (its drafts go as rows, computed as its decode steps compute them)."""
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True, logprobs=1)]
    served = {"kv_cache_precision": "u8", "inference_precision": "auto"}
    plain, _ = outputs(tiny_qwen3_ir, [TEXT[:30]], 0, params, **served)
    spec = {"speculative_tokens": 4, "speculation": "auto"}
    fast, stats = outputs(tiny_qwen3_ir, [TEXT[:30]], 0, params, Oracle([TEXT[:30]], plain), **served, **spec)
    assert stats.num_accepted_tokens > 0, stats
    assert fast == plain


def test_speculation_on_int8_weights_gives_the_greedy_tokens_and_logprobs_of_a_batch(tiny_qwen3_ir, every_draft):
    """int8 weights, u8 cache: requests decoding together (steps of several sequences) get with drafts the
    tokens and the very log-probabilities they get without, since verify rows are decode rows. Same-length
    prompts: the oracle's drafts are kept and rejected in step, so the requests stay together to the end.
    Every request gets all the drafts it may have (every_draft): this test is about what verify rows compute."""
    prompts = [TEXT[:20], TEXT[20:40], TEXT[40:]]  # one prefill step of 60 tokens
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True, logprobs=1)] * 3
    plain, _ = outputs(tiny_qwen3_ir, prompts, 0, params, kv_cache_precision="u8")
    oracle = Oracle(prompts, plain)
    spec = {"speculative_tokens": 4, "speculation": "auto", "kv_cache_precision": "u8"}
    fast, stats = outputs(tiny_qwen3_ir, prompts, 0, params, oracle, **spec)
    assert stats.num_accepted_tokens > 0, stats
    assert fast == plain


def test_speculation_at_auto_precision_gives_plain_decodings_logprobs_while_prompts_arrive(tiny_qwen3_ir, every_draft):
    """int8 weights, a u8 cache and auto precision, as served: two requests decoding with drafts get the tokens
    and the very log-probabilities they get without, while prompts of 100 tokens arrive. Their pieces run on the
    bf16 copy apart from the decoding rows (where the CPU has one), and the drafts are fed as one-token rows."""
    config = EngineConfig(kv_cache_gb=0.02, max_num_batched_tokens=128, max_num_seqs=16, enable_prefix_caching=False)
    decoders = [TEXT[:40], TEXT[20:]]
    params = SamplingParams(max_new_tokens=80, ignore_eos=True, logprobs=1)
    arriving = [[random.Random(51 + i).randrange(100, 150_000) for _ in range(100)] for i in range(4)]

    def replies(speculation: dict, proposer=None):
        engine = Engine(tiny_qwen3_ir, dataclasses.replace(config, **speculation))
        if proposer is not None:
            engine.core.scheduler.proposer = proposer
        engine.start()

        async def one(prompt, p):
            tokens = []
            async for out in engine.generate(GenerationRequest(prompt, p)):
                tokens += [(t, lp.logprob) for t, lp in zip(out.token_ids, out.logprobs, strict=True)]
            return tokens

        async def main():
            tasks = [asyncio.create_task(one(p, params)) for p in decoders]
            for p in arriving:
                await asyncio.sleep(0.005)
                async for _ in engine.generate(GenerationRequest(p, SamplingParams(max_new_tokens=1))):
                    pass
            assert not any(t.done() for t in tasks)  # every prompt was computed while they decoded
            return await asyncio.gather(*tasks)

        try:
            return asyncio.run(main()), engine.stats()
        finally:
            engine.shutdown()

    plain, _ = replies({"speculation": "off"})
    spec = {"speculation": "auto", "speculative_tokens": 4}
    fast, stats = replies(spec, Oracle(decoders, [[t for t, _ in r] for r in plain]))
    assert stats.num_accepted_tokens > 0, stats
    assert fast == plain


def test_drafts_go_as_rows_alone_too(tiny_qwen3_ir, every_draft, monkeypatch):
    """auto: drafts go as one-token rows beside another request and alone (the runner gives a lone row the path
    of rows beside others, so rows make a lone request's drafts exact too)."""
    steps = []  # steps with drafts: (requests in the step, whether every sequence is one token)

    def recording(execute):
        def run(seqs, shape=None):
            wanted = [s for s in seqs if s.num_logits > 0]
            if sum(s.num_logits for s in wanted) > len({tuple(s.block_ids) for s in wanted}):  # drafts
                steps.append((len({tuple(s.block_ids) for s in wanted}), all(len(s.token_ids) == 1 for s in wanted)))
            return execute(seqs, shape)

        return run

    real_init = Engine.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        monkeypatch.setattr(self.core.runner, "execute", recording(self.core.runner.execute))

    monkeypatch.setattr(Engine, "__init__", init)
    spec = {"speculative_tokens": 4, "speculation": "auto", "inference_precision": "auto", "kv_cache_precision": "u8"}
    prompts = [TEXT[:20], TEXT[20:40]]
    for n in (1, 2):
        plain, _ = outputs(tiny_qwen3_ir, prompts[:n], 30)
        steps.clear()
        outputs(tiny_qwen3_ir, prompts[:n], 30, proposer=Oracle(prompts[:n], plain), **spec)
        assert any(requests == n for requests, _ in steps), steps
        assert all(rows for _, rows in steps), steps


def test_greedy_with_penalties_logprobs_and_min_new_tokens_is_exact_too(tiny_qwen3_fp16_ir, every_draft):
    """Each verified position applies the penalties and the eos mask as if the drafts before it were generated,
    and reports the logprob the plain sampler would."""
    params = [
        SamplingParams(max_new_tokens=30, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_new_tokens=30, frequency_penalty=0.5, logprobs=2, ignore_eos=True),
        SamplingParams(max_new_tokens=30, min_new_tokens=20, stop_token_ids=tuple(TEXT[:10])),
    ]
    prompts = [TEXT, [5, 6, 7] * 12, TEXT[10:] + TEXT[:10]]
    plain, _ = outputs(tiny_qwen3_fp16_ir, prompts, 0, params)
    oracle = Oracle(prompts, plain)
    fast, stats = outputs(tiny_qwen3_fp16_ir, prompts, 0, params, oracle, speculative_tokens=4, speculation="auto")
    assert [fast[0], fast[2]] == [plain[0], plain[2]]
    assert [t[:2] for t in fast[1]] == [t[:2] for t in plain[1]]
    assert [t[2] for t in fast[1]] == pytest.approx([t[2] for t in plain[1]], abs=1e-3)
    assert stats.num_accepted_tokens > 0, stats


def test_a_stop_string_inside_a_kept_run_ends_the_reply_where_plain_decoding_ends_it(tiny_qwen3_fp16_ir, every_draft):
    """Stop strings are matched by the front, on text: a verify step's run carries tokens past the one that
    completes a stop string, and those must not reach the reply, its logprobs, its usage or its finish reason."""
    greedy = SamplingParams(max_new_tokens=40, ignore_eos=True)
    (reply,), _ = outputs(tiny_qwen3_fp16_ir, [TEXT], 0, [greedy])
    engine = Engine(tiny_qwen3_fp16_ir, EngineConfig(kv_cache_gb=0.02, inference_precision="f32"))
    decode = engine.tokenizer.decode
    text = decode(reply)
    stops = []  # stop strings that the reply completes first at its tokens 9, 15, 21 and 27
    for j in (9, 15, 21, 27):
        head = decode(reply[: j + 1])
        stop = head[-3:]
        if "\ufffd" not in stop and text.find(stop) + len(stop) == len(head) and stop not in decode(reply[:j]):
            stops.append(stop)
    assert len(stops) >= 2, stops

    async def run(params: SamplingParams):
        tokens, logprobs, pieces, last = [], [], [], None
        async for out in engine.generate(GenerationRequest(TEXT, params)):
            tokens += out.token_ids
            logprobs += [(lp.token_id, round(lp.logprob, 3)) for lp in out.logprobs]
            pieces.append(out.text)
            last = out
        return tokens, logprobs, "".join(pieces), last.finish_reason, last.usage.completion_tokens, last.usage

    async def main():
        results = []
        for stop in stops:
            params = dataclasses.replace(greedy, stop=(stop,), logprobs=1)
            plain = await run(dataclasses.replace(params, speculation="off"))
            fast = await run(dataclasses.replace(params, speculation="auto"))
            results.append((stop, plain, fast))
        return results

    engine.core.scheduler.proposer = type("Exact", (Oracle,), {"WRONG": 10**9})([TEXT], [reply])
    engine.start()
    try:
        results = asyncio.run(main())
        stats = engine.stats()
    finally:
        engine.shutdown()
    for stop, plain, fast in results:
        assert plain[3] is FinishReason.STOP and plain[4] < 40 and plain[2] == text[: text.find(stop)], stop
        assert fast[:5] == plain[:5], stop
        assert 0 < fast[5].accepted_draft_tokens < fast[4]  # its own kept drafts only, those before the stop
    assert stats.num_accepted_tokens > sum(fast[5].accepted_draft_tokens for _, _, fast in results)  # runs went past


def test_a_seeded_sampled_reply_does_not_depend_on_its_batch(tiny_qwen3_fp16_ir, every_draft):
    """Speculation on: the same seeded request alone and beside others (which changes its steps' shapes and
    what shares them) gives one reply; and since verification draws once per emitted token, the reply is
    the one plain decoding gives."""
    seeded = SamplingParams(
        max_new_tokens=40, temperature=0.1, presence_penalty=0.2, seed=77, ignore_eos=True, logprobs=2
    )
    crowd = [SamplingParams(max_new_tokens=30, temperature=t, seed=None, ignore_eos=True) for t in (0.0, 0.9, 0.3)]
    others = [[5, 6, 7] * 12, TEXT[20:], TEXT[5:40]]
    (plain,), _ = outputs(tiny_qwen3_fp16_ir, [TEXT], 0, [seeded])
    spec = {"speculative_tokens": 4, "speculation": "auto", "proposer": Oracle([TEXT], [plain])}
    (alone,), stats = outputs(tiny_qwen3_fp16_ir, [TEXT], 0, [seeded], **spec)
    crowded, _ = outputs(tiny_qwen3_fp16_ir, [*others, TEXT], 0, [*crowd, seeded], **spec)
    assert stats.num_accepted_tokens > 0, stats  # some drafts were kept: the sampled path ran
    for reply in (crowded[-1], plain):  # logprobs agree to rounding: the step shapes differ
        assert [t[:2] for t in reply] == [t[:2] for t in alone]
        assert [t[2] for t in reply] == pytest.approx([t[2] for t in alone], abs=1e-3)


def runs_of(*runs: int) -> DraftStats:
    stats = DraftStats()
    for run in runs:
        stats.record(run)
    return stats


def test_a_guess_is_judged_once_the_reply_leaves_it_or_matches_all_of_it():
    stats = DraftStats()
    stats.watch(3, Guess((5, 6, 7), kind=3))
    stats.watch(4, Guess((9,), kind=1))  # one guess at a time: ignored, but drafts are judged by it now
    assert stats.latest == Guess((9,), kind=1) and stats.expected_tokens(3) == stats.expected_tokens(1)
    assert stats.settle([0, 0, 0, 5, 6]) is None  # agrees so far: not known yet
    assert stats.watched == (3, Guess((5, 6, 7), 3)) and stats.by_kind == {}
    assert stats.settle([0, 0, 0, 5, 6, 8]) == (3, 2)  # the reply left it after two: a run of its guess's kind
    assert stats.watched is None and stats.by_kind[3].counts == [0.0, 0.0, 1.0]
    stats.watch(6, Guess((1, 2, 3), kind=3))
    assert stats.settle([0, 0, 0, 5, 6, 8, 1, 2, 3]) == (3, 3)  # all of it matched
    assert stats.by_kind[3].counts == pytest.approx([0.0, 0.0, 0.7, 1.0])
    stats.watch(9, Guess())  # no guess at all: nothing to judge, and no drafts for it
    assert stats.watched is None and list(stats.by_kind) == [3]


def test_drafts_are_judged_by_their_guess_kind_from_what_all_requests_earned_then_their_own():
    everyone = GuessRecord()
    for _ in range(50):
        everyone.record(5, 10)  # guesses from long matches kept all ten drafts
        everyone.record(1, 0)  # those from 1-token matches none
    stats = DraftStats(everyone)
    stats.watch(0, Guess(tuple(range(10)), kind=5))
    assert stats.expected_tokens(10) > 10  # a new request's long match: what long matches earned
    stats.watch(0, Guess(tuple(range(10)), kind=1))
    assert stats.expected_tokens(10) < 1.1
    for _ in range(6):
        stats.record(0, kind=5)  # this request's long matches miss: its own runs soon outweigh everyone's
    stats.watch(0, Guess(tuple(range(10)), kind=5))
    assert stats.expected_tokens(10) < 1.5
    s = scheduler(k=4)
    r = decoding(s, [1, 2, 3, 4, 1, 2, 3])  # first token 4: lookup guesses 1, 2, 3 (a 4-token match)
    plan = s.schedule()
    assert r.draft_stats.record_of_all is s.guess_record and plan.chunks[0].drafts[:3] == (1, 2, 3)
    s.update(plan, [[1, 2, 9]])  # the reply left the guess after two
    assert s.guess_record.by_kind[3].counts == pytest.approx([0.0, 0.0, 1.0])


def test_expected_drafts_are_calibrated_by_what_verify_steps_of_their_kind_kept():
    """The rule offers drafts to the requests whose runs look best, and those overrate them (writing at 4
    streams: guesses from 1-token matches kept half the drafts their runs expected), while runs of long
    matches can undersell them: each kind's expected drafts are scaled by what its verify steps kept against
    what was expected lately, within bounds, from 1 before any step."""
    everyone = GuessRecord()
    stats = DraftStats(everyone)
    stats.watch(0, Guess(tuple(range(4)), kind=1))
    raw = stats.expected_kept_up_to(4)
    assert everyone.calibration(1) == 1.0 and stats.expected_tokens_up_to(4) == [1 + kept for kept in raw]
    everyone.record_verify(1, 2.0, 1)  # one step moves it a little: both sums start at CALIBRATION_PRIOR
    assert everyone.calibration(1) == pytest.approx(
        (CALIBRATION_DECAY * CALIBRATION_PRIOR + 1) / (CALIBRATION_DECAY * CALIBRATION_PRIOR + 2)
    )
    for _ in range(300):
        everyone.record_verify(1, 2.0, 1)  # half what was expected
        everyone.record_verify(5, 2.0, 8)  # four times: bounded
    assert everyone.calibration(1) == pytest.approx(0.5, abs=0.01)
    assert everyone.calibration(5) == CALIBRATION_BOUNDS[1]
    assert everyone.calibration(3) == 1.0  # a kind of its own
    assert stats.expected_tokens_up_to(4) == pytest.approx([1 + everyone.calibration(1) * kept for kept in raw])
    # through a request's stats: by its latest guess's kind; drafts past the guess (padding) are kept by luck
    # and count only within it, and an empty guess is not recorded
    stats.watch(0, Guess((1, 2), kind=3))
    stats.record_verify(2.0, 4)
    assert everyone.verified[3] == (
        CALIBRATION_DECAY * CALIBRATION_PRIOR + 2.0,
        CALIBRATION_DECAY * CALIBRATION_PRIOR + 2,
    )
    stats.watch(0, Guess())
    stats.record_verify(0.0, 1)
    assert 0 not in everyone.verified
    # the scheduler records each verify step's expected and kept drafts by its guess's kind
    s = scheduler(k=4)
    decoding(s, [1, 2, 3, 4, 1, 2, 3])  # first token 4: lookup guesses 1, 2, 3 (a 4-token match, kind 3)
    plan = s.schedule()
    expected = plan.chunks[0].expected_kept
    stats_then = plan.chunks[0].request.draft_stats
    assert 0 < expected == pytest.approx(stats_then.expected_kept_up_to(len(plan.chunks[0].drafts))[-1])
    s.update(plan, [[1, 2, 9]])  # two drafts kept
    assert s.guess_record.verified[3] == pytest.approx(
        (CALIBRATION_DECAY * CALIBRATION_PRIOR + expected, CALIBRATION_DECAY * CALIBRATION_PRIOR + 2)
    )


def test_expected_tokens_follow_the_recorded_runs():
    fresh = DraftStats()  # the prior alone: each draft kept with probability 0.5 after the one before
    assert fresh.expected_tokens(0) == 1.0
    assert fresh.expected_tokens(3) == pytest.approx(1 + PRIOR_ACCEPTANCE + PRIOR_ACCEPTANCE**2 + PRIOR_ACCEPTANCE**3)
    copying = runs_of(*[8] * 10)  # long runs: every draft up to 8 is kept
    assert copying.expected_tokens(5) == pytest.approx(6, abs=0.05)
    assert copying.expected_tokens(10) == pytest.approx(9, abs=0.1)  # no run went past 8
    missing = runs_of(*[0] * 10)
    assert missing.expected_tokens(5) == pytest.approx(1, abs=0.05)
    mixed = runs_of(*[0, 4] * 10)  # half the guesses miss, half agree for four tokens (the latest weighs most)
    assert 3 < mixed.expected_tokens(4) < 3.5 and mixed.expected_tokens(5) - mixed.expected_tokens(4) < 0.01


def test_drafts_pay_when_the_step_is_small_or_they_are_likely_kept():
    """k drafts for a request whose steps yield E(k) tokens raise the step's rate from produced / (F + T) to
    (produced + E(k) - 1) / (F + T + k): the cost rule takes the k that maximizes it."""
    alone = StepCost(StepTimes(8), tokens=1, produced=1)
    assert alone.best(alone.options(runs_of(*[8] * 10), 5)) == 5  # one stream copying its input: every draft pays
    assert alone.best(alone.options(runs_of(*[0] * 10), 5)) == 0  # guesses that miss never pay
    assert alone.best(alone.options(runs_of(*[0, 1] * 10), 5)) == 1  # runs of one: a second draft would never be kept
    crowd = StepCost(StepTimes(8), tokens=32, produced=32)  # 32 decoding requests: compute-bound
    assert crowd.best(crowd.options(DraftStats(), 5)) == 0
    assert crowd.best(crowd.options(runs_of(*[0, 2] * 10), 5)) == 0
    assert crowd.best(crowd.options(runs_of(*[8] * 10), 5)) == 5  # copying gains 3% here (the prior line: F = 8)...
    no_drafts = [(runs_of(*[8] * 10), 5, 0)]
    assert choose_drafts(crowd, no_drafts, fits=lambda n: n == 0) == [0]  # ...less than a change of shape is worth
    few = StepCost(StepTimes(8), tokens=8, produced=8)
    assert few.best(few.options(runs_of(*[8] * 10), 5)) == 5  # beside 7 others, a request that copies its input gains
    beside_a_prompt = StepCost(StepTimes(8), tokens=200, produced=1)  # one decoding request beside a prompt chunk
    assert (
        beside_a_prompt.best(beside_a_prompt.options(DraftStats(), 5)) == 5
    )  # the step is slow anyway: its few outputs are worth a lot
    stats = runs_of(*[8] * 10)
    crowd.add(5, crowd.options(stats, 5))
    assert (crowd.tokens + crowd.num_drafts, crowd.produced) == (37, pytest.approx(32 + stats.expected_tokens(5) - 1))


def test_drafts_cost_by_the_rows_before_them_and_their_reads_of_the_context():
    """A draft's rows cost what the one-sequence curve adds from the step's rows before them (n one-token rows
    at a short context cost what one sequence of n tokens does: SmolLM2, flat up to 12 rows, then 0.6 ms a
    row), so the first drafts of a step of 8 are nearly free and the later ones are not; beside other
    sequences, the fitted DraftCosts add their reads of the context."""

    def measured() -> StepTimes:
        times = StepTimes()
        for n, seconds in {8: 0.0130, 12: 0.0140, 16: 0.0180, 32: 0.0268}.items():
            times.observe(n, seconds)
        times.observe(8, 0.0190, sequences=8)  # 8 decoding sequences at 600 tokens of context
        return times

    times = measured()
    missing = runs_of(*[0] * 10)
    step = StepCost(times, tokens=8, produced=8, sequences=8)
    first = step.options(missing, 1).seconds[1]
    assert first == pytest.approx(0.0130 + 0.0010 / 4 - 0.0130)  # 8 to 9 rows
    for _ in range(8):
        step.add(1, step.options(missing, 1))
    assert step.seconds == pytest.approx(0.0190 + 0.0180 - 0.0130)  # 8 to 16 rows
    assert step.options(missing, 1).seconds[1] > 2 * first  # a seventeenth row costs more than the ninth
    times.observe(16, 0.0200)  # a live one-sequence step moves the curve: the next estimate follows it
    assert times.rows_cost(8, 8) == pytest.approx(0.0190 - 0.0130)
    times = measured()
    times.draft_costs = DraftCosts(per_draft_context_token=0.0000013)  # as one-token rows, each reads the context
    step = StepCost(times, tokens=8, produced=8, sequences=8)
    assert step.options(missing, 3, context=600).seconds[3] == pytest.approx(
        0.0010 * 3 / 4 + 3 * 0.0000013 * 600  # 8 to 11 rows, and the context read by each
    )
    for _ in range(8):
        step.add(1, step.options(missing, 1, context=600))
    assert step.seconds == pytest.approx(0.0190 + 0.0180 - 0.0130 + 8 * 0.0000013 * 600)
    # alone: the curve's difference from the one row (below 8 tokens, along the prior line, F = 8)
    assert times.draft_cost(0) == 0 and times.draft_cost(5, context=600) == pytest.approx(0.0130 * (6 - 1) / 16)


def test_a_step_keeps_its_shape_unless_a_change_pays():
    """A step of the same shape as the one before is cheaper: a request takes a number of drafts that needs
    another shape only when what the switch saves over HORIZON steps exceeds what two changes of shape cost
    (drafts come and go with the matches, so a switch is undone before long)."""
    times = StepTimes()
    for n, seconds in {1: 0.0162, 2: 0.0169, 3: 0.0179, 4: 0.0197, 5: 0.0237, 6: 0.0237}.items():
        times.observe(n, seconds)
    times.observe_change(1, 0.0162 + 0.005)  # a change of shape: 5 ms more
    assert times.change_seconds == pytest.approx(0.005)
    cost = StepCost(times, tokens=1, produced=1)
    copying = runs_of(*[5] * 10)  # every guess kept whole
    rates = [cost.rate(cost.options(copying, 5), k) for k in range(6)]
    assert max(range(6), key=rates.__getitem__) == 5 and rates[5] < 1.25 * rates[4]  # 5 drafts: 20% better than 4

    def shape_of(drafts: int) -> Callable[[int], bool]:  # the last step had one sequence and `drafts` drafts
        return lambda n: n == drafts

    for last in range(6):  # 4 steps at 20% faster save more than the 2 x 5 ms of changes: switch
        assert choose_drafts(cost, [(copying, 5, 0)], shape_of(last)) == [5]
    for _ in range(50):  # 9 ms a change: from 3 or 4 drafts a switch saves 15.5 ms, more than one change
        times.observe_change(1, 0.0162 + 0.009)
    for last, chosen in ((4, 4), (3, 3), (2, 5)):
        assert choose_drafts(cost, [(copying, 5, 0)], shape_of(last)) == [chosen]
    for _ in range(50):  # changes got far dearer: 20 ms
        times.observe_change(1, 0.0162 + 0.020)
    assert choose_drafts(cost, [(copying, 5, 0)], shape_of(4)) == [4]
    # but a shape of no drafts against five: 6 tokens a step instead of 1
    assert choose_drafts(cost, [(copying, 5, 0)], shape_of(0)) == [5]
    assert choose_drafts(cost, [(copying, 2, 0)], shape_of(4)) == [2]  # never beyond the limit, whatever fits
    assert choose_drafts(cost, [(copying, 5, 0)]) == [5]  # with no shape to keep (a first step), the best


def test_a_shape_that_keeps_giving_up_time_is_left_once_that_pays_for_a_switch():
    """A gain too small to pay for two changes within HORIZON steps still pays once the steps kept in the old
    shape have given up as much (rent or buy): a lone request copying a long passage sat at 2 drafts for 40
    steps where 10 were best. Taking the best numbers, or a step with no shape to keep, starts the count again."""
    times = StepTimes()
    for n, seconds in {1: 0.0162, 2: 0.0169, 3: 0.0179, 4: 0.0197, 5: 0.0237, 6: 0.0237}.items():
        times.observe(n, seconds)
    for _ in range(50):  # 9 ms a change: from 4 drafts a switch to 5 saves less than one change over HORIZON
        times.observe_change(1, 0.0162 + 0.009)
    cost = StepCost(times, tokens=1, produced=1)
    copying = runs_of(*[5] * 10)

    def four_drafts(n: int) -> bool:
        return n == 4

    regret = ShapeRegret()
    kept = 0
    while choose_drafts(cost, [(copying, 5, 0)], four_drafts, regret) == [4]:
        kept += 1
        assert kept < 50
    assert kept > 1 and regret.seconds == 0.0  # kept for a while, then switched, and the count starts again
    assert choose_drafts(cost, [(copying, 5, 0)], four_drafts) == [4]  # without a count: never
    regret.seconds = 1.0
    assert choose_drafts(cost, [(copying, 5, 0)], None, regret) == [5] and regret.seconds == 0.0
    regret.seconds = 1.0  # no number of drafts keeps the shape: it changes, and the count starts again
    assert choose_drafts(cost, [(copying, 5, 0)], lambda n: False, regret) == [5] and regret.seconds == 0.0


def test_the_whole_step_switches_or_none_of_it():
    """Eight requests beside each other whose last step carried eight drafts: one request's share of the step
    is too small to pay for a change of shape alone, but the whole step dropping its drafts does (against the
    eight drafts the shape would keep, placed on the fewest requests)."""
    times = StepTimes()
    for n, seconds in {1: 0.0126, 8: 0.0158, 9: 0.0168, 16: 0.0214}.items():
        times.observe(n, seconds)
    times.observe(8, 0.0206, sequences=8)
    times.observe_change(8, 0.0206 + 0.005, sequences=8)
    cost = StepCost(times, tokens=8, produced=8, sequences=8)
    missing = [runs_of(*[0] * 10) for _ in range(8)]  # guesses that never agree
    one = StepCost(times, tokens=8, produced=8, sequences=8)
    one.add(1, one.options(missing[0], 1))
    alone_saves = 4 * one.seconds * (1 - (one.produced / one.seconds) / (8 / cost.seconds))
    assert alone_saves < times.change_seconds  # one request dropping its draft would not pay for a change
    eight_drafts = lambda n: n == 8  # noqa: E731
    # all eight dropping theirs does
    assert choose_drafts(cost, [(stats, 5, 0) for stats in missing], eight_drafts) == [0] * 8


def test_drafts_move_within_the_shape_to_the_request_that_copies():
    """Within the last step's shape, drafts go where they are worth most: a request whose guess ran out gives
    its room to one that copies, rather than each keeping its number or the step changing shape."""
    times = StepTimes()
    for n, seconds in {1: 0.0126, 2: 0.0130, 4: 0.0140, 8: 0.0158, 16: 0.0214}.items():
        times.observe(n, seconds)
    times.observe(2, 0.0150, sequences=2)
    times.observe_change(2, 0.0150 + 0.030, sequences=2)  # changes dear: the shape is kept
    cost = StepCost(times, tokens=2, produced=2, sequences=2)
    missing, copying = runs_of(*[0] * 10), runs_of(*[8] * 10)
    up_to_five = lambda n: n <= 5  # noqa: E731  (four drafts and a padding sequence of one token last step)
    assert choose_drafts(cost, [(missing, 8, 0), (copying, 8, 0)], up_to_five) == [0, 5]
    assert choose_drafts(cost, [(missing, 8, 0), (copying, 8, 0)]) == [0, 8]  # no shape to keep: the best
    # a shape without a padding sequence takes exactly its tokens: the rest goes to the request with drafts
    short = runs_of(*[2] * 10)  # runs of two: a third draft would never be kept
    exactly_six = lambda n: n == 6  # noqa: E731
    assert choose_drafts(cost, [(missing, 8, 0), (short, 8, 0)], exactly_six) == [0, 6]
    assert choose_drafts(cost, [(missing, 8, 0), (short, 8, 0)], lambda n: n == 12) == [4, 8]  # then the others


def test_a_first_change_of_shape_costs_a_quarter_step_until_measured():
    times = StepTimes(overhead=8.0)
    assert times.change_cost(4) == pytest.approx(12 / 4)  # the prior line's step
    times.observe_change(4, 1.0)  # nothing to compare it with yet
    assert times.change_seconds is None
    times.observe(4, 0.020)
    assert times.change_cost(4) == pytest.approx(0.005)
    times.observe_change(4, 5.0)  # a first-ever shape compiles kernels too: at most twice the step
    assert times.change_seconds == pytest.approx(0.040)


def test_a_request_whose_guesses_miss_loses_its_drafts_and_gets_them_back_when_it_copies():
    s = scheduler(k=4, overhead=8.0)
    r = decoding(s, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9])  # first token 1: lookup offers 2, 3, ...
    offered = []
    for token in range(50, 58):  # the reply leaves every guess at once
        plan = s.schedule()
        offered.append(len(plan.chunks[0].drafts))
        s.update(plan, [[token]])
    assert offered[0] > 0 and offered[-1] == 0  # from the prior's drafts to none
    assert r.draft_stats.expected_tokens(4) < 1.2
    for _ in range(10):  # the reply copies its prompt again: the guesses watched without drafts see it
        plan = s.schedule()
        drafts = plan.chunks[0].drafts
        s.update(plan, [[*drafts, *(s.proposer.propose(r.all_token_ids + list(drafts), 1).tokens or [1])]])
    drafts = s.schedule().chunks[0].drafts
    assert drafts and s.proposer.propose(r.all_token_ids, 4).tokens[: len(drafts)] == drafts  # its guess again


def test_the_scheduler_asks_which_totals_keep_the_shape_and_places_drafts_within(monkeypatch):
    s = scheduler(k=3)
    first = Request(next(IDS), [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams())
    second = Request(next(IDS), [11, 12, 13, 14, 15, 16, 17, 18, 19], SamplingParams())
    s.add(first)
    s.add(second)
    s.update(s.schedule(), [[5], [15]])  # both prompts in one step; each then has a guess of three tokens
    asked = []

    def up_to_four(sequences: int, drafts: int) -> bool:  # the last step: two sequences, four drafts and a pad
        asked.append(sequences)
        return drafts <= 4

    monkeypatch.setattr(s.step_times, "change_cost", lambda tokens, sequences=1: 1e9)  # changes never pay
    chunks = s.schedule(up_to_four).chunks
    assert set(asked) == {2} and [c.request for c in chunks] == [first, second]
    assert [len(c.drafts) for c in chunks] == [3, 1]  # six would pay with no shape to keep; four fit


def test_a_short_guess_is_padded_to_the_number_of_drafts_its_step_keeps():
    fresh = scheduler(k=5)
    decoding(fresh, [1, 2, 3, 4, 5, 6, 7])  # first token 4: lookup has only 5, 6, 7, 4 after it
    assert fresh.schedule().chunks[0].drafts == (5, 6, 7, 4)  # a fifth draft could never be kept: not chosen
    s = scheduler(k=5)
    decoding(s, [1, 2, 3, 4, 5, 6, 7])

    def five_drafts(sequences: int, drafts: int) -> bool:  # the last step had five: a change would cost more
        return drafts == 5

    assert s.schedule(five_drafts).chunks[0].drafts == (5, 6, 7, 4, 4)  # a step of the shape it keeps
    constrained = scheduler(k=5)
    r = decoding(constrained, [1, 2, 3, 4, 5, 6, 7])
    r.matcher = type("AnyToken", (), {"num_valid": staticmethod(len)})()  # a grammar that allows all
    assert constrained.schedule(five_drafts).chunks[0].drafts == (5, 6, 7, 4)  # never padded past a grammar's check


def test_drafts_leave_room_for_the_prompt_pieces_after_them():
    """Other requests' drafts never decide where a prompt is cut: with a budget of 32, pieces of 24 and two
    requests decoding with up to 5 drafts each, a prompt arriving is cut at 24 and 40 as without speculation
    (drafts took the room and cut it at 20 first)."""

    def cuts(speculation: str) -> list[int]:
        config = EngineConfig(
            max_num_seqs=8,
            max_num_batched_tokens=32,
            prompt_chunk_tokens=24,
            speculation=speculation,
            speculative_tokens=5,
            speculative_max_seqs=4,
        )
        s = Scheduler(config, KVCacheManager(64, BS), 128, step_times=StepTimes(1000.0))
        for prompt in ([1, 2, 3, 4, 5, 6, 7, 8, 9] * 2, [11, 12, 13, 14, 15, 16, 17, 18, 19] * 2):
            decoding(s, prompt)
        for _ in range(3):  # their guesses copy: drafts from here on
            plan = s.schedule()
            s.update(plan, [[c.drafts[0] if c.drafts else 5] for c in plan.chunks if c.sample])
        prompt = Request(next(IDS), list(range(100, 140)), SamplingParams(max_new_tokens=1))
        s.add(prompt)
        ends, drafted = [], 0
        while prompt.num_output_tokens == 0:
            plan = s.schedule()
            drafted += sum(len(c.drafts) for c in plan.chunks)
            s.update(plan, [[c.drafts[0] if c.drafts else 5] for c in plan.chunks if c.sample])
            ends += [c.start + c.num_tokens for c in plan.chunks if c.request is prompt]
        return ends if speculation == "off" or drafted else []

    assert cuts("off") == cuts("auto") == [24, 40]


def test_drafts_never_preempt_and_leave_others_their_block():
    s = scheduler(k=3, num_blocks=4)
    s.speculative_tokens = 0  # set the scene without drafts
    a = Request(next(IDS), [1, 2, 1, 2, 1, 2], SamplingParams())
    s.add(a)
    s.update(s.schedule(), [[1]])
    b = Request(next(IDS), [50, 51, 52, 53], SamplingParams())
    s.add(b)
    s.update(s.schedule(), [[2], [54]])
    # a: 8 tokens in 2 full blocks; b: 5 tokens, its 5th needs a second block; one block is free
    assert (a.num_tokens, b.num_tokens, s.kv.pool.num_free) == (8, 5, 1)
    s.speculative_tokens = 3
    plan = s.schedule()
    assert s.num_preemptions == 0 and not plan.preempted
    assert [c.request for c in plan.chunks] == [a, b]
    assert plan.chunks[0].drafts == ()  # the free block is b's to grow into, not a's drafts'


def test_drafts_leave_a_prompt_computed_in_pieces_the_blocks_for_its_next_piece():
    config = EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=64, prompt_chunk_tokens=8, speculation="auto", speculative_tokens=3
    )
    s = Scheduler(config, KVCacheManager(6, BS), 24, step_times=StepTimes(1000.0))
    s.speculative_tokens = 0  # set the scene without drafts
    a = Request(next(IDS), [1, 2, 1, 2, 1, 2], SamplingParams())
    s.add(a)
    s.update(s.schedule(), [[2]])
    b = Request(next(IDS), list(range(50, 66)), SamplingParams())
    s.add(b)
    s.update(s.schedule(), [[1]])
    # a decodes in 2 blocks; b computed the first 8 of its 16 prompt tokens in 2 blocks and needs 2 more for
    # the next 8; 2 blocks are free
    assert (a.num_computed_tokens, b.num_computed_tokens, s.kv.pool.num_free) == (7, 8, 2)
    s.speculative_tokens = 3
    plan = s.schedule()
    assert not plan.preempted and s.num_preemptions == 0
    assert [(c.request, c.num_tokens, c.drafts) for c in plan.chunks] == [(a, 1, ()), (b, 8, ())]


# -- the per-request switch ------------------------------------------------------------------------------
def test_a_request_with_speculation_off_gets_no_drafts():
    s = scheduler()
    off = decoding(s, [1, 2, 3, 4, 5, 6, 7, 8, 9], speculation="off")
    auto = decoding(s, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # the server's default here: auto
    drafts = {c.request.id: c.drafts for c in s.schedule().chunks}
    assert drafts[off.id] == () and drafts[auto.id] == (6, 7, 8)


def test_the_servers_default_applies_to_requests_that_do_not_choose():
    config = EngineConfig(speculation="off", speculative_tokens=3)
    s = Scheduler(config, KVCacheManager(32, BS), 64, step_times=StepTimes(1000.0))
    default = decoding(s, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    auto = decoding(s, [1, 2, 3, 4, 5, 6, 7, 8, 9], speculation="auto")  # a request may opt in
    drafts = {c.request.id: c.drafts for c in s.schedule().chunks}
    assert drafts[default.id] == () and drafts[auto.id] == (6, 7, 8)
    s.speculative_tokens = 0  # no drafts at all, whatever a request asks
    assert all(c.drafts == () for c in s.schedule().chunks)


@pytest.mark.parametrize("value", ["fast", "", "AUTO"])
def test_an_unknown_speculation_value_is_refused_naming_the_field(value):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(speculation=value).validate(1000, 1000)
    assert err.value.field == "speculation" and "auto, off" in str(err.value)


def test_the_grpc_field_maps_onto_the_params():
    assert wire.sampling_params(pb.GenerateRequest()).speculation is None
    assert wire.sampling_params(pb.GenerateRequest(speculation=pb.SPECULATION_OFF)).speculation == "off"
    assert build_request(prompt="x", speculation="auto").speculation == pb.SPECULATION_AUTO
    with pytest.raises(InvalidArgument) as err:  # an enum number this server does not know
        wire.sampling_params(pb.GenerateRequest(speculation=7))
    assert err.value.field == "speculation"


def test_speculation_flags(monkeypatch):
    config = parse_args(["--model", "m", "--speculation", "auto", "--prompt-lookup-min-ngram", "2"], env={})
    assert (config.engine.speculation, config.engine.prompt_lookup_min_ngram) == ("auto", 2)
    assert parse_args(["--model", "m"], env={"OVSERVE_SPECULATION": "auto"}).engine.speculation == "auto"
    for argv in (["--speculation", "on"], ["--prompt-lookup-min-ngram", "4", "--prompt-lookup-max-ngram", "3"]):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", *argv], env={})


def test_prompt_lookup_matches_no_suffix_shorter_than_min_ngram():
    tokens = [5, 6, 7, 8, 6]  # only the 1-gram [6] recurs
    assert PromptLookup(max_ngram=3, min_ngram=1).propose(tokens, 2).tokens == (7, 8)
    assert PromptLookup(max_ngram=3, min_ngram=2).propose(tokens, 2) == Guess()


def test_off_requests_on_a_real_server_verify_no_drafts(tiny_qwen3_fp16_ir, every_draft):
    """One server with auto by default: the same prompt accepts drafts with the default and with auto, none
    with off (over gRPC and HTTP), and the tokens are the same (uncompressed weights, f16 cache)."""
    spec = {"speculation": "auto", "speculative_tokens": 4}
    exact = {"kv_cache_precision": "f16", "inference_precision": "f32"}
    running = Running(base_config(tiny_qwen3_fp16_ir, **spec, **exact, http_port=free_port()))
    # the random model's greedy reply to this prompt repeats a 4-token run of its own: lookup finds it
    prompt = [5, 6, 7, 8] * 10
    try:
        request = {"prompt_token_ids": prompt, "max_new_tokens": 40, "ignore_eos": True, "timeout": TIMEOUT}
        with Client(running.target) as client:
            default = client.generate(**request)
            drafts_before = running.engine.stats().num_draft_tokens
            off = client.generate(**request, speculation="off")
            drafts_after_off = running.engine.stats().num_draft_tokens
            auto = client.generate(**request, speculation="auto")
        assert default.usage.accepted_draft_tokens > 0 and auto.usage.accepted_draft_tokens > 0
        assert off.usage.accepted_draft_tokens == 0 and drafts_after_off == drafts_before  # none was even proposed
        assert list(off.token_ids) == list(default.token_ids) == list(auto.token_ids)

        url = f"http://127.0.0.1:{running.server.http.port}/v1/completions"
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}

        def accepted(**extra):
            reply = httpx.post(url, json=body | extra, timeout=TIMEOUT)
            assert reply.status_code == 200, reply.text
            return reply.json()["usage"]["completion_tokens_details"]["accepted_prediction_tokens"]

        assert accepted(speculation="off") == 0 and accepted(speculation="auto") > 0
        refused = httpx.post(url, json=body | {"speculation": "always"}, timeout=TIMEOUT)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "speculation"
    finally:
        running.stop()


def test_a_request_may_opt_in_when_the_server_default_is_off(tiny_qwen3_fp16_ir, every_draft):
    auto = SamplingParams(max_new_tokens=40, ignore_eos=True, speculation="auto")
    plain = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompt = [5, 6, 7, 8] * 10
    (with_auto, without), stats = outputs(tiny_qwen3_fp16_ir, [prompt, prompt], 0, [auto, plain], speculative_tokens=4)
    assert with_auto == without and stats.num_accepted_tokens > 0, stats


# -- the cost model, kept up to date ---------------------------------------------------------------------
def feed(times: StepTimes, seconds_of, sizes=(1, 2, 4, 6), rounds=100) -> None:
    for _ in range(rounds):
        for n in sizes:
            times.observe(n, seconds_of(n))


def test_step_times_keep_what_each_size_costs_and_follow_a_change():
    times = StepTimes(overhead=8.0)
    assert times.predict(1) is None and times.cost(3) == 11.0  # nothing measured: the prior line F + T
    steady = {1: 0.0162, 2: 0.0169, 3: 0.0179, 4: 0.0197, 5: 0.0237, 6: 0.0237}  # not a line
    feed(times, steady.__getitem__, sizes=tuple(steady))
    assert all(times.predict(n) == pytest.approx(t) for n, t in steady.items())
    assert times.predict(5) - times.predict(4) > 2 * (times.predict(4) - times.predict(3))
    feed(times, lambda n: 1.2 * steady[n], sizes=tuple(steady), rounds=50)  # the machine got busier
    assert times.predict(3) == pytest.approx(1.2 * steady[3], rel=0.01)


def test_step_times_fill_sizes_never_seen():
    times = StepTimes(overhead=8.0)
    times.observe(2, 0.010)
    assert times.predict(1) == pytest.approx(0.010 * 9 / 10)  # beyond the table: along the prior line
    assert times.predict(12) == pytest.approx(0.010 * 20 / 10)
    times.observe(12, 0.030)
    assert times.predict(7) == pytest.approx(0.020)  # between two sizes: interpolated
    long_prompt = times.predict(400)
    times.observe(400, 10.0)  # beyond max_tokens: not the steps drafts are decided in
    assert times.predict(400) == long_prompt


def test_step_times_of_several_sequences_add_the_one_sequence_curves_difference():
    """A step of 8 sequences costs more than one sequence of 8 tokens; drafts beside them cost what the
    one-sequence curve adds per token, not the one-sequence step's time."""
    times = StepTimes()
    one = {1: 0.0126, 2: 0.0140, 8: 0.0158, 10: 0.0179, 16: 0.0214}
    for n, seconds in one.items():
        times.observe(n, seconds)
    times.observe(8, 0.0206, sequences=8)
    assert times.predict(8, sequences=8) == pytest.approx(0.0206)
    assert times.predict(10, sequences=8) == pytest.approx(0.0206 + 0.0179 - 0.0158)
    assert times.predict(9, sequences=4) == pytest.approx(times.predict(9))  # no step of 4 yet: the curve
    times.observe(11, 0.0150, sequences=8)  # a lucky fast draft step is not read directly
    assert times.predict(11, sequences=8) > times.predict(10, sequences=8)
    crowd = StepCost(times, tokens=8, produced=8, sequences=8)
    rarely = runs_of(*[0, 0, 0, 1] * 5)  # a draft kept a quarter of the time or so
    assert crowd.best(crowd.options(rarely, 5)) == 0  # beside 7 others: 5% more tokens, 7% dearer
    alone = StepCost(times, tokens=1, produced=1)
    assert alone.best(alone.options(rarely, 5)) == 1  # alone, the same draft is nearly free


def test_one_wild_step_moves_the_estimate_little():
    times = StepTimes()
    feed(times, lambda n: 0.010 + 0.001 * n)
    times.observe(1, 5.0)  # a stall 450 times the usual: counted as 1.5 times the table's
    assert times.predict(1) == pytest.approx(0.011 * (1 + StepTimes.ALPHA * 0.5))
    assert times.overhead == pytest.approx(10.0 * (1 + StepTimes.ALPHA * 0.5), rel=0.05)  # the gauge
    flat = StepTimes()
    feed(flat, lambda n: 1.0, sizes=(1, 8))  # the fixed part is everything
    assert flat.overhead == 64.0


def test_draft_costs_are_fitted_to_what_the_rows_share_does_not_explain():
    """Steps of 8 sequences (ms added by drafts, at 8 and 1000 tokens of context): one draft for each of the 8,
    ten for one of them, and two layouts between. What the one-sequence curve says their rows add is taken
    off; as one sequence, the fit splits the rest into a drafting sequence's and a context token's share, as
    one-token rows into a draft's context token's; each predicts the layouts it was not given."""
    times = StepTimes()
    for n, seconds in {1: 0.0100, 8: 0.0110, 16: 0.0150, 32: 0.0230}.items():
        times.observe(n, seconds)
    layouts = [(1, 10), (8, 1), (4, 5), (8, 2)]

    def steps(truth: DraftCosts) -> list[tuple[list[tuple[int, int]], float]]:
        return [([(k, c)] * m, times.rows_cost(8, m * k) + m * truth.of(k, c)) for c in (8, 1000) for m, k in layouts]

    sequence = DraftCosts(per_sequence=0.0002, per_context_token=0.0000025)
    times.fit_draft_costs(steps(sequence), 8, rows=False)
    fitted = times.draft_costs
    assert fitted is not None
    assert fitted.per_sequence == pytest.approx(sequence.per_sequence)
    assert fitted.per_context_token == pytest.approx(sequence.per_context_token)
    assert fitted.per_draft_context_token == 0.0
    assert fitted.of(3, 500) == pytest.approx(0.0002 + 0.0000025 * 500)
    assert fitted.of(0, 500) == 0.0  # no drafts add nothing
    rows = DraftCosts(per_draft_context_token=0.0000013)  # every draft reads the context
    times.fit_draft_costs(steps(rows), 8, rows=True)
    fitted = times.draft_costs
    assert fitted is not None
    assert fitted.per_draft_context_token == pytest.approx(rows.per_draft_context_token)
    assert fitted.per_sequence == fitted.per_context_token == 0.0
    assert fitted.of(10, 600) == pytest.approx(10 * fitted.of(1, 600))
    # noise that makes a share negative: it counts as none, never as drafts that save time
    for as_rows in (False, True):
        noisy = DraftCosts.fit([([(1, 8)], -0.001), ([(2, 8)], 0.0005), ([(1, 8), (1, 8)], 0.0002)], as_rows)
        assert min(noisy.per_sequence, noisy.per_context_token, noisy.per_draft_context_token) >= 0


def test_drafts_beside_other_sequences_cost_what_the_fit_and_the_live_steps_say():
    """Beside other sequences a request's drafts cost their rows' share plus DraftCosts' reads of the context,
    scaled by what live draft steps added against that; alone, the curve's difference only, never below 0
    (its one-token entry is another compiled copy's, and a noisy one made drafts look free)."""
    times = StepTimes()
    for n, seconds in {1: 0.0130, 2: 0.0125, 6: 0.0150, 11: 0.0170}.items():
        times.observe(n, seconds)
    times.observe(8, 0.0170, sequences=8)
    # 12.5 ms against 13.0: not a saving, and not free either (ROW_FLOOR of the step a row)
    assert times.draft_cost(1) == pytest.approx(StepTimes.ROW_FLOOR * 0.0130)
    rows_share = times.rows_cost(8, 5)
    # 8 to 13 rows: between measured sizes, then along the prior line (F = 8) beyond the largest
    assert rows_share == pytest.approx(0.0170 * (8 + 13) / (8 + 11) - (0.0150 + (0.0170 - 0.0150) * 2 / 5))
    assert times.draft_cost(5, 8, 8, context=300) == pytest.approx(rows_share)  # no fit yet: the rows' share
    times.draft_costs = DraftCosts(per_draft_context_token=0.0000025)
    predicted = times.draft_cost(5, 8, 8, context=300)
    assert predicted == pytest.approx(rows_share + 5 * 0.0000025 * 300)
    assert times.draft_cost(5, 1, 1, context=300) == pytest.approx(0.0150 - 0.0130)  # alone: the curve
    for _ in range(30):  # live steps with one request's 5 drafts took twice what the fit says
        times.observe_drafts(13, 0.0170 + 2 * predicted, 8, [(5, 300)])
    assert 1.8 < times.draft_scale <= 2.0
    assert times.draft_cost(5, 8, 8, context=300) == pytest.approx(times.draft_scale * predicted)
    for _ in range(100):  # a stall is clipped: the scale never passes MAX_DRAFT_SCALE
        times.observe_drafts(13, 1.0, 8, [(5, 300)])
    assert times.draft_scale == StepTimes.MAX_DRAFT_SCALE
    for _ in range(100):  # and comes back down when draft steps get cheap
        times.observe_drafts(13, 0.0170 + predicted / 4, 8, [(5, 300)])
    assert times.draft_scale == pytest.approx(1 / StepTimes.MAX_DRAFT_SCALE, rel=0.05)


def test_a_draft_is_never_free_so_the_live_steps_can_price_it():
    """The one-sequence curve has flat stretches (and noise can make it dip); a draft priced at 0 there could
    never be corrected by the live scale, which multiplies the price. A row costs at least ROW_FLOOR of its
    step, so live steps that show drafts dear raise their price."""
    times = StepTimes()
    for n, seconds in {1: 0.0120, 4: 0.0130, 5: 0.0150, 6: 0.0150, 8: 0.0155}.items():
        times.observe(n, seconds)
    times.observe(4, 0.0170, sequences=4)
    times.draft_costs = DraftCosts(per_draft_context_token=0.0000013)
    price = times.draft_cost(1, 5, 4, context=8)  # 5 to 6 rows: flat
    assert price == pytest.approx((StepTimes.ROW_FLOOR * 0.0150 + 0.0000013 * 8) * times.draft_scale)
    for _ in range(50):  # each of the 4 requests' one draft added 16 ms in live steps
        times.observe_drafts(8, 0.0170 + 0.016, 4, [(1, 8)] * 4)
    assert times.draft_scale == StepTimes.MAX_DRAFT_SCALE and times.draft_cost(1, 5, 4, context=8) > price


def test_the_warm_up_fits_draft_costs_on_the_real_model(tiny_qwen3_fp16_ir):
    """An engine that speculates by default measures its draft costs before serving."""
    engine = Engine(
        tiny_qwen3_fp16_ir,
        EngineConfig(kv_cache_gb=0.02, speculation="auto", kv_cache_precision="f16", inference_precision="f32"),
    )
    engine.start()
    try:
        costs = engine.core.step_times.draft_costs
        assert costs is not None
        assert min(costs.per_sequence, costs.per_context_token, costs.per_draft_context_token) >= 0
        assert costs.of(5, 100) >= 0 and engine.core.step_times.draft_cost(5, 8, 8, context=100) > 0
        assert engine.core.kv.pool.num_free == engine.core.kv.pool.num_blocks  # the warm-up took no block
    finally:
        engine.shutdown()


def test_the_cost_curve_measures_each_form_of_drafts_on_the_real_runner(tiny_qwen3_ir):
    from bench.speculative import cost_curve

    curve = cost_curve(str(tiny_qwen3_ir), (1, 3), max_drafts=2, repeats=1, contexts=(8, 40))["curves"]
    assert sorted(curve) == sorted(
        f"context {c}, batch {b}{form}" for c in (8, 40) for b in (1, 3) for form in ("", ", drafts as rows")
    )
    for key, rows in curve.items():
        batch = 3 if "batch 3" in key else 1
        assert [r["tokens"] for r in rows] == [batch, 2 * batch, 3 * batch]
        assert rows[0]["x_plain_step"] == 1.0 and all(r["seconds"] > 0 for r in rows)
