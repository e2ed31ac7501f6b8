"""The gateway's token streams from one worker, many requests on one call (TokenStreamService.Follow):
each request attaches when placed and leaves when the gateway gives it up (the worker then aborts
it), and every message of the call carries the events of all its requests ready on the worker
then, so gRPC's read of a message, and its I/O thread, serve a whole decode step's batch.

The call's reader hands each event straight to its request's consumer (`StreamConsumer`, which
attempt.py gives as it starts reading), then the stream's end: None once it ended OK, else the
status that ended it, as an AioRpcError. No queue and no task of the request's own sit between the
call and the consumer: a message is handed over in one pass of the event loop, its whole batch.
The call is opened by the first request attached and closed once none is left (a worker
that drains for a shutdown then sees no call of the gateway's waiting). A call that breaks (the
worker died, its connection dropped) ends every stream on it with its status; the next request
opens a new one. It carries the internal token; the requests' deadlines are the gateway's own
(leaving a request whose deadline passed is what cancelling its call did).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from services.common.grpc_server import INTERNAL_TOKEN_KEY
from tandem.v1 import scheduler_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class StreamConsumer(Protocol):
    """What takes one request's stream: its events in order, then its end, once."""

    def on_event(self, event: scheduler_pb2.TokenEvent) -> None: ...

    def on_end(self, error: grpc.aio.AioRpcError | None) -> None:
        """The stream ended: OK (None) or with the status that ended it."""


class FollowedStream:
    """One request's stream on a Follow call. Call order: listen() once; cancel() any time."""

    __slots__ = ("request_id", "_call", "_ended", "_consumer", "_early")

    def __init__(self, request_id: str, call: _FollowCall | None) -> None:
        self.request_id = request_id
        self._call = call
        self._ended = call is None
        self._consumer: StreamConsumer | None = None
        self._early: list[scheduler_pb2.TokenEvent | _End] = []  # what came before listen()

    def listen(self, consumer: StreamConsumer) -> None:
        """Hand the stream to `consumer`: what came already at once, the rest as it comes."""
        self._consumer = consumer
        early, self._early = self._early, []
        for item in early:
            self.put(item)

    def cancel(self) -> bool:
        """Leave the request (the worker aborts it if it still runs); False once the stream had ended."""
        if self._ended:
            return False
        self._ended = True
        assert self._call is not None
        self._call.leave(self.request_id)
        return True

    def end(self, error: grpc.aio.AioRpcError | None) -> None:
        """End the stream, OK (None) or with `error`, after the events put before."""
        self._ended = True
        self.put(_End(error))

    def put(self, item: scheduler_pb2.TokenEvent | _End) -> None:
        """An event, or the end, to the consumer; one that raises is a bug of its own, which must not end the call's other
        requests: it is logged and its request left (its deadline ends it)."""
        if self._consumer is None:
            self._early.append(item)
            return
        try:
            if isinstance(item, _End):
                self._consumer.on_end(item.error)
            else:
                self._consumer.on_event(item)
        except Exception:
            log.exception("request %s: its token stream's consumer failed; leaving the request", self.request_id)
            self.cancel()


class _End:
    __slots__ = ("error",)

    def __init__(self, error: grpc.aio.AioRpcError | None) -> None:
        self.error = error


class WorkerFollow:
    """The gateway's Follow call to one worker, opened on demand. Call order: attach()*; close() last."""

    def __init__(self, stub: worker_pb2_grpc.TokenStreamServiceStub) -> None:
        self._stub = stub
        self._call: _FollowCall | None = None

    def attach(self, request: worker_pb2.StreamRequest, metadata: tuple[tuple[str, str], ...]) -> FollowedStream:
        """Follow the request's events on this worker's call (opened now when there is none)."""
        if self._call is None or self._call.ended:
            token = tuple((key, value) for key, value in metadata if key == INTERNAL_TOKEN_KEY)
            self._call = _FollowCall(self._stub, token)
        return self._call.attach(request)

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None


class _FollowCall:
    """One Follow call: its streams by request id, the controls still to send, and its reader."""

    def __init__(self, stub: worker_pb2_grpc.TokenStreamServiceStub, metadata: tuple[tuple[str, str], ...]) -> None:
        self.streams: dict[str, FollowedStream] = {}
        self.ended = False  # no request may attach any more: the call broke, or it is closing
        self._controls: asyncio.Queue[worker_pb2.FollowControl | None] = asyncio.Queue()
        self._call = stub.Follow(self._sent(), metadata=metadata)
        self._reader = asyncio.ensure_future(self._read())

    def attach(self, request: worker_pb2.StreamRequest) -> FollowedStream:
        request_id = request.request_id
        if request_id in self.streams:
            stream = FollowedStream(request_id, None)
            stream.end(_status(grpc.StatusCode.INVALID_ARGUMENT, f"request {request_id!r} is already followed "
                                                                 f"on this worker's call"))
            return stream
        stream = self.streams[request_id] = FollowedStream(request_id, self)
        self._controls.put_nowait(worker_pb2.FollowControl(attach=request))
        return stream

    def leave(self, request_id: str) -> None:
        if self.streams.pop(request_id, None) is not None and not self.ended:
            self._controls.put_nowait(worker_pb2.FollowControl(leave=request_id))
            self._close_if_idle()

    def cancel(self) -> None:
        self.ended = True
        self._call.cancel()

    async def _sent(self) -> AsyncIterator[worker_pb2.FollowControl]:
        while (control := await self._controls.get()) is not None:
            yield control

    async def _read(self) -> None:
        try:
            while (batch := await self._call.read()) is not grpc.aio.EOF:
                for event in batch.events:
                    if (stream := self.streams.get(event.request_id)) is not None:
                        stream.put(event)
                for end in batch.ends:
                    if (stream := self.streams.pop(end.request_id, None)) is not None:
                        stream.end(_ended(end))
                self._close_if_idle()
            error = _status(grpc.StatusCode.UNAVAILABLE, "the worker ended the token stream call")
        except grpc.aio.AioRpcError as failure:
            error = failure
        except asyncio.CancelledError:
            error = _status(grpc.StatusCode.CANCELLED, "the gateway closed the token stream call")
        self.ended = True
        if self.streams:
            log.info("the token stream call to a worker ended with %d request(s) on it: %s: %s", len(self.streams),
                     error.code().name, error.details())
        for stream in self.streams.values():
            stream.end(error)
        self.streams.clear()

    def _close_if_idle(self) -> None:
        """No request left: half-close the call; the worker ends it, and the next request opens another."""
        if not self.streams and not self.ended:
            self.ended = True
            self._controls.put_nowait(None)


_CODES = {code.value[0]: code for code in grpc.StatusCode}  # StreamEnd.code -> its status


def _ended(end: worker_pb2.StreamEnd) -> grpc.aio.AioRpcError | None:
    """None for a stream that ended OK, else its status as the error a call would raise."""
    if end.code == 0:
        return None
    return _status(_CODES.get(end.code, grpc.StatusCode.UNKNOWN), end.message)


def _status(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
