"""What the engine streams back to a caller, free of any wire format."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace


class FinishReason(enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller
    TOOL_CALLS = "tool_calls"  # the reply ended with tool calls (set by the front, which parses them)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int  # not computed: found in the RAM prefix cache, restored from disk or fetched remotely
    disk_prompt_tokens: int = 0  # of the cached ones, those restored from the disk tier
    accepted_draft_tokens: int = 0  # of the completion tokens, speculative drafts the model kept
    reasoning_tokens: int = 0  # of the completion tokens, those of the reasoning block (its tags included)
    # n > 1: of the prompt's tokens in all candidates, those the later candidates read from the first one's blocks
    shared_prompt_tokens: int = 0
    remote_prompt_tokens: int = 0  # of the cached ones, those fetched from the remote tier (the fleet's store)
    accepted_prediction_tokens: int = 0  # of those, drafts from the request's predicted output
    rejected_prediction_tokens: int = 0  # drafts from the predicted output that the model did not keep


@dataclass(frozen=True)
class Timings:
    """Seconds. queue: submit -> first scheduled; ttft: submit -> first token; decode: first -> last token."""

    queue: float
    ttft: float
    decode: float
    total: float


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class ToolCallDelta:
    """An increment of the reply's call number index: the first has id and name, later ones a fragment of
    arguments (the fragments of one index concatenate to its arguments)."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class RequestOutput:
    """One streamed chunk: new token ids and the text they completed. The last chunk has finish_reason."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()  # increments of the reply's tool calls (requests with tools)
    reasoning: str = ""  # the reasoning these tokens completed (requests whose replies may reason)
    index: int = 0  # the candidate (n > 1) this output belongs to

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def combined_usage(usages: Sequence[Usage]) -> Usage:
    """The usage of the candidates of one request (by index), as OpenAI counts n > 1: the prompt once, with the
    cached tokens of the first candidate (what the prompt reused from earlier requests); completion tokens,
    accepted drafts, reasoning and prediction tokens summed; shared_prompt_tokens: the prompt tokens the later
    candidates did not compute."""
    first = usages[0]
    return Usage(
        first.prompt_tokens,
        sum(u.completion_tokens for u in usages),
        first.cached_prompt_tokens,
        first.disk_prompt_tokens,
        sum(u.accepted_draft_tokens for u in usages),
        sum(u.reasoning_tokens for u in usages),
        shared_prompt_tokens=sum(u.cached_prompt_tokens for u in usages[1:]),
        remote_prompt_tokens=first.remote_prompt_tokens,
        accepted_prediction_tokens=sum(u.accepted_prediction_tokens for u in usages),
        rejected_prediction_tokens=sum(u.rejected_prediction_tokens for u in usages),
    )


def summary(finals: Sequence[RequestOutput]) -> RequestOutput:
    """One request's last outputs, one per candidate in the order they finished, as one: the last, with the
    candidates' combined usage (for logs and metrics)."""
    last = finals[-1]
    usages = [o.usage for o in sorted(finals, key=lambda o: o.index) if o.usage is not None]
    if len(finals) == 1 or len(usages) != len(finals):
        return last
    return replace(last, usage=combined_usage(usages))
