"""python -m bench.structured MODEL: decoding under a JSON schema against plain decoding, and the mask's cost.

One engine in this process; rounds alternate plain and constrained on the same prompts (bench/prompts.jsonl
with the chat template) so that both see the same background load. Both run exactly --max-new-tokens per
reply: plain with ignore_eos, constrained under a schema that cannot be complete before then (an array of at
least MIN_ITEMS objects), so both keep the same batch for the same number of steps. Rates are generated
tokens over wall time; the ratio is the median of per-round ratios. The mask's time is the engine's own
measure: per step that had constrained requests, all their masks together (at N streams, N masks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from statistics import mean, median
from typing import Any

from bench import workers
from service.engine import GenerationRequest

HERE = Path(__file__).resolve().parent
MIN_ITEMS = 40
SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "items": {
            "type": "array",
            "minItems": MIN_ITEMS,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "category": {"enum": ["food", "tools", "books", "other"]},
                },
                "required": ["name", "quantity", "category"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["order_id", "items"],
    "additionalProperties": False,
}


def prompts(engine: Any, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in (HERE / "prompts.jsonl").read_text().splitlines() if line.strip()]
    return [engine.tokenizer.encode_chat(rows[i % len(rows)]["messages"]) for i in range(n)]


async def batch(engine: Any, ids: list[list[int]], max_new: int, constrained: bool) -> tuple[int, float]:
    from service.core.grammar import ResponseFormat
    from service.core.params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    fmt = ResponseFormat.json_schema(json.dumps(SCHEMA)) if constrained else None

    async def one(prompt: list[int]) -> int:
        return sum(
            [
                len(out.token_ids)
                async for out in engine.generate(GenerationRequest(prompt, params, response_format=fmt))
            ]
        )

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in ids))
    return sum(counts), time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(model: str, streams: list[int], rounds: int, max_new: int) -> dict[str, Any]:
    engine = workers.our_engine({"model": model, "budget": workers.budget_dict(workers.BUDGET)}, prefix_caching=False)
    results: dict[str, Any] = {"model": model, "max_new_tokens": max_new, "schema": SCHEMA, "streams": {}}
    try:
        asyncio.run(batch(engine, prompts(engine, 1), 8, constrained=True))  # builds the grammar tokenizer
        for n in streams:
            ids = prompts(engine, n)
            asyncio.run(batch(engine, ids, 16, constrained=False))  # warm the step shapes of this batch
            rates: dict[str, list[float]] = {"plain": [], "json_schema": []}
            engine.core.masks.seconds.clear()
            for _ in range(rounds):
                for mode in ("plain", "json_schema"):
                    tokens, seconds = asyncio.run(batch(engine, ids, max_new, constrained=mode == "json_schema"))
                    assert tokens == n * max_new, f"{mode}: {tokens} tokens, expected {n * max_new}"
                    rates[mode].append(tokens / seconds)
            masks = list(engine.core.masks.seconds)
            ratios = [c / p for p, c in zip(rates["plain"], rates["json_schema"], strict=True)]
            results["streams"][str(n)] = {
                "tokens_per_second": {mode: [round(r, 1) for r in values] for mode, values in rates.items()},
                "median_ratio": round(median(ratios), 3),
                "mask_ms_per_step": {
                    "mean": round(1000 * mean(masks), 3),
                    "p99": round(1000 * percentile(masks, 0.99), 3),
                    "steps": len(masks),
                },
            }
            print(json.dumps({n: results["streams"][str(n)]}), flush=True)
    finally:
        engine.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--streams", default="1,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=HERE / "results-structured/results.json")
    args = parser.parse_args()
    results = run(args.model, [int(s) for s in args.streams.split(",")], args.rounds, args.max_new_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
