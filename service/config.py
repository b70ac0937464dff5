"""Server settings: command-line flags, each defaulting to its OVSERVE_<FLAG_UPPER_SNAKE> environment variable.

The flags are made from the fields of ServerConfig and EngineConfig (service/core/config.py), where each
default and help text is stated once."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import Field, dataclass, field, fields
from importlib import metadata
from pathlib import Path

from service.core.config import EngineConfig, setting

ENV_PREFIX = "OVSERVE_"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class ServerConfig:
    model: str = setting("", "folder written by `python -m convert` (required)")
    host: str = setting("127.0.0.1", "address to bind (use 0.0.0.0 in containers)")
    port: int = setting(50051, "gRPC port (0: any free port)")
    metrics_port: int = setting(9090, "Prometheus metrics HTTP port; 0 disables it")
    http_port: int = setting(8000, "OpenAI-compatible HTTP API and browser playground port; 0 disables it")
    max_concurrent_streams: int = setting(256, "concurrent RPCs per client connection (HTTP/2 streams)")
    max_message_bytes: int = setting(4 << 20, "largest request or response message (an HTTP body too)")
    drain_delay_seconds: float = setting(
        2.0,
        "on SIGTERM or SIGINT, health reports NOT_SERVING at once but new requests are still served this long, "
        "so that load balancers stop sending work before it is refused (cover their health-check interval; a "
        "second signal skips it)",
    )
    drain_grace_seconds: float = setting(30.0, "on SIGTERM, time given to in-flight requests before they are cancelled")
    http_head_timeout_seconds: float = setting(
        10.0,
        "HTTP: a connection that has not sent a whole request head this long after opening (or after its "
        "first byte following an idle keep-alive) is closed",
    )
    http_body_timeout_seconds: float = setting(
        30.0, "HTTP: a request whose body has not all arrived this long after its head is closed"
    )
    keep_alive_timeout_seconds: float = setting(
        15.0, "an idle connection (HTTP keep-alive, or a gRPC connection with no call) is closed after this long"
    )
    http_max_connections: int = setting(
        1000, "HTTP: open connections at most; connections beyond it are closed as they arrive"
    )
    log_format: str = setting("text", "log lines as text or one JSON object per line", ("text", "json"))
    auth_token_file: str | None = setting(
        None, "require `authorization: Bearer <token>` (the file's content) on all but health checks"
    )
    api_keys_file: str | None = setting(
        None,
        "API keys that each name a tenant, one `tenant key [weight]` a line (docs/API.md, Tenants): requests need "
        "`authorization: Bearer <key>` and are admitted fairly across tenants by weight. Read again when the file "
        "changes (or on SIGHUP); a file that cannot be used keeps the previous keys. Excludes --auth-token-file",
    )
    share_cache_across_tenants: bool = setting(
        False,
        "let the tenants of --api-keys-file share prefix-cache blocks (by default each tenant has its own, so no "
        "tenant can time another's prompts)",
    )
    tls_cert: str | None = setting(None, "TLS certificate chain (PEM); with --tls-key serves TLS only (gRPC and HTTP)")
    tls_key: str | None = setting(None, "TLS private key (PEM)")
    allowed_origins: str = setting(
        "",
        "browser pages of other origins allowed to call the HTTP API, comma-separated (e.g. "
        "https://app.example.com), or * for any; by default only the server's own host (its playground)",
    )
    allowed_hosts: str = setting(
        "",
        "names the HTTP API answers in the Host header besides localhost and IP addresses, comma-separated, or * "
        "for any; by default any when bound to a non-loopback address, none when bound to a loopback one "
        "(a web page that points its own name at 127.0.0.1, DNS rebinding, is refused)",
    )
    engine: EngineConfig = field(default_factory=EngineConfig)


def origins(text: str) -> set[str]:
    """--allowed-origins as browsers send an Origin: scheme://host[:port] in lower case, without a default port
    or a path (an extension's is chrome-extension://<id>); ValueError naming an entry that is not one ("*"
    stands for any)."""
    allowed = set()
    for entry in (e.strip().lower().rstrip("/") for e in text.split(",")):
        if not entry or entry == "*":
            allowed.update({entry} - {""})
            continue
        match = re.fullmatch(r"([a-z][a-z0-9+.\-]*)://([a-z0-9.\-\[\]:]+?)(:\d+)?", entry)
        if match is None:
            raise ValueError(f"{entry!r} is not an origin (scheme://host[:port], without a path)")
        scheme, host, port = match.groups()
        default = {"http": ":80", "https": ":443"}.get(scheme)
        allowed.add(f"{scheme}://{host}{'' if port in (None, default) else port}")
    return allowed


def hosts(text: str) -> set[str]:
    """--allowed-hosts as names in lower case, without a trailing dot ("*" stands for any); ValueError naming an
    entry that is not a host name (a port, a scheme or a path)."""
    allowed = set()
    for entry in (e.strip().lower().rstrip(".") for e in text.split(",")):
        if entry and entry != "*" and not re.fullmatch(r"[a-z0-9_]([a-z0-9_.\-]*[a-z0-9_])?", entry):
            raise ValueError(f"{entry!r} is not a host name (no scheme, port or path)")
        allowed.update({entry} - {""})
    return allowed


# --help lists the flags in these groups, in this order; an engine setting not named here goes under "engine".
GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("model", "chat_template", "max_model_len"),
    "serving": (
        *("host", "port", "http_port", "metrics_port", "log_format", "max_message_bytes", "max_concurrent_streams"),
        *("http_head_timeout_seconds", "http_body_timeout_seconds", "keep_alive_timeout_seconds"),
        *("http_max_connections", "drain_delay_seconds", "drain_grace_seconds"),
    ),
    "security": ("auth_token_file", "tls_cert", "tls_key", "allowed_origins", "allowed_hosts"),
    "tenants": ("api_keys_file", "share_cache_across_tenants", "max_queued_per_tenant", "fair_admission"),
    "engine": (),
    "cache": ("kv_cache_gb", "kv_cache_precision", "enable_prefix_caching", "kv_disk_dir", "kv_disk_gb"),
    "speculation": ("speculation", "speculative_tokens", "prompt_lookup_max_ngram", "prompt_lookup_min_ngram"),
}


def group_of(name: str) -> str:
    if name.startswith(("kv_disk_", "kv_remote_")):
        return "cache"
    if name.startswith("speculative_") or name.startswith("prompt_lookup_"):
        return "speculation"
    return next((group for group, names in GROUPS.items() if name in names), "engine")


def version_text() -> str:
    """ovserve's version and OpenVINO's, read from the installed packages' metadata (importing OpenVINO takes a
    while, and --version should not)."""
    found = []
    for name, shown in (("ovserve", "ovserve"), ("openvino", "OpenVINO")):
        try:
            found.append(f"{shown} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{shown} (not installed)")
    return ", ".join(found)


def flag_fields() -> list[Field]:
    """Every field that is a flag: the server's, then the engine's."""
    return [f for f in fields(ServerConfig) if f.name != "engine"] + list(fields(EngineConfig))


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
        usage="python -m service --model DIR [options]",
        description="Serve a converted model over gRPC and an OpenAI-compatible HTTP API. Every flag can also be "
        f"set in the environment as {ENV_PREFIX}<FLAG_IN_UPPER_SNAKE_CASE>, e.g. {ENV_PREFIX}KV_CACHE_GB=4; flags win.",
    )
    p.add_argument("--version", action="version", version=version_text())
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    for f in flag_fields():
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.name != "model" else None
        kind = str(f.type).split(" | ")[0]  # annotations are strings (from __future__ import annotations)
        text = env.get(env_name(f.name))
        group = groups[group_of(f.name)]
        if kind == "bool":
            if text:
                default = _bool(text)
            # argparse adds the default to a boolean flag's help itself
            help_text = f"{f.metadata['help']} [env {env_name(f.name)}]"
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            continue
        shown = "" if f.name == "model" else f"default {f.default if f.default is not None else 'unset'}; "
        help_text = f"{f.metadata['help']} ({shown}env {env_name(f.name)})".replace("%", "%%")
        convert = {"int": int, "float": float, "str": str}[kind]
        if text:
            try:
                default = convert(text)
            except ValueError:
                p.error(f"{env_name(f.name)}={text!r} is not a valid {kind}")
            # argparse checks choices only of values given as flags, never of a default
            choices = f.metadata["choices"]
            if choices is not None and default not in choices:
                p.error(f"{env_name(f.name)}={text!r} is not one of {', '.join(choices)}")
        group.add_argument(flag, type=convert, default=default, choices=f.metadata["choices"], help=help_text)
    return p


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> ServerConfig:
    p = parser(os.environ if env is None else env)
    args = vars(p.parse_args(argv))
    if not args["model"]:
        p.error(f"--model (or {env_name('model')}) is required")
    if args["auth_token_file"] and args["api_keys_file"]:
        p.error("--auth-token-file and --api-keys-file exclude each other (a token can be a line of the keys file)")
    if bool(args["tls_cert"]) != bool(args["tls_key"]):
        p.error("--tls-cert and --tls-key go together")
    for name in ("port", "metrics_port", "http_port"):
        if not 0 <= args[name] <= 65535:
            p.error(f"--{name.replace('_', '-')} must be in [0, 65535]")
    for name in ("max_concurrent_streams", "max_message_bytes", "http_max_connections"):
        if args[name] < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("drain_delay_seconds", "drain_grace_seconds"):
        if args[name] < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    for name in ("http_head_timeout_seconds", "http_body_timeout_seconds", "keep_alive_timeout_seconds"):
        if not args[name] > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    for name in ("auth_token_file", "tls_cert", "tls_key", "chat_template"):
        path = args[name] and Path(args[name])
        if path and not path.is_file():
            p.error(f"--{name.replace('_', '-')} {path}: {'not a file' if path.exists() else 'no such file'}")
    try:
        origins(args["allowed_origins"])
    except ValueError as exc:
        p.error(f"--allowed-origins: {exc}")
    try:
        hosts(args["allowed_hosts"])
    except ValueError as exc:
        p.error(f"--allowed-hosts: {exc}")
    engine = EngineConfig(**{f.name: args.pop(f.name) for f in fields(EngineConfig)})
    for problem in engine.problems():
        name, rest = problem.split(" ", 1)
        p.error(f"--{name.replace('_', '-')} {rest}")
    return ServerConfig(**args, engine=engine)
