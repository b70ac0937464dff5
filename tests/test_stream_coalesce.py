"""Events waiting for a lagging consumer are folded into one output per request (the candidates of an n > 1
call share a queue); errors and the end are never skipped."""

import asyncio

from service.core.outputs import FinishReason
from service.engine.core import EngineOutput
from service.engine.outputs import coalesce
from service.errors import EngineFailure


def _queue(*events: EngineOutput) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()
    for e in events:
        q.put_nowait(e)
    return q


def test_waiting_tokens_fold_into_one_event_up_to_the_finish():
    q = _queue(
        EngineOutput(1, [2, 3], drafted=[True, False]),
        EngineOutput(1, [4], drafted=[False], finish_reason=FinishReason.LENGTH),
        EngineOutput(1, [99], drafted=[False]),
    )
    [event] = coalesce(EngineOutput(1, [1], drafted=[False]), q)
    assert event.token_ids == [1, 2, 3, 4]
    assert event.drafted == [False, True, False, False]  # which tokens were kept drafts, token by token
    assert event.finish_reason is FinishReason.LENGTH  # what came after the finish is not the reply's


def test_an_error_behind_tokens_wins():
    error = EngineFailure("boom")
    [event] = coalesce(EngineOutput(1, [1]), _queue(EngineOutput(1, [2]), EngineOutput(1, error=error)))
    assert event.error is error


def test_an_error_after_the_finish_does_not_replace_it():
    [event] = coalesce(
        EngineOutput(1, [1], finish_reason=FinishReason.STOP), _queue(EngineOutput(1, error=EngineFailure("x")))
    )
    assert event.finish_reason is FinishReason.STOP and event.error is None


def test_candidates_fold_apart_in_the_order_they_first_came():
    q = _queue(
        EngineOutput(2, [20]),
        EngineOutput(1, [11], finish_reason=FinishReason.STOP),
        EngineOutput(3, [30]),
        EngineOutput(2, [21], finish_reason=FinishReason.LENGTH),
    )
    events = coalesce(EngineOutput(1, [10]), q)
    assert [(e.request_id, e.token_ids, e.finish_reason) for e in events] == [
        (1, [10, 11], FinishReason.STOP),
        (2, [20, 21], FinishReason.LENGTH),
        (3, [30], None),
    ]
    assert q.empty()


def test_nothing_waiting_leaves_the_event_as_it_is():
    first = EngineOutput(1, [7])
    assert coalesce(first, _queue()) == [first]
    assert coalesce(first, _queue())[0] is first
