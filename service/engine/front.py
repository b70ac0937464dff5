"""The engine's async front: takes a call's requests (checked and made by the intake), streams their outputs
to callers on any event loop (detokenized, stop strings applied), and aborts what callers abandon.

Each request gets a server-generated id, the key of its stream here and of its state on the engine
thread; the caller's request_id is only a label. A call for n candidates is n requests on one stream: the
first computes the prompt, the others read its KV blocks (the scheduler's leader rule), and closing the
stream aborts every one still running. Outputs come back from the engine thread once per step
and are handed to each caller's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from pathlib import Path

from service.core.config import EngineConfig
from service.core.grammar import GrammarCompiler
from service.core.outputs import RequestOutput
from service.core.reasoning import ReasoningSplitter
from service.core.stats import EngineStats, ModelInfo
from service.engine.core import EngineCore, EngineOutput
from service.engine.intake import Intake
from service.engine.model_files import ModelFiles
from service.engine.outputs import coalesce
from service.engine.protocol import GenerationRequest
from service.engine.reply import ReplyAssembler
from service.engine.tokenizer import Tokenizer
from service.errors import Unavailable

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
        self.core = EngineCore(self.model, config, self._publish, self._core_died, self.tokenizer.turn_marks())
        self.info: ModelInfo = self.core.info
        if self.tokenizer.max_token_id >= self.info.vocab_size:
            raise ValueError(
                f"the tokenizer in {model_dir} has token ids up to {self.tokenizer.max_token_id}, outside the "
                f"model's vocabulary of {self.info.vocab_size}; convert the model again with `python -m convert`"
            )
        grammars = GrammarCompiler(
            (self.model.path / "tokenizer.json").read_text(), self.info.vocab_size, self.info.eos_token_ids
        )
        self.intake = Intake(config, self.info, self.tokenizer, grammars)
        self._streams: dict[int, _Stream] = {}  # by request id; written on callers' loops, read by the engine
        self._in_flight: Counter[str] = Counter()  # requests with a stream, by tenant
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
        shape = await self.intake.shape(asked)
        requests = self.intake.requests(
            asked,
            shape.matchers,
            accepting=self._accepting,
            in_flight=len(self._streams),
            tenant_in_flight=self._in_flight[asked.tenant.name],
        )
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
                shape.call_ids,
                index,
                ReasoningSplitter(self.tokenizer.decode, *shape.think_ids, shape.inside) if shape.think_ids else None,
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
