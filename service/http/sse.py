"""Server-sent events as OpenAI streams them: one `data:` line of JSON per event, `data: [DONE]` last."""

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
