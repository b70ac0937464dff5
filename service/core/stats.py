"""What the engine tells about itself: the served model's limits, and a snapshot of its counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    model_dir: str
    max_model_len: int
    max_new_tokens_limit: int
    vocab_size: int  # token ids are in [0, vocab_size): the model's embedding rows
    eos_token_ids: tuple[int, ...]
    num_threads: int
    kv_cache_bytes: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    # the model's recommended sampling settings (generation_config.json), by SamplingParams field name
    sampling_defaults: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class DiskTierStats:
    enabled: bool = False  # the tier writes; False once the disk refused a write (restores go on)
    num_blocks: int = 0
    num_bytes: int = 0
    num_written: int = 0
    num_restored: int = 0  # blocks
    num_skipped: int = 0  # blocks not written because writes had fallen behind
    num_evicted: int = 0
    num_corrupt: int = 0  # files removed as truncated, corrupt or foreign
    bytes_written: int = 0
    bytes_read: int = 0
    num_restores: int = 0  # loads (one per admitted request that restored)
    restore_seconds_total: float = 0.0


@dataclass(frozen=True)
class RemoteTierStats:
    up: bool = False  # the store answered the last operation
    num_published: int = 0  # blocks
    num_skipped: int = 0  # full blocks not published: publishing fell behind, or the store was down
    num_fetched: int = 0  # blocks fetched and verified
    num_missed: int = 0  # fetches whose chain ended at a block the store did not hold
    num_corrupt: int = 0  # values refused (wrong length, checksum, identity, digest or type), never loaded
    num_errors: int = 0  # operations that failed (unreachable, timed out, refused)
    num_outages: int = 0
    bytes_published: int = 0
    bytes_fetched: int = 0
    num_fetches: int = 0  # loads that asked the store
    fetch_seconds_total: float = 0.0


@dataclass(frozen=True)
class EngineStats:
    """Published by the engine thread after every step; readers on other threads take it without locks.
    The *_seconds_total counters split the engine thread's time by stage (benchmarks read their deltas)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_hit_rate: float = 0.0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_draft_tokens: int = 0  # proposed for speculative decoding and verified
    num_accepted_tokens: int = 0  # of those, the ones the model agreed with
    num_verify_steps: int = 0  # request-steps that verified drafts; each also yields one token of the model's
    num_steps: int = 0
    num_shape_changes: int = 0  # steps whose input shape differed from the last (each prepares kernels anew)
    num_failed_steps: int = 0
    last_step_seconds: float = 0.0
    tokens_per_step: float = 0.0
    num_cache_evictions: int = 0
    num_loading: int = 0  # requests waiting for their prefix to be restored from disk or the remote tier
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the RAM prefix cache, not computed
    num_restored_prompt_tokens: int = 0  # prompt tokens restored from the disk tier, not computed
    # of the RAM cache's, those later candidates of n > 1 requests read from their first candidate's blocks
    num_shared_prompt_tokens: int = 0
    num_remote_prompt_tokens: int = 0  # prompt tokens fetched from the remote tier, not computed
    disk: DiskTierStats | None = None  # None without a disk tier
    remote: RemoteTierStats | None = None  # None without a remote tier
    schedule_seconds_total: float = 0.0
    execute_seconds_total: float = 0.0
    sample_seconds_total: float = 0.0
    update_seconds_total: float = 0.0
    mask_seconds_total: float = 0.0  # waiting for grammar masks after the model finished its step
    step_seconds_total: float = 0.0
    step_overhead_tokens: float = 0.0  # the draft rule's F: a step's fixed cost in tokens' work, fitted live
