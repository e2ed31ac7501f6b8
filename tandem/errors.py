"""The SDK's exceptions: one class per gRPC status code a Tandem server reports, named and coded by
the wire's error table (tandem.v1.errors), as the servers' own exceptions are.

`error_from_rpc` turns a failed call (sync or grpc.aio) into its class; every error carries the
server's message and the exact status code. Catch `TandemError` to catch them all.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import grpc
import grpc.aio

from tandem.v1.errors import kind_named, retry_after_hint

_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


class TandemError(Exception):
    """A Tandem call failed. `message` is the server's text; `code` the gRPC status code.

    `request_id` is set when the server had already named the request (an error mid-stream).
    A subclass's `default_code` is the one of the wire's error kind named like it.
    """

    default_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.default_code = kind_named(cls.__name__).code

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.default_code
        self.request_id: str | None = None


class InvalidRequest(TandemError):
    """A request field is invalid (INVALID_ARGUMENT); `field` names it when the message starts with it."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message, code)
        match = _FIELD_PREFIX.match(message)
        self.field: str | None = match.group(1) if match else None


class Unauthenticated(TandemError):
    """The API key is missing or wrong (UNAUTHENTICATED)."""


class PermissionDenied(TandemError):
    """The API key may not do this (PERMISSION_DENIED)."""


class NotFound(TandemError):
    """The named model (or request) does not exist (NOT_FOUND)."""


class FailedPrecondition(TandemError):
    """The deployment is not in a state that allows the call (FAILED_PRECONDITION)."""


class Overloaded(TandemError):
    """No capacity now (RESOURCE_EXHAUSTED); `retry_after` is the server's hint in seconds, if it sent one."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None, retry_after: float | None = None) -> None:
        super().__init__(message, code)
        self.retry_after = retry_after


class Unavailable(TandemError):
    """The server, or a worker the request needed, is unreachable or was lost (UNAVAILABLE);
    `retry_after` is the server's hint in seconds, if it sent one."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None, retry_after: float | None = None) -> None:
        super().__init__(message, code)
        self.retry_after = retry_after


class DeadlineExceeded(TandemError):
    """The call's deadline passed before it completed (DEADLINE_EXCEEDED)."""


class Cancelled(TandemError):
    """The call was cancelled (CANCELLED)."""


class Internal(TandemError):
    """The server failed in a way that is not the caller's fault (INTERNAL)."""


ERROR_BY_CODE: dict[grpc.StatusCode, type[TandemError]] = {
    cls.default_code: cls
    for cls in (InvalidRequest, Unauthenticated, PermissionDenied, NotFound, FailedPrecondition, Overloaded,
                Unavailable, DeadlineExceeded, Cancelled, Internal)
}


def error_from_status(
    code: grpc.StatusCode, message: str, trailing_metadata: tuple[tuple[str, str | bytes], ...] = ()
) -> TandemError:
    """The exception for a status; codes without a class of their own give a plain TandemError."""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(message, code, retry_after=retry_after_hint(trailing_metadata))
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(message, code, retry_after=retry_after_hint(trailing_metadata))
    return ERROR_BY_CODE.get(code, TandemError)(message, code)


def error_from_rpc(error: grpc.RpcError) -> TandemError:
    """The exception for a failed call of either grpc API (both expose code, details, trailing_metadata)."""
    if not isinstance(error, grpc.Call | grpc.aio.AioRpcError):
        return TandemError(str(error))
    return error_from_status(error.code(), error.details() or "", tuple(error.trailing_metadata() or ()))
