"""Failure isolation on a real model: an exception at any stage of a step fails the requests of that step
(INTERNAL), frees their blocks, and the engine goes on serving; one request's row that fails to sample fails
that request alone; a request that always fails cannot make the engine loop."""

import asyncio

import numpy as np
import pytest

import service.core.sampler as sampler
import service.engine.sampling as engine_sampling
from service.core.params import SamplingParams
from service.engine import Engine, EngineConfig
from service.engine.runner import StepInput
from service.errors import EngineFailure
from tests.support.engine import assert_no_blocks_held, collect, run

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
POISON = 4242  # a prompt starting with this token fails every step it is in


@pytest.fixture(scope="module")
def engine(tiny_qwen3_ir):
    e = Engine(tiny_qwen3_ir, EngineConfig(kv_cache_gb=0.02, max_num_batched_tokens=64, max_num_seqs=4))
    e.start()
    yield e
    e.shutdown()


def poisoned(chunks_or_requests) -> bool:
    return any(getattr(x, "request", x).prompt_token_ids[0] == POISON for x in chunks_or_requests)


def inject(monkeypatch, engine: Engine, stage: str) -> None:
    """Make `stage` raise whenever the poisoned request takes part in it."""
    core = engine.core
    if stage == "schedule":
        real_schedule = core.scheduler.schedule

        def schedule():
            if poisoned(core.scheduler.waiting) or poisoned(core.scheduler.running):
                raise RuntimeError("injected planning failure")
            return real_schedule()

        monkeypatch.setattr(core.scheduler, "schedule", schedule)
    elif stage == "execute":
        real_step = core.runner.step

        def step(seqs):
            if any(list(s.token_ids[:1]) == [POISON] and s.past_len == 0 for s in seqs):
                raise RuntimeError("injected runner failure")
            return real_step(seqs)

        monkeypatch.setattr(core.runner, "step", step)
    elif stage == "sample":
        real_sample = engine_sampling.sample

        def sample(logits, requests, *masks):
            if poisoned(requests):
                raise RuntimeError("injected sampler failure")
            return real_sample(logits, requests, *masks)

        monkeypatch.setattr(engine_sampling, "sample", sample)
    elif stage == "sample_row":
        real_penalties = sampler._adjust_logits

        def penalties(row, params, output_token_ids, all_token_ids):
            if all_token_ids[0] == POISON:
                raise RuntimeError("injected row failure")
            real_penalties(row, params, output_token_ids, all_token_ids)

        monkeypatch.setattr(sampler, "_adjust_logits", penalties)
    elif stage == "nan_row":  # the model computed NaN for the poisoned request's row
        real_sample = engine_sampling.sample

        def sample(logits, requests, *masks):
            for row, request in enumerate(requests):
                if request.prompt_token_ids[0] == POISON:
                    logits[row, 3] = np.nan
            return real_sample(logits, requests, *masks)

        monkeypatch.setattr(engine_sampling, "sample", sample)
    elif stage == "update":
        real_update = core.scheduler.update

        def update(plan, sampled):
            finished = real_update(plan, sampled)  # state already changed: the worst moment to fail
            if poisoned(plan.chunks):
                raise RuntimeError("injected bookkeeping failure")
            return finished

        monkeypatch.setattr(core.scheduler, "update", update)


async def outcome(engine: Engine, prompt: list[int], delay: float = 0.0, params: SamplingParams = PARAMS) -> str:
    try:
        tokens, _, last = await collect(engine, prompt, params, delay=delay)
    except EngineFailure:
        return "failed"
    assert len(tokens) == params.max_new_tokens and last.finish_reason is not None
    return "ok"


@pytest.mark.parametrize("stage", ["schedule", "execute", "sample", "update"])
def test_a_failing_stage_fails_its_step_only_and_the_engine_goes_on(engine, monkeypatch, stage):
    inject(monkeypatch, engine, stage)
    failed_steps = engine.stats().num_failed_steps
    steps = engine.stats().num_steps

    async def traffic():
        healthy = [outcome(engine, [5, 6, 7 + i], delay=0.3) for i in range(3)]
        return await asyncio.gather(outcome(engine, [POISON, 1, 2, 3]), *healthy)

    poison, *others = run(traffic())
    assert poison == "failed"
    assert others == ["ok"] * 3  # they arrived after the poisoned step failed
    assert engine.stats().num_failed_steps == failed_steps + 1, "the failing request came back"
    assert_no_blocks_held(engine)
    monkeypatch.undo()
    assert run(outcome(engine, [POISON, 1, 2, 3])) == "ok"  # and the engine is whole again
    assert engine.stats().num_steps > steps


@pytest.mark.parametrize(
    ("stage", "expected", "steps"),
    [
        ("sample", ["failed", "failed", "ok"], 1),
        ("sample_row", ["ok", "failed", "ok"], 0),
        ("nan_row", ["ok", "failed", "ok"], 0),
    ],
    ids=["whole-sampler", "one-row", "non-finite-row"],
)
def test_a_failed_sampler_fails_its_step_and_a_failed_row_its_request(engine, monkeypatch, stage, expected, steps):
    """A sampler that fails as a whole fails its step; one row that fails to sample (no input is known to make
    one since extreme temperatures and penalties are handled) ends its own request, and the step's other
    requests keep their tokens."""
    inject(monkeypatch, engine, stage)
    failed_steps = engine.stats().num_failed_steps
    long = SamplingParams(max_new_tokens=300, ignore_eos=True)

    async def traffic():
        return await asyncio.gather(
            outcome(engine, [5, 6, 7], params=long),  # still decoding when the poisoned prompt joins its step
            outcome(engine, [POISON, 1, 2], delay=0.05),
            outcome(engine, [8, 9], delay=1.0),
        )

    assert run(traffic()) == expected
    assert engine.stats().num_failed_steps == failed_steps + steps
    assert_no_blocks_held(engine)


def test_a_request_that_always_fails_cannot_loop(engine, monkeypatch):
    inject(monkeypatch, engine, "execute")
    before = engine.stats().num_failed_steps

    async def traffic():
        return await asyncio.gather(*(outcome(engine, [POISON, i]) for i in range(5)))

    results = run(traffic())
    assert results == ["failed"] * 5
    assert engine.stats().num_failed_steps - before <= 5  # at most one failed step per poisoned request
    assert_no_blocks_held(engine)
    assert run(outcome(engine, [5, 6])) == "ok"


def test_a_request_the_scheduler_cannot_take_fails_alone(engine, monkeypatch):
    real_add = engine.core.scheduler.add

    def add(request):
        if request.prompt_token_ids[0] == POISON:
            raise RuntimeError("injected queueing failure")
        real_add(request)

    monkeypatch.setattr(engine.core.scheduler, "add", add)

    async def traffic():
        return await asyncio.gather(outcome(engine, [POISON, 1]), outcome(engine, [5, 6, 7]))

    assert run(traffic()) == ["failed", "ok"]
    assert engine.alive
    assert_no_blocks_held(engine)


def test_an_engine_refuses_a_config_out_of_range_before_loading(tmp_path):
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        Engine(tmp_path / "no-model", EngineConfig(max_num_seqs=0))


def test_an_engine_whose_logits_are_not_finite_refuses_to_start(smollm2_ir):
    """f16 activations overflow on SmolLM2 on a CPU without native f16 (every logit NaN): such an engine would
    answer every request with the same token, so start() fails, naming the setting. Where the plugin computes
    finite f16 logits the engine starts: which one holds is read off the runner itself."""
    engine = Engine(smollm2_ir, EngineConfig(kv_cache_gb=0.05, inference_precision="f16"))
    try:
        logits = engine.core.runner.execute([StepInput(list(range(1, 31)), 0, [0, 1], 1)])
        if np.isfinite(logits).all():
            engine.start()
            assert engine.alive
        else:
            with pytest.raises(ValueError, match="inference_precision 'f16'"):
                engine.start()
    finally:
        engine.shutdown()
