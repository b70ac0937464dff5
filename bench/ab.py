"""python -m bench.ab MODEL [--kv-gb 1] [--concurrency 1,8,32]: ovserve vs genai, interleaved in one process.

On a busy 2-core machine, runs in separate processes minutes apart see different background load. Here
both engines are loaded side by side (idle while the other runs) and their runs alternate, so they see the
same noise; per concurrency it prints both throughputs, their ratio, and the engine thread's breakdown
(model execute vs sampler vs scheduler) plus the median decode-only step time of ovserve.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from statistics import median

from bench import run, workers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ab")
    p.add_argument("model")
    p.add_argument("--kv-gb", type=float, default=1.0)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    a = p.parse_args(argv)
    ids, _ = run.tokenize(Path(a.model), run.load_prompts())
    spec = {
        "model": a.model,
        "budget": workers.BUDGET | {"kv_cache_gb": a.kv_gb},
    }
    engine = workers._our_engine(spec, prefix_caching=False)
    timer = workers._instrument(engine)
    steps: list[tuple[int, int, float]] = []
    inner = engine.runner.execute

    def execute(seqs):
        t = time.perf_counter()
        try:
            return inner(seqs)
        finally:
            steps.append((sum(len(s.token_ids) for s in seqs), len(seqs), time.perf_counter() - t))

    engine.runner.execute = execute
    pipe = workers._genai_pipe(spec, False)
    try:
        asyncio.run(workers._ours_batch(engine, ids[:2], 8))
        workers._genai_generate(pipe, ids[:2], 8)
        for c in (int(x) for x in a.concurrency.split(",")):
            ours, genai, decode = [], [], []
            for _ in range(a.repeats):
                timer.reset()
                steps.clear()
                r = asyncio.run(workers._ours_batch(engine, workers._take(ids, c), a.max_new_tokens))
                ours.append(r["output_tokens"] / r["wall_s"])
                decode += [d for n, s, d in steps if n == s == c]
                share = {k: v / r["wall_s"] for k, v in timer.seconds.items()}
                wall, n = workers._genai_generate(pipe, workers._take(ids, c), a.max_new_tokens)
                genai.append(n / wall)
            ratio = median(o / g for o, g in zip(ours, genai, strict=True))
            dec = f"{median(decode) * 1000:.1f} ms" if decode else "-"
            print(
                f"c={c}: ovserve {median(ours):.1f} tok/s, genai {median(genai):.1f} tok/s, ratio {ratio:.2f}; "
                f"ovserve decode-only step {dec}; engine thread: execute {share['execute']:.0%}, "
                f"sampler {share['sample']:.1%}, scheduler {share['schedule'] + share['complete']:.1%}",
                flush=True,
            )
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
