"""The one table from domain errors to gRPC status codes, and the details a client is told."""

from __future__ import annotations

import grpc

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

# Anything else (EngineFailure included) is INTERNAL.
STATUS_OF: dict[type[Exception], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    EngineFailure: grpc.StatusCode.INTERNAL,
}


def status_of(exc: BaseException) -> grpc.StatusCode:
    return status_lookup(exc, STATUS_OF, grpc.StatusCode.INTERNAL)


def status_details(exc: BaseException) -> str:
    """Domain errors carry a message written for the client, cut to MAX_MESSAGE_CHARS (a message may quote what
    the client sent, and status details travel in gRPC metadata, which a client refuses beyond 8 KiB); anything
    else is not leaked in detail."""
    if isinstance(exc, ServiceError):
        return exc.client_message
    return f"internal error ({type(exc).__name__}); see the server log"
