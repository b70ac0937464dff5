"""python -m bench.speculative MODEL: speculative decoding (prompt lookup) at one stream, interleaved.

Four engines load side by side in this process and take turns on the same writing-assistant prompts
(bench/prompts.jsonl: rewrite, polish, translate, summarize), greedy, up to --max-new-tokens each, so that all
see the same background load: ovserve without and with speculation, and openvino-genai's LLMPipeline without
and with its prompt lookup (num_assistant_tokens and max_ngram_size set like ours). Each engine stops at eos as
it would in use; tokens/s counts what each generated. Also reports how often ovserve's speculative reply equals
its plain one token for token (int8 weights: a many-token verify step can round a near tie differently).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from statistics import median

from bench import run, workers


def ours(model: str, speculative_tokens: int, ngram: int):
    return workers.our_engine(
        {"model": model, "budget": workers.budget_dict(workers.BUDGET)},
        prefix_caching=False,
        settings={"speculative_tokens": speculative_tokens, "speculative_ngram": ngram},
    )


async def ours_one(engine, ids: list[int], max_new: int) -> list[int]:
    from service.core.params import SamplingParams

    tokens: list[int] = []
    async for out in engine.generate(ids, SamplingParams(max_new_tokens=max_new)):
        tokens += out.token_ids
    return tokens


def genai(model: str, threads: int, lookup: bool):
    import openvino_genai as og

    config = {"INFERENCE_NUM_THREADS": threads}
    if lookup:
        return og.LLMPipeline(model, "CPU", prompt_lookup=True, **config)
    return og.LLMPipeline(model, "CPU", **config)


def genai_one(pipe, ids: list[int], max_new: int, k: int, ngram: int, lookup: bool) -> int:
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    config = og.GenerationConfig(max_new_tokens=max_new)
    config.eos_token_id = pipe.get_generation_config().eos_token_id
    if lookup:
        config.num_assistant_tokens = k
        config.max_ngram_size = ngram
    result = pipe.generate(ov.Tensor(np.asarray([ids], dtype=np.int64)), config)
    return int(np.asarray(result.tokens[0]).size) if hasattr(result, "tokens") else len(result.m_generation_ids[0])


def median_ratio(a: list[float], b: list[float]) -> float:
    """The median of the per-prompt ratios a[i] / b[i]."""
    return median(x / y for x, y in zip(a, b, strict=True))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__)
    p.add_argument("model")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--k", type=int, default=5, help="draft tokens per step (genai: num_assistant_tokens)")
    p.add_argument("--ngram", type=int, default=3)
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    ids, _ = run.tokenize(Path(a.model), run.load_prompts())
    ids = ids[: a.prompts]
    threads = workers.peer_threads(workers.BUDGET)
    engines = {"ovserve": ours(a.model, 0, a.ngram), "ovserve+lookup": ours(a.model, a.k, a.ngram)}
    pipes = {"genai": genai(a.model, threads, False), "genai+lookup": genai(a.model, threads, True)}
    rates: dict[str, list[float]] = {name: [] for name in [*engines, *pipes]}
    same = 0
    try:
        for i, prompt in enumerate(ids):
            replies = {}
            for name, engine in engines.items():
                t0 = time.perf_counter()
                replies[name] = asyncio.run(ours_one(engine, prompt, a.max_new_tokens))
                rates[name].append(len(replies[name]) / (time.perf_counter() - t0))
            same += replies["ovserve"] == replies["ovserve+lookup"]
            for name, pipe in pipes.items():
                t0 = time.perf_counter()
                n = genai_one(pipe, prompt, a.max_new_tokens, a.k, a.ngram, lookup=name.endswith("lookup"))
                rates[name].append(n / (time.perf_counter() - t0))
            print(f"prompt {i}: " + ", ".join(f"{n} {r[-1]:.1f} tok/s" for n, r in rates.items()), flush=True)
        stats = engines["ovserve+lookup"].stats()
    finally:
        for engine in engines.values():
            engine.shutdown()
    result = {
        "model": a.model,
        "k": a.k,
        "ngram": a.ngram,
        "max_new_tokens": a.max_new_tokens,
        "tokens_per_s": rates,
        "median_tokens_per_s": {n: median(r) for n, r in rates.items()},
        "speedup_ours": median_ratio(rates["ovserve+lookup"], rates["ovserve"]),
        "speedup_genai": median_ratio(rates["genai+lookup"], rates["genai"]),
        "lookup_vs_genai_lookup": median_ratio(rates["ovserve+lookup"], rates["genai+lookup"]),
        "acceptance": stats.num_accepted_tokens / max(1, stats.num_draft_tokens),
        "identical_replies": f"{same}/{len(ids)}",
    }
    print(json.dumps({k: v for k, v in result.items() if k != "tokens_per_s"}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
