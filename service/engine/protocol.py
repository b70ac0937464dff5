"""What a front end asks of an engine: one request type, and the EngineClient protocol that the engine (and a
test's fake engine) satisfies. Fronts build a GenerationRequest from their wire format and stream outputs back."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from service.core.grammar import ResponseFormat
from service.core.outputs import RequestOutput
from service.core.params import SamplingParams
from service.core.request import DEFAULT_TENANT, Tenant
from service.core.stats import EngineStats, ModelInfo
from service.core.tools import Tools
from service.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class GenerationRequest:
    """One request as a caller sends it. prompt_field names the input the client sent (for errors); requests
    with different cache_salt never share cached KV blocks; a response_format constrains the reply to its
    grammar; active tools (already rendered into the prompt) constrain the reply's calls and come back parsed.
    request_id is the caller's label (a new one when None); timeout is in seconds from now. reasoning: the reply
    may open with a reasoning block (serving.prompt.reasons), returned apart from its text. n candidates are
    generated for the one prompt, candidate i with seed + i; their outputs carry their index. tenant: who it is
    served for (fair admission, the per-tenant queue limit, the tenant's own prefix cache); priority orders it
    among its tenant's waiting requests, lower first. prediction: the reply the client expects, as token ids
    (OpenAI's predicted output): drafts verified exactly, so it changes how fast the reply comes, never the
    reply."""

    prompt_token_ids: Sequence[int]
    params: SamplingParams
    request_id: str | None = None
    timeout: float | None = None
    prompt_field: str = "prompt_token_ids"
    cache_salt: str = ""
    response_format: ResponseFormat | None = None
    tools: Tools | None = None
    reasoning: bool = False
    n: int = 1
    tenant: Tenant = DEFAULT_TENANT
    priority: int = 0
    prediction: Sequence[int] = ()


class EngineClient(Protocol):
    """The face of an engine that the serving layer and the fronts use."""

    info: ModelInfo
    tokenizer: Tokenizer

    @property
    def alive(self) -> bool: ...

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    def on_death(self, listener: Callable[[], None]) -> None: ...

    def stats(self) -> EngineStats: ...

    def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        """An async generator: closing it (aclose) before the last output aborts the request."""
        ...
