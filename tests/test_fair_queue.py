"""Fair admission across tenants, without a model: the fair queue alone, then the scheduler asking it."""

import itertools

from service.core.config import EngineConfig
from service.core.fair_queue import FairQueue
from service.core.kv_cache import KVCacheManager
from service.core.params import SamplingParams
from service.core.request import Request
from service.core.scheduler import Scheduler

IDS = itertools.count()
BS = 4


def request(tenant: str, n: int = 4, weight: float = 1.0, priority: int = 0, **kw) -> Request:
    rid = next(IDS)
    return Request(
        rid,
        list(range(rid * 100, rid * 100 + n)),
        SamplingParams(**kw),
        label=f"{tenant}{rid}",
        tenant=tenant,
        tenant_weight=weight,
        priority=priority,
    )


def admit_all(queue: FairQueue, cost: int = 10) -> list[str]:
    """Admit every waiting request one by one as a scheduler does, charging each `cost` tokens; their tenants."""
    order = []
    while queue:
        chosen = next(iter(queue))
        queue.admitted(chosen)
        queue.charge(chosen, cost)
        order.append(chosen.tenant)
    return order


def test_a_burst_does_not_go_first_when_another_tenant_waits():
    q = FairQueue()
    for _ in range(6):
        q.add(request("flood"))
    q.add(request("light"))
    assert admit_all(q)[:2] == ["flood", "light"]  # the light tenant's one request waits for one, not six


def test_tenants_alternate_in_proportion_to_their_weights():
    q = FairQueue()
    for _ in range(9):
        q.add(request("a", weight=2.0))
        q.add(request("b", weight=1.0))
    order = admit_all(q)[:9]
    assert order.count("a") == 6 and order.count("b") == 3


def test_a_reloaded_weight_stays_when_an_older_request_is_preempted_back_into_the_queue():
    q = FairQueue()
    old = request("a", weight=1.0)
    q.add(old)
    q.admitted(old)
    q.add(request("a", weight=4.0))  # the keys file was reloaded: a's weight is now 4
    q.add(old)  # preempted: back in line with the weight it came with
    assert q.tenants() == {"a": 4.0}


def test_priority_orders_a_tenants_own_requests_only():
    q = FairQueue()
    low, high = request("a", priority=5), request("a", priority=-5)
    other = request("b", priority=1000)
    for r in (low, high, other):
        q.add(r)
    chosen = []
    while q:
        r = next(iter(q))
        q.admitted(r)
        q.charge(r, 10)
        chosen.append(r)
    assert chosen.index(high) < chosen.index(low)  # within tenant a, the lower number first
    assert chosen.index(other) == 1  # b's lowest priority does not put it behind both of a's


def test_idle_time_is_not_saved_up_for_a_burst():
    q = FairQueue()
    busy = request("busy")
    q.add(busy)
    q.admitted(busy)
    q.charge(busy, 1000)  # the busy tenant ran alone for a long while
    q.add(request("busy"))
    q.admitted(next(iter(q)))
    for _ in range(4):
        q.add(request("late"))
    q.add(request("busy"))
    # the late tenant starts at the clock of the last admission, not at 0: it does not take 100 turns in a row
    order = admit_all(q, cost=1000)
    assert order.index("busy") <= 1


def test_without_fairness_it_is_one_queue_by_priority_then_arrival():
    q = FairQueue(fair=False)
    requests = [request("flood") for _ in range(3)] + [request("light"), request("light", priority=-1)]
    for r in requests:
        q.add(r)
    assert [r.label for r in q] == [requests[4].label] + [r.label for r in requests[:4]]


def test_a_preempted_request_keeps_its_place():
    q = FairQueue()
    first, second = request("a"), request("a")
    q.add(first)
    q.add(second)
    q.admitted(first)
    q.add(first)  # preempted: back in front of the one that came after it
    assert next(iter(q)) is first and len(q) == 2


# -- the scheduler ------------------------------------------------------------------------------------------
def scheduler(max_num_seqs: int = 4, budget: int = 64, num_blocks: int = 256, fair: bool = True) -> Scheduler:
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, fair_admission=fair)
    return Scheduler(config, KVCacheManager(num_blocks, BS, True), 1024)


def step(s: Scheduler):
    plan = s.schedule()
    s.update(plan, [[7] for _ in plan.sampled])
    return plan


def flooded(fair: bool = True) -> tuple[Scheduler, list[Request], Request]:
    """Four places all held by a tenant with eight requests, and another tenant's request just arrived."""
    s = scheduler(max_num_seqs=4, fair=fair)
    flood = [request("flood", max_new_tokens=100) for _ in range(8)]
    for r in flood:
        s.add(r)
    step(s)
    assert [r.tenant for r in s.running] == ["flood"] * 4
    light = request("light", max_new_tokens=2)
    s.add(light)
    return s, flood, light


def test_a_tenant_under_its_share_takes_a_place_from_the_flood():
    s, flood, light = flooded()
    plan = step(s)
    assert light in s.running and light in [c.request for c in plan.chunks]
    assert [r.label for r in plan.preempted] == [flood[3].label]  # the flood's newest gave its place
    assert s.num_preemptions == 1
    while light.num_output_tokens < 2:
        step(s)
    # the light tenant's request finished; the flood takes its place back and nobody is preempted for it
    step(s)
    assert [r.tenant for r in s.running] == ["flood"] * 4 and s.num_preemptions == 1


def test_no_place_is_taken_without_fairness():
    s, _, light = flooded(fair=False)
    for _ in range(5):
        step(s)
    assert light not in s.running and s.num_preemptions == 0


def test_tenants_at_their_share_keep_their_places():
    s = scheduler(max_num_seqs=4)
    for tenant in ("a", "a", "b", "b", "a", "b"):
        s.add(request(tenant, max_new_tokens=100))
    for _ in range(5):
        step(s)
    assert sorted(r.tenant for r in s.running) == ["a", "a", "b", "b"] and s.num_preemptions == 0


def test_weights_set_the_share_of_places():
    s = scheduler(max_num_seqs=4)
    for _ in range(6):
        s.add(request("big", weight=3.0, max_new_tokens=100))
    step(s)
    for _ in range(3):
        s.add(request("small", weight=1.0, max_new_tokens=100))
    for _ in range(4):
        step(s)
    assert sorted(r.tenant for r in s.running) == ["big", "big", "big", "small"]


def test_every_block_comes_back_after_a_fair_preemption():
    s = scheduler(max_num_seqs=3, num_blocks=64)
    for _ in range(6):
        s.add(request("flood", n=9, max_new_tokens=6))
    step(s)
    for _ in range(2):
        s.add(request("light", n=5, max_new_tokens=3))
    for _ in range(200):
        if not s.has_work():
            break
        step(s)
    assert not s.has_work() and s.kv.pool.num_free == 64
    assert s.num_preemptions >= 1


def decoding(tenant: str = "flood", count: int = 4, fair: bool = True) -> Scheduler:
    """count requests of one tenant decoding, with places to spare."""
    s = scheduler(max_num_seqs=8, fair=fair)
    for _ in range(count):
        s.add(request(tenant, max_new_tokens=100))
    step(s)
    step(s)
    assert len(s.running) == count and all(r.num_output_tokens == 2 for r in s.running)
    return s


def test_a_tenant_with_nothing_running_starts_in_a_step_of_its_own():
    s = decoding()
    light, other = request("light", n=6, max_new_tokens=3), request("other", n=5, max_new_tokens=3)
    s.add(light)
    s.add(other)
    plan = step(s)
    # both newcomers' prompts, and none of the flood's decoding rows beside them
    assert [c.request for c in plan.chunks] == [light, other] and plan.num_tokens == 11
    plan = step(s)
    assert len(plan.chunks) == 6  # then everyone decodes together


def test_a_tenant_with_a_request_running_takes_its_turn_beside_the_others():
    s = decoding()
    first = request("light", max_new_tokens=100)
    s.add(first)
    step(s)
    second = request("light", n=6, max_new_tokens=3)
    s.add(second)
    plan = step(s)
    assert second in [c.request for c in plan.chunks] and len(plan.chunks) == 6


def test_no_step_of_its_own_without_fairness_or_with_one_tenant():
    for s, newcomer in ((decoding(fair=False), request("light")), (decoding(), request("flood"))):
        s.add(newcomer)
        plan = step(s)
        assert newcomer in [c.request for c in plan.chunks] and len(plan.chunks) == 5
