"""Scheduler: continuous batching, chunked prefill, preemption and abort, without any model."""

import itertools
import random
import time

from service.core.config import EngineConfig
from service.core.kv_cache import KVCacheManager
from service.core.params import SamplingParams
from service.core.request import Request, Status
from service.core.scheduler import Scheduler

BS = 4


def make(num_blocks=64, max_num_seqs=4, budget=16, max_model_len=256, prefix=True):
    kv = KVCacheManager(num_blocks, BS, prefix)
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return Scheduler(config, kv, max_model_len)


IDS = itertools.count()


def request(label: str, n: int, start: int = 0, **kw) -> Request:
    return Request(next(IDS), list(range(start, start + n)), SamplingParams(**kw), label=label)


def step(s: Scheduler, sampled_token: int = 7):
    """Plan a step, 'run' it, and give a token to each request that reached its end."""
    plan = s.schedule()
    s.update(plan, [[sampled_token] for _ in plan.sampled])
    return plan


def test_chunked_prefill_splits_long_prompt_and_completes():
    s = make(budget=16)
    r = request("a", 40)
    s.add(r)
    sizes = [step(s).chunks[0].num_tokens for _ in range(3)]
    assert sizes == [16, 16, 8]
    assert r.num_output_tokens == 1
    assert step(s).chunks[0].num_tokens == 1  # decode


def prompt_cuts(decoding: int) -> list[int]:
    """Where a 30-token prompt's pieces end, computed beside `decoding` requests that decode in every step."""
    s = make(budget=16, max_num_seqs=8)
    for i in range(decoding):
        s.add(request(f"o{i}", 1, start=1000 * (i + 1), max_new_tokens=50))
    step(s)
    r = request("r", 30)
    s.add(r)
    ends = []
    while r.num_output_tokens == 0:
        step(s)
        ends.append(r.num_computed_tokens)
    return ends


def test_prompts_are_cut_where_the_budget_ends():
    assert prompt_cuts(decoding=0) == [16, 30]
    assert prompt_cuts(decoding=3) == [13, 26, 30]  # decoding tokens first


def test_a_prompt_computed_in_pieces_keeps_the_blocks_it_still_needs():
    # with room left beside a piece, a waiting request was admitted into the blocks the prompt had yet to
    # fill, and the prompt's next pieces preempted it (its prefill thrown away)
    s = make(num_blocks=12, budget=16)
    long, short = request("long", 40, max_new_tokens=4), request("short", 12, start=500, max_new_tokens=12)
    s.add(long)
    step(s)
    s.add(short)
    while s.has_work():
        step(s)
    assert s.num_preemptions == 0 and long.num_output_tokens == 4 and short.num_output_tokens == 12


def test_prefill_chunks_mix_with_decode_tokens():
    s = make(budget=16)
    a = request("a", 5)
    s.add(a)
    step(s)
    s.add(request("b", 40, start=100))
    plan = step(s)
    assert [(c.request.label, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 15)]


def test_budget_and_max_num_seqs_never_exceeded():
    rng = random.Random(0)
    s = make(num_blocks=40, max_num_seqs=3, budget=12)
    for i in range(12):
        s.add(request(f"r{i}", rng.randint(1, 30), start=i * 1000, max_new_tokens=5))
    for _ in range(200):
        plan = step(s)
        assert plan.num_tokens <= 12
        assert len(s.running) <= 3
        for r in list(s.running):
            if r.num_output_tokens >= 5:
                s.finish(r)
        if not s.has_work():
            break
    assert not s.has_work()
    assert s.kv.pool.num_free == 40


def test_running_first_then_waiting_fcfs():
    s = make(max_num_seqs=2, budget=64)
    for rid in "abc":
        s.add(request(rid, 4, start=ord(rid) * 100))
    plan = step(s)
    assert [c.request.label for c in plan.chunks] == ["a", "b"]
    s.finish(s.running[0])
    plan = step(s)
    assert [c.request.label for c in plan.chunks] == ["b", "c"]


def test_preemption_by_recompute_and_resume():
    s = make(num_blocks=5, budget=64, max_num_seqs=4)  # 20 token slots
    a, b = request("a", 7), request("b", 7, start=100)
    s.add(a)
    s.add(b)
    step(s)  # both prefilled: 2 blocks each, one block left (b was admitted because a could still grow)
    step(s)  # 8 tokens each: still fits
    plan = step(s)  # a takes the last block for its 9th token; b needs one too and is preempted
    assert [r.label for r in plan.preempted] == ["b"]
    assert b.status is Status.WAITING and b.num_computed_tokens == 0
    assert next(iter(s.waiting)) is b
    assert s.num_preemptions == 1
    s.finish(a)
    plan = s.schedule()  # b resumes: its two full blocks (prompt + first generated token) from the cache
    chunk = plan.chunks[0]
    assert chunk.request is b and chunk.sample
    assert (chunk.start, chunk.num_tokens) == (8, b.num_tokens - 8)
    assert b.num_output_tokens == 2


def test_no_admission_in_a_step_that_preempted():
    s = make(num_blocks=5, budget=64)
    a, b = request("a", 8), request("b", 8, start=100)
    s.add(a)
    s.add(b)
    step(s)
    s.add(request("c", 1, start=500))
    plan = step(s)  # a takes the last block, b is preempted, and c must wait although b freed two
    assert plan.preempted
    assert "c" not in [c.request.label for c in plan.chunks]


def test_admission_leaves_each_running_request_a_block_to_grow_into():
    s = make(num_blocks=4, budget=64)
    a, b = request("a", 7), request("b", 7, start=100)
    s.add(a)
    s.add(b)
    plan = step(s)  # b would fit (2 of 4 blocks) but then a's next block would cost b its prefill
    assert [c.request.label for c in plan.chunks] == ["a"]
    s.finish(a)
    assert [c.request.label for c in step(s).chunks] == ["b"]  # nothing running: all blocks usable
    assert s.num_preemptions == 0


def test_request_that_fits_max_model_len_always_completes():
    s = make(num_blocks=8, budget=8, max_num_seqs=4)  # 32 token slots
    reqs = [request(f"r{i}", 20, start=i * 100) for i in range(4)]
    for r in reqs:
        s.add(r)
    for _ in range(500):
        step(s)
        for r in list(s.running):
            if r.num_tokens >= 30:
                s.finish(r)
        if not s.has_work():
            break
    assert all(r.status is Status.FINISHED and r.num_tokens == 30 for r in reqs)
    assert s.num_preemptions > 0
    assert s.kv.pool.num_free == 8


def test_abort_frees_everything():
    s = make(num_blocks=16)
    running, waiting = request("a", 10), request("b", 10, start=50)
    s.add(running)
    step(s)
    s.add(waiting)
    s.finish(running)
    s.finish(waiting)
    assert not s.has_work()
    assert s.kv.pool.num_free == 16


def test_prefix_hit_skips_cached_tokens():
    s = make(budget=64)
    a = request("a", 20)
    s.add(a)
    step(s)
    s.finish(a)
    b = request("b", 25)  # shares a's first 20 tokens: 5 full blocks cached
    s.add(b)
    plan = step(s)
    assert plan.chunks[0].start == 20 and plan.chunks[0].num_tokens == 5
    assert b.num_cached_tokens == 20


def test_expired_request_is_dropped_and_freed():
    s = make()
    r = request("a", 10)
    r.deadline = time.monotonic() - 1
    s.add(r)
    plan = s.schedule()
    assert plan.expired == [r] and not plan.chunks
    assert s.kv.pool.num_free == 64


# -- the disk tier: loading state ------------------------------------------------------------------------


class FakeDisk:
    """Stands in for the tiers below RAM: the disk holds the blocks whose digests it was given; with remote, the
    rest of every chain is tried remotely (as a remote tier that answers does)."""

    def __init__(self, digests=(), remote: bool = False) -> None:
        self.digests = set(digests)
        self.remote = remote

    def count_chain(self, digests) -> int:
        n = 0
        while n < len(digests) and digests[n] in self.digests:
            n += 1
        return n

    def count_remote(self, digests) -> int:
        return len(digests) if self.remote else 0

    def touch(self, digests) -> None:
        pass


def with_disk(disk: FakeDisk, num_blocks: int = 64, max_num_seqs: int = 4) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, True)
    return Scheduler(EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=16), kv, 256, disk=disk)


def digests_of(s: Scheduler, r: Request) -> list[bytes]:
    return s.kv.full_block_digests(-1 - r.id, r.prompt_token_ids, r.cache_salt)


def queued_with_three_blocks_on_disk() -> tuple[Scheduler, Request]:
    """A scheduler with a disk tier, and a queued 18-token request whose first 3 blocks are on disk."""
    disk = FakeDisk()
    s = with_disk(disk)
    r = request("a", 18)
    disk.digests.update(digests_of(s, r)[:3])
    s.add(r)
    return s, r


def test_a_prefix_on_disk_is_loaded_then_computed_from_there():
    s, r = queued_with_three_blocks_on_disk()  # blocks 0-2 of its 4 full ones
    plan = s.schedule()
    assert not plan.chunks and [load.request for load in plan.loads] == [r]
    load = plan.loads[0]
    assert (len(load.digests), len(load.block_ids), load.first) == (3, 3, True)
    assert r.status is Status.LOADING and s.has_work()
    assert s.schedule().empty  # nothing to do until the load ends
    s.loaded(r.id, 3)
    assert r.status is Status.RUNNING and r.num_computed_tokens == 12
    assert (r.num_cached_tokens, r.num_restored_tokens, s.num_restored_tokens) == (12, 12, 12)
    assert tuple(b.digest for b in s.kv.take_newly_cached()) == load.digests  # restored blocks join the cache
    chunk = step(s).chunks[0]
    assert (chunk.start, chunk.num_tokens, r.num_output_tokens) == (12, 6, 1)


def test_a_partial_load_gives_back_the_rest_and_computes_it():
    disk = FakeDisk()
    s = with_disk(disk)
    r = request("a", 18)
    disk.digests.update(digests_of(s, r))
    s.add(r)
    load = s.schedule().loads[0]
    assert len(load.digests) == 4  # every full block: the last token is in the fifth
    free_before = s.kv.pool.num_free
    s.loaded(r.id, 1)  # the second file was corrupt
    assert s.kv.pool.num_free == free_before + 3
    assert (r.num_computed_tokens, r.num_cached_tokens, r.num_restored_tokens) == (4, 4, 4)
    while r.status is not Status.FINISHED:
        step(s)
        if r.num_output_tokens == 1:
            s.finish(r)
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


def test_the_block_of_the_last_token_is_never_restored():
    disk = FakeDisk()
    s = with_disk(disk)
    r = request("a", 16)  # four full blocks; the last holds the token whose logits are wanted
    disk.digests.update(digests_of(s, r))
    s.add(r)
    assert len(s.schedule().loads[0].digests) == 3


def test_two_requests_needing_the_same_blocks_load_them_once():
    disk = FakeDisk()
    s = with_disk(disk)
    a, b = request("a", 18), request("b", 18)
    disk.digests.update(digests_of(s, a)[:3])
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert [load.request for load in plan.loads] == [a] and b.status is Status.WAITING
    assert s.schedule().empty  # b waits for a's load rather than loading the same blocks
    s.loaded(a.id, 3)
    plan = s.schedule()
    assert not plan.loads and {c.request for c in plan.chunks} == {a, b}
    assert b.num_cached_tokens == 12 and b.num_restored_tokens == 0  # found in RAM once a restored them


def test_a_chain_continues_from_disk_into_the_remote_tier_and_usage_says_where_it_came_from():
    disk = FakeDisk(remote=True)
    s = with_disk(disk)
    r = request("a", 18)
    disk.digests.update(digests_of(s, r)[:1])
    s.add(r)
    load = s.schedule().loads[0]
    assert len(load.digests) == 4  # one block on disk, three tried remotely
    s.loaded(r.id, 3, num_remote=2)  # the remote tier had two of them
    assert (r.num_computed_tokens, r.num_cached_tokens) == (12, 12)
    assert (r.num_restored_tokens, r.num_remote_tokens) == (4, 8)
    assert (s.num_restored_tokens, s.num_remote_tokens) == (4, 8)
    assert s.kv.num_blocks(r.id) == 3  # the block tried in vain is given back


def test_a_remote_try_never_holds_a_request_back_for_lack_of_blocks():
    disk = FakeDisk(remote=True)
    s = with_disk(disk, num_blocks=6)  # fewer than the 30-token prompt's seven full blocks
    r = request("a", 30)
    s.add(r)
    plan = s.schedule()
    assert not plan.loads and [c.request for c in plan.chunks] == [r]  # computed, as without the tier
    assert r.num_remote_tokens == 0


def test_a_request_finished_while_loading_frees_its_blocks_when_the_load_ends():
    s, r = queued_with_three_blocks_on_disk()
    s.schedule()
    s.finish(r)  # aborted: the I/O thread may still be writing into its blocks
    assert s.kv.pool.num_free == s.kv.pool.num_blocks - 3 and not s.has_work()
    s.loaded(r.id, 3)
    assert s.kv.pool.num_free == s.kv.pool.num_blocks and not s.loading
    assert r not in s.running
    again = request("again", 18)  # what was restored for it is kept in RAM for whoever comes next
    assert s.kv.find_prefix(again.id, r.prompt_token_ids).num_tokens == 12


def test_an_expired_loading_request_is_dropped():
    s, r = queued_with_three_blocks_on_disk()
    assert s.schedule().loads
    r.deadline = time.monotonic()  # expires while loading
    assert s.schedule().expired == [r]
    s.loaded(r.id, 3)
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


def test_loading_requests_count_towards_max_num_seqs():
    disk = FakeDisk()
    s = with_disk(disk, max_num_seqs=1)
    a, b = request("a", 18), request("b", 5, start=500)
    disk.digests.update(digests_of(s, a)[:3])
    s.add(a)
    s.add(b)
    assert s.schedule().loads and s.schedule().empty
    s.loaded(a.id, 3)
    assert [c.request for c in s.schedule().chunks] == [a]


# -- the candidates of an n > 1 request ----------------------------------------------------------------------
def candidates(n: int, prompt_len: int, **kw) -> list[Request]:
    """n requests for one prompt, the later ones following the first, as the engine's front makes them."""
    first = request("c0", prompt_len, start=500, **kw)
    return [first] + [
        Request(next(IDS), list(first.prompt_token_ids), first.params, label=f"c{i}", leader=first) for i in range(1, n)
    ]


def test_later_candidates_wait_for_the_prompt_then_compute_only_its_last_partial_block():
    s = make(budget=16, max_num_seqs=8)
    group = candidates(3, 30)  # 7 full blocks of 4 before the last token, then 2 tokens
    for r in group:
        s.add(r)
    computed = {r.id: 0 for r in group}
    while any(r.num_output_tokens == 0 for r in group):
        for chunk in step(s).chunks:  # prompt tokens computed (the first one decodes meanwhile)
            computed[chunk.request.id] += max(0, min(chunk.start + chunk.num_tokens, 30) - chunk.start)
    first, *later = group
    assert computed[first.id] == 30
    assert [computed[r.id] for r in later] == [2, 2]  # the 28 tokens of the full blocks were read, not computed
    assert [r.num_cached_tokens for r in later] == [28, 28] and first.num_cached_tokens == 0
    assert s.num_shared_prompt_tokens == 56
    # the candidates hold the prompt's full blocks together, by reference
    tables = [s.kv.block_ids(r.id) for r in group]
    assert tables[0][:7] == tables[1][:7] == tables[2][:7]
    assert len({t[7] for t in tables}) == 3
    for r in group:
        s.finish(r)
    assert s.kv.pool.num_free == s.kv.pool.num_blocks  # nothing leaks


def test_candidates_of_a_short_prompt_start_together():
    s = make(budget=16, max_num_seqs=8)
    group = candidates(3, 4)  # no full block before the last token: nothing to share, nothing to wait for
    for r in group:
        s.add(r)
    plan = step(s)
    assert [c.request for c in plan.chunks] == group
    assert s.num_shared_prompt_tokens == 0


def test_a_later_candidate_does_not_wait_for_a_leader_that_ended_or_without_a_prefix_cache():
    s = make(budget=16, max_num_seqs=8)
    first, later = candidates(2, 30)
    s.add(first)
    s.add(later)
    s.finish(first)  # aborted before computing anything
    plan = step(s)
    assert [c.request for c in plan.chunks] == [later]
    s = make(budget=64, max_num_seqs=8, prefix=False)
    group = candidates(2, 30)
    for r in group:
        s.add(r)
    assert [c.request for c in step(s).chunks] == group


def test_aborting_every_candidate_mid_prompt_frees_every_block():
    s = make(budget=16, max_num_seqs=8, num_blocks=32)
    group = candidates(4, 30)
    for r in group:
        s.add(r)
    for _ in range(3):
        step(s)
    for r in group:
        s.finish(r)
    assert s.kv.pool.num_free == s.kv.pool.num_blocks
    assert not s.requests and not s.waiting and not s.running


def test_a_short_prompt_starts_beside_a_long_one_rather_than_after_it():
    s = make(budget=16)
    long = request("long", 100, max_new_tokens=2)
    s.add(long)
    step(s)
    short = request("short", 6, start=500, max_new_tokens=2)
    s.add(short)
    plan = step(s)
    assert [(c.request.label, c.num_tokens) for c in plan.chunks] == [("long", 10), ("short", 6)]
    assert short.num_output_tokens == 1 and long.num_output_tokens == 0
    # a waiting prompt longer than what the running one has left waits its turn as before
    s2 = make(budget=16)
    first, second = request("first", 20, max_new_tokens=2), request("second", 40, start=500, max_new_tokens=2)
    s2.add(first)
    step(s2)
    s2.add(second)
    assert [(c.request.label, c.num_tokens) for c in step(s2).chunks] == [("first", 4), ("second", 12)]
