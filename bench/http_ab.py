"""python -m bench.http_ab MODEL: what the HTTP front costs, against gRPC and against the engine in-process.

The method of bench.grpc_ab, with one more side: this process holds an in-process engine, `python -m
service` (same budget, prefix caching off so every prompt is computed) serves both fronts on one engine, and a
load-generator subprocess sends the same bursts of streamed requests (the same prompt token ids, ignore_eos,
the same number of new tokens) over gRPC and over HTTP (/v1/completions with SSE). Each round runs one burst
of each kind, the order rotated; ratios are per round, then the median.

The load generator runs at normal priority by default, unlike bench.grpc_ab's: at SCHED_IDLE it only runs
when the inference threads leave a core free, and on a machine loaded by other work the Python HTTP client
(httpx, one SSE line parsed per token) then reads late and the figure measures the client, not the server.
At normal priority the client's CPU (recorded per token, with the server's) competes with inference for
both protocols alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

from bench import grpc_ab, grpc_load, loopback, run, workers


class HttpClient:
    """The HTTP side of the load generator, with grpc_load.Client's interface."""

    def __init__(self, port: int) -> None:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=600)

    async def close(self) -> None:
        await self.http.aclose()

    async def one(self, ids: list[int], max_new: int) -> grpc_load.Sample:
        # greedy, as the gRPC side and the in-process engine run (OpenAI's default would sample at temperature 1)
        body = {"prompt": ids, "max_tokens": max_new, "ignore_eos": True, "stream": True, "temperature": 0}
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


def measure(model: Path, concurrency: list[int], repeats: int, max_new: int, idle_client: bool) -> dict:
    ids, _ = run.tokenize(model, run.load_prompts())
    engine = workers.our_engine({"model": str(model), "budget": workers.budget_dict(workers.BUDGET)}, False)
    grpc_port, http_port = loopback.free_port(), loopback.free_port()
    flags = [*grpc_load.server_flags(engine.config), f"--http-port={http_port}"]  # the last --http-port wins
    log_path = Path(tempfile.gettempdir()) / f"http-ab-server-{grpc_port}.log"
    result: dict = {"model": str(model), "max_new_tokens": max_new, "client_sched_idle": idle_client, "runs": {}}
    try:
        asyncio.run(workers.ours_batch(engine, ids[:2], 8))  # warm-up
        with grpc_load.server(str(model), grpc_port, extra=flags, log_path=log_path) as server:
            client = grpc_ab.LoadClient(
                f"{grpc_port},{http_port}", server.pid, ids, idle_client, module="bench.http_ab"
            )
            try:
                for c in concurrency:
                    rounds = [_round(i, engine, client, ids, c, max_new) for i in range(repeats)]
                    summary = summarize(rounds)
                    result["runs"][str(c)] = {"rounds": rounds, **summary}
                    print(_line(c, summary, repeats), flush=True)
            finally:
                client.close()
    finally:
        engine.shutdown()
    return result


KINDS = ("inproc", "grpc", "http")


def _round(i: int, engine, client: grpc_ab.LoadClient, ids: list[list[int]], c: int, max_new: int) -> dict:
    """One burst of each kind, the order rotated every round so that none always goes first."""
    order = KINDS[i % 3 :] + KINDS[: i % 3]
    out = {}
    for kind in order:
        time.sleep(0.2)  # let the previous run's stragglers settle
        if kind == "inproc":
            out[kind] = grpc_ab.inproc_burst(engine, ids, c, max_new)
        else:
            out[kind] = grpc_ab.served_burst(client, c, max_new, protocol=kind)
    return out


def summarize(rounds: list[dict]) -> dict:
    def ratio(a: str, b: str) -> float:
        return median(r[a]["tokens_per_s"] / r[b]["tokens_per_s"] for r in rounds)

    def ms(kind: str, key: str) -> float:
        return 1000 * median(r[kind][key] for r in rounds)

    return {
        **{f"{k}_tokens_per_s": median(r[k]["tokens_per_s"] for r in rounds) for k in KINDS},
        "http_over_grpc": ratio("http", "grpc"),
        "http_over_inproc": ratio("http", "inproc"),
        "grpc_over_inproc": ratio("grpc", "inproc"),
        "inproc_cpu_ms_per_token": ms("inproc", "cpu_s_per_token"),
        **{f"{k}_server_cpu_ms_per_token": ms(k, "cpu_s_per_token") for k in ("grpc", "http")},
        **{f"{k}_client_cpu_ms_per_token": ms(k, "client_cpu_s_per_token") for k in ("grpc", "http")},
    }


def _line(c: int, s: dict, repeats: int) -> str:
    tps = ", ".join(f"{k} {s[f'{k}_tokens_per_s']:.1f}" for k in KINDS)
    ratios = ", ".join(f"{k} {s[k]:.3f}" for k in ("http_over_grpc", "http_over_inproc", "grpc_over_inproc"))
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in s.items() if k.endswith("_cpu_ms_per_token"))
    return f"c={c}: tok/s {tps}; medians of {repeats} rounds: {ratios}; {cpu}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.http_ab", description=__doc__)
    p.add_argument("model", nargs="?")
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--client-priority", choices=("normal", "idle"), default="normal")
    p.add_argument("--out", help="write the runs as JSON here")
    p.add_argument("--client", help=argparse.SUPPRESS)  # internal: be the load generator on GRPC,HTTP ports
    a = p.parse_args(argv)
    if a.client:
        grpc_port, http_port = (int(x) for x in a.client.split(","))
        return client_main(grpc_port, http_port)
    if not a.model:
        p.error("MODEL is required")
    concurrency = [int(c) for c in a.concurrency.split(",")]
    result = measure(Path(a.model), concurrency, a.repeats, a.max_new_tokens, a.client_priority == "idle")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
