"""Errors in OpenAI's error body, with the HTTP status of each kind in one table (STATUS_OF)."""

from __future__ import annotations

from dataclasses import dataclass

from service.errors import (
    DeadlineExceeded,
    EngineFailure,
    InvalidArgument,
    QueueFull,
    ServiceError,
    Unauthenticated,
    Unavailable,
    status_lookup,
)


class NotFound(ServiceError):
    """An unknown model name or path. param names what was not found (e.g. `model`)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


class CrossOrigin(ServiceError):
    """A browser request from a page of another origin."""


class HostNotAllowed(ServiceError):
    """A request whose Host header names a host this server does not answer (DNS rebinding)."""


class TooLarge(ServiceError):
    """The request body is larger than --max-message-bytes."""


@dataclass(frozen=True)
class Status:
    code: int
    type: str  # OpenAI's error.type
    error_code: str  # OpenAI's error.code: a stable token for programs


# The one table from errors to HTTP statuses; anything else (EngineFailure included) is INTERNAL.
INTERNAL = Status(500, "server_error", "internal_error")
STATUS_OF: dict[type[Exception], Status] = {
    InvalidArgument: Status(400, "invalid_request_error", "invalid_value"),
    Unauthenticated: Status(401, "authentication_error", "invalid_api_key"),
    CrossOrigin: Status(403, "permission_error", "cross_origin"),
    HostNotAllowed: Status(403, "permission_error", "host_not_allowed"),
    NotFound: Status(404, "invalid_request_error", "model_not_found"),  # OpenAI's code: only models are looked up
    TooLarge: Status(413, "invalid_request_error", "request_too_large"),
    QueueFull: Status(429, "rate_limit_error", "queue_full"),
    Unavailable: Status(503, "service_unavailable", "unavailable"),
    DeadlineExceeded: Status(504, "timeout_error", "deadline_exceeded"),
    EngineFailure: INTERNAL,
}


def status_of(exc: BaseException) -> Status:
    return status_lookup(exc, STATUS_OF, INTERNAL)


def error_body(exc: BaseException) -> dict[str, object]:
    """OpenAI's error object. Domain errors carry a message written for the client; anything else is not
    leaked in detail."""
    status = status_of(exc)
    if isinstance(exc, ServiceError):
        message = exc.client_message  # it may quote what the client sent
    else:
        message = f"internal error ({type(exc).__name__}); see the server log"
    param = getattr(exc, "field", None) or getattr(exc, "param", None)
    return {"error": {"message": message, "type": status.type, "param": param, "code": status.error_code}}
