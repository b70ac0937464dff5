"""python -m bench.pieces MODEL: does a greedy reply depend on what shares its steps, and what do fixed prompt
pieces (--prompt-chunk-tokens) cost a prompt alone?

Reproducibility: engines of the settings compared (two of each, in this process) take turns serving the same
closed loop (bench.speculative's: N clients, each sending its next prompt of the edit set when its last reply
ends), plain greedy decoding; replies of each pair of engines are compared. Two engines of the same settings
see different step compositions (arrivals depend on timing), so their agreement is the reproducibility of a
reply under load. Time to the first token: each prompt alone (one new token), alternating the settings, the
median of --repeats runs; a prompt of 2,000 tokens is made of the edit set's prompts joined.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import time
from pathlib import Path
from statistics import median
from typing import Any

from bench import run, workers
from bench.speculative import WORKLOADS, ours_serve, run_streams
from service.engine import GenerationRequest

SETTINGS = {"pieces of 256 (default)": {}, "cut where the budget ends (0)": {"prompt_chunk_tokens": 0}}


def engine(model: str, settings: dict) -> Any:
    spec = {"model": model, "budget": workers.budget_dict(workers.BUDGET)}
    return workers.our_engine(spec, prefix_caching=False, settings={"speculation": "off", **settings})


def reproducibility(model: str, prompts: list[list[int]], streams: int, rounds: int, per: int) -> dict:
    engines = {f"{name} #{i}": engine(model, s) for name, s in SETTINGS.items() for i in (1, 2)}
    try:
        result = run_streams({n: ours_serve(e) for n, e in engines.items()}, prompts, streams, rounds, 128, per)
    finally:
        for e in engines.values():
            e.shutdown()
    replies = result["replies"]
    pairs = {
        f"{a} == {b}": f"{sum(x == y for x, y in zip(replies[a], replies[b], strict=True))}/{len(replies[a])}"
        for a, b in itertools.combinations(replies, 2)
    }
    return {"streams": streams, "rounds": rounds, "requests_per_stream": per, "identical": pairs}


async def first_token_seconds(e: Any, ids: list[int]) -> float:
    from service.core.params import SamplingParams

    t0 = time.perf_counter()
    async for _ in e.generate(GenerationRequest(ids, SamplingParams(max_new_tokens=1))):
        pass
    return time.perf_counter() - t0


def time_to_first_token(model: str, prompts: list[list[int]], repeats: int) -> dict:
    ordered = sorted(prompts, key=len)
    cases = {"shortest": ordered[0], "longest": ordered[-1], "2000 tokens": [t for p in ordered for t in p][:2000]}
    engines = {name: engine(model, s) for name, s in SETTINGS.items()}
    seconds: dict[str, dict[str, list[float]]] = {c: {n: [] for n in engines} for c in cases}
    try:
        for r in range(repeats):
            for case, ids in cases.items():
                for name in list(engines)[:: 1 if r % 2 else -1]:
                    seconds[case][name].append(asyncio.run(first_token_seconds(engines[name], ids)))
    finally:
        for e in engines.values():
            e.shutdown()
    default, old = SETTINGS
    return {
        case: {
            "prompt_tokens": len(cases[case]),
            "median_seconds": {n: round(median(v), 4) for n, v in by_name.items()},
            "default_over_0": round(median(by_name[default]) / median(by_name[old]), 3),
        }
        for case, by_name in seconds.items()
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pieces", description=__doc__)
    p.add_argument("model")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests-per-stream", type=int, default=3)
    p.add_argument("--repeats", type=int, default=12, help="runs of each prompt alone, per setting")
    p.add_argument("--out", help="write the result as JSON here")
    a = p.parse_args(argv)
    prompts, _ = run.tokenize(Path(a.model), run.load_prompts(WORKLOADS["edit"]))
    result = {
        "model": a.model,
        "reproducibility": reproducibility(a.model, prompts, a.streams, a.rounds, a.requests_per_stream),
        "time_to_first_token_alone": time_to_first_token(a.model, prompts, a.repeats),
        "load": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
