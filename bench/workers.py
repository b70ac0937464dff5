"""One measurement, in its own process: `python -m bench.workers SPEC.json OUT.json`.

Each peer runs alone in a fresh process so that no two engines share the two cores, and a crash or an
import error in one peer costs only its own numbers. The spec names the engine kind, the model directory,
the token ids of the prompts (tokenized once by the parent, so every engine sees the same tokens), and the
budgets. The result is plain JSON.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING

from service.core.config import EngineConfig
from service.core.stats import EngineStats
from service.engine import GenerationRequest

if TYPE_CHECKING:
    from service.engine import Engine


def _log(msg: str) -> None:
    print(f"    [{os.getpid()}] {msg}", file=sys.stderr, flush=True)


# -- the budget ----------------------------------------------------------------------------------------
# The budget every peer gets unless a run says otherwise: the engine's own defaults (service.core.config),
# with 2 inference threads. Specs carry it as a dict (budget_dict); workers turn it back (budget_of).
BUDGET = EngineConfig(threads=2)


def budget_dict(config: EngineConfig) -> dict:
    """The budget as plain JSON for a spec or a result: every EngineConfig field."""
    return dataclasses.asdict(config)


def budget_of(spec: dict) -> EngineConfig:
    """The spec's budget as the EngineConfig it was made from."""
    return EngineConfig(**spec["budget"])


def peer_threads(config: EngineConfig) -> int:
    """Inference threads for a peer: the budget's, or, when it leaves them open, what our engine would take."""
    if config.threads is not None:
        return config.threads
    from service.engine.runner import available_cpus

    return available_cpus()


# -- our engine ----------------------------------------------------------------------------------------
STAGES = ("schedule", "execute", "sample", "update", "step")  # the engine thread's *_seconds_total counters


def engine_thread_seconds(before: EngineStats, after: EngineStats) -> dict[str, float]:
    """Seconds the engine thread spent in each stage of its steps between two stats snapshots, and steps."""
    seconds = {k: getattr(after, f"{k}_seconds_total") - getattr(before, f"{k}_seconds_total") for k in STAGES}
    return seconds | {"steps": after.num_steps - before.num_steps}


def our_engine(spec: dict, prefix_caching: bool = True, settings: dict | None = None) -> Engine:
    """The engine with the spec's budget; `settings` are further EngineConfig fields (they win)."""
    from service.engine import Engine

    config = dataclasses.replace(budget_of(spec), enable_prefix_caching=prefix_caching, **(settings or {}))
    engine = Engine(spec["model"], config)
    engine.start()
    return engine


async def ours_batch(
    engine: Engine, prompts: list[list[int]], max_new: int, steps: dict[int, EngineStats] | None = None
) -> dict:
    """All prompts at once; wall time, output tokens and median TTFT. With `steps`, the engine's stats
    snapshot is kept as each output arrives, by step number: a sample of single steps (a snapshot holds
    its last step's tokens and seconds), without touching the engine thread."""
    from service.core.params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    ttfts: list[float] = []

    async def one(ids: list[int]) -> int:
        n = 0
        t0 = time.perf_counter()
        async for out in engine.generate(GenerationRequest(ids, params)):
            if n == 0 and out.token_ids:
                ttfts.append(time.perf_counter() - t0)
            n += len(out.token_ids)
            if steps is not None:
                s = engine.stats()
                steps.setdefault(s.num_steps, s)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tokens": sum(counts), "ttft_p50_s": median(ttfts) if ttfts else None}


def run_ours(spec: dict) -> dict:
    engine = our_engine(spec, prefix_caching=spec.get("prefix_caching", False))
    try:
        asyncio.run(ours_batch(engine, spec["prompts"][:2], 8))  # warm-up: shapes and caches
        results = []
        for c in spec["concurrency"]:
            tries = []
            for _ in range(_repeats(spec, c)):
                before = engine.stats()
                r = asyncio.run(ours_batch(engine, take(spec["prompts"], c), spec["max_new_tokens"]))
                # the engine publishes a step's stats before its outputs: the last step is counted
                r["engine_thread_s"] = engine_thread_seconds(before, engine.stats())
                tries.append(r)
            r = _median_run(tries)
            r["concurrency"] = c
            results.append(r)
            _log(f"ours c={c}: {r['tokens_per_s']:.1f} tok/s")
        return {"runs": results}
    finally:
        engine.shutdown()


def _repeats(spec: dict, c: int) -> int:
    return int(spec.get("repeats", {}).get(str(c), 3 if c == 1 else 1))


def _median_run(tries: list[dict]) -> dict:
    for r in tries:
        r["tokens_per_s"] = r["output_tokens"] / r["wall_s"]
    tries.sort(key=lambda r: r["tokens_per_s"])
    best = dict(tries[len(tries) // 2])
    best["tries_tokens_per_s"] = [r["tokens_per_s"] for r in tries]
    return best


def take(prompts: list[list[int]], n: int) -> list[list[int]]:
    """n prompts, cycling through the set."""
    return [prompts[i % len(prompts)] for i in range(n)]


# -- openvino-genai ContinuousBatchingPipeline ---------------------------------------------------------
def genai_pipe(spec: dict, prefix_caching: bool):
    """openvino-genai's pipeline with the spec's budget (its KV cache in whole GB)."""
    import openvino_genai as genai

    b = budget_of(spec)
    sc = genai.SchedulerConfig()
    sc.cache_size = max(1, int(round(b.kv_cache_gb)))
    sc.max_num_seqs = b.max_num_seqs
    sc.max_num_batched_tokens = b.max_num_batched_tokens
    sc.enable_prefix_caching = prefix_caching
    return genai.ContinuousBatchingPipeline(spec["model"], sc, "CPU", {"INFERENCE_NUM_THREADS": peer_threads(b)})


def genai_generate(pipe, prompts: list[list[int]], max_new: int) -> tuple[float, int]:
    """All prompts in one generate() call: wall time and generated tokens."""
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    config = genai.GenerationConfig(max_new_tokens=max_new, ignore_eos=True)
    tensors = [ov.Tensor(np.asarray([p], dtype=np.int64)) for p in prompts]
    t0 = time.perf_counter()
    out = pipe.generate(tensors, [config] * len(tensors))
    wall = time.perf_counter() - t0
    return wall, sum(len(r.m_generation_ids[0]) for r in out)


def run_genai(spec: dict) -> dict:
    pipe = genai_pipe(spec, prefix_caching=spec.get("prefix_caching", False))
    genai_generate(pipe, spec["prompts"][:2], 8)
    results = []
    for c in spec["concurrency"]:
        tries = []
        for _ in range(_repeats(spec, c)):
            wall, n = genai_generate(pipe, take(spec["prompts"], c), spec["max_new_tokens"])
            tries.append({"wall_s": wall, "output_tokens": n})
        r = _median_run(tries) | {"concurrency": c}
        results.append(r)
        _log(f"genai c={c}: {r['tokens_per_s']:.1f} tok/s")
    return {"runs": results}


# -- optimum-intel OVModelForCausalLM.generate(), static batches ---------------------------------------
def _padded(prompts: list[list[int]], pad: int):
    import numpy as np

    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for i, p in enumerate(prompts):  # left padding, as generation needs
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    return ids, mask


def run_optimum(spec: dict) -> dict:
    import torch
    from optimum.intel import OVModelForCausalLM

    model = OVModelForCausalLM.from_pretrained(
        spec["model"],
        ov_config={"INFERENCE_NUM_THREADS": peer_threads(budget_of(spec)), "PERFORMANCE_HINT": "LATENCY"},
        compile=True,
    )
    return _hf_style(model, spec, torch)


def run_hf(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(peer_threads(budget_of(spec)))
    kwargs = {"gguf_file": spec["gguf_file"]} if spec.get("gguf_file") else {}
    model = AutoModelForCausalLM.from_pretrained(spec["hf_model"], dtype=torch.float32, **kwargs)
    model.eval()
    return _hf_style(model, spec, torch)


def _hf_style(model, spec: dict, torch) -> dict:
    pad = spec.get("pad_token_id", 0)

    def gen(prompts: list[list[int]], max_new: int) -> tuple[float, int]:
        ids, mask = _padded(prompts, pad)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=torch.from_numpy(ids),
                attention_mask=torch.from_numpy(mask),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad,
            )
        wall = time.perf_counter() - t0
        return wall, int((out.shape[1] - ids.shape[1]) * ids.shape[0])

    gen(spec["prompts"][:1], 4)
    results = []
    for c in spec["concurrency"]:
        tries = []
        for _ in range(_repeats(spec, c) if spec["kind"] == "optimum" else 1):
            wall, n = gen(take(spec["prompts"], c), spec["max_new_tokens"])
            tries.append({"wall_s": wall, "output_tokens": n})
        r = _median_run(tries) | {"concurrency": c}
        results.append(r)
        _log(f"{spec['kind']} c={c}: {r['tokens_per_s']:.1f} tok/s")
    return {"runs": results}


# -- multi-turn: second-turn TTFT, history cached vs cold ---------------------------------------------
def run_multiturn_ours(spec: dict) -> dict:
    """For each conversation: turn 1 (long history) is answered, then turn 2 extends it.

    Cached: the same engine (prefix caching on) answers turn 2 right after turn 1.
    Cold: a fresh engine with prefix caching off gets the identical turn-2 prompt.
    """
    convs = spec["conversations"]
    turn2_prompts = []
    cached, cold, cached_tokens = [], [], []
    engine = our_engine(spec, prefix_caching=True)
    try:
        asyncio.run(ours_batch(engine, [convs[0]["turn1"][:16]], 2))
        for conv in convs:
            reply = asyncio.run(_ours_collect(engine, conv["turn1"], spec["reply_tokens"]))
            prompt2 = conv["turn1"] + reply + conv["turn2_suffix"]
            turn2_prompts.append(prompt2)
            ttft, usage = asyncio.run(_ours_ttft(engine, prompt2))
            cached.append(ttft)
            cached_tokens.append(usage)
            _log(f"ours multi-turn cached ttft {ttft * 1000:.1f} ms ({len(prompt2)} tokens, {usage} cached)")
    finally:
        engine.shutdown()
    engine = our_engine(spec, prefix_caching=False)
    try:
        asyncio.run(ours_batch(engine, [convs[0]["turn1"][:16]], 2))
        for prompt2 in turn2_prompts:
            ttft, _ = asyncio.run(_ours_ttft(engine, prompt2))
            cold.append(ttft)
            _log(f"ours multi-turn cold ttft {ttft * 1000:.1f} ms")
    finally:
        engine.shutdown()
    return {
        "cached_ttft_s": cached,
        "cold_ttft_s": cold,
        "cached_tokens": cached_tokens,
        "prompt_tokens": [len(p) for p in turn2_prompts],
        "turn2_prompts": turn2_prompts,
    }


async def _ours_collect(engine, ids: list[int], n: int) -> list[int]:
    from service.core.params import SamplingParams

    toks: list[int] = []
    async for out in engine.generate(GenerationRequest(ids, SamplingParams(max_new_tokens=n, ignore_eos=True))):
        toks.extend(out.token_ids)
    return toks


async def _ours_ttft(engine, ids: list[int]) -> tuple[float, int | None]:
    from service.core.params import SamplingParams

    t0 = time.perf_counter()
    ttft = None
    usage = None
    async for out in engine.generate(GenerationRequest(ids, SamplingParams(max_new_tokens=1, ignore_eos=True))):
        if ttft is None and out.token_ids:
            ttft = time.perf_counter() - t0
        if out.usage is not None:
            usage = out.usage.cached_prompt_tokens
    return ttft or 0.0, usage


def run_multiturn_genai(spec: dict) -> dict:
    """Same conversations; the turn-2 prompts are the ones our engine built (same tokens)."""
    convs = spec["conversations"]
    prompts2 = spec["turn2_prompts"]
    cached, cold = [], []
    pipe = genai_pipe(spec, prefix_caching=True)
    genai_generate(pipe, [convs[0]["turn1"][:16]], 2)
    for conv, prompt2 in zip(convs, prompts2, strict=True):
        n1 = len(conv["turn1"])
        genai_generate(pipe, [prompt2[: n1 + spec["reply_tokens"]]], 1)  # turn 1 with its reply in the cache
        wall, _ = genai_generate(pipe, [prompt2], 1)
        cached.append(wall)
        _log(f"genai multi-turn cached ttft {wall * 1000:.1f} ms")
    del pipe
    pipe = genai_pipe(spec, prefix_caching=False)
    genai_generate(pipe, [convs[0]["turn1"][:16]], 2)
    for prompt2 in prompts2:
        wall, _ = genai_generate(pipe, [prompt2], 1)
        cold.append(wall)
        _log(f"genai multi-turn cold ttft {wall * 1000:.1f} ms")
    return {"cached_ttft_s": cached, "cold_ttft_s": cold}


KINDS = {
    "ours": run_ours,
    "genai": run_genai,
    "optimum": run_optimum,
    "hf": run_hf,
    "multiturn_ours": run_multiturn_ours,
    "multiturn_genai": run_multiturn_genai,
}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1])
    try:
        result = KINDS[spec["kind"]](spec)
        result["ok"] = True
    except Exception as exc:  # report, don't crash the whole bench
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
