"""The worker's end of an Assign stream (ColocatedService.Assign): many requests' admissions on one
call from a scheduler, each answered by a RunResult naming its call_id with the status a unary call
would have ended with.

Each RunRequest is admitted in a task of its own (a request may wait for its model to load while
the next ones are queued at once), bounded by its `timeout_ms` as a call's deadline bounded it; its
answer goes out as soon as it is known. The stream ends once the scheduler half-closed it and every
admission was answered; when the call ends early (the scheduler went away), admissions still under
way are cancelled, as a cancelled call's handler would be.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

from services.common.errors import DeadlineExceeded, Overloaded, TandemError, Unavailable, grpc_status
from tandem.v1 import common_pb2, worker_pb2

log = logging.getLogger(__name__)

# Queues one request; returns how many requests wait ahead of it. Raises TandemError to refuse it.
Admit = Callable[[worker_pb2.RunRequest], Awaitable[int]]


async def serve_assignments(requests: AsyncIterator[worker_pb2.RunRequest],
                            admit: Admit) -> AsyncIterator[worker_pb2.RunResult]:
    """ColocatedService.Assign: `admit` each request as it arrives; yield each one's RunResult."""
    answered: deque[worker_pb2.RunResult] = deque()
    admissions: set[asyncio.Task[None]] = set()
    ready = asyncio.Event()

    async def answer(request: worker_pb2.RunRequest) -> None:
        result = await _result(request, admit)
        admissions.discard(asyncio.current_task())  # type: ignore[arg-type]
        answered.append(result)
        ready.set()

    async def read() -> None:
        try:
            async for request in requests:
                admissions.add(asyncio.ensure_future(answer(request)))
        finally:
            ready.set()

    reader = asyncio.ensure_future(read())
    try:
        while True:
            if answered:
                yield answered.popleft()
            elif reader.done() and not admissions:
                reader.result()  # raises what ended the requests (a message that did not parse), if anything
                return
            else:
                ready.clear()
                await ready.wait()
    finally:
        reader.cancel()
        for task in list(admissions):
            task.cancel()


async def _result(request: worker_pb2.RunRequest, admit: Admit) -> worker_pb2.RunResult:
    """The request admitted within its timeout, or the status that refused it."""
    result = worker_pb2.RunResult(call_id=request.call_id, request_id=request.request_id)
    try:
        async with asyncio.timeout(request.timeout_ms / 1000 if request.timeout_ms > 0 else None):
            result.queue_position = await admit(request)
    except TimeoutError:
        _refuse(result, DeadlineExceeded(f"request {request.request_id!r} was not queued within "
                                         f"{request.timeout_ms} ms"))
    except TandemError as error:
        _refuse(result, error)
    except Exception as exc:  # noqa: BLE001 - one request's failure must not end the others' stream
        log.exception("admitting request %r failed", request.request_id)
        _refuse(result, TandemError(f"request {request.request_id!r}: the worker failed to queue it "
                                    f"(internal error: {type(exc).__name__}); its log has the detail"))
    return result


def _refuse(result: worker_pb2.RunResult, error: TandemError) -> None:
    result.status.CopyFrom(common_pb2.RequestError(code=grpc_status(error).value[0], message=error.message))
    retry_after = error.retry_after if isinstance(error, (Overloaded, Unavailable)) else None
    if retry_after is not None:
        result.retry_after_s = retry_after
