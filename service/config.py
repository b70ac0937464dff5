"""Server settings: command-line flags, each defaulting to its OVSERVE_<FLAG_UPPER_SNAKE> environment variable."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

ENV_PREFIX = "OVSERVE_"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class ServerConfig:
    """Defaults suit a 2-core box; on a 32-core server raise kv_cache_gb, max_num_seqs and
    max_num_batched_tokens (see README). threads=None uses every CPU this process may run on."""

    model: str
    host: str = "127.0.0.1"  # 0.0.0.0 in containers (the k8s ConfigMap sets OVSERVE_HOST)
    port: int = 50051
    metrics_port: int = 9090  # 0 disables the metrics endpoint
    threads: int | None = None
    kv_cache_gb: float = 1.0
    kv_cache_precision: str = "u8"
    dq_group_size: int | None = None  # None: the CPU plugin's default (32)
    fast_single_stream: bool = False
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    max_queue: int = 256
    batch_window_ms: float = 0.0
    enable_prefix_caching: bool = True
    max_concurrent_streams: int = 256  # per HTTP/2 connection
    max_message_bytes: int = 4 << 20
    drain_grace_seconds: float = 30.0
    log_format: str = "text"
    auth_token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None


HELP = {
    "model": "folder written by `python -m convert` (required)",
    "host": "address to bind (use 0.0.0.0 in containers)",
    "port": "gRPC port (0: any free port)",
    "metrics_port": "Prometheus metrics HTTP port; 0 disables it",
    "threads": "inference threads (default: the CPUs this process may use)",
    "kv_cache_gb": "KV cache budget in GiB",
    "kv_cache_precision": "KV cache element type",
    "dq_group_size": "activation channels per dynamic-quantization group in int8 matmuls (default: the CPU "
    "plugin's, 32; 64 measured 5-10%% faster with slightly larger logit error; 0 turns it off)",
    "fast_single_stream": "compile a second copy of the model, without dynamic quantization, for steps of one "
    "token (one stream decoding): faster single-stream decode, a second copy of the weights in memory",
    "max_num_seqs": "requests generated together at most",
    "max_num_batched_tokens": "tokens per engine step at most (prompt chunks and decode tokens)",
    "max_model_len": "context limit (default: the model's, capped by what the KV cache holds)",
    "max_queue": "requests waiting beyond the running ones before RESOURCE_EXHAUSTED",
    "batch_window_ms": "wait this long after an arrival to gather a burst into one step",
    "enable_prefix_caching": "reuse the KV cache of shared prompt prefixes",
    "max_concurrent_streams": "concurrent RPCs per client connection (HTTP/2 streams)",
    "max_message_bytes": "largest request or response message",
    "drain_grace_seconds": "on SIGTERM, time given to in-flight requests before they are cancelled",
    "log_format": "log lines as text or one JSON object per line",
    "auth_token_file": "require `authorization: Bearer <token>` (the file's content) on all but health checks",
    "tls_cert": "TLS certificate chain (PEM); with --tls-key serves TLS only",
    "tls_key": "TLS private key (PEM)",
}
CHOICES = {"kv_cache_precision": ("u8", "f16", "f32"), "log_format": ("text", "json")}


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value not in TRUE + FALSE:
        raise argparse.ArgumentTypeError(f"expected one of {TRUE + FALSE}, got {text!r}")
    return value in TRUE


def parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m service",
        description="Serve a converted model over gRPC. Every flag can also be set in the environment as "
        f"{ENV_PREFIX}<FLAG_IN_UPPER_SNAKE_CASE>, e.g. {ENV_PREFIX}KV_CACHE_GB=4; flags win.",
    )
    defaults = ServerConfig(model="")
    for f in fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name) if f.name != "model" else None
        kind = f.type.split(" | ")[0]  # annotations are strings (from __future__ import annotations)
        text = env.get(env_name(f.name))
        help_text = f"{HELP[f.name]} [env {env_name(f.name)}]"
        if kind == "bool":
            if text:
                default = _bool(text)
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            continue
        convert = {"int": int, "float": float, "str": str}[kind]
        if text:
            try:
                default = convert(text)
            except ValueError:
                p.error(f"{env_name(f.name)}={text!r} is not a valid {kind}")
        p.add_argument(flag, type=convert, default=default, choices=CHOICES.get(f.name), help=help_text)
    return p


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> ServerConfig:
    p = parser(os.environ if env is None else env)
    args = p.parse_args(argv)
    if not args.model:
        p.error(f"--model (or {env_name('model')}) is required")
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together")
    for name in ("port", "metrics_port"):
        if not 0 <= getattr(args, name) <= 65535:
            p.error(f"--{name.replace('_', '-')} must be in [0, 65535]")
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_concurrent_streams", "max_message_bytes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    if args.dq_group_size is not None and args.dq_group_size < 0:
        p.error("--dq-group-size must be >= 0 (0 turns dynamic quantization off)")
    if args.kv_cache_gb <= 0 or args.drain_grace_seconds < 0 or args.max_queue < 0 or args.batch_window_ms < 0:
        p.error("--kv-cache-gb must be > 0; --drain-grace-seconds, --max-queue, --batch-window-ms >= 0")
    return ServerConfig(**vars(args))
