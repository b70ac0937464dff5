"""python -m bench.int4: what 4-bit weights buy (decode speed) and cost (quality), against 8-bit ones.

quality FP16 INT8 INT4: one model converted three ways, teacher-forced through our runner over held-out texts
(bench/texts/en.txt, an English story, and zh.txt, a Chinese one; written for this benchmark, so no model saw
them). Each position's logits come from one step over the whole text with every row wanted, an f16 KV cache,
so only the weights differ. Reported per text: how often int8's and int4's most likely next token is fp16's
(next-token agreement), and each model's perplexity of the text.

speed INT8 INT4: batch-1 decode tokens/s of our engine on each IR, both loaded, taking turns on the same
prompt (interleaved rounds, so both see the same background load); the ratio is the median of per-round
ratios. Decode rate: tokens after the first over the time from the first to the last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

from bench.speculative import median_ratio
from service.engine import GenerationRequest

HERE = Path(__file__).resolve().parent
TEXTS = {"en": HERE / "texts" / "en.txt", "zh": HERE / "texts" / "zh.txt"}


def teacher_forced_logits(model_dir: str, token_ids: list[int]) -> np.ndarray:
    """[len(token_ids), vocab] logits: row i predicts token i + 1."""
    from service.core.config import EngineConfig
    from service.engine.model_files import ModelFiles
    from service.engine.runner import ModelRunner, StepInput

    runner = ModelRunner(ModelFiles.read(model_dir).ir, EngineConfig(kv_cache_gb=0.1, kv_cache_precision="f16"))
    blocks = list(range(-(-len(token_ids) // runner.block_size)))
    return np.asarray(runner.execute([StepInput(token_ids, 0, blocks, len(token_ids))]), dtype=np.float64)


def perplexity(logits: np.ndarray, token_ids: list[int]) -> float:
    rows, targets = logits[:-1], np.asarray(token_ids[1:])
    shifted = rows - rows.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return math.exp(-float(log_probs[np.arange(len(targets)), targets].mean()))


def quality(models: dict[str, str]) -> dict[str, Any]:
    """models: fp16, int8 and int4 model folders (fp16 is the reference)."""
    from service.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(Path(models["fp16"]))
    result: dict[str, Any] = {}
    for name, path in TEXTS.items():
        ids = tokenizer.encode(path.read_text())
        logits = {kind: teacher_forced_logits(folder, ids) for kind, folder in models.items()}
        reference = logits["fp16"][:-1].argmax(axis=1)
        result[name] = {
            "tokens": len(ids),
            "perplexity": {kind: round(perplexity(x, ids), 3) for kind, x in logits.items()},
            "next_token_agreement_with_fp16": {
                kind: round(float((x[:-1].argmax(axis=1) == reference).mean()), 4)
                for kind, x in logits.items()
                if kind != "fp16"
            },
        }
        print(name, json.dumps(result[name]), flush=True)
    return result


def speed(models: dict[str, str], rounds: int, max_new: int, prompt: list[int]) -> dict[str, Any]:
    from service.core.config import EngineConfig
    from service.core.params import SamplingParams
    from service.engine import Engine

    config = EngineConfig(kv_cache_gb=0.25, enable_prefix_caching=False, speculative_tokens=0)
    engines = {kind: Engine(folder, config) for kind, folder in models.items()}
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)

    async def decode_rate(engine: Engine) -> float:
        async for out in engine.generate(GenerationRequest(prompt, params)):
            if out.finished:
                assert out.usage is not None and out.timings is not None
                return (out.usage.completion_tokens - 1) / out.timings.decode
        raise RuntimeError("the reply did not finish")

    rates: dict[str, list[float]] = {kind: [] for kind in engines}
    loads = []
    try:
        for engine in engines.values():
            engine.start()
            asyncio.run(decode_rate(engine))  # first use: kernels for every step shape are prepared
        for r in range(rounds):
            for kind, engine in engines.items():
                rates[kind].append(asyncio.run(decode_rate(engine)))
            loads.append(os.getloadavg()[0])
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f} tok/s" for k, v in rates.items()), flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    kinds = list(engines)
    return {
        "models": models,
        "max_new_tokens": max_new,
        "prompt_tokens": len(prompt),
        "median_tokens_per_s": {k: round(median(v), 2) for k, v in rates.items()},
        f"{kinds[1]} / {kinds[0]}": round(median_ratio(rates[kinds[1]], rates[kinds[0]]), 3),
        "tokens_per_s": rates,
        "load_per_round": loads,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.int4", description=__doc__)
    sub = p.add_subparsers(dest="what", required=True)
    q = sub.add_parser("quality", help="next-token agreement and perplexity against fp16")
    q.add_argument("fp16")
    q.add_argument("int8")
    q.add_argument("int4")
    s = sub.add_parser("speed", help="batch-1 decode tokens/s, int4 against int8, interleaved")
    s.add_argument("int8")
    s.add_argument("int4")
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument("--max-new-tokens", type=int, default=32)
    for sp in (q, s):
        sp.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    started = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_before": os.getloadavg()}
    if a.what == "quality":
        result = quality({"fp16": a.fp16, "int8": a.int8, "int4": a.int4})
    else:
        from service.engine.tokenizer import Tokenizer

        prompt = Tokenizer(Path(a.int8)).encode(TEXTS["en"].read_text())[:64]
        result = speed({"int8": a.int8, "int4": a.int4}, a.rounds, a.max_new_tokens, prompt)
    result = started | result | {"load_after": os.getloadavg()}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
