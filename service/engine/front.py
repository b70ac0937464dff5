"""The engine's async front: validates requests, streams their outputs to callers on any event loop
(detokenized, stop strings applied), and aborts what callers abandon.

Each request gets a server-generated id, the key of its stream here and of its state on the engine
thread; the caller's request_id is only a label. Outputs come back from the engine thread once per step
and are handed to each caller's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from pathlib import Path

from service.core.config import EngineConfig
from service.core.grammar import GrammarCompiler, Matcher, ResponseFormat
from service.core.outputs import RequestOutput
from service.core.request import Request, check_cache_salt, check_label, check_prediction, check_prompt
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
        """Stream the outputs of one request (see GenerationRequest); the last has finish_reason, usage and
        timings. Closing the stream early aborts the request. A response_format's grammar is compiled off the
        caller's event loop (a large schema takes milliseconds). With active tools the reply's calls come back
        parsed, as increments in each output's tool_calls."""
        response_format, call_ids = asked.response_format, None
        if asked.tools is not None and asked.tools.active:
            if response_format is not None:
                raise InvalidArgument("response_format", "cannot be combined with tools")
            call_ids = self.tool_call_ids()
            response_format = asked.tools.response_format(*call_ids)
        tool_schemas = asked.tools.schemas() if call_ids is not None and asked.tools is not None else []
        matcher = None
        if response_format is not None:
            matcher = await asyncio.to_thread(self._matcher, response_format, tool_schemas)
        request = self._make_request(asked, matcher)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request.id] = stream
        reply = ReplyAssembler(
            request.label,
            request.num_prompt_tokens,
            request.arrival_time,
            asked.params,
            self.tokenizer.decode,
            call_ids,
        )
        ended = False  # the engine is done with the request: finished, failed or told to stop
        try:
            if not self.core.alive:  # checked after registering: a death from now on reaches this stream
                raise Unavailable("the engine has stopped")
            self.core.submit(request)
            while not ended:
                out = coalesce(await stream.outputs.get(), stream.outputs)
                if out.error is not None:
                    ended = True
                    raise out.error
                output = reply.add(out)
                if reply.stopped_by_text:
                    self.core.abort(request.id)  # the engine would go on past the stop string
                ended = reply.finished
                yield output
        finally:
            del self._streams[request.id]
            if not ended:
                self.core.abort(request.id)

    def _matcher(self, fmt: ResponseFormat, tool_schemas: list[ResponseFormat]) -> Matcher:
        """The format's matcher. Where a reply with tools does not compile, each tool's schema is compiled alone,
        so that the error names the tool whose parameters are at fault rather than the whole grammar."""
        try:
            return self.grammars.matcher(fmt)
        except InvalidArgument:
            for schema in tool_schemas:
                self.grammars.compile(schema)
            raise

    def tool_call_ids(self) -> tuple[int, int]:
        """The tokens that open and close a tool call in the model's format (Qwen3's)."""
        self.tokenizer.check_tools()
        ids = self.tokenizer.token_to_id(OPEN_TAG), self.tokenizer.token_to_id(CLOSE_TAG)
        assert ids[0] is not None and ids[1] is not None  # check_tools refuses a model without them
        return ids[0], ids[1]

    def _make_request(self, asked: GenerationRequest, matcher: Matcher | None) -> Request:
        """Validate everything a caller sent; the request is the engine thread's once submitted."""
        prompt, params, label, timeout = asked.prompt_token_ids, asked.params, asked.request_id, asked.timeout
        prompt_field, cache_salt = asked.prompt_field, asked.cache_salt
        if label is not None:
            check_label(label)
        check_cache_salt(cache_salt)
        if not self._accepting:
            raise Unavailable("the engine is not serving (loading, stopped or draining)")
        check_prompt(prompt, prompt_field, self.info.max_model_len, self.info.vocab_size)
        check_prediction(asked.prediction, self.info.max_model_len, self.info.vocab_size)
        params.validate(self.info.max_new_tokens_limit, self.info.vocab_size)
        if timeout is not None and timeout <= 0:
            raise DeadlineExceeded("the deadline passed before the request was queued")
        limit = self.config.max_num_seqs + self.config.max_queue
        if len(self._streams) >= limit:
            raise QueueFull(
                f"{len(self._streams)} requests in flight; the limit is "
                f"{self.config.max_num_seqs} running + {self.config.max_queue} queued"
            )
        params = replace(params, eos_token_ids=self.info.eos_token_ids)
        deadline = time.monotonic() + timeout if timeout is not None else None
        return Request(
            next(self._ids),
            list(prompt),
            params,
            label or uuid.uuid4().hex,
            cache_salt=cache_salt,
            deadline=deadline,
            matcher=matcher,
            prediction=Prediction(asked.prediction, len(prompt)) if asked.prediction else None,
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


def coalesce(out: EngineOutput, pending: asyncio.Queue[EngineOutput]) -> EngineOutput:
    """Fold the outputs already waiting behind this one into it: a consumer that fell behind (a slow client,
    a busy event loop) catches up with one output, and so one stream message, instead of one per step."""
    while not out.final and not pending.empty():
        later = pending.get_nowait()
        if later.error is not None:
            return later
        out = replace(
            later,
            token_ids=out.token_ids + later.token_ids,
            logprobs=out.logprobs + later.logprobs,
            drafted=out.drafted + later.drafted,
            predicted=out.predicted + later.predicted,
        )
    return out
