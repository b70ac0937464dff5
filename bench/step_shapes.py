"""python -m bench.step_shapes MODEL: what a change of a step's shape costs, against a row of a step.

The runner alone (no engine): a context of --context tokens, then steps of one request's rows at that context
(the same positions again each step), in patterns of row counts: constant (1, 4, 7 rows: the time of a row)
and changing every step (1 and 7 alternating, 1 to 10 cycling: each step another shape, which makes the CPU
plugin prepare its kernels and buffers for it). A changing pattern's mean minus the mean of its sizes' constant
times is the price of a shape change, which the draft policy weighs against padding or more drafts.
"""

from __future__ import annotations

import argparse
import time
from statistics import mean, median

from service.core.config import SAFE_STEP_TOKENS, EngineConfig
from service.engine.model_files import ModelFiles
from service.engine.runner import ModelRunner, StepInput

PATTERNS = {
    "1 row": [1],
    "4 rows": [4],
    "7 rows": [7],
    "1 and 7 alternating": [1, 7],
    "1 to 10 cycling": list(range(1, 11)),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_shapes", description=__doc__)
    p.add_argument("model")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=60, help="steps per pattern and round")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args(argv)
    config = EngineConfig()
    runner = ModelRunner(ModelFiles.read(a.model).ir, config)
    blocks = list(range(a.context // runner.block_size + 2))
    prompt = [1 + i % 1000 for i in range(a.context)]
    piece = SAFE_STEP_TOKENS  # the context is written in steps any CPU computes alike
    for start in range(0, a.context, piece):
        runner.execute([StepInput(prompt[start : start + piece], start, blocks, 1)])
    for r in range(a.rounds):
        for name, pattern in PATTERNS.items():
            times, changes = [], 0
            for k in range(a.steps):
                rows = pattern[k % len(pattern)]
                t0 = time.perf_counter()
                changes += runner.step([StepInput([5] * rows, a.context, blocks, rows)]).shape_changed
                times.append(time.perf_counter() - t0)
            print(
                f"round {r}, {name}: median {median(times) * 1000:.2f} ms, mean {mean(times) * 1000:.2f} ms, "
                f"{changes} shape changes in {a.steps} steps",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
