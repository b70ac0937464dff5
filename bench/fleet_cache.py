"""python -m bench.fleet_cache MODEL: a returning conversation on a replica that never saw it, in one run.

Replica A (fleet cache and a disk tier on) computes conversations of --history tokens and publishes their KV
blocks to a Redis store (and writes them to its disk). Then the next turn of each (the history plus a new user
message) goes to:
  - replica B, fleet cache on and its own empty disk: the history is fetched from the store ("remote");
  - replica C, its own empty disk and no fleet cache: the history is computed ("recompute");
  - replica D, started afterwards on A's disk folder (A stopped, its writes flushed), no remote: the history is
    read from local disk ("disk"), the same blocks B fetched, as after a restart of A.
Time to first token of each, the prompt tokens each computed, then the remote fetch's time split (network,
integrity checks, copy into the cache) over one history's blocks, and decode throughput with the fleet cache on
and nothing to fetch (B) against off (C: the same disk tier, so that only the fleet cache differs), on fresh
prompts that every lookup misses, in alternating order. Token ids are random (fixed seed).

The store is a redis-server started in a temporary folder on a free port (Debian's redis-server), or
--redis-url for one of your own (its database is flushed: give it an empty one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
import zlib
from pathlib import Path
from statistics import median

import numpy as np
import redis

from bench import sysinfo, workers
from bench.loopback import RedisServer
from service.core.params import SamplingParams
from service.engine import Engine, GenerationRequest
from service.engine.remote_store import RemoteStore

TURN_TOKENS = 24


def engine(model: str, kv_cache_gb: float, url: str | None = None, disk: str | None = None) -> Engine:
    spec = {"model": model, "budget": workers.budget_dict(workers.BUDGET)}
    settings = {"kv_cache_gb": kv_cache_gb, "kv_remote_url": url, "kv_disk_dir": disk}
    return workers.our_engine(spec, settings=settings)


async def _turn(e: Engine, ids: list[int], max_new: int) -> dict:
    t0 = time.perf_counter()
    ttft, usage = 0.0, None
    tokens: list[int] = []
    async for out in e.generate(GenerationRequest(ids, SamplingParams(max_new_tokens=max_new, ignore_eos=True))):
        if not ttft and out.token_ids:
            ttft = time.perf_counter() - t0
        tokens += out.token_ids
        usage = out.usage or usage
    assert usage is not None
    return {
        "ttft": ttft,
        "computed": usage.prompt_tokens - usage.cached_prompt_tokens,
        "remote": usage.remote_prompt_tokens,
        "disk": usage.disk_prompt_tokens,
        "tokens": tokens,
    }


def turn(e: Engine, ids: list[int], max_new: int = 1) -> dict:
    return asyncio.run(_turn(e, ids, max_new))


def throughput(e: Engine, prompts: list[list[int]], max_new: int) -> float:
    async def all_of():
        return await asyncio.gather(*(_turn(e, p, max_new) for p in prompts))

    t0 = time.perf_counter()
    done = asyncio.run(all_of())
    return sum(len(d["tokens"]) for d in done) / (time.perf_counter() - t0)


def remote_store(e: Engine) -> RemoteStore:
    tiers = e.core.tiers
    assert tiers is not None and tiers.remote is not None, "the replica has no remote tier"
    return tiers.remote.store


def wait_published(e: Engine, num_blocks: int, timeout: float = 120) -> None:
    counters = remote_store(e).counters
    deadline = time.monotonic() + timeout
    while counters.num_published < num_blocks and time.monotonic() < deadline:
        time.sleep(0.05)


def fetch_split(e: Engine, prompt: list[int]) -> dict:
    """One history's blocks fetched by hand through the replica's store: the pipelined round trips alone, the
    integrity checks (header and CRC-32), and the copy into pool-shaped arrays."""
    store, kv = remote_store(e), e.core.kv
    digests = kv.full_block_digests(-1, prompt, "")
    kv.free(-1)
    pipe = store.client.pipeline(transaction=False)
    for d in digests:
        pipe.getrange(store.key(d), 0, store.value_bytes)
    t0 = time.perf_counter()
    values = [v for v in pipe.execute() if v]  # the chain's blocks the store holds
    network = time.perf_counter() - t0
    t0 = time.perf_counter()
    for v in values:
        zlib.crc32(memoryview(v)[-store.payload_bytes :])
    checks = time.perf_counter() - t0
    scratch = np.empty(store.payload_bytes, dtype=np.uint8)
    t0 = time.perf_counter()
    for v in values:
        scratch[:] = np.frombuffer(v, np.uint8, store.payload_bytes, len(v) - store.payload_bytes)
    copy = time.perf_counter() - t0
    num_bytes = sum(len(v) for v in values)
    return {
        "blocks": len(values),
        "bytes": num_bytes,
        "network_s": network,
        "checks_s": checks,
        "copy_s": copy,
        "network_mb_per_s": num_bytes / network / 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet_cache", description=__doc__)
    p.add_argument("model")
    p.add_argument("--kv-cache-gb", type=float, default=0.2)
    p.add_argument("--history", type=int, default=2000, help="tokens of each conversation's history")
    p.add_argument("--rounds", type=int, default=3, help="conversations")
    p.add_argument("--throughput-rounds", type=int, default=6, help="rounds of the on/off throughput pair (0: none)")
    p.add_argument("--redis-url", help="a store of your own (flushed first) instead of a local redis-server")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="fleet-cache-") as work:
        server = None if a.redis_url else RedisServer(Path(work))
        url = server.url if server is not None else a.redis_url
        redis.Redis.from_url(url).flushdb()
        try:
            result = run(a, rng, url, *(str(Path(work) / f"disk-{r}") for r in "abc"))
        finally:
            if server is not None:
                server.stop()
    result["machine"] = sysinfo.machine()
    print(json.dumps({k: v for k, v in result.items() if k not in ("turns", "machine")}, indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


def run(a: argparse.Namespace, rng: random.Random, url: str, disk_a: str, disk_b: str, disk_c: str) -> dict:
    replica_a = engine(a.model, a.kv_cache_gb, url, disk_a)
    b, c = engine(a.model, a.kv_cache_gb, url, disk_b), engine(a.model, a.kv_cache_gb, None, disk_c)
    vocab, bs = replica_a.info.vocab_size, replica_a.info.block_size
    histories = [[rng.randrange(200, vocab) for _ in range(a.history)] for _ in range(a.rounds)]
    nexts = [h + [rng.randrange(200, vocab) for _ in range(TURN_TOKENS)] for h in histories]
    turns: dict[str, list[dict]] = {"remote": [], "recompute": [], "disk": []}
    try:
        for e in (replica_a, b, c):
            turn(e, [rng.randrange(200, vocab) for _ in range(64)])  # warm up
        for h in histories:
            turn(replica_a, h)
        wait_published(replica_a, sum(len(h) // bs for h in histories))
        for prompt in nexts:  # taking turns: both see the same background load
            turns["remote"].append(turn(b, prompt))
            turns["recompute"].append(turn(c, prompt))
        split = fetch_split(b, nexts[0])
        batch = [[rng.randrange(200, vocab) for _ in range(256)] for _ in range(8)]
        rates: dict[str, list[float]] = {"fleet cache on": [], "off": []}
        for i in range(a.throughput_rounds):
            pair = [("fleet cache on", b), ("off", c)]
            for name, e in pair if i % 2 == 0 else pair[::-1]:
                rates[name].append(throughput(e, batch, 64))
            batch = [[rng.randrange(200, vocab) for _ in range(256)] for _ in range(8)]  # nothing to fetch
        remote_stats = vars(b.stats().remote)
    finally:
        replica_a.shutdown()  # flushes its disk writes
        b.shutdown()
        c.shutdown()
    d = engine(a.model, a.kv_cache_gb, None, disk_a)
    try:
        turn(d, [rng.randrange(200, vocab) for _ in range(64)])
        for prompt in nexts:
            turns["disk"].append(turn(d, prompt))
    finally:
        d.shutdown()
    for rows in turns.values():
        for row in rows:
            row.pop("tokens")
    ttft = {k: median(r["ttft"] for r in rows) for k, rows in turns.items()}
    return {
        "model": a.model,
        "history_tokens": a.history,
        "rounds": a.rounds,
        "ttft_median_s": ttft,
        "speedup_over_recompute": {k: ttft["recompute"] / ttft[k] for k in ("remote", "disk")},
        "prompt_tokens_computed": {k: [r["computed"] for r in rows] for k, rows in turns.items()},
        "fetch_split": split,
        "throughput_tokens_per_s": rates,
        # per round, then the median: each round's pair ran back to back
        "throughput_ratio_on_over_off": median(
            on / off for on, off in zip(rates["fleet cache on"], rates["off"], strict=True)
        )
        if a.throughput_rounds
        else None,
        "remote_stats": remote_stats,
        "turns": turns,
    }


if __name__ == "__main__":
    raise SystemExit(main())
