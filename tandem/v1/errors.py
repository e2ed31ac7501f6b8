"""The error contract of the tandem.v1 API: the name, gRPC status code and HTTP status of every
failure a Tandem server reports, the metadata keys of a retry hint and how it reads, and how a RequestError's code
number reads. Hand-written, beside the
generated stubs, because it is part of the wire contract as much as the .proto files are.

Two exception hierarchies speak it: the servers' (services.common.errors), which servicers raise
and the error interceptor turns into statuses, and the SDK's (tandem.errors), which clients catch.
Each class takes its status from the row named like the class, and a class named after no row
cannot be defined, so a client catches `Overloaded` where a server raised `Overloaded`. The table
lives here because it is the one place both may import: `tandem/` never imports `services/`, and
`services/common` takes nothing from `tandem/` but `tandem.v1`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

RETRY_AFTER_KEY = "retry-after"  # whole seconds, as HTTP's Retry-After
RETRY_AFTER_MS_KEY = "retry-after-ms"  # the same hint in milliseconds, when the server estimated it


def retry_after_hint(trailing_metadata: Sequence[tuple[str, str | bytes]]) -> float | None:
    """The retry hint a peer sent, in seconds: `retry-after-ms` when present, else `retry-after`;
    None when it sent neither (or nothing that parses as a number >= 0)."""
    values = dict(trailing_metadata)
    for key, scale in ((RETRY_AFTER_MS_KEY, 1000.0), (RETRY_AFTER_KEY, 1.0)):
        try:
            seconds = float(values[key]) / scale
        except (KeyError, ValueError):
            continue
        if 0 <= seconds < math.inf:
            return seconds
    return None


@dataclass(frozen=True, slots=True)
class ErrorKind:
    """One failure as the wire reports it: the exception class name both hierarchies give it, its
    gRPC status code, and its HTTP status on the OpenAI-compatible door."""

    name: str
    code: grpc.StatusCode
    http_status: int


ERROR_KINDS: tuple[ErrorKind, ...] = (
    ErrorKind("InvalidRequest", grpc.StatusCode.INVALID_ARGUMENT, 400),
    ErrorKind("Unauthenticated", grpc.StatusCode.UNAUTHENTICATED, 401),
    ErrorKind("PermissionDenied", grpc.StatusCode.PERMISSION_DENIED, 403),
    ErrorKind("NotFound", grpc.StatusCode.NOT_FOUND, 404),
    ErrorKind("FailedPrecondition", grpc.StatusCode.FAILED_PRECONDITION, 400),
    ErrorKind("Overloaded", grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    ErrorKind("Unavailable", grpc.StatusCode.UNAVAILABLE, 503),
    ErrorKind("DeadlineExceeded", grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    ErrorKind("Cancelled", grpc.StatusCode.CANCELLED, 499),  # nginx's status for a client that left
    ErrorKind("Internal", grpc.StatusCode.INTERNAL, 500),
)
_KIND_BY_NAME = {kind.name: kind for kind in ERROR_KINDS}
INTERNAL = _KIND_BY_NAME["Internal"]
_CODE_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def kind_named(name: str) -> ErrorKind:
    """The row for an exception class name; a TypeError naming the table when there is none."""
    try:
        return _KIND_BY_NAME[name]
    except KeyError:
        raise TypeError(f"no error kind is named {name!r}: an error class takes its name from a row of "
                        f"tandem.v1.errors.ERROR_KINDS; add the row (name, gRPC code, HTTP status) or "
                        f"use one of {', '.join(_KIND_BY_NAME)}") from None


def code_from_number(number: int) -> grpc.StatusCode:
    """The gRPC status code a RequestError carries as its number (INTERNAL for one gRPC does not define)."""
    return _CODE_BY_NUMBER.get(number, grpc.StatusCode.INTERNAL)
