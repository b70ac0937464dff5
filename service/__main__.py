"""python -m service --model DIR [flags]: serve a converted model over gRPC until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys

from service.config import ServerConfig, parse_args
from service.server import Server


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if hasattr(record, "request_id"):
            line["request_id"] = record.request_id
        return json.dumps(line)


def setup_logging(config: ServerConfig) -> None:
    handler = logging.StreamHandler()
    if config.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])


async def serve(config: ServerConfig) -> None:
    server = Server(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    load = asyncio.create_task(server.load())
    await stop.wait()
    logging.getLogger("service").info("signal received: draining")
    if not load.done():
        load.cancel()
    await server.drain()


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    setup_logging(config)
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
