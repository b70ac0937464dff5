"""python -m bench.deterministic MODEL: what reproducible replies cost, and how reproducible each mode is.

Two engines in this process, deterministic steps (the default) and fast ones (--no-deterministic with 512
tokens a step, the mode before deterministic steps: prompt pieces fed whole), take turns on the same work:

- reproducibility: the greedy replies to the edit set's prompts, each alone and cold (a salt of its own), are
  the reference; the same requests again (cached prefix), all at once beside 8 and beside 32 other requests,
  and alone with speculation on are compared with it. The share of identical replies per condition.
- time to the first token of a prompt alone (one new token): 2,000 tokens made of the edit set's prompts
  joined, the median of --repeats runs, the engines alternating.
- throughput at 1, 8 and 32 streams (bench.speculative's closed loop, plain decoding, the writing set's
  prompts): the median over rounds of each engine's tokens/s, and deterministic over fast.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path
from statistics import median
from typing import Any

from bench import run, sysinfo, workers
from bench.speculative import WORKLOADS, median_ratio, ours_serve, run_streams
from service.engine import GenerationRequest

MODES = {"deterministic": {}, "fast": {"deterministic": False, "max_num_batched_tokens": 512}}


def engine(model: str, settings: dict, prefix_caching: bool = True) -> Any:
    spec = {"model": model, "budget": workers.budget_dict(workers.BUDGET)}
    return workers.our_engine(spec, prefix_caching=prefix_caching, settings={"speculation": "off", **settings})


async def reply(e: Any, ids: list[int], max_new: int, salt: str = "", speculation: str | None = None) -> list[int]:
    from service.core.params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new, speculation=speculation)
    tokens: list[int] = []
    async for out in e.generate(GenerationRequest(ids, params, cache_salt=salt)):
        tokens += out.token_ids
    return tokens


def reproducibility(model: str, prompts: list[list[int]], max_new: int) -> dict[str, dict[str, str]]:
    rng = random.Random(0)
    crowd = [[rng.randrange(100, 30_000) for _ in range(rng.randint(20, 200))] for _ in range(32)]

    async def conditions(e: Any) -> dict[str, list[list[int]]]:
        async def beside(n: int) -> list[list[int]]:
            busy = [asyncio.create_task(reply(e, p, 64, "crowd")) for p in crowd[:n]]
            mine = await asyncio.gather(*(reply(e, p, max_new) for p in prompts))
            await asyncio.gather(*busy)
            return list(mine)

        cold = [await reply(e, p, max_new, f"cold{i}") for i, p in enumerate(prompts)]
        first = [await reply(e, p, max_new) for p in prompts]
        cached = [await reply(e, p, max_new) for p in prompts]
        return {
            "cold": cold,
            "first shared": first,
            "cached": cached,
            "beside 8": await beside(8),
            "beside 32": await beside(32),
            "speculation": [await reply(e, p, max_new, f"spec{i}", "auto") for i, p in enumerate(prompts)],
        }

    out = {}
    for name, settings in MODES.items():
        e = engine(model, settings)
        try:
            replies = asyncio.run(conditions(e))
        finally:
            e.shutdown()
        cold = replies.pop("cold")
        out[name] = {
            condition: f"{sum(a == b for a, b in zip(got, cold, strict=True))}/{len(cold)}"
            for condition, got in replies.items()
        }
        print(f"  identical to cold, {name}: {out[name]}", flush=True)
    return out


def time_to_first_token(model: str, ids: list[int], repeats: int) -> dict[str, Any]:
    engines = {name: engine(model, s, prefix_caching=False) for name, s in MODES.items()}
    seconds: dict[str, list[float]] = {n: [] for n in engines}
    try:
        for r in range(repeats):
            for name in list(engines)[:: 1 if r % 2 else -1]:
                t0 = time.perf_counter()
                asyncio.run(reply(engines[name], ids, 1))
                seconds[name].append(time.perf_counter() - t0)
            print(f"  first token of {len(ids)}, round {r}: { ({n: round(v[-1], 3) for n, v in seconds.items()}) }")
    finally:
        for e in engines.values():
            e.shutdown()
    return {
        "prompt_tokens": len(ids),
        "seconds": {n: [round(x, 3) for x in v] for n, v in seconds.items()},
        "median_seconds": {n: round(median(v), 3) for n, v in seconds.items()},
        "deterministic_over_fast": round(median_ratio(seconds["deterministic"], seconds["fast"]), 3),
    }


def throughput(model: str, prompts: list[list[int]], streams: list[int], rounds: int, max_new: int) -> dict:
    engines = {name: engine(model, s, prefix_caching=False) for name, s in MODES.items()}
    out = {}
    try:
        for n in streams:
            result = run_streams({k: ours_serve(e) for k, e in engines.items()}, prompts, n, rounds, max_new)
            rates = result["rates"]
            out[f"{n} streams"] = {
                "tokens_per_s": {k: [round(x, 1) for x in v] for k, v in rates.items()},
                "deterministic_over_fast": round(median_ratio(rates["deterministic"], rates["fast"]), 3),
            }
    finally:
        for e in engines.values():
            e.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.deterministic", description=__doc__)
    p.add_argument("model")
    p.add_argument("--streams", default="1,8,32", help="comma-separated stream counts for throughput")
    p.add_argument("--rounds", type=int, default=3, help="throughput rounds per stream count")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=2000, help="the long prompt's length for time to first token")
    p.add_argument("--repeats", type=int, default=5, help="runs of the long prompt alone, per mode")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out: reproducibility, ttft, throughput")
    p.add_argument("--out", help="write the result as JSON here")
    a = p.parse_args(argv)
    skip = set(a.skip.split(","))
    edits, _ = run.tokenize(Path(a.model), run.load_prompts(WORKLOADS["edit"]))
    writing, _ = run.tokenize(Path(a.model), run.load_prompts(WORKLOADS["writing"]))
    long = [t for prompt in sorted(edits, key=len) * 10 for t in prompt][: a.prompt_tokens]
    result: dict[str, Any] = {"model": a.model, "modes": MODES, "machine": sysinfo.machine()}
    if "reproducibility" not in skip:
        result["identical_to_cold"] = reproducibility(a.model, edits[:8], a.max_new_tokens)
    if "ttft" not in skip:
        result["time_to_first_token"] = time_to_first_token(a.model, long, a.repeats)
    if "throughput" not in skip:
        streams = [int(s) for s in a.streams.split(",")]
        result["throughput"] = throughput(a.model, writing, streams, a.rounds, a.max_new_tokens)
    run.report(result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
