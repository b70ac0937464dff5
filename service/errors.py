"""Domain errors raised by the engine and the fronts; each front maps them to its status codes in one table
(service/rpc/status.py, service/http/errors.py) through status_lookup."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

S = TypeVar("S")

# A client's error message at most (both fronts): messages may quote what the client sent
MAX_MESSAGE_CHARS = 1000


class ServiceError(Exception):
    """Base of every error the server translates into a status code."""

    @property
    def client_message(self) -> str:
        """The message for the client, cut to MAX_MESSAGE_CHARS: it may quote what the client sent, and a gRPC
        client refuses status details beyond 8 KiB."""
        message = str(self)
        return message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS] + "... (cut)"


class InvalidArgument(ServiceError):
    """A request field is out of range. The message names the field and the allowed range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class QueueFull(ServiceError):
    """The waiting queue is at its limit; the client should retry later."""


class Unauthenticated(ServiceError):
    """Missing or wrong bearer token (API key)."""


class Unavailable(ServiceError):
    """The engine is loading, draining or stopped."""


class DeadlineExceeded(ServiceError):
    """The request's deadline passed before it finished."""


class EngineFailure(ServiceError):
    """An unexpected error while stepping the model failed this request; the engine keeps serving."""


def status_lookup(exc: BaseException, table: Mapping[type[Exception], S], default: S) -> S:
    """The status of exc's nearest class in table (a subclass takes its base's), else default."""
    for kind in type(exc).__mro__:
        if kind in table:
            return table[kind]
    return default
