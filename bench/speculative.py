"""python -m bench.speculative MODEL: speculative decoding (prompt lookup), interleaved, at 1 and more streams.

Engines load side by side in this process and take turns on the same prompts, greedy, stopping at eos as
they would in use, up to --max-new-tokens each, so that all see the same background load:

- ovserve without and with speculation (`--speculation auto --speculative-tokens K`, its cost rule deciding
  per step);
- openvino-genai's LLMPipeline without and with prompt_lookup (one stream only);
- openvino-genai's ContinuousBatchingPipeline without and with prompt lookup (the `prompt_lookup` property).

genai's lookup runs at its recommended settings (the prompt-lookup sample's num_assistant_tokens=5,
max_ngram_size=3), ours at its defaults (at most 10 drafts, its cost rule choosing how many; --our-k changes
that) with the same n-gram. Two workloads: `edit` (bench/prompts-edit.jsonl: English
and Chinese texts of 150-400 tokens to rewrite, correct, translate keeping the quotations, or repeat and
continue; the work prompt lookup is for) and `writing` (bench/prompts.jsonl: open-ended writing, emails,
summaries; little is copied). At N streams, with `--arrivals closed` (the default) N clients each send their
next prompt as soon as their last reply ends, through --requests-per-stream prompts each per round, as users
of a service do; with `--arrivals batch` each round submits N prompts at once and waits for all (a batch job:
the slowest reply sets the time, so tokens gained by the others count little). The set is cycled, shifted each
round. Rates are generated tokens over wall time; ratios are medians of per-round ratios. Also reported: how
often a speculative greedy reply equals the same engine's plain reply (int8 weights: a many-token verify
step can round a near tie differently), ours and genai's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

from bench import run, workers
from service.core.config import INFERENCE_PRECISIONS, EngineConfig
from service.engine import GenerationRequest

HERE = Path(__file__).resolve().parent
WORKLOADS = {"edit": HERE / "prompts-edit.jsonl", "writing": HERE / "prompts.jsonl"}
# prompts, streams, max new tokens -> replies in the prompts' order: each of `streams` clients sends its next
# prompt when its last reply ends (streams = len(prompts): all at once)
Serve = Callable[[list[list[int]], int, int], list[list[int]]]


def ours(
    model: str,
    k: int,
    ngram: int,
    precision: str | None = None,
    max_seqs: int | None = None,
    deterministic: bool | None = None,
) -> Any:
    settings: dict[str, Any] = {
        "speculation": "auto" if k else "off",
        "speculative_tokens": k,
        "prompt_lookup_max_ngram": ngram,
    }
    if max_seqs is not None:
        settings["speculative_max_seqs"] = max_seqs
    if precision is not None:
        settings["inference_precision"] = precision
    if deterministic is not None:
        settings["deterministic"] = deterministic
    return workers.our_engine(
        {"model": model, "budget": workers.budget_dict(workers.BUDGET)}, prefix_caching=False, settings=settings
    )


def ours_serve(engine: Any) -> Serve:
    from service.core.params import SamplingParams

    async def one(ids: list[int], max_new: int, clients: asyncio.Semaphore) -> list[int]:
        tokens: list[int] = []
        async with clients:
            async for out in engine.generate(GenerationRequest(ids, SamplingParams(max_new_tokens=max_new))):
                tokens += out.token_ids
        return tokens

    async def serve(prompts: list[list[int]], streams: int, max_new: int) -> list[list[int]]:
        clients = asyncio.Semaphore(streams)
        return list(await asyncio.gather(*(one(p, max_new, clients) for p in prompts)))

    return lambda prompts, streams, max_new: asyncio.run(serve(prompts, streams, max_new))


def _config(model: str, max_new: int, k: int, ngram: int, lookup: bool) -> Any:
    """genai's greedy config, stopping at the eos ids ovserve stops at (the model's generation config)."""
    import openvino_genai as og

    from service.engine.model_files import ModelFiles

    eos = ModelFiles.read(model).eos_token_ids
    config = og.GenerationConfig(max_new_tokens=max_new)
    config.eos_token_id = eos[0]
    config.stop_token_ids = set(eos)
    if lookup:
        config.num_assistant_tokens = k
        config.max_ngram_size = ngram
    return config


def _tensor(ids: list[int]) -> Any:
    import numpy as np
    import openvino as ov

    return ov.Tensor(np.asarray([ids], dtype=np.int64))


def _genai_properties(precision: str | None) -> dict[str, Any]:
    """genai's plugin properties: the bench's thread count, and an activation precision if one is asked for
    (f32 on both sides stands for a CPU without bf16, where the plugin's default is f32)."""
    properties: dict[str, Any] = {"INFERENCE_NUM_THREADS": workers.peer_threads(workers.BUDGET)}
    if precision is not None:
        properties["INFERENCE_PRECISION_HINT"] = precision
    return properties


def llm_pipeline(model: str, lookup: bool, k: int, ngram: int, precision: str | None = None) -> Serve:
    import numpy as np
    import openvino_genai as og

    pipe = og.LLMPipeline(model, "CPU", prompt_lookup=lookup, **_genai_properties(precision))

    def serve(prompts: list[list[int]], streams: int, max_new: int) -> list[list[int]]:
        assert streams == 1, "LLMPipeline serves one stream"
        config = _config(model, max_new, k, ngram, lookup)
        return [np.asarray(pipe.generate(_tensor(p), config).tokens[0]).tolist() for p in prompts]

    return serve


def cb_pipeline(model: str, lookup: bool, k: int, ngram: int, precision: str | None = None) -> Serve:
    import openvino_genai as og

    b = workers.BUDGET
    sc = og.SchedulerConfig()
    sc.cache_size = max(1, int(round(b.kv_cache_gb)))
    sc.max_num_seqs = b.max_num_seqs
    sc.max_num_batched_tokens = b.max_num_batched_tokens
    sc.enable_prefix_caching = False
    properties = _genai_properties(precision)
    if lookup:
        properties["prompt_lookup"] = True
    pipe = og.ContinuousBatchingPipeline(model, sc, "CPU", properties)

    request_ids = iter(range(1 << 62))

    def serve(prompts: list[list[int]], streams: int, max_new: int) -> list[list[int]]:
        """The pipeline's own step loop, as its generate() runs it, adding a prompt whenever one ends."""
        config = _config(model, max_new, k, ngram, lookup)
        replies: list[list[int]] = [[] for _ in prompts]
        running: dict[int, Any] = {}
        waiting = iter(range(len(prompts)))
        while True:
            while len(running) < streams and (i := next(waiting, None)) is not None:
                running[i] = pipe.add_request(next(request_ids), _tensor(prompts[i]), config)
            if not running:
                return replies
            pipe.step()
            for i, handle in list(running.items()):
                status = handle.get_status()
                if status == og.GenerationStatus.FINISHED:
                    replies[i] = list(handle.read_all()[0].generated_ids)
                    del running[i]
                elif status != og.GenerationStatus.RUNNING:
                    raise RuntimeError(f"genai request ended with {status}")

    return serve


def cost_curve(
    model: str, batches: tuple[int, ...], max_drafts: int, repeats: int, contexts: tuple[int, ...] = (64, 512)
) -> dict[str, Any]:
    """Step time against tokens per step: `batch` decoding sequences (each `context` tokens long) each feeding
    its last token plus 0..max_drafts drafts, every logits row wanted, as verify steps do: as one sequence a
    request (fast steps, --no-deterministic) and as one-token rows (deterministic steps, the default).
    Median of `repeats` after one unmeasured step per shape; also as a multiple of the step without drafts."""
    from service.core.config import EngineConfig
    from service.engine.runner import ModelRunner, StepInput

    ir = Path(model) / "openvino_model.xml"
    runners = {
        rows_form: ModelRunner(ir, EngineConfig(kv_cache_gb=1.0, deterministic=rows_form))
        for rows_form in (False, True)
    }
    curve: dict[str, Any] = {}
    for context in contexts:
        per_seq = -(-(context + max_drafts + 1) // runners[True].block_size)
        for batch in batches:
            tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
            for rows_form, runner in runners.items():
                rows = []
                for drafts in range(max_drafts + 1):
                    seqs = [StepInput([1] * (1 + drafts), context, t, 1 + drafts) for t in tables]
                    runner.execute(seqs)
                    times = []
                    for _ in range(repeats):
                        t0 = time.perf_counter()
                        runner.execute(seqs)
                        times.append(time.perf_counter() - t0)
                    rows.append(
                        {"tokens": batch * (1 + drafts), "drafts_per_seq": drafts, "seconds": round(median(times), 4)}
                    )
                for row in rows:
                    row["x_plain_step"] = round(row["seconds"] / rows[0]["seconds"], 3)
                key = f"context {context}, batch {batch}" + (", drafts as rows" if rows_form else "")
                curve[key] = rows
                print(f"{key}: " + ", ".join(f"{r['tokens']} tok {r['seconds']:.3f}s" for r in rows), flush=True)
    return {"model": model, "repeats": repeats, "load": os.getloadavg(), "curves": curve}


def median_ratio(a: list[float], b: list[float]) -> float:
    """The median of the per-round ratios a[i] / b[i]."""
    return median(x / y for x, y in zip(a, b, strict=True))


def run_streams(
    engines: dict[str, Serve], prompts: list[list[int]], streams: int, rounds: int, max_new: int, per_stream: int = 1
) -> dict[str, Any]:
    """rounds rounds of streams * per_stream prompts served by `streams` clients, every engine in turn on the
    same prompts, in reverse order every other round (an engine that always ran after the same one would
    always meet what that one leaves behind: its threads winding down, the caches it filled)."""
    rates: dict[str, list[float]] = {name: [] for name in engines}
    replies: dict[str, list[list[int]]] = {name: [] for name in engines}
    size = streams * per_stream
    for r in range(rounds):
        batch = [prompts[(r * size + i) % len(prompts)] for i in range(size)]
        for name, serve in list(engines.items())[:: -1 if r % 2 else 1]:
            t0 = time.perf_counter()
            out = serve(batch, streams, max_new)
            rates[name].append(sum(len(x) for x in out) / (time.perf_counter() - t0))
            replies[name] += out
        print(f"  {streams} streams, round {r}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in rates.items()), flush=True)
    return {"rates": rates, "replies": replies}


def summarize(rates: dict[str, list[float]], replies: dict[str, list[list[int]]]) -> dict[str, Any]:
    pairs = [("ovserve+lookup", "ovserve"), ("genai+lookup", "genai"), ("genai-cb+lookup", "genai-cb")]
    ratios = {f"{a} / {b}": median_ratio(rates[a], rates[b]) for a, b in pairs if a in rates and b in rates}
    for peer in ("genai+lookup", "genai-cb+lookup", "genai-cb"):
        if peer in rates:
            ratios[f"ovserve+lookup / {peer}"] = median_ratio(rates["ovserve+lookup"], rates[peer])
    same = {
        f"{a} == {b}": f"{sum(x == y for x, y in zip(replies[a], replies[b], strict=True))}/{len(replies[a])}"
        for a, b in pairs
        if a in replies and b in replies
    }
    return {
        "median_tokens_per_s": {n: round(median(v), 1) for n, v in rates.items()},
        "ratios": {n: round(v, 3) for n, v in ratios.items()},
        "identical_greedy_replies": same,
        "reply_tokens": {n: round(median(len(x) for x in v)) for n, v in replies.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__)
    p.add_argument("model")
    p.add_argument("--workloads", default="edit,writing", help="comma-separated: edit, writing")
    p.add_argument("--streams", default="1", help="comma-separated stream counts, e.g. 1,4,8")
    p.add_argument("--rounds", type=int, default=0, help="rounds per stream count (default: the prompts once)")
    p.add_argument(
        "--arrivals",
        choices=("closed", "batch"),
        default="closed",
        help="closed: each stream sends its next prompt when its reply ends; batch: a round's prompts at once",
    )
    p.add_argument(
        "--requests-per-stream", type=int, default=3, help="prompts each stream sends per round (closed arrivals)"
    )
    p.add_argument("--writing-prompts", type=int, default=8, help="prompts of the writing set used")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--k", type=int, default=5, help="draft tokens per step (genai: num_assistant_tokens)")
    p.add_argument(
        "--our-k",
        type=int,
        help="ovserve's --speculative-tokens, its cost rule choosing up to it (default: ovserve's default)",
    )
    p.add_argument(
        "--our-precision",
        choices=INFERENCE_PRECISIONS,
        help="ovserve's --inference-precision (default: its own default)",
    )
    p.add_argument(
        "--our-fast-steps",
        action="store_true",
        help="ovserve's --no-deterministic for the lookup side: drafts verified as one sequence",
    )
    p.add_argument(
        "--genai-precision",
        choices=INFERENCE_PRECISIONS,
        help="genai's INFERENCE_PRECISION_HINT (default: the plugin's, bf16 on CPUs with AVX512_BF16); f32 on "
        "both sides stands for a CPU without bf16",
    )
    p.add_argument(
        "--our-max-seqs",
        type=int,
        help="ovserve's --speculative-max-seqs (default: its own default; 32 leaves it to the cost rule alone)",
    )
    p.add_argument("--ngram", type=int, default=3, help="longest n-gram matched (genai: max_ngram_size)")
    p.add_argument("--no-llm-pipeline", action="store_true", help="leave genai's LLMPipeline out")
    p.add_argument("--ours-only", action="store_true", help="ovserve without and with speculation only")
    p.add_argument(
        "--cost-curve",
        action="store_true",
        help="only measure step time against tokens per step (batch 1 and 8, 0 to --our-k drafts each, as one "
        "sequence and as one-token rows, contexts of 64 and 512 tokens), e.g. on the Qwen3-4B shape",
    )
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    if a.cost_curve:
        curve = cost_curve(a.model, (1, 8), EngineConfig().speculative_tokens if a.our_k is None else a.our_k, 3)
        if a.out:
            Path(a.out).write_text(json.dumps(curve, indent=1))
        return 0
    streams = [int(s) for s in a.streams.split(",")]
    our_k = EngineConfig().speculative_tokens if a.our_k is None else a.our_k
    per_stream = a.requests_per_stream if a.arrivals == "closed" else 1
    ours_plain = ours(a.model, 0, a.ngram, a.our_precision)
    ours_lookup = ours(a.model, our_k, a.ngram, a.our_precision, a.our_max_seqs, False if a.our_fast_steps else None)
    engines: dict[str, Serve] = {"ovserve": ours_serve(ours_plain), "ovserve+lookup": ours_serve(ours_lookup)}
    single: dict[str, Serve] = {}
    if not a.ours_only:
        engines["genai-cb"] = cb_pipeline(a.model, False, a.k, a.ngram, a.genai_precision)
        engines["genai-cb+lookup"] = cb_pipeline(a.model, True, a.k, a.ngram, a.genai_precision)
        if not a.no_llm_pipeline:
            single["genai"] = llm_pipeline(a.model, False, a.k, a.ngram, a.genai_precision)
            single["genai+lookup"] = llm_pipeline(a.model, True, a.k, a.ngram, a.genai_precision)
    result: dict[str, Any] = {
        "model": a.model,
        "k": a.k,
        "our_k": our_k,
        "our_precision": ours_plain.config.inference_precision,
        "our_max_seqs": ours_lookup.config.speculative_max_seqs,
        "our_deterministic": ours_lookup.config.deterministic,
        "genai_precision": a.genai_precision or "the plugin's default",
        "ngram": a.ngram,
        "max_new_tokens": a.max_new_tokens,
        "arrivals": a.arrivals,
        "requests_per_stream": per_stream,
        "load_before": os.getloadavg(),
        "ovserve_step_overhead_tokens": round(ours_lookup.core.step_times.overhead, 2),  # at warm-up
        "workloads": {},
    }
    try:
        for workload in a.workloads.split(","):
            prompts = run.load_prompts(WORKLOADS[workload])
            if workload == "writing":
                prompts = prompts[: a.writing_prompts]
            ids, _ = run.tokenize(Path(a.model), prompts)
            for n in streams:
                print(f"{workload}, {n} streams (load {os.getloadavg()[0]:.1f})", flush=True)
                stats0 = ours_lookup.stats()
                rounds = a.rounds or max(1, len(ids) // (n * per_stream))
                measured = run_streams(
                    engines | (single if n == 1 else {}), ids, n, rounds, a.max_new_tokens, per_stream
                )
                stats = ours_lookup.stats()
                drafts = stats.num_draft_tokens - stats0.num_draft_tokens
                accepted = stats.num_accepted_tokens - stats0.num_accepted_tokens
                verify_steps = stats.num_verify_steps - stats0.num_verify_steps
                summary = summarize(measured["rates"], measured["replies"]) | {
                    "ovserve_drafts": drafts,
                    "ovserve_acceptance": round(accepted / max(1, drafts), 3),
                    "ovserve_tokens_per_verify_step": round(1 + accepted / max(1, verify_steps), 2),
                    "ovserve_step_overhead_tokens": round(ours_lookup.core.step_times.overhead, 2),  # the table
                    "load": os.getloadavg(),
                    "tokens_per_s": measured["rates"],
                }
                result["workloads"].setdefault(workload, {})[str(n)] = summary
                print(json.dumps({k: v for k, v in summary.items() if k != "tokens_per_s"}, indent=1), flush=True)
    finally:
        ours_plain.shutdown()
        ours_lookup.shutdown()
    save(result, a.out)
    return 0


def save(result: dict[str, Any], out: str | None) -> None:
    """The run's results with the load after it, written to out (when given)."""
    result["load_after"] = os.getloadavg()
    if out:
        Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
