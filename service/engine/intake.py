"""What a call asks for, checked and made into the engine thread's requests: every client-supplied value is
validated here, with the field named, before anything is submitted.

A call for n candidates becomes n requests: candidate i draws with seed + i, and the later ones follow the
first (the leader, whose prompt blocks they read). A response format, tools and a reasoning block become one
grammar matcher per candidate.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, replace

from service.core.config import EngineConfig
from service.core.grammar import GrammarCompiler, Matcher, ResponseFormat
from service.core.reasoning import after_reasoning, starts_inside
from service.core.request import (
    Request,
    check_cache_salt,
    check_label,
    check_prediction,
    check_priority,
    check_prompt,
)
from service.core.spec import Prediction
from service.core.stats import ModelInfo
from service.core.tools import CLOSE_TAG, OPEN_TAG
from service.engine.protocol import GenerationRequest
from service.engine.tokenizer import Tokenizer
from service.errors import DeadlineExceeded, InvalidArgument, QueueFull, Unavailable

SEEDS = 1 << 64  # the contract's uint64 seeds: candidate i's seed + i wraps around


@dataclass(frozen=True)
class Shape:
    """What the reply's text must follow: a matcher per candidate (None: free text), the tool-call tokens
    (with active tools) and the reasoning block's tokens (a reply that may reason) and whether the prompt
    already opened it."""

    matchers: list[Matcher | None]
    call_ids: tuple[int, int] | None
    think_ids: tuple[int, int] | None
    inside: bool


class Intake:
    def __init__(self, config: EngineConfig, info: ModelInfo, tokenizer: Tokenizer, grammars: GrammarCompiler) -> None:
        self.config, self.info, self.tokenizer, self.grammars = config, info, tokenizer, grammars
        self._ids = itertools.count(1)  # request ids: the engine's keys, never the caller's label

    def _check_n(self, n: int) -> None:
        if not 1 <= n <= self.config.max_n:
            raise InvalidArgument("n", f"must be in [1, {self.config.max_n}] (the server's --max-n), got {n}")
        held, limits = self.config.max_num_seqs + self.config.max_queue, "--max-num-seqs + --max-queue"
        queued = self.config.max_queued_per_tenant
        if queued is not None and self.config.max_num_seqs + queued < held:
            held, limits = self.config.max_num_seqs + queued, "--max-num-seqs + --max-queued-per-tenant"
        if n > held:  # never served, however long the client retried: not a full queue
            raise InvalidArgument("n", f"must be at most {held} here: the server holds no more requests ({limits})")

    async def shape(self, asked: GenerationRequest) -> Shape:
        """n checked, then the reply's grammar, compiled off the caller's event loop (a large schema takes
        milliseconds) once for each of the n candidates: a response format, or the tools' calls; after the
        reasoning block when the reply may reason."""
        self._check_n(asked.n)
        response_format, call_ids = asked.response_format, None
        if asked.tools is not None and asked.tools.active:
            if response_format is not None:
                raise InvalidArgument("response_format", "cannot be combined with tools")
            call_ids = self.tool_call_ids()
            response_format = asked.tools.response_format(*call_ids)
        checks = asked.tools.schemas() if call_ids is not None and asked.tools is not None else []
        think_ids = self.tokenizer.think_ids if asked.reasoning else None
        inside = think_ids is not None and starts_inside(asked.prompt_token_ids, *think_ids)
        if think_ids is not None and response_format is not None:
            # the format alone first, so that its errors are its own; then with the reasoning before it
            checks = [response_format] if call_ids is None else checks
            response_format = after_reasoning(response_format, *think_ids, inside)
        matchers: list[Matcher | None] = [None] * asked.n
        if response_format is not None:  # one each: a matcher follows its own reply (the grammar is compiled once)
            fmt = response_format
            matchers = await asyncio.to_thread(lambda: [self._matcher(fmt, checks) for _ in range(asked.n)])
        return Shape(matchers, call_ids, think_ids, inside)

    def _matcher(self, fmt: ResponseFormat, parts: list[ResponseFormat]) -> Matcher:
        """The format's matcher. Where a grammar built from parts (each tool's schema, a format after reasoning)
        does not compile, each part is compiled alone, so that the error names the part at fault (the tool whose
        parameters are wrong) and says what is wrong with it rather than with the whole grammar."""
        try:
            return self.grammars.matcher(fmt)
        except InvalidArgument:
            for part in parts:
                self.grammars.compile(part)
            raise

    def tool_call_ids(self) -> tuple[int, int]:
        """The tokens that open and close a tool call in the model's format (Qwen3's)."""
        self.tokenizer.check_tools()
        ids = self.tokenizer.token_to_id(OPEN_TAG), self.tokenizer.token_to_id(CLOSE_TAG)
        assert ids[0] is not None and ids[1] is not None  # check_tools refuses a model without them
        return ids[0], ids[1]

    def requests(
        self,
        asked: GenerationRequest,
        matchers: list[Matcher | None],
        *,
        accepting: bool,
        in_flight: int,
        tenant_in_flight: int,
    ) -> list[Request]:
        """Validate everything a caller sent, given whether the engine takes requests and how many are in flight
        (all, and the caller's tenant's); the requests (one per candidate, with its matcher) are the engine
        thread's once submitted."""
        prompt, params, label, timeout = asked.prompt_token_ids, asked.params, asked.request_id, asked.timeout
        if label is not None:
            check_label(label)
        check_cache_salt(asked.cache_salt)
        check_priority(asked.priority)
        if not accepting:
            raise Unavailable("the engine is not serving (loading, stopped or draining)")
        check_prompt(prompt, asked.prompt_field, self.info.max_model_len, self.info.vocab_size)
        check_prediction(asked.prediction, self.info.max_model_len, self.info.vocab_size)
        params.validate(self.info.max_new_tokens_limit, self.info.vocab_size)
        if timeout is not None and timeout <= 0:
            raise DeadlineExceeded("the deadline passed before the request was queued")
        limit = self.config.max_num_seqs + self.config.max_queue
        if in_flight + len(matchers) > limit:
            raise QueueFull(
                f"{in_flight} requests in flight and {len(matchers)} asked for; the limit is "
                f"{self.config.max_num_seqs} running + {self.config.max_queue} queued"
            )
        self._check_tenant_queue(asked.tenant.name, tenant_in_flight, len(matchers))
        params = replace(params, eos_token_ids=self.info.eos_token_ids)
        deadline = time.monotonic() + timeout if timeout is not None else None
        label = label or uuid.uuid4().hex
        requests: list[Request] = []
        for i, matcher in enumerate(matchers):
            seed = None if params.seed is None else (params.seed + i) % SEEDS
            request = Request(
                next(self._ids),
                list(prompt),
                replace(params, seed=seed),
                label,
                cache_salt=asked.tenant.cache_salt(asked.cache_salt),
                tenant=asked.tenant.name,
                tenant_weight=asked.tenant.weight,
                priority=asked.priority,
                deadline=deadline,
                matcher=matcher,
                leader=requests[0] if requests else None,
                prediction=Prediction(asked.prediction, len(prompt)) if asked.prediction else None,
            )
            requests.append(request)
        return requests

    def _check_tenant_queue(self, tenant: str, in_flight: int, asked: int) -> None:
        """QueueFull when the tenant's requests in flight and the `asked` ones (n candidates) would pass what
        --max-queued-per-tenant allows: one tenant cannot fill the queue that every tenant shares."""
        queued = self.config.max_queued_per_tenant
        if queued is not None and in_flight + asked > self.config.max_num_seqs + queued:
            raise QueueFull(
                f"tenant {tenant} has {in_flight} requests in flight and {asked} asked for; the limit "
                f"per tenant is {self.config.max_num_seqs} running + {queued} queued (max_queued_per_tenant)"
            )
