"""python -m bench.tune MODEL --knob NAME: one tuning question answered with data.

Two engines that differ only in one setting are loaded side by side in this process and their runs
alternate, so both see the same background load; each pair of runs gives a ratio (B over A) and the
median of those is the answer. Knobs:

- threads: 1 vs 2 inference threads (the same method answers "how many threads" on a bigger machine);
- kv_cache_precision: u8 (the default) vs f16 KV cache;
- dq_group_size: the CPU plugin's default dynamic-quantization group vs 64;
- batch_window_ms: 0 (the default) vs 10 ms of waiting after an arrival to gather a burst into one step,
  measured under staggered (Poisson) arrivals, where it could matter, and under a burst;
- max_num_batched_tokens: the default (chosen at start: 80 to 512) vs 512 tokens per step, under Poisson
  arrivals: a smaller budget splits new prompts into more, shorter chunks, so the streams already decoding
  wait less between tokens (inter-token latency p99) at some cost in throughput and time to first token;
- deterministic: on (the default) vs fast steps (--no-deterministic, 512 tokens a step: prompt pieces whole),
  under Poisson arrivals;
- kernel_cache_shapes: the CPU plugin's own runtime-cache size (5000 step shapes) vs ours (64), under
  Poisson arrivals, whose varied prompt chunks make many shapes. oneDNN's primitive cache size is one per
  process, set by the first engine (A), so only the plugin's cache differs between the two.
- inference_precision: bf16 (the CPU plugin's own default on CPUs with AVX512_BF16 or AMX) vs ours (f32).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import replace
from pathlib import Path
from statistics import median

from bench import grpc_load, run, workers
from service.engine import GenerationRequest

# knob: (A, B), EngineConfig fields over the bench's budget (the engine's defaults, 2 threads); where the
# question is "change the default?", A is the default.
KNOBS: dict[str, tuple[dict, dict]] = {
    "threads": ({"threads": 1}, {"threads": workers.BUDGET.threads}),
    "kv_cache_precision": ({"kv_cache_precision": workers.BUDGET.kv_cache_precision}, {"kv_cache_precision": "f16"}),
    "dq_group_size": ({}, {"dq_group_size": 64}),
    "batch_window_ms": ({"batch_window_ms": workers.BUDGET.batch_window_ms}, {"batch_window_ms": 10.0}),
    "max_num_batched_tokens": (
        {"max_num_batched_tokens": workers.BUDGET.max_num_batched_tokens},
        {"max_num_batched_tokens": 512},
    ),
    "deterministic": ({}, {"deterministic": False, "max_num_batched_tokens": 512}),
    "kernel_cache_shapes": ({"kernel_cache_shapes": 5000}, {"kernel_cache_shapes": workers.BUDGET.kernel_cache_shapes}),
    "inference_precision": (
        {"inference_precision": "bf16"},
        {"inference_precision": workers.BUDGET.inference_precision},
    ),
}
ARRIVAL_KNOBS = (
    "batch_window_ms",
    "max_num_batched_tokens",
    "kernel_cache_shapes",
    "deterministic",
)  # measured under staggered arrivals


async def arrivals(engine, prompts: list[list[int]], rate: float, n: int, max_new: int, seed: int = 0) -> dict:
    """n requests at Poisson times (rate per second): tokens/s over the whole span, TTFT and inter-token
    latency percentiles."""
    from service.core.params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    rng = random.Random(seed)

    async def one(ids: list[int], delay: float) -> grpc_load.Sample:
        await asyncio.sleep(delay)
        sample = grpc_load.Sample(time.perf_counter())  # the gRPC load generator's bookkeeping, in-process
        async for out in engine.generate(GenerationRequest(ids, params)):
            sample.chunks.append((time.perf_counter(), len(out.token_ids)))
        return sample

    delays, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        delays.append(t)
    t0 = time.perf_counter()
    samples = await asyncio.gather(*(one(prompts[i % len(prompts)], d) for i, d in enumerate(delays)))
    wall = time.perf_counter() - t0
    ttfts = [s.ttft for s in samples if s.ttft is not None]
    gaps = [g for s in samples for g in s.itls()]
    return {
        "tokens_per_s": sum(s.tokens for s in samples) / wall,
        "ttft_p50_s": grpc_load.pct(ttfts, 0.5),
        "ttft_p95_s": grpc_load.pct(ttfts, 0.95),
        "itl_p50_s": grpc_load.pct(gaps, 0.5),
        "itl_p99_s": grpc_load.pct(gaps, 0.99),
    }


def workloads(knob: str, quick: bool) -> list[tuple[str, dict]]:
    max_new = 64 if quick else 128
    if knob in ARRIVAL_KNOBS:
        poisson = ("poisson 8 req/s, 16 requests", {"rate": 8.0, "n": 16, "max_new": max_new})
        return [poisson] if quick else [poisson, ("burst of 16", {"rate": None, "n": 16, "max_new": max_new})]
    return [(f"burst of {c}", {"rate": None, "n": c, "max_new": max_new}) for c in ((1, 32) if quick else (1, 8, 32))]


def measure_once(engine, prompts: list[list[int]], w: dict) -> dict:
    if w["rate"] is None:
        r = asyncio.run(workers.ours_batch(engine, workers.take(prompts, w["n"]), w["max_new"]))
        return {"tokens_per_s": r["output_tokens"] / r["wall_s"], "ttft_p50_s": r["ttft_p50_s"]}
    return asyncio.run(arrivals(engine, prompts, w["rate"], w["n"], w["max_new"]))


def tune(model: Path, knob: str, repeats: int, quick: bool, kv_gb: float = 1.0) -> dict:
    prompts, _ = run.tokenize(model, run.load_prompts())
    a_setting, b_setting = KNOBS[knob]
    spec = {"model": str(model), "budget": workers.budget_dict(replace(workers.BUDGET, kv_cache_gb=kv_gb))}
    engines = [workers.our_engine(spec, prefix_caching=False, settings=s) for s in (a_setting, b_setting)]
    result: dict = {"knob": knob, "a": a_setting, "b": b_setting, "workloads": []}
    try:
        for e in engines:
            asyncio.run(workers.ours_batch(e, prompts[:2], 8))  # warm-up
        for label, w in workloads(knob, quick):
            pairs = []
            for r in range(repeats):
                order = (0, 1) if r % 2 == 0 else (1, 0)
                pair: dict = {}
                for i in order:
                    pair["ab"[i]] = measure_once(engines[i], prompts, w)
                pairs.append(pair)
            entry = {
                "workload": label,
                "a_tokens_per_s": median(p["a"]["tokens_per_s"] for p in pairs),
                "b_tokens_per_s": median(p["b"]["tokens_per_s"] for p in pairs),
                "b_over_a": median(p["b"]["tokens_per_s"] / p["a"]["tokens_per_s"] for p in pairs),
                "a_ttft_p50_s": median(p["a"]["ttft_p50_s"] for p in pairs),
                "b_ttft_p50_s": median(p["b"]["ttft_p50_s"] for p in pairs),
                "pairs": pairs,
            }
            if "itl_p99_s" in pairs[0]["a"]:
                entry["a_itl_p99_s"] = median(p["a"]["itl_p99_s"] for p in pairs)
                entry["b_itl_p99_s"] = median(p["b"]["itl_p99_s"] for p in pairs)
            result["workloads"].append(entry)
            print(
                f"{knob} {label}: A {entry['a_tokens_per_s']:.1f} tok/s, B {entry['b_tokens_per_s']:.1f} tok/s, "
                f"B/A {entry['b_over_a']:.3f}; TTFT p50 {1000 * entry['a_ttft_p50_s']:.0f} vs "
                f"{1000 * entry['b_ttft_p50_s']:.0f} ms",
                flush=True,
            )
    finally:
        for e in engines:
            e.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tune", description=__doc__)
    p.add_argument("model")
    p.add_argument("--knob", choices=sorted(KNOBS), required=True)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="64 new tokens per request instead of 128; no burst of 8")
    p.add_argument("--kv-gb", type=float, default=1.0)
    p.add_argument("--out", help="write the result as JSON here")
    a = p.parse_args(argv)
    result = tune(Path(a.model), a.knob, a.repeats, a.quick, a.kv_gb)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
