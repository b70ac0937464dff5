"""python -m bench.http_ab MODEL: what the HTTP front costs against gRPC, on one server process.

One `python -m service` serves both fronts on one engine; a load generator in its own low-priority process
(SCHED_IDLE, as in bench.grpc_ab: a remote client's CPU is not the server's) sends the same bursts of
streamed requests (the same prompt token ids, ignore_eos, the same number of new tokens) over gRPC and over
HTTP (/v1/completions with SSE), alternating which goes first. Throughput ratios are per pair, then the
median; the server's CPU seconds per generated token give a second view of each front's cost that the
machine's background load moves less. Prefix caching is off (server_flags), so every prompt is computed.
The gRPC-versus-in-process figure is bench.grpc_ab's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

from bench import grpc_load, run, workers


class HttpClient:
    """The HTTP side of the load generator, with grpc_load.Client's interface."""

    def __init__(self, port: int) -> None:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=600)

    async def close(self) -> None:
        await self.http.aclose()

    async def one(self, ids: list[int], max_new: int) -> grpc_load.Sample:
        body = {"prompt": ids, "max_tokens": max_new, "ignore_eos": True, "stream": True}
        body["stream_options"] = {"include_usage": True}
        s = grpc_load.Sample(time.perf_counter(), prompt_tokens=len(ids))
        async with self.http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                s.status = str(response.status_code)
                return s
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    # SSE chunks carry text, not token counts: the last text chunk takes the remainder
                    done = sum(n for _, n in s.chunks[:-1])
                    if s.chunks:
                        s.chunks[-1] = (s.chunks[-1][0], chunk["usage"]["completion_tokens"] - done)
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    s.chunks.append((time.perf_counter(), 1))
        return s


def client_main(grpc_port: int, http_port: int) -> int:
    """The load-generator side: read the prompts, then answer one burst per command line."""

    async def serve() -> None:
        # grpc_load.burst needs only `one()`, which both clients have
        clients: dict[str, Any] = {
            "grpc": grpc_load.Client(grpc_load.load_api(), grpc_port),
            "http": HttpClient(http_port),
        }
        prompts = json.loads(sys.stdin.readline())["prompts"]
        for client in clients.values():
            await grpc_load.burst(client, prompts[:2], 2, 8)  # warm-up: connections and server shapes
        for line in sys.stdin:
            cmd = json.loads(line)
            r = await grpc_load.burst(clients[cmd["protocol"]], prompts, cmd["concurrency"], cmd["max_new_tokens"])
            print(json.dumps(r), flush=True)
        for client in clients.values():
            await client.close()

    asyncio.run(serve())
    return 0


def measure(model: Path, concurrency: list[int], repeats: int, max_new: int) -> dict:
    ids, _ = run.tokenize(model, run.load_prompts())
    grpc_port, http_port = grpc_load.free_port(), grpc_load.free_port()
    flags = [*grpc_load.server_flags(workers.BUDGET), f"--http-port={http_port}"]  # the last --http-port wins
    log_path = Path(tempfile.gettempdir()) / f"http-ab-server-{grpc_port}.log"
    result: dict = {"model": str(model), "max_new_tokens": max_new, "runs": {}}
    with grpc_load.server(str(model), grpc_port, extra=flags, log_path=log_path) as server:
        load = subprocess.Popen(
            [sys.executable, "-m", "bench.http_ab", "--client", f"{grpc_port},{http_port}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=run.ROOT,
            preexec_fn=lambda: os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)),
        )
        assert load.stdin is not None and load.stdout is not None  # both piped
        commands, answers = load.stdin, load.stdout

        def burst(protocol: str, c: int) -> dict:
            time.sleep(0.2)  # let the previous run's stragglers settle
            cpu = grpc_load.proc_cpu(server.pid)
            commands.write(json.dumps({"protocol": protocol, "concurrency": c, "max_new_tokens": max_new}) + "\n")
            commands.flush()
            r = json.loads(answers.readline())
            if r["errors"]:
                raise RuntimeError(f"{protocol} errors: {r['errors']}")
            return {
                "tokens_per_s": r["tokens_per_s"],
                "server_cpu_s_per_token": (grpc_load.proc_cpu(server.pid) - cpu) / r["output_tokens"],
            }

        try:
            commands.write(json.dumps({"prompts": ids}) + "\n")
            for c in concurrency:
                pairs = []
                for i in range(repeats):
                    order = ("grpc", "http") if i % 2 == 0 else ("http", "grpc")
                    pairs.append({p: burst(p, c) for p in order})
                summary = {
                    "grpc_tokens_per_s": median(p["grpc"]["tokens_per_s"] for p in pairs),
                    "http_tokens_per_s": median(p["http"]["tokens_per_s"] for p in pairs),
                    "http_over_grpc": median(p["http"]["tokens_per_s"] / p["grpc"]["tokens_per_s"] for p in pairs),
                    "grpc_server_cpu_ms_per_token": 1000 * median(p["grpc"]["server_cpu_s_per_token"] for p in pairs),
                    "http_server_cpu_ms_per_token": 1000 * median(p["http"]["server_cpu_s_per_token"] for p in pairs),
                }
                result["runs"][str(c)] = {"pairs": pairs, **summary}
                print(
                    f"c={c}: gRPC {summary['grpc_tokens_per_s']:.1f} tok/s, HTTP {summary['http_tokens_per_s']:.1f} "
                    f"tok/s, HTTP/gRPC {summary['http_over_grpc']:.3f} (median of {repeats} pairs); server CPU per "
                    f"token {summary['grpc_server_cpu_ms_per_token']:.2f} ms gRPC, "
                    f"{summary['http_server_cpu_ms_per_token']:.2f} ms HTTP",
                    flush=True,
                )
        finally:
            commands.close()
            load.wait(timeout=30)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.http_ab", description=__doc__)
    p.add_argument("model", nargs="?")
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", help="write the runs as JSON here")
    p.add_argument("--client", help=argparse.SUPPRESS)  # internal: be the load generator on GRPC,HTTP ports
    a = p.parse_args(argv)
    if a.client:
        grpc_port, http_port = (int(x) for x in a.client.split(","))
        return client_main(grpc_port, http_port)
    if not a.model:
        p.error("MODEL is required")
    result = measure(Path(a.model), [int(c) for c in a.concurrency.split(",")], a.repeats, a.max_new_tokens)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
