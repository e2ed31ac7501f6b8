"""The scheduler's Assign stream to one colocated (or hybrid decode) worker: many requests' admissions
on one long-lived call (ColocatedService.Assign) instead of a unary call each.

`send` numbers the request on the call (call_id), sends it, and returns the future of its RunResult
within its timeout (`run` awaits it); the future holds the result, or fails with what a failed unary
call would raise: an AioRpcError with the
worker's status code, message and retry hint (trailing `retry-after`), DEADLINE_EXCEEDED when no
answer came in time (that request alone fails; the call, which may be dead without knowing it,
takes no more requests and ends once the others are answered), or the call's own status when it
broke (every request still unanswered on it fails with it, UNAVAILABLE when it ended without one).
The call is opened by the first request and again by the first one after it broke or timed out;
`half_close` lets a worker that leaves end it once its answers are out, `close` cancels it. The call carries the
internal token; each request carries its own timeout and trace context.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import grpc

from services.common.errors import request_rpc_error, rpc_error
from services.scheduler import message_counts
from services.scheduler.message_counts import ASSIGN, IN, OUT
from tandem.v1 import worker_pb2, worker_pb2_grpc


class AssignStream:
    """Call order: send()* or run()*, half_close() any time (the next one opens a new call), close() last."""

    def __init__(self, stub: worker_pb2_grpc.ColocatedServiceStub, metadata: tuple[tuple[str, str], ...]) -> None:
        self._stub = stub
        self._metadata = metadata
        self._call: _AssignCall | None = None

    def send(self, request: worker_pb2.RunRequest, timeout: float) -> asyncio.Future[worker_pb2.RunResult]:
        """The future of the request's admission on the worker within `timeout` seconds: its
        RunResult, or an AioRpcError. Cancelling the future leaves the request unanswered here (the
        worker may still queue it: abort it there). No task per request: a future the stream's
        reader settles."""
        if self._call is None or not self._call.open:
            self._call = _AssignCall(self._stub, self._metadata)
        return self._call.send(request, timeout)

    async def run(self, request: worker_pb2.RunRequest, timeout: float) -> worker_pb2.RunResult:
        """The request admitted on the worker within `timeout` seconds; an AioRpcError otherwise."""
        return await self.send(request, timeout)

    def half_close(self) -> None:
        """No more requests on this call: the worker ends it once it answered those sent."""
        if self._call is not None:
            self._call.half_close()

    def close(self) -> None:
        """Cancel the call: the requests still unanswered on it fail as UNAVAILABLE."""
        if self._call is not None:
            self._call.cancel()
            self._call = None


class _AssignCall:
    """One Assign call: the requests sent and not yet answered, by call_id, and its reader."""

    def __init__(self, stub: worker_pb2_grpc.ColocatedServiceStub, metadata: tuple[tuple[str, str], ...]) -> None:
        self.open = True  # takes new requests: not half-closed, not broken
        self._pending: dict[int, asyncio.Future[worker_pb2.RunResult]] = {}
        self._call_ids = itertools.count(1)
        self._outgoing: asyncio.Queue[worker_pb2.RunRequest | None] = asyncio.Queue()
        self._call = stub.Assign(self._sent(), metadata=metadata)
        self._reader = asyncio.ensure_future(self._read())  # held here: the loop keeps tasks only weakly

    def send(self, request: worker_pb2.RunRequest, timeout: float) -> asyncio.Future[worker_pb2.RunResult]:
        call_id = request.call_id = next(self._call_ids)
        request.timeout_ms = max(1, round(timeout * 1000))
        loop = asyncio.get_running_loop()
        answer = self._pending[call_id] = loop.create_future()
        timer = loop.call_later(timeout, self._expire, answer, timeout)  # lighter than wait_for's waiter

        def settled(_: asyncio.Future[worker_pb2.RunResult]) -> None:
            timer.cancel()
            self._pending.pop(call_id, None)

        answer.add_done_callback(settled)
        self._outgoing.put_nowait(request)
        return answer

    def half_close(self) -> None:
        if self.open:
            self.open = False
            self._outgoing.put_nowait(None)

    def _expire(self, answer: asyncio.Future[worker_pb2.RunResult], timeout: float) -> None:
        """No answer in time: the request fails alone, and the call takes no more (it may be dead
        without knowing it; the next request opens a fresh one, as a new unary call would)."""
        if not answer.done():
            answer.set_exception(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                                         f"no answer on the Assign stream within {timeout:g} s"))
            self.half_close()

    def cancel(self) -> None:
        self.open = False
        self._call.cancel()

    async def _sent(self) -> AsyncIterator[worker_pb2.RunRequest]:
        while (request := await self._outgoing.get()) is not None:
            if request.call_id in self._pending:  # else it timed out, or its caller left, before it went out
                message_counts.count(ASSIGN, OUT)
                yield request

    async def _read(self) -> None:
        try:
            async for result in self._call:
                message_counts.count(ASSIGN, IN)
                answer = self._pending.get(result.call_id)
                if answer is not None and not answer.done():
                    _settle(answer, result)
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the worker ended the Assign stream")
        except grpc.aio.AioRpcError as failure:
            error = failure
        except asyncio.CancelledError:  # the call, or its channel, was closed: the worker was lost or left
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the Assign stream was closed")
        self.open = False
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(error)



def _settle(answer: asyncio.Future[worker_pb2.RunResult], result: worker_pb2.RunResult) -> None:
    """The answer's outcome: the result when the worker queued the request, else its refusal as a
    unary call's AioRpcError (status code, message, retry hint)."""
    if result.status.code:
        answer.set_exception(request_rpc_error(result.status, result.retry_after_s
                                               if result.HasField("retry_after_s") else None))
    else:
        answer.set_result(result)
