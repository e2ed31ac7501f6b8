"""Domain errors of every Tandem service and their one mapping to gRPC status codes and HTTP statuses.

Servicers raise these; the error interceptor (grpc_server.py) turns them into statuses,
and clients turn statuses back into them with `error_from_status`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import grpc

RETRY_AFTER_KEY = "retry-after"


class TandemError(Exception):
    """Base of the errors a service reports to its caller; the message says what to change."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """Extra metadata sent with the status."""
        return ()


class InvalidRequest(TandemError):
    """A request field is invalid; the message starts with the field's name."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class NotFound(TandemError):
    """The named thing (model, request, reservation) does not exist."""


class Overloaded(TandemError):
    """No capacity now (full queue, no free blocks); the caller may retry after retry_after seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((RETRY_AFTER_KEY, str(max(1, math.ceil(self.retry_after)))),)


class Unavailable(TandemError):
    """A service or worker the request needs is unreachable or was lost."""


class DeadlineExceeded(TandemError):
    """The request's deadline passed before it could complete."""


class Unauthenticated(TandemError):
    """Missing or wrong credentials."""


class FailedPrecondition(TandemError):
    """The system is not in a state that allows the operation (e.g. mismatched block sizes)."""


# The one mapping: error class -> (gRPC status code, HTTP status).
STATUS_BY_ERROR: dict[type[TandemError], tuple[grpc.StatusCode, int]] = {
    InvalidRequest: (grpc.StatusCode.INVALID_ARGUMENT, 400),
    Unauthenticated: (grpc.StatusCode.UNAUTHENTICATED, 401),
    NotFound: (grpc.StatusCode.NOT_FOUND, 404),
    FailedPrecondition: (grpc.StatusCode.FAILED_PRECONDITION, 400),
    Overloaded: (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    Unavailable: (grpc.StatusCode.UNAVAILABLE, 503),
    DeadlineExceeded: (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
}
_INTERNAL = (grpc.StatusCode.INTERNAL, 500)


def grpc_status(error: TandemError) -> grpc.StatusCode:
    """The gRPC status code an error is reported with."""
    return _lookup(type(error))[0]


def http_status(error: TandemError) -> int:
    """The HTTP status an error is reported with (the OpenAI-compatible API)."""
    return _lookup(type(error))[1]


def _lookup(cls: type[TandemError]) -> tuple[grpc.StatusCode, int]:
    for klass in cls.__mro__:
        if klass in STATUS_BY_ERROR:
            return STATUS_BY_ERROR[klass]
    return _INTERNAL


def error_from_status(
    code: grpc.StatusCode, message: str, trailing_metadata: Sequence[tuple[str, str | bytes]] = ()
) -> TandemError:
    """Rebuild the domain error of a status received from another service (for relaying it unchanged)."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, sep, problem = message.partition(": ")
        return InvalidRequest(field, problem) if sep else InvalidRequest("request", message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        retry = dict(trailing_metadata).get(RETRY_AFTER_KEY, "1")
        return Overloaded(message, retry_after=float(retry))
    for cls, (status, _) in STATUS_BY_ERROR.items():
        if status == code:
            return cls(message)
    return TandemError(message)


def error_from_rpc(error: grpc.aio.AioRpcError) -> TandemError:
    """error_from_status for a failed grpc.aio call."""
    return error_from_status(error.code(), error.details() or "", tuple(error.trailing_metadata() or ()))
