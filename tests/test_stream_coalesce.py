"""Events waiting for a lagging consumer are folded into one output; errors and the end are never skipped."""

import asyncio

from service.core.outputs import FinishReason
from service.engine import _coalesce, _Event
from service.errors import EngineFailure


def _queue(*events: _Event) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()
    for e in events:
        q.put_nowait(e)
    return q


def test_waiting_tokens_fold_into_one_event_up_to_the_finish():
    q = _queue(_Event([2]), _Event([3], finish_reason=FinishReason.LENGTH), _Event([99]))
    event = _coalesce(_Event([1]), q)
    assert event.token_ids == [1, 2, 3]
    assert event.finish_reason is FinishReason.LENGTH
    assert q.qsize() == 1  # nothing past the finish is taken


def test_an_error_behind_tokens_wins():
    error = EngineFailure("boom")
    event = _coalesce(_Event([1]), _queue(_Event([2]), _Event(error=error)))
    assert event.error is error


def test_nothing_waiting_leaves_the_event_as_it_is():
    first = _Event([7])
    assert _coalesce(first, _queue()) is first
