"""Speculative decoding on a real model: greedy output with speculation equals greedy output without it
(deterministic steps and fast ones, through preemption, on int8 weights, with penalties, logprobs and stop
strings), and the warm-up's step table. Engines of one configuration are shared by the module (shared_engine). The rules
without a model are in test_spec_rules.py."""

import asyncio
import dataclasses
import itertools
import random

import httpx
import numpy as np
import pytest

from service.client import Client
from service.core.config import EngineConfig
from service.core.outputs import FinishReason
from service.core.params import SamplingParams
from service.core.spec import DraftPolicy, Guess, PromptLookup
from service.core.stats import EngineStats
from service.engine import Engine, GenerationRequest
from service.engine.runner import ModelRunner, StepInput, as_rows
from tests.support.servers import TIMEOUT, Running, base_config, free_port

SERVED = {"kv_cache_precision": "u8"}  # int8 weights as served

# -- on a real model -------------------------------------------------------------------------------------
_ENGINES: dict[tuple[str, EngineConfig], Engine] = {}


@pytest.fixture(scope="module", autouse=True)
def _shared_engines():
    """Engines of one configuration are built once for the module and shut down after it."""
    yield
    for engine in _ENGINES.values():
        engine.shutdown()
    _ENGINES.clear()


DEFAULTS = {
    "kv_cache_gb": 0.02,
    "max_num_batched_tokens": 64,
    "kv_cache_precision": "f16",
    "inference_precision": "f32",
}
SPEC = {"speculative_tokens": 4, "speculation": "auto"}
COUNTERS = ("num_draft_tokens", "num_accepted_tokens", "num_verify_steps", "num_generated_tokens", "num_preemptions")


def shared_engine(model, **config) -> Engine:
    """A started engine of DEFAULTS and these settings, built once per module."""
    settings = EngineConfig(**(DEFAULTS | config))
    key = (str(model), settings)
    if key not in _ENGINES:
        engine = Engine(model, settings)
        engine.start()
        _ENGINES[key] = engine
    return _ENGINES[key]


def outputs(model, prompts, max_new, params=None, proposer=None, **config) -> tuple[list[list[int]], EngineStats]:
    """The tokens of each prompt, all submitted at once, on a shared engine; params[i] for prompt i (default:
    greedy). With logprobs, each token comes as (token, its logprob's token id, logprob). proposer replaces
    prompt lookup. The stats' counters are this call's."""
    engine = shared_engine(model, **config)
    settings = engine.core.config
    scheduler = engine.core.scheduler
    scheduler.proposer = proposer or PromptLookup(settings.prompt_lookup_max_ngram, settings.prompt_lookup_min_ngram)
    before = engine.stats()
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

    result = asyncio.run(main())
    after = engine.stats()
    stats = dataclasses.replace(after, **{c: getattr(after, c) - getattr(before, c) for c in COUNTERS})
    assert stats.num_free_blocks == stats.num_total_blocks
    assert sum(accepted) <= stats.num_accepted_tokens  # less when a stop dropped kept drafts
    return result, stats


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
    monkeypatch.setattr(DraftPolicy, "choose", lambda self, candidates, step: [limit for _, limit in candidates])


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fast"])
def test_speculation_gives_exactly_the_greedy_tokens(tiny_qwen3_fp16_ir, deterministic, every_draft):
    """Uncompressed weights and an f16 cache: a k+1-token verify step must reproduce one-token decoding, its
    drafts fed as one-token rows (deterministic steps) or as one sequence (fast ones)."""
    prompts = [TEXT, TEXT[10:] + TEXT[:10], [5, 6, 7] * 12]
    plain, _ = outputs(tiny_qwen3_fp16_ir, prompts, 40, deterministic=deterministic)
    spec = SPEC | {"deterministic": deterministic}
    fast, stats = outputs(tiny_qwen3_fp16_ir, prompts, 40, proposer=Oracle(prompts, plain), **spec)
    assert fast == plain
    looked_up, _ = outputs(tiny_qwen3_fp16_ir, prompts, 40, **spec)  # prompt lookup's drafts, mostly rejected
    assert looked_up == plain
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats
    # each verify step yields its kept drafts and one token; every other step one token per request
    assert 0 < stats.num_verify_steps <= stats.num_generated_tokens - stats.num_accepted_tokens


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fast"])
def test_speculation_through_preemption_gives_exactly_the_greedy_tokens(tiny_qwen3_fp16_ir, deterministic, every_draft):
    """Four requests of 100 tokens (prompt and reply) in a cache of 6 blocks of 32 tokens: requests are preempted
    while they speculate and recomputed later, and still reply what plain decoding with room for all does."""
    prompts = [[1000 + (i * (7 + j)) % 50 for i in range(60)] for j in range(4)]
    plain, _ = outputs(tiny_qwen3_fp16_ir, prompts, 40, deterministic=deterministic)
    sizing = shared_engine(tiny_qwen3_fp16_ir)
    block_bytes = sizing.info.kv_cache_bytes / (sizing.info.num_kv_blocks + 1)  # and the runner's padding block
    spec = SPEC | {"deterministic": deterministic}
    fast, stats = outputs(
        tiny_qwen3_fp16_ir, prompts, 40, proposer=Oracle(prompts, plain), kv_cache_gb=6 * block_bytes / 2**30, **spec
    )
    assert stats.num_preemptions > 0 and stats.num_accepted_tokens > 0, stats
    assert fast == plain


@pytest.fixture(scope="module")
def runner(tiny_qwen3_ir):
    """int8 weights, a u8 cache, f32 activations, deterministic steps: each test writes its own blocks from 0."""
    return ModelRunner(tiny_qwen3_ir / "openvino_model.xml", EngineConfig(kv_cache_gb=0.02))


@pytest.fixture(scope="module")
def fast_runner(tiny_qwen3_ir):
    """The same with fast steps (--no-deterministic): sequences go to the model as they come."""
    return ModelRunner(tiny_qwen3_ir / "openvino_model.xml", EngineConfig(kv_cache_gb=0.02, deterministic=False))


def test_draft_rows_are_computed_as_decode_steps_compute_them(runner, fast_runner):
    """int8 weights and a u8 cache: a verify step's rows are the rows one-token decode steps give, bit for bit,
    since deterministic steps feed every token as a one-token sequence on the request's block table. Fed as one
    many-token sequence (fast steps) they are not (the check that the test can tell)."""
    rng = np.random.default_rng(1)
    prompt, other = rng.integers(10, 1000, 30).tolist(), rng.integers(10, 1000, 20).tolist()
    table, other_table = [0, 1], [2]
    fed = rng.integers(10, 1000, 6).tolist()  # the request's last token and five drafts
    beside = StepInput([other[-1]], 20, other_table, 1)  # decode steps of two sequences, as in a batch
    results = []
    for r in (runner, fast_runner):
        r.execute([StepInput(prompt, 0, table, 1), StepInput(other, 0, other_table, 1)])
        decoded = np.stack([r.execute([StepInput([t], 30 + i, table, 1), beside])[0].copy() for i, t in enumerate(fed)])
        results.append((decoded, r.execute([StepInput(fed, 30, table, 6), beside])[:6].copy()))
    (decoded, verified), (fast_decoded, fast_verified) = results
    np.testing.assert_array_equal(verified, decoded)
    assert not np.array_equal(fast_verified, fast_decoded)
    assert [r.token_ids for r in as_rows([StepInput(fed, 30, table, 6)])] == [[t] for t in fed]


def test_a_lone_decoding_row_is_computed_as_beside_other_sequences(runner):
    """int8 weights and a u8 cache: a request decoding alone gets the very logits its row gets beside another
    sequence. The CPU plugin's matmuls compute a step of one row otherwise (on AVX2 SmolLM2's logits moved by
    0.01), and its attention sums fewer one-token rows than threads in per-block partials: the runner pads a
    lone row with a row of its own and adds an empty sequence."""
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
    """int8 weights and a u8 cache, as served: a request decoding alone gets with drafts the tokens and
    log-probabilities it gets without (its drafts go as rows, computed as its decode steps compute them)."""
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True, logprobs=1)]
    plain, _ = outputs(tiny_qwen3_ir, [TEXT[:30]], 0, params, **SERVED)
    fast, stats = outputs(tiny_qwen3_ir, [TEXT[:30]], 0, params, Oracle([TEXT[:30]], plain), **SERVED, **SPEC)
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
    fast, stats = outputs(tiny_qwen3_ir, prompts, 0, params, oracle, **SPEC, kv_cache_precision="u8")
    assert stats.num_accepted_tokens > 0, stats
    assert fast == plain


def test_speculation_as_served_gives_plain_decodings_logprobs_while_prompts_arrive(tiny_qwen3_ir, every_draft):
    """int8 weights and a u8 cache at default settings, as served: two requests decoding with drafts get the
    tokens and the very log-probabilities they get without, while prompts of 100 tokens arrive."""
    config = EngineConfig(kv_cache_gb=0.02, max_num_seqs=16, enable_prefix_caching=False)
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
    fast, stats = outputs(tiny_qwen3_fp16_ir, prompts, 0, params, oracle, **SPEC)
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
    what shares them) gives one reply, log-probabilities included; and since verification draws once per
    emitted token, the reply is the one plain decoding gives."""
    seeded = SamplingParams(
        max_new_tokens=40, temperature=0.1, presence_penalty=0.2, seed=77, ignore_eos=True, logprobs=2
    )
    crowd = [SamplingParams(max_new_tokens=30, temperature=t, seed=None, ignore_eos=True) for t in (0.0, 0.9, 0.3)]
    others = [[5, 6, 7] * 12, TEXT[20:], TEXT[5:40]]
    (plain,), _ = outputs(tiny_qwen3_fp16_ir, [TEXT], 0, [seeded])
    spec = SPEC | {"proposer": Oracle([TEXT], [plain])}
    (alone,), stats = outputs(tiny_qwen3_fp16_ir, [TEXT], 0, [seeded], **spec)
    crowded, _ = outputs(tiny_qwen3_fp16_ir, [*others, TEXT], 0, [*crowd, seeded], **spec)
    assert stats.num_accepted_tokens > 0, stats  # some drafts were kept: the sampled path ran
    assert crowded[-1] == alone == plain  # log-probabilities too: deterministic steps


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
            details = reply.json()["usage"]["completion_tokens_details"]
            assert details["accepted_prediction_tokens"] == 0  # lookup's drafts are no predicted output's
            return details["accepted_draft_tokens"]

        assert accepted(speculation="off") == 0 and accepted(speculation="auto") > 0
        refused = httpx.post(url, json=body | {"speculation": "always"}, timeout=TIMEOUT)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "speculation"
    finally:
        running.stop()


def test_a_request_may_opt_in_when_the_server_default_is_off(tiny_qwen3_fp16_ir, every_draft):
    auto = SamplingParams(max_new_tokens=40, ignore_eos=True, speculation="auto")
    plain = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompt = [5, 6, 7, 8] * 10
    # the default engine: speculation off for requests that do not choose, up to 10 drafts for those that opt in
    (with_auto, without), stats = outputs(tiny_qwen3_fp16_ir, [prompt, prompt], 0, [auto, plain])
    assert with_auto == without and stats.num_accepted_tokens > 0, stats


def test_the_warm_up_measures_the_step_table_on_the_real_model(tiny_qwen3_fp16_ir):
    """An engine that speculates by default measures its step table before serving: a lone request's steps of 1
    to K + 1 tokens and larger ones, each no cheaper than a smaller one, taking no block. One that does not
    judges drafts by the prior line."""
    engine = shared_engine(tiny_qwen3_fp16_ir, **SPEC)
    table = engine.core.step_times
    assert {1, 2, 3, 4, 5, 16, 64} <= set(table.seconds)
    assert all(a <= b for a, b in itertools.pairwise(table.seconds.values())) and table.cost(1) > 0
    assert engine.core.kv.pool.num_free == engine.core.kv.pool.num_blocks
    assert shared_engine(tiny_qwen3_fp16_ir).core.step_times.seconds == {}


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
