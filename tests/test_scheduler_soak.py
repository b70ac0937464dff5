"""Scheduler and KV cache under random traffic, without a model: a stand-in 'KV memory' records which
token each block slot holds, so every step checks what paged attention relies on. Each chunk's block
table must hold exactly the request's earlier tokens (a stale prefix-cache block or a block shared by
mistake would show up here), reference counts must match the block tables, and when the traffic
ends, with finishes, aborts and preemptions along the way, every block must be free."""

import random

import pytest

from service.core.config import EngineConfig
from service.core.feed import Feed
from service.core.kv_cache import KVCacheManager
from service.core.params import SamplingParams
from service.core.request import Request, Status
from service.core.scheduler import Scheduler

BS = 4
# deterministic steps' feed over this traffic's tokens: replies (tokens below 97) often hold the header and the end
FEED = Feed(header=(5,), end=7)
PREFIXES = [list(range(1000 * k, 1000 * k + n)) for k, n in ((1, 9), (2, 16), (3, 5))]


def _next_token(request: Request) -> int:
    """Deterministic per request and position, like greedy decoding, so equal histories stay equal."""
    return hash((request.prompt_token_ids[-1], request.num_tokens)) % 97


def _check_tables(s: Scheduler) -> None:
    refs: dict[int, int] = {}
    for request in s.running:
        for block_id in s.kv.block_ids(request.id):
            refs[block_id] = refs.get(block_id, 0) + 1
        assert len(s.kv.block_ids(request.id)) * BS >= request.num_computed_tokens
    for request in s.waiting:
        assert not s.kv.holds(request.id), f"{request.id} waits while holding blocks"
    for block in s.kv.pool.blocks:
        assert block.ref_count == refs.get(block.block_id, 0), f"block {block.block_id}"
    assert s.kv.pool.num_free == sum(1 for b in s.kv.pool.blocks if b.ref_count == 0)


def _run_chunk(chunk, memory: dict[int, list[int | None]]) -> None:
    """What the model would read and write: positions before start must already be in the table."""
    tokens = chunk.request.all_token_ids
    for pos in range(chunk.start + chunk.num_tokens):
        block_id = chunk.block_ids[pos // BS]
        if pos < chunk.start:
            held = memory[block_id][pos % BS]
            assert held == tokens[pos], f"{chunk.request.id} reads a wrong KV entry at {pos}"
        else:
            memory[block_id][pos % BS] = tokens[pos]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix", "no-prefix"])
@pytest.mark.parametrize("num_tenants", [1, 3], ids=["one-tenant", "tenants"])
@pytest.mark.parametrize("feed", [None, FEED], ids=["fast", "rows-and-pieces"])
def test_random_traffic_keeps_kv_consistent_and_frees_every_block(
    seed: int, prefix_caching: bool, num_tenants: int, feed: Feed | None
):
    """With several tenants (weights, priorities) fair admission preempts too: the same must hold."""
    rng = random.Random(seed)
    weights = [rng.choice([0.5, 1.0, 3.0]) for _ in range(num_tenants)]
    num_blocks = rng.choice([12, 20, 40])  # small pools force preemption
    s = Scheduler(
        EngineConfig(max_num_seqs=rng.choice([2, 4, 8]), max_num_batched_tokens=rng.choice([8, 16, 64])),
        KVCacheManager(num_blocks, BS, prefix_caching),
        max_model_len=num_blocks * BS,
        feed=feed,
    )
    memory: dict[int, list[int | None]] = {b: [None] * BS for b in range(num_blocks)}
    targets: dict[int, int] = {}
    finished, aborted = [], []
    for i in range(3000):  # 300 steps of arrivals, then until the traffic drains
        if i < 300 and rng.random() < 0.3:
            prompt = rng.choice(PREFIXES) + [rng.randrange(97) for _ in range(rng.randint(1, 12))]
            if rng.random() < 0.3 and finished:  # a next turn: an earlier history plus a new message
                earlier = rng.choice(finished)
                prompt = earlier.all_token_ids + [rng.randrange(97) for _ in range(rng.randint(1, 6))]
            prompt = prompt[: num_blocks * BS // 2]  # fits the pool on its own
            num_new = rng.randint(1, 10)
            k = rng.randrange(num_tenants)
            tenant = {"tenant": f"t{k}", "tenant_weight": weights[k], "priority": rng.randint(-2, 2)}
            request = Request(i, prompt, SamplingParams(max_new_tokens=num_new), **tenant)
            targets[request.id] = len(prompt) + num_new
            s.add(request)
        if rng.random() < 0.05 and (s.running or s.waiting):
            victim = rng.choice([*s.running, *s.waiting])
            s.finish(victim)
            aborted.append(victim)
        plan = s.schedule()
        assert plan.num_tokens <= s.max_num_batched_tokens
        assert len(s.running) <= s.max_num_seqs
        _check_tables(s)
        for chunk in plan.chunks:
            _run_chunk(chunk, memory)
            if feed is not None:
                assert all(not piece or len(ids) >= 2 for ids, _, _, piece in chunk.feeds()), "a one-token piece"
        finished += s.update(plan, [[_next_token(r)] for r in plan.sampled])
        if i >= 300 and not s.has_work():
            break
    assert not s.has_work(), "the traffic did not drain"
    assert s.kv.pool.num_free == num_blocks
    assert all(r.status is Status.FINISHED for r in finished + aborted)
    assert all(r.num_tokens == targets[r.id] for r in finished)
    if prefix_caching:
        assert s.kv.num_hit_tokens > 0
    else:
        assert s.kv.pool.num_cached == 0
