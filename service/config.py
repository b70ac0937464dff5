"""Server settings: command-line flags, each with an OVSERVE_* environment variable as its default."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9090  # 0 disables the metrics endpoint
    threads: int | None = None
    kv_cache_gb: float = 1.0
    kv_cache_precision: str = "u8"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    max_queue: int = 256
    batch_window_ms: float = 0.0
    max_concurrent_streams: int = 512
    max_message_bytes: int = 4 << 20
    drain_grace_seconds: float = 30.0
    log_format: str = "text"
    log_prompts: bool = False
    auth_token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None


def _env(name: str, default: object) -> object:
    return os.environ.get("OVSERVE_" + name.upper(), default)


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    d = ServerConfig(model="")
    p = argparse.ArgumentParser(
        prog="python -m service",
        description="Serve a converted model over gRPC. "
        "Every flag can also be set as OVSERVE_<FLAG> in the environment.",
    )

    def add(flag: str, typ: type, default: object, help_text: str, **kw) -> None:
        name = flag.replace("-", "_")
        p.add_argument(f"--{flag}", type=typ, default=_env(name, default), help=help_text, **kw)

    add("model", str, None, "folder written by `python -m convert` (required)")
    add("host", str, d.host, "address to bind; 0.0.0.0 in containers")
    add("port", int, d.port, "gRPC port")
    add("metrics-port", int, d.metrics_port, "Prometheus metrics HTTP port; 0 disables it")
    add("threads", int, d.threads, "inference threads (default: the CPUs this process may use)")
    add("kv-cache-gb", float, d.kv_cache_gb, "KV cache budget in GiB")
    add("kv-cache-precision", str, d.kv_cache_precision, "KV cache element type", choices=("u8", "f16", "f32"))
    add("max-num-seqs", int, d.max_num_seqs, "requests batched together at most")
    add("max-num-batched-tokens", int, d.max_num_batched_tokens, "tokens per engine step at most")
    add("max-model-len", int, d.max_model_len, "context limit (default: the model's, capped by the KV cache)")
    add("max-queue", int, d.max_queue, "waiting requests beyond the running ones before RESOURCE_EXHAUSTED")
    add("batch-window-ms", float, d.batch_window_ms, "wait this long to gather arrivals into one step")
    add("max-concurrent-streams", int, d.max_concurrent_streams, "concurrent RPCs per connection")
    add("max-message-bytes", int, d.max_message_bytes, "largest request or response message")
    add("drain-grace-seconds", float, d.drain_grace_seconds, "on SIGTERM, time given to in-flight requests")
    add("log-format", str, d.log_format, "log line format", choices=("text", "json"))
    add("auth-token-file", str, d.auth_token_file, "require `authorization: Bearer <token>` with this file's token")
    add("tls-cert", str, d.tls_cert, "TLS certificate chain (PEM); with --tls-key enables TLS")
    add("tls-key", str, d.tls_key, "TLS private key (PEM)")
    p.add_argument(
        "--log-prompts",
        action="store_true",
        default=str(_env("log_prompts", "")).lower() in ("1", "true"),
        help="include prompt text in debug logs (off by default)",
    )
    args = p.parse_args(argv)
    if not args.model:
        p.error("--model (or OVSERVE_MODEL) is required")
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together")
    return ServerConfig(**{k: v for k, v in vars(args).items()})
