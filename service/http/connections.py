"""HTTP/1.1 connections with bounds: a request head must arrive within a deadline of the connection opening (or
of its first byte after an idle keep-alive), its body within a deadline of the head, an idle keep-alive
connection is closed after its own limit (uvicorn's), and connections beyond a cap are closed at once. Without
them a client that opens connections and sends nothing holds each one, and a file descriptor, forever.
Errors of the HTTP parser itself are answered in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    head_seconds: float  # from opening (or the first byte after idling) to the end of the request head
    body_seconds: float  # from the end of the head to the end of the body
    max_connections: int  # open at once; more are closed as they arrive


REASONS = {
    "head_timeout": "no whole request head in time (--http-head-timeout-seconds)",
    "body_timeout": "no whole request body in time (--http-body-timeout-seconds)",
    "connection_limit": "too many open connections (--http-max-connections)",
}


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with Limits (set on a subclass by with_limits)."""

    limits: Limits
    drop_log: DropLog
    on_dropped: Any = None  # called with the reason when a connection is closed for a limit

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deadline: asyncio.TimerHandle | None = None
        self.waiting_for: str | None = None  # "head" or "body": what the deadline is for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.drop("connection_limit")
            return
        self.expect("head", self.limits.head_seconds)

    def connection_lost(self, exc: Exception | None) -> None:
        self.expect(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self.waiting_for != "body":
                self.expect("body", self.limits.body_seconds)
        elif state is h11.IDLE:
            if self.waiting_for is None and not self.transport.is_closing():  # a next request has begun
                self.expect("head", self.limits.head_seconds)
        else:
            self.expect(None)

    def expect(self, what: str | None, seconds: float = 0.0) -> None:
        """Close the connection unless `what` has arrived within seconds (None: nothing is awaited)."""
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        self.waiting_for = what
        if what is not None:
            self.deadline = self.loop.call_later(seconds, self.drop, f"{what}_timeout")

    def drop(self, reason: str) -> None:
        """Close the connection for a limit: reason is head_timeout, body_timeout or connection_limit."""
        self.expect(None)
        if self.transport.is_closing():
            return
        self.drop_log.note(reason)
        if self.on_dropped is not None:
            self.on_dropped(reason)
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """What the parser refuses (a malformed request line or header, a head too large), as OpenAI's error."""
        body = json.dumps(
            {"error": {"message": msg, "type": "invalid_request_error", "param": None, "code": "invalid_request"}}
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # a response had begun: nothing can be said any more
            pass
        self.transport.close()


class DropLog:
    """One log line per reason and LOG_EVERY_SECONDS at most, with the count since the last: a client that opens
    thousands of silent connections must not write thousands of lines."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.logged_at: dict[str, float] = {}

    def note(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        now = time.monotonic()
        if now - self.logged_at.get(reason, -LOG_EVERY_SECONDS) >= LOG_EVERY_SECONDS:
            log.info("closed %d HTTP connection(s): %s", self.counts.pop(reason), REASONS[reason])
            self.logged_at[reason] = now


LOG_EVERY_SECONDS = 60.0


def with_limits(limits: Limits, on_dropped: Any = None) -> type[BoundedH11Protocol]:
    """The protocol class uvicorn takes (Config(http=...)), with these limits."""
    fields = {"limits": limits, "on_dropped": staticmethod(on_dropped), "drop_log": DropLog()}
    return type("BoundedH11", (BoundedH11Protocol,), fields)
