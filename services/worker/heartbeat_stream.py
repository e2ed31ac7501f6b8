"""A worker's heartbeats to one scheduler on one long-lived Heartbeats stream: one message each way
per heartbeat instead of a unary call (gRPC's per-call work was ~0.4 ms of scheduler CPU a
heartbeat, 50 times the handler's).

The stream only carries what a Heartbeat call would: liveness is still the registry's TTL, renewed
by each heartbeat the scheduler reads, so a frozen or dead worker lapses as it did (an open stream
proves nothing: a frozen process keeps its connection). Invariants:
- one heartbeat on the stream at a time, so an answer pairs with its heartbeat by order;
- a stream whose answer was late, that broke or that ended is closed and never written again: a
  late answer left on it would pair with the next heartbeat; the next exchange opens a new one;
- a stream found broken when a heartbeat is written (the scheduler restarted since the last one)
  is replaced at once and the heartbeat sent again, within the same bound;
- a scheduler without the Heartbeats method (UNIMPLEMENTED: an older one) gets unary Heartbeat
  calls from then on.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc


class HeartbeatStream:
    """Call order: exchange(request, timeout)* -> close()."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerServiceStub, metadata: tuple[tuple[str, str], ...]) -> None:
        self._stub = stub
        self._metadata = metadata
        self._call: grpc.aio.StreamStreamCall | None = None
        self._unary = False  # the scheduler has no Heartbeats method
        self._turn = asyncio.Lock()  # one heartbeat on the stream at a time: answers pair by order

    async def exchange(self, request: scheduler_pb2.HeartbeatRequest,
                       timeout: float) -> scheduler_pb2.HeartbeatResponse:
        """The scheduler's answer to one heartbeat within `timeout` seconds; AioRpcError as the unary
        call would raise it (DEADLINE_EXCEEDED when late, the stream's status when it broke)."""
        async with self._turn:
            if self._unary:
                return await self._stub.Heartbeat(request, timeout=timeout, metadata=self._metadata)
            deadline = time.monotonic() + timeout
            fresh = self._call is None
            try:
                return await self._exchange_once(request, timeout)
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self._unary = True
                    return await self._stub.Heartbeat(request, timeout=timeout, metadata=self._metadata)
                if fresh or error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
            # An open stream broke since the last heartbeat: once more on a new one, in the time left.
            return await self._exchange_once(request, max(deadline - time.monotonic(), 0.0))

    def close(self) -> None:
        """Cancel the stream, if one is open (the scheduler's end sees it cancelled)."""
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def _exchange_once(self, request: scheduler_pb2.HeartbeatRequest,
                             timeout: float) -> scheduler_pb2.HeartbeatResponse:
        """Write the heartbeat on the stream (opened if none is) and read its answer within `timeout`."""
        if self._call is None:
            self._call = self._stub.Heartbeats(metadata=self._metadata)
        try:
            response = await asyncio.wait_for(_write_and_read(self._call, request), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            self.close()
            detail = f"no answer to the heartbeat within {timeout:g} s"
            raise _failed(grpc.StatusCode.DEADLINE_EXCEEDED, detail) from None
        except (grpc.aio.AioRpcError, asyncio.CancelledError):  # cancelled: its answer may still come
            self.close()
            raise
        except asyncio.InvalidStateError:  # a write on a stream that had already ended
            self.close()
            raise _failed(grpc.StatusCode.UNAVAILABLE, "the heartbeat stream had ended") from None
        if response is grpc.aio.EOF:  # the stream ended OK (read() raises for any other status)
            self.close()
            raise _failed(grpc.StatusCode.UNAVAILABLE, "the scheduler ended the heartbeat stream")
        return response


async def _write_and_read(call: grpc.aio.StreamStreamCall,
                          request: scheduler_pb2.HeartbeatRequest) -> scheduler_pb2.HeartbeatResponse:
    await call.write(request)
    return await call.read()


def _failed(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """A heartbeat that failed on the stream, as the error a failed call would raise."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
