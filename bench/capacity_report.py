"""bench.capacity's REPORT.md and plots (latency against users, one line per system) from its results.json."""

from __future__ import annotations

from pathlib import Path

PLOTS = (  # file, title, value of a level, target attribute
    ("ttft.png", "time to first token, ordinary turns, p95 (s)", ("p95", "ttft_s"), "ttft_s"),
    (
        "paste-ttft.png",
        "time to first token, turns pasting a document, p95 (s)",
        ("p95", "paste_ttft_s"),
        "paste_ttft_s",
    ),
    ("pace.png", "time per output token within a reply, p95 (ms)", ("p95", "tpot_s"), "tpot_s"),
    ("tokens.png", "output tokens/s, all users", ("output_tokens_per_s",), None),
)


def value(summary: dict, path: tuple[str, ...]) -> float | None:
    v: object = summary
    for key in path:
        v = v.get(key) if isinstance(v, dict) else None
    return v if isinstance(v, float | int) else None


def plot(results: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    targets = results["plan"]["targets"]
    for name, title, path, target in PLOTS:
        fig, ax = plt.subplots(figsize=(6.4, 4))
        plotted = False
        for system, r in results["systems"].items():
            scale = 1000 if name == "pace.png" else 1
            points = sorted((lv["users"], value(lv["summary"], path)) for lv in r["levels"])
            xs = [users for users, y in points if y is not None]
            ys = [scale * y for _, y in points if y is not None]
            ax.plot(xs, ys, marker="o", label=system)
            plotted = plotted or bool(xs)
        if target:
            t = targets[target] * (1000 if name == "pace.png" else 1)
            ax.axhline(t, color="grey", linestyle="--", linewidth=1, label="target")
        if plotted:
            ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent users")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)
    return written


def at_capacity(r: dict) -> dict | None:
    """The level a system carried at its capacity (None when it carried none)."""
    return next((lv for lv in r["levels"] if lv["users"] == r.get("capacity") and lv["summary"]["carried"]), None)


def ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def table(results: dict) -> list[str]:
    """One row a system: the figures at its capacity, or at its first level when it carried none."""
    lines = [
        "| system | users carried | figures at | output tok/s | p95 first token: ordinary / paste (ms) "
        "| p95 time per token (ms) | prompt tokens reused | peak RSS (MB) | `prediction` |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for system, r in results["systems"].items():
        lv = at_capacity(r) or min(r["levels"], key=lambda lv: lv["users"], default=None)
        if lv is None:
            lines.append(f"| {system} | {r.get('capacity', 0)} | - | - | - | - | - | - | {r['prediction']} |")
            continue
        s = lv["summary"]
        where = f"{lv['users']} user{'' if lv['users'] == 1 else 's'}" + ("" if s["carried"] else ", missed")
        reused = (
            "not reported"
            if s["prompt_tokens_reused"] is None
            else f"{s['prompt_tokens_reused'] / max(1, s['prompt_tokens']):.0%} of {s['prompt_tokens']:,}"
        )
        rss = "-" if lv["peak_rss_bytes"] is None else f"{lv['peak_rss_bytes'] / 1e6:.0f}"
        lines.append(
            f"| {system} | **{r['capacity']}** | {where} | {s['output_tokens_per_s']:.1f} | {ms(s['p95']['ttft_s'])} / "
            f"{ms(s['p95']['paste_ttft_s'])} | {ms(s['p95']['tpot_s'])} | {reused} | {rss} | {r['prediction']} |"
        )
    return lines


def levels_table(results: dict) -> list[str]:
    lines = [
        "| system | users | verdict | turns (errors) | first token p50 / p95 (ms) | paste p50 / p95 (ms) | pace p50 / "
        "p95 (ms) | chunk gap p99 (ms) | tok/s | prompt tokens computed / reused | peak RSS (MB) | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for system, r in results["systems"].items():
        for lv in r["levels"]:
            s = lv["summary"]
            verdict = "carried" if s["carried"] else "missed: " + ", ".join(s["missed"])
            reused = s["prompt_tokens_reused"]
            tokens = "-" if reused is None else f"{s['prompt_tokens'] - reused:,} / {reused:,}"
            rss = "-" if lv["peak_rss_bytes"] is None else f"{lv['peak_rss_bytes'] / 1e6:.0f}"
            lines.append(
                f"| {system} | {lv['users']} | {verdict} | {s['turns']} ({s['errors']}) | {ms(s['p50']['ttft_s'])} / "
                f"{ms(s['p95']['ttft_s'])} | {ms(s['p50']['paste_ttft_s'])} / {ms(s['p95']['paste_ttft_s'])} | "
                f"{ms(s['p50']['tpot_s'])} / {ms(s['p95']['tpot_s'])} | {ms(s['p99_gap_s'])} | "
                f"{s['output_tokens_per_s']:.1f} | {tokens} | {rss} | {lv['loadavg'][0]:.1f} |"
            )
    return lines


def starts_text(starts: dict[str, int]) -> str:
    if not starts:
        return ""
    each = ", ".join(f"{name} from {users}" for name, users in starts.items())
    return f" (climbs begun higher, fewer users taken as carried: {each})"


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    plots = plot(results, out)
    m, v, plan = results["machine"], results["versions"], results["plan"]
    t = plan["targets"]
    sizes = results.get("workload", {})  # runs before 2026-12-07 used the defaults
    lines = [
        "# Writing-assistant users carried at a latency target (`python -m bench.capacity`)",
        "",
        *([f"**{results['note']}**", ""] if results.get("note") else []),
        f"{results['started']} to {results['finished']}; {m['cpu_model']}, {m['usable_cpus']} usable CPUs, CPU flags "
        f"{' '.join(m['isa_flags'])}; {results['threads']} inference threads each; openvino {v.get('openvino')}, "
        f"openvino-genai {v.get('openvino-genai')}; llama-server {results['llama_server']}.",
        f"Model: {results['model']} (our IR for ovserve and genai; llama-server runs the GGUF named below). "
        f"Sessions paste documents of {'-'.join(map(str, sizes.get('document_tokens', (500, 1500))))} tokens, "
        f"replies of {'-'.join(map(str, sizes.get('reply_tokens', (100, 300))))} tokens. "
        f"{'Quick set' if results['quick'] else 'Full sweep'}: levels {plan['ladder']}"
        f"{' refined by halving' if plan['refine'] else ''}"
        f"{starts_text(plan.get('starts') or {})}, {plan['duration_s']:.0f} s each, users arriving over "
        f"{plan['ramp_s']:.0f} s, think time {plan['think_s']:g} s on average, seed {plan['seed']}, `prediction` "
        f"{'sent on edit turns to servers that accept it' if plan['prediction'] else 'not sent'}.",
        f"Targets (p95 over the turns sent after the last user arrived): first token {t['ttft_s']:g} s for "
        f"ordinary turns, {t['paste_ttft_s']:g} s for turns pasting a document, {1000 * t['tpot_s']:.0f} ms per "
        "output token within a reply; no failed turn.",
        "",
        *table(results),
        "",
        "What each system is:",
        "",
        *[f"- **{name}**: {r['settings']}." for name, r in results["systems"].items()],
        "",
        "## Every level",
        "",
        *levels_table(results),
        "",
        *[f"![{p}]({p})" for p in plots],
        "",
    ]
    (out / "REPORT.md").write_text("\n".join(lines))
