"""The engine on a real converted model (tiny synthetic Qwen3), against the stateful IR as reference."""

import asyncio
import random

import numpy as np
import openvino as ov
import pytest

from service.core.outputs import FinishReason
from service.core.params import SamplingParams
from service.engine import Engine, EngineConfig, GenerationRequest
from service.engine.runner import ModelRunner, StepInput
from service.errors import InvalidArgument
from tests.support.engine import GREEDY, NEW, PRECISION, assert_no_blocks_held, collect, prompts, run
from tests.support.reference import StatefulReference


@pytest.fixture(scope="module")
def engine(tiny_qwen3_fp16_ir):
    e = Engine(
        tiny_qwen3_fp16_ir,
        EngineConfig(
            kv_cache_gb=0.02,
            max_num_batched_tokens=64,
            max_num_seqs=8,
            kv_cache_precision=PRECISION,
            inference_precision="f32",
        ),
    )
    e.start()
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_qwen3_fp16_ir):
    return StatefulReference(tiny_qwen3_fp16_ir)


def test_greedy_matches_reference(engine, reference):
    prompt = prompts(1, seed=1)[0]
    tokens, _, last = run(collect(engine, prompt))
    assert tokens == reference.greedy(prompt, NEW)
    assert len(set(tokens)) > 1, "the test model should not repeat one token"
    assert last.finish_reason is FinishReason.LENGTH
    assert last.usage.prompt_tokens == len(prompt) and last.usage.completion_tokens == NEW
    assert last.timings.ttft > 0 and last.timings.total >= last.timings.ttft


def test_mixed_prefill_and_decode_match_reference(engine, reference):
    ps = prompts(8, seed=2)

    async def main():
        return await asyncio.gather(*(collect(engine, p, delay=0.01 * i) for i, p in enumerate(ps)))

    results = run(main())
    for p, (tokens, _, _) in zip(ps, results, strict=True):
        assert tokens == reference.greedy(p, NEW)
    assert_no_blocks_held(engine)


def test_requests_ending_one_by_one_stay_exact(engine, reference):
    """As requests end, the remaining ones' steps change shape: their tokens are still exactly the reference's."""
    ps = prompts(6, seed=3)
    lengths = [3, 5, 7, 9, 11, 13]

    async def main():
        return await asyncio.gather(
            *(
                collect(engine, p, SamplingParams(max_new_tokens=n, ignore_eos=True))
                for p, n in zip(ps, lengths, strict=True)
            )
        )

    results = run(main())
    for p, n, (tokens, _, _) in zip(ps, lengths, results, strict=True):
        assert tokens == reference.greedy(p, n)
    assert_no_blocks_held(engine)


def test_preemption_keeps_outputs_exact(engine, tiny_qwen3_fp16_ir, reference):
    block_bytes = engine.info.kv_cache_bytes / engine.info.num_kv_blocks
    # 8 blocks of 32 tokens: four 100-token sequences cannot all fit at once.
    config = EngineConfig(
        kv_cache_gb=8 * block_bytes / 2**30,
        max_num_batched_tokens=64,
        kv_cache_precision=PRECISION,
        inference_precision="f32",
    )
    small = Engine(tiny_qwen3_fp16_ir, config)
    small.start()
    try:
        ps = prompts(4, seed=3)
        ps = [p[:60] + [7] * max(0, 60 - len(p)) for p in ps]
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)

        async def main():
            return await asyncio.gather(*(collect(small, p, params) for p in ps))

        results = run(main())
        assert small.stats().num_preemptions > 0
        for p, (tokens, _, _) in zip(ps, results, strict=True):
            assert tokens == reference.greedy(p, 40)
        assert_no_blocks_held(small)
    finally:
        small.shutdown()


def test_prefix_cache_hit_gives_same_tokens(engine):
    prompt = prompts(1, seed=4)[0] + list(range(1000, 1100))
    cold, _, first = run(collect(engine, prompt))
    warm, _, second = run(collect(engine, prompt))
    assert warm == cold
    assert first.usage.cached_prompt_tokens == 0
    assert second.usage.cached_prompt_tokens >= len(prompt) - engine.info.block_size


def test_seeded_sampling_reproducible_across_batches(engine):
    prompt = prompts(1, seed=5)[0]
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone, _, _ = run(collect(engine, prompt, params))

    async def crowded():
        others = [collect(engine, p, SamplingParams(max_new_tokens=NEW, temperature=0.8)) for p in prompts(5, 6)]
        return (await asyncio.gather(collect(engine, prompt, params), *others))[0]

    assert run(crowded())[0] == alone


def test_stop_string_truncates_text(engine):
    prompt = prompts(1, seed=7)[0]
    _, text, _ = run(collect(engine, prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True)))
    assert len(text) > 4
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    _, cut, last = run(collect(engine, prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True, stop=(stop,))))
    assert cut == text[: text.index(stop)]
    assert last.finish_reason is FinishReason.STOP
    assert_no_blocks_held(engine)


def test_abort_mid_stream_frees_blocks(engine):
    async def main():
        stream = engine.generate(
            GenerationRequest(prompts(1, seed=8)[0], SamplingParams(max_new_tokens=200, ignore_eos=True))
        )
        async for _ in stream:
            break
        await stream.aclose()

    run(main())
    assert_no_blocks_held(engine)


def test_bad_inputs_raise_invalid_argument(engine):
    async def first(prompt, params=GREEDY):
        async for _ in engine.generate(GenerationRequest(prompt, params)):
            break

    with pytest.raises(InvalidArgument, match="prompt"):
        run(first([]))
    with pytest.raises(InvalidArgument, match="context"):
        run(first([5] * engine.info.max_model_len))
    with pytest.raises(InvalidArgument, match="vocabulary"):
        run(first([10**7]))
    with pytest.raises(InvalidArgument, match="top_p"):
        run(first([5, 6], SamplingParams(top_p=0)))
    assert run(collect(engine, [5, 6]))[0]  # still serving


def test_streamed_text_of_chinese_and_emoji_round_trips(engine):
    text = "你好，世界！今天天气很好 😀🎉 写作助手"
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    from service.core.detokenizer import IncrementalDetokenizer

    d = IncrementalDetokenizer(engine.tokenizer.decode)
    deltas = [d.add([t]) for t in ids] + [d.flush()]
    assert "".join(deltas) == engine.tokenizer.decode(ids) == text
    assert all("\ufffd" not in piece for piece in deltas)


def test_failed_step_fails_its_requests_and_engine_keeps_serving(engine, monkeypatch):
    real_step = engine.core.runner.step
    calls = {"n": 0}

    def fail_once(seqs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return real_step(seqs)

    monkeypatch.setattr(engine.core.runner, "step", fail_once)
    from service.errors import EngineFailure

    with pytest.raises(EngineFailure, match="injected failure"):
        run(collect(engine, [5, 6, 7]))
    assert_no_blocks_held(engine)
    tokens, _, _ = run(collect(engine, [5, 6, 7]))
    assert len(tokens) == NEW


def test_deterministic_steps_feed_every_token_as_a_row_and_never_one_row_alone(tiny_qwen3_ir):
    """Deterministic steps (the default): a prompt piece goes to the model as one-token rows, a lone decoding
    row gets a padding row on the runner's own block (never a request's), and a row's logits are the same
    whether its position ends a prompt piece or is decoded beside another request. Fast steps feed the piece as
    it comes, and its last row is computed otherwise (the check that the test can tell)."""
    ir = tiny_qwen3_ir / "openvino_model.xml"
    rows, fast = (ModelRunner(ir, EngineConfig(kv_cache_gb=0.02, deterministic=d)) for d in (True, False))
    assert rows.pad_block == rows.num_blocks  # past every block a request can get
    rng = random.Random(3)
    prompt, other = [rng.randrange(100, 150_000) for _ in range(40)], [rng.randrange(100, 150_000) for _ in range(9)]
    ends = {}
    for runner in (rows, fast):
        runner.execute([StepInput(other, 0, [5], 1)])
        report = runner.step([StepInput(prompt, 0, [0, 1], 1)])
        ends[runner is rows] = report.logits[0].copy()
        assert report.shape_changed
        # tokens, sequences (an empty one after one-token rows) and logits rows (2 at least)
        assert runner.last_shape == ((40, 41, 2) if runner is rows else (40, 1, 2))
        assert not runner.step([StepInput(prompt, 0, [0, 1], 1)]).shape_changed  # the same shape again
        decoded = runner.execute([StepInput(prompt[-1:], 39, [0, 1], 1), StepInput(other[-1:], 8, [5], 1)])[0]
        assert np.array_equal(decoded, ends[runner is rows]) == (runner is rows)
        lone = runner.execute([StepInput(prompt[-1:], 39, [0, 1], 1)])[0]
        assert runner.last_shape == ((2, 3, 2) if runner is rows else (1, 2, 2))
        if runner is rows:
            assert np.array_equal(lone, decoded)


def test_a_prompts_first_logits_do_not_depend_on_another_prompt_ending_in_its_step(tiny_qwen3_ir):
    """int8 weights, deterministic steps: two prompts' last pieces in one step give the first prompt the logits
    it gets alone (its rows are computed alike whatever shares the step, its logits row beside another too)."""
    runner = ModelRunner(tiny_qwen3_ir / "openvino_model.xml", EngineConfig(kv_cache_gb=0.02))
    rng = random.Random(1)
    first, ending = ([rng.randrange(100, 150_000) for _ in range(64)] for _ in range(2))
    alone = runner.execute([StepInput(first, 0, [0, 1, 2], 1)])[0].copy()
    together = runner.execute([StepInput(first, 0, [0, 1, 2], 1), StepInput(ending, 0, [20, 21, 22], 1)])
    assert np.array_equal(together[0], alone)


def test_a_u8_cache_keeps_a_tokens_key_whatever_is_written_after_it_in_its_block(tiny_qwen3_fp16_ir):
    """Rejected drafts are written into the cache and then written over: with keys quantized by token, the
    tokens before them read back exactly as before, so a position computed again gives the same logits (with
    keys quantized by channel over the block, the drafts' values changed the block's scales)."""
    runner = ModelRunner(
        tiny_qwen3_fp16_ir / "openvino_model.xml", EngineConfig(kv_cache_gb=0.02, inference_precision="f32")
    )
    assert runner.cache_format.count(":u8[") == len(runner.cache_arrays())
    prompt = prompts(1, seed=7)[0][:20]
    blocks = [0, 1]
    runner.execute([StepInput(prompt, 0, blocks, 1)])
    first = runner.execute([StepInput([prompt[-1]], 20, blocks, 1)]).copy()
    rng = np.random.default_rng(3)
    for _ in range(3):  # drafts of very different tokens, rejected, at the positions after it
        drafts = rng.integers(10, 1000, 8).tolist()
        runner.execute([StepInput([prompt[-1], *drafts], 20, blocks, 9)])
    again = runner.execute([StepInput([prompt[-1]], 20, blocks, 1)])
    np.testing.assert_array_equal(again, first)


async def _all_logprobs(engine: Engine, prompt, params):
    out = []
    async for chunk in engine.generate(GenerationRequest(prompt, params)):
        out += chunk.logprobs
    return out


def test_int4_weights_are_served_as_the_stateful_ir_runs_them(tiny_qwen3_int4_ir):
    """The converter's int4 mode: the paged model the engine builds from the IR gives the greedy tokens the
    stateful IR gives, alone and batched, with 4-bit weights in the matmuls."""
    ir = ov.Core().read_model(tiny_qwen3_int4_ir / "openvino_model.xml")
    assert any(op.get_output_element_type(0).get_type_name() in ("u4", "i4") for op in ir.get_ops())
    # without dynamic quantization of activations on either side: it rounds a many-token step differently
    config = EngineConfig(
        kv_cache_gb=0.02,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        kv_cache_precision=PRECISION,
        inference_precision="f32",
        dq_group_size=0,
    )
    engine = Engine(tiny_qwen3_int4_ir, config)
    engine.start()
    try:
        ps = prompts(4, seed=5)
        reference = StatefulReference(tiny_qwen3_int4_ir, DYNAMIC_QUANTIZATION_GROUP_SIZE=0)

        async def main():
            return await asyncio.gather(*(collect(engine, p) for p in ps))

        for p, (tokens, _, _) in zip(ps, run(main()), strict=True):
            assert tokens == reference.greedy(p, NEW)
    finally:
        engine.shutdown()


def test_a_prompts_logprobs_do_not_depend_on_what_shares_its_steps(tiny_qwen3_ir):
    """int8 weights and a u8 cache, as served: a prompt computed alone and beside 6 or 14 decoding requests
    gets the same first-token log-probabilities to the bit, though the others leave it another room in each
    step and so cut it elsewhere."""
    config = EngineConfig(kv_cache_gb=0.02, max_num_seqs=16, enable_prefix_caching=False)  # computed twice
    engine = Engine(tiny_qwen3_ir, config)
    engine.start()
    try:
        prompt = [random.Random(21).randrange(100, 150_000) for _ in range(150)]
        first = SamplingParams(max_new_tokens=1, logprobs=5)
        others = [p[:20] for p in prompts(14, seed=22)]

        async def beside_decoders(n: int):
            decoding = SamplingParams(max_new_tokens=60, ignore_eos=True)
            generated = engine.stats().num_generated_tokens
            busy = [asyncio.create_task(collect(engine, p, decoding)) for p in others[:n]]
            while engine.stats().num_generated_tokens < generated + 3 * n:  # every prompt computed: all decode
                await asyncio.sleep(0.001)
            result = await _all_logprobs(engine, prompt, first)
            await asyncio.gather(*busy)
            return result

        alone = run(_all_logprobs(engine, prompt, first))
        busy = {n: run(beside_decoders(n)) for n in (6, 14)}
        assert len(alone) == len(busy[6]) == len(busy[14]) == 1
        assert alone == busy[6] == busy[14]
    finally:
        engine.shutdown()


def test_a_request_decoding_alone_gets_the_logprobs_it_gets_beside_another(tiny_qwen3_ir):
    """int8 weights and a u8 cache, as served: a request's log-probabilities are the same to the bit whether it
    decodes alone or beside another request (the runner never lets a row be computed alone)."""
    config = EngineConfig(kv_cache_gb=0.02, enable_prefix_caching=False)
    engine = Engine(tiny_qwen3_ir, config)
    engine.start()
    try:
        prompt, other = ([random.Random(51 + i).randrange(100, 150_000) for _ in range(40)] for i in range(2))
        params = SamplingParams(max_new_tokens=60, ignore_eos=True, logprobs=3)

        async def beside():
            return await asyncio.gather(_all_logprobs(engine, prompt, params), _all_logprobs(engine, other, params))

        alone = run(_all_logprobs(engine, prompt, params))
        assert len(alone) == 60
        assert run(beside())[0] == alone
    finally:
        engine.shutdown()


def test_decoding_logprobs_do_not_depend_on_prompts_sharing_their_steps(tiny_qwen3_ir):
    """int8 weights and a u8 cache, as served: two requests decoding alone and while prompts of 100 tokens
    arrive get the same log-probabilities at every position, to the bit."""
    config = EngineConfig(kv_cache_gb=0.02, max_num_seqs=16, enable_prefix_caching=False)
    engine = Engine(tiny_qwen3_ir, config)
    engine.start()
    try:
        decoders = [[random.Random(31 + i).randrange(100, 150_000) for _ in range(20)] for i in range(2)]
        params = SamplingParams(max_new_tokens=120, ignore_eos=True, logprobs=3)
        arriving = [[random.Random(41 + i).randrange(100, 150_000) for _ in range(100)] for i in range(6)]

        async def decode(with_prompts: bool):
            tasks = [asyncio.create_task(_all_logprobs(engine, p, params)) for p in decoders]
            if with_prompts:
                for p in arriving:
                    await asyncio.sleep(0.005)
                    await collect(engine, p, SamplingParams(max_new_tokens=1))
                assert not any(t.done() for t in tasks)  # every prompt was computed while they decoded
            return await asyncio.gather(*tasks)

        alone = run(decode(False))
        beside = run(decode(True))
        assert engine.stats().num_prompt_tokens >= 2 * 20 + 6 * 100
        assert all(len(x) == 120 for x in alone)
        assert alone == beside
    finally:
        engine.shutdown()
