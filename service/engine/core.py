"""The engine thread: takes commands, steps the model, publishes each step's outputs and stats.

Only the engine thread touches the scheduler, the KV cache and the runner. Other threads call
submit(), abort() and stop(), which put a command on the queue, and stats(), which reads the last
published snapshot. The tiers below RAM (disk, remote) report finished restores through the same queue. A
failed step fails the requests in it and nothing else; if the thread itself ever dies, `on_death` is
called so that the front can fail every caller and report unhealthy.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from service.core.config import EngineConfig
from service.core.feed import Feed
from service.core.kv_cache import KVCacheManager
from service.core.outputs import FinishReason
from service.core.request import Request
from service.core.scheduler import Scheduler, StepPlan
from service.core.spec import StepTimes
from service.core.stats import EngineStats, ModelInfo
from service.engine import warmup
from service.engine.kv_tier import LoadResult
from service.engine.kv_tiers import build_tiers, kv_identity
from service.engine.masks import MaskThread
from service.engine.model_files import ModelFiles
from service.engine.outputs import Abort, Command, EngineOutput, Progress, Publish, error_of, output_of, step_output
from service.engine.runner import ModelRunner, StepInput
from service.engine.sampling import sample_step
from service.engine.stats import StageClock, StatsBook
from service.errors import DeadlineExceeded, EngineFailure, InvalidArgument, ServiceError, Unavailable

__all__ = ["EngineCore", "EngineOutput"]

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        model: ModelFiles,
        config: EngineConfig,
        publish: Publish,
        on_death: Callable[[BaseException], None],
        turn_marks: tuple[tuple[int, ...], int | None] = ((), None),
    ) -> None:
        """turn_marks: the chat template's assistant header and end-of-turn token (Tokenizer.turn_marks)."""
        self.runner = ModelRunner(model.ir, config)
        self.budget_checked = config.max_num_batched_tokens is None  # choose_budget checks the budget it chooses
        budget = config.max_num_batched_tokens or warmup.choose_budget(self.runner)
        self.config = config = replace(config, max_num_batched_tokens=budget)
        capacity = self.runner.num_blocks * self.runner.block_size
        context = model.context_length or capacity
        self.max_model_len = min(config.max_model_len or context, context, capacity)
        feed = None
        if config.deterministic:
            self.runner.reads_pieces = warmup.check_pieces(self.runner)
            feed = Feed(*turn_marks, pieces=self.runner.reads_pieces)
        identity = kv_identity(model, config, self.runner.cache_format)
        self.kv = KVCacheManager(
            self.runner.num_blocks, self.runner.block_size, config.enable_prefix_caching, identity=identity
        )
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.tiers = build_tiers(config, identity, self.runner.cache_arrays(), self._commands.put)
        # the draft policy's table of step times, measured at warm-up
        self.step_times = StepTimes()
        self.scheduler = Scheduler(
            config, self.kv, self.max_model_len, disk=self.tiers, step_times=self.step_times, feed=feed
        )
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
            max_num_batched_tokens=budget,
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
        self.book = StatsBook(self.scheduler, self.kv, self.tiers)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.masks = MaskThread()
        self.alive = False  # the thread runs and takes requests

    # -- any thread ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Warm the model up (checking that it computes finite logits; with speculation on by default, measuring
        the draft policy's table), then start the engine thread. With speculation off by default, requests that
        opt in are judged by the table's prior line: no server start pays for the measurement."""
        warmup.check_rows(self.runner, self.config, self.budget_checked)
        if self.config.speculative_tokens > 0 and self.config.speculation == "auto":
            warmup.measure_step_times(self.runner, self.config, self.step_times)
        if self.tiers is not None:
            self.tiers.start()
            self.book.update()  # the tiers' figures, open, before any step: an idle replica shows them too
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.alive = True
        self._thread.start()

    def stop(self) -> None:
        """Fail what is left with UNAVAILABLE and end the thread."""
        self._stopping = True
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.masks.shutdown()
        self.alive = False
        if self.tiers is not None:  # blocks filled before the stop reach the disk: a restart finds them
            self.tiers.close(timeout=30)

    def submit(self, request: Request) -> None:
        """Hand a validated request to the engine thread; from now on only that thread touches it."""
        self._commands.put(request)

    def abort(self, request_id: int) -> None:
        self._commands.put(Abort(request_id))

    def stats(self) -> EngineStats:
        return self.book.current

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
        self.book.update()

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
                self._publish([error_of(command, EngineFailure(f"the request could not be queued: {exc}"))])
                return False
            return True
        if isinstance(command, LoadResult):
            self.scheduler.loaded(command.request_id, command.num_loaded, command.num_remote)
            return False
        if isinstance(command, Abort):
            request = self.scheduler.requests.get(command.request_id)
            if request is not None:
                self.scheduler.finish(request, FinishReason.ABORT)
                if self.tiers is not None:  # a load still under way for it ends early
                    self.tiers.cancel(request.id)
                self._publish([output_of(request, [], [])])
        return False

    def step(self) -> bool:
        """Plan, run, sample and record one step; False when there was nothing to do. An exception at any
        stage fails exactly the requests of this step (INTERNAL, blocks freed); the engine goes on with
        the others."""
        clock = StageClock()
        # what a plan could hold: the running requests and the first waiting one (taken before planning,
        # which may preempt a running request to the front of the queue)
        candidates = [*self.scheduler.running, *list(self.scheduler.waiting)[:1]]
        loading_before = set(self.scheduler.loading)
        try:
            plan = self.scheduler.schedule()
        except Exception as exc:
            # The plan is lost: fail what it could have held. Each such failure removes at least one
            # request, so a request that breaks planning cannot make the engine loop. Loads it started
            # never reached the disk tier: end them here, or their blocks would wait for them forever.
            for request_id in set(self.scheduler.loading) - loading_before:
                self.scheduler.loaded(request_id, 0)
            self._fail_step(candidates, exc)
            return True
        clock.lap("schedule")
        if self.tiers is not None:
            for load in plan.loads:
                self.tiers.load(load.request.id, load.digests, load.block_ids, load.request.deadline)
        outputs = [error_of(r, DeadlineExceeded("the request's deadline passed")) for r in plan.expired]
        if self.tiers is not None:
            for request in plan.expired:  # a load still under way for it ends early
                self.tiers.cancel(request.id)
        if plan.chunks:
            try:
                outputs += self._run_plan(plan, clock)
            except Exception as exc:
                self._publish(outputs)
                self._fail_step([c.request for c in plan.chunks], exc)
                return True
        self._save_filled_blocks()
        # before publishing: callers see fresh stats
        self.book.update(plan, clock, num_generated=sum(len(o.token_ids) for o in outputs))
        self._publish(outputs)
        return not plan.empty

    def _save_filled_blocks(self) -> None:
        """Queue the blocks this step filled for the tiers below RAM, before any later step can reuse them."""
        blocks = self.kv.take_newly_cached()
        if self.tiers is not None and blocks:
            self.tiers.save([(b.digest, b.block_id) for b in blocks if b.digest is not None])

    def _run_plan(self, plan: StepPlan, clock: StageClock) -> list[EngineOutput]:
        sampled = [c for c in plan.chunks if c.sample]
        pending = self.masks.start(sampled)  # computed while the model runs
        report = self.runner.step(
            [
                StepInput(ids, start, c.block_ids, logits, piece)
                for c in plan.chunks
                for ids, start, logits, piece in c.feeds()
            ]
        )
        self.book.num_shape_changes += report.shape_changed
        clock.lap("execute")
        by_id = {}
        if pending is not None:
            by_id = pending.result()
            clock.lap("mask")  # the masks' time beyond the model's: what they add to the step
        runs, logprobs, failed = sample_step(report.logits, sampled, [by_id.get(c.request.id) for c in sampled])
        clock.lap("sample")
        outputs = [self._sampling_failed(sampled[i].request, exc) for i, exc in failed.items()]
        if failed:  # those requests are finished: the step's outcome is the others'
            gone = {sampled[i].request.id for i in failed}
            plan = replace(plan, chunks=[c for c in plan.chunks if c.request.id not in gone])
            keep = [i for i in range(len(sampled)) if i not in failed]
            sampled, runs, logprobs = [sampled[i] for i in keep], [runs[i] for i in keep], [logprobs[i] for i in keep]
        before = [Progress.of(c.request) for c in sampled]
        self.scheduler.update(plan, runs)
        clock.lap("update")
        for chunk, progress, run_logprobs in zip(sampled, before, logprobs, strict=True):
            matcher = chunk.request.matcher
            if matcher is not None and matcher.error:
                outputs.append(self._grammar_failed(chunk.request, matcher.error))
            else:
                outputs.append(step_output(chunk.request, progress, run_logprobs))
        return outputs

    def _grammar_failed(self, request: Request, error: str) -> EngineOutput:
        """A grammar that hit one of its limits (an extreme schema) ends its own request with an error, and
        nothing else (the matcher then admits only eos, so the engine saw no invalid token)."""
        log.warning("request %d: its grammar failed: %.200s", request.id, error)  # may quote the client's schema
        self.scheduler.finish(request)
        field = request.matcher.field if request.matcher is not None else "response_format"
        return error_of(request, InvalidArgument(field, f"the grammar failed mid-reply: {error}"))

    def _sampling_failed(self, request: Request, exc: Exception) -> EngineOutput:
        """Sampling one request's row raised (a bug: no input is known to make it): that request ends with an
        error, and nothing else (the step's other requests keep their tokens)."""
        log.error("request %d: sampling its tokens failed", request.id, exc_info=exc)
        self.scheduler.finish(request)
        return error_of(request, EngineFailure(f"sampling the reply failed: {exc}"))

    def _fail_step(self, requests: list[Request], exc: Exception) -> None:
        log.error("engine step failed; failing its %d requests", len(requests), exc_info=exc)
        error = EngineFailure(f"the model step failed: {exc}")
        outputs = []
        for request in requests:
            self.scheduler.finish(request)
            outputs.append(error_of(request, error))
        self.book.num_failed_steps += 1
        self.book.update()
        self._publish(outputs)

    def _fail_everything(self, error: ServiceError) -> None:
        self._drain_commands()  # what was submitted after the last command was taken fails too
        outputs = []
        for request in list(self.scheduler.requests.values()):
            self.scheduler.finish(request)
            outputs.append(error_of(request, error))
        self._publish(outputs)
