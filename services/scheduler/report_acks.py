"""The acknowledgements on one ReportTokens stream: which of the worker's numbered batches (those
carrying a final event) the scheduler has applied, so the worker can stop keeping them for a resend.

An ack is cumulative (`applied_through`: every numbered batch up to it that came on this stream is
applied) and sent only when something new was applied, at most once per ACK_INTERVAL_S: a stream
costs at most one ack in that time however many requests it ends (scheduler CPU per request is
what the control plane is measured by), and no ack while it ends none. An ack sent late or lost
costs only a resend of what it covered (kept by the worker meanwhile), applied as a no-op.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from services.scheduler import message_counts
from services.scheduler.message_counts import OUT, REPORT_TOKENS
from tandem.v1 import scheduler_pb2

log = logging.getLogger(__name__)

ACK_INTERVAL_S = 5.0
CLOSE_WAIT_S = 1.0  # how long a stream's end waits for its ack writer to stop

WriteAck = Callable[[scheduler_pb2.ReportAck], Awaitable[None]]


class StreamAcks:
    """Call order: applied(sequence, batches)* -> close(). One writer task at a time, started by the
    first ack due, so a stream whose worker numbers nothing costs no task."""

    def __init__(self, write: WriteAck, interval_s: float = ACK_INTERVAL_S) -> None:
        self._write = write
        self._interval_s = interval_s
        self._applied_through = 0
        self._batches = 0
        self._due = asyncio.Event()
        self._task: asyncio.Task | None = None

    def applied(self, sequence: int, batches: int) -> None:
        """The batch numbered `sequence` (0: unnumbered, nothing to ack), the stream's `batches`-th, is applied."""
        self._batches = batches
        if sequence <= self._applied_through:
            return
        self._applied_through = sequence
        self._due.set()
        if self._task is None:
            self._task = asyncio.create_task(self._send_when_due(), name="report-acks")

    async def close(self) -> None:
        """The stream ended: acks still due are dropped (the worker resends what they covered). An ack's
        write to a worker that is gone may not end when cancelled: it is waited for CLOSE_WAIT_S at most."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=CLOSE_WAIT_S)

    async def _send_when_due(self) -> None:
        while True:
            await self._due.wait()
            self._due.clear()
            ack = scheduler_pb2.ReportAck(batches=self._batches, applied_through=self._applied_through)
            try:
                await self._write(ack)
                message_counts.count(REPORT_TOKENS, OUT)
            except Exception as error:  # noqa: BLE001 - the call is ending: its end is handled by the reader
                log.debug("ReportTokens ack not sent (%s: %s); the stream is ending", type(error).__name__, error)
                return
            await asyncio.sleep(self._interval_s)
