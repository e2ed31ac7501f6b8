"""The workers' ReportTokens streams: one long-lived stream per worker, identified by the worker id
of its first TokenBatch. When the current stream of a worker ends, the tokens of its requests can
no longer arrive: `on_closed(worker_id, reason)` fails them and drops the worker. (A killed or
cancelled worker's stream may end cleanly or with an error: both mean the same here.)"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable

from tandem.v1 import scheduler_pb2


class TokenStreams:
    def __init__(self, on_batch: Callable[[str, scheduler_pb2.TokenBatch], None],
                 on_closed: Callable[[str, str], None]) -> None:
        self._on_batch = on_batch
        self._on_closed = on_closed
        self._current: dict[str, int] = {}
        self._generations = itertools.count(1)

    def is_open(self, worker_id: str) -> bool:
        return worker_id in self._current

    async def consume(self, batches: AsyncIterator[scheduler_pb2.TokenBatch]) -> int:
        """Feed one stream's batches to on_batch until it ends; returns how many arrived.

        A newer stream of the same worker replaces this one: the old one's end then means nothing.
        """
        generation = next(self._generations)
        worker_id: str | None = None
        count = 0
        try:
            async for batch in batches:
                count += 1
                if worker_id is None and batch.worker_id:
                    worker_id = batch.worker_id
                    self._current[worker_id] = generation
                if worker_id is not None:
                    self._on_batch(worker_id, batch)
        finally:
            if worker_id is not None and self._current.get(worker_id) == generation:
                del self._current[worker_id]
                self._on_closed(worker_id, "its token stream closed")
        return count
