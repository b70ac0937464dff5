"""An asyncio gRPC load generator for the service: closed-loop concurrency and open-loop Poisson arrivals.

It reads the generated code in service/api and finds the streaming generate call and its request fields
from the message descriptors, so it keeps working while field names settle. Each request records when it
was sent, when each streamed chunk arrived and how many tokens it carried; metrics are computed from
those timestamps (time to first token, inter-token latency, end-to-end latency, errors by status code).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import pkgutil
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from bench.loopback import free_port
from service.core.config import EngineConfig

ROOT = Path(__file__).resolve().parent.parent


class Unsupported(RuntimeError):
    """The server package or its generated code is not there (yet): skip the gRPC benchmarks."""


@dataclass
class Api:
    pb2: object
    stub_cls: type
    method: str  # the server-streaming generate method on the stub
    request_cls: type
    set_prompt_ids: Callable[[Any, list[int]], None]  # (request, ids)
    set_params: Callable[[Any, int], None]  # (request, max_new_tokens)


def load_api() -> Api:
    try:
        import grpc  # noqa: F401

        api_pkg = importlib.import_module("service.api")
    except Exception as exc:
        raise Unsupported(f"service.api is not importable: {exc}") from exc
    grpc_mods = []
    for info in pkgutil.walk_packages(api_pkg.__path__, "service.api."):
        if info.name.endswith("_pb2_grpc"):
            grpc_mods.append(info.name)
    if not grpc_mods:
        raise Unsupported("no generated *_pb2_grpc module under service/api (run `make proto`)")
    for name in grpc_mods:
        gmod = importlib.import_module(name)
        pb2 = importlib.import_module(name[: -len("_grpc")])
        for sdesc in pb2.DESCRIPTOR.services_by_name.values():
            stub_cls = getattr(gmod, f"{sdesc.name}Stub", None)
            if stub_cls is None:
                continue
            for m in sdesc.methods:
                if m.server_streaming and not m.client_streaming and "generate" in m.name.lower():
                    req_cls = _message_class(pb2, m.input_type)
                    set_ids, set_params = _request_setters(m.input_type)
                    return Api(pb2, stub_cls, m.name, req_cls, set_ids, set_params)
    raise Unsupported("no server-streaming Generate* method found in the generated code")


def _message_class(pb2, desc):
    cls = getattr(pb2, desc.name, None)
    if cls is not None:
        return cls
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(desc)


def _find_field(desc, names):
    for n in names:
        if n in desc.fields_by_name:
            return desc.fields_by_name[n]
    return None


def _request_setters(desc):
    """Setters for the prompt token ids and the sampling budget, wherever the proto put them."""
    ids_names = ("prompt_token_ids", "token_ids", "input_ids", "ids")
    path_ids = _search(desc, ids_names, depth=2)
    if path_ids is None:
        raise Unsupported(f"{desc.full_name} has no token-id prompt field ({', '.join(ids_names)})")
    path_max = _search(desc, ("max_new_tokens", "max_tokens"), depth=3)
    path_eos = _search(desc, ("ignore_eos",), depth=3)

    def set_ids(req, ids):
        target = _descend(req, path_ids[:-1])
        getattr(target, path_ids[-1]).extend(ids)

    def set_params(req, max_new):
        if path_max:
            setattr(_descend(req, path_max[:-1]), path_max[-1], max_new)
        if path_eos:
            setattr(_descend(req, path_eos[:-1]), path_eos[-1], True)

    return set_ids, set_params


def _search(desc, names, depth, prefix=()):
    f = _find_field(desc, names)
    if f is not None:
        return (*prefix, f.name)
    if depth <= 1:
        return None
    for f in desc.fields:
        if f.message_type is not None and not _repeated(f):
            if f.containing_oneof is not None and f.message_type.name.lower().startswith("chat"):
                continue
            hit = _search(f.message_type, names, depth - 1, (*prefix, f.name))
            if hit:
                return hit
    return None


def _repeated(f) -> bool:
    flag = getattr(f, "is_repeated", None)
    return bool(flag) if flag is not None else f.label == 3  # LABEL_REPEATED in older protobuf


def _descend(msg, path):
    for name in path:
        msg = getattr(msg, name)
    return msg


def _token_ids(resp) -> list[int]:
    """Token ids carried by one streamed response: the first token_ids list found."""
    stack = [resp]
    while stack:
        m = stack.pop()
        for f, v in m.ListFields():
            if f.name in ("token_ids", "output_token_ids") and _repeated(f):
                return list(v)
            if f.message_type is not None and not _repeated(f):
                stack.append(v)
    return []


def _cached_tokens(resp) -> int | None:
    """usage.cached_prompt_tokens of the final response, when the API has it."""
    for f, v in resp.ListFields():
        if f.name == "usage" and "cached_prompt_tokens" in f.message_type.fields_by_name:
            return int(v.cached_prompt_tokens)
    return None


# -- the server process ----------------------------------------------------------------------------
def server_flags(config: EngineConfig) -> list[str]:
    """`python -m service` flags giving the server exactly this engine config (the in-process peer's):
    each EngineConfig field is a flag of the same name (service/config.py); None leaves the server's default."""
    flags = []
    for f in fields(config):
        value = getattr(config, f.name)
        flag = f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            flags.append(f"--{flag}={value}")
    return [*flags, f"--metrics-port={free_port()}", f"--http-port={free_port()}"]  # as in production


@contextlib.contextmanager
def server(model: str, port: int, extra: list[str] | None = None, log_path: Path | None = None, timeout: float = 180.0):
    try:
        importlib.import_module("service.process")
    except Exception as exc:
        raise Unsupported(f"service.process is not importable: {exc}") from exc
    log = open(log_path, "w") if log_path else None  # noqa: SIM115
    cmd = [
        sys.executable,
        "-m",
        "service",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *(extra or []),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        _wait_ready(proc, port, timeout)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log:
            log.close()


def _wait_ready(proc, port: int, timeout: float) -> None:
    import grpc

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                grpc.channel_ready_future(ch).result(timeout=1)
            if _health_serving(port):
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become ready in time")


def _health_serving(port: int) -> bool:
    try:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError:
        return True
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError as exc:
        return exc.code() == grpc.StatusCode.UNIMPLEMENTED  # no health service: the channel being up is enough


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- load ------------------------------------------------------------------------------------------
@dataclass
class Sample:
    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, tokens)
    status: str = "OK"
    prompt_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    cached_tokens: int | None = None

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float | None:
        return next((t - self.sent for t, n in self.chunks if n), None)

    @property
    def e2e(self) -> float | None:
        return self.chunks[-1][0] - self.sent if self.chunks else None

    def itls(self) -> list[float]:
        """Per-token gaps: a chunk of n tokens after a gap g counts as n gaps of g / n."""
        chunks = [(t, n) for t, n in self.chunks if n]
        out: list[float] = []
        for (t_prev, _), (t, n) in zip(chunks, chunks[1:], strict=False):
            out.extend([(t - t_prev) / n] * n)
        return out


class Client:
    def __init__(self, api: Api, port: int) -> None:
        import grpc

        self.api = api
        self.channel = grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20)]
        )
        self.stub = api.stub_cls(self.channel)
        self.call = getattr(self.stub, api.method)

    async def close(self) -> None:
        await self.channel.close()

    async def one(self, ids: list[int], max_new: int) -> Sample:
        import grpc

        req = self.api.request_cls()
        self.api.set_prompt_ids(req, ids)
        self.api.set_params(req, max_new)
        s = Sample(time.perf_counter(), prompt_tokens=len(ids))
        last = None
        try:
            async for last in self.call(req):
                now, new_ids = time.perf_counter(), _token_ids(last)
                s.chunks.append((now, len(new_ids)))
                s.token_ids.extend(new_ids)
        except grpc.aio.AioRpcError as exc:
            s.status = exc.code().name
        cached = _cached_tokens(last) if last is not None else None  # usage rides on the final message
        if cached is not None:
            s.cached_tokens = cached
        return s


async def burst(client: Client, prompts: list[list[int]], concurrency: int, max_new: int) -> dict:
    """All requests at once (same shape as the in-process throughput runs)."""
    batch = [prompts[i % len(prompts)] for i in range(concurrency)]
    t0 = time.perf_counter()
    samples = await asyncio.gather(*(client.one(p, max_new) for p in batch))
    return summarize(samples, time.perf_counter() - t0) | {"concurrency": concurrency}


async def closed_loop(
    client: Client, prompts: list[list[int]], concurrency: int, max_new: int, requests_per_worker: int, seed: int = 0
) -> dict:
    rng = random.Random(seed)
    samples: list[Sample] = []

    async def worker() -> None:
        for _ in range(requests_per_worker):
            samples.append(await client.one(rng.choice(prompts), max_new))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return summarize(samples, time.perf_counter() - t0) | {"concurrency": concurrency}


async def poisson(
    client: Client, prompts: list[list[int]], rate: float, duration: float, max_new: int, seed: int = 0
) -> dict:
    rng = random.Random(seed)
    tasks = []
    t0 = time.perf_counter()
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t > duration:
            break
        await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
        tasks.append(asyncio.create_task(client.one(rng.choice(prompts), max_new)))
    samples = await asyncio.gather(*tasks)
    return summarize(list(samples), time.perf_counter() - t0) | {"rate": rate}


async def multiturn(client: Client, conversations: list[dict], turns: int, reply_tokens: int) -> dict:
    """Conversations side by side, each turn sent when the last one's reply is in: turn k's prompt is turn
    k-1's prompt, its reply and a new user message, so a server with prefix caching reuses the history."""
    by_turn: dict[int, list[Sample]] = {}

    async def conversation(conv: dict) -> None:
        prompt = conv["turn1"]
        for k in range(1, turns + 1):
            s = await client.one(prompt, reply_tokens)
            by_turn.setdefault(k, []).append(s)
            if s.status != "OK":
                return
            prompt = prompt + s.token_ids + conv["turn2_suffix"]

    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(c) for c in conversations))
    wall = time.perf_counter() - t0
    out = []
    for k, samples in sorted(by_turn.items()):
        ok = [s for s in samples if s.status == "OK"]
        cached = [s.cached_tokens for s in ok if s.cached_tokens is not None]
        out.append(
            summarize(samples, wall)
            | {
                "turn": k,
                "prompt_tokens_mean": sum(s.prompt_tokens for s in ok) / max(len(ok), 1),
                "cached_tokens_mean": sum(cached) / len(cached) if cached else None,
            }
        )
    return {"conversations": len(conversations), "reply_tokens": reply_tokens, "turns": out}


def pct(values: list[float], q: float) -> float | None:
    """The q-quantile of values, interpolated linearly; None for none."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(samples: list[Sample], wall: float) -> dict:
    ok = [s for s in samples if s.status == "OK"]
    errors: dict[str, int] = {}
    for s in samples:
        if s.status != "OK":
            errors[s.status] = errors.get(s.status, 0) + 1
    ttft = [s.ttft for s in ok if s.ttft is not None]
    itl = [x for s in ok for x in s.itls()]
    e2e = [s.e2e for s in ok if s.e2e is not None]
    tokens = sum(s.tokens for s in ok)
    return {
        "requests": len(samples),
        "errors": errors,
        "wall_s": wall,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "requests_per_s": len(ok) / wall if wall else 0.0,
        "ttft_s": {"p50": pct(ttft, 0.5), "p95": pct(ttft, 0.95), "p99": pct(ttft, 0.99)},
        "itl_s": {"p50": pct(itl, 0.5), "p99": pct(itl, 0.99)},
        "e2e_s": {"p50": pct(e2e, 0.5), "p95": pct(e2e, 0.95)},
    }
