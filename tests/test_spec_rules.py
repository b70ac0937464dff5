"""Speculative decoding's rules, without a model: prompt lookup, greedy acceptance, verification of sampled
requests, what guesses earn, the draft policy's cost gate and its table, and the scheduler's planning and
rollback of drafts. The engine tests are in test_speculative.py."""

import itertools
import random

import numpy as np
import pytest

from service.api.ovserve.v1 import ovserve_pb2 as pb
from service.client import build_request
from service.config import parse_args
from service.core.config import EngineConfig
from service.core.kv_cache import KVCacheManager
from service.core.outputs import FinishReason
from service.core.params import SamplingParams
from service.core.request import Request
from service.core.sampler import sample, verify
from service.core.scheduler import Scheduler
from service.core.spec import (
    DraftPolicy,
    DraftStats,
    Guess,
    GuessRecord,
    PromptLookup,
    StepLoad,
    StepTimes,
    accept_greedy,
)
from service.core.spec.acceptance import PRIOR_ACCEPTANCE
from service.errors import InvalidArgument
from service.rpc import wire

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
    {"temperature": 0.0, "logit_bias": ((1, 2.5), (4, -100.0))},
    {"temperature": 0.9, "seed": 9, "logit_bias": ((2, 1.5), (5, -3.0)), "presence_penalty": 0.5},
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
    assert r.draft_stats.record_of_all is s.policy.record and plan.chunks[0].drafts[:3] == (1, 2, 3)
    s.update(plan, [[1, 2, 9]])  # the reply left the guess after two
    assert s.policy.record.by_kind[3].counts == pytest.approx([0.0, 0.0, 1.0])


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
    """k drafts for a request whose steps yield E(k) tokens raise the step's rate from produced / cost(T) to
    (produced + E(k) - 1) / cost(T + k): the policy takes the k that maximizes it (here the prior line, F = 8)."""

    def best(stats: DraftStats, tokens: int, produced: int, limit: int = 5) -> int:  # no step before to keep
        return DraftPolicy(8, StepTimes(8)).choose([(stats, limit)], StepLoad(tokens, tokens, produced))[0]

    assert best(runs_of(*[8] * 10), 1, 1) == 5  # one stream copying its input: every draft pays
    assert best(runs_of(*[0] * 10), 1, 1) == 0  # guesses that miss never pay
    assert best(runs_of(*[0, 1] * 10), 1, 1) == 1  # runs of one: a second draft would never be kept
    assert best(DraftStats(), 32, 32) == 0  # 32 decoding requests: compute-bound
    assert best(runs_of(*[0, 2] * 10), 32, 32) == 0
    assert best(runs_of(*[8] * 10), 32, 32) == 5  # copying still gains
    assert best(runs_of(*[8] * 10), 8, 8) == 5  # beside 7 others, a request that copies its input gains
    assert best(DraftStats(), 200, 1) == 5  # beside a prompt piece the step is slow anyway: its outputs are dear


def test_each_requests_rows_are_priced_after_those_chosen_before_it():
    """The table's step of 7 rows costs three times that of 6 (a kernel's step): of two copying requests, the
    first takes the drafts that fill the cheap rows and the second none."""
    table = StepTimes()
    table.set({1: 0.0100, 2: 0.0101, 3: 0.0102, 4: 0.0103, 5: 0.0104, 6: 0.0105, 7: 0.0300, 8: 0.0301})
    policy = DraftPolicy(8, table)
    copying = runs_of(*[8] * 10)
    assert policy.choose([(copying, 5), (copying, 5)], StepLoad(2, 2, 2)) == [4, 0]
    assert policy.choose([(copying, 5)], StepLoad(1, 1, 1)) == [5]
    assert policy.speculates(8) and not policy.speculates(9)  # more running requests than max_sequences: none


def test_drafts_kept_less_often_than_their_records_promise_scale_every_promise_down():
    """The records promise a request that copies about 4 of 5 drafts; verification keeps 1 of each 5 offered:
    the policy scales the promised gains by what was kept against what was expected, and stops the drafts that
    only paid at the promised rate. It never scales a promise up, nor below half (it learns only from the drafts
    it lets through)."""
    table = StepTimes()
    table.set({4: 0.0189, 5: 0.0234, 6: 0.0247, 7: 0.0289, 8: 0.0352, 9: 0.0352})  # 4 rows: measured on 2 cores
    policy = DraftPolicy(8, table)
    copying = runs_of(*[4] * 10)
    step = StepLoad(4, 4, 4)
    first = policy.choose([(copying, 5)], step)[0]
    assert first > 0 and policy.calibration() == 1.0
    policy.verified(copying, first, first)  # kept all: still 1, never above
    assert policy.calibration() == 1.0
    for _ in range(60):
        k = policy.choose([(copying, 5)], step)[0] or 5
        policy.verified(copying, k, 1)
    assert policy.kept / policy.expected_kept < 0.5 and policy.calibration() == DraftPolicy.CALIBRATION_FLOOR
    assert policy.choose([(copying, 5)], step) == [0]
    assert policy.choose([(runs_of(*[8] * 10), 5)], StepLoad(1, 1, 1))[0] > 0  # alone, drafts still pay
    policy.verified(DraftStats(), 3, 3)  # drafts the policy did not offer (none chosen through it): ignored
    assert policy.kept / policy.expected_kept < 0.5


def test_a_step_keeps_its_rows_unless_a_change_pays():
    """A step of other rows than the one before costs a change of shape: a request takes a number of drafts that
    changes them only when what the switch saves over HORIZON steps exceeds two changes (drafts come and go with
    the matches, so a switch is undone before long), or once the steps kept have given up that much (regret)."""
    table = StepTimes()
    table.set({1: 0.0162, 2: 0.0169, 3: 0.0179, 4: 0.0197, 5: 0.0237, 6: 0.0237})
    copying = runs_of(*[5] * 10)  # every guess kept whole

    def chosen(last_drafts: int | None, change: float, limit: int = 5) -> int:
        table.change_seconds = change
        policy = DraftPolicy(8, table)
        policy.last = None if last_drafts is None else (1, 1 + last_drafts)
        return policy.choose([(copying, limit)], StepLoad(1))[0]

    assert [chosen(last, 0.005) for last in range(6)] == [5] * 6  # 5 ms: 4 steps at 20% faster pay two changes
    assert [chosen(last, 0.009) for last in (4, 3, 2)] == [4, 3, 5]  # 9 ms: from 3 or 4 drafts, keep them
    assert chosen(4, 0.020) == 4 and chosen(0, 0.020) == 5  # 20 ms: but 6 tokens a step instead of 1 pays
    assert chosen(4, 0.020, limit=2) == 2 and chosen(None, 0.020) == 5  # never past the limit; no shape: the best
    table.change_seconds = 0.009
    policy = DraftPolicy(8, table)
    policy.last = (1, 5)  # four drafts; a switch to five saves too little over HORIZON, but regret adds up
    kept = 0
    while policy.choose([(copying, 5)], StepLoad(1)) == [4]:
        kept += 1
        assert kept < 50
    assert kept > 1 and policy.regret == 0.0 and policy.last == (1, 6)
    policy.last = (2, 5)  # another number of sequences: the shape changes anyway, the best numbers
    assert policy.choose([(copying, 5)], StepLoad(1)) == [5]


def test_beside_other_sequences_a_step_keeps_its_rows_unless_the_change_pays_within_the_step():
    """Several requests' step takes numbers that change the last step's rows only when its rate, a change's
    seconds added, beats the rate of the numbers that keep them, or once the steps kept have given up two
    changes' worth (regret): a step never stays filled with drafts that stopped paying."""
    table = StepTimes()
    table.set({1: 0.0126, 2: 0.0130, 4: 0.0140, 8: 0.0158, 16: 0.0214})
    missing, copying = runs_of(*[0] * 10), runs_of(*[8] * 10)

    def policy(last: tuple[int, int], change: float) -> DraftPolicy:
        table.change_seconds = change
        chosen = DraftPolicy(8, table)
        chosen.last = last
        return chosen

    two = StepLoad(2, 2, 2)
    # after a step without drafts: 10 tokens in 17.2 ms plus the change, against 2 in 13.0 ms
    assert policy((2, 2), 0.030).choose([(missing, 8), (copying, 8)], two) == [0, 8]
    kept = policy((2, 2), 0.060)
    assert kept.choose([(missing, 8), (copying, 8)], two) == [0, 0] and kept.last == (2, 2)
    # after one with five drafts: against 7 tokens in 15.35 ms, up to 4.7 ms
    assert policy((2, 7), 0.004).choose([(missing, 8), (copying, 8)], two) == [0, 8]
    slow = policy((2, 7), 0.005)
    steps = 0
    while slow.choose([(missing, 8), (copying, 8)], two) == [0, 5]:
        steps += 1
        assert steps < 10
    assert steps > 1 and slow.regret == 0.0 and slow.last == (2, 10)  # kept until they gave up two changes
    # a step with a prompt piece takes the piece's shape: the best numbers
    piece = policy((2, 7), 1.0)
    assert piece.choose([(missing, 8), (copying, 8)], StepLoad(40, 2, 1)) == [0, 8] and piece.last is None


def test_the_step_table_interpolates_extrapolates_and_never_prices_a_row_at_nothing():
    table = StepTimes(overhead=8.0)
    assert table.cost(3) == 11.0  # nothing measured: the prior line F + T
    table.set({1: 0.0162, 2: 0.0169, 4: 0.0197, 6: 0.0190, 8: 0.0250})
    assert table.seconds[6] == 0.0197  # a larger step never costs less (noise at warm-up)
    assert table.cost(3) == pytest.approx((0.0169 + 0.0197) / 2)  # between two sizes: interpolated
    assert table.cost(10) == pytest.approx(0.0197 + (0.0250 - 0.0197) * 2)  # beyond: the last two sizes' slope
    floor = StepTimes.ROW_FLOOR * 0.0197
    assert table.rows_cost(4, 2) == [0.0, pytest.approx(floor), pytest.approx(2 * floor)]  # 4 to 6 rows: flat
    one = StepTimes(overhead=8.0)
    one.set({2: 0.010})
    assert one.cost(1) == pytest.approx(0.010 * 9 / 10) and one.cost(12) == pytest.approx(0.010 * 20 / 10)
    gauge = StepTimes()
    gauge.set({1: 0.011, 8: 0.018})
    assert gauge.overhead == pytest.approx(10.0)  # F: the fixed part in units of a token's work
    flat = StepTimes()
    flat.set({1: 1.0, 8: 1.0})
    assert flat.overhead == 64.0


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


def test_a_short_guess_is_padded_to_the_number_of_drafts_its_step_keeps():
    fresh = scheduler(k=5)
    decoding(fresh, [1, 2, 3, 4, 5, 6, 7])  # first token 4: lookup has only 5, 6, 7, 4 after it
    assert fresh.schedule().chunks[0].drafts == (5, 6, 7, 4)  # a fifth draft could never be kept: not chosen
    s = scheduler(k=5)
    decoding(s, [1, 2, 3, 4, 5, 6, 7])
    s.policy.last = (1, 6)  # the last step had five drafts, and a change would cost more
    s.step_times.change_seconds = 1e9
    assert s.schedule().chunks[0].drafts == (5, 6, 7, 4, 4)  # the rows it keeps
    constrained = scheduler(k=5)
    r = decoding(constrained, [1, 2, 3, 4, 5, 6, 7])
    r.matcher = type("AnyToken", (), {"num_valid": staticmethod(len)})()  # a grammar that allows all
    constrained.policy.last = (1, 6)
    constrained.step_times.change_seconds = 1e9
    assert constrained.schedule().chunks[0].drafts == (5, 6, 7, 4)  # never padded past a grammar's check


def test_drafts_leave_room_for_the_prompt_pieces_after_them():
    """Other requests' drafts never take a prompt's room: with a budget of 32 and two requests decoding with up
    to 5 drafts each, a prompt arriving is cut at 30 and 40 as without speculation (drafts took the room and
    cut it at 20 first)."""

    def cuts(speculation: str) -> list[int]:
        config = EngineConfig(
            max_num_seqs=8,
            max_num_batched_tokens=32,
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

    assert cuts("off") == cuts("auto") == [30, 40]


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
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=13, speculation="auto", speculative_tokens=3)
    s = Scheduler(config, KVCacheManager(6, BS), 24, step_times=StepTimes(1000.0))
    s.speculative_tokens = 0  # set the scene without drafts
    a = Request(next(IDS), [1, 2, 1, 2, 1, 2], SamplingParams())
    s.add(a)
    s.update(s.schedule(), [[2]])
    b = Request(next(IDS), list(range(50, 66)), SamplingParams())
    s.add(b)
    s.update(s.schedule(), [[1]])
    # a decodes in 2 blocks; b computed the first 12 of its 16 prompt tokens in 3 blocks and needs 1 more for
    # the last 4 and 1 more for its first token: 1 block is free, the budget leaves room for drafts
    assert (a.num_computed_tokens, b.num_computed_tokens, s.kv.pool.num_free) == (7, 12, 1)
    s.speculative_tokens = 3
    plan = s.schedule()
    assert not plan.preempted and s.num_preemptions == 0
    assert [(c.request, c.num_tokens, c.drafts) for c in plan.chunks] == [(a, 1, ()), (b, 4, ())]


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
