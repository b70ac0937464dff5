"""python -m bench.ab MODEL [--kv-gb 1] [--concurrency 1,8,32]: ovserve vs genai, interleaved in one process.

On a busy 2-core machine, runs in separate processes minutes apart see different background load. Here
both engines are loaded side by side (idle while the other runs) and their runs alternate, so they see the
same noise; per concurrency it prints both throughputs, their ratio, and the engine thread's breakdown
(model execute vs sampler vs scheduler, from the engine's stats counters) plus the median decode-only step
time of ovserve (whole steps, from the stats snapshots seen as outputs arrive).
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import replace
from pathlib import Path
from statistics import median

from bench import run, workers
from service.core.stats import EngineStats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ab")
    p.add_argument("model")
    p.add_argument("--kv-gb", type=float, default=1.0)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    a = p.parse_args(argv)
    ids, _ = run.tokenize(Path(a.model), run.load_prompts())
    spec = {"model": a.model, "budget": workers.budget_dict(replace(workers.BUDGET, kv_cache_gb=a.kv_gb))}
    engine = workers.our_engine(spec, prefix_caching=False)
    pipe = workers.genai_pipe(spec, False)
    try:
        asyncio.run(workers.ours_batch(engine, ids[:2], 8))
        workers.genai_generate(pipe, ids[:2], 8)
        for c in (int(x) for x in a.concurrency.split(",")):
            ours, genai, decode = [], [], []
            for _ in range(a.repeats):
                before = engine.stats()
                steps: dict[int, EngineStats] = {}
                r = asyncio.run(workers.ours_batch(engine, workers.take(ids, c), a.max_new_tokens, steps))
                ours.append(r["output_tokens"] / r["wall_s"])
                decode += [s.last_step_seconds for s in steps.values() if _decode_only(s, c)]
                seconds = workers.engine_thread_seconds(before, engine.stats())
                share = {k: seconds[k] / r["wall_s"] for k in workers.STAGES}
                wall, n = workers.genai_generate(pipe, workers.take(ids, c), a.max_new_tokens)
                genai.append(n / wall)
            ratio = median(o / g for o, g in zip(ours, genai, strict=True))
            dec = f"{median(decode) * 1000:.1f} ms" if decode else "-"
            print(
                f"c={c}: ovserve {median(ours):.1f} tok/s, genai {median(genai):.1f} tok/s, ratio {ratio:.2f}; "
                f"ovserve decode-only step {dec}; engine thread: execute {share['execute']:.0%}, "
                f"sampler {share['sample']:.1%}, scheduler {share['schedule'] + share['update']:.1%}",
                flush=True,
            )
    finally:
        engine.shutdown()
    return 0


def _decode_only(s: EngineStats, c: int) -> bool:
    """A step of one new token for each of c running requests (no prompt chunk in it), as far as a
    snapshot tells: c tokens and c requests still running after it."""
    return s.tokens_per_step == c and s.num_running == c


if __name__ == "__main__":
    raise SystemExit(main())
