"""The worker's one long-lived ReportTokens stream to the scheduler, fed by a queue of TokenBatches.

A TokenBatch goes on the stream for each engine iteration in which requests started or ended (their
first and final events: the tokens go to the gateway on the requests' own streams). When an open
stream breaks the scheduler has usually lost this worker's requests (it failed or moved each one,
and their gateways heard it), so the queued batches are dropped, `on_lost` lets the worker abort
what no gateway reads (the rest streams on to its gateway; each one aborted is reported on the next
stream), and the reporter reconnects with exponential backoff. An attempt that never connected (the
scheduler is restarting) fails nothing: what is queued waits for the next stream, since a restarted
scheduler may route requests here before the stream is back.

Final events are delivered at least once (final_outbox.py): the scheduler acknowledges the numbered
batches it applied on the stream's responses, and the next stream opens with those it had not, so a
break the scheduler did not see (it still holds the old stream, and what was written to it is lost)
leaves no request waiting for its deadline. Where the scheduler had failed them, they are no-ops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from services.worker.final_outbox import FinalOutbox
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

_BACKOFF_START_S = 0.1
_BACKOFF_MAX_S = 1.0  # as often as the channel itself retries (services.common.channels)


class TokenReporter:
    """Call order: start() -> send(batch)* -> stop().

    The stream has no deadline on purpose: it lives as long as the worker (a scheduler that dies
    resets the connection; one that vanishes is noticed by the heartbeats). Each (re)connection
    opens with an empty batch carrying the worker id, so the scheduler knows the stream at once.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        worker_id: str,
        metadata: tuple[tuple[str, str], ...] = (),
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self._stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        self._worker_id = worker_id
        self._metadata = metadata
        self._on_lost = on_lost
        self._queue: asyncio.Queue[scheduler_pb2.TokenBatch | None] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._closing = False
        self.connected = asyncio.Event()
        self._was_lost = False
        self._outbox = FinalOutbox()
        self._resend_through = 0  # numbered batches up to this one went out on (or were dropped from) a stream

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="token-reporter")

    def send(self, batch: scheduler_pb2.TokenBatch) -> None:
        """Queue a batch for the stream (never blocks; the engine thread's pace is the limit)."""
        batch.worker_id = self._worker_id
        self._queue.put_nowait(self._outbox.number(batch))

    def announce(self) -> None:
        """Send an empty batch: tells a scheduler that forgot this worker which stream is its."""
        self.send(scheduler_pb2.TokenBatch())

    async def stop(self, timeout: float = 2.0) -> None:
        """Flush what is queued, half-close the stream and wait (at most `timeout`) for its end."""
        if self._task is None:
            return
        self._closing = True
        self._queue.put_nowait(None)
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        backoff = _BACKOFF_START_S
        while not self._closing:
            try:
                await self._stream_once()
                backoff = _BACKOFF_START_S
            except grpc.aio.AioRpcError as error:
                self._lost(f"{error.code().name}: {error.details()}")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)

    async def _stream_once(self) -> None:
        self.connected.clear()
        call = self._stub.ReportTokens(self._requests(), metadata=self._metadata)
        await call.wait_for_connection()
        if self._was_lost:
            log.info("ReportTokens stream to the scheduler open again")
        self._was_lost = False
        self.connected.set()
        batches = 0
        async for ack in call:
            self._outbox.acked(ack.applied_through)
            batches = ack.batches
        log.debug("ReportTokens stream closed (%d batches acknowledged)", batches)

    async def _requests(self) -> AsyncIterator[scheduler_pb2.TokenBatch]:
        yield scheduler_pb2.TokenBatch(worker_id=self._worker_id)  # names the stream at once
        await self.connected.wait()  # a call that fails to connect must take nothing off the queue
        resend = self._outbox.unacked(self._resend_through)
        if resend:  # after a break only: as rare as the break's warning, and its pair
            log.warning("ReportTokens: %d unacknowledged final event(s) resent", sum(len(b.events) for b in resend))
        for batch in resend:
            yield batch
        while True:
            batch = await self._queue.get()
            if batch is None:
                return
            self._resend_through = max(self._resend_through, batch.sequence)
            yield batch

    def _lost(self, reason: str) -> None:
        if not self.connected.is_set():
            return  # never connected: no scheduler failed anything, the queue waits for the next stream
        self.connected.clear()
        self._was_lost = True
        dropped = self._queue.qsize()
        self._queue = asyncio.Queue()
        self._resend_through = self._outbox.last  # the dropped batches' final events go out again too
        if self._closing:
            return
        log.warning("ReportTokens stream to the scheduler broke (%s); %d batch(es) dropped, reconnecting",
                    reason, dropped)
        if self._on_lost is not None:
            self._on_lost()
