"""Speculative decoding: prompt lookup, greedy acceptance and the scheduler's planning and rollback without a
model; then on a real model, greedy output with speculation equals greedy output without it."""

import asyncio
import itertools

import pytest

from service.core.config import EngineConfig
from service.core.kv_cache import KVCacheManager
from service.core.outputs import FinishReason
from service.core.params import SamplingParams
from service.core.request import Request
from service.core.scheduler import Scheduler
from service.core.speculative import PromptLookup, accept_greedy
from service.engine import Engine

IDS = itertools.count()
BS = 4


def test_prompt_lookup_continues_the_latest_match_of_the_longest_suffix():
    lookup = PromptLookup(max_ngram=3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 1, 2, 3, 4]
    assert lookup.propose(tokens, 2) == [6, 7]  # [2, 3, 4] last seen before 6, 7
    assert lookup.propose([5, 6, 7, 8, 6], 3) == [7, 8, 6]  # only a 1-gram matches
    assert lookup.propose([1, 2, 3], 4) == []  # nothing repeats
    assert lookup.propose([7, 7], 5) == [7]  # the continuation may be short
    assert lookup.propose([4], 2) == []


def test_accept_greedy_keeps_the_agreeing_run_and_the_models_token():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all agree: a bonus token
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_greedy([5, 6, 7], [4, 6, 7, 8]) == [4]  # none agree: still one token
    assert accept_greedy([], [3]) == [3]


def scheduler(k=3, max_seqs=4, num_blocks=32, max_model_len=64) -> Scheduler:
    config = EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=64, speculative_tokens=k, speculative_max_seqs=max_seqs
    )
    return Scheduler(config, KVCacheManager(num_blocks, BS), max_model_len)


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
    assert (s.num_draft_tokens, s.num_accepted_tokens) == (5, 2)
    assert s.schedule().chunks[0].start == 15


def test_a_stop_inside_the_accepted_run_ends_the_request_there():
    s = scheduler()
    r = decoding(s, [1, 2, 3, 4, 5, 6, 7, 8, 9], stop_token_ids=(7,))
    plan = s.schedule()
    assert s.update(plan, [[6, 7, 8, 9]]) == [r]
    assert r.output_token_ids == [5, 6, 7] and r.finish_reason is FinishReason.STOP
    assert s.kv.pool.num_free == 32


@pytest.mark.parametrize(
    "params",
    [{"temperature": 0.8}, {"repetition_penalty": 1.2}, {"presence_penalty": 0.5}, {"logprobs": 2}],
    ids=["sampled", "repetition", "presence", "logprobs"],
)
def test_only_plain_greedy_requests_speculate(params):
    s = scheduler()
    decoding(s, [1, 2, 3, 4, 5, 6, 7, 8, 9], **params)
    assert s.schedule().chunks[0].drafts == ()


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


def test_min_new_tokens_pending_means_no_drafts():
    s = scheduler()
    decoding(s, [1, 2, 3, 4, 5, 6, 7, 8, 9], min_new_tokens=3, eos_token_ids=(99,))
    assert s.schedule().chunks[0].drafts == ()


# -- on a real model -------------------------------------------------------------------------------------
def greedy_outputs(model, prompts, max_new, **config) -> tuple[list[list[int]], object]:
    engine = Engine(
        model, EngineConfig(kv_cache_gb=0.02, max_num_batched_tokens=64, kv_cache_precision="f16", **config)
    )
    engine.start()
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)

    async def one(prompt):
        tokens = []
        async for out in engine.generate(prompt, params):
            tokens += out.token_ids
        return tokens

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    try:
        outputs = asyncio.run(main())
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        return outputs, stats
    finally:
        engine.shutdown()


def test_speculation_gives_exactly_the_greedy_tokens(tiny_qwen3_fp16_ir):
    """Uncompressed weights and an f16 cache: a k+1-token verify step must reproduce one-token decoding."""
    text = [1000 + (i * 7) % 50 for i in range(60)]  # a prompt with repeats, so lookup has something to offer
    prompts = [text, text[10:] + text[:10], [5, 6, 7] * 12]
    plain, _ = greedy_outputs(tiny_qwen3_fp16_ir, prompts, 40)
    fast, stats = greedy_outputs(tiny_qwen3_fp16_ir, prompts, 40, speculative_tokens=4)
    assert fast == plain
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats


def test_drafts_adapt_to_what_the_request_accepts():
    s = scheduler(k=4)
    r = decoding(s, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9])  # first token 9: lookup offers 1, 2, 3, 4
    plan = s.schedule()
    assert len(plan.chunks[0].drafts) == 4
    s.update(plan, [[5]])  # the model rejects the first draft
    assert r.max_drafts == 1
    plan = s.schedule()
    assert len(plan.chunks[0].drafts) == 1
    s.update(plan, [[*plan.chunks[0].drafts, 5]])  # accepted in full: offer more again
    assert r.max_drafts == 2


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
