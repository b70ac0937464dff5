"""python -m bench.revisions MODEL --server NAME=REV[:FLAGS] ...: the same gRPC work on servers of git revisions.

An in-process A/B needs both variants in one codebase; when a change removes a mode (the `auto` precision and
its bf16 copy) or rewrites the engine, the old variant exists only in history. Each --server is a revision
(`.` for this checkout as it is) and server flags beside its defaults; a past revision is extracted with
`git archive` into a temporary folder and served from there by this checkout's Python environment (the same
packages). The servers stay up side by side; only one is given work at a time, and each round reverses the
order, so all see the same background load. Ratios are against the first server.

- reproducibility (once): greedy replies (64 new tokens) to the edit set's prompts, each alone with a salt of
  its own (cold), then again (prefix cached), then all at once beside 8 busy streams; the share identical to
  cold per condition.
- time to the first token of a --prompt-tokens prompt alone, a salt of its own per run (nothing cached).
- throughput at each --streams count: every stream sends 2 requests one after the other (the writing set's
  prompts, --max-new-tokens with ignore_eos, a salt per request): generated tokens over wall time.
- resident memory of each server: VmRSS after start and after the work, VmHWM (its peak).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import shlex
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

from bench import run, sysinfo
from bench.memory_soak import read_memory
from bench.replicas import ROOT, Replica
from bench.speculative import WORKLOADS
from service.client import build_request


def extract(rev: str, into: Path) -> Path:
    """The tree of `rev` (its committed files, generated gRPC code included) in a folder under `into`."""
    folder = into / rev
    if folder.exists():
        return folder
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as t:
        t.extractall(folder, filter="data")
    return folder


def server_spec(spec: str) -> tuple[str, str, str]:
    """NAME=REV[:FLAGS] as (name, revision, flags)."""
    name, _, rest = spec.partition("=")
    rev, _, flags = rest.partition(":")
    if not name or not rev:
        raise ValueError(f"--server {spec!r}: expected NAME=REV[:FLAGS]")
    return name, rev, flags


def memory(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process, in GB."""
    found = read_memory(pid)
    return {k: round(found[k] / 1e9, 2) for k in ("VmRSS", "VmHWM")}


class Server:
    def __init__(self, name: str, replica: Replica) -> None:
        import grpc

        from service.api.ovserve.v1 import ovserve_pb2_grpc

        self.name, self.replica = name, replica
        self.channel = grpc.aio.insecure_channel(replica.target)
        self.stub = ovserve_pb2_grpc.GenerationStub(self.channel)

    async def reply(self, ids: list[int], max_new: int, salt: str, ignore_eos: bool = False) -> tuple[float, list[int]]:
        """(seconds to the first token, the reply's tokens) of one greedy streamed request."""
        req = build_request(
            prompt_token_ids=ids, max_new_tokens=max_new, temperature=0.0, cache_salt=salt, ignore_eos=ignore_eos
        )
        t0, first, tokens = time.perf_counter(), None, []
        async for chunk in self.stub.GenerateStream(req):
            if chunk.token_ids and first is None:
                first = time.perf_counter() - t0
            tokens += chunk.token_ids
        return first or 0.0, tokens


async def reproducibility(s: Server, prompts: list[list[int]], crowd: list[list[int]]) -> dict[str, str]:
    cold = [(await s.reply(p, 64, f"cold{i}"))[1] for i, p in enumerate(prompts)]
    shared = [(await s.reply(p, 64, "shared"))[1] for p in prompts]
    cached = [(await s.reply(p, 64, "shared"))[1] for p in prompts]
    busy = [asyncio.create_task(s.reply(p, 64, "crowd", ignore_eos=True)) for p in crowd]
    beside = [r[1] for r in await asyncio.gather(*(s.reply(p, 64, "shared") for p in prompts))]
    await asyncio.gather(*busy)
    got = {"first shared": shared, "cached": cached, "beside 8": beside}
    return {k: f"{sum(a == b for a, b in zip(v, cold, strict=True))}/{len(cold)}" for k, v in got.items()}


async def throughput(s: Server, prompts: list[list[int]], streams: int, max_new: int, tag: str) -> float:
    async def stream(i: int) -> int:
        done = 0
        for j in range(2):
            done += len((await s.reply(prompts[(2 * i + j) % len(prompts)], max_new, f"{tag}-{i}-{j}", True))[1])
        return done

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(stream(i) for i in range(streams))))
    return tokens / (time.perf_counter() - t0)


async def measure(replicas: dict[str, Replica], a: argparse.Namespace) -> dict[str, Any]:
    servers = [Server(name, r) for name, r in replicas.items()]  # gRPC's aio channels belong to this loop
    edits, _ = run.tokenize(Path(a.model), run.load_prompts(WORKLOADS["edit"]))
    writing, _ = run.tokenize(Path(a.model), run.load_prompts(WORKLOADS["writing"]))
    long = [t for prompt in sorted(edits, key=len) * 10 for t in prompt][: a.prompt_tokens]
    streams = [int(n) for n in a.streams.split(",") if n]
    out: dict[str, Any] = {s.name: {"memory_after_start": memory(s.replica.proc.pid)} for s in servers}
    for s in servers:
        await s.reply(edits[0], 4, "warm")
        if a.reproducibility:
            out[s.name]["identical_to_cold"] = await reproducibility(s, edits[:8], writing[:8])
            print(f"{s.name}: identical to cold {out[s.name]['identical_to_cold']}", flush=True)
    ttft: dict[str, list[float]] = {s.name: [] for s in servers}
    rates: dict[str, dict[int, list[float]]] = {s.name: {n: [] for n in streams} for s in servers}
    for r in range(a.rounds):
        for s in servers[:: 1 if r % 2 else -1]:
            if a.prompt_tokens:
                ttft[s.name].append(round((await s.reply(long, 1, f"ttft{r}"))[0], 3))
            for n in streams:
                rates[s.name][n].append(round(await throughput(s, writing, n, a.max_new_tokens, f"r{r}n{n}"), 1))
            print(f"round {r} {s.name}: first token {ttft[s.name][-1:]} s, tokens/s {rates[s.name]}", flush=True)
    first = servers[0].name
    for s in servers:
        out[s.name] |= {"first_token_s": ttft[s.name], "tokens_per_s": rates[s.name]}
        out[s.name]["memory_at_end"] = memory(s.replica.proc.pid)
        if s.name != first:  # medians of the first server over this one's: above 1, the first is faster / slower
            ratios = {
                f"tokens/s, {n} streams": round(median(rates[first][n]) / median(rates[s.name][n]), 3) for n in streams
            }
            if a.prompt_tokens:
                ratios["first token, seconds"] = round(median(ttft[first]) / median(ttft[s.name]), 3)
            out[f"{first} over {s.name}"] = ratios
    for s in servers:
        await s.channel.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.revisions", description=__doc__)
    p.add_argument("model")
    p.add_argument(
        "--server",
        action="append",
        required=True,
        metavar="NAME=REV[:FLAGS]",
        help="a server: a name, a git revision (. for this checkout) and server flags (repeat; 2 or more)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", default="1,8,32", help="comma-separated stream counts for throughput")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=2000, help="the long prompt's length (0: no first-token runs)")
    p.add_argument("--no-reproducibility", dest="reproducibility", action="store_false")
    p.add_argument("--out", help="write the result as JSON here")
    a = p.parse_args(argv)
    try:
        systems = [server_spec(spec) for spec in a.server]
    except ValueError as e:
        p.error(str(e))
    result: dict[str, Any] = {"model": a.model, "servers": {name: f"{rev} {flags}" for name, rev, flags in systems}}
    with tempfile.TemporaryDirectory(prefix="ovserve-revisions-") as tmp:
        replicas: dict[str, Replica] = {}
        try:
            for name, rev, flags in systems:
                cwd = ROOT if rev == "." else extract(rev, Path(tmp))
                log = Path(tmp) / f"{name}.log"
                model = Path(a.model).resolve()
                replicas[name] = Replica(model, log, a.threads, a.kv_cache_gb, *shlex.split(flags), cwd=cwd)
                replicas[name].wait_serving(timeout=900)
            result |= {"machine": sysinfo.machine()} | asyncio.run(measure(replicas, a))
        finally:
            for r in replicas.values():
                r.stop()
    run.report(result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
