"""The fields of a request's log line, the same for both front ends: never prompt or reply text."""

from __future__ import annotations

from typing import Any

from service.core.outputs import RequestOutput


def request_record(
    protocol: str,
    rpc: str,
    code: str | int,
    seconds: float,
    request_id: str | None,
    session_id: str | None,
    output: RequestOutput | None,
) -> dict[str, Any]:
    """logging's `extra` for one finished request; ids appear only once validated (None otherwise)."""
    record: dict[str, Any] = {"protocol": protocol, "rpc": rpc, "code": code, "seconds": round(seconds, 4)}
    if request_id is not None:
        record["request_id"] = request_id
    if session_id is not None:
        record["session_id"] = session_id
    if output is not None and output.usage is not None:
        record["prompt_tokens"] = output.usage.prompt_tokens
        record["completion_tokens"] = output.usage.completion_tokens
        record["cached_prompt_tokens"] = output.usage.cached_prompt_tokens
    return record
