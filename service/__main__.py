"""python -m service --model DIR [flags]: serve a converted model over gRPC until SIGTERM or SIGINT.

Answers at once (health NOT_SERVING, generation UNAVAILABLE) while the model loads and warms up, then
SERVING. On SIGTERM or SIGINT: NOT_SERVING, new requests UNAVAILABLE, in-flight requests get
--drain-grace-seconds to finish, then exit 0."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys

from service.config import ServerConfig, parse_args
from service.server import Server

log = logging.getLogger("service")
# Fields the server attaches to its log records (logging's `extra`); never prompt or reply text.
RECORD_FIELDS = ("request_id", "rpc", "code", "seconds", "prompt_tokens", "completion_tokens", "cached_prompt_tokens")


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


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{name}={getattr(record, name)}" for name in RECORD_FIELDS if hasattr(record, name))
        text = super().format(record)
        return f"{text} {fields}" if fields else text


def setup_logging(log_format: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)


async def serve(config: ServerConfig) -> int:
    server = Server(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    load = asyncio.create_task(server.load())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({load, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if load.done() and load.exception() is not None:
        log.error("cannot load the model from %s", config.model, exc_info=load.exception())
        await server.drain()
        return 1
    await stopping
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
