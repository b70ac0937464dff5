"""Memory soak: does the server's memory outside the KV cache grow with the number of requests served?

python -m bench.memory_soak --model DIR [--requests N] [--out bench/results-memory/]
                            [--variant NAME[:ENV=VALUE,...]]... [--rounds R]

Starts `python -m service` in a subprocess per variant (port 0; the port is read from its log line
"listening on host:port"), warms it up until every KV cache block has been written once, then drives it
with the project's Client from a few worker threads: completed unary and streamed requests, streams
cancelled after 1-5 messages, requests whose short deadline expires (queued or mid-generation), invalid
requests (top_p=2, an empty prompt, max_new_tokens=0, an out-of-vocabulary token id) and multi-turn chats
whose messages grow turn by turn. Every --sample-every requests it reads the server's /proc/PID/status
(RssAnon, RssFile) and /proc/PID/smaps_rollup.

Why "anonymous RSS minus the KV budget" is memory outside the KV cache: the KV tensors are ordinary
anonymous memory, allocated untouched, that enters RSS as blocks are first written. The warm-up sends
distinct prompts totalling more tokens than the cache holds; the block pool hands out never-used blocks
before it evicts cached ones, so afterwards every block has been written and the KV tensors count fully
(GetModelInfo.kv_cache_bytes). The warm-up repeats until a round adds under 2 MB, and the report shows the
RssAnon of each warm-up round so that this can be checked. (The tensors are not separate, recognisable
mappings in /proc/PID/smaps: glibc may serve them from its heap once its dynamic mmap threshold has risen.)

Variants run one after another and, with --rounds > 1, alternate (A B A B), because the machine is shared.
A variant is a name plus environment variables for the server, e.g.
  --variant capped --variant plugin-defaults:OVSERVE_KERNEL_CACHE_SHAPES=5000,ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024
  --variant arena2:MALLOC_ARENA_MAX=2
Writes results.json (every sample) and REPORT.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
MB = 1e6
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "they",
    "this",
    "which",
    "are",
    "were",
    "be",
    "an",
    "or",
    "had",
    "not",
    "but",
    "river",
    "mountain",
    "engine",
    "kernel",
    "memory",
    "cache",
    "token",
    "request",
    "stream",
    "server",
    "client",
    "model",
    "thread",
    "arena",
    "block",
    "paris",
    "london",
    "tokyo",
    "autumn",
    "winter",
    "summer",
    "music",
    "history",
    "science",
    "garden",
    "ocean",
    "forest",
    "city",
    "library",
    "bridge",
    "quickly",
    "slowly",
    "carefully",
    "quietly",
    "brightly",
    "strange",
    "ancient",
    "modern",
    "gentle",
    "simple",
    "complex",
    "small",
    "large",
    "green",
]
TOPICS = ("cooking", "astronomy", "chess", "gardening", "sailing", "databases", "poetry", "trains", "bees", "tea")


# -- the server --------------------------------------------------------------------------------------------
@dataclass
class ServerProc:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# gRPC on any free port; metrics and the HTTP API off
PORTS = ("--port", "0", "--metrics-port", "0", "--http-port", "0")


def start_server(model: str, server_args: list[str], env_extra: dict[str, str], log_path: Path) -> ServerProc:
    """The server logs one line per request, so its stderr goes to a file (a pipe nobody reads would fill and
    block it); the file is polled for the "listening on" and "serving" lines."""
    env = {**os.environ, **env_extra}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "w")  # noqa: SIM115 (kept open for the child's lifetime)
    cmd = [sys.executable, "-m", "service", "--model", model, *PORTS, *server_args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, text=True)
    log_file.close()
    port = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        text = log_path.read_text()
        m = re.search(r"listening on \S+:(\d+)", text)
        if m:
            port = int(m.group(1))
        if port and re.search(r"\bserving\b", text):
            return ServerProc(proc, port, log_path)
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not start within 300 s:\n{log_path.read_text()[-3000:]}")


def read_memory(pid: int) -> dict[str, int]:
    """Bytes: RssAnon, RssFile, VmRSS, VmHWM from status; Anonymous, Private_Dirty, Swap from smaps_rollup."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmRSS", "VmHWM", "Threads"):
            value = rest.split()[0]
            out[key] = int(value) * (1024 if key != "Threads" else 1)
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        if key in ("Anonymous", "Private_Dirty", "Swap", "Rss"):
            out["smaps_" + key] = int(rest.split()[0]) * 1024
    return out


# -- the workload ------------------------------------------------------------------------------------------
def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@dataclass
class Counts:
    by_kind: dict[str, int] = field(default_factory=dict)
    by_code: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, code: str) -> None:
        with self.lock:
            self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
            self.by_code[code] = self.by_code.get(code, 0) + 1


KINDS = (  # (kind, weight); a chat counts one request per turn
    ("unary", 18),
    ("stream", 18),
    ("cancel", 14),
    ("deadline", 12),
    ("invalid", 12),
    ("chat", 26),
)


def sampling(rng: random.Random) -> dict:
    """Greedy or seeded sampling with assorted options, so the sampler's paths all run."""
    options: dict = {"max_new_tokens": rng.randint(8, 32)}
    if rng.random() < 0.5:
        options |= {"temperature": rng.choice((0.7, 1.0)), "seed": rng.randrange(1 << 30)}
        options |= rng.choice(({}, {"top_k": 20}, {"top_p": 0.9}, {"min_p": 0.05}))
    if rng.random() < 0.2:
        options["repetition_penalty"] = 1.1
    if rng.random() < 0.1:
        options["logprobs"] = 3
    return options


def prompt_input(rng: random.Random) -> dict:
    r = rng.random()
    if r < 0.5:
        return {"prompt": text(rng, rng.randint(3, 120))}
    if r < 0.8:
        return {"messages": [{"role": "user", "content": text(rng, rng.randint(3, 60))}]}
    return {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randint(4, 200))]}


def one_request(client, rng: random.Random, kind: str, count) -> None:
    """Runs one request (or, for a chat, a whole conversation); count(kind, code) once per request."""
    if kind == "unary":
        client.generate(**prompt_input(rng), **sampling(rng), stop=rng.choice(((), (".",), ("\n", " the"))))
        count(kind, "OK")
    elif kind == "stream":
        for _ in client.stream(**prompt_input(rng), **sampling(rng)):
            pass
        count(kind, "OK")
    elif kind == "cancel":
        stream = client.stream(**prompt_input(rng), max_new_tokens=64, ignore_eos=True)
        want = rng.randint(1, 5)
        got = 0
        for _ in stream:
            got += 1
            if got >= want:
                stream.cancel()
                break
        count(kind, "CANCELLED" if got >= want else "OK")
    elif kind == "deadline":
        timeout = rng.choice((0.005, 0.02, 0.05, 0.1, 0.2))
        try:
            if rng.random() < 0.5:
                client.generate(**prompt_input(rng), max_new_tokens=64, ignore_eos=True, timeout=timeout)
            else:
                for _ in client.stream(**prompt_input(rng), max_new_tokens=64, ignore_eos=True, timeout=timeout):
                    pass
            count(kind, "OK")
        except grpc.RpcError as exc:
            count(kind, exc.code().name)
    elif kind == "invalid":
        bad = rng.choice(
            (
                {"prompt": "hello", "top_p": 2.0},
                {"prompt": ""},
                {"prompt": "hello", "max_new_tokens": 0},
                {"prompt_token_ids": [10, 10**9]},
                {"messages": [{"role": "wizard", "content": "hi"}]},
            )
        )
        try:
            client.generate(**bad)
            count(kind, "OK")
        except grpc.RpcError as exc:
            count(kind, exc.code().name)
    elif kind == "chat":
        messages = []
        if rng.random() < 0.5:
            messages.append(
                {"role": "system", "content": f"You are a helpful assistant who knows {rng.choice(TOPICS)}."}
            )
        for _turn in range(rng.randint(2, 5)):
            messages.append({"role": "user", "content": text(rng, rng.randint(4, 30)) + "?"})
            if rng.random() < 0.5:
                reply = client.generate(messages=messages, **sampling(rng)).text
            else:
                reply = "".join(c.text for c in client.stream(messages=messages, **sampling(rng)))
            messages.append({"role": "assistant", "content": reply})
            count(kind, "OK")


class Soak:
    """Worker threads share one request counter; every `sample_every` requests, the worker that crosses the
    mark reads the server's memory."""

    def __init__(self, server: ServerProc, requests: int, workers: int, sample_every: int, seed: int) -> None:
        self.server, self.requests, self.workers, self.sample_every = server, requests, workers, sample_every
        self.seed = seed
        self.done = 0
        self.lock = threading.Lock()
        self.samples: list[dict] = []
        self.counts = Counts()
        self.errors: list[str] = []
        self.started = time.monotonic()

    def count(self, kind: str, code: str) -> None:
        self.counts.add(kind, code)
        with self.lock:
            self.done += 1
            mark = self.done % self.sample_every == 0
            n = self.done
        if mark:
            self.sample(n)

    def sample(self, n: int) -> None:
        row = {"requests": n, "seconds": round(time.monotonic() - self.started, 2), **read_memory(self.server.pid)}
        with self.lock:
            self.samples.append(row)

    def worker(self, index: int) -> None:
        from service.client import Client

        rng = random.Random(self.seed * 1000 + index)
        names = [k for k, _ in KINDS]
        weights = [w for _, w in KINDS]
        with Client(f"127.0.0.1:{self.server.port}", timeout=120) as client:
            while True:
                with self.lock:
                    if self.done >= self.requests:
                        return
                kind = rng.choices(names, weights)[0]
                try:
                    one_request(client, rng, kind, self.count)
                except grpc.RpcError as exc:  # unexpected: counted, and the first few kept for the report
                    self.count(kind, "UNEXPECTED_" + exc.code().name)
                    if len(self.errors) < 10:
                        self.errors.append(f"{kind}: {exc.code().name}: {exc.details()}")

    def run(self) -> None:
        self.sample(0)
        threads = [threading.Thread(target=self.worker, args=(i,), daemon=True) for i in range(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(1.0)  # in-flight aborts settle
        self.sample(self.done)


def warm_up(server: ServerProc, seed: int, max_rounds: int = 6) -> dict:
    """Distinct prompts of full blocks until every KV block has been written: rounds of 1.2x the cache's
    token capacity, until a round adds under 2 MB of anonymous memory. Then one round of the soak mix
    (a few hundred requests) so that the first samples do not include one-time costs."""
    from service.client import Client

    rng = random.Random(seed)
    with Client(f"127.0.0.1:{server.port}", timeout=300) as client:
        info = client.model_info()
        capacity = info.num_kv_blocks * info.block_size
        prompt_len = min(15 * info.block_size, info.max_model_len - 2)
        per_round = int(1.2 * capacity / prompt_len) + 1
        rounds = [read_memory(server.pid)["RssAnon"]]
        for _ in range(max_rounds):
            done = threading.Semaphore(0)

            def send(n: int, done: threading.Semaphore = done) -> None:
                with Client(f"127.0.0.1:{server.port}", timeout=300) as c:
                    for _ in range(n):
                        ids = [rng.randrange(100, 40000) for _ in range(prompt_len)]
                        c.generate(prompt_token_ids=ids, max_new_tokens=1)
                done.release()

            for n in (per_round // 2, per_round - per_round // 2):
                threading.Thread(target=send, args=(n,), daemon=True).start()
            done.acquire()
            done.acquire()
            rounds.append(read_memory(server.pid)["RssAnon"])
            if len(rounds) >= 3 and rounds[-1] - rounds[-2] < 2 * MB:
                break
    return {
        "kv_cache_bytes": info.kv_cache_bytes,
        "num_kv_blocks": info.num_kv_blocks,
        "block_size": info.block_size,
        "warmup_rss_anon_by_round": rounds,
    }


# -- analysis ----------------------------------------------------------------------------------------------
def slope_per_1000(samples: list[dict], key: str, skip: int = 1000) -> float | None:
    """Least-squares slope of samples[key] against requests, after the first `skip` requests, per 1,000."""
    pts = [(s["requests"], s[key]) for s in samples if s["requests"] >= skip]
    if len(pts) < 3:
        return None
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    sxy = sum((x - mx) * (y - my) for x, y in pts)
    return sxy / sxx * 1000 if sxx else None


def summarize(run: dict) -> dict:
    kv = run["warmup"]["kv_cache_bytes"]
    samples = run["samples"]
    for s in samples:
        s["outside_kv"] = s["RssAnon"] - kv
    slope = slope_per_1000(samples, "outside_kv")
    return {
        "variant": run["variant"],
        "round": run["round"],
        "requests": samples[-1]["requests"],
        "seconds": samples[-1]["seconds"],
        "kv_cache_mb": kv / MB,
        "outside_kv_start_mb": samples[0]["outside_kv"] / MB,
        "outside_kv_end_mb": samples[-1]["outside_kv"] / MB,
        "outside_kv_max_mb": max(s["outside_kv"] for s in samples) / MB,
        "slope_mb_per_1000": None if slope is None else slope / MB,
        "rss_file_end_mb": samples[-1]["RssFile"] / MB,
        "threads_end": samples[-1].get("Threads"),
    }


def write_report(out: Path, results: dict) -> None:
    lines = [
        "# Memory soak",
        "",
        f"{results['when']}, {results['host']}; model `{results['model']}`; server flags "
        f"`{' '.join(results['server_args'])}`; {results['workers']} client threads; samples every "
        f"{results['sample_every']} requests.",
        "",
        "Memory outside KV = the server's RssAnon minus GetModelInfo.kv_cache_bytes, after a warm-up that writes "
        "every KV block (the warm-up rounds' RssAnon are in results.json). Slope: least squares over the samples "
        "after the first 1,000 requests.",
        "",
        "| variant | round | requests | minutes | outside KV after warm-up (MB) | slope (MB / 1,000 req) "
        "| end (MB) | max (MB) | RssFile end (MB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in results["summary"]:
        slope = "n/a" if s["slope_mb_per_1000"] is None else f"{s['slope_mb_per_1000']:+.2f}"
        lines.append(
            f"| {s['variant']} | {s['round']} | {s['requests']} | {s['seconds'] / 60:.1f} | "
            f"{s['outside_kv_start_mb']:.1f} | {slope} | {s['outside_kv_end_mb']:.1f} | {s['outside_kv_max_mb']:.1f} | "
            f"{s['rss_file_end_mb']:.1f} |"
        )
    lines += ["", "Variants (server environment):", ""]
    for name, env in results["variants"].items():
        lines.append(f"- `{name}`: {env or 'nothing extra'}")
    lines += ["", "Status codes per run:", ""]
    for run in results["runs"]:
        lines.append(f"- {run['variant']} round {run['round']}: {json.dumps(run['codes'], sort_keys=True)}")
        if run["errors"]:
            lines.append(f"  unexpected errors (first few): {run['errors']}")
    (out / "REPORT.md").write_text("\n".join(lines) + "\n")


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    name, _, rest = spec.partition(":")
    env = dict(item.split("=", 1) for item in rest.split(",") if item)
    return name, env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory_soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.environ.get("MODEL", "models/smollm2-135m-int8"))
    p.add_argument(
        "--requests",
        type=int,
        default=2000,
        help="requests per run (aim: 5-10 min on a quiet 2-core box; 1.6 req/s seen beside another heavy job)",
    )
    p.add_argument("--out", default="bench/results-memory")
    p.add_argument("--workers", type=int, default=6, help="client threads")
    p.add_argument("--sample-every", type=int, default=500)
    p.add_argument("--kv-cache-gb", type=float, default=0.25, help="small, so that warm-up touches all of it")
    p.add_argument("--variant", action="append", default=[], help="NAME[:ENV=VALUE,...] (repeatable)")
    p.add_argument("--rounds", type=int, default=1, help="alternate the variants this many times")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("server_args", nargs="*", help="further server flags, after --")
    args = p.parse_args(argv)
    variants = dict(parse_variant(v) for v in args.variant or ["base"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server_args = ["--kv-cache-gb", str(args.kv_cache_gb), *args.server_args]
    results: dict = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "host": f"{platform.node()}, {os.cpu_count()} CPUs",
        "model": args.model,
        "server_args": server_args,
        "workers": args.workers,
        "sample_every": args.sample_every,
        "variants": variants,
        "runs": [],
        "summary": [],
    }
    for rnd in range(1, args.rounds + 1):
        for name, env in variants.items():
            print(f"[{time.strftime('%H:%M:%S')}] {name} round {rnd}: starting the server", file=sys.stderr, flush=True)
            server = start_server(args.model, server_args, env, out / f"server-{name}-{rnd}.log")
            try:
                warm = warm_up(server, args.seed + rnd)
                print(
                    f"  warm-up RssAnon by round (MB): {[round(x / MB, 1) for x in warm['warmup_rss_anon_by_round']]}, "
                    f"KV {warm['kv_cache_bytes'] / MB:.1f} MB",
                    file=sys.stderr,
                    flush=True,
                )
                mix = Soak(server, min(300, args.requests), args.workers, 10**9, args.seed + 100 + rnd)
                mix.run()  # one-time costs (first shapes, first chats) before the first sample
                soak = Soak(server, args.requests, args.workers, args.sample_every, args.seed + rnd)
                soak.run()
            finally:
                server.stop()
            run = {
                "variant": name,
                "round": rnd,
                "env": env,
                "warmup": warm,
                "samples": soak.samples,
                "kinds": soak.counts.by_kind,
                "codes": soak.counts.by_code,
                "errors": soak.errors,
            }
            results["runs"].append(run)
            summary = summarize(run)
            results["summary"].append(summary)
            print(f"  {json.dumps(summary)}", file=sys.stderr, flush=True)
            (out / "results.json").write_text(json.dumps(results, indent=1))
            write_report(out, results)
    print((out / "REPORT.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
