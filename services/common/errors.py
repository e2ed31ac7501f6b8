"""Domain errors of every Tandem service. Each class's gRPC status code and HTTP status is the row of
the wire's error table (tandem.v1.errors) named like the class, the table the SDK's exceptions
(tandem.errors) take theirs from too.

Servicers raise these; the error interceptor (grpc_server.py) turns them into statuses,
and clients turn statuses back into them with `error_from_status`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import grpc

from tandem.v1 import common_pb2
from tandem.v1.errors import (INTERNAL, RETRY_AFTER_KEY, RETRY_AFTER_MS_KEY, ErrorKind, code_from_number, kind_named,
                             retry_after_hint)

DEFAULT_RETRY_AFTER_S = 1.0  # the hint when a peer sent none


class TandemError(Exception):
    """Base of the errors a service reports to its caller; the message says what to change.

    The base is INTERNAL; a subclass is the wire's error kind named like it (a TypeError otherwise).
    """

    kind: ClassVar[ErrorKind] = INTERNAL

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.kind = kind_named(cls.__name__)

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

    def __init__(self, message: str, retry_after: float = DEFAULT_RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return retry_metadata(self.retry_after)


class Unavailable(TandemError):
    """A service or worker the request needs is unreachable or was lost; `retry_after` (seconds) is
    sent as a hint when known."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return () if self.retry_after is None else retry_metadata(self.retry_after)


class DeadlineExceeded(TandemError):
    """The request's deadline passed before it could complete."""


class Unauthenticated(TandemError):
    """Missing or wrong credentials."""


class FailedPrecondition(TandemError):
    """The system is not in a state that allows the operation (e.g. mismatched block sizes)."""


# The errors rebuilt from a status by their message alone (the others carry a field or a retry hint).
_PLAIN_ERROR_BY_CODE = {cls.kind.code: cls for cls in (Unauthenticated, NotFound, FailedPrecondition, DeadlineExceeded)}


def grpc_status(error: TandemError) -> grpc.StatusCode:
    """The gRPC status code an error is reported with."""
    return error.kind.code


def http_status(error: TandemError) -> int:
    """The HTTP status an error is reported with (the OpenAI-compatible API)."""
    return error.kind.http_status


def error_from_status(
    code: grpc.StatusCode, message: str, trailing_metadata: Sequence[tuple[str, str | bytes]] = ()
) -> TandemError:
    """Rebuild the domain error of a status received from another service (for relaying it unchanged)."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, sep, problem = message.partition(": ")
        return InvalidRequest(field, problem) if sep else InvalidRequest("request", message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        retry = retry_after_hint(trailing_metadata)
        return Overloaded(message, retry_after=DEFAULT_RETRY_AFTER_S if retry is None else retry)
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(message, retry_after=retry_after_hint(trailing_metadata))
    return _PLAIN_ERROR_BY_CODE.get(code, TandemError)(message)


def error_from_rpc(error: grpc.aio.AioRpcError) -> TandemError:
    """error_from_status for a failed grpc.aio call."""
    return error_from_status(error.code(), error.details() or "", tuple(error.trailing_metadata() or ()))


def retry_metadata(seconds: float) -> tuple[tuple[str, str], ...]:
    """A retry hint as trailing metadata: `retry-after` in whole seconds (rounded up, at least 1, as
    HTTP's Retry-After header takes it) and `retry-after-ms` with the precise value."""
    return ((RETRY_AFTER_KEY, str(max(1, math.ceil(seconds)))),
            (RETRY_AFTER_MS_KEY, str(max(0, round(seconds * 1000)))))


def rpc_error(code: grpc.StatusCode, details: str,
              trailing: Sequence[tuple[str, str]] = ()) -> grpc.aio.AioRpcError:
    """The error a failed grpc.aio call raises, for one request's failure on a stream that carries many
    (the Submissions and Assign streams), so its reader takes it as from a call of its own."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details)


def request_rpc_error(status: common_pb2.RequestError, retry_after_s: float | None) -> grpc.aio.AioRpcError:
    """rpc_error for a refusal or end carried on such a stream: a RequestError (code number and
    message) with its retry hint, which a call sends as trailing `retry-after`."""
    trailing = () if retry_after_s is None else retry_metadata(retry_after_s)
    return rpc_error(code_from_number(status.code), status.message, trailing)

