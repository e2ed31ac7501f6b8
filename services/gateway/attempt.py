"""One attempt of a request, as the gateway runs it: the scheduler's Submit call that placed it,
and the token streams of its workers (on the gateway's Follow call to each, follow.py), all
feeding the request's relay.

The scheduler decides and accounts; the tokens come straight from the workers: the generating
(decode or colocated) worker's stream, and the prefill worker's, which carries output token 0. The
Submit call stays open beside them and has the last word on the attempt: it ends with a status
(the request failed: the relay fails with it), or says AttemptLost (the worker generating it was
lost: the relay is interrupted and the gateway submits the continuation), or ends OK (the request
finished: its final event is on the worker's stream). A worker stream that breaks or that the
worker drops therefore ends quietly: the Submit call says why (a worker reports the requests it
drops to the scheduler as their final event). A worker's error event is left to the scheduler
too, which reports it as the call's status. Once the Submit call ended OK, the attempt's streams
that all end without a final event fail the request with UNAVAILABLE: the scheduler counted it
ended, but its last tokens were lost on the way (or it was aborted), and nothing else would end it.

The Submit call and the workers' streams are separate calls, so the scheduler's status may reach
the gateway before tokens a worker streamed ahead of the request's end. The status is therefore
acted on once the streams have had their say, at most STREAMS_GRACE_S later: a failure once every
stream has ended (the worker's error event, or the abort that dropped it), so the client gets
exactly the tokens the workers streamed, then the error; a break once the generator's stream has
given its first event or ended.

A scheduler that dies once the generating worker has started the request (its stream has given an
event; the Submit call breaks with UNAVAILABLE) takes nothing with it: that stream goes on to the
request's end, and only a stream that then ends without its final event fails the request (no
scheduler is left to say why). One that dies before interrupts the relay with nothing delivered,
as a lost worker does (`scheduler_lost` set): the steps still to come (Run, the prefill and its KV
hand-off) were the scheduler's calls, cut with it, so the gateway closes the attempt (its workers
drop it) and submits the continuation to the next scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc

from services.common.errors import TandemError, Unavailable, error_from_rpc
from services.gateway.follow import FollowedStream
from services.gateway.relay import Relay
from services.gateway.submissions import SubmitCall
from tandem.v1 import common_pb2, scheduler_pb2, worker_pb2

log = logging.getLogger(__name__)

# How long the Submit call's status waits for the workers' streams (see above). It bounds only a
# stream that never ends: one whose worker was cut off without its connection breaking.
STREAMS_GRACE_S = 1.0

OpenStream = Callable[[str, worker_pb2.StreamRequest], FollowedStream]


class Attempt:
    """Call order: start() once its Placement is read -> close() (idempotent)."""

    def __init__(self, submit: SubmitCall, placement: scheduler_pb2.Placement, relay: Relay) -> None:
        self.submit = submit
        self.placement = placement
        self._relay = relay
        self._calls: list[FollowedStream] = []
        self._readers: list[_StreamReader] = []
        self._watcher: asyncio.Task | None = None
        self._current = True
        self._scheduler_gone = False  # the Submit call broke with UNAVAILABLE after placement
        self._submit_ended = False  # the Submit call ended OK: the request ended (finished or aborted)
        self._generator_cut: Unavailable | None = None  # the generator's stream ended before its final event
        self._generator_started = False  # the generator's stream gave an event
        self._generator_heard = asyncio.Event()  # it gave an event or ended
        self.scheduler_lost = False  # the Submit call broke before the generator started: hand it over

    def start(self, open_stream: OpenStream) -> None:
        """Read the workers' streams into the relay, and watch the Submit call."""
        request = worker_pb2.StreamRequest(request_id=self.placement.attempt_id)
        addresses = [self.placement.generator_address]
        if self.placement.prefill_address:
            addresses.append(self.placement.prefill_address)
        for address in addresses:
            reader = _StreamReader(self, address, address == self.placement.generator_address)
            self._readers.append(reader)
            call = open_stream(address, request)
            self._calls.append(call)
            call.listen(reader)
        self._watcher = asyncio.ensure_future(self._watch())

    async def settled(self, timeout: float) -> None:
        """Wait, at most `timeout` seconds, for the Submit call to end: after the final event, the
        scheduler ends it once it has counted the request finished (its spans and stats with it)."""
        if self._watcher is not None:
            await asyncio.wait([self._watcher], timeout=timeout)

    def close(self) -> None:
        """Stop taking this attempt's events, and cancel its calls (aborting what is still running)."""
        self._current = False
        for call in self._calls:
            call.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
        self.submit.cancel()

    @property
    def request_id(self) -> str:
        return self._relay.request_id

    def _take(self, reader: _StreamReader, event: scheduler_pb2.TokenEvent) -> bool:
        """Push one of a worker stream's events into the relay; False: the stream is done (the
        attempt stopped, or the worker's error event came: the scheduler ends the Submit call with it)."""
        if not self._current:
            return False
        if event.finish_reason == common_pb2.FINISH_REASON_ERROR:
            if self._scheduler_gone:
                self._fail(Unavailable(f"request {self._relay.request_id}: worker at {reader.address} "
                                       f"failed it and no scheduler is left to say why; retry the request"))
            return False
        if reader.generator and not self._generator_started:
            self._generator_started = True
            self._generator_heard.set()
        reader.finished = event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        self._relay.push(event)
        return True

    def _stream_ended(self, reader: _StreamReader) -> None:
        """A worker's stream gave its last event, or ended without it (`reader.finished` says which)."""
        self._fail_if_unended()
        if not reader.generator:
            return
        self._generator_heard.set()
        if not reader.finished and self._current:
            self._generator_cut = Unavailable(f"request {self._relay.request_id}: the token stream from "
                                              f"{reader.address} ended before the request did; retry the request")
            if self._scheduler_gone:
                self._fail(self._generator_cut)

    def _fail_if_unended(self) -> None:
        """The Submit call ended OK and every stream of the attempt ended, yet no final event came (a
        final event on any stream, the prefill worker's when the first token ends the request, closes the
        relay first): its last tokens were lost on the way, or it was aborted; nothing else would end it."""
        if self._submit_ended and self._current and all(reader.ended.done() for reader in self._readers):
            self._fail(Unavailable(f"request {self._relay.request_id}: its token streams ended before the "
                                   f"request did; retry the request"))

    async def _watch(self) -> None:
        try:
            while (event := await self.submit.read()) is not grpc.aio.EOF:
                if event.HasField("lost") and self._current:
                    self._current = False  # the lost worker's late events must not reach the relay
                    self._relay.interrupt(Unavailable(
                        f"request {self._relay.request_id}: worker {event.lost.worker_id} was lost "
                        f"({event.lost.reason}); retry the request"))
            self._submit_ended = True  # the final event is on its way, unless every stream ended without it
            self._fail_if_unended()
        except grpc.aio.AioRpcError as error:
            if not self._current or error.code() == grpc.StatusCode.CANCELLED:
                return
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                await asyncio.wait([reader.ended for reader in self._readers],
                                   timeout=STREAMS_GRACE_S)  # their tokens come first
                self._fail(error_from_rpc(error))
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._generator_heard.wait(), STREAMS_GRACE_S)
            if not self._generator_started:
                self.scheduler_lost = True  # the next scheduler takes the request over, as a continuation
                self._current = False
                self._relay.interrupt(Unavailable(f"request {self._relay.request_id}: its scheduler was lost "
                                                  f"before {self.placement.generator_address} started it"))
                return
            log.warning("request %s: its scheduler was lost (%s); streaming on from %s", self._relay.request_id,
                        error.details(), self.placement.generator_address)
            self._scheduler_gone = True
            if self._generator_cut is not None:
                self._fail(self._generator_cut)

    def _fail(self, error: TandemError) -> None:
        self._current = False
        self._relay.fail(error)


class _StreamReader:
    """One worker's stream of an attempt, taken as the Follow call hands it over (follow.py): its
    events into the relay until the final one, the worker's error event, or the attempt stopping
    (`ended` resolves then, and `finished` says whether the final event came)."""

    __slots__ = ("_attempt", "address", "generator", "finished", "ended")

    def __init__(self, attempt: Attempt, address: str, generator: bool) -> None:
        self._attempt = attempt
        self.address = address
        self.generator = generator
        self.finished = False
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_event(self, event: scheduler_pb2.TokenEvent) -> None:
        if not self.ended.done() and not self._attempt._take(self, event):
            self._end()

    def on_end(self, error: grpc.aio.AioRpcError | None) -> None:
        if self.ended.done():
            return
        if error is not None and error.code() != grpc.StatusCode.CANCELLED:
            log.info("request %s: the token stream from %s ended: %s: %s (waiting for the scheduler's word)",
                     self._attempt.request_id, self.address, error.code().name, error.details())
        self._end()

    def _end(self) -> None:
        self.ended.set_result(None)
        self._attempt._stream_ended(self)
