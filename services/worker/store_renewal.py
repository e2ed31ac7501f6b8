"""Which of a worker's scheduler replicas writes its heartbeats to the state store they share.

The worker heartbeats to every replica (each one hears its load, and keeps it live through an
outage of the store), but only one of them renews its store entry; the others are told so
(HeartbeatRequest.renewed_elsewhere) and renew their own view only. Without this the store took
one write per replica for each heartbeat, and each replica's listing of the workers decoded as
many changed records.

The rule: the replicas in an order that starts at a place drawn from the worker id (so the
writes spread over the replicas), and the first of them whose last heartbeat went through renews.
A replica whose heartbeat fails hands the renewal on at the next heartbeat, and takes it back once
one goes through again; the store entry's TTL spans several heartbeats, so one missed renewal
lapses nothing. With one scheduler it always renews.
"""

from __future__ import annotations

import zlib


class StoreRenewal:
    """Call order: renews(seat) before each heartbeat to replica `seat`; heard(seat, ok) after it."""

    def __init__(self, worker_id: str, replicas: int) -> None:
        start = zlib.crc32(worker_id.encode()) % replicas if replicas > 0 else 0
        self._order = [(start + i) % replicas for i in range(replicas)]
        self._failing: set[int] = set()

    def renews(self, seat: int) -> bool:
        """Whether replica `seat` writes this heartbeat to the store."""
        renewer = next((s for s in self._order if s not in self._failing), self._order[0] if self._order else seat)
        return seat == renewer

    def heard(self, seat: int, ok: bool) -> None:
        """A heartbeat to replica `seat` went through (ok) or failed."""
        if ok:
            self._failing.discard(seat)
        else:
            self._failing.add(seat)
