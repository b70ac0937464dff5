"""python -m service --model DIR [flags]: serve a converted model over gRPC, and over the
OpenAI-compatible HTTP API on --http-port (service/http), until SIGTERM or SIGINT.

Answers at once (health NOT_SERVING, generation UNAVAILABLE) while the model loads and warms up, then
SERVING. On SIGTERM or SIGINT: NOT_SERVING, new requests UNAVAILABLE (HTTP 503), in-flight requests get
--drain-grace-seconds to finish, then exit 0. If the engine thread dies: NOT_SERVING at once, every
request UNAVAILABLE, exit 1 (so that a supervisor such as Kubernetes restarts the process)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import unicodedata

from service.config import ServerConfig, parse_args
from service.server import Server

log = logging.getLogger("service")
# Fields the server attaches to its log records (logging's `extra`); never prompt or reply text.
RECORD_FIELDS = (
    "request_id",
    "protocol",
    "session_id",
    "rpc",
    "code",
    "seconds",
    "prompt_tokens",
    "completion_tokens",
    "cached_prompt_tokens",
)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line |= {name: getattr(record, name) for name in RECORD_FIELDS if hasattr(record, name)}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def one_line(text: str) -> str:
    """Control and line-separator characters escaped: text from anywhere cannot start a forged log line."""
    return "".join(f"\\x{ord(c):02x}" if c < " " or unicodedata.category(c) in ("Cc", "Zl", "Zp") else c for c in text)


class TextFormatter(logging.Formatter):
    """One line per record (a traceback follows on its own lines); message and fields are escaped."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = one_line(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(
            f"{name}={one_line(str(getattr(record, name)))}" for name in RECORD_FIELDS if hasattr(record, name)
        )
        text = super().format(record)
        if not fields:
            return text
        first, newline, rest = text.partition("\n")
        return f"{first} {fields}{newline}{rest}"


def setup_logging(log_format: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)


async def serve(config: ServerConfig) -> int:
    try:
        server = Server(config)
    except (ValueError, OSError) as exc:  # a port is taken, the TLS files do not fit, the token file is empty
        log.error("cannot start: %s", exc)
        return 1
    try:
        await server.start()  # binds the metrics port, starts the HTTP server (its TLS context)
    except (ValueError, OSError, RuntimeError) as exc:
        log.error("cannot start: %s", exc)
        await server.drain(grace_seconds=0)  # what did start stops, and its ports are freed
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    load = asyncio.create_task(server.load())
    stopping = asyncio.create_task(stop.wait())
    failed = asyncio.create_task(server.engine_failed.wait())
    await asyncio.wait({load, stopping, failed}, return_when=asyncio.FIRST_COMPLETED)
    if load.done() and load.exception() is not None:
        log.error("cannot load the model from %s", config.model, exc_info=load.exception())
        await server.drain()
        return 1
    await asyncio.wait({stopping, failed}, return_when=asyncio.FIRST_COMPLETED)
    if failed.done():
        log.critical("the engine stopped unexpectedly; exiting with status 1")
        await server.drain(grace_seconds=0)  # nothing in flight can finish
        logging.shutdown()
        return 1
    log.info("signal received: draining for up to %.0f s", config.drain_grace_seconds)
    loading = not load.done()
    await server.drain()
    if loading:
        log.info("stopped while loading the model")
        logging.shutdown()
        os._exit(0)  # the loading thread cannot be interrupted; nothing else is left to finish
    return 0


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    setup_logging(config.log_format)
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
