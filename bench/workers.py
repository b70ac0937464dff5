"""One measurement, in its own process: `python -m bench.workers SPEC.json OUT.json`.

Each peer runs alone in a fresh process so that no two engines share the two cores, and a crash or an
import error in one peer costs only its own numbers. The spec names the engine kind, the model directory,
the token ids of the prompts (tokenized once by the parent, so every engine sees the same tokens), and the
budgets. The result is plain JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import traceback
from pathlib import Path
from statistics import median


def _log(msg: str) -> None:
    print(f"    [{os.getpid()}] {msg}", file=sys.stderr, flush=True)


# -- our engine ----------------------------------------------------------------------------------------
class _StepTimer:
    """Wraps the engine thread's parts with perf counters; cheap enough to leave on while measuring."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"execute": 0.0, "sample": 0.0, "schedule": 0.0, "complete": 0.0, "step": 0.0}
        self.calls = 0

    def wrap(self, owner, name: str, key: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - t

        setattr(owner, name, timed)

    def reset(self) -> None:
        for k in self.seconds:
            self.seconds[k] = 0.0


# The budget every peer gets unless a run says otherwise (the server's defaults, 2 threads).
BUDGET = {"kv_cache_gb": 1.0, "max_num_seqs": 32, "max_num_batched_tokens": 512, "num_threads": 2}


def _our_engine(spec: dict, prefix_caching: bool = True, settings: dict | None = None):
    """The engine with the spec's budget; `settings` are further EngineConfig fields (they win)."""
    from service.engine import Engine, EngineConfig

    b = spec["budget"]
    fields = {
        "kv_cache_gb": b["kv_cache_gb"],
        "max_num_seqs": b["max_num_seqs"],
        "max_num_batched_tokens": b["max_num_batched_tokens"],
        "num_threads": b["num_threads"],
        "enable_prefix_caching": prefix_caching,
    }
    engine = Engine(spec["model"], EngineConfig(**(fields | (settings or {}))))
    engine.start()
    return engine


def _instrument(engine) -> _StepTimer:
    import service.engine as engine_module

    timer = _StepTimer()
    timer.wrap(engine.runner, "execute", "execute")
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.scheduler, "complete", "complete")
    timer.wrap(engine_module, "sample", "sample")
    timer.wrap(engine, "_step", "step")
    return timer


async def _ours_batch(engine, prompts: list[list[int]], max_new: int) -> dict:
    from service.core.params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    ttfts: list[float] = []

    async def one(ids: list[int]) -> int:
        n = 0
        t0 = time.perf_counter()
        async for out in engine.generate(ids, params):
            if n == 0 and out.token_ids:
                ttfts.append(time.perf_counter() - t0)
            n += len(out.token_ids)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tokens": sum(counts), "ttft_p50_s": median(ttfts) if ttfts else None}


def run_ours(spec: dict) -> dict:
    engine = _our_engine(spec, prefix_caching=spec.get("prefix_caching", False))
    timer = _instrument(engine)
    try:
        asyncio.run(_ours_batch(engine, spec["prompts"][:2], 8))  # warm-up: shapes and caches
        results = []
        for c in spec["concurrency"]:
            tries = []
            for _ in range(_repeats(spec, c)):
                timer.reset()
                r = asyncio.run(_ours_batch(engine, _take(spec["prompts"], c), spec["max_new_tokens"]))
                r["engine_thread_s"] = dict(timer.seconds)
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


def _take(prompts: list[list[int]], n: int) -> list[list[int]]:
    return [prompts[i % len(prompts)] for i in range(n)]


# -- openvino-genai ContinuousBatchingPipeline ---------------------------------------------------------
def _genai_pipe(spec: dict, prefix_caching: bool):
    import openvino_genai as genai

    b = spec["budget"]
    sc = genai.SchedulerConfig()
    sc.cache_size = max(1, int(round(b["kv_cache_gb"])))
    sc.max_num_seqs = b["max_num_seqs"]
    sc.max_num_batched_tokens = b["max_num_batched_tokens"]
    sc.enable_prefix_caching = prefix_caching
    return genai.ContinuousBatchingPipeline(spec["model"], sc, "CPU", {"INFERENCE_NUM_THREADS": b["num_threads"]})


def _genai_generate(pipe, prompts: list[list[int]], max_new: int) -> tuple[float, int]:
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
    pipe = _genai_pipe(spec, prefix_caching=spec.get("prefix_caching", False))
    _genai_generate(pipe, spec["prompts"][:2], 8)
    results = []
    for c in spec["concurrency"]:
        tries = []
        for _ in range(_repeats(spec, c)):
            wall, n = _genai_generate(pipe, _take(spec["prompts"], c), spec["max_new_tokens"])
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

    b = spec["budget"]
    model = OVModelForCausalLM.from_pretrained(
        spec["model"],
        ov_config={"INFERENCE_NUM_THREADS": b["num_threads"], "PERFORMANCE_HINT": "LATENCY"},
        compile=True,
    )
    return _hf_style(model, spec, torch)


def run_hf(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["budget"]["num_threads"])
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
            wall, n = gen(_take(spec["prompts"], c), spec["max_new_tokens"])
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
    engine = _our_engine(spec, prefix_caching=True)
    try:
        asyncio.run(_ours_batch(engine, [convs[0]["turn1"][:16]], 2))
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
    engine = _our_engine(spec, prefix_caching=False)
    try:
        asyncio.run(_ours_batch(engine, [convs[0]["turn1"][:16]], 2))
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
    async for out in engine.generate(ids, SamplingParams(max_new_tokens=n, ignore_eos=True)):
        toks.extend(out.token_ids)
    return toks


async def _ours_ttft(engine, ids: list[int]) -> tuple[float, int | None]:
    from service.core.params import SamplingParams

    t0 = time.perf_counter()
    ttft = None
    usage = None
    async for out in engine.generate(ids, SamplingParams(max_new_tokens=1, ignore_eos=True)):
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
    pipe = _genai_pipe(spec, prefix_caching=True)
    _genai_generate(pipe, [convs[0]["turn1"][:16]], 2)
    for conv, prompt2 in zip(convs, prompts2, strict=True):
        n1 = len(conv["turn1"])
        _genai_generate(pipe, [prompt2[: n1 + spec["reply_tokens"]]], 1)  # turn 1 with its reply in the cache
        wall, _ = _genai_generate(pipe, [prompt2], 1)
        cached.append(wall)
        _log(f"genai multi-turn cached ttft {wall * 1000:.1f} ms")
    del pipe
    pipe = _genai_pipe(spec, prefix_caching=False)
    _genai_generate(pipe, [convs[0]["turn1"][:16]], 2)
    for prompt2 in prompts2:
        wall, _ = _genai_generate(pipe, [prompt2], 1)
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
