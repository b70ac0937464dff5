"""Every engine setting with its default and help text, stated once.

The command line (service/config.py) makes a flag and an environment variable of each field; the
runner, the scheduler, the engine and bench/ read the same object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from service.core.params import SPECULATION_MODES

INFERENCE_PRECISIONS = ("f32", "bf16", "f16")
REMOTE_SCHEMES = ("redis", "rediss", "unix")


def setting(default: Any, help: str, choices: tuple[str, ...] | None = None, secret: bool = False) -> Any:
    """A dataclass field carrying its command-line help (and allowed values) in its metadata. A secret one (it
    may hold a password) is left out of the config's repr."""
    return field(default=default, repr=not secret, metadata={"help": help, "choices": choices})


# The smallest step budget: a run of prompt tokens read in pieces of at least two (core/feed.py) always fits
MIN_STEP_TOKENS = 4
# Step budgets without --max-num-batched-tokens: deterministic steps take the largest of STEP_BUDGETS at which the
# start-up check finds rows computed alike (warmup.choose_budget), else SAFE_STEP_TOKENS, the largest at which the
# CPU plugin's matmuls kept their kernels on every CPU measured; fast steps take the largest
STEP_BUDGETS = (128, 256, 512)
SAFE_STEP_TOKENS = 80


@dataclass(frozen=True)
class EngineConfig:
    """Defaults suit a 2-core box; on a 32-core server raise kv_cache_gb, max_num_seqs and
    max_num_batched_tokens (see README)."""

    threads: int | None = setting(None, "inference threads (default: the CPUs this process may use)")
    kv_cache_gb: float = setting(1.0, "KV cache budget in GiB")
    kv_cache_precision: str = setting("u8", "KV cache element type", ("u8", "f16", "f32"))
    deterministic: bool = setting(
        True,
        "reproducible replies: how each token is fed (a one-token row, or in a prompt piece of two or more) depends "
        "on the tokens alone, so a greedy or seeded reply does not depend on what was cached, how its prompt was "
        'cut, what shares its steps, speculation or preemption (docs/API.md, "Reproducible replies"). '
        "--no-deterministic feeds each chunk whole: replies that move with load and cache state",
    )
    inference_precision: str = setting(
        "f32",
        "precision of the model's activations. Replies are reproducible in f32 only (docs/API.md); on CPUs with "
        "AVX512_BF16 or AMX, bf16 reads prompts faster (docs/BENCH.md)",
        INFERENCE_PRECISIONS,
    )
    dq_group_size: int | None = setting(
        None,
        "activation channels per dynamic-quantization group in int8 matmuls (default: the CPU plugin's, 32; "
        "64 measured 5-10%% faster with slightly larger logit error; 0 turns it off)",
    )
    max_num_seqs: int = setting(32, "requests generated together at most")
    max_num_batched_tokens: int | None = setting(
        None,
        "tokens per engine step at most (prompt tokens, decode tokens and drafts). Default: 512, or with "
        "deterministic steps the largest of 128, 256 and 512 at which the start-up check finds a step's rows "
        "computed as in a step of two, else 80 (reproducible replies need every step computed by the same "
        "kernels: the CPU plugin's matmuls switched kernels at 81 tokens a step on AVX2 CPUs); the warm-up warns "
        "when a budget set here computes rows otherwise",
    )
    max_model_len: int | None = setting(None, "context limit (default: the model's, capped by what the KV cache holds)")
    chat_template: str | None = setting(
        None,
        "a Jinja chat template file replacing the model's own (templates/qwen3-instruct-2507.jinja: Qwen3's, with "
        "tool calling)",
    )
    max_n: int = setting(
        8,
        "candidates (n) one request may ask for at most; each counts as a request against --max-num-seqs and "
        "--max-queue",
    )
    max_queue: int = setting(256, "requests waiting beyond the running ones before RESOURCE_EXHAUSTED")
    max_queued_per_tenant: int | None = setting(
        None,
        "requests of one tenant waiting beyond max_num_seqs running before its next one gets RESOURCE_EXHAUSTED "
        "(HTTP 429), so that one tenant cannot fill --max-queue for the others (default: only --max-queue applies)",
    )
    fair_admission: bool = setting(
        True,
        "admit waiting requests fairly across tenants (weighted fair queuing over the tokens computed for each, "
        "and a tenant under its share of max_num_seqs takes a place from the tenant furthest over its share); "
        "--no-fair-admission admits them in arrival order (priority first)",
    )
    batch_window_ms: float = setting(0.0, "wait this long after an arrival to gather a burst into one step")
    enable_prefix_caching: bool = setting(True, "reuse the KV cache of shared prompt prefixes")
    kv_disk_dir: str | None = setting(
        None,
        "folder for the prefix cache's disk tier: full KV blocks are written there as they fill and restored "
        "instead of recomputed once evicted from RAM or after a restart (default: no disk tier)",
    )
    kv_disk_gb: float = setting(10.0, "size of the disk tier in GiB; least recently used blocks are removed first")
    kv_disk_ttl_seconds: float = setting(
        0.0, "remove disk-tier blocks unused for this long (0: only when space runs out)"
    )
    kv_remote_url: str | None = setting(
        None,
        "the fleet cache: a Redis 7 or Valkey store shared by every replica of the model, as redis://host:port/db "
        "(rediss:// for TLS). Full KV blocks are published there as they fill and fetched by any replica instead "
        "of recomputed; the store is never required (down or slow, prefixes are computed). Give the password "
        "with --kv-remote-password-file rather than in the URL (default: no remote tier)",
        secret=True,
    )
    kv_remote_password_file: str | None = setting(
        None, "a file holding the remote store's password (a mounted Secret); a user goes in the URL"
    )
    kv_remote_ca_cert: str | None = setting(None, "CA certificates (PEM) to check a rediss:// store's certificate")
    kv_remote_ttl_seconds: float = setting(
        0.0,
        "remote blocks unused for this long expire (0: only the store's own eviction, maxmemory and allkeys-lru, "
        "bounds them)",
    )
    kv_remote_timeout_seconds: float = setting(
        1.0, "a remote store operation not answered within this long fails, and the store is taken for down"
    )
    speculation: str = setting(
        "off",
        "speculative decoding for requests that do not choose (their `speculation` field): auto verifies draft "
        "tokens found by prompt lookup in the same step when the draft policy expects them to pay (a table of step "
        "times measured at start, when auto is the default); off decodes "
        "one token per step. Off by default: open-ended writing loses a few percent with it (docs/BENCH.md)",
        SPECULATION_MODES,
    )
    speculative_tokens: int = setting(
        10,
        "draft tokens per decoding request at most, proposed by prompt lookup over the request's prompt and "
        "output and verified in the same step (the draft policy offers fewer where they do not pay); 0 turns "
        "speculation off whatever requests ask",
    )
    prompt_lookup_max_ngram: int = setting(3, "longest suffix of a request's tokens that prompt lookup matches")
    prompt_lookup_min_ngram: int = setting(1, "shortest suffix of a request's tokens that prompt lookup matches")
    speculative_max_seqs: int = setting(
        8, "speculate only while at most this many requests run: a larger batch already reads each weight for many"
    )
    kernel_cache_shapes: int = setting(
        64,
        "step shapes whose prepared kernels the CPU plugin keeps (its runtime cache and oneDNN's primitive "
        "cache, least recently used first out); each costs about 1.4 MB for SmolLM2, and with the plugin's "
        "defaults (5000 and 1024) memory grew with every new step shape",
    )

    @property
    def step_budget(self) -> int:
        """Tokens a step holds at most: max_num_batched_tokens, or SAFE_STEP_TOKENS until the engine has chosen
        one at start (warmup.choose_budget)."""
        return self.max_num_batched_tokens or SAFE_STEP_TOKENS

    def problems(self) -> list[str]:
        """What is out of range, one sentence each, naming the setting; empty when the config is usable."""
        checks = [
            (self.threads is None or self.threads >= 1, "threads must be at least 1"),
            (self.kv_cache_gb > 0, "kv_cache_gb must be > 0"),
            (self.dq_group_size is None or self.dq_group_size >= 0, "dq_group_size must be >= 0 (0 turns it off)"),
            (self.max_num_seqs >= 1, "max_num_seqs must be at least 1"),
            (
                self.max_num_batched_tokens is None or self.max_num_batched_tokens >= MIN_STEP_TOKENS,
                f"max_num_batched_tokens must be at least {MIN_STEP_TOKENS} (a prompt piece is at least two tokens)",
            ),
            (self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be at least 2"),
            (self.max_queue >= 0, "max_queue must be >= 0"),
            (self.max_n >= 1, "max_n must be at least 1"),
            (
                self.max_queued_per_tenant is None or self.max_queued_per_tenant >= 0,
                "max_queued_per_tenant must be >= 0",
            ),
            (self.batch_window_ms >= 0, "batch_window_ms must be >= 0"),
            (self.kv_disk_gb > 0, "kv_disk_gb must be > 0"),
            (
                0 <= self.kv_disk_ttl_seconds < math.inf,
                "kv_disk_ttl_seconds must be >= 0 and finite (0: no time limit)",
            ),
            (
                not self.kv_disk_dir or self.enable_prefix_caching,
                "kv_disk_dir needs prefix caching: it stores the prefix cache's blocks",
            ),
            (
                not self.kv_remote_url or self.kv_remote_url.split("://")[0] in REMOTE_SCHEMES,
                f"kv_remote_url must start with one of {', '.join(s + '://' for s in REMOTE_SCHEMES)}",
            ),
            (
                not self.kv_remote_url or self.enable_prefix_caching,
                "kv_remote_url needs prefix caching: it stores the prefix cache's blocks",
            ),
            (
                0 <= self.kv_remote_ttl_seconds < math.inf,
                "kv_remote_ttl_seconds must be >= 0 and finite (0: no time limit)",
            ),
            (0 < self.kv_remote_timeout_seconds < math.inf, "kv_remote_timeout_seconds must be > 0 and finite"),
            (self.kernel_cache_shapes >= 1, "kernel_cache_shapes must be at least 1"),
            (
                self.inference_precision in INFERENCE_PRECISIONS,
                f"inference_precision must be one of {', '.join(INFERENCE_PRECISIONS)}",
            ),
            (self.speculation in SPECULATION_MODES, f"speculation must be one of {', '.join(SPECULATION_MODES)}"),
            (self.speculative_tokens >= 0, "speculative_tokens must be >= 0"),
            (self.prompt_lookup_min_ngram >= 1, "prompt_lookup_min_ngram must be at least 1"),
            (
                self.prompt_lookup_max_ngram >= self.prompt_lookup_min_ngram,
                "prompt_lookup_max_ngram must be at least prompt_lookup_min_ngram",
            ),
            (self.speculative_max_seqs >= 1, "speculative_max_seqs must be at least 1"),
        ]
        return [message for ok, message in checks if not ok]
