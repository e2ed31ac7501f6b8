"""The scheduler's counters and recent routing decisions, and the SchedulerStats snapshot built from them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

from services.common.store import WorkerRecord
from services.scheduler.admission import Admission
from services.scheduler.convert import info_to_pb, load_to_pb
from services.scheduler.registry import WorkerRegistry
from services.scheduler.router import Score
from tandem.v1 import scheduler_pb2

RECENT_ROUTES = 256


class Outcome(StrEnum):
    """How a Submit stream ended (the counters of SchedulerStats)."""

    COMPLETED = "completed"  # STOP or LENGTH
    ABORTED = "aborted"  # Abort RPC, client gone, deadline passed
    FAILED = "failed"  # a worker failed or was lost, no worker to serve it
    REJECTED = "rejected"  # RESOURCE_EXHAUSTED


class RecentRoute(NamedTuple):
    """A routing decision and its best candidates' scores, as kept for Stats: the scores become the
    wire's WorkerScores only when Stats asks (every request is routed; few decisions are read)."""

    route: scheduler_pb2.RouteInfo  # without scores
    prefill: list[Score]
    decode: list[Score]

    def to_pb(self) -> scheduler_pb2.RouteInfo:
        route = scheduler_pb2.RouteInfo()
        route.CopyFrom(self.route)
        route.prefill_scores.extend(s.to_pb() for s in self.prefill)
        route.decode_scores.extend(s.to_pb() for s in self.decode)
        return route


@dataclass(slots=True)
class Counters:
    submitted: int = 0
    migrated: int = 0  # continuations started after a worker was lost (a request may move more than once)
    outcomes: dict[Outcome, int] = field(default_factory=lambda: dict.fromkeys(Outcome, 0))
    routes: deque[RecentRoute] = field(default_factory=lambda: deque(maxlen=RECENT_ROUTES))

    def record_route(self, route: scheduler_pb2.RouteInfo, prefill: list[Score], decode: list[Score]) -> None:
        self.routes.append(RecentRoute(route, prefill, decode))

    def recent_routes(self, n: int) -> list[scheduler_pb2.RouteInfo]:
        """The last `n` decisions, oldest first, with their candidates' scores."""
        return [recent.to_pb() for recent in list(self.routes)[-n:]] if n > 0 else []


def snapshot(counters: Counters, admission: Admission, registry: WorkerRegistry, workers: list[WorkerRecord],
             recent_routes: int) -> scheduler_pb2.SchedulerStats:
    """The Stats RPC's answer: queue, counters, live workers and the last `recent_routes` decisions."""
    return scheduler_pb2.SchedulerStats(
        waiting=admission.waiting,
        running=admission.running,
        max_queue=admission.max_queue,
        degraded=registry.degraded,
        store=registry.store.name,
        workers=[worker_status(r, registry.heartbeat_age(r.info.worker_id)) for r in workers],
        submitted=counters.submitted,
        completed=counters.outcomes[Outcome.COMPLETED],
        aborted=counters.outcomes[Outcome.ABORTED],
        failed=counters.outcomes[Outcome.FAILED],
        rejected=counters.outcomes[Outcome.REJECTED],
        migrated=counters.migrated,
        recent_routes=counters.recent_routes(recent_routes),
    )


def worker_status(record: WorkerRecord, heartbeat_age_s: float | None) -> scheduler_pb2.WorkerStatus:
    return scheduler_pb2.WorkerStatus(
        info=info_to_pb(record.info, record.load),
        load=load_to_pb(record.load),
        heartbeat_age_ms=0.0 if heartbeat_age_s is None else heartbeat_age_s * 1000,
    )
