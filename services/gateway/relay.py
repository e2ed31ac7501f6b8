"""One request's token relay, in the gateway: events from its workers' token streams, in output
order, to the client.

The prefill worker streams output token 0 and the decode worker the rest, on different
connections, so events may arrive out of order or twice. The relay keeps a cursor `next_offset`
(tokens delivered so far): an event at the cursor is delivered, one ahead of it is held until the
gap fills, and tokens behind it are duplicates and dropped. The stream ends with the event that
carries a finish reason, or with an error (fail(): the scheduler's Submit call ended with a status).

A request whose worker was lost may go on elsewhere (the scheduler's migration.py): interrupt() drops the held
events, whose gap will never fill, and makes events() raise Interrupted after what was delivered.
The continuation's worker numbers its outputs from 0, so from then on every pushed event is
shifted by `base`, the tokens delivered before the interruption; `tokens` keeps them all, and
`restate_usage` counts them as output again in the final usage. Tokens delivered while the reader
has not yet taken the previous event join that event (one chunk for the client, not one per token).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable

from services.common.errors import DeadlineExceeded, TandemError
from tandem.v1 import common_pb2, scheduler_pb2

TokenEvent = scheduler_pb2.TokenEvent


class Interrupted(Exception):
    """events() met an interrupt(): the request may go on from `offset` on another worker, or fail with `error`."""

    def __init__(self, error: TandemError, offset: int) -> None:
        super().__init__(str(error))
        self.error = error
        self.offset = offset


class Relay:
    """Call order: push()/fail()/finish()/interrupt() from anywhere on the event loop; events() by
    the client's stream (again after each Interrupted)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.next_offset = 0
        self.base = 0
        self.tokens: list[int] = []
        self._held: dict[int, TokenEvent] = {}
        # What events() has yet to take, and the future it waits on while there is none: lighter than an
        # asyncio.Queue, whose put and get, with their bookkeeping (unfinished tasks, putters), are paid per event.
        self._ready: deque[TokenEvent | TandemError | Interrupted] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._unread: TokenEvent | None = None  # the last event queued, while events() has not taken it
        self.closed = False

    def push(self, event: TokenEvent) -> None:
        """Take one worker event; delivers it and any held events it unblocks, in order."""
        if self.closed:
            return
        event.output_offset += self.base
        if event.finish_reason == common_pb2.FINISH_REASON_ABORT:
            self._end_at_once(event)  # a worker that aborts a request ends it, whatever came before
            return
        if event.output_offset > self.next_offset:
            self._held.setdefault(event.output_offset, event)
            return
        self._deliver(event)
        while self._held and not self.closed:  # nothing held: the usual case, in order from one worker
            offset = min((o for o in self._held if o <= self.next_offset), default=None)
            if offset is None:
                return
            self._deliver(self._held.pop(offset))

    def fail(self, error: TandemError) -> None:
        """End the stream with `error` (its gRPC status), dropping undelivered tokens."""
        if not self.closed:
            self._close(error)

    def interrupt(self, error: TandemError) -> None:
        """The worker generating the request was lost: events() raises Interrupted(error) after the
        events delivered so far, and pushed events count from the cursor from now on. The caller
        stops taking the lost attempt's events first."""
        if self.closed:
            return
        self._held.clear()
        self.base = self.next_offset
        self._unread = None
        self._put(Interrupted(error, self.next_offset))

    def finish(self, reason: int, worker_id: str = "") -> None:
        """End the stream now with an empty final event (e.g. FINISH_REASON_ABORT), dropping held tokens."""
        if not self.closed:
            self._close(TokenEvent(request_id=self.request_id, output_offset=self.next_offset,
                                   finish_reason=reason, worker_id=worker_id))

    async def events(self, remaining: Callable[[], float | None]) -> AsyncIterator[TokenEvent]:
        """The ordered events up to the final one; raises the failure, or DeadlineExceeded when
        `remaining()` (seconds left, None: no deadline) runs out first, Interrupted after an interrupt()."""
        loop = asyncio.get_running_loop()
        left = remaining()
        timer = None if left is None else loop.call_later(left, self._expire)
        try:
            while True:  # one timer for the whole stream, none per event
                while not self._ready:
                    self._waiter = loop.create_future()
                    await self._waiter
                item = self._ready.popleft()
                remaining()  # raises once the deadline passed
                if isinstance(item, (TandemError, Interrupted)):
                    raise item
                if item is self._unread:
                    self._unread = None
                yield item
                if item.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    return
        finally:
            if timer is not None:
                timer.cancel()

    def _expire(self) -> None:
        self.fail(DeadlineExceeded(f"request {self.request_id}: its deadline passed after {self.next_offset} token(s)"))

    def _deliver(self, event: TokenEvent) -> None:
        """Deliver an event at or behind the cursor, without the tokens already delivered."""
        token_ids = event.token_ids  # the repeated field read once: each read of it costs a wrapper's lookup
        if duplicate := self.next_offset - event.output_offset:
            if duplicate > len(token_ids):
                return  # wholly behind the cursor: a stale copy, its finish reason included
            del token_ids[:duplicate]
            del event.logprobs[:duplicate]
            event.output_offset = self.next_offset
        count = len(token_ids)
        finished = event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        if not count and not finished:
            return
        self.next_offset += count
        self.tokens.extend(token_ids)
        if finished:
            self._close(event)
        elif (unread := self._unread) is not None and _joinable(unread, event):
            unread.token_ids.extend(token_ids)  # the reader fell behind: one event for both
            unread.logprobs.extend(event.logprobs)
            unread.timings.MergeFrom(event.timings)
        else:
            self._put(event)
            self._unread = event

    def _end_at_once(self, event: TokenEvent) -> None:
        final = TokenEvent(request_id=self.request_id, output_offset=self.next_offset,
                           finish_reason=event.finish_reason, worker_id=event.worker_id)
        final.usage.CopyFrom(event.usage)
        self._close(final)

    def _close(self, last: TokenEvent | TandemError) -> None:
        self.closed = True
        self._held.clear()
        self._unread = None
        self._put(last)

    def _put(self, item: TokenEvent | TandemError | Interrupted) -> None:
        self._ready.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def _joinable(unread: TokenEvent, event: TokenEvent) -> bool:
    """Whether `event` (next at the cursor) may join the event still waiting for the reader."""
    return unread.worker_id == event.worker_id and bool(unread.logprobs) == bool(event.logprobs)


def restate_usage(usage: common_pb2.Usage, prompt_tokens: int, completion_tokens: int) -> None:
    """A continuation's final usage counted its delivered tokens as prompt: count them as output again."""
    usage.prompt_tokens = prompt_tokens
    usage.cached_tokens = min(usage.cached_tokens, prompt_tokens)
    usage.completion_tokens = completion_tokens
