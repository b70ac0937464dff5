"""python -m bench.tenants MODEL: does one tenant's flood delay another tenant's request?

A server (`python -m service`) with a keys file of two tenants, `flood` and `light`. In each mode (fair
admission, the default, then `--no-fair-admission`: one queue in arrival order) the light tenant first sends
one streamed request a second to the idle server (its idle time to first token), then the flood tenant sends
--flood requests at once while the light tenant goes on sending one a second until the flood is served. The two
tenants are two clients: the flood's streams are read by a process of their own (as another tenant's would be),
so the light tenant's times are not those of one event loop parsing 200 streams. The light tenant is a writing
assistant's user: a short chat turn on /v1/chat/completions, whose first token is text. (A bare completion
prompt was used before 2026-12-08; SmolLM2's first token for it is an end-of-turn token that shows no text, so
the time to its first text was the time to its second token, one more step of the flood's.) The flood is a batch
job's plain completions. Reported: the light tenant's time to first token during the flood against its idle
time in the same run (median and worst), and how long the flood took. Every prompt is distinct (the light
tenant's share the chat template's first 26 tokens, less than a 32-token block: no prefix-cache hits); replies
are greedy with ignore_eos, so every request computes the same number of tokens in both modes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from statistics import median

import httpx

from bench import sysinfo
from bench.loopback import free_port

KEYS = {"flood": "flood-key-0123456789abcdef", "light": "light-key-0123456789abcdef"}
MODES = {"fair": [], "fifo": ["--no-fair-admission"]}


class Server:
    """`python -m service` with the two tenants' keys, in one mode."""

    def __init__(self, model: str, mode: str, folder: Path) -> None:
        keys = folder / "keys"
        keys.write_text("".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
        self.port, self.metrics_port = free_port(), free_port()
        args = [sys.executable, "-m", "service", "--model", model, "--port", "0"]
        args += ["--metrics-port", str(self.metrics_port)]
        args += ["--http-port", str(self.port), "--api-keys-file", str(keys), "--drain-delay-seconds", "0"]
        self.log = open(folder / f"server-{mode}.log", "w")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(args + MODES[mode], stdout=self.log, stderr=subprocess.STDOUT)

    async def ready(self, client, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}; see {self.log.name}")
            try:
                if (await client.get(f"http://127.0.0.1:{self.port}/ready")).status_code == 200:
                    return
            except httpx.TransportError:  # not listening yet
                pass
            await asyncio.sleep(0.5)
        raise TimeoutError("the server did not become ready")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)
        self.log.close()


async def first_token(client, port: int, tenant: str, prompt: str, max_tokens: int) -> float | None:
    """Seconds from sending a streamed request to its first text; None when it was refused. The light tenant
    asks in a chat turn, the flood in plain completions."""
    body: dict = {"max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    if tenant == "light":
        body["messages"], path = [{"role": "user", "content": prompt}], "chat/completions"
    else:
        body["prompt"], path = prompt, "completions"
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    started, first = time.perf_counter(), None
    async with client.stream("POST", f"http://127.0.0.1:{port}/v1/{path}", json=body, headers=headers) as response:
        if response.status_code != 200:
            return None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {") and text_of(json.loads(line[6:])):
                first = time.perf_counter() - started
    return first


def text_of(chunk: dict) -> str:
    """The text a streamed chunk carries: a completion's text, or a chat delta's content."""
    choices = chunk.get("choices") or [{}]
    return choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""


SERVER_SIDE = {"ttft": "ovserve_time_to_first_token_seconds", "queue": "ovserve_queue_time_seconds"}


async def server_side(client, metrics_port: int) -> dict[str, tuple[float, float]]:
    """The light tenant's histograms so far, (sum, count) each: time to first token as the server measures it
    (from the call's start in the front to its first output) and time queued before the first step."""
    text = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
    samples = {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln.startswith("ovserve_"))}
    light = '{tenant="light"}'
    return {
        name: (samples.get(f"{metric}_sum{light}", 0.0), samples.get(f"{metric}_count{light}", 0.0))
        for name, metric in SERVER_SIDE.items()
    }


def means(before: dict, after: dict) -> dict[str, float | None]:
    """Each histogram's mean over the requests observed between two scrapes."""
    out: dict[str, float | None] = {}
    for name in SERVER_SIDE:
        count = after[name][1] - before[name][1]
        out[name] = (after[name][0] - before[name][0]) / count if count else None
    return out


async def light_requests(client, port: int, count: int, max_tokens: int, tag: str, until=None) -> list[float]:
    """One light request a second (count of them, or until `until` is done); their times to first token."""
    tasks = []
    for i in range(count):
        if until is not None and until.done():
            break
        prompt = f"[{tag} {i}] Write one sentence about the sea."
        tasks.append(asyncio.create_task(first_token(client, port, "light", prompt, max_tokens)))
        await asyncio.sleep(1.0)
    return [t for t in await asyncio.gather(*tasks) if t is not None]


LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=None)


async def flood_requests(port: int, prompts: list[str], max_tokens: int) -> list[float]:
    async with httpx.AsyncClient(limits=LIMITS, timeout=900) as client:
        ttfts = await asyncio.gather(*(first_token(client, port, "flood", p, max_tokens) for p in prompts))
    return [t for t in ttfts if t is not None]


def flood_client(port: int, prompts: list[str], max_tokens: int) -> list[float]:
    """The flood tenant's client, run in a process of its own."""
    return asyncio.run(flood_requests(port, prompts, max_tokens))


async def run_mode(model: str, mode: str, args: argparse.Namespace, folder: Path) -> dict:
    server = Server(model, mode, folder)
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        pool.submit(int).result()  # the flood's process is started (and has imported) before anything is timed
        async with httpx.AsyncClient(limits=LIMITS, timeout=900) as client:
            await server.ready(client)
            await light_requests(client, server.port, 2, args.light_max_tokens, f"{mode} warm-up")
            scraped = [await server_side(client, server.metrics_port)]
            idle = await light_requests(client, server.port, args.light_requests, args.light_max_tokens, f"{mode} idle")
            scraped.append(await server_side(client, server.metrics_port))
            started = time.perf_counter()
            prompts = [f"[{mode} flood {i}] Tell a long story about a lighthouse keeper." for i in range(args.flood)]
            flood = asyncio.get_running_loop().run_in_executor(
                pool, flood_client, server.port, prompts, args.flood_max_tokens
            )
            await asyncio.sleep(0.5)  # the flood is queued first
            loaded = await light_requests(
                client, server.port, 10_000, args.light_max_tokens, f"{mode} loaded", until=flood
            )
            flood_ttft = await flood
            flood_seconds = time.perf_counter() - started
            scraped.append(await server_side(client, server.metrics_port))
    finally:
        pool.shutdown()
        server.stop()
    return {
        "mode": mode,
        "idle_ttft": idle,
        "loaded_ttft": loaded,
        "idle_median": median(idle),
        "loaded_median": median(loaded) if loaded else None,
        "loaded_worst": max(loaded) if loaded else None,
        "ratio_median": median(loaded) / median(idle) if loaded else None,
        "ratio_worst": max(loaded) / median(idle) if loaded else None,
        "flood_served": len(flood_ttft),
        "flood_seconds": flood_seconds,
        "flood_median_ttft": median(flood_ttft) if flood_ttft else None,
        # the light tenant's means as the server measured them: idle, then during the flood
        "server_idle": means(scraped[0], scraped[1]),
        "server_loaded": means(scraped[1], scraped[2]),
    }


def report(results: list[dict]) -> str:
    lines = [
        "| mode | light TTFT idle (median) | during the flood (median / worst) | ratio (median / worst) | flood | "
        "server-side means, idle / flood: first token; queued |",
        "|---|---|---|---|---|---|",
    ]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    for r in results:
        idle, loaded = r.get("server_idle") or {}, r.get("server_loaded") or {}
        server = (
            f"{ms(idle.get('ttft'))} / {ms(loaded.get('ttft'))} ms; {ms(idle.get('queue'))} / "
            f"{ms(loaded.get('queue'))} ms"
        )
        if r["loaded_median"] is None:
            lines.append(
                f"| {r['mode']} | {r['idle_median'] * 1000:.0f} ms | no light request during the flood | | | {server} |"
            )
            continue
        lines.append(
            f"| {r['mode']} | {r['idle_median'] * 1000:.0f} ms | {r['loaded_median'] * 1000:.0f} / "
            f"{r['loaded_worst'] * 1000:.0f} ms ({len(r['loaded_ttft'])} requests) | {r['ratio_median']:.2f}x / "
            f"{r['ratio_worst']:.2f}x | {r['flood_served']} served in {r['flood_seconds']:.1f} s | {server} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tenants", description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--flood", type=int, default=200, help="requests the flood tenant sends at once")
    p.add_argument("--flood-max-tokens", type=int, default=64)
    p.add_argument("--light-requests", type=int, default=10, help="idle-server requests of the light tenant")
    p.add_argument("--light-max-tokens", type=int, default=16)
    p.add_argument("--modes", default="fair,fifo", help="comma-separated: fair, fifo")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            results.append(asyncio.run(run_mode(args.model, mode, args, Path(tmp))))
            print(report(results[-1:]).splitlines()[-1], flush=True)
    print(report(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if k != "out"}
        machine = {"machine": sysinfo.machine(), "versions": sysinfo.versions(), "loadavg": os.getloadavg()}
        args.out.write_text(json.dumps({"settings": settings, **machine, "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
