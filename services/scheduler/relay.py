"""One request's token relay: events from any worker stream, in output order, to its Submit stream.

The prefill worker reports output token 0 and the decode worker the rest, on different
connections, so events may arrive out of order or twice. The relay keeps a cursor `next_offset`
(tokens delivered so far): an event at the cursor is delivered, one ahead of it is held until the
gap fills, and tokens behind it are duplicates and dropped. The stream ends with the event that
carries a finish reason, or with an error.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc

from services.common.errors import DeadlineExceeded, TandemError, error_from_status
from tandem.v1 import common_pb2, scheduler_pb2

TokenEvent = scheduler_pb2.TokenEvent
_STATUS_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}
# A worker that aborts or fails a request ends it at once, whatever the order of earlier events.
_ENDS_AT_ONCE = (common_pb2.FINISH_REASON_ABORT, common_pb2.FINISH_REASON_ERROR)


def error_from_event(event: TokenEvent) -> TandemError:
    """The TandemError of a FINISH_REASON_ERROR event (its RequestError's code and message)."""
    status = _STATUS_BY_NUMBER.get(event.error.code, grpc.StatusCode.INTERNAL)
    return error_from_status(status, event.error.message or f"worker {event.worker_id} failed the request")


class Relay:
    """Call order: push()/fail()/finish() from anywhere on the event loop; events() once, by the Submit stream."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.next_offset = 0
        self._held: dict[int, TokenEvent] = {}
        self._ready: asyncio.Queue[TokenEvent | TandemError] = asyncio.Queue()
        self.closed = False

    def push(self, event: TokenEvent) -> None:
        """Take one worker event; delivers it and any held events it unblocks, in order."""
        if self.closed:
            return
        if event.finish_reason in _ENDS_AT_ONCE:
            self._end_at_once(event)
            return
        if event.output_offset > self.next_offset:
            self._held.setdefault(event.output_offset, event)
            return
        self._deliver(event)
        while not self.closed and (offset := min((o for o in self._held if o <= self.next_offset),
                                                 default=None)) is not None:
            self._deliver(self._held.pop(offset))

    def fail(self, error: TandemError) -> None:
        """End the stream with `error` (its gRPC status), dropping undelivered tokens."""
        if not self.closed:
            self._close(error)

    def finish(self, reason: int, worker_id: str = "") -> None:
        """End the stream now with an empty final event (e.g. FINISH_REASON_ABORT), dropping held tokens."""
        if not self.closed:
            self._close(TokenEvent(request_id=self.request_id, output_offset=self.next_offset,
                                   finish_reason=reason, worker_id=worker_id))

    async def events(self, remaining: Callable[[], float | None]) -> AsyncIterator[TokenEvent]:
        """The ordered events up to the final one; raises the failure, or DeadlineExceeded when
        `remaining()` (seconds left, None: no deadline) runs out first."""
        while True:
            try:
                item = await asyncio.wait_for(self._ready.get(), remaining())
            except TimeoutError:
                raise DeadlineExceeded(
                    f"request {self.request_id} passed its deadline after {self.next_offset} tokens") from None
            if isinstance(item, TandemError):
                raise item
            yield item
            if item.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                return

    def _deliver(self, event: TokenEvent) -> None:
        """Deliver an event at or behind the cursor, without the tokens already delivered."""
        duplicate = self.next_offset - event.output_offset
        if duplicate > len(event.token_ids):
            return  # wholly behind the cursor: a stale copy, its finish reason included
        if duplicate:
            del event.token_ids[:duplicate]
            del event.logprobs[:duplicate]
            event.output_offset = self.next_offset
        if not event.token_ids and event.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
            return
        self.next_offset += len(event.token_ids)
        if event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self._close(event)
        else:
            self._ready.put_nowait(event)

    def _end_at_once(self, event: TokenEvent) -> None:
        if event.finish_reason == common_pb2.FINISH_REASON_ERROR:
            self.fail(error_from_event(event))
            return
        final = TokenEvent(request_id=self.request_id, output_offset=self.next_offset,
                           finish_reason=event.finish_reason, worker_id=event.worker_id)
        final.usage.CopyFrom(event.usage)
        self._close(final)

    def _close(self, last: TokenEvent | TandemError) -> None:
        self.closed = True
        self._held.clear()
        self._ready.put_nowait(last)
