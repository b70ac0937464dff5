"""What the engine thread publishes, the commands it takes, and how a lagging caller folds what waits for it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from service.core.outputs import FinishReason, TokenLogprob
from service.core.request import Request
from service.engine.kv_tier import LoadResult
from service.errors import ServiceError


@dataclass
class EngineOutput:
    """What a step produced for one request: new tokens and, on its last output, a finish reason or an
    error. num_cached_tokens and queue_seconds are known from the request's first scheduling on."""

    request_id: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, or none (none asked for)
    drafted: list[bool] = field(default_factory=list)  # one per token: whether it was a draft the model kept
    predicted: list[bool] = field(default_factory=list)  # one per token: whether it was a kept predicted draft
    finish_reason: FinishReason | None = None
    error: ServiceError | None = None
    num_cached_tokens: int = 0
    num_restored_tokens: int = 0
    num_remote_tokens: int = 0
    num_rejected_predicted: int = 0  # so far: the predicted drafts the model did not keep
    queue_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not self.drafted:  # none said: none was a draft
            self.drafted = [False] * len(self.token_ids)
        if not self.predicted:
            self.predicted = [False] * len(self.token_ids)

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(frozen=True)
class Abort:
    request_id: int


Command = Request | Abort | LoadResult | None  # None only wakes the thread up
Publish = Callable[[list[EngineOutput]], None]


def output_of(
    request: Request,
    token_ids: list[int],
    logprobs: list[TokenLogprob],
    drafted: list[bool] | None = None,
    predicted: list[bool] | None = None,
) -> EngineOutput:
    """A request's new tokens, with its finish reason (if it finished) and what its first scheduling said."""
    scheduled = request.first_scheduled_time
    return EngineOutput(
        request.id,
        token_ids,
        logprobs,
        drafted or [],
        predicted or [],
        finish_reason=request.finish_reason,
        num_cached_tokens=request.num_cached_tokens,
        num_restored_tokens=request.num_restored_tokens,
        num_remote_tokens=request.num_remote_tokens,
        num_rejected_predicted=request.num_rejected_predicted,
        queue_seconds=(scheduled - request.arrival_time) if scheduled is not None else 0.0,
    )


@dataclass(frozen=True)
class Progress:
    """A request's counts before a step's update: what the step added is measured from them."""

    num_output_tokens: int
    num_accepted_drafts: int
    num_accepted_predicted: int

    @classmethod
    def of(cls, request: Request) -> Progress:
        return cls(request.num_output_tokens, request.num_accepted_drafts, request.num_accepted_predicted)


def step_output(request: Request, before: Progress, logprobs: list[TokenLogprob | None]) -> EngineOutput:
    """What one step added to a request since before: its new tokens (a stop inside a run drops the tokens after
    it), their logprobs (of the step's run) and which of them were kept drafts. A verify step's run is its kept
    drafts (the predicted ones first), then the model's own token."""
    new = request.output_token_ids[before.num_output_tokens :]
    kept = [lp for lp in logprobs[: len(new)] if lp is not None]
    num_drafted = request.num_accepted_drafts - before.num_accepted_drafts
    num_predicted = request.num_accepted_predicted - before.num_accepted_predicted
    return output_of(request, new, kept, _first(num_drafted, len(new)), _first(num_predicted, len(new)))


def _first(num_true: int, length: int) -> list[bool]:
    return [True] * num_true + [False] * (length - num_true)


def error_of(request: Request, error: ServiceError) -> EngineOutput:
    """A request's last output when it fails."""
    out = output_of(request, [], [])
    out.finish_reason, out.error = None, error
    return out


def coalesce(out: EngineOutput, pending: asyncio.Queue[EngineOutput]) -> list[EngineOutput]:
    """This output and those already waiting behind it, folded into one per request (in the order of their first
    output): a consumer that fell behind (a slow client, a busy event loop) catches up with one output per
    candidate, and so one stream message each, instead of one per step. An error replaces what came before it;
    what comes after a request's last output is dropped."""
    folded: dict[int, EngineOutput] = {out.request_id: out}
    while not pending.empty():
        later = pending.get_nowait()
        earlier = folded.get(later.request_id)
        if earlier is None or later.error is not None:
            folded[later.request_id] = later if earlier is None or not earlier.final else earlier
        elif not earlier.final:
            folded[later.request_id] = replace(
                later,
                token_ids=earlier.token_ids + later.token_ids,
                logprobs=earlier.logprobs + later.logprobs,
                drafted=earlier.drafted + later.drafted,
                predicted=earlier.predicted + later.predicted,
            )
    return list(folded.values())
