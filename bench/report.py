"""REPORT.md and PNG plots from results.json."""

from __future__ import annotations

from pathlib import Path
from statistics import mean, median

from bench.run import summary


def _f(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    s = summary(results)
    lines: list[str] = ["# ovserve benchmark report", ""]
    m, v = results.get("machine", {}), results.get("versions", {})
    lines += [
        f"Run {results.get('started')} - {results.get('finished', '?')}"
        f"{' (quick set)' if results.get('quick') else ''}.",
        "",
        "## Machine",
        "",
        f"- CPU: {m.get('cpu_model')}, {m.get('usable_cpus')} usable of {m.get('logical_cpus')} logical CPUs, "
        f"{m.get('memory_gb')} GiB RAM",
        f"- ISA flags: {', '.join(m.get('isa_flags', []))}",
        f"- Memory stream-read bandwidth (numpy, best of 5): **{_f(results.get('bandwidth_gbps'))} GB/s**",
        f"- Python {m.get('python')}, {m.get('platform')}",
        "- Packages: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
        "",
        "## Method",
        "",
        "Every engine runs in its own subprocess, one at a time, on the same int8 IR with the same prompt token "
        "ids (the writing-assistant set in `bench/prompts.jsonl`, 21 chat prompts in English and Chinese, "
        "rendered with the model's chat template). N concurrent requests = N prompts submitted at once, "
        "128 new tokens each (32 for the Qwen3-4B shape) with eos ignored; output tokens/s = generated tokens / "
        "wall time from submission to the "
        "last token (prefill included). Equal budgets for ovserve and genai: same KV-cache size, "
        f"{_budget_text(results)}, prefix caching off for throughput runs (on for multi-turn). "
        "ovserve and genai alternate order across rounds; ratios are computed within a round, then the median "
        "is taken.",
        "",
    ]
    for name, e in results.get("models", {}).items():
        ms = s.get(name, {})
        lines += [
            f"## {name}",
            "",
            f"IR `{e['dir']}`, weights {e['weight_bytes'] / 1e6:.0f} MB, "
            f"mean prompt {e['prompt_tokens_mean']:.0f} tokens, {e['max_new_tokens']} new tokens per request, "
            f"KV cache {e['budget']['kv_cache_gb']} GB, "
            f"{len(e['rounds'])} round(s).",
            "",
            "| engine | " + " | ".join(f"c={c}" for c in (1, 8, 32)) + " |",
            "|---|---|---|---|",
        ]
        rows = [
            ("ovserve Engine (in-process)", ms.get("ours", {})),
            ("openvino-genai ContinuousBatchingPipeline", ms.get("genai", {})),
            ("optimum-intel generate(), static batch", ms.get("optimum", {})),
            ("HF transformers PyTorch fp32 (32 new tokens)", ms.get("hf", {})),
        ]
        for label, d in rows:
            if d:
                lines.append(f"| {label} | " + " | ".join(_f(_get(d, c)) for c in (1, 8, 32)) + " |")
        r = ms.get("ratio_vs_genai", {})
        ratios = (_get(r, c) for c in (1, 8, 32))
        lines.append("| **ovserve / genai** | " + " | ".join(f"**{x:.2f}x**" if x else "-" for x in ratios) + " |")
        lines += ["", "Output tokens/s; medians over rounds.", ""]
        errs = [f"{k}: {e[k].get('error')}" for k in ("optimum", "hf") if k in e and not e[k].get("ok")]
        for rnd in e["rounds"]:
            errs += [f"{k}: {x.get('error')}" for k, x in rnd.items() if not x.get("ok")]
        if errs:
            lines += ["Failures: " + "; ".join(errs), ""]
        ours1 = _get(ms.get("ours", {}), 1)
        if ours1 and results.get("bandwidth_gbps"):
            bw = results["bandwidth_gbps"] * 1e9
            streamed = e["weight_bytes"] - (e.get("embedding_bytes") or 0)
            ceiling = bw / streamed
            g1 = _get(ms.get("genai", {}), 1)
            lines += [
                f"Batch-1 decode vs the memory limit: a decode step reads every weight once except the "
                f"input-embedding table (one row), about {streamed / 1e6:.0f} MB here; at "
                f"{results['bandwidth_gbps']:.1f} GB/s that caps batch 1 at {ceiling:.0f} tok/s "
                f"({bw / e['weight_bytes']:.0f} tok/s if the whole {e['weight_bytes'] / 1e6:.0f} MB file "
                f"were read). ovserve reaches {ours1:.1f} tok/s ({100 * ours1 / ceiling:.0f}% of the cap, "
                f"{e['max_new_tokens']} tokens incl. prefill)"
                + (f", genai {g1:.1f} ({100 * g1 / ceiling:.0f}%)." if g1 else "."),
                "",
            ]
        busy = _busy(e)
        if busy:
            lines += [
                f"Other processes kept up to {max(busy):.1f} CPUs busy just before a measurement "
                f"(median {median(busy):.2f}); above ~0.3 the numbers are noisy.",
                "",
            ]
        prof = _profile(e)
        if prof:
            lines += [
                "Where ovserve's engine thread spends a step (share of wall time, per concurrency): ",
                "",
                "| c | model execute | sampler | scheduler | other in step | outside steps |",
                "|---|---|---|---|---|---|",
            ]
            for c, p in prof.items():
                lines.append(
                    f"| {c} | {p['execute']:.0%} | {p['sample']:.0%} | {p['schedule']:.0%} | "
                    f"{p['other']:.0%} | {p['idle']:.0%} |"
                )
            lines.append("")
        lines += _multiturn_md(e)
        lines += _grpc_md(e)
        lines += _tuning_md(e)
    lines += ["## Plots", ""]
    for png in plots(results, s, out):
        lines.append(f"![{png.stem}]({png.name})")
    lines.append("")
    (out / "REPORT.md").write_text("\n".join(lines), encoding="utf-8")


def _budget_text(results: dict) -> str:
    """The budget the runs had (the first model's; they differ in KV-cache size only), from the results."""
    first: dict = next(iter(results.get("models", {}).values()), {})
    b: dict = first.get("budget", {})
    threads = b.get("threads", b.get("num_threads"))  # num_threads in results from before EngineConfig.threads
    parts = [f"{k} {b[k]}" for k in ("max_num_seqs", "max_num_batched_tokens") if k in b]
    parts += [f"{threads} inference threads"] if threads else []
    parts += [f"{b['kv_cache_precision']} KV cache (both defaults)"] if "kv_cache_precision" in b else []
    return ", ".join(parts) or "the engine defaults"


def _busy(e: dict) -> list[float]:
    runs = [x for rnd in e["rounds"] for x in rnd.values()]
    runs += [e[k] for k in ("optimum", "hf", "multiturn_ours", "multiturn_genai") if k in e]
    return [x["busy_cpus_before"] for x in runs if x.get("busy_cpus_before") is not None]


def _get(d: dict, c: int):
    return d.get(c, d.get(str(c)))


def _profile(e: dict) -> dict:
    acc: dict = {}
    for rnd in e["rounds"]:
        if not rnd.get("ours", {}).get("ok"):
            continue
        for r in rnd["ours"]["runs"]:
            t = r.get("engine_thread_s")
            if not t:
                continue
            w = r["wall_s"]
            update = t.get("update", t.get("complete", 0.0))  # "complete" in results from before the engine stats
            other = t["step"] - t["execute"] - t["sample"] - t["schedule"] - update
            acc.setdefault(r["concurrency"], []).append(
                {
                    "execute": t["execute"] / w,
                    "sample": t["sample"] / w,
                    "schedule": (t["schedule"] + update) / w,
                    "other": max(0.0, other / w),  # timer overhead can make it a hair negative
                    "idle": max(0.0, 1 - t["step"] / w),
                }
            )
    return {c: {k: mean(x[k] for x in v) for k in v[0]} for c, v in acc.items()}


def _multiturn_md(e: dict) -> list[str]:
    mo, mg = e.get("multiturn_ours"), e.get("multiturn_genai")
    if not mo:
        return []
    if not mo.get("ok"):
        return [f"Multi-turn failed: {mo.get('error')}", ""]
    lines = [
        "### Multi-turn: second-turn TTFT, history cached vs cold",
        "",
        f"{len(mo['cached_ttft_s'])} conversations; turn-2 prompts of {min(mo['prompt_tokens'])}-"
        f"{max(mo['prompt_tokens'])} tokens (turn-1 history + a 32-token reply + a new user message); "
        "cold = the identical prompt on an engine with prefix caching off. Medians, ms.",
        "",
        "| engine | cached | cold | cold / cached |",
        "|---|---|---|---|",
    ]
    for label, d in (("ovserve", mo), ("genai (enable_prefix_caching)", mg)):
        if d and d.get("ok"):
            a, b = median(d["cached_ttft_s"]), median(d["cold_ttft_s"])
            lines.append(f"| {label} | {_ms(a)} | {_ms(b)} | {b / a:.1f}x |")
    lines += ["", f"ovserve reused {mo['cached_tokens']} prompt tokens from the cache.", ""]
    return lines


def _grpc_md(e: dict) -> list[str]:
    g = e.get("grpc")
    if not g:
        return []
    lines = ["### gRPC layer: through the server vs the engine in-process (interleaved, same run)", ""]
    if g.get("skipped") or g.get("error"):
        lines += [f"gRPC runs skipped or failed: {g.get('skipped') or g.get('error')}", ""]
    o = g.get("overhead") or {}
    if o.get("ok"):
        lines += [
            "| streams | in-process tok/s | gRPC tok/s | gRPC / in-process | CPU ms/token in-process | "
            "server + load generator | extra CPU |",
            "|---|---|---|---|---|---|---|",
        ]
        for c, r in o["runs"].items():
            lines.append(
                f"| {c} | {_f(r['inproc_tokens_per_s'])} | {_f(r['grpc_tokens_per_s'])} | "
                f"{r['throughput_ratio']:.3f} | {r['inproc_cpu_ms_per_token']:.2f} | "
                f"{r['grpc_cpu_ms_per_token']:.2f} + {r['client_cpu_ms_per_token']:.2f} | "
                f"{100 * r['cpu_cost']:+.1f}% |"
            )
        lines += [
            "",
            f"`python -m bench.grpc_ab`: an in-process engine and `python -m service` with the same budget, loaded "
            f"side by side, {len(next(iter(o['runs'].values()))['pairs'])} alternating pairs of bursts of "
            f"{o['max_new_tokens']} new tokens per stream; ratios per pair, then the median. The load generator runs "
            "under SCHED_IDLE (a remote client's CPU is not ours to spend). CPU per token: the whole in-process "
            "engine vs the server process plus the load generator; with inference threads on every core, the extra "
            "CPU is what the gRPC layer takes from inference (a second view of the same cost; both move with the "
            "background load of a shared machine).",
            "",
        ]
    elif o:
        lines += [f"gRPC overhead run failed: {o.get('error', '')[-300:]}", ""]
    if g.get("closed_loop"):
        lines += [
            "Closed-loop sweep through gRPC (each stream sends its next request when the last ends):",
            "",
            "| streams | out tok/s | req/s | TTFT p50 / p95 / p99 ms | ITL p50 / p99 ms | errors |",
            "|---|---|---|---|---|---|",
        ]
        for r in g["closed_loop"]:
            lines.append(_load_row(r["concurrency"], r))
        lines.append("")
    if g.get("poisson"):
        lines += [
            "Open-loop Poisson arrivals through gRPC:",
            "",
            "| rate req/s | out tok/s | req/s | TTFT p50 / p95 / p99 ms | ITL p50 / p99 ms | errors |",
            "|---|---|---|---|---|---|",
        ]
        for r in g["poisson"]:
            lines.append(_load_row(r["rate"], r))
        lines.append("")
    mt = g.get("multiturn")
    if mt:
        lines += [
            f"Multi-turn conversations through gRPC: {mt.get('conversations', 'several')} conversations side by "
            "side, each turn "
            f"sent when the previous reply ({mt['reply_tokens']} tokens) is in, prefix caching on (the default):",
            "",
            "| turn | prompt tokens | served from cache | TTFT p50 / p95 ms | ITL p50 ms | errors |",
            "|---|---|---|---|---|---|",
        ]
        for t in mt["turns"]:
            lines.append(
                f"| {t['turn']} | {t['prompt_tokens_mean']:.0f} | {_f(t['cached_tokens_mean'], 0)} | "
                f"{_ms(t['ttft_s']['p50'])} / {_ms(t['ttft_s']['p95'])} | {_ms(t['itl_s']['p50'])} | "
                f"{t['errors'] or 0} |"
            )
        lines.append("")
    return lines


def _tuning_md(e: dict) -> list[str]:
    t = e.get("tuning")
    if not t:
        return []
    lines = [
        "### Tuning answers",
        "",
        "`python -m bench.tune`: two in-process engines that differ in one setting, loaded side by side, runs "
        "alternating; B/A is the median of per-pair ratios (above 1: B is faster).",
        "",
        "| knob | A | B | workload | A tok/s | B tok/s | B/A | TTFT p50 A / B ms | ITL p99 A / B ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for knob, r in t.items():
        if not r.get("ok"):
            lines.append(f"| {knob} | failed: {r.get('error', '')[-120:]} | | | | | | | |")
            continue
        a, b = _setting(r["a"]), _setting(r["b"])
        for w in r["workloads"]:
            lines.append(
                f"| {knob} | {a} | {b} | {w['workload']} | {_f(w['a_tokens_per_s'])} | {_f(w['b_tokens_per_s'])} | "
                f"{w['b_over_a']:.2f} | {_ms(w['a_ttft_p50_s'])} / {_ms(w['b_ttft_p50_s'])} | "
                f"{_ms(w.get('a_itl_p99_s'))} / {_ms(w.get('b_itl_p99_s'))} |"
            )
    lines.append("")
    return lines


def _setting(d: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items()) or "default"


def _load_row(key, r: dict) -> str:
    t, i = r["ttft_s"], r["itl_s"]
    return (
        f"| {key} | {_f(r['tokens_per_s'])} | {_f(r['requests_per_s'], 2)} | "
        f"{_ms(t['p50'])} / {_ms(t['p95'])} / {_ms(t['p99'])} | {_ms(i['p50'])} / {_ms(i['p99'])} | "
        f"{r['errors'] or 0} |"
    )


def plots(results: dict, s: dict, out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    models = list(results.get("models", {}))
    if models:
        fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
        for ax, name in zip(axes[0], models, strict=True):
            for kind, label in (
                ("ours", "ovserve"),
                ("genai", "genai CB"),
                ("optimum", "optimum-intel"),
                ("hf", "HF PyTorch"),
            ):
                d = s.get(name, {}).get(kind)
                if d:
                    cs = sorted(int(c) for c in d)
                    ax.plot(cs, [_get(d, c) for c in cs], marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel("output tokens/s")
            ax.set_title(name)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
        fig.tight_layout()
        made.append(out / "throughput_vs_concurrency.png")
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    for name, e in results.get("models", {}).items():
        g = e.get("grpc") or {}
        if g.get("closed_loop") or g.get("poisson"):
            fig, axes = plt.subplots(1, 2, figsize=(11, 4))
            for ax, key, xk, xl in (
                (axes[0], "closed_loop", "concurrency", "concurrent streams (closed loop)"),
                (axes[1], "poisson", "rate", "arrival rate, req/s (Poisson)"),
            ):
                rows = g.get(key) or []
                x = [r[xk] for r in rows]
                for q in ("p50", "p95", "p99"):
                    ax.plot(x, [(r["ttft_s"][q] or 0) * 1000 for r in rows], marker="o", label=f"TTFT {q}")
                for q in ("p50", "p99"):
                    ax.plot(x, [(r["itl_s"][q] or 0) * 1000 for r in rows], marker="x", ls="--", label=f"ITL {q}")
                ax.set_xlabel(xl)
                ax.set_ylabel("ms")
                ax.set_yscale("log")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
            fig.suptitle(f"{name}: latency vs load through gRPC")
            fig.tight_layout()
            made.append(out / f"latency_vs_load_{name}.png")
            fig.savefig(made[-1], dpi=110)
            plt.close(fig)
        mo, mg = e.get("multiturn_ours"), e.get("multiturn_genai")
        if mo and mo.get("ok"):
            fig, ax = plt.subplots(figsize=(5.5, 4))
            labels, cached, cold = [], [], []
            for label, d in (("ovserve", mo), ("genai", mg)):
                if d and d.get("ok"):
                    labels.append(label)
                    cached.append(median(d["cached_ttft_s"]) * 1000)
                    cold.append(median(d["cold_ttft_s"]) * 1000)
            xs = range(len(labels))
            ax.bar([x - 0.2 for x in xs], cold, 0.4, label="cold cache")
            ax.bar([x + 0.2 for x in xs], cached, 0.4, label="history cached")
            ax.set_xticks(list(xs), labels)
            ax.set_ylabel("second-turn TTFT, ms")
            ax.set_title(f"{name}: prefix-cache effect (~1k-token history)")
            ax.legend()
            fig.tight_layout()
            made.append(out / f"prefix_cache_{name}.png")
            fig.savefig(made[-1], dpi=110)
            plt.close(fig)
    return made
