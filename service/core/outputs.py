"""What the engine streams back to a caller, free of any wire format."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller
    TOOL_CALLS = "tool_calls"  # the reply ended with tool calls (set by the front, which parses them)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int  # not computed: found in the RAM prefix cache or restored from disk
    disk_prompt_tokens: int = 0  # of the cached ones, those restored from the disk tier
    accepted_draft_tokens: int = 0  # of the completion tokens, speculative drafts the model kept
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
