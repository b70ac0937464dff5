"""One API call's bookkeeping, the same for both fronts: its validated ids, the in-flight count drain waits
for, its metrics and its one log line (never prompt or reply text). Each front maps errors to its own status
codes and tells finish() what the call ended with."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from service.core.outputs import RequestOutput
from service.core.request import Tenant, check_label
from service.metrics import Metrics
from service.serving.state import Serving

log = logging.getLogger("service.call")

MAX_SHOWN_CHARS = 200  # of an error message quoted in a log line


class Call:
    """protocol: "grpc" or "http"; rpc: the method or endpoint. A generation call counts as in flight from its
    arrival to finish(), whatever front it came through, so that a drain waits for the same things on both."""

    def __init__(self, serving: Serving, metrics: Metrics, protocol: str, rpc: str, generation: bool = False) -> None:
        self.serving, self.metrics, self.protocol, self.rpc = serving, metrics, protocol, rpc
        self.started = time.monotonic()
        self.request_id: str | None = None  # set once validated: only then may it reach the log
        self.session_id: str | None = None  # likewise
        self.tenant: Tenant | None = None  # once authenticated (a configured tenant: a bounded metric label)
        self.output: RequestOutput | None = None  # the last one, once finished
        self.error: Exception | None = None  # what ended a reply already under way (its status is sent)
        self.finished = False
        self.in_flight = generation
        if generation:
            serving.num_in_flight += 1

    @property
    def tenant_name(self) -> str:
        """The tenant's name, empty before it is known (a call refused first)."""
        return self.tenant.name if self.tenant is not None else ""

    def label(self, given: str | None, field: str = "request_id") -> str:
        """The request's id: the client's, once checked (it is echoed and logged), or a new one."""
        self.request_id = check_label(given, field) if given is not None else uuid.uuid4().hex
        return self.request_id

    def finish(self, code: str | int, exc: BaseException | None = None, failed: bool = False) -> None:
        """Count the call under its status code and log it, once. exc: what refused it (a client's error or an
        unavailable engine) or, with failed, the bug that broke it (logged with its traceback)."""
        if self.finished:
            return
        self.finished = True
        try:
            seconds = time.monotonic() - self.started
            self.metrics.observe_call(self.protocol, self.rpc, code, seconds, self.output, self.tenant_name)
            if self.request_id is None and exc is None:
                return  # health probes, model lists: nothing worth a line
            extra = self.record(code, seconds)
            if failed:
                log.error("request failed", extra=extra, exc_info=exc)
            elif exc is not None:
                log.info("request refused: %s", str(exc)[:MAX_SHOWN_CHARS], extra=extra)
            else:
                log.info("request done", extra=extra)
        finally:
            # last: a call no longer in flight (what a drain waits for) has been counted and logged
            if self.in_flight:
                self.serving.num_in_flight -= 1

    def record(self, code: str | int, seconds: float) -> dict[str, Any]:
        """logging's `extra` for the finished call; ids appear only once validated."""
        record: dict[str, Any] = {
            "protocol": self.protocol,
            "rpc": self.rpc,
            "code": code,
            "seconds": round(seconds, 4),
        }
        if self.request_id is not None:
            record["request_id"] = self.request_id
        if self.session_id is not None:
            record["session_id"] = self.session_id
        if self.tenant is not None:
            record["tenant"] = self.tenant.name
        usage = self.output.usage if self.output is not None else None
        if usage is not None:
            record["prompt_tokens"] = usage.prompt_tokens
            record["completion_tokens"] = usage.completion_tokens
            record["cached_prompt_tokens"] = usage.cached_prompt_tokens
        return record
