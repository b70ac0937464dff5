"""The engine: one thread that steps the model, and an asyncio API that streams results.

The engine thread alone touches the scheduler, the KV cache and the runner. Callers talk to it
through a command queue; results go back once per step through each caller's event loop, where
detokenization and stop strings are handled, off the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from service.core.detokenizer import IncrementalDetokenizer
from service.core.kv_cache import KVCacheManager
from service.core.outputs import FinishReason, RequestOutput, Timings, TokenLogprob, Usage
from service.core.params import SamplingParams
from service.core.request import Request
from service.core.sampler import sample
from service.core.scheduler import Scheduler, SchedulerConfig, StepPlan
from service.errors import DeadlineExceeded, EngineFailure, InvalidArgument, QueueFull, ServiceError, Unavailable
from service.runner import ModelRunner, RunnerConfig, StepInput
from service.tokenizer import Tokenizer, read_json

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    kv_cache_gb: float = 1.0
    num_threads: int | None = None  # None: CPUs this process may use
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's context, capped by what the KV cache holds
    max_queue: int = 256  # waiting requests beyond the running ones; more -> QueueFull
    batch_window_ms: float = 0.0
    kv_cache_precision: str = "u8"
    dynamic_quantization_group_size: int | None = None
    fast_single_stream: bool = False  # one-token steps on a copy compiled without dynamic quantization
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    model_dir: str
    max_model_len: int
    max_new_tokens_limit: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_threads: int
    kv_cache_bytes: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_hit_rate: float = 0.0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    last_step_seconds: float = 0.0
    tokens_per_step: float = 0.0
    num_cache_evictions: int = 0


@dataclass
class _Event:
    """What the engine thread reports for one request after a step."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: ServiceError | None = None


@dataclass
class _Live:
    request: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[_Event]


class Engine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        model_dir = Path(model_dir)
        model_config = read_json(model_dir / "config.json")
        eos = _eos_ids(read_json(model_dir / "generation_config.json"), model_config)
        self.tokenizer = Tokenizer(model_dir, eos)
        self.runner = ModelRunner(
            model_dir,
            RunnerConfig(
                kv_cache_bytes=int(config.kv_cache_gb * 2**30),
                num_threads=config.num_threads,
                kv_cache_precision=config.kv_cache_precision,
                dynamic_quantization_group_size=config.dynamic_quantization_group_size,
                single_token_model=config.fast_single_stream,
            ),
        )
        capacity = self.runner.num_blocks * self.runner.block_size
        context = int(model_config.get("max_position_embeddings", capacity))
        max_model_len = min(config.max_model_len or context, context, capacity)
        self.kv = KVCacheManager(self.runner.num_blocks, self.runner.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len), self.kv
        )
        manifest = read_json(model_dir / "manifest.json")
        self.info = ModelInfo(
            model_id=str(manifest.get("model_id") or manifest.get("source") or model_dir.name),
            model_dir=str(model_dir),
            max_model_len=max_model_len,
            max_new_tokens_limit=max_model_len,
            vocab_size=self.tokenizer.vocab_size,
            eos_token_ids=tuple(eos),
            num_threads=self.runner.num_threads,
            kv_cache_bytes=self.runner.kv_cache_bytes,
            num_kv_blocks=self.runner.num_blocks,
            block_size=self.runner.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        log.info(
            "max_model_len %d (model context %d, KV cache holds %d tokens in %d blocks)",
            max_model_len,
            context,
            capacity,
            self.runner.num_blocks,
        )
        self.vocab_limit = int(model_config.get("vocab_size", self.tokenizer.vocab_size))
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._num_submitted = 0  # caller side: requests submitted and not yet finished
        self._stats = EngineStats(num_total_blocks=self.runner.num_blocks, num_free_blocks=self.runner.num_blocks)
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._stopping = False

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Warm the model up, then start the engine thread. Returns when ready to serve."""
        self.runner.execute([StepInput([0] * 8, 0, [0], True)])
        # and a one-token step: with --fast-single-stream it runs on the second copy, whose weights the
        # CPU plugin packs on first use (about 10 s for the Qwen3-4B shape), not on a user's first token
        self.runner.execute([StepInput([0], 8, [0], True)])
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()
        self._accepting = True

    def shutdown(self) -> None:
        self._accepting = False
        self._stopping = True
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- caller API ------------------------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request. Closing the stream aborts the request."""
        request = self._make_request(prompt_token_ids, params, request_id, timeout)
        live = _Live(request, asyncio.get_running_loop(), asyncio.Queue())
        detok = IncrementalDetokenizer(
            self.tokenizer.decode, request.params.stop, request.params.include_stop_str_in_output
        )
        self._num_submitted += 1
        self._commands.put(("add", live))
        finished = False
        try:
            while not finished:
                event = _coalesce(await live.events.get(), live.events)
                if event.error is not None:
                    finished = True
                    raise event.error
                text = detok.add(event.token_ids)
                finish = event.finish_reason
                if detok.stopped and finish is None:
                    finish = FinishReason.STOP
                    self.abort(request.request_id)
                if finish is not None:
                    text += detok.flush()
                    finished = True
                yield RequestOutput(
                    request.request_id,
                    tuple(event.token_ids),
                    text,
                    tuple(event.logprobs),
                    finish,
                    event.usage or (_usage(request) if finish else None),
                    event.timings,
                )
        finally:
            self._num_submitted -= 1
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def _make_request(
        self, prompt: Sequence[int], params: SamplingParams, request_id: str | None, timeout: float | None
    ) -> Request:
        if not self._accepting:
            raise Unavailable("the engine is not serving (loading or draining)")
        if not prompt:
            raise InvalidArgument("prompt", "must not be empty")
        limit = self.info.max_model_len
        if len(prompt) >= limit:
            raise InvalidArgument(
                "prompt",
                f"prompt has {len(prompt)} tokens; the context holds {limit} (at most {limit - 1} prompt tokens)",
            )
        bad = next((t for t in prompt if not 0 <= t < self.vocab_limit), None)
        if bad is not None:
            raise InvalidArgument(
                "prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {self.vocab_limit})"
            )
        params.validate(self.info.max_new_tokens_limit)
        if timeout is not None and timeout <= 0:
            raise DeadlineExceeded("the deadline passed before the request was queued")
        if self._num_submitted >= self.config.max_num_seqs + self.config.max_queue:
            raise QueueFull(
                f"{self._num_submitted} requests in flight; the limit is "
                f"{self.config.max_num_seqs} running + {self.config.max_queue} queued"
            )
        params = replace(params, eos_token_ids=self.info.eos_token_ids)
        deadline = time.monotonic() + timeout if timeout is not None else None
        return Request(request_id or uuid.uuid4().hex, list(prompt), params, deadline)

    # -- engine thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            self._take_commands(block=not self.scheduler.has_work())
            if self._stopping:
                break
            if not self.scheduler.has_work():
                continue
            self._step()
        for request_id in list(self._live):
            self._fail(request_id, Unavailable("the server is shutting down"))

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        added = self._apply(command)
        while True:
            try:
                added |= self._apply(self._commands.get_nowait())
            except queue.Empty:
                break
        if added and self.config.batch_window_ms > 0 and not self.scheduler.running:
            time.sleep(self.config.batch_window_ms / 1000)  # gather a burst of arrivals into one step
            self._take_commands(block=False)
        self._update_stats()

    def _apply(self, command: tuple[str, object]) -> bool:
        kind, payload = command
        if kind == "add":
            assert isinstance(payload, _Live)
            self._live[payload.request.request_id] = payload
            self.scheduler.add(payload.request)
            return True
        if kind == "abort":
            assert isinstance(payload, str)
            live = self._live.pop(payload, None)
            if live is not None:
                self.scheduler.finish(live.request)
                self._send({payload: (live, _Event(finish_reason=FinishReason.ABORT, usage=_usage(live.request)))})
        return False

    def _step(self) -> None:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        out: dict[str, tuple[_Live, _Event]] = {}
        for request in plan.expired:
            live = self._live.pop(request.request_id)
            out[request.request_id] = (live, _Event(error=DeadlineExceeded("the request's deadline passed")))
        if plan.chunks:
            try:
                self._run(plan, out)
            except Exception as exc:  # a failed step fails its requests, not the engine
                log.exception("engine step failed")
                for chunk in plan.chunks:
                    self._fail(chunk.request.request_id, EngineFailure(f"the model step failed: {exc}"))
        self._update_stats(plan, time.perf_counter() - started)  # before sending: callers see fresh stats
        self._send(out)

    def _run(self, plan: StepPlan, out: dict[str, tuple[_Live, _Event]]) -> None:
        logits = self.runner.execute(
            [
                StepInput(c.request.all_token_ids[c.start : c.start + c.num_tokens], c.start, c.block_ids, c.sample)
                for c in plan.chunks
            ]
        )
        self.scheduler.complete(plan)
        sampled = [c.request for c in plan.chunks if c.sample]
        result = sample(logits, sampled)
        now = time.monotonic()
        for request, token_id, logprob in zip(sampled, result.token_ids, result.logprobs, strict=True):
            live = self._live[request.request_id]
            request.append_token(token_id)
            if request.first_token_time is None:
                request.first_token_time = now
            event = _Event([token_id], [logprob] if logprob else [], self._finish_reason(request, token_id))
            if event.finish_reason is not None:
                self.scheduler.finish(request)
                self._live.pop(request.request_id)
                event.usage = _usage(request)
                event.timings = _timings(request, now)
            out[request.request_id] = (live, event)

    def _finish_reason(self, request: Request, token_id: int) -> FinishReason | None:
        p = request.params
        if token_id in p.stop_token_ids or (token_id in p.eos_token_ids and not p.ignore_eos):
            return FinishReason.STOP
        if request.num_output_tokens >= p.max_new_tokens or request.num_tokens >= self.scheduler.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _fail(self, request_id: str, error: ServiceError) -> None:
        live = self._live.pop(request_id, None)
        if live is not None:
            self.scheduler.finish(live.request)
            self._send({request_id: (live, _Event(error=error))})

    def _send(self, out: dict[str, tuple[_Live, _Event]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Live, _Event]]] = {}
        for live, event in out.values():
            by_loop.setdefault(live.loop, []).append((live, event))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed; nobody is listening
                loop.call_soon_threadsafe(_deliver, items)

    def _update_stats(self, plan: StepPlan | None = None, seconds: float | None = None) -> None:
        """Publish a fresh snapshot; callers on other threads read it without locks."""
        s = self._stats
        chunks = plan.chunks if plan else []
        generated = sum(1 for c in chunks if c.sample)
        prompt = sum(c.num_tokens for c in chunks if c.start < c.request.num_prompt_tokens)
        self._stats = EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=self.kv.usage,
            num_free_blocks=self.kv.pool.num_free,
            num_total_blocks=self.kv.pool.num_blocks,
            prefix_hit_rate=self.kv.hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=s.num_prompt_tokens + prompt,
            num_generated_tokens=s.num_generated_tokens + generated,
            num_steps=s.num_steps + (plan is not None),
            last_step_seconds=s.last_step_seconds if seconds is None else seconds,
            tokens_per_step=float(plan.num_tokens) if plan else s.tokens_per_step,
            num_cache_evictions=self.kv.pool.num_evictions,
        )


def _coalesce(event: _Event, pending: asyncio.Queue[_Event]) -> _Event:
    """Fold the events already waiting behind this one into it: a consumer that fell behind (a slow client,
    a busy event loop) catches up with one output, and so one stream message, instead of one per step."""
    while event.error is None and event.finish_reason is None and not pending.empty():
        later = pending.get_nowait()
        if later.error is not None:
            return later
        event = replace(later, token_ids=event.token_ids + later.token_ids, logprobs=event.logprobs + later.logprobs)
    return event


def _deliver(items: list[tuple[_Live, _Event]]) -> None:
    for live, event in items:
        live.events.put_nowait(event)


def _usage(request: Request) -> Usage:
    return Usage(request.num_prompt_tokens, request.num_output_tokens, request.num_cached_tokens)


def _timings(request: Request, now: float) -> Timings:
    start = request.arrival_time
    first_token = request.first_token_time or now
    return Timings(
        queue=(request.first_scheduled_time or now) - start,
        ttft=first_token - start,
        decode=now - first_token,
        total=now - start,
    )


def _eos_ids(generation_config: dict, model_config: dict) -> list[int]:
    eos = generation_config.get("eos_token_id", model_config.get("eos_token_id"))
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
