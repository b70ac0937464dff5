"""python -m bench.kv_disk MODEL: the prefix cache's disk tier against recomputing and against genai.

Three engines in this process, taking turns so that all see the same background load, with the same
number of KV blocks in RAM: ovserve with the disk tier (in a temporary folder on local disk), ovserve
without it, and openvino-genai's ContinuousBatchingPipeline with its prefix caching (which has no tier
below RAM: once evicted, a history is computed again).

1. Returning conversation: time to first token of a history of 1,000 and 2,000 tokens plus a new user
   turn when the history is (a) in RAM, (b) evicted and, for ovserve with the tier, restored from disk,
   (c) evicted and recomputed (ovserve without the tier; genai).
2. Many users: conversations whose histories together hold --pool-multiple times what the RAM pool
   holds, turns (a new user message, then a short reply) arriving one at a time in random order: mean
   and p95 TTFT of returning turns, and prompt tokens computed.
3. No restore, no loss: decode throughput of a batch of new prompts with the tier on and off (the tier
   still writes every block that fills).

--after-restart (for large models, where evicting a RAM pool by computing prompts takes too long): each
history is computed once by an engine with the tier, which then stops; a new engine finds it on disk and
answers the next turn (restored), and an engine without the tier answers the same turn cold (recomputed).

Token ids are random (fixed seed): the costs measured do not depend on the text.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import tempfile
import time
from pathlib import Path
from statistics import mean, median

from bench import workers
from service.engine import GenerationRequest

REPLY_TOKENS = 16
TURN_TOKENS = 24


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(200, vocab) for _ in range(n)]


class Ours:
    def __init__(self, model: str, kv_cache_gb: float, disk_dir: str | None) -> None:
        self.name = "ovserve+disk" if disk_dir else "ovserve"
        spec = {"model": model, "budget": workers.budget_dict(workers.BUDGET)}
        self.engine = workers.our_engine(spec, settings={"kv_cache_gb": kv_cache_gb, "kv_disk_dir": disk_dir})

    async def _first_token(self, ids: list[int], max_new: int) -> tuple[float, int, list[int]]:
        from service.core.params import SamplingParams

        t0 = time.perf_counter()
        ttft, computed = 0.0, len(ids)
        tokens: list[int] = []
        async for out in self.engine.generate(
            GenerationRequest(ids, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
        ):
            if not ttft and out.token_ids:
                ttft = time.perf_counter() - t0
            tokens += out.token_ids
            if out.usage is not None:
                computed = out.usage.prompt_tokens - out.usage.cached_prompt_tokens
        return ttft, computed, tokens

    def turn(self, ids: list[int], max_new: int = 1) -> tuple[float, int | None, list[int]]:
        """TTFT, prompt tokens computed, and the reply."""
        return asyncio.run(self._first_token(ids, max_new))

    def throughput(self, prompts: list[list[int]], max_new: int) -> float:
        async def all_of():
            return await asyncio.gather(*(self._first_token(p, max_new) for p in prompts))

        t0 = time.perf_counter()
        done = asyncio.run(all_of())
        return sum(len(tokens) for _, _, tokens in done) / (time.perf_counter() - t0)

    def settle(self) -> None:
        """Let the tier's I/O thread write what is queued, so an eviction that follows cannot outrun it."""
        tiers = self.engine.core.tiers
        tier = tiers.disk if tiers is not None else None
        deadline = time.monotonic() + 60
        while tier is not None and tier.pending_bytes and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.engine.shutdown()


class Genai:
    name = "genai"

    def __init__(self, model: str, num_blocks: int) -> None:
        import openvino_genai as og

        sc = og.SchedulerConfig()
        sc.num_kv_blocks = num_blocks
        sc.cache_size = 0
        sc.enable_prefix_caching = True
        sc.max_num_seqs = workers.BUDGET.max_num_seqs
        sc.max_num_batched_tokens = workers.BUDGET.max_num_batched_tokens
        threads = workers.peer_threads(workers.BUDGET)
        self.pipe = og.ContinuousBatchingPipeline(model, sc, "CPU", {"INFERENCE_NUM_THREADS": threads})

    def turn(self, ids: list[int], max_new: int = 1) -> tuple[float, int | None, list[int]]:
        """Wall time of a one-token generation (its TTFT), prompt tokens computed (not reported), reply."""
        import numpy as np
        import openvino as ov
        import openvino_genai as og

        config = og.GenerationConfig(max_new_tokens=1, ignore_eos=True)
        t0 = time.perf_counter()
        self.pipe.generate([ov.Tensor(np.asarray([ids], dtype=np.int64))], [config])
        ttft = time.perf_counter() - t0
        reply: list[int] = []
        if max_new > 1:
            config = og.GenerationConfig(max_new_tokens=max_new, ignore_eos=True)
            out = self.pipe.generate([ov.Tensor(np.asarray([ids], dtype=np.int64))], [config])
            reply = list(out[0].m_generation_ids[0])
        return ttft, None, reply

    def settle(self) -> None:
        pass

    def close(self) -> None:
        del self.pipe


def evict(engine, rng: random.Random, pool_tokens: int, vocab: int) -> None:
    """Fill the RAM pool with unrelated prompts, least recently used out: every earlier history goes."""
    for _ in range(pool_tokens * 5 // 4 // 1500 + 1):
        engine.turn(random_ids(rng, 1500, vocab))


def returning(engines, rng, lengths, rounds, pool_tokens, vocab) -> dict:
    results: dict = {}
    for length in lengths:
        for _ in range(rounds):
            history = random_ids(rng, length, vocab)
            ask, ask_again = random_ids(rng, TURN_TOKENS, vocab), random_ids(rng, TURN_TOKENS, vocab)
            for e in engines:
                e.turn(history)  # the conversation so far, computed once
                ram = e.turn(history + ask)[0]
                e.settle()
                evict(e, rng, pool_tokens, vocab)
                e.settle()
                evicted, computed, _ = e.turn(history + ask_again)
                r = results.setdefault(f"{e.name} {length}", {"ram_s": [], "evicted_s": [], "computed_tokens": []})
                r["ram_s"].append(ram)
                r["evicted_s"].append(evicted)
                r["computed_tokens"].append(computed)
                print(f"{e.name} {length}: RAM {ram * 1000:.0f} ms, evicted {evicted * 1000:.0f} ms", flush=True)
    return {
        k: v | {"ram_median_s": median(v["ram_s"]), "evicted_median_s": median(v["evicted_s"])}
        for k, v in results.items()
    }


def many_users(engines, rng, pool_tokens, multiple, history, turns, vocab) -> dict:
    num_convs = pool_tokens * multiple // history
    convs = [random_ids(rng, history, vocab) for _ in range(num_convs)]
    order = [c for c in range(num_convs) for _ in range(turns)]
    rng.shuffle(order)
    asks = [random_ids(rng, TURN_TOKENS, vocab) for _ in order]
    results = {}
    for e in engines:
        texts = [list(c) for c in convs]
        seen: set[int] = set()
        ttfts, computed = [], []
        t0 = time.perf_counter()
        for c, ask in zip(order, asks, strict=True):
            texts[c] += ask
            ttft, n, reply = e.turn(texts[c], REPLY_TOKENS)
            texts[c] += reply
            if c in seen:  # a returning turn
                ttfts.append(ttft)
                computed.append(n)
            seen.add(c)
        ttfts.sort()
        results[e.name] = {
            "conversations": num_convs,
            "returning_turns": len(ttfts),
            "mean_ttft_s": mean(ttfts),
            "p95_ttft_s": ttfts[int(0.95 * (len(ttfts) - 1))],
            "prompt_tokens_computed": sum(computed) if None not in computed else None,
            "wall_s": time.perf_counter() - t0,
        }
        print(f"{e.name} many users: {results[e.name]}", flush=True)
    return results


def after_restart(model: str, kv_cache_gb: float, lengths: list[int], disk: str) -> dict:
    rng = random.Random(1)
    results: dict = {}
    for length in lengths:
        first = Ours(model, kv_cache_gb, disk)
        vocab = first.engine.info.vocab_size
        history = random_ids(rng, length, vocab)
        ask = random_ids(rng, TURN_TOKENS, vocab)
        computed = first.turn(history)[0]
        first.close()  # a graceful stop: every block is on disk
        del first
        gc.collect()  # one model in memory at a time (4 GB packed for the Qwen3-4B shape)
        restarted = Ours(model, kv_cache_gb, disk)
        restored, recomputed_tokens, _ = restarted.turn(history + ask)
        disk_stats = restarted.engine.stats().disk
        seconds = disk_stats.restore_seconds_total if disk_stats else 0.0
        restarted.close()
        del restarted
        gc.collect()
        cold_engine = Ours(model, kv_cache_gb, None)
        cold, cold_tokens, _ = cold_engine.turn(history + ask)
        cold_engine.close()
        results[str(length)] = {
            "first_turn_s": computed,
            "restored_ttft_s": restored,
            "restore_io_s": seconds,
            "restored_turn_computed_tokens": recomputed_tokens,
            "recomputed_ttft_s": cold,
            "recomputed_turn_computed_tokens": cold_tokens,
            "speedup": cold / restored,
        }
        print(f"{length}: restored {restored:.2f} s (I/O {seconds:.2f} s), recomputed {cold:.2f} s", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kv_disk", description=__doc__)
    p.add_argument("model")
    p.add_argument("--kv-cache-gb", type=float, default=0.1, help="ovserve's RAM pool; genai gets as many blocks")
    p.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pool-multiple", type=int, default=5)
    p.add_argument("--history", type=int, default=1500, help="tokens per conversation in the many-users run")
    p.add_argument("--turns", type=int, default=3, help="turns per conversation in the many-users run")
    p.add_argument("--after-restart", action="store_true", help="only the restart measurement (see above)")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="kv-disk-", dir=Path(a.out).parent if a.out else None) as disk:
        if a.after_restart:
            restarts = {"model": a.model, "after_restart": after_restart(a.model, a.kv_cache_gb, a.lengths, disk)}
            print(json.dumps(restarts, indent=1))
            if a.out:
                Path(a.out).write_text(json.dumps(restarts, indent=1))
            return 0
        tier, plain = Ours(a.model, a.kv_cache_gb, disk), Ours(a.model, a.kv_cache_gb, None)
        info = tier.engine.info
        vocab = info.vocab_size
        pool_tokens = info.num_kv_blocks * info.block_size
        genai = Genai(a.model, info.num_kv_blocks)
        engines: list[Ours | Genai] = [tier, plain, genai]
        try:
            for e in engines:
                e.turn(random_ids(rng, 64, vocab))  # warm up
            result: dict = {"model": a.model, "pool_tokens": pool_tokens, "kv_cache_gb": a.kv_cache_gb}
            result["returning"] = returning(engines, rng, a.lengths, a.rounds, pool_tokens, vocab)
            result["many_users"] = many_users(engines, rng, pool_tokens, a.pool_multiple, a.history, a.turns, vocab)
            batch = [random_ids(rng, 256, vocab) for _ in range(8)]
            rates: dict[str, list[float]] = {"ovserve+disk": [], "ovserve": []}
            for _ in range(3):
                for e in (tier, plain):
                    rates[e.name].append(e.throughput(batch, 64))
                batch = [random_ids(rng, 256, vocab) for _ in range(8)]  # new prompts: nothing to restore
            result["throughput_tokens_per_s"] = rates
            result["throughput_ratio"] = median(rates["ovserve+disk"]) / median(rates["ovserve"])
            result["disk_stats"] = vars(tier.engine.stats().disk)
        finally:
            for e in engines:
                e.close()
    print(json.dumps({k: v for k, v in result.items() if k != "returning"}, indent=1, default=str))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
