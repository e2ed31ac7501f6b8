"""The life of a request in the scheduler, from its Submit call to the end of its stream.

Model: a request waits its turn in the queue (admission.py) until it may run and a decode worker
has room for its KV, or is refused; then it is routed, started on its workers (launcher.py), and
relayed until its final event: token 0 from the prefill worker, the rest from the decode worker,
each on its own ReportTokens stream (or all from a colocated one). A request whose Reserve every
decode worker refused for lack of blocks goes back to the head of the queue until one reports
room. When the decode or colocated worker generating a started request is lost (or its prefill
worker, before the first token came back), the request moves: with migration on, its continuation
(migration.py) is placed like a new request, at the head of the queue if no decode worker has room,
and the relay goes on at the same output offset. Whatever ends the stream (final event, Abort,
error, the call cancelled, the deadline), `_close` runs exactly once: the request leaves every
table, what workers still hold for it is aborted unless it finished, and a decode reservation it
never used is released.

Failures reach the gateway as the Submit call's gRPC status, never as an in-band error event,
with a stable message naming the request id (failures.py; the detail goes to the log and span):
INVALID_ARGUMENT when the prompt's KV fits on no decode worker; RESOURCE_EXHAUSTED with the retry
hint from the queue's drain rate (trailing `retry-after`, whole seconds, and `retry-after-ms`)
when the queue is full; UNAVAILABLE when a worker holding the request is lost (its token stream
ends, its heartbeat lapses, or a call to it is cut) and the request cannot move (migration off,
presence or frequency penalties after its first token, no worker left), or no worker can serve
it; DEADLINE_EXCEEDED; a worker's own status code otherwise; INTERNAL for anything unexpected.

A request's Status (inflight.py) moves forward as it goes: PENDING, PREFILLING once started on its
workers, GENERATING at its first token, DECODING at its decode worker's first report, CLOSED.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry import trace

from services.common.errors import DeadlineExceeded, InvalidRequest, Overloaded, TandemError, Unavailable
from services.common.metrics import ServiceMetrics
from services.common.spans import Event
from services.common.tracing import Attr, SpanName, TokenTimings, extract_context
from services.common.wire import FINISH_REASON_FROM_PROTO
from services.scheduler import failures, migration
from services.scheduler.admission import Admission, TicketState
from services.scheduler.deadline import Deadline
from services.scheduler.inflight import InflightTable, Placement, RequestState, Status
from services.scheduler.launcher import Launcher
from services.scheduler.membership import Membership
from services.scheduler.outgoing import outgoing
from services.scheduler.planner import Room, RoutePlan, never_fits, plan_route, room
from services.scheduler.registry import WorkerRegistry
from services.scheduler.relay import Interrupted, Relay
from services.scheduler.router import cached_tokens
from services.scheduler.stats import Counters, Outcome, snapshot
from services.scheduler.streams import TokenStreams
from services.scheduler.worker_clients import WorkerClients
from tandem.v1 import common_pb2, scheduler_pb2

log = logging.getLogger(__name__)

_SEED_BITS = 63
_FINISHED = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
_ERROR = common_pb2.FINISH_REASON_ERROR


class Dispatcher:
    """Call order: start(), then submit()/abort()/worker events from the servicer, close() last."""

    def __init__(self, registry: WorkerRegistry, clients: WorkerClients, *, max_queue: int, max_running: int,
                 migration: bool = True, metrics: ServiceMetrics | None = None,
                 tracer: trace.Tracer | None = None) -> None:
        self.registry = registry
        self.clients = clients
        self.inflight = InflightTable()
        self.membership = Membership(registry, self.inflight, clients, max_running=max_running, spawn=self._spawn,
                                     end_attempt=self._attempt_lost, on_room=self._let_in)
        self.admission = Admission(max_queue, self.membership.capacity)
        self.counters = Counters()
        self.streams = TokenStreams(self.on_token_batch, self.membership.lost)
        self._launcher = Launcher(clients, self._spawn, registry, control_timeout=registry.ttl,
                                  on_lost=self._attempt_lost, deliver=self._deliver)
        self._migration = migration
        self._metrics = metrics or ServiceMetrics("", "scheduler")
        self._tracer = tracer or trace.get_tracer("tandem.scheduler")
        self._tasks: set[asyncio.Task] = set()
        self._watcher: asyncio.Task | None = None

    # -- lifecycle of the service --------------------------------------------------------------

    def start(self, watch_interval: float) -> None:
        """Watch the registry every `watch_interval` seconds for workers whose heartbeat lapsed."""
        self._watcher = self._spawn(self.membership.watch(watch_interval))

    async def close(self, grace: float = 2.0) -> None:
        """Stop watching; give the aborts and releases under way `grace` seconds, then cancel what is left."""
        if self._watcher is not None:
            self._watcher.cancel()
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=grace)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def stats(self, recent_routes: int) -> scheduler_pb2.SchedulerStats:
        records = await self.registry.live_workers()
        return snapshot(self.counters, self.admission, self.registry, records, recent_routes)

    # -- a request -----------------------------------------------------------------------------

    async def submit(self, request: scheduler_pb2.SubmitRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        """The request's events, in order, up to the final one; every failure raises TandemError."""
        if request.request_id in self.inflight:
            raise InvalidRequest("request_id", f"{request.request_id!r} is already in flight; ids must be unique")
        state = self._open(request, context)
        context.add_done_callback(lambda _: self._close(state))  # also when the stream is cut mid-write
        try:
            await self._place(state)
            with self._relay_span(state) as timings:
                while True:
                    try:
                        async for event in state.relay.events(state.deadline.remaining):
                            if event.token_ids:
                                timings.record(len(event.token_ids))
                            yield outgoing(state, event, time.monotonic())
                        break
                    except Interrupted as interruption:
                        await self._resume(state, interruption)
        except TandemError as error:
            state.error = error
            raise
        except asyncio.CancelledError:
            if failures.caller_cancelled():
                raise  # the Submit call ended: nobody is left to tell
            state.error = failures.interrupted(state)
            raise state.error from None
        except Exception as exc:
            state.error = failures.internal(state, exc)
            raise state.error from None
        finally:
            self._close(state)

    def abort(self, request_ids: list[str]) -> list[str]:
        """End these requests' streams with FINISH_REASON_ABORT (their workers are told on close)."""
        aborted = []
        for request_id in request_ids:
            state = self.inflight.get(request_id)
            if state is None or state.relay.closed:
                continue
            state.relay.finish(common_pb2.FINISH_REASON_ABORT)
            if state.ticket is not None and state.ticket.state is TicketState.WAITING:
                self.admission.leave(state.ticket)
            aborted.append(request_id)
        return aborted

    def _open(self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext) -> RequestState:
        span = self._tracer.start_span(
            SpanName.SCHEDULER_SUBMIT, context=extract_context(context.invocation_metadata()),
            kind=trace.SpanKind.SERVER,
            attributes={Attr.REQUEST_ID: request.request_id, Attr.GEN_AI_REQUEST_MODEL: request.model})
        sampling = request.sampling
        seed = sampling.seed if sampling.HasField("seed") else secrets.randbits(_SEED_BITS)
        deadline = Deadline.of(context.time_remaining(), request.deadline_unix_ms)
        state = RequestState(request, deadline, span, Relay(request.request_id), Placement(request), seed=seed)
        self.inflight.add(state)
        self.counters.submitted += 1
        return state

    async def _place(self, state: RequestState) -> None:
        """Wait for the request's turn, then route and start it; back to the head of the queue while
        no decode worker has room for its KV. Returns when it runs, or when its stream has ended."""
        self._check_fits(state)
        state.ticket = self.admission.enter(state.request_id, lambda: self._ready(state))
        if await self._wait_turn(state):
            await self._start_in_turn(state)
        self._metrics.request_queue_time.observe(state.queued_s)
        self._update_gauges()

    async def _start_in_turn(self, state: RequestState) -> None:
        """Start the request on its running slot; back to the head of the queue while no decode
        worker has room for its KV."""
        assert state.ticket is not None
        while not await self._start(state):
            self.admission.requeue(state.ticket)
            if not await self._wait_turn(state):
                return

    async def _resume(self, state: RequestState, interruption: Interrupted) -> None:
        """Start the continuation _attempt_lost placed; the loss's error when no worker can take it."""
        if room(self.registry, self.inflight, state.placement.request) is Room.NEVER:
            raise interruption.error
        try:
            await self._start_in_turn(state)
        except Unavailable:
            raise interruption.error from None
        if not state.placement.launched:
            return  # aborted before the continuation started (one that started may finish at once)
        self.counters.migrated += 1
        self._metrics.num_migrations.inc()
        self._update_gauges()

    async def _wait_turn(self, state: RequestState) -> bool:
        """Wait until the ticket is let in; False when the request left the queue (aborted)."""
        assert state.ticket is not None
        with self._child_span(state, SpanName.SCHEDULER_QUEUE):
            self._update_gauges()
            try:
                turn = await asyncio.wait_for(asyncio.shield(state.ticket.turn), state.deadline.remaining())
            except TimeoutError:
                raise DeadlineExceeded(f"request {state.request_id}: its deadline passed in the scheduler's "
                                       f"queue ({self.admission.waiting} waiting)") from None
        if not state.migrations:
            state.queued_s = time.monotonic() - state.arrival
        return turn and not state.relay.closed

    def _ready(self, state: RequestState) -> bool:
        """The request's KV may fit now (or will never: routing then refuses it at once)."""
        return room(self.registry, self.inflight, state.placement.request) is not Room.LATER

    def _check_fits(self, state: RequestState) -> None:
        if room(self.registry, self.inflight, state.placement.request) is Room.NEVER:
            raise never_fits(self.registry, state.placement.request)

    async def _start(self, state: RequestState) -> bool:
        """Route the request, reserve its decode blocks, and start it on its workers. False when no
        decode worker had room for it after all; True once it started, or its stream ended meanwhile."""
        self._check_fits(state)
        with self._child_span(state, SpanName.SCHEDULER_ROUTE) as span:
            plan = await plan_route(self.registry, self.inflight, state.placement.request)
            if state.relay.closed:
                return True
            self._assign_prefill(state, plan)
            decode, block_ids = None, []
            if not plan.colocated:
                reserved = await self._launcher.reserve(state, plan)
                if reserved is None:
                    span.set_attribute(Attr.ROUTE_SCORES, plan.scores_json())
                    return state.relay.closed
                decode, block_ids = reserved
            state.route = plan.route_info(state.request_id, decode.worker_id if decode else "",
                                          state.placement.reserved_blocks)
            self.counters.routes.append(state.route)
            span.set_attributes({Attr.ROUTE_PREFILL_WORKER: state.route.prefill_worker_id,
                                 Attr.ROUTE_DECODE_WORKER: state.route.decode_worker_id,
                                 Attr.ROUTE_SCORES: plan.scores_json()})
        if state.relay.closed:
            return True
        self.inflight.advance(state, Status.PREFILLING)
        state.placement.launched = True
        if plan.colocated:
            await self._launcher.run(state)
        else:
            self._launcher.prefill(state, block_ids)
        return True

    def _assign_prefill(self, state: RequestState, plan: RoutePlan) -> None:
        best = plan.prefill[0]
        worker = plan.workers[best.worker_id]
        placement = state.placement
        placement.colocated = plan.colocated
        placement.prefill = worker
        cached = cached_tokens(best.cached_blocks, worker.info.block_size, placement.prompt_tokens)
        placement.uncached_tokens = placement.prompt_tokens - cached
        if plan.colocated:
            placement.holders[best.worker_id] = worker

    def _close(self, state: RequestState) -> None:
        """Forget the request and settle what workers hold for it; runs once per request."""
        reservation_unused = state.status < Status.DECODING
        if not self.inflight.close(state):
            return
        state.relay.finish(common_pb2.FINISH_REASON_ABORT)  # nothing more is delivered
        if state.ticket is not None:
            self.admission.leave(state.ticket)
        outcome = _outcome(state)
        self.counters.outcomes[outcome] += 1
        if outcome is Outcome.COMPLETED:
            if reservation_unused:
                self._launcher.release(state)
        else:
            self._launcher.abort(state, state.placement, _abort_reason(state))
        reason = FINISH_REASON_FROM_PROTO.get(state.finish_reason)
        if reason is not None:
            self._metrics.request_success(reason).inc()
        self._update_gauges()
        if outcome in (Outcome.FAILED, Outcome.REJECTED):
            state.span.set_status(trace.StatusCode.ERROR, str(state.error))
        state.span.end()

    # -- token events and lost attempts ---------------------------------------------------------

    def on_token_batch(self, worker_id: str, batch: scheduler_pb2.TokenBatch) -> None:
        """One iteration's events from a worker's ReportTokens stream, to their requests' relays."""
        for event in batch.events:
            state = self.inflight.by_attempt(event.request_id)
            if state is not None:  # else it ended already (aborted, failed, moved): late tokens are dropped
                self._deliver(state, state.placement, worker_id, event)

    def _deliver(self, state: RequestState, placement: Placement, worker_id: str,
                 event: scheduler_pb2.TokenEvent) -> None:
        """An event of the attempt `placement` from `worker_id`, to the request's relay if that
        attempt is still current; the first token and the decode worker's first report advance it."""
        if state.placement is not placement:
            return
        event.request_id = state.request_id
        if not event.worker_id:
            event.worker_id = worker_id
        if event.finish_reason == _ERROR:
            state.relay.fail(failures.from_event(state, event))
            return
        if event.output_offset == 0:
            self.inflight.advance(state, Status.GENERATING)
        if placement.decode is not None and worker_id == placement.decode.info.worker_id:
            self.inflight.advance(state, Status.DECODING)
        state.relay.push(event)

    def _attempt_lost(self, state: RequestState, placement: Placement, error: TandemError) -> bool:
        """A worker of the request's attempt was lost: move the request to a continuation (True),
        which its Submit stream starts when the relay reaches the interruption, or fail it with
        `error`. An attempt that is no longer current changes nothing."""
        if state.placement is not placement or state.relay.closed:
            return False
        delivered = state.relay.next_offset
        refusal = "migration is off" if not self._migration else migration.refusal(
            state.request, delivered, state.migrations)
        if refusal is not None:
            log.info("request %s cannot move to another worker: %s", state.request_id, refusal)
            state.relay.fail(error)
            return False
        state.migrations += 1
        attempt_id = migration.attempt_id(state.request_id, state.migrations, self.inflight)
        moved = migration.continuation(state.request, state.relay.tokens, attempt_id)
        old = self.inflight.move(state, Placement(moved))
        self._launcher.abort(state, old, "the request moved to another worker")
        state.relay.interrupt(error)
        state.span.add_event(Event.MIGRATED, {Attr.MIGRATION_FROM: old.generator_id or "",
                                              Attr.MIGRATION_OFFSET: delivered})
        return True

    # -- helpers -------------------------------------------------------------------------------

    @contextmanager
    def _child_span(self, state: RequestState, name: str) -> Iterator[trace.Span]:
        span = self._tracer.start_span(name, context=trace.set_span_in_context(state.span))
        try:
            yield span
        except Exception as exc:
            span.set_status(trace.StatusCode.ERROR, str(exc))
            raise
        finally:
            span.end()

    @contextmanager
    def _relay_span(self, state: RequestState) -> Iterator[TokenTimings]:
        """The relay of the request's events back to the gateway: a span with the timings of the
        tokens as they passed through (record them on the yielded TokenTimings)."""
        timings = TokenTimings()
        with self._child_span(state, SpanName.RELAY) as span:
            try:
                yield timings
            finally:
                span.set_attribute(Attr.GEN_AI_USAGE_OUTPUT_TOKENS, timings.num_tokens)
                reason = FINISH_REASON_FROM_PROTO.get(state.finish_reason)
                if reason is not None:
                    span.set_attribute(Attr.GEN_AI_RESPONSE_FINISH_REASONS, [reason])
                timings.annotate(span)

    def _let_in(self) -> None:
        """Capacity or a worker's room may have grown: let waiting requests in."""
        self.admission.grant()
        self._update_gauges()

    def _update_gauges(self) -> None:
        self._metrics.num_requests_running.set(self.admission.running)
        self._metrics.num_requests_waiting.set(self.admission.waiting)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _outcome(state: RequestState) -> Outcome:
    if state.finish_reason in _FINISHED:
        return Outcome.COMPLETED
    if state.finish_reason == common_pb2.FINISH_REASON_ABORT:
        return Outcome.ABORTED
    if isinstance(state.error, Overloaded):
        return Outcome.REJECTED
    if state.error is None or isinstance(state.error, DeadlineExceeded):
        return Outcome.ABORTED  # the call was cancelled, or time ran out
    return Outcome.FAILED


def _abort_reason(state: RequestState) -> str:
    if state.finish_reason == common_pb2.FINISH_REASON_ABORT:
        return "aborted"
    if isinstance(state.error, DeadlineExceeded):
        return "deadline passed"
    if state.error is not None:
        return f"request failed: {state.error}"
    return "client cancelled"

