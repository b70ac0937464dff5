"""The engine's async front: validates requests, streams their outputs to callers on any event loop
(detokenized, stop strings applied), and aborts what callers abandon.

Each request gets a server-generated id, the key of its stream here and of its state on the engine
thread; the caller's request_id is only a label. A call for n candidates is n requests on one stream: the
first computes the prompt, the others read its KV blocks (the scheduler's leader rule), and closing the
stream aborts every one still running. Outputs come back from the engine thread once per step
and are handed to each caller's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from pathlib import Path

from service.core.config import EngineConfig
from service.core.grammar import GrammarCompiler, Matcher, ResponseFormat
from service.core.outputs import RequestOutput
from service.core.reasoning import ReasoningSplitter, after_reasoning, starts_inside
from service.core.request import (
    Request,
    check_cache_salt,
    check_label,
    check_prediction,
    check_priority,
    check_prompt,
)
from service.core.spec import Prediction
from service.core.stats import EngineStats, ModelInfo
from service.core.tools import CLOSE_TAG, OPEN_TAG
from service.engine.core import EngineCore, EngineOutput
from service.engine.model_files import ModelFiles
from service.engine.protocol import GenerationRequest
from service.engine.reply import ReplyAssembler
from service.engine.tokenizer import Tokenizer
from service.errors import DeadlineExceeded, InvalidArgument, QueueFull, Unavailable

log = logging.getLogger(__name__)

SEEDS = 1 << 64  # the contract's uint64 seeds: candidate i's seed + i wraps around


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[EngineOutput]


class Engine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        problems = config.problems()  # the CLI checks them first, naming the flags; library callers get them here
        if problems:
            raise ValueError("; ".join(problems))
        self.model = ModelFiles.read(model_dir)
        self.tokenizer = Tokenizer(self.model.path, Path(config.chat_template) if config.chat_template else None)
        self.core = EngineCore(self.model, config, self._publish, self._core_died)
        self.info: ModelInfo = self.core.info
        if self.tokenizer.max_token_id >= self.info.vocab_size:
            raise ValueError(
                f"the tokenizer in {model_dir} has token ids up to {self.tokenizer.max_token_id}, outside the "
                f"model's vocabulary of {self.info.vocab_size}; convert the model again with `python -m convert`"
            )
        self.grammars = GrammarCompiler(
            (self.model.path / "tokenizer.json").read_text(), self.info.vocab_size, self.info.eos_token_ids
        )
        self._streams: dict[int, _Stream] = {}  # by request id; written on callers' loops, read by the engine
        self._in_flight: Counter[str] = Counter()  # requests with a stream, by tenant
        self._ids = itertools.count(1)
        self._death_listeners: list[Callable[[], None]] = []
        self.died = False
        self._accepting = False

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Warm the model up and start the engine thread. Returns when ready to serve."""
        self.core.start()
        self._accepting = True

    def shutdown(self) -> None:
        self._accepting = False
        self.core.stop()
        # a request submitted while the engine thread made its last drain has nobody left to answer it
        self._fail_streams(Unavailable("the server is shutting down"))

    @property
    def alive(self) -> bool:
        return self.core.alive

    def on_death(self, listener: Callable[[], None]) -> None:
        """Call listener (on the engine thread) when the engine thread dies; at once if it already has."""
        self._death_listeners.append(listener)
        if self.died:
            listener()

    def stats(self) -> EngineStats:
        return self.core.stats()

    # -- requests --------------------------------------------------------------------------------------
    async def generate(self, asked: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        """Stream the outputs of one request (see GenerationRequest); each candidate's last has finish_reason,
        usage and timings, and the stream ends after the last candidate's. Closing the stream early aborts every
        candidate still running. A response_format's grammar is compiled off the caller's event loop (a large
        schema takes milliseconds). With active tools the reply's calls come back parsed, as increments in each
        output's tool_calls. A reply that may reason (asked.reasoning) has its reasoning block returned apart, in
        each output's reasoning, and a format applies after the block."""
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
        requests = self._make_requests(asked, matchers)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        replies = {}
        for index, request in enumerate(requests):
            self._streams[request.id] = stream
            self._in_flight[request.tenant] += 1
            replies[request.id] = ReplyAssembler(
                request.label,
                request.num_prompt_tokens,
                request.arrival_time,
                asked.params,
                self.tokenizer.decode,
                call_ids,
                index,
                ReasoningSplitter(self.tokenizer.decode, *think_ids, inside) if think_ids is not None else None,
            )
        running = set(replies)  # the candidates the engine is not done with (finished, failed or told to stop)
        try:
            if not self.core.alive:  # checked after registering: a death from now on reaches this stream
                raise Unavailable("the engine has stopped")
            for request in requests:  # in order: the first is the leader, admitted first
                self.core.submit(request)
            while running:
                for out in coalesce(await stream.outputs.get(), stream.outputs):
                    if out.request_id not in running:  # what an abort of a candidate stopped by text sends
                        continue
                    if out.error is not None:
                        running.discard(out.request_id)
                        raise out.error
                    reply = replies[out.request_id]
                    output = reply.add(out)
                    if reply.stopped_by_text:
                        self.core.abort(out.request_id)  # the engine would go on past the stop string
                    if reply.finished:
                        running.discard(out.request_id)
                    yield output
        finally:
            for request in requests:
                del self._streams[request.id]
                self._in_flight[request.tenant] -= 1
                if not self._in_flight[request.tenant]:
                    del self._in_flight[request.tenant]
            for request_id in running:
                self.core.abort(request_id)

    def _check_n(self, n: int) -> None:
        if not 1 <= n <= self.config.max_n:
            raise InvalidArgument("n", f"must be in [1, {self.config.max_n}] (the server's --max-n), got {n}")
        held = self.config.max_num_seqs + self.config.max_queue
        if n > held:  # never served, however long the client retried: not a full queue
            limits = "--max-num-seqs + --max-queue"
            raise InvalidArgument("n", f"must be at most {held} here: the server holds no more requests ({limits})")

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

    def _make_requests(self, asked: GenerationRequest, matchers: list[Matcher | None]) -> list[Request]:
        """Validate everything a caller sent; the requests (one per candidate, with its matcher) are the engine
        thread's once submitted. Candidate i draws with seed + i; the later ones follow the first (leader)."""
        prompt, params, label, timeout = asked.prompt_token_ids, asked.params, asked.request_id, asked.timeout
        prompt_field, cache_salt = asked.prompt_field, asked.cache_salt
        if label is not None:
            check_label(label)
        check_cache_salt(cache_salt)
        check_priority(asked.priority)
        if not self._accepting:
            raise Unavailable("the engine is not serving (loading, stopped or draining)")
        check_prompt(prompt, prompt_field, self.info.max_model_len, self.info.vocab_size)
        check_prediction(asked.prediction, self.info.max_model_len, self.info.vocab_size)
        params.validate(self.info.max_new_tokens_limit, self.info.vocab_size)
        if timeout is not None and timeout <= 0:
            raise DeadlineExceeded("the deadline passed before the request was queued")
        limit = self.config.max_num_seqs + self.config.max_queue
        if len(self._streams) + len(matchers) > limit:
            raise QueueFull(
                f"{len(self._streams)} requests in flight and {len(matchers)} asked for; the limit is "
                f"{self.config.max_num_seqs} running + {self.config.max_queue} queued"
            )
        self._check_tenant_queue(asked.tenant.name, len(matchers))
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
                cache_salt=asked.tenant.cache_salt(cache_salt),
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

    def _check_tenant_queue(self, tenant: str, asked: int) -> None:
        """QueueFull when the tenant's requests in flight and the `asked` ones (n candidates) would pass what
        --max-queued-per-tenant allows: one tenant cannot fill the queue that every tenant shares."""
        queued = self.config.max_queued_per_tenant
        if queued is not None and self._in_flight[tenant] + asked > self.config.max_num_seqs + queued:
            raise QueueFull(
                f"tenant {tenant} has {self._in_flight[tenant]} requests in flight and {asked} asked for; the limit "
                f"per tenant is {self.config.max_num_seqs} running + {queued} queued (max_queued_per_tenant)"
            )

    # -- engine thread ---------------------------------------------------------------------------------
    def _publish(self, outputs: list[EngineOutput]) -> None:
        """Hand each output to its caller's loop, one call per loop per step; outputs nobody waits for
        (the caller went away) are dropped."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, EngineOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed; nobody is listening
                loop.call_soon_threadsafe(_deliver, items)

    def _core_died(self, exc: BaseException) -> None:
        self._accepting = False
        self.died = True
        self._fail_streams(Unavailable("the engine stopped unexpectedly; retry on another replica"))
        for listener in self._death_listeners:
            try:
                listener()
            except Exception:
                log.exception("engine death listener failed")

    def _fail_streams(self, error: Unavailable) -> None:
        """End every stream still waiting with error (from any thread)."""
        self._publish([EngineOutput(request_id, error=error) for request_id in list(self._streams)])


def _deliver(items: list[tuple[_Stream, EngineOutput]]) -> None:
    for stream, out in items:
        stream.outputs.put_nowait(out)


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
