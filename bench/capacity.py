"""python -m bench.capacity [--quick]: how many writing-assistant users one CPU server carries at a latency
target, ovserve against its peers, in one run (`make bench`; the full sweep: `make bench-capacity-full`).

Every system serves the same model files on the same cores as an OpenAI-compatible HTTP server, started once
and driven by the same client (bench.chat_load) with the same sessions (bench.workload, from one seed). For
each system the number of concurrent users rises (1, 2, 4, 8, ...) until the 95th percentile of a latency
misses its target; the systems take turns level by level, the order reversed every round, so that drift on a
shared machine hits all alike. A system carries a level when, over the turns sent after the last user arrived:

- time to first token of ordinary turns (edits and writing, the document already in the conversation), p95;
- time to first token of turns that paste a document (500-1,500 tokens, their own target: on 2 cores its
  prefill alone takes seconds in every system), p95;
- the reply's pace, (last token - first token) / (tokens - 1) per reply, p95;

are within their targets (TARGETS, below, for SmolLM2 on 2 cores) and no turn failed. The capacity is the
largest level carried. Also recorded per level: output tokens/s, prompt tokens computed and reused (where the
server reports them), the peak resident memory of the server's process tree, latency percentiles, and what
each system does with the OpenAI `prediction` field that edit turns carry (--no-prediction leaves it out).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import loopback, replicas, run, sysinfo
from bench.chat_load import ChatClient, as_dicts, probe_prediction, run_level, served_model
from bench.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
THREADS = 2
KV_CACHE_GB = 1  # every system's KV budget: ovserve and genai in GiB; llama-server in tokens (LLAMA_CONTEXT)
LLAMA_CONTEXT = 65536  # f16 K and V: ~1.5 GB for SmolLM2 (llama.cpp's default cache type)


@dataclass(frozen=True)
class Targets:
    """p95 targets, chosen for SmolLM2-135M on 2 cores: a reply starts within 2 s, a pasted document is read
    within 8 s (1,500 tokens take 3-6 s alone here), and a reply streams at least ~7 tokens/s."""

    ttft_s: float = 2.0
    paste_ttft_s: float = 8.0
    tpot_s: float = 0.150


TARGETS = Targets()


# -- the search ----------------------------------------------------------------------------------------------
class Search:
    """Users to try next for one system: up the ladder until a level is missed, then (refine) halving the gap
    between the last level carried and the first missed until they are neighbours. With `every`, every level
    of the ladder runs, missed or not (latency curves to compare past a miss); the capacity is still the largest
    level below the first one missed. With `start`, the climb begins there: fewer users are taken as carried
    (no system here missed a target with fewer users than a level it carried), which saves the slow small levels
    when an earlier run has located the system's limit."""

    def __init__(self, ladder: list[int], refine: bool, every: bool = False, start: int = 0) -> None:
        self.ladder = sorted({n for n in ladder if n > start} | ({start} if start else set()))
        self.refine = refine
        self.every = every
        self.carried = 0  # the largest level carried so far
        self.missed: int | None = None  # the smallest level missed so far
        self.tried: list[tuple[int, bool]] = []

    def next(self) -> int | None:
        if self.every:
            left = [n for n in self.ladder if n not in {users for users, _ in self.tried}]
            return left[0] if left else None
        if self.missed is None:
            higher = [n for n in self.ladder if n > self.carried]
            return higher[0] if higher else None
        if not self.refine or self.missed - self.carried <= 1:
            return None
        return (self.carried + self.missed) // 2

    def record(self, users: int, carried: bool) -> None:
        self.tried.append((users, carried))
        if not carried:
            self.missed = users if self.missed is None else min(self.missed, users)
        elif self.missed is None or users < self.missed:  # a level carried above a miss (every) does not count
            self.carried = max(self.carried, users)

    @property
    def capacity(self) -> int:
        return self.carried


def percentile(values: list[float], q: float) -> float | None:
    return replicas.percentile(values, q) if values else None


def summarize(turns: list[dict], wall_s: float, targets: Targets = TARGETS) -> dict:
    """A level's figures over its measured turns (not warm-up), and whether it met every target."""
    measured = [t for t in turns if not t["warmup"]]
    ok = [t for t in measured if t["status"] == "ok"]
    ttft = [t["ttft_s"] for t in ok if t["kind"] != "paste" and t["ttft_s"] is not None]
    paste = [t["ttft_s"] for t in ok if t["kind"] == "paste" and t["ttft_s"] is not None]
    tpot = [t["tpot_s"] for t in ok if t["tpot_s"] is not None]
    gaps = [g for t in ok for g in t["gaps_s"]]
    reported = [t for t in ok if t["cached_tokens"] is not None]
    p95 = {"ttft_s": percentile(ttft, 0.95), "paste_ttft_s": percentile(paste, 0.95), "tpot_s": percentile(tpot, 0.95)}
    misses = [k for k, v in p95.items() if v is not None and v > getattr(targets, k)]
    errors = len(measured) - len(ok)
    return {
        "turns": len(measured),
        "warmup_turns": len(turns) - len(measured),
        "errors": errors,
        "error_samples": sorted({t["status"] for t in measured if t["status"] != "ok"})[:3],
        "carried": bool(ok) and not misses and errors == 0,
        "missed": misses + (["errors"] if errors else []) + ([] if ok else ["no turn measured"]),
        "p95": p95,
        "p50": {
            "ttft_s": percentile(ttft, 0.5),
            "paste_ttft_s": percentile(paste, 0.5),
            "tpot_s": percentile(tpot, 0.5),
        },
        "p99_gap_s": percentile(gaps, 0.99),
        "samples": {"ttft": len(ttft), "paste_ttft": len(paste), "tpot": len(tpot)},
        "output_tokens_per_s": sum(t["completion_tokens"] or 0 for t in turns if t["status"] == "ok") / wall_s,
        "prompt_tokens": sum(t["prompt_tokens"] or 0 for t in reported),
        "prompt_tokens_reused": sum(t["cached_tokens"] for t in reported) if reported else None,
        "accepted_prediction_tokens": sum(t["accepted_prediction_tokens"] or 0 for t in ok),
        "wall_s": wall_s,
    }


# -- the systems ------------------------------------------------------------------------------------------------
def tree_rss(pid: int) -> int:
    """Resident bytes of a process and its descendants (0 once it is gone)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def trees_rss(pids: list[int]) -> int:
    return sum(tree_rss(pid) for pid in pids)


class PeakRss:
    """The peak of the process trees' summed resident bytes, sampled every second on a thread, while in a `with`
    block."""

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.peak = pids, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def sample(self) -> None:
        while True:
            self.peak = max(self.peak, trees_rss(self.pids))
            if self.stop.wait(1.0):
                return

    def __enter__(self) -> PeakRss:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, trees_rss(self.pids))


@dataclass
class System:
    """One server as its users run it: how to start it, and what its turns carry."""

    name: str
    kind: str  # ovserve, genai, llama.cpp
    settings: str  # what differs, in words, for the report
    args: list[str] = field(default_factory=list)
    session_header: bool = False
    disk_tier: bool = False  # ovserve: the prefix cache's disk tier, in a folder of its own
    gguf: str | None = None
    precision: str | None = None
    replicas: int = 1  # ovserve: this many replicas behind the project's HAProxy recipe, sharing the cores


def behind_haproxy(system: System, count: int) -> System:
    """The same ovserve settings as `count` replicas behind HAProxy (deploy/lb.py: a session's turns hashed to
    one replica by x-session-id), with the cores and the KV budget split between them."""
    return System(
        f"{system.name} x{count}",
        system.kind,
        f"{system.settings}; {count} replicas of 1 inference thread and {KV_CACHE_GB / count:.2f} GiB of KV cache "
        f"each, on the same {THREADS} cores, behind HAProxy with session hashing",
        system.args,
        session_header=True,
        disk_tier=system.disk_tier,
        replicas=count,
    )


def systems(model: Path, quick: bool, with_llama: bool) -> list[System]:
    out = [
        System(
            "ovserve",
            "ovserve",
            "recommended: speculation auto (prompt lookup), prefix cache with its disk tier, x-session-id; "
            "deterministic steps, the step budget chosen at start (the defaults)",
            ["--speculation", "auto"],
            session_header=True,
            disk_tier=True,
        ),
        System("ovserve plain", "ovserve", "defaults: speculation off, prefix cache in RAM only, no session key"),
        System(
            "genai CB",
            "genai",
            "ContinuousBatchingPipeline, prefix caching on, OVMS's scheduler defaults; "
            "activations at the plugin's default precision",
        ),
    ]
    if not quick:  # what reproducible replies cost this traffic: prompts computed in fewer, larger steps
        fast = System(
            "ovserve fast steps",
            "ovserve",
            "the recommended set with --no-deterministic --max-num-batched-tokens 512 (replies not reproducible)",
            ["--speculation", "auto", "--no-deterministic", "--max-num-batched-tokens", "512"],
            session_header=True,
            disk_tier=True,
        )
        out.insert(1, fast)
    flags = set(sysinfo.machine()["isa_flags"])
    if not flags & {"avx512_bf16", "amx_bf16"}:
        out[-1].settings += " (f32 on this CPU: it has neither AVX512_BF16 nor AMX)"
    elif not quick:
        out.append(System("genai CB f32", "genai", "the same with f32 activations", precision="f32"))
    if with_llama:
        gguf = run.smol_gguf()
        if gguf is not None:
            out.append(
                System(
                    "llama-server Q4_1",
                    "llama.cpp",
                    f"the GGUF SmolLM2 ships as ({gguf.name}), "
                    "continuous batching over parallel slots, unified f16 KV, prompt cache",
                    gguf=str(gguf),
                )
            )
            if not quick:
                from bench import llama_server

                q8 = llama_server.q8_0(gguf, THREADS)
                out.append(
                    System(
                        "llama-server Q8_0",
                        "llama.cpp",
                        "the same weights requantized to Q8_0 (our IR's precision)",
                        gguf=str(q8),
                    )
                )
    return out


class Served:
    """A system's server process on a free port, its log in a file; `url` once it answers."""

    def __init__(self, system: System, model: Path, work: Path, slots: int) -> None:
        self.system = system
        self.log = work / f"{system.name.replace(' ', '-')}.log"
        self.port = loopback.free_port()
        self.replicas: list[replicas.Replica] = []
        self.balancer: replicas.HAProxy | None = None
        if system.kind == "ovserve":
            count = system.replicas
            for i in range(count):
                args = list(system.args)
                name = self.log.stem if count == 1 else f"{self.log.stem}-{i}"
                if system.disk_tier:
                    args += ["--kv-disk-dir", str(work / f"kv-disk-{name}")]
                threads, kv_gb = (THREADS, KV_CACHE_GB) if count == 1 else (1, KV_CACHE_GB / count)
                log = self.log if count == 1 else work / f"{name}.log"
                port = self.port if count == 1 else 0
                self.replicas.append(replicas.Replica(model, log, threads, kv_gb, *args, http_port=port))
            self.proc = self.replicas[0].proc
            return
        if system.kind == "genai":
            command = [
                sys.executable,
                "-m",
                "bench.genai_server",
                "--model",
                str(model),
                "--port",
                str(self.port),
                "--kv-cache-gb",
                str(KV_CACHE_GB),
                "--threads",
                str(THREADS),
            ]
            if system.precision:
                command += ["--precision", system.precision]
        else:
            from bench import llama_server

            # port 0: llama-server binds a port of the kernel's choosing (its log names it). A port picked here
            # and bound later could meet another SO_REUSEPORT listener (cpp-httplib and gRPC both set it) and
            # share connections with it silently: seen as dropped requests on a busy host.
            self.port = 0
            command = llama_server.command(Path(system.gguf or ""), 0, slots, THREADS, LLAMA_CONTEXT)
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pids(self) -> list[int]:
        """The processes whose memory counts: the server, or every replica (HAProxy's few MB left out)."""
        return [r.proc.pid for r in self.replicas] or [self.proc.pid]

    def wait(self, timeout: float = 1200) -> None:  # the Qwen3-4B shape warms up for minutes beside the others
        if self.replicas:
            for r in self.replicas:
                r.wait_serving(timeout)
            if len(self.replicas) > 1:  # HAProxy starts its servers up: they already serve
                lb_dir = self.log.parent / f"haproxy-{self.log.stem}"
                lb_dir.mkdir(exist_ok=True)
                pool = replicas.local_pool(self.replicas, log_requests=False)
                self.balancer = replicas.HAProxy(pool, lb_dir)
                self.port = int(self.balancer.http_url.rsplit(":", 1)[1])
            return
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.system.name} exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if self.port == 0:
                bound = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.log.read_text(errors="replace"))
                if bound is None:
                    time.sleep(0.5)
                    continue
                self.port = int(bound.group(1))
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.system.name} not serving after {timeout} s")

    def stop(self) -> None:
        if self.balancer is not None:
            self.balancer.stop()
        for proc in [r.proc for r in self.replicas] or [self.proc]:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(30)


# -- one level -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    ladder: list[int]
    refine: bool
    duration_s: float
    ramp_s: float
    think_s: float
    seed: int
    prediction: bool
    targets: Targets = TARGETS
    min_turns: int = 0  # a level runs on past its duration (up to 3x) until this many turns are measured
    every_level: bool = False  # run every level of the ladder, not only up to the first missed
    starts: dict[str, int] = field(default_factory=dict)  # a system's first level, when not the ladder's first


QUICK = Plan([1, 2, 4, 8], False, 30, 6, 3.0, 1, True, min_turns=8)
FULL = Plan([1, 2, 4, 8, 16, 32, 64], True, 180, 30, 8.0, 1, True, min_turns=20)


def measure(
    url: str,
    pids: list[int] | None,
    workload: Workload,
    users: int,
    plan: Plan,
    prediction: bool,
    session_header: bool,
    model: str,
) -> dict:
    """One level against one server: its summary, peak memory and every turn."""

    async def go() -> list:
        client = ChatClient(url, prediction, session_header, model)
        try:
            return await run_level(client, workload, users, plan.duration_s, plan.ramp_s, plan.seed, plan.min_turns)
        finally:
            await client.close()

    t0 = time.perf_counter()
    if not pids:
        turns = as_dicts(asyncio.run(go()))
        peak = None
    else:
        with PeakRss(pids) as rss:
            turns = as_dicts(asyncio.run(go()))
        peak = rss.peak
    summary = summarize(turns, time.perf_counter() - t0, plan.targets)
    return {"users": users, "summary": summary, "peak_rss_bytes": peak, "loadavg": os.getloadavg(), "turns": turns}


def prepare(url: str, workload: Workload, log=print) -> tuple[str, str]:
    """The model the server names, and what it does with `prediction` (asked twice: the first time warms the
    server's shapes and caches up). A dropped connection is tried again twice."""
    import httpx

    async def go() -> tuple[str, str]:
        client = ChatClient(url, False, False)
        try:
            client.model = await served_model(client)
            await probe_prediction(client, workload)
            return client.model, await probe_prediction(client, workload)
        finally:
            await client.close()

    for attempt in range(3):
        try:
            return asyncio.run(go())
        except httpx.TransportError as exc:
            if attempt == 2:
                raise
            log(f"{url}: {type(exc).__name__}: {exc}; trying again in 5 s")
            time.sleep(5)
    raise AssertionError("unreachable")


def sweep(chosen: list[System], model: Path, plan: Plan, workload: Workload, work: Path, log=print) -> dict:
    """Every system's search, level by level in alternating order; every server runs the whole time."""
    slots = max(plan.ladder)
    servers = {}
    try:
        for s in chosen:
            servers[s.name] = Served(s, model, work, slots)
        results: dict[str, dict] = {}
        for s in chosen:
            servers[s.name].wait()
            model_id, prediction = prepare(servers[s.name].url, workload, log)
            results[s.name] = {
                **asdict(s),
                "model_id": model_id,
                "prediction": prediction,
                "levels": [],
                "idle_rss_bytes": trees_rss(servers[s.name].pids),
            }
            log(f"{s.name}: serving; prediction {prediction}")
        searches = {
            s.name: Search(plan.ladder, plan.refine, plan.every_level, plan.starts.get(s.name, 0)) for s in chosen
        }
        round_no = 0
        while any(search.next() is not None for search in searches.values()):
            order = chosen if round_no % 2 == 0 else chosen[::-1]
            for s in order:
                users = searches[s.name].next()
                if users is None:
                    continue
                send_prediction = plan.prediction and results[s.name]["prediction"] != "refused"
                level = measure(
                    servers[s.name].url,
                    servers[s.name].pids,
                    workload,
                    users,
                    plan,
                    send_prediction,
                    s.session_header,
                    results[s.name]["model_id"],
                )
                searches[s.name].record(users, level["summary"]["carried"])
                results[s.name]["levels"].append(level)
                log(line(s.name, level))
            round_no += 1
        for s in chosen:
            results[s.name]["capacity"] = searches[s.name].capacity
            results[s.name]["tried"] = searches[s.name].tried
        return results
    finally:
        for served in servers.values():
            served.stop()


def line(name: str, level: dict) -> str:
    s = level["summary"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{1000 * v:.0f}"

    return (
        f"{name} @ {level['users']} users: {'carried' if s['carried'] else 'missed ' + ','.join(s['missed'])}; "
        f"p95 ttft {ms(s['p95']['ttft_s'])} ms, paste {ms(s['p95']['paste_ttft_s'])} ms, "
        f"pace {ms(s['p95']['tpot_s'])} ms; {s['output_tokens_per_s']:.1f} tok/s; {s['turns']} turns, "
        f"{s['errors']} errors; load {level['loadavg'][0]:.1f}"
    )


def token_counter(model: Path):
    from service.engine.model_files import ModelFiles
    from service.engine.tokenizer import Tokenizer

    tok = Tokenizer(ModelFiles.read(model).path)
    return lambda text: len(tok.encode(text, add_special_tokens=False))


def span(text: str) -> tuple[int, int]:
    """LOW,HIGH token counts, 0 < LOW <= HIGH; anything else ends the run naming the rule."""
    parts = text.split(",")
    if len(parts) != 2 or not all(x.strip().isdigit() for x in parts) or not 0 < int(parts[0]) <= int(parts[1]):
        raise SystemExit(f"a range is LOW,HIGH with 0 < LOW <= HIGH, not {text!r}")
    return int(parts[0]), int(parts[1])


def starts(given: list[str], top: int) -> dict[str, int]:
    """SYSTEM=USERS pairs, 1 <= USERS <= the ladder's top; anything else ends the run naming the rule."""
    out = {}
    for item in given:
        name, _, users = item.rpartition("=")
        if not name or not users.isdigit() or not 1 <= int(users) <= top:
            raise SystemExit(f"--start is SYSTEM=USERS with 1 <= USERS <= {top} (the ladder's top), not {item!r}")
        out[name] = int(users)
    return out


def choose(known: list[System], names: str | None, replicas: int, starts: dict[str, int]) -> list[System]:
    """The systems run: those named (comma-separated; all when None), each ovserve one also as `replicas` replicas
    behind HAProxy ("NAME xN", its own climb: N replicas carry their own number of users). A --start naming none
    of them ends the run."""
    chosen = [s for s in known if names is None or s.name in names.split(",")]
    if replicas > 1:
        chosen = [x for s in chosen for x in ([s, behind_haproxy(s, replicas)] if s.kind == "ovserve" else [s])]
    unknown = set(starts) - {s.name for s in chosen}
    if unknown:
        raise SystemExit(f"--start names {sorted(unknown)}, not among the systems run: {[s.name for s in chosen]}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m-int8")
    p.add_argument("--quick", action="store_true", help="4 systems, 1-8 users, 30 s a level (about 10 minutes in all)")
    p.add_argument("--systems", help="comma-separated names to run (default: all of the set)")
    p.add_argument("--ladder", help="comma-separated user counts (default: 1,2,4,8 quick, 1,2,...,64 full)")
    p.add_argument("--duration", type=float, help="seconds a level runs")
    p.add_argument("--think", type=float, help="mean think time before a turn, seconds")
    p.add_argument(
        "--min-turns",
        type=int,
        help="turns a level measures at least, running up to 3x its duration (8 quick, 20 full)",
    )
    p.add_argument("--ttft", type=float, default=TARGETS.ttft_s, help="p95 first-token target, ordinary turns (s)")
    p.add_argument("--paste-ttft", type=float, default=TARGETS.paste_ttft_s, help="the same, pasting turns (s)")
    p.add_argument("--pace", type=float, default=TARGETS.tpot_s, help="p95 time per output token target (s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--start",
        action="append",
        default=[],
        metavar="SYSTEM=USERS",
        help="begin this system's climb at USERS, taking fewer as carried (repeatable; e.g. from an earlier run)",
    )
    p.add_argument("--every-level", action="store_true", help="run every level of the ladder, past a missed one")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="also run each chosen ovserve system as this many replicas behind HAProxy on the same cores",
    )
    p.add_argument("--documents", help="pasted documents' length range in tokens, LOW,HIGH (default 500,1500)")
    p.add_argument("--replies", help="replies' length range in tokens, LOW,HIGH (default 100,300)")
    p.add_argument("--no-prediction", action="store_true", help="edit turns carry no `prediction`")
    p.add_argument("--no-llama", action="store_true", help="leave llama-server out")
    p.add_argument("--build-llama", action="store_true", help="build llama-server first if missing (~12 min)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results-capacity")
    p.add_argument("--note", help="a line for the report's head, e.g. how busy the host was")
    p.add_argument("--report-only", action="store_true", help="rebuild REPORT.md and the plots from results.json")
    a = p.parse_args(argv)
    if a.replicas < 1:
        p.error(f"--replicas is a count of 1 or more, not {a.replicas}")
    os.chdir(ROOT)
    from bench import capacity_report, llama_server

    if a.report_only:
        capacity_report.write(json.loads((a.out / "results.json").read_text()), a.out)
        return 0
    plan = QUICK if a.quick else FULL
    ladder = [int(x) for x in a.ladder.split(",")] if a.ladder else plan.ladder
    plan = Plan(
        ladder,
        plan.refine,
        a.duration or plan.duration_s,
        min(plan.ramp_s, (a.duration or plan.duration_s) / 4),
        plan.think_s if a.think is None else a.think,
        a.seed,
        not a.no_prediction,
        Targets(a.ttft, a.paste_ttft, a.pace),
        plan.min_turns if a.min_turns is None else a.min_turns,
        a.every_level,
        starts(a.start, max(ladder)),
    )
    if a.build_llama and not a.no_llama:
        llama_server.build()
    with_llama = not a.no_llama and llama_server.binary() is not None
    chosen = choose(systems(a.model, a.quick, with_llama), a.systems, a.replicas, plan.starts)
    sizes = {}
    if a.documents:
        sizes["document_tokens"] = span(a.documents)
    if a.replies:
        sizes["reply_tokens"] = span(a.replies)
    workload = Workload(plan.seed, token_counter(a.model), plan.think_s, **sizes)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    print(
        f"capacity: {', '.join(s.name for s in chosen)}; ladder {plan.ladder}; {plan.duration_s:.0f} s a level",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="capacity-"))
    try:
        results = sweep(chosen, a.model, plan, workload, work, lambda m: print(m, flush=True))
    except BaseException:
        print(f"the servers' logs are in {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)
    record = {
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": sysinfo.machine(),
        "versions": sysinfo.versions(),
        "model": str(a.model.relative_to(ROOT) if a.model.is_relative_to(ROOT) else a.model),
        "quick": a.quick,
        "note": a.note,
        "plan": asdict(plan),
        "workload": {"document_tokens": workload.document_tokens, "reply_tokens": workload.reply_tokens},
        "threads": THREADS,
        "kv_cache_gb": KV_CACHE_GB,
        "llama_context": LLAMA_CONTEXT,
        "llama_server": "built" if with_llama else "not built (python -m bench.llama_server build)",
        "systems": results,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(record, indent=1))
    capacity_report.write(record, a.out)
    print(f"wrote {a.out / 'results.json'}, {a.out / 'REPORT.md'} and plots", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
