"""Server-sent events as OpenAI streams them: one `data:` line of JSON per event, `data: [DONE]` last (chat and
completions), or typed events with an `event:` line (responses)."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
# No caching, and no buffering by proxies such as nginx: each token must reach the client as it is made.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MEDIA_TYPE = "text/event-stream"


def event(data: dict[str, Any]) -> bytes:
    # json.dumps escapes newlines inside strings, so an event is always exactly one data line.
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def named_event(name: str, data: dict[str, Any]) -> bytes:
    """An event with its type on an `event:` line too, as the Responses API streams them."""
    return b"event: " + name.encode() + b"\n" + event(data)
