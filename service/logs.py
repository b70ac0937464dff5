"""Log formats: plain text (one escaped line per record) or JSON lines, with the fields the fronts attach to a
request's record (logging's `extra`): never prompt or reply text."""

from __future__ import annotations

import json
import logging
import unicodedata

# Fields the server attaches to its log records (logging's `extra`); never prompt or reply text.
RECORD_FIELDS = (
    "request_id",
    "protocol",
    "session_id",
    "tenant",
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
