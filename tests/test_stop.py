"""Stop rules and the scheduler's recording of a step's outcome, without any model."""

import itertools

import pytest

from service.core.config import EngineConfig
from service.core.kv_cache import KVCacheManager
from service.core.outputs import FinishReason
from service.core.params import SamplingParams
from service.core.request import Request, Status
from service.core.scheduler import Scheduler
from service.core.stop import stop_reason

EOS = 2
IDS = itertools.count()


def given(tokens, prompt_len=3, max_model_len=100, **params) -> FinishReason | None:
    """The stop reason after feeding tokens one by one (None if none of them stops the request)."""
    request = Request(next(IDS), list(range(10, 10 + prompt_len)), SamplingParams(eos_token_ids=(EOS,), **params))
    for t in tokens:
        request.append_token(t)
        reason = stop_reason(request, max_model_len)
        if reason is not None:
            return reason
    return None


def test_eos_stops_unless_ignored():
    assert given([5, EOS]) is FinishReason.STOP
    assert given([5, EOS, 6], ignore_eos=True) is None


def test_stop_token_ids_stop_even_with_ignore_eos():
    assert given([5, 9], stop_token_ids=(9,), ignore_eos=True) is FinishReason.STOP


def test_max_new_tokens_is_length():
    assert given([5, 6, 7], max_new_tokens=3) is FinishReason.LENGTH
    assert given([5, 6], max_new_tokens=3) is None


def test_context_end_is_length():
    assert given([5, 6], prompt_len=8, max_model_len=10) is FinishReason.LENGTH
    assert given([5], prompt_len=8, max_model_len=10) is None


def test_eos_on_the_last_allowed_token_is_stop():
    assert given([5, EOS], max_new_tokens=2) is FinishReason.STOP


@pytest.mark.parametrize("min_new", [1, 2, 3])
def test_min_new_tokens_hold_eos_and_stop_ids_back(min_new):
    early = [EOS] * min_new
    assert given(early, min_new_tokens=min_new) is None
    assert given([*early, EOS], min_new_tokens=min_new) is FinishReason.STOP
    assert given([9] * min_new, stop_token_ids=(9,), min_new_tokens=min_new) is None


def test_min_new_tokens_do_not_hold_length_back():
    assert given([EOS, EOS], max_new_tokens=2, min_new_tokens=2) is FinishReason.LENGTH


# -- Scheduler.update: the one place a step's outcome is recorded ---------------------------------------
def scheduler(num_blocks=32, block_size=4, max_model_len=64) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(EngineConfig(max_num_seqs=8, max_num_batched_tokens=64), kv, max_model_len)


def admitted(s: Scheduler, n_prompt=5, **params) -> Request:
    request = Request(next(IDS), list(range(100, 100 + n_prompt)), SamplingParams(eos_token_ids=(EOS,), **params))
    s.add(request)
    return request


def test_update_records_computed_and_sampled_tokens():
    s = scheduler()
    r = admitted(s)
    plan = s.schedule()
    assert s.update(plan, [[7]]) == []
    assert (r.num_computed_tokens, r.output_token_ids, r.status) == (5, [7], Status.RUNNING)
    assert r.first_token_time is not None


def test_update_accepts_a_run_of_tokens_and_drops_those_after_a_stop():
    s = scheduler()
    r = admitted(s)
    plan = s.schedule()
    assert s.update(plan, [[7, 8, EOS, 9, 9]]) == [r]
    assert r.output_token_ids == [7, 8, EOS]
    assert (r.status, r.finish_reason) == (Status.FINISHED, FinishReason.STOP)
    assert not s.has_work() and s.kv.pool.num_free == 32


def test_update_stops_a_run_at_max_new_tokens():
    s = scheduler()
    r = admitted(s, max_new_tokens=2)
    assert s.update(s.schedule(), [[7, 8, 9]]) == [r]
    assert r.output_token_ids == [7, 8] and r.finish_reason is FinishReason.LENGTH


def test_update_finishes_only_the_requests_that_stopped():
    s = scheduler()
    a, b = admitted(s), admitted(s, n_prompt=6)
    finished = s.update(s.schedule(), [[EOS], [7]])
    assert finished == [a] and s.running == [b] and list(s.requests.values()) == [b]


def test_update_needs_one_run_per_sampled_request():
    s = scheduler()
    admitted(s)
    with pytest.raises(ValueError):
        s.update(s.schedule(), [])


def test_finish_is_idempotent_and_frees_blocks_once():
    s = scheduler()
    r = admitted(s)
    s.update(s.schedule(), [[7]])
    s.finish(r, FinishReason.ABORT)
    s.finish(r)
    assert r.finish_reason is FinishReason.ABORT
    assert s.kv.pool.num_free == 32 and not s.has_work()


def test_a_request_id_cannot_be_added_twice():
    s = scheduler()
    r = admitted(s)
    with pytest.raises(ValueError, match="already"):
        s.add(Request(r.id, [1, 2], SamplingParams()))
    assert list(s.requests.values()) == [r]
