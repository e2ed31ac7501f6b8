"""The gateway's end of the Submissions stream to one scheduler: every request the gateway submits
there rides one long-lived call, instead of a Submit call each (one call's cost in gRPC, per
request, on both sides). Each submission still reads as its own Submit call (`SubmitCall`: read()
gives its events, then grpc.aio.EOF; a status other than OK raises grpc.aio.AioRpcError with the
status code, message and retry hint the scheduler ended it with; cancel() aborts it), so attempt.py
and generation.py take the same outcomes as from a Submit call.

Model: the stream opens on the first submission and again on the first one after it ended. Commands
(submissions, cancels) and updates (events, ends) are batched as they become ready. When the stream
ends or breaks, each submission still open on it fails with the stream's status (UNAVAILABLE when it
ended without one), as its Submit call would have broken, and says so (`broke`; `reached` when the
stream had connected, so the scheduler may have placed it before its placement came). Every read is
bounded by the submission's timeout: past it, the submission is cancelled and fails with
DEADLINE_EXCEEDED, as a call's deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from services.common.errors import request_rpc_error, rpc_error
from services.common.grpc_server import INTERNAL_TOKEN_KEY
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc

# A message of commands stays well under the channels' 64 MiB limit, whatever the prompts waiting.
MESSAGE_BUDGET_BYTES = 4 << 20
_Metadata = Sequence[tuple[str, str]]
_Item = scheduler_pb2.SubmitEvent | grpc.aio.AioRpcError | object  # an event, a failure, or grpc.aio.EOF


class SubmitCall:
    """One submission on the stream, read as a Submit call. Call order: read() (or iterate) until
    EOF or an AioRpcError; cancel() at any time (a no-op once it ended)."""

    __slots__ = ("call_id", "broke", "reached", "_stream", "_deadline", "_items", "_ended")

    def __init__(self, call_id: int, stream: _Stream, timeout: float | None) -> None:
        self.call_id = call_id
        self.broke = False  # it failed because its stream did (not the scheduler's own answer)
        self.reached = False  # ... a stream that had connected: the scheduler may have placed it
        self._stream = stream
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._items: asyncio.Queue[_Item] = asyncio.Queue()
        self._ended = False

    async def read(self) -> scheduler_pb2.SubmitEvent | object:
        """The next event, or grpc.aio.EOF once the submission ended OK; raises its failure. A
        reader cancelled while it waits cancels the submission, as with a call's read()."""
        remaining = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
        try:
            item = await asyncio.wait_for(self._items.get(), remaining)
        except TimeoutError:
            self.cancel()
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except asyncio.CancelledError:
            self.cancel()
            raise
        if isinstance(item, grpc.aio.AioRpcError):
            self._items.put_nowait(item)  # read again, it raises again
            raise item
        if item is grpc.aio.EOF:
            self._items.put_nowait(item)
        return item

    async def __aiter__(self) -> AsyncIterator[scheduler_pb2.SubmitEvent]:
        while (event := await self.read()) is not grpc.aio.EOF:
            yield event

    def cancel(self) -> bool:
        """Abort the submission on the scheduler (as cancelling its Submit call); False once it ended."""
        if self._ended:
            return False
        self._end(rpc_error(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))
        self._stream.cancel(self.call_id)
        return True

    def take(self, update: scheduler_pb2.SubmitUpdate) -> None:
        """An update from the scheduler: an event, or the end (EOF on OK, else its status)."""
        if update.HasField("event"):
            self._items.put_nowait(update.event)
            return
        end = update.end
        if end.status.code == grpc.StatusCode.OK.value[0]:
            self._end(grpc.aio.EOF)
            return
        self._end(request_rpc_error(end.status, end.retry_after_s if end.HasField("retry_after_s") else None))

    def broken(self, error: grpc.aio.AioRpcError) -> None:
        """The stream ended or broke with the submission still open."""
        self.broke, self.reached = not self._ended, self._stream.connected
        self._end(error)

    def _end(self, item: _Item) -> None:
        if not self._ended:
            self._ended = True
            self._items.put_nowait(item)


class _Stream:
    """One open Submissions call and the submissions on it."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerServiceStub, metadata: _Metadata) -> None:
        self.open = True
        self.connected = False  # the call reached the scheduler
        self._calls: dict[int, SubmitCall] = {}
        self._commands: list[scheduler_pb2.SubmitCommand] = []
        self._wake = asyncio.Event()
        self._call = stub.Submissions(self._outgoing(), metadata=tuple(metadata))
        self._reader = asyncio.ensure_future(self._read())

    def submit(self, call: SubmitCall, submission: scheduler_pb2.Submission) -> None:
        self._calls[call.call_id] = call
        self._send(scheduler_pb2.SubmitCommand(call_id=call.call_id, submit=submission))

    def cancel(self, call_id: int) -> None:
        if self._calls.pop(call_id, None) is not None and self.open:
            self._send(scheduler_pb2.SubmitCommand(call_id=call_id, cancel=True))

    def close(self) -> None:
        self._end(rpc_error(grpc.StatusCode.CANCELLED, "the gateway closed the Submissions stream"))
        self._call.cancel()

    def _send(self, command: scheduler_pb2.SubmitCommand) -> None:
        self._commands.append(command)
        self._wake.set()

    async def _outgoing(self) -> AsyncIterator[scheduler_pb2.SubmitCommands]:
        """The commands ready, MESSAGE_BUDGET_BYTES of them at most to a message (prompts are large)."""
        while self.open:
            await self._wake.wait()
            self._wake.clear()
            while self._commands:
                size, count = 0, 0
                for command in self._commands:
                    size += command.ByteSize()
                    if count and size > MESSAGE_BUDGET_BYTES:
                        break
                    count += 1
                commands, self._commands = self._commands[:count], self._commands[count:]
                yield scheduler_pb2.SubmitCommands(commands=commands)

    async def _read(self) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the scheduler ended the Submissions stream")
        try:
            await self._call.wait_for_connection()
            self.connected = True
            async for message in self._call:
                for update in message.updates:
                    call = self._calls.get(update.call_id)
                    if call is None:
                        continue  # cancelled here already
                    if update.HasField("end"):
                        del self._calls[update.call_id]
                    call.take(update)
        except grpc.aio.AioRpcError as exc:
            error = exc
        finally:
            self._end(error)

    def _end(self, error: grpc.aio.AioRpcError) -> None:
        """No more updates come: the submissions still open fail with `error`."""
        self.open = False
        self._wake.set()
        calls, self._calls = self._calls, {}
        for call in calls.values():
            call.broken(error)


class SchedulerSubmissions:
    """The Submissions stream to one scheduler. Call order: submit() per request; close() last."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerServiceStub) -> None:
        self._stub = stub
        self._stream: _Stream | None = None
        self._call_ids = itertools.count(1)

    def submit(self, request: scheduler_pb2.SubmitRequest, *, timeout: float | None,
               metadata: _Metadata) -> SubmitCall:
        """Submit on the stream (opened now if none is): `metadata` as a Submit call's. The internal
        token authorizes the stream, opened with the first submission's; the rest (the trace
        context) goes with the submission."""
        stream = self._stream
        if stream is None or not stream.open:
            stream = self._stream = _Stream(self._stub, [(k, v) for k, v in metadata if k == INTERNAL_TOKEN_KEY])
        call = SubmitCall(next(self._call_ids), stream, timeout)
        submission = scheduler_pb2.Submission(
            request=request, timeout_ms=0 if timeout is None else max(1, round(timeout * 1000)),
            trace_context={k: v for k, v in metadata if k != INTERNAL_TOKEN_KEY})
        stream.submit(call, submission)
        return call

    def close(self) -> None:
        """End the stream (its open submissions fail CANCELLED)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None
