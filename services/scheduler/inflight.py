"""The requests this scheduler holds, and the load their placements put on workers.

A request enters the table when its Submit call arrives (it may wait in the queue first) and
leaves when its Submit call ends, whatever the outcome. Its Status moves forward only, and only
through this table (advance, close). Its progress (status, ending, outcome) lives on the
RequestState; where it runs lives on its Placement: the workers know an attempt by its own id (the
request id, then `REQUEST_ID#migrated-N` for the continuation the gateway submits after a lost
worker, a record of its own), and only the current attempt's reports reach the request. `holders` are the workers that may hold state for the
attempt (a prefill worker until its Prefill call returns, the decode or colocated worker until the
end): if one is lost, the attempt ends (the request moves, or fails).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum

from opentelemetry import trace

from services.common.step_cost import chunk_reads
from services.common.store import WorkerRecord
from services.scheduler.admission import Ticket
from services.scheduler.deadline import Deadline
from services.scheduler.ending import Ending
from tandem.v1 import common_pb2, scheduler_pb2


class Status(IntEnum):
    """Where a request stands, in order."""

    PENDING = 0  # waiting in the queue, or being routed and reserved
    PREFILLING = 1  # started on its workers; the attempt's first token has not come back
    GENERATING = 2  # the first token came back; the decode worker has not reported (its reservation is unused)
    DECODING = 3  # the decode worker reported: its reservation is in use
    CLOSED = 4  # the Submit call ended: nothing more is started


@dataclass(slots=True)
class Placement:
    """One attempt of a request on workers: what they were sent and what they hold for it."""

    request: scheduler_pb2.SubmitRequest  # as the workers get it: the client's, or a continuation
    colocated: bool = False
    prefill: WorkerRecord | None = None  # the colocated worker in colocated mode
    decode: WorkerRecord | None = None
    uncached_tokens: int = 0  # prompt tokens the prefill worker computes (its queued load until the first token)
    reserved_blocks: int = 0
    decode_reused_blocks: int = 0  # leading reserved blocks the decode worker held already (not shipped)
    reserved_at: float = 0.0
    holders: dict[str, WorkerRecord] = field(default_factory=dict)
    prefill_task: asyncio.Task | None = None
    landing: asyncio.Future | None = None  # the last Reserve or assignment (it may be in flight)
    launched: bool = False  # its assignment or Prefill was sent: the attempt started on its workers

    @property
    def attempt_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.token_ids)

    @property
    def generator(self) -> WorkerRecord | None:
        """The decode or colocated worker that generates (or will generate) the attempt's tokens."""
        return self.prefill if self.colocated else self.decode

    @property
    def generator_id(self) -> str | None:
        worker = self.generator
        return None if worker is None else worker.info.worker_id


@dataclass(slots=True)
class RequestState:
    """One request (or one continuation of it) from admission to the end of its Submit call."""

    request: scheduler_pb2.SubmitRequest  # as the gateway sent it (a continuation's with its delivered tokens)
    deadline: Deadline
    span: trace.Span
    ending: Ending
    placement: Placement
    status: Status = Status.PENDING  # written by InflightTable only
    seed: int = 0
    arrival: float = field(default_factory=time.monotonic)
    queued_s: float = 0.0
    ticket: Ticket | None = None  # its place in the waiting queue, then its running slot
    migrations: int = 0  # moves before this attempt (SubmitRequest.migration)
    route: scheduler_pb2.RouteInfo | None = None
    moved: bool = False  # its worker was lost: a continuation carries the request on
    output_tokens: int = 0  # as the final report counted them
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    error: Exception | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.token_ids)


class InflightTable:
    """Requests by id and by their current attempt's id, with the per-worker sums routing adds to
    the workers' reports."""

    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}
        self._attempts: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        """Whether the id is in use, by a request or by a current attempt on the workers."""
        return request_id in self._states or request_id in self._attempts

    def __iter__(self) -> Iterator[RequestState]:
        return iter(list(self._states.values()))

    def add(self, state: RequestState) -> None:
        self._states[state.request_id] = state
        self._attempts[state.placement.attempt_id] = state

    def get(self, request_id: str) -> RequestState | None:
        return self._states.get(request_id)

    def by_attempt(self, attempt_id: str) -> RequestState | None:
        """The request whose current attempt the workers know by this id."""
        return self._attempts.get(attempt_id)

    def advance(self, state: RequestState, status: Status) -> None:
        """Move the request forward to `status` (never back; a closed request stays closed)."""
        if state.status < status < Status.CLOSED:
            state.status = status

    def close(self, state: RequestState) -> bool:
        """CLOSED: the request leaves the table. False when it had already (close once)."""
        if state.status is Status.CLOSED:
            return False
        state.status = Status.CLOSED
        self._states.pop(state.request_id, None)
        self._attempts.pop(state.placement.attempt_id, None)
        return True

    def held_by(self, worker_id: str) -> list[RequestState]:
        return [s for s in self._states.values() if worker_id in s.placement.holders]

    def holders(self) -> set[str]:
        return {worker_id for s in self._states.values() for worker_id in s.placement.holders}

    def loads(self) -> WorkerLoads:
        """The per-worker sums routing adds to the workers' reports, in one pass over the table."""
        loads = WorkerLoads()
        # The tables bound once: routing sums every request in flight on every route.
        queued, reads, generating, context = (loads.queued_prefill, loads.queued_reads, loads.generating,
                                              loads.generating_context)
        for state in self._states.values():
            placement = state.placement
            prefill, decode = placement.prefill, placement.decode
            prompt_tokens = placement.prompt_tokens
            if prefill is not None and state.status < Status.GENERATING:
                worker_id, uncached = prefill.info.worker_id, placement.uncached_tokens
                queued[worker_id] = queued.get(worker_id, 0) + uncached
                reads[worker_id] = reads.get(worker_id, 0) + chunk_reads(prompt_tokens - uncached, uncached)
            generator = placement.generator
            if generator is not None:
                generator_id = generator.info.worker_id
                generating[generator_id] = generating.get(generator_id, 0) + 1
                context[generator_id] = context.get(generator_id, 0) + prompt_tokens
            if decode is not None and placement.reserved_blocks:
                loads.reservations.setdefault(decode.info.worker_id, []).append(
                    (placement.reserved_at, placement.reserved_blocks))
        return loads


@dataclass(slots=True)
class WorkerLoads:
    """What this scheduler's requests put on each worker, at one moment (InflightTable.loads)."""

    queued_prefill: dict[str, int] = field(default_factory=dict)
    queued_reads: dict[str, int] = field(default_factory=dict)  # the KV entries those prompt tokens' chunks read
    generating: dict[str, int] = field(default_factory=dict)
    generating_context: dict[str, int] = field(default_factory=dict)  # their prompt tokens: KV their decodes read
    reservations: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # decode worker -> (at, blocks)

    def queued_prefill_tokens(self, worker_id: str) -> int:
        """Prompt tokens this scheduler sent the worker to compute that have not produced a first token."""
        return self.queued_prefill.get(worker_id, 0)

    def queued_prefill_reads(self, worker_id: str) -> int:
        """The KV entries the chunks of those prompt tokens read (the token at position p reads p + 1)."""
        return self.queued_reads.get(worker_id, 0)

    def running(self, worker_id: str) -> int:
        """Requests generating (or about to) on the decode or colocated worker."""
        return self.generating.get(worker_id, 0)

    def running_context(self, worker_id: str) -> int:
        """The prompt tokens of those requests: the KV entries their decodes read at least."""
        return self.generating_context.get(worker_id, 0)

    def reserves_on(self, worker_id: str) -> bool:
        """Whether requests in flight hold a reservation on the decode worker."""
        return worker_id in self.reservations

    def reserved_since(self, worker_id: str, since: float) -> int:
        """Blocks reserved on the decode worker after `since` (its last report), for requests still in flight."""
        return sum(blocks for at, blocks in self.reservations.get(worker_id, ()) if at > since)
