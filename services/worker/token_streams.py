"""Each request's token events, held on the worker for the gateway that reads them
(TokenStreamService.Follow): the scheduler is told where a request runs, never its tokens.

A request's stream is opened by whichever comes first: the worker taking the request (`open`) or
the gateway attaching (`follow`), which may come before the request reaches this worker (a
prefill worker's Prefill call, a decode worker's KV, are still on their way). Events wait in the
stream until they are read; a request opened here that nobody attaches to within `attach_s` is
given up (`on_abandoned` aborts it), and so is one whose reader goes before its last event: its
call ended (`on_abandoned`), or it left the request (`on_left`: its gateway gave the request up, and
tells the scheduler itself). The
last event is the final one, or output token 0 on a worker that hands the request on after it
(a prefill worker). Events already waiting when the reader takes one go out joined in one message
(the tokens of consecutive steps, when the reader fell behind); a reader asking for several tokens
per message (StreamRequest.min_tokens_per_message) gets its first token at once, then messages
that wait for that many. `drop` ends a stream with UNAVAILABLE when the worker drops its request.

`follow_many` serves one Follow call: the streams of many requests (a gateway's, on this worker),
attached and left one by one, their events sent together (each message has every event ready then,
a step's tokens of the whole batch at once) with the end of each request's stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from services.common.errors import InvalidRequest, TandemError, Unavailable, grpc_status
from tandem.v1 import common_pb2, scheduler_pb2, worker_pb2

ATTACH_S = 30.0  # the gateway attaches right after placement; this only bounds a gateway that vanished


@dataclass(slots=True)
class _Stream:
    queue: asyncio.Queue[scheduler_pb2.TokenEvent | Unavailable] = field(default_factory=asyncio.Queue)
    hands_on: bool = False  # the last event is output token 0
    opened: bool = False  # the worker took the request
    attached: bool = False
    left: bool = False  # its reader gave it up (a leave), rather than going with its call
    timer: asyncio.TimerHandle | None = None


class RequestStreams:
    """Call order: open(request_id) as the worker takes a request -> push(event)* -> drop() on an
    abort; follow(request_id) once, from a Follow call's attach, in any order with open()."""

    def __init__(self, on_abandoned: Callable[[str], None], attach_s: float = ATTACH_S,
                 on_left: Callable[[str], None] | None = None) -> None:
        """`on_left`: for a request its reader left (default: `on_abandoned`)."""
        self._streams: dict[str, _Stream] = {}
        self._on_abandoned = on_abandoned
        self._on_left = on_left or on_abandoned
        self._attach_s = attach_s

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def attached(self, request_id: str) -> bool:
        """Whether a gateway reads the request's tokens now."""
        stream = self._streams.get(request_id)
        return stream is not None and stream.attached

    def open(self, request_id: str, *, hands_on: bool = False) -> None:
        """The worker takes the request; its reader has `attach_s` to come if it has not yet."""
        stream = self._streams.setdefault(request_id, _Stream())
        stream.opened, stream.hands_on = True, hands_on
        if not stream.attached:
            loop = asyncio.get_running_loop()
            stream.timer = loop.call_later(self._attach_s, self._unattended, request_id, stream)

    def push(self, event: scheduler_pb2.TokenEvent) -> None:
        stream = self._streams.get(event.request_id)
        if stream is not None:
            stream.queue.put_nowait(event)

    def drop(self, request_id: str, reason: str) -> None:
        """End the request's stream with UNAVAILABLE (its reader, if any, sees it after the events
        before; one that comes within `attach_s` still does)."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        stream.opened = False  # nothing left to give up
        stream.queue.put_nowait(Unavailable(f"request {request_id} was dropped by this worker: {reason}"))
        if not stream.attached and stream.timer is None:
            stream.timer = asyncio.get_running_loop().call_later(self._attach_s, self._unattended, request_id, stream)

    def leave(self, request_id: str) -> None:
        """The reader gives the request up (call before ending its `follow`): `on_left`, not `on_abandoned`."""
        stream = self._streams.get(request_id)
        if stream is not None and stream.attached:
            stream.left = True

    async def follow(self, request_id: str, min_tokens: int = 1) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        """The request's events up to its last one; raises Unavailable. After the first token, a
        message waits for `min_tokens` tokens (or the last event). Leaving early (the call was
        cancelled) gives the request up."""
        stream = self._streams.setdefault(request_id, _Stream())
        if stream.attached:
            raise InvalidRequest("request_id", f"{request_id!r} already has a reader on this worker")
        stream.attached = True
        if stream.timer is not None:
            stream.timer.cancel()
        last = False
        held: scheduler_pb2.TokenEvent | Unavailable | None = None  # taken while coalescing, not yet sent
        sent = 0  # tokens sent so far
        try:
            while not last:
                item = held if held is not None else await stream.queue.get()
                held = None
                if isinstance(item, Unavailable):
                    last = True
                    raise item
                while not (last := _is_last(item, stream.hands_on)):
                    if stream.queue.empty() and (not sent or len(item.token_ids) >= min_tokens):
                        break  # nothing more waiting, and this message may go
                    held = await stream.queue.get()
                    if not _follows(item, held):
                        break
                    item, held = _joined(item, held), None
                sent += len(item.token_ids)
                yield item
        finally:
            self._forget(request_id, stream)
            if not last:  # also before the worker opened it: a decode reservation still waiting for its KV
                (self._on_left if stream.left else self._on_abandoned)(request_id)

    def _unattended(self, request_id: str, stream: _Stream) -> None:
        if self._streams.get(request_id) is stream and not stream.attached:
            self._forget(request_id, stream)
            if stream.opened:
                self._on_abandoned(request_id)

    def _forget(self, request_id: str, stream: _Stream) -> None:
        if self._streams.get(request_id) is stream:
            del self._streams[request_id]
        if stream.timer is not None:
            stream.timer.cancel()


Follow = Callable[[str, int], AsyncIterator[scheduler_pb2.TokenEvent]]  # RequestStreams.follow's shape


async def follow_many(controls: AsyncIterator[worker_pb2.FollowControl], follow: Follow,
                      leave: Callable[[str], None] | None = None) -> AsyncIterator[worker_pb2.FollowBatch]:
    """TokenStreamService.Follow: `follow(request_id, min_tokens)` for each attached request until
    its stream ends or it is left (`leave(request_id)` first: RequestStreams.leave); batches of every
    event ready, and of the streams' ends. Ends when the controls are done and no stream is left;
    leaving early (the call ended) gives up every stream still followed."""
    batches = _Batches(follow, leave)
    reader = asyncio.ensure_future(batches.read(controls))
    try:
        while True:
            if (batch := batches.take()) is not None:
                yield batch
            elif reader.done() and not batches.pumps:
                reader.result()  # raises what ended the controls, if anything did
                return
            else:
                batches.ready.clear()
                await batches.ready.wait()
    finally:
        reader.cancel()
        for pump in list(batches.pumps.values()):
            pump.cancel()  # follow()'s end gives the request up


class _Batches:
    """The streams followed on one Follow call, and the batches filled for its next messages: one,
    but an event with prompt logprobs (which may be megabytes) goes alone, so that joining it to
    others never makes a message bigger than one request's."""

    def __init__(self, follow: Follow, leave: Callable[[str], None] | None = None) -> None:
        self._follow = follow
        self._leave = leave
        self.pumps: dict[str, asyncio.Task[None]] = {}
        self.ready = asyncio.Event()
        self._full: list[worker_pb2.FollowBatch] = []
        self._batch = worker_pb2.FollowBatch()

    def take(self) -> worker_pb2.FollowBatch | None:
        """The next message, None when nothing is waiting."""
        if self._full:
            return self._full.pop(0)
        batch = self._batch
        if not batch.events and not batch.ends:
            return None
        self._batch = worker_pb2.FollowBatch()
        return batch

    def add(self, event: scheduler_pb2.TokenEvent) -> None:
        if event.prompt_logprobs:
            self._seal()
            self._batch.events.append(event)
            self._seal()
        else:
            self._batch.events.append(event)
        self.ready.set()

    def _seal(self) -> None:
        if self._batch.events or self._batch.ends:
            self._full.append(self._batch)
            self._batch = worker_pb2.FollowBatch()

    async def read(self, controls: AsyncIterator[worker_pb2.FollowControl]) -> None:
        try:
            async for control in controls:
                if control.HasField("attach"):
                    self._attach(control.attach)
                elif (pump := self.pumps.pop(control.leave, None)) is not None:
                    if self._leave is not None:
                        self._leave(control.leave)
                    pump.cancel()
        finally:
            self.ready.set()

    def _attach(self, request: worker_pb2.StreamRequest) -> None:
        request_id = request.request_id
        if not request_id:
            self._end(request_id, InvalidRequest("attach.request_id", "is empty; pass the attempt id of the "
                                                                      "scheduler's Placement"))
        elif request_id in self.pumps:
            self._end(request_id, InvalidRequest("attach.request_id",
                                                 f"{request_id!r} is already followed on this call"))
        else:
            self.pumps[request_id] = asyncio.ensure_future(self._pump(request_id, request.min_tokens_per_message))

    async def _pump(self, request_id: str, min_tokens: int) -> None:
        error = None
        try:
            async for event in self._follow(request_id, min_tokens):
                self.add(event)
        except TandemError as failure:
            error = failure
        if self.pumps.get(request_id) is asyncio.current_task():
            del self.pumps[request_id]
        self._end(request_id, error)

    def _end(self, request_id: str, error: TandemError | None) -> None:
        end = self._batch.ends.add(request_id=request_id)
        if error is not None:
            end.code, end.message = grpc_status(error).value[0], error.message
        self.ready.set()


def _follows(event: scheduler_pb2.TokenEvent, after: scheduler_pb2.TokenEvent | Unavailable) -> bool:
    """Whether `after` carries the tokens right after `event`'s, from the same worker, logprobs alike."""
    return (isinstance(after, scheduler_pb2.TokenEvent) and after.worker_id == event.worker_id
            and after.output_offset == event.output_offset + len(event.token_ids)
            and bool(after.logprobs) == bool(event.logprobs))


def _joined(event: scheduler_pb2.TokenEvent, after: scheduler_pb2.TokenEvent) -> scheduler_pb2.TokenEvent:
    """One event for two consecutive ones (a copy: the worker's own events stay as they were)."""
    joined = scheduler_pb2.TokenEvent()
    joined.CopyFrom(event)
    joined.MergeFrom(after)  # tokens and logprobs appended; finish reason, usage, error, timings the later's
    joined.output_offset = event.output_offset
    return joined


def _is_last(event: scheduler_pb2.TokenEvent, hands_on: bool) -> bool:
    if event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
        return True
    return hands_on and event.output_offset == 0 and bool(event.token_ids)

