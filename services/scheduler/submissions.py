"""The scheduler's end of a Submissions stream: many requests on one long-lived call per gateway, each
served by the same per-request handler a Submit call runs (`handle(request, call)`, an async
iterator of SubmitEvents that raises TandemError to fail the request).

Model: each submission runs as a task of its own with a `SubmissionCall` standing in for its Submit
call's context (its metadata is the stream's plus the submission's trace context, its deadline the
submission's timeout, its done callbacks run when the task ends). Its events, then its end (the
status the Submit call would end with), go back in order on the stream, several to a message when
ready together. A cancel cancels the task, as cancelling a Submit call does, and sends nothing back.
When the stream breaks, every task still running is cancelled the same way; when the gateway
half-closes it, they run to their ends, and then the stream ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc

from services.common.errors import InvalidRequest, TandemError, grpc_status
from services.scheduler import message_counts
from services.scheduler.message_counts import IN, OUT, SUBMISSIONS
from tandem.v1 import common_pb2, scheduler_pb2
from tandem.v1.errors import retry_after_hint

log = logging.getLogger(__name__)

Handler = Callable[[scheduler_pb2.SubmitRequest, "SubmissionCall"], AsyncIterator[scheduler_pb2.SubmitEvent]]
_Metadata = tuple[tuple[str, str | bytes], ...]


class SubmissionCall:
    """What a submission's handler sees of its call: the part of grpc.aio.ServicerContext that
    Submit's handler reads (invocation_metadata, time_remaining, add_done_callback)."""

    __slots__ = ("_metadata", "_deadline", "_callbacks")

    def __init__(self, stream_metadata: _Metadata, submission: scheduler_pb2.Submission) -> None:
        self._metadata = (*stream_metadata, *submission.trace_context.items())
        self._deadline = time.monotonic() + submission.timeout_ms / 1000 if submission.timeout_ms > 0 else None
        self._callbacks: list[Callable[[SubmissionCall], None]] = []

    def invocation_metadata(self) -> _Metadata:
        return self._metadata

    def time_remaining(self) -> float | None:
        """Seconds left of the submission's timeout (None: none), as a call's deadline."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def add_done_callback(self, callback: Callable[[SubmissionCall], None]) -> None:
        self._callbacks.append(callback)

    def done(self) -> None:
        """The submission ended (its handler returned, raised or was cancelled): run the callbacks once."""
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)


class SubmissionStream:
    """One Submissions call. Call order: serve() once; it returns when the stream ends."""

    def __init__(self, handle: Handler, metadata: _Metadata) -> None:
        self._handle = handle
        self._metadata = metadata
        self._running: dict[int, asyncio.Task] = {}
        self._ready: list[scheduler_pb2.SubmitUpdate] = []
        self._wake = asyncio.Event()
        self._reading = True

    async def serve(self, commands: AsyncIterator[scheduler_pb2.SubmitCommands]) -> AsyncIterator[
            scheduler_pb2.SubmitUpdates]:
        """The stream's updates, batched as they become ready, until the gateway's side ends."""
        reader = asyncio.ensure_future(self._read(commands))
        try:
            while self._reading or self._running or self._ready:
                await self._wake.wait()
                self._wake.clear()
                if self._ready:
                    updates, self._ready = self._ready, []
                    message_counts.count(SUBMISSIONS, OUT)
                    yield scheduler_pb2.SubmitUpdates(updates=updates)
            await reader  # its error, if it failed, ends the call with its status
        finally:
            reader.cancel()
            for task in list(self._running.values()):
                task.cancel()

    async def _read(self, commands: AsyncIterator[scheduler_pb2.SubmitCommands]) -> None:
        """Apply the commands until the gateway half-closes (what runs goes on to its end) or the
        stream breaks (what runs is cancelled, as each Submit call would be)."""
        try:
            async for message in commands:
                message_counts.count(SUBMISSIONS, IN)
                for command in message.commands:
                    self._apply(command)
        except BaseException:
            for task in list(self._running.values()):
                task.cancel()
            raise
        finally:
            self._reading = False
            self._wake.set()

    def _apply(self, command: scheduler_pb2.SubmitCommand) -> None:
        if command.HasField("submit"):
            if command.call_id in self._running:
                self._send(command.call_id, end=_end_of(_duplicate(command.call_id)))
                return
            call = SubmissionCall(self._metadata, command.submit)
            task = asyncio.ensure_future(self._run(command.call_id, command.submit.request, call))
            self._running[command.call_id] = task
            task.add_done_callback(lambda done, call_id=command.call_id, call=call: self._ended(call_id, done, call))
        elif command.cancel and (task := self._running.pop(command.call_id, None)) is not None:
            task.cancel()

    async def _run(self, call_id: int, request: scheduler_pb2.SubmitRequest, call: SubmissionCall) -> None:
        """Serve one submission to its end; its end goes back unless it was cancelled."""
        try:
            async for event in self._handle(request, call):
                self._send(call_id, event=event)
        except TandemError as error:
            self._send(call_id, end=_end_of(error))
        except Exception:
            log.exception("submission %d (request %s) failed in the scheduler", call_id, request.request_id)
            self._send(call_id, end=_end_of(TandemError(f"request {request.request_id}: the scheduler failed it "
                                                        f"(internal error); its log has the detail")))
        else:
            self._send(call_id, end=scheduler_pb2.SubmitEnd(status=common_pb2.RequestError()))

    def _ended(self, call_id: int, task: asyncio.Task, call: SubmissionCall) -> None:
        if self._running.get(call_id) is task:  # not a later submission that reused a cancelled one's id
            del self._running[call_id]
        call.done()
        self._wake.set()

    def _send(self, call_id: int, **kind: scheduler_pb2.SubmitEvent | scheduler_pb2.SubmitEnd) -> None:
        self._ready.append(scheduler_pb2.SubmitUpdate(call_id=call_id, **kind))
        self._wake.set()


def _end_of(error: TandemError) -> scheduler_pb2.SubmitEnd:
    """The end a Submit call failing with `error` would have: its status, and its retry hint."""
    end = scheduler_pb2.SubmitEnd(status=common_pb2.RequestError(code=grpc_status(error).value[0],
                                                                  message=error.message))
    retry_after = retry_after_hint(error.trailing_metadata())
    if retry_after is not None:
        end.retry_after_s = retry_after
    return end


def _duplicate(call_id: int) -> TandemError:
    return InvalidRequest("call_id", f"{call_id} is already in use on this stream; number each submission anew")


def serve(handle: Handler, commands: AsyncIterator[scheduler_pb2.SubmitCommands],
          context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.SubmitUpdates]:
    """Serve a Submissions call with `handle` for each of its submissions."""
    return SubmissionStream(handle, tuple(context.invocation_metadata() or ())).serve(commands)
