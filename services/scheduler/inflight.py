"""The requests this scheduler holds, and the load its dispatched ones put on workers.

A request enters the table when its Submit call arrives (it may wait in the queue first) and
leaves when its Submit stream ends, whatever the outcome. `holders` are the workers that may hold
state for it (a prefill worker until its Prefill call returns, the decode or colocated worker
until the end): if one is lost, the request fails.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from opentelemetry import trace

from services.common.store import WorkerRecord
from services.scheduler.admission import Ticket
from services.scheduler.deadline import Deadline
from services.scheduler.relay import Relay
from tandem.v1 import common_pb2, scheduler_pb2


@dataclass(slots=True)
class RequestState:
    """One request from admission to the end of its Submit stream."""

    request: scheduler_pb2.SubmitRequest
    deadline: Deadline
    span: trace.Span
    relay: Relay
    seed: int = 0
    arrival: float = field(default_factory=time.monotonic)
    queued_s: float = 0.0
    ticket: Ticket | None = None  # its place in the waiting queue, then its running slot
    colocated: bool = False
    prefill: WorkerRecord | None = None  # the colocated worker in colocated mode
    decode: WorkerRecord | None = None
    uncached_tokens: int = 0  # prompt tokens the prefill worker computes (its queued load until the first token)
    prefill_pending: bool = True  # no first token yet
    reserved_blocks: int = 0
    reserved_at: float = 0.0
    decode_reported: bool = False  # the decode worker sent an event for it
    holders: dict[str, WorkerRecord] = field(default_factory=dict)
    route: scheduler_pb2.RouteInfo | None = None
    timings: common_pb2.RequestTimings = field(default_factory=common_pb2.RequestTimings)
    first_token_at: float | None = None
    events_sent: int = 0
    prefill_task: asyncio.Task | None = None
    landing: asyncio.Future | None = None  # the last Reserve or Run call (it may be in flight)
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    error: Exception | None = None
    closed: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.token_ids)


class InflightTable:
    """Dispatched requests by id, with the per-worker sums routing adds to the workers' reports."""

    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __iter__(self) -> Iterator[RequestState]:
        return iter(list(self._states.values()))

    def add(self, state: RequestState) -> None:
        self._states[state.request_id] = state

    def get(self, request_id: str) -> RequestState | None:
        return self._states.get(request_id)

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def held_by(self, worker_id: str) -> list[RequestState]:
        return [s for s in self._states.values() if worker_id in s.holders]

    def holders(self) -> set[str]:
        return {worker_id for s in self._states.values() for worker_id in s.holders}

    def queued_prefill_tokens(self, worker_id: str) -> int:
        """Prompt tokens this scheduler sent the worker to compute that have not produced a first token."""
        return sum(s.uncached_tokens for s in self._states.values()
                   if s.prefill_pending and s.prefill is not None and s.prefill.info.worker_id == worker_id)

    def running(self, worker_id: str) -> int:
        """Requests generating (or about to) on the decode or colocated worker."""
        return sum(1 for s in self._states.values() if _generator_id(s) == worker_id)

    def reserved_since(self, worker_id: str, since: float) -> int:
        """Blocks reserved on the decode worker after `since` (its last report), for requests still in flight."""
        return sum(s.reserved_blocks for s in self._states.values()
                   if s.decode is not None and s.decode.info.worker_id == worker_id and s.reserved_at > since)


def _generator_id(state: RequestState) -> str | None:
    worker = state.prefill if state.colocated else state.decode
    return None if worker is None else worker.info.worker_id
