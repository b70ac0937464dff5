"""The engine thread: takes commands, steps the model, publishes each step's outputs and stats.

Only the engine thread touches the scheduler, the KV cache and the runner. Other threads call
submit(), abort() and stop(), which put a command on the queue, and stats(), which reads the last
published snapshot. The disk tier's I/O thread reports finished restores through the same queue. A
failed step fails the requests in it and nothing else; if the thread itself ever dies, `on_death` is
called so that the front can fail every caller and report unhealthy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from service.core.config import EngineConfig
from service.core.kv_cache import KVCacheManager
from service.core.outputs import FinishReason, TokenLogprob
from service.core.request import Request
from service.core.sampler import sample, verify
from service.core.scheduler import ScheduledChunk, Scheduler, StepPlan
from service.core.stats import DiskTierStats, EngineStats, ModelInfo
from service.core.step_shape import ShapeKeeper, StepShape
from service.core.step_times import StepTimes
from service.engine.disk_store import DiskStore
from service.engine.kv_tier import KVDiskTier, LoadResult
from service.engine.model_files import ModelFiles
from service.engine.runner import LARGE_STEP_TOKENS, ModelRunner, StepInput
from service.errors import DeadlineExceeded, EngineFailure, InvalidArgument, ServiceError, Unavailable

log = logging.getLogger(__name__)

MASK_TIMES_KEPT = 10_000


@dataclass
class EngineOutput:
    """What a step produced for one request: new tokens and, on its last output, a finish reason or an
    error. num_cached_tokens and queue_seconds are known from the request's first scheduling on."""

    request_id: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, or none (none asked for)
    drafted: list[bool] = field(default_factory=list)  # one per token: whether it was a draft the model kept
    finish_reason: FinishReason | None = None
    error: ServiceError | None = None
    num_cached_tokens: int = 0
    num_restored_tokens: int = 0
    queue_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not self.drafted:  # none said: none was a draft
            self.drafted = [False] * len(self.token_ids)

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(frozen=True)
class Abort:
    request_id: int


Command = Request | Abort | LoadResult | None  # None only wakes the thread up
Publish = Callable[[list[EngineOutput]], None]


class EngineCore:
    def __init__(
        self,
        model: ModelFiles,
        config: EngineConfig,
        publish: Publish,
        on_death: Callable[[BaseException], None],
    ) -> None:
        self.config = config
        self.runner = ModelRunner(model.ir, config)
        capacity = self.runner.num_blocks * self.runner.block_size
        context = model.context_length or capacity
        self.max_model_len = min(config.max_model_len or context, context, capacity)
        identity = kv_identity(model, config, self.runner.cache_format)
        self.kv = KVCacheManager(
            self.runner.num_blocks, self.runner.block_size, config.enable_prefix_caching, identity=identity
        )
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.disk_tier: KVDiskTier | None = None
        if config.kv_disk_dir:
            store = DiskStore(
                Path(config.kv_disk_dir), identity, int(config.kv_disk_gb * 2**30), config.kv_disk_ttl_seconds
            )
            self.disk_tier = KVDiskTier(store, self.runner.cache_arrays(), self._commands.put)
        # a step's cost against its tokens, for the draft rule: measured at warm-up, refitted after every step
        self.step_times = StepTimes()
        # drafts as one-token rows make a verify row a decode row, bit for bit, where decode rows are computed one
        # way: in f32 (auto runs long prompt pieces apart on its bf16 copy). In bf16 a row depends on its step's
        # size anyway, and one sequence is faster.
        self.draft_rows = config.verify_drafts == "rows" or (
            config.verify_drafts == "auto" and self.runner.rows_alike_in_every_step
        )
        self.shape_keeper = ShapeKeeper(self.step_times)
        self.num_shape_changes = 0
        self.scheduler = Scheduler(config, self.kv, self.max_model_len, disk=self.disk_tier, step_times=self.step_times)
        self.info = ModelInfo(
            model_id=model.model_id,
            model_dir=str(model.path),
            max_model_len=self.max_model_len,
            max_new_tokens_limit=self.max_model_len,
            vocab_size=self.runner.vocab_size,
            eos_token_ids=model.eos_token_ids,
            num_threads=self.runner.num_threads,
            kv_cache_bytes=self.runner.kv_cache_bytes,
            num_kv_blocks=self.runner.num_blocks,
            block_size=self.runner.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            sampling_defaults=tuple(model.sampling_defaults.items()),
        )
        log.info(
            "max_model_len %d (model context %d, KV cache holds %d tokens in %d blocks)",
            self.max_model_len,
            context,
            capacity,
            self.runner.num_blocks,
        )
        self._publish = publish
        self._on_death = on_death
        self._stats = EngineStats(num_total_blocks=self.runner.num_blocks, num_free_blocks=self.runner.num_blocks)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.num_failed_steps = 0
        # seconds spent computing grammar masks, per step that had any: benchmarks read their distribution
        self.mask_seconds: deque[float] = deque(maxlen=MASK_TIMES_KEPT)
        self._grammar_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.alive = False  # the thread runs and takes requests

    # -- any thread ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Warm the model up (checking that it computes finite logits), then start the engine thread."""
        self._check_logits()
        # with speculation off by default, requests that opt in start from StepTimes' prior and the live
        # steps (prompt chunks and decode steps differ in size) fit it: no server start pays for the warm-up
        if self.config.speculative_tokens > 0 and self.config.speculation == "auto":
            self._measure_step_times()
            log.info(
                "speculative decoding: steps take %s ms by tokens, a change of shape %.1f ms more",
                ", ".join(f"{n}: {1000 * self.step_times.seconds[(1, n)]:.1f}" for n in self.step_times.sizes[1]),
                1000 * (self.step_times.change_seconds or 0.0),
            )
            if self.step_times.draft_costs is not None:
                costs = self.step_times.draft_costs
                log.info(
                    "speculative decoding: beside other sequences, a sequence's drafts add to their rows' share "
                    "%.2f ms each per 1000 tokens of its context, plus %.2f ms and %.2f ms per 1000 tokens of it",
                    1e6 * costs.per_draft_context_token,
                    1000 * costs.per_sequence,
                    1e6 * costs.per_context_token,
                )
        if self.disk_tier is not None:
            self.disk_tier.start()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.alive = True
        self._thread.start()

    def _check_logits(self) -> None:
        """A first step on each compiled copy, from position 0 on the first blocks (no request has any yet): a
        prompt of more than LARGE_STEP_TOKENS tokens (auto's bf16 copy, where there is one), 8 of its tokens (the
        main copy) and one more token (with --fast-single-stream, the one-token copy, whose weights the CPU
        plugin packs on first use: about 10 s for the Qwen3-4B shape, not on a user's first token). A model
        whose logits are not all finite cannot serve, and would answer every request with the same token:
        f16 activations gave NaN for every logit of SmolLM2 int8 on a CPU without native f16."""
        length = min(LARGE_STEP_TOKENS + 1, self.runner.num_blocks * self.runner.block_size - 1)
        prompt = [1 + i % min(1000, self.runner.vocab_size - 1) for i in range(length)]
        blocks = list(range(-(-(length + 1) // self.runner.block_size)))
        for tokens, start in ((prompt, 0), (prompt[:8], 0), (prompt[8:9], 8)):
            logits = self.runner.execute([StepInput(tokens, start, blocks, 1)])
            if not np.isfinite(logits).all():
                raise ValueError(
                    f"the model's logits are not finite (NaN or inf) with activations in "
                    f"{self.runner.activation_precision} on this CPU: inference_precision "
                    f"{self.config.inference_precision!r} cannot serve this model here; use 'auto' or 'f32'"
                )

    def _measure_step_times(self, repeats: int = 2) -> None:
        """Give the cost table its first entries: a step of each size a request's drafts can make (1 to
        K + 1 tokens) and a few larger ones that several requests' steps reach, all their logits rows wanted
        as drafts want them, each size run repeats times after one unmeasured step (which prepares the
        kernels of its new shape). The live steps take over from there."""
        largest = min(self.step_times.max_tokens, self.config.max_num_batched_tokens)
        sizes = sorted({*range(1, self.config.speculative_tokens + 2), 8, 12, 16, 24, 32, 48, 64})
        sizes = [n for n in sizes if n <= largest]
        blocks = list(range(-(-(8 + max(sizes)) // self.runner.block_size)))
        for n in sizes:
            for i in range(repeats + 1):
                start = time.perf_counter()
                self.runner.execute(verify_inputs([0] * n, 8, blocks, self.drafts_as_rows(1)))  # as a lone request
                if i:
                    self.step_times.observe(n, time.perf_counter() - start)
        # and what a change of shape costs: steps alternating between no drafts and K, shapes seen above
        for i in range(2 * repeats):
            n = 1 + (i % 2) * self.config.speculative_tokens
            start = time.perf_counter()
            self.runner.execute(verify_inputs([0] * n, 8, blocks, self.drafts_as_rows(1)))
            self.step_times.observe_change(n, time.perf_counter() - start)
        self._measure_draft_costs()

    def _measure_draft_costs(self, repeats: int = 3) -> None:
        """Fit DraftCosts: steps of S decoding sequences, some of them with drafts, against the same step
        without drafts, at a short context and a long one (S: as many as speculate together at most). Each
        layout runs repeats times after one unmeasured step; the median counts."""
        k = self.config.speculative_tokens
        s = min(8, self.config.speculative_max_seqs, self.config.max_num_seqs)
        block_size = self.runner.block_size
        long_context = min(1024, self.max_model_len - k - 2, (self.runner.num_blocks // max(s, 1)) * block_size - k - 1)
        if s < 2 or long_context < 64:
            return
        tables = [list(range(i * self.runner.num_blocks // s, (i + 1) * self.runner.num_blocks // s)) for i in range(s)]
        layouts = [(0, 0), (1, k), (s, 1), (s // 2, max(1, k // 2)), (s, 2)]  # (sequences with drafts, drafts each)
        samples = []
        for context in (8, long_context):
            seconds = {}
            for drafting, num_drafts in layouts:
                inputs = [
                    row
                    for i, table in enumerate(tables)
                    for row in verify_inputs(
                        [0] * (1 + (num_drafts if i < drafting else 0)),
                        context,
                        table,
                        self.draft_rows,
                    )
                ]
                times = []
                for i in range(repeats + 1):
                    start = time.perf_counter()
                    self.runner.execute(inputs)
                    if i:
                        times.append(time.perf_counter() - start)
                seconds[(drafting, num_drafts)] = statistics.median(times)
            for drafting, num_drafts in layouts[1:]:
                added = seconds[(drafting, num_drafts)] - seconds[(0, 0)]
                samples.append(([(num_drafts, context)] * drafting, added))
        self.step_times.fit_draft_costs(samples, s, self.draft_rows)

    def stop(self) -> None:
        """Fail what is left with UNAVAILABLE and end the thread."""
        self._stopping = True
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._grammar_thread.shutdown(wait=False)
        self.alive = False
        if self.disk_tier is not None:  # blocks filled before the stop reach the disk: a restart finds them
            self.disk_tier.close(timeout=30)

    def submit(self, request: Request) -> None:
        """Hand a validated request to the engine thread; from now on only that thread touches it."""
        self._commands.put(request)

    def abort(self, request_id: int) -> None:
        self._commands.put(Abort(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    # -- engine thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            busy = False
            while not self._stopping:
                # wait for a command unless the last step did something: a step can be idle with work
                # left (every request loading from disk), and then it waits for the load's report
                self._take_commands(block=not busy)
                if self._stopping:
                    break
                busy = self.scheduler.has_work() and self.step()
            self.alive = False  # before the last drain: nothing submitted from now on can be missed
            self._fail_everything(Unavailable("the server is shutting down"))
        except BaseException as exc:  # the loop itself broke: nothing here can be trusted any more
            self.alive = False
            log.critical("the engine thread died", exc_info=exc)
            self._on_death(exc)
        finally:
            self.alive = False

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        added = self._apply(command) | self._drain_commands()
        if added and self.config.batch_window_ms > 0 and not self.scheduler.running:
            time.sleep(self.config.batch_window_ms / 1000)  # gather a burst of arrivals into one step, once
            self._drain_commands()
        self._update_stats()

    def _drain_commands(self) -> bool:
        """Apply every command already queued; True if any added a request."""
        added = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return added
            added |= self._apply(command)

    def _apply(self, command: Command) -> bool:
        if isinstance(command, Request):
            try:
                self.scheduler.add(command)
            except Exception as exc:  # this request's fault, not the engine's: it alone fails
                log.error("cannot queue request %d", command.id, exc_info=exc)
                self._publish([self._error(command, EngineFailure(f"the request could not be queued: {exc}"))])
                return False
            return True
        if isinstance(command, LoadResult):
            self.scheduler.loaded(command.request_id, command.num_loaded)
            return False
        if isinstance(command, Abort):
            request = self.scheduler.requests.get(command.request_id)
            if request is not None:
                self.scheduler.finish(request, FinishReason.ABORT)
                self._publish([self._output(request, [], [])])
        return False

    def step(self) -> bool:
        """Plan, run, sample and record one step; False when there was nothing to do. An exception at any
        stage fails exactly the requests of this step (INTERNAL, blocks freed); the engine goes on with
        the others."""
        clock = _StageClock()
        # what a plan could hold: the running requests and the first waiting one (taken before planning,
        # which may preempt a running request to the front of the queue)
        candidates = [*self.scheduler.running, *list(self.scheduler.waiting)[:1]]
        loading_before = set(self.scheduler.loading)
        try:
            plan = self.scheduler.schedule(self.keeps_shape)
        except Exception as exc:
            # The plan is lost: fail what it could have held. Each such failure removes at least one
            # request, so a request that breaks planning cannot make the engine loop. Loads it started
            # never reached the disk tier: end them here, or their blocks would wait for them forever.
            for request_id in set(self.scheduler.loading) - loading_before:
                self.scheduler.loaded(request_id, 0)
            self._fail_step(candidates, exc)
            return True
        clock.lap("schedule")
        if self.disk_tier is not None:
            for load in plan.loads:
                self.disk_tier.load(load.request.id, load.digests, load.block_ids)
        outputs = [self._error(r, DeadlineExceeded("the request's deadline passed")) for r in plan.expired]
        if plan.chunks:
            try:
                outputs += self._run_plan(plan, clock)
            except Exception as exc:
                self._publish(outputs)
                self._fail_step([c.request for c in plan.chunks], exc)
                return True
        self._save_filled_blocks()
        # before publishing: callers see fresh stats
        self._update_stats(plan, clock, num_generated=sum(len(o.token_ids) for o in outputs))
        self._publish(outputs)
        return not plan.empty

    def keeps_shape(self, sequences: int, drafts: int) -> bool:
        """Whether a step of `sequences` decoding sequences carrying `drafts` drafts in all can run in the shape
        of the last step on its copy (ShapeKeeper): for the draft rule, which places drafts within it."""
        tokens = sequences + drafts
        # drafts as one-token rows: every token its own sequence; either way every token wants a logits row
        needed = StepShape(tokens, tokens if self.drafts_as_rows(sequences) else sequences, tokens)
        return self.shape_keeper.keeps(needed, self.runner.last_shapes.get(self.runner.copy_for_tokens(tokens)))

    def _step_inputs(self, plan: StepPlan) -> list[StepInput]:
        """The step's sequences, drafts as one-token rows where drafts_as_rows says so."""
        return [row for c in plan.chunks for row in step_inputs(c, self.drafts_as_rows(len(plan.chunks)))]

    def drafts_as_rows(self, sequences: int) -> bool:
        """Whether a step of this many requests feeds drafts as one-token rows (draft_rows), which a request
        decoding alone does too unless its plain steps run on the single_token copy (--fast-single-stream):
        there rows would be no more exact than one sequence, only slower."""
        return self.draft_rows and (sequences > 1 or not self.runner.lone_rows_apart)

    def _save_filled_blocks(self) -> None:
        """Queue the blocks this step filled for the disk tier, before any later step can reuse them."""
        blocks = self.kv.take_newly_cached()
        if self.disk_tier is not None and blocks:
            self.disk_tier.save([(b.digest, b.block_id) for b in blocks if b.digest is not None])

    def _run_plan(self, plan: StepPlan, clock: _StageClock) -> list[EngineOutput]:
        sampled = [c for c in plan.chunks if c.sample]
        # The grammars' masks depend only on the tokens accepted so far, so they are computed while the model
        # runs, on the grammar thread (both release the GIL); the engine thread takes the matchers back with
        # the result and is their only user otherwise.
        constrained = [c for c in sampled if c.request.matcher is not None]
        pending = self._grammar_thread.submit(self._masks, constrained) if constrained else None
        inputs = self._step_inputs(plan)
        # the shape kept is that of the sequences on the f32 copy: long prompt pieces run apart, on the bf16 copy
        _, others = self.runner.split(inputs)
        shape = None
        padding_tokens = padding_sequences = 0
        if others:
            needed = StepShape.of([len(i.token_ids) for i in others], [i.num_logits for i in others])
            shape = self.shape_keeper.choose(needed, self.runner.last_shapes.get(self.runner.copy_for(others)))
            padding_tokens, padding_sequences = shape.tokens - needed.tokens, shape.sequences - needed.sequences
        logits = self.runner.execute(inputs, shape)
        clock.lap("execute")
        seconds = clock.seconds["execute"]
        tokens = plan.num_tokens + padding_tokens
        # the cost table counts requests (and padding sequences), not the one-token rows of drafts
        sequences = len(plan.chunks) + padding_sequences
        if self.runner.pieces_shape_changed:
            pass  # the bf16 copy prepared kernels for the pieces' new shape: neither a step's cost nor a change's
        elif self.runner.shape_changed:  # a new shape's step also prepares kernels: not what its tokens cost
            self.num_shape_changes += 1
            self.step_times.observe_change(tokens, seconds, sequences)
        else:
            self.step_times.observe(tokens, seconds, sequences)
        if all(c.num_tokens == 1 + len(c.drafts) for c in plan.chunks):
            # every step of decoding requests with drafts, changed and padded ones too: what drafts cost includes
            # the changes of shape and the padding that their coming and going causes
            drafts = [(len(c.drafts), c.start + 1) for c in plan.chunks if c.drafts]  # context as the rule saw it
            self.step_times.observe_drafts(plan.num_tokens, seconds, len(plan.chunks), drafts)
        by_id = {}
        if pending is not None:
            by_id = pending.result()
            clock.lap("mask")  # the masks' time beyond the model's: what they add to the step
        masks = [by_id.get(c.request.id) for c in sampled]
        ends = np.cumsum([c.num_logits for c in sampled], dtype=np.int64)
        plain = [i for i, c in enumerate(sampled) if not c.drafts]
        plain_masks = [masks[i] for i in plain] if constrained else []
        result = sample(logits[ends[plain] - 1], [sampled[i].request for i in plain], plain_masks)
        runs: list[list[int]] = [[] for _ in sampled]
        logprobs: list[list[TokenLogprob | None]] = [[] for _ in sampled]
        failed: dict[int, Exception] = {}  # by index into sampled: sampling its row raised
        for i, token_id, logprob, error in zip(plain, result.token_ids, result.logprobs, result.errors, strict=True):
            if error is not None:
                failed[i] = error
            runs[i], logprobs[i] = [token_id], [logprob]
        for i, chunk in enumerate(sampled):
            if chunk.drafts:  # the k+1 rows of a verify chunk
                rows = logits[ends[i] - chunk.num_logits : ends[i]]
                try:
                    run = verify(rows, chunk.request, chunk.drafts, masks[i])
                except Exception as exc:
                    failed[i] = exc
                    continue
                runs[i], logprobs[i] = run.token_ids, run.logprobs
        clock.lap("sample")
        outputs = [self._sampling_failed(sampled[i].request, exc) for i, exc in failed.items()]
        if failed:  # those requests are finished: the step's outcome is the others'
            gone = {sampled[i].request.id for i in failed}
            plan = replace(plan, chunks=[c for c in plan.chunks if c.request.id not in gone])
            keep = [i for i in range(len(sampled)) if i not in failed]
            sampled, runs, logprobs = [sampled[i] for i in keep], [runs[i] for i in keep], [logprobs[i] for i in keep]
        before = [(c.request.num_output_tokens, c.request.num_accepted_drafts) for c in sampled]
        self.scheduler.update(plan, runs)
        clock.lap("update")
        for chunk, (n, drafts_before), run_logprobs in zip(sampled, before, logprobs, strict=True):
            matcher = chunk.request.matcher
            if matcher is not None and matcher.error:
                outputs.append(self._grammar_failed(chunk.request, matcher.error))
                continue
            new = chunk.request.output_token_ids[n:]  # a stop inside a run drops the tokens after it
            kept = [lp for lp in run_logprobs[: len(new)] if lp is not None]
            # a verify step's run is its kept drafts, then the model's own token
            num_kept = chunk.request.num_accepted_drafts - drafts_before
            drafted = [True] * num_kept + [False] * (len(new) - num_kept)
            outputs.append(self._output(chunk.request, new, kept, drafted))
        return outputs

    def _masks(self, chunks: list[ScheduledChunk]) -> dict[int, np.ndarray]:
        """On the grammar thread: each constrained chunk's masks, by request id."""
        start = time.perf_counter()
        masks = {}
        for c in chunks:
            assert c.request.matcher is not None
            masks[c.request.id] = c.request.matcher.masks(c.drafts)
        self.mask_seconds.append(time.perf_counter() - start)
        return masks

    def _grammar_failed(self, request: Request, error: str) -> EngineOutput:
        """A grammar that hit one of its limits (an extreme schema) ends its own request with an error, and
        nothing else (the matcher then admits only eos, so the engine saw no invalid token)."""
        log.warning("request %d: its grammar failed: %.200s", request.id, error)  # may quote the client's schema
        self.scheduler.finish(request)
        field = request.matcher.field if request.matcher is not None else "response_format"
        return self._error(request, InvalidArgument(field, f"the grammar failed mid-reply: {error}"))

    def _sampling_failed(self, request: Request, exc: Exception) -> EngineOutput:
        """Sampling one request's row raised (a bug: no input is known to make it): that request ends with an
        error, and nothing else (the step's other requests keep their tokens)."""
        log.error("request %d: sampling its tokens failed", request.id, exc_info=exc)
        self.scheduler.finish(request)
        return self._error(request, EngineFailure(f"sampling the reply failed: {exc}"))

    def _fail_step(self, requests: list[Request], exc: Exception) -> None:
        log.error("engine step failed; failing its %d requests", len(requests), exc_info=exc)
        error = EngineFailure(f"the model step failed: {exc}")
        outputs = []
        for request in requests:
            self.scheduler.finish(request)
            outputs.append(self._error(request, error))
        self.num_failed_steps += 1
        self._update_stats()
        self._publish(outputs)

    def _fail_everything(self, error: ServiceError) -> None:
        self._drain_commands()  # what was submitted after the last command was taken fails too
        outputs = []
        for request in list(self.scheduler.requests.values()):
            self.scheduler.finish(request)
            outputs.append(self._error(request, error))
        self._publish(outputs)

    def _output(
        self,
        request: Request,
        token_ids: list[int],
        logprobs: list[TokenLogprob],
        drafted: list[bool] | None = None,
    ) -> EngineOutput:
        scheduled = request.first_scheduled_time
        return EngineOutput(
            request.id,
            token_ids,
            logprobs,
            drafted or [],
            finish_reason=request.finish_reason,
            num_cached_tokens=request.num_cached_tokens,
            num_restored_tokens=request.num_restored_tokens,
            queue_seconds=(scheduled - request.arrival_time) if scheduled is not None else 0.0,
        )

    def _error(self, request: Request, error: ServiceError) -> EngineOutput:
        out = self._output(request, [], [])
        out.finish_reason, out.error = None, error
        return out

    def _update_stats(
        self, plan: StepPlan | None = None, clock: _StageClock | None = None, num_generated: int = 0
    ) -> None:
        """Publish a fresh snapshot; callers on other threads read it without locks."""
        s = self._stats
        chunks = plan.chunks if plan else []
        seconds = clock.seconds if clock else {}
        self._stats = EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=self.kv.usage,
            num_free_blocks=self.kv.pool.num_free,
            num_total_blocks=self.kv.pool.num_blocks,
            prefix_hit_rate=self.kv.hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=s.num_prompt_tokens
            + sum(c.num_tokens for c in chunks if c.start < c.request.num_prompt_tokens),
            num_generated_tokens=s.num_generated_tokens + num_generated,
            num_draft_tokens=self.scheduler.num_draft_tokens,
            num_accepted_tokens=self.scheduler.num_accepted_tokens,
            num_verify_steps=self.scheduler.num_verify_steps,
            num_steps=s.num_steps + (plan is not None),
            num_shape_changes=self.num_shape_changes,
            num_padded_steps=self.shape_keeper.num_padded_steps,
            num_failed_steps=self.num_failed_steps,
            last_step_seconds=clock.total if clock else s.last_step_seconds,
            tokens_per_step=float(plan.num_tokens) if plan else s.tokens_per_step,
            num_cache_evictions=self.kv.pool.num_evictions,
            num_loading=len(self.scheduler.loading),
            num_cached_prompt_tokens=self.kv.num_hit_tokens,
            num_restored_prompt_tokens=self.scheduler.num_restored_tokens,
            disk=self._disk_stats(),
            schedule_seconds_total=s.schedule_seconds_total + seconds.get("schedule", 0.0),
            execute_seconds_total=s.execute_seconds_total + seconds.get("execute", 0.0),
            sample_seconds_total=s.sample_seconds_total + seconds.get("sample", 0.0),
            update_seconds_total=s.update_seconds_total + seconds.get("update", 0.0),
            mask_seconds_total=s.mask_seconds_total + seconds.get("mask", 0.0),
            step_seconds_total=s.step_seconds_total + (clock.total if clock else 0.0),
            step_overhead_tokens=self.step_times.overhead,
        )

    def _disk_stats(self) -> DiskTierStats | None:
        tier = self.disk_tier
        if tier is None:
            return None
        store, t = tier.store.counters, tier.counters
        return DiskTierStats(
            enabled=tier.enabled and tier.writable,
            num_blocks=tier.store.num_blocks,
            num_bytes=tier.store.num_bytes,
            num_written=store.num_written,
            num_restored=t.num_restored_blocks,
            num_skipped=t.num_skipped,
            num_evicted=store.num_evicted,
            num_corrupt=store.num_corrupt,
            bytes_written=store.bytes_written,
            bytes_read=store.bytes_read,
            num_restores=t.num_restores,
            restore_seconds_total=t.restore_seconds_total,
        )


def step_inputs(chunk: ScheduledChunk, one_token_rows: bool) -> list[StepInput]:
    """A chunk's share of a step. With one_token_rows, a chunk with drafts runs as one-token sequences on the
    same block table, one a position: the attention kernel writes every new key and value before it reads
    any, so each sees the ones before it, and each row is computed exactly as a decode step of several
    sequences computes it (bit for bit, int8 weights and u8 cache too). Fed as one sequence of k + 1 tokens,
    the rows come from the kernel for many-token queries, which also reads the drafts' keys and values before
    they are rounded to the u8 cache: on SmolLM2 int8 the top two logits' gap moved by 0.08 at the median and
    0.5 at the 99th percentile, and greedy replies with drafts differed from plain decoding's. One-token rows
    cost as much at 1-2 drafts and more beyond, more at long contexts (each row reads the whole context: a lone
    request's 11 rows took 1.18x one sequence's time at a 300-token context, 1.38x at 700), so by default
    (verify_drafts auto) they are used where they make speculation exact: where decoding rows run in f32
    (ModelRunner.rows_alike_in_every_step), a request decoding alone included."""
    if not chunk.drafts:
        return [StepInput(chunk.token_ids, chunk.start, chunk.block_ids, chunk.num_logits)]
    return verify_inputs(chunk.token_ids, chunk.start, chunk.block_ids, one_token_rows)


def verify_inputs(
    token_ids: Sequence[int], start: int, block_ids: Sequence[int], one_token_rows: bool
) -> list[StepInput]:
    """A request's last token and drafts at positions start.., every row wanted: one sequence, or one-token
    rows (step_inputs says when and why). The warm-up measures draft steps through it too."""
    if not one_token_rows:
        return [StepInput(token_ids, start, block_ids, len(token_ids))]
    return [StepInput([t], start + i, block_ids, 1) for i, t in enumerate(token_ids)]


def kv_identity(model: ModelFiles, config: EngineConfig, cache_format: str) -> bytes:
    """Everything that changes what a KV block holds: the model's content, the cache's format (runtime,
    precision, block shape, the activations' precision) and the settings that change the numbers written
    (dynamic quantization, the single-token copy). Thread counts are left out: they change only the order of sums."""
    parts = {
        "model": model.digest,
        "cache_format": cache_format,
        "kv_cache_precision": config.kv_cache_precision,
        "dq_group_size": config.dq_group_size,
        "fast_single_stream": config.fast_single_stream,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).digest()


class _StageClock:
    """Seconds spent in each stage of one step."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = now - self.last
        self.last = now

    @property
    def total(self) -> float:
        return time.perf_counter() - self.start
