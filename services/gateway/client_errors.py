"""What a client is told when its request fails after the gateway accepted it: one stable message per
status, naming the request id, with the scheduler's retry hint (or the default) on RESOURCE_EXHAUSTED
and UNAVAILABLE. What the upstream said (worker ids and addresses, a worker's own words) is for the
operator: it goes to the gateway's log and the request's span, never to the client.
"""

from __future__ import annotations

from services.common.errors import (
    DEFAULT_RETRY_AFTER_S, DeadlineExceeded, FailedPrecondition, InvalidRequest, NotFound, Overloaded, TandemError,
    Unavailable,
)

BUSY = "the server is at capacity; retry after the delay in retry-after"
NO_WORKER = "no worker can run the request now (none is available, or the one running it was lost); retry after " \
            "the delay in retry-after"
NO_SCHEDULER = "no scheduler can be reached now; retry after the delay in retry-after"
DEADLINE = "the request's deadline passed before it completed"
INTERNAL = "the request failed inside the server; the operator can look it up by its request id"


def for_client(error: TandemError, request_id: str, scheduler_unreached: bool = False) -> TandemError:
    """The error to send for a request that failed upstream. Errors about the request itself
    (INVALID_ARGUMENT, NOT_FOUND) keep their message, which names the field to fix, and so does
    FAILED_PRECONDITION (a model the scheduler serves only once provisioned; the scheduler words a
    worker's own FAILED_PRECONDITION without the worker's detail). UNAVAILABLE
    says whether no scheduler could be reached (`scheduler_unreached`) or no worker could run it."""
    if isinstance(error, InvalidRequest | NotFound | FailedPrecondition):
        return error
    if isinstance(error, Overloaded):
        return Overloaded(_named(BUSY, request_id), retry_after=error.retry_after)
    if isinstance(error, Unavailable):
        retry = DEFAULT_RETRY_AFTER_S if error.retry_after is None else error.retry_after
        return Unavailable(_named(NO_SCHEDULER if scheduler_unreached else NO_WORKER, request_id), retry_after=retry)
    if isinstance(error, DeadlineExceeded):
        return DeadlineExceeded(_named(DEADLINE, request_id))
    return TandemError(_named(INTERNAL, request_id))


def _named(message: str, request_id: str) -> str:
    return f"{message} (request {request_id})"
