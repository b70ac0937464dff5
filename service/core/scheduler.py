"""Iteration-level continuous batching under one token budget per step.

Every request has num_tokens (prompt + generated) and num_computed_tokens; each step shares the token
budget out, running requests first, then waiting ones in arrival order. A prompt longer than the
remaining budget is computed in chunks, side by side with other requests' decode tokens. A waiting
request is admitted only while each running request keeps one free block to grow into. When blocks
run out the newest running request is preempted: its blocks are freed and it is recomputed later
(mostly from the prefix cache).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from service.core.kv_cache import KVCacheManager
from service.core.request import Request, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096


@dataclass(frozen=True)
class ScheduledChunk:
    """num_tokens tokens of request, starting at position start; sample is True when the chunk
    reaches the request's last token (as planned), so its logits row is sampled."""

    request: Request
    start: int
    num_tokens: int
    block_ids: list[int]
    sample: bool


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    expired: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request) -> None:
        """Remove a request wherever it is (done, aborted, failed, expired) and free its blocks."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request.status is Status.WAITING and request in self.waiting:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        self.kv.free(request.request_id)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._drop_expired(plan)
        budget = self.config.max_num_batched_tokens
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, plan):
                continue
            plan.chunks.append(self._chunk(request, num_new))
            budget -= num_new
        if not plan.preempted:
            self._admit_waiting(budget, plan)
        return plan

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: StepPlan) -> bool:
        target = request.num_computed_tokens + num_new
        while not self.kv.allocate(request.request_id, target):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.status = Status.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        plan.preempted.append(request)
        plan.chunks = [c for c in plan.chunks if c.request is not request]

    def _admit_waiting(self, budget: int, plan: StepPlan) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            prefix = self.kv.find_prefix(request.request_id, request.all_token_ids)
            num_new = min(request.num_tokens - prefix.num_tokens, budget)
            # admit only if every running request can still take one more block: otherwise the next
            # decode step would preempt the newcomer and throw its prefill away
            keep_free = len(self.running)
            if not self.kv.allocate(request.request_id, prefix.num_tokens + num_new, prefix, keep_free):
                break  # wait for blocks to be freed; first come, first served
            self.waiting.popleft()
            request.status = Status.RUNNING
            request.num_computed_tokens = prefix.num_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = prefix.num_tokens
            self.running.append(request)
            plan.chunks.append(self._chunk(request, num_new))
            budget -= num_new

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(
            request, start, num_new, self.kv.block_ids(request.request_id), sample=start + num_new == request.num_tokens
        )

    def _drop_expired(self, plan: StepPlan) -> None:
        now = time.monotonic()
        for request in [*self.running, *self.waiting]:
            if request.deadline is not None and now >= request.deadline:
                self.finish(request)
                plan.expired.append(request)

    def complete(self, plan: StepPlan) -> None:
        """Record that the model computed the plan's chunks and register newly full blocks."""
        for chunk in plan.chunks:
            request = chunk.request
            request.num_computed_tokens += chunk.num_tokens
            self.kv.cache_full_blocks(request.request_id, request.all_token_ids, request.num_computed_tokens)
