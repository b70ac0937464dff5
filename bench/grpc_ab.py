"""python -m bench.grpc_ab MODEL: what the gRPC layer costs, engine in-process vs the same engine behind the server.

Both are loaded side by side and their runs alternate, so they see the same background load: this
process holds an in-process engine; `python -m service` runs in a subprocess with the same budget; a
load-generator subprocess drives the server. On a 2-core box the load generator would otherwise compete
with the inference threads for CPU that a remote client would not take, so it runs under SCHED_IDLE (only
when a core is otherwise idle; `--client-priority normal` counts its CPU as gRPC cost). Ratios are per
pair of runs, then the median.

Throughput on a shared machine moves by 10-20% between identical runs, more than the cost being measured,
so each run also records CPU seconds per generated token: the whole in-process engine against the server
process plus the load generator. The extra CPU per token is what the gRPC layer takes from inference when
the inference threads use every core: a second view of the same cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from bench import grpc_load, loopback, run, workers


class LoadClient:
    """The load generator in its own low-priority process, driven over its stdin and stdout, one JSON line each."""

    def __init__(
        self, port: int | str, server_pid: int, prompts: list[list[int]], idle: bool, module: str = "bench.grpc_ab"
    ) -> None:
        """`python -m MODULE --client PORT` is the load generator: bench.http_ab passes "GRPC,HTTP" ports."""
        self.server_pid = server_pid
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--client", str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=run.ROOT,
            preexec_fn=_idle_priority if idle else None,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both piped
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self._send({"prompts": prompts})

    def burst(self, concurrency: int, max_new: int, **extra: str) -> dict:
        self._send({"concurrency": concurrency, "max_new_tokens": max_new, **extra})
        line = self.stdout.readline()
        if not line:
            raise RuntimeError("the load generator exited")
        return json.loads(line)

    def close(self) -> None:
        self.stdin.close()
        self.proc.wait(timeout=30)

    def _send(self, obj: dict) -> None:
        self.stdin.write(json.dumps(obj) + "\n")
        self.stdin.flush()


def _idle_priority() -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def client_main(port: int) -> int:
    """The load-generator side: read the prompts, then answer one burst per command line."""

    async def serve() -> None:
        client = grpc_load.Client(grpc_load.load_api(), port)
        prompts = json.loads(sys.stdin.readline())["prompts"]
        await grpc_load.burst(client, prompts[:2], 2, 8)  # warm-up: connection and server shapes
        for line in sys.stdin:
            cmd = json.loads(line)
            r = await grpc_load.burst(client, prompts, cmd["concurrency"], cmd["max_new_tokens"])
            print(json.dumps(r), flush=True)
        await client.close()

    asyncio.run(serve())
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grpc_ab", description=__doc__)
    p.add_argument("model", nargs="?")
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--client-priority", choices=("idle", "normal"), default="idle")
    p.add_argument("--out", help="write the runs as JSON here")
    p.add_argument("--client", type=int, help=argparse.SUPPRESS)  # internal: be the load generator on this port
    a = p.parse_args(argv)
    if a.client:
        return client_main(a.client)
    if not a.model:
        p.error("MODEL is required")
    concurrency = [int(c) for c in a.concurrency.split(",")]
    result = measure(Path(a.model), concurrency, a.repeats, a.max_new_tokens, a.client_priority == "idle")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


def measure(model: Path, concurrency: list[int], repeats: int, max_new: int, idle_client: bool) -> dict:
    ids, _ = run.tokenize(model, run.load_prompts())
    engine = workers.our_engine({"model": str(model), "budget": workers.budget_dict(workers.BUDGET)}, False)
    port = loopback.free_port()
    log_path = Path(tempfile.gettempdir()) / f"grpc-ab-server-{port}.log"
    budget = workers.budget_dict(engine.config)  # what both sides run with
    result: dict = {"model": str(model), "budget": budget, "max_new_tokens": max_new, "runs": {}}
    result["client_sched_idle"] = idle_client
    try:
        asyncio.run(workers.ours_batch(engine, ids[:2], 8))  # warm-up
        flags = grpc_load.server_flags(engine.config)  # the in-process engine's config, prefix caching off
        with grpc_load.server(str(model), port, extra=flags, log_path=log_path) as proc:
            client = LoadClient(port, proc.pid, ids, idle_client)
            try:
                for c in concurrency:
                    pairs = []
                    for r in range(repeats):
                        pair = {}
                        for kind in ("inproc", "grpc") if r % 2 == 0 else ("grpc", "inproc"):
                            pair[kind] = _one(kind, engine, client, ids, c, max_new)
                        pairs.append(pair)
                    summary = summarize(pairs)
                    result["runs"][str(c)] = {"pairs": pairs, **summary}
                    print(
                        f"c={c}: in-process {summary['inproc_tokens_per_s']:.1f} tok/s, "
                        f"gRPC {summary['grpc_tokens_per_s']:.1f} tok/s, ratio {summary['throughput_ratio']:.3f}; "
                        f"CPU per token {summary['inproc_cpu_ms_per_token']:.2f} ms in-process, "
                        f"{summary['grpc_cpu_ms_per_token']:.2f} ms server + {summary['client_cpu_ms_per_token']:.2f} "
                        f"ms load generator: gRPC layer {100 * summary['cpu_cost']:+.1f}% CPU",
                        flush=True,
                    )
            finally:
                client.close()
    finally:
        engine.shutdown()
    return result


def summarize(pairs: list[dict]) -> dict:
    def med(kind: str, key: str) -> float:
        return median(p[kind][key] for p in pairs)

    inproc_cpu = med("inproc", "cpu_s_per_token")
    server_cpu, client_cpu = med("grpc", "cpu_s_per_token"), med("grpc", "client_cpu_s_per_token")
    return {
        "inproc_tokens_per_s": med("inproc", "tokens_per_s"),
        "grpc_tokens_per_s": med("grpc", "tokens_per_s"),
        "throughput_ratio": median(p["grpc"]["tokens_per_s"] / p["inproc"]["tokens_per_s"] for p in pairs),
        "inproc_cpu_ms_per_token": 1000 * inproc_cpu,
        "grpc_cpu_ms_per_token": 1000 * server_cpu,
        "client_cpu_ms_per_token": 1000 * client_cpu,
        "cpu_cost": (server_cpu + client_cpu) / inproc_cpu - 1,
        "server_cpu_cost": server_cpu / inproc_cpu - 1,
    }


def _one(kind: str, engine, client: LoadClient, ids: list[list[int]], c: int, max_new: int) -> dict:
    time.sleep(0.2)  # let the previous run's stragglers settle
    if kind == "inproc":
        return inproc_burst(engine, ids, c, max_new)
    return served_burst(client, c, max_new)


def inproc_burst(engine, ids: list[list[int]], c: int, max_new: int) -> dict:
    """One burst on the engine in this process: tokens/s and this process's CPU per generated token."""
    cpu = _own_cpu()
    r = asyncio.run(workers.ours_batch(engine, workers.take(ids, c), max_new))
    n = r["output_tokens"]
    return {"tokens_per_s": n / r["wall_s"], "cpu_s_per_token": (_own_cpu() - cpu) / n}


def served_burst(client: LoadClient, c: int, max_new: int, protocol: str = "grpc") -> dict:
    """One burst through the server: tokens/s, and the server's and load generator's CPU per token."""
    server, load = grpc_load.proc_cpu(client.server_pid), grpc_load.proc_cpu(client.proc.pid)
    r = client.burst(c, max_new, protocol=protocol)
    if r["errors"]:
        raise RuntimeError(f"{protocol} errors: {r['errors']}")
    n = r["output_tokens"]
    return {
        "tokens_per_s": r["tokens_per_s"],
        "cpu_s_per_token": (grpc_load.proc_cpu(client.server_pid) - server) / n,
        "client_cpu_s_per_token": (grpc_load.proc_cpu(client.proc.pid) - load) / n,
    }


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


if __name__ == "__main__":
    raise SystemExit(main())
