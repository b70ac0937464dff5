"""The engine's published stats: a fresh EngineStats snapshot after every step or command, which other threads
read without locks, and the clock of a step's stages."""

from __future__ import annotations

import time

from service.core.kv_cache import KVCacheManager
from service.core.scheduler import Scheduler, StepPlan
from service.core.stats import DiskTierStats, EngineStats, RemoteTierStats
from service.engine.kv_tiers import KVTiers


class StageClock:
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


class StatsBook:
    """Counts what only the engine thread sees (failed steps, changes of shape) and publishes snapshots."""

    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, tiers: KVTiers | None) -> None:
        self.scheduler, self.kv, self.tiers = scheduler, kv, tiers
        self.num_failed_steps = 0
        self.num_shape_changes = 0
        blocks = kv.pool.num_blocks
        self.current = EngineStats(num_total_blocks=blocks, num_free_blocks=blocks)

    def update(self, plan: StepPlan | None = None, clock: StageClock | None = None, num_generated: int = 0) -> None:
        """Publish a fresh snapshot, adding this step's counts (none without a plan) to the last one's."""
        s, scheduler, kv = self.current, self.scheduler, self.kv
        chunks = plan.chunks if plan else []
        seconds = clock.seconds if clock else {}
        self.current = EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_usage=kv.usage,
            num_free_blocks=kv.pool.num_free,
            num_total_blocks=kv.pool.num_blocks,
            prefix_hit_rate=kv.hit_rate,
            num_preemptions=scheduler.num_preemptions,
            num_prompt_tokens=s.num_prompt_tokens
            + sum(c.num_tokens for c in chunks if c.start < c.request.num_prompt_tokens),
            num_generated_tokens=s.num_generated_tokens + num_generated,
            num_draft_tokens=scheduler.num_draft_tokens,
            num_accepted_tokens=scheduler.num_accepted_tokens,
            num_verify_steps=scheduler.num_verify_steps,
            num_steps=s.num_steps + (plan is not None),
            num_shape_changes=self.num_shape_changes,
            num_failed_steps=self.num_failed_steps,
            last_step_seconds=clock.total if clock else s.last_step_seconds,
            tokens_per_step=float(plan.num_tokens) if plan else s.tokens_per_step,
            num_cache_evictions=kv.pool.num_evictions,
            num_loading=len(scheduler.loading),
            num_cached_prompt_tokens=kv.num_hit_tokens,
            num_restored_prompt_tokens=scheduler.num_restored_tokens,
            num_shared_prompt_tokens=scheduler.num_shared_prompt_tokens,
            num_remote_prompt_tokens=scheduler.num_remote_tokens,
            disk=self._disk_stats(),
            remote=self._remote_stats(),
            schedule_seconds_total=s.schedule_seconds_total + seconds.get("schedule", 0.0),
            execute_seconds_total=s.execute_seconds_total + seconds.get("execute", 0.0),
            sample_seconds_total=s.sample_seconds_total + seconds.get("sample", 0.0),
            update_seconds_total=s.update_seconds_total + seconds.get("update", 0.0),
            mask_seconds_total=s.mask_seconds_total + seconds.get("mask", 0.0),
            step_seconds_total=s.step_seconds_total + (clock.total if clock else 0.0),
            step_overhead_tokens=scheduler.step_times.overhead,
        )

    def _disk_stats(self) -> DiskTierStats | None:
        tier = self.tiers.disk if self.tiers is not None else None
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

    def _remote_stats(self) -> RemoteTierStats | None:
        tier = self.tiers.remote if self.tiers is not None else None
        if tier is None:
            return None
        store, t = tier.store.counters, tier.counters
        return RemoteTierStats(
            up=tier.up,
            num_published=store.num_published,
            num_skipped=t.num_skipped,
            num_fetched=store.num_fetched,
            num_missed=store.num_missed,
            num_corrupt=store.num_corrupt,
            num_errors=store.num_errors,
            num_outages=store.num_outages,
            bytes_published=store.bytes_published,
            bytes_fetched=store.bytes_fetched,
            num_fetches=t.num_fetches,
            fetch_seconds_total=t.fetch_seconds_total,
        )
