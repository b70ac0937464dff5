"""python -m service --model DIR [flags]: serve a converted model over gRPC, and over the OpenAI-compatible
HTTP API on --http-port, until SIGTERM or SIGINT (service/process.py says how it starts, drains and fails)."""

from __future__ import annotations

import asyncio
import sys

from service.config import parse_args
from service.logs import setup_logging
from service.process import run


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    setup_logging(config.log_format)
    return asyncio.run(run(config))


if __name__ == "__main__":
    sys.exit(main())
