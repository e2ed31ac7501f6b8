"""The life of a request in the scheduler, from its Submit call to the end of the call.

Model: the scheduler decides and accounts; it carries no tokens. A request waits its turn in the
queue (admission.py) until it may run and a decode worker has room for its KV, or is refused; then
it is routed, started on its workers (launcher.py), and its Placement goes to the gateway, which
reads the tokens from the workers itself. The call then stays open until the request ends
(ending.py): the workers report each request's first and final event on their ReportTokens
streams, which is all the accounting needs. A request whose Reserve every decode worker refused
for lack of blocks goes back to the head of the queue until one reports room. When the decode or
colocated worker generating a started request is lost (or its prefill worker, before the first
token), the gateway is told (AttemptLost) and submits the continuation: the same request id with
the tokens it delivered and `migration` counting the moves; with migration on, it is placed like a
new request under a new attempt id (migration.py), at the head of the queue if no decode worker
has room. Whatever ends the call (final event, Abort, error, the call cancelled, the deadline, a
lost worker), `_close` runs exactly once: the request leaves every table, what workers still hold
for it is aborted unless it finished, and a decode reservation it never used is released.

Failures reach the gateway as the Submit call's gRPC status, with a stable message naming the
request id (failures.py; the detail goes to the log and span): INVALID_ARGUMENT when the prompt's
KV fits on no decode worker; RESOURCE_EXHAUSTED with the retry hint from the queue's drain rate
(trailing `retry-after`, whole seconds, and `retry-after-ms`) when the queue is full; UNAVAILABLE
when a continuation cannot move (migration off, presence or frequency penalties after its first
token, too many moves), or no worker can serve the request; DEADLINE_EXCEEDED; a worker's own
status code otherwise; INTERNAL for anything unexpected.

A request's Status (inflight.py) moves forward as it goes: PENDING, PREFILLING once started on its
workers, GENERATING at its first token, DECODING at its decode worker's first report, CLOSED.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc
from opentelemetry import trace

from services.common.errors import DeadlineExceeded, InvalidRequest, Overloaded, TandemError, Unavailable
from services.common.metrics import ServiceMetrics
from services.common.spans import Event
from services.common.tracing import Attr, SpanName, extract_context
from services.common.wire import FINISH_REASON_FROM_PROTO
from services.scheduler import failures, migration
from services.scheduler.admission import Admission, TicketState
from services.scheduler.deadline import Deadline
from services.scheduler.ending import Ending, Lost
from services.scheduler.inflight import InflightTable, Placement, RequestState, Status
from services.scheduler.launcher import Launcher
from services.scheduler.membership import Membership
from services.scheduler.model_ttft import ModelTtft
from services.scheduler.planner import Room, RoutePlan, never_fits, plan_route, room
from services.scheduler.prefill_placement import PrefillPlacement
from services.scheduler.registry import WorkerRegistry
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
                 tracer: trace.Tracer | None = None, placement: PrefillPlacement | None = None) -> None:
        """`placement`: where a request with a hybrid decode worker prefills (none: the default policy)."""
        self.registry = registry
        self.placement = placement or PrefillPlacement()
        self.clients = clients
        self.inflight = InflightTable()
        self.membership = Membership(registry, self.inflight, clients, max_running=max_running, spawn=self._spawn,
                                     end_attempt=self._attempt_lost, on_room=self._let_in)
        self.admission = Admission(max_queue, self.membership.capacity)
        self.counters = Counters()
        self.ttft = ModelTtft()  # first-token times per model: cost placement's --replicate-ttft-ms
        self.streams = TokenStreams(self.on_token_batch, self.membership.lost, registry.report_blocks)
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
                     context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.SubmitEvent]:
        """The request's Placement once it runs, then AttemptLost if its worker is lost; returns when
        the request ends. Every failure raises TandemError."""
        state = self._open(request, context)
        context.add_done_callback(lambda _: self._close(state))  # also when the call is cut mid-write
        try:
            if request.migration:
                self._check_may_move(state)
            await self._place(state)
            if not state.placement.launched:
                return  # aborted while it waited
            if request.migration:
                self._count_migration(state)
            yield scheduler_pb2.SubmitEvent(placement=self._placement(state))
            lost = await state.ending.wait(state.deadline.remaining)
            if lost is not None:
                state.moved = True
                yield scheduler_pb2.SubmitEvent(lost=scheduler_pb2.AttemptLost(worker_id=lost.worker_id,
                                                                               reason=str(lost.error)))
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
        """End these requests' Submit calls (OK; their workers are told on close)."""
        aborted = []
        for request_id in request_ids:
            state = self.inflight.get(request_id)
            if state is None or state.ending.closed:
                continue
            state.finish_reason = common_pb2.FINISH_REASON_ABORT
            state.ending.finish()
            if state.ticket is not None and state.ticket.state is TicketState.WAITING:
                self.admission.leave(state.ticket)
            aborted.append(request_id)
        return aborted

    def _open(self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext) -> RequestState:
        if request.migration:
            self._take_over(request.request_id)
        if request.request_id in self.inflight:
            raise InvalidRequest("request_id", f"{request.request_id!r} is already in flight; ids must be unique")
        span = self._tracer.start_span(
            SpanName.SCHEDULER_SUBMIT, context=extract_context(context.invocation_metadata(), baggage=False),
            kind=trace.SpanKind.SERVER,
            attributes={Attr.REQUEST_ID: request.request_id, Attr.GEN_AI_REQUEST_MODEL: request.model})
        sampling = request.sampling
        seed = sampling.seed if sampling.HasField("seed") else secrets.randbits(_SEED_BITS)
        deadline = Deadline.of(context.time_remaining(), request.deadline_unix_ms)
        placement = Placement(request)
        if request.migration:
            attempt_id = migration.attempt_id(request.request_id, request.migration, self.inflight)
            placement = Placement(migration.continuation(request, request.delivered_token_ids, attempt_id))
        state = RequestState(request, deadline, span, Ending(request.request_id), placement, seed=seed,
                             migrations=request.migration)
        self.inflight.add(state)
        if not request.migration:
            self.counters.submitted += 1
        return state

    def _take_over(self, request_id: str) -> None:
        """A continuation arrived: the lost attempt's call may not have ended yet; end it now."""
        old = self.inflight.get(request_id)
        if old is not None:
            old.moved = True
            self._close(old)

    def _check_may_move(self, state: RequestState) -> None:
        """A continuation moves on only with migration on and nothing against it (migration.refusal)."""
        request = state.request
        delivered = len(request.delivered_token_ids)
        refusal = "migration is off" if not self._migration else migration.refusal(
            request, delivered, request.migration - 1)
        if refusal is None:
            return
        log.info("request %s cannot move to another worker: %s", state.request_id, refusal)
        raise Unavailable(f"request {state.request_id}: a worker serving it was lost after {delivered} "
                          f"token(s) and it cannot move on ({refusal}); retry the request")

    def _count_migration(self, state: RequestState) -> None:
        self.counters.migrated += 1
        self._metrics.num_migrations.inc()
        state.span.add_event(Event.MIGRATED, {Attr.MIGRATION_OFFSET: len(state.request.delivered_token_ids)})

    def _placement(self, state: RequestState) -> scheduler_pb2.Placement:
        placement = state.placement
        generator = placement.prefill if placement.colocated else placement.decode
        assert generator is not None and placement.prefill is not None
        event = scheduler_pb2.Placement(
            attempt_id=placement.attempt_id, generator_worker_id=generator.info.worker_id,
            generator_address=generator.info.address, queue_ms=state.queued_s * 1000, seed=state.seed)
        if not placement.colocated:
            event.prefill_worker_id = placement.prefill.info.worker_id
            event.prefill_address = placement.prefill.info.address
        if state.route is not None:
            event.route.CopyFrom(state.route)
        return event

    async def _place(self, state: RequestState) -> None:
        """Wait for the request's turn, then route and start it; back to the head of the queue while
        no decode worker has room for its KV. Returns when it runs, or when its stream has ended."""
        just_asked = [self._check_fits(state)]  # admission's first readiness check, if it comes at once
        state.ticket = self.admission.enter(
            state.request_id, lambda: (just_asked.pop() if just_asked else self._room(state)) is not Room.LATER)
        just_asked.clear()  # later checks (a grant, a requeue) ask again
        let_in_at_once = state.ticket.turn.done()  # nothing ran since the check: no need to check again
        if await self._wait_turn(state):
            await self._start_in_turn(state, fits_checked=let_in_at_once)
        self._metrics.request_queue_time(state.request.model).observe(state.queued_s)
        self._update_gauges()

    async def _start_in_turn(self, state: RequestState, fits_checked: bool = False) -> None:
        """Start the request on its running slot; back to the head of the queue while no decode
        worker has room for its KV. `fits_checked`: room() was asked since the request's last await."""
        assert state.ticket is not None
        while not await self._start(state, fits_checked):
            fits_checked = False
            self.admission.requeue(state.ticket)
            if not await self._wait_turn(state):
                return

    async def _wait_turn(self, state: RequestState) -> bool:
        """Wait until the ticket is let in; False when the request left the queue (aborted)."""
        assert state.ticket is not None
        turn = state.ticket.turn
        self._update_gauges()
        if not turn.done():  # else it was let in at once: nothing to wait for
            try:
                await asyncio.wait_for(asyncio.shield(turn), state.deadline.remaining())
            except TimeoutError:
                raise DeadlineExceeded(f"request {state.request_id}: its deadline passed in the scheduler's "
                                       f"queue ({self.admission.waiting} waiting)") from None
        if not state.migrations:
            state.queued_s = time.monotonic() - state.arrival
        state.span.add_event(Event.ADMITTED)
        return turn.result() and not state.ending.closed

    def _room(self, state: RequestState) -> Room:
        """Whether the request's KV fits now (NEVER: routing then refuses it at once)."""
        return room(self.registry, self.inflight, state.placement.request)

    def _check_fits(self, state: RequestState) -> Room:
        """The request's room(); raises InvalidRequest when it will never fit."""
        fits = self._room(state)
        if fits is Room.NEVER:
            raise never_fits(self.registry, state.placement.request)
        return fits

    async def _start(self, state: RequestState, fits_checked: bool = False) -> bool:
        """Route the request, reserve its decode blocks, and start it on its workers. False when no
        decode worker had room for it after all; True once it started, or its stream ended meanwhile.
        `fits_checked`: whether it fits was asked with nothing awaited since (workers may have left
        while it waited: then it is asked again)."""
        if not fits_checked:
            self._check_fits(state)
        plan = await plan_route(self.registry, self.inflight, state.placement.request, self.placement)
        if state.ending.closed:
            return True
        self._assign_prefill(state, plan)
        decode, block_ids = None, []
        if not plan.colocated:
            reserved = await self._launcher.reserve(state, plan)
            if reserved is None:
                state.span.add_event(Event.NO_ROOM, {Attr.ROUTE_SCORES: plan.scores_json()})
                return state.ending.closed
            decode, block_ids = reserved
        self._record_route(state, plan, decode.worker_id if decode else "")
        if state.ending.closed:
            return True
        self.inflight.advance(state, Status.PREFILLING)
        state.placement.launched = True
        if plan.colocated:
            await self._launcher.run(state)
        else:
            self._launcher.prefill(state, block_ids)
        return True

    def _record_route(self, state: RequestState, plan: RoutePlan, decode_worker_id: str) -> None:
        """The decision, in the stats' recent routes and on the request's span (its `routed` event)."""
        state.route = plan.route_info(state.request_id, decode_worker_id, state.placement.reserved_blocks)
        self.counters.record_route(state.route, *plan.recorded_scores())
        attributes = {Attr.ROUTE_PREFILL_WORKER: state.route.prefill_worker_id,
                      Attr.ROUTE_DECODE_WORKER: state.route.decode_worker_id, Attr.ROUTE_SCORES: plan.scores_json()}
        if plan.placement is not None:
            attributes |= plan.placement.span_attributes()
            self._metrics.prefill_placement(plan.placement.site, plan.placement.reason, state.request.model).inc()
        state.span.set_attributes(attributes)
        state.span.add_event(Event.ROUTED)

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
        state.ending.finish()  # nothing more is waited for
        if state.ticket is not None:
            self.admission.leave(state.ticket)
        outcome = _outcome(state)
        if outcome is not None:
            self.counters.outcomes[outcome] += 1
        if outcome is Outcome.COMPLETED:
            if reservation_unused:
                self._launcher.release(state)
        else:
            self._launcher.abort(state, state.placement, _abort_reason(state))
        reason = FINISH_REASON_FROM_PROTO.get(state.finish_reason)
        if reason is not None:
            self._metrics.request_success(reason, state.request.model).inc()
            state.span.set_attribute(Attr.GEN_AI_RESPONSE_FINISH_REASONS, [reason])
        if state.placement.launched:
            state.span.set_attribute(Attr.GEN_AI_USAGE_OUTPUT_TOKENS, state.output_tokens)
        self._update_gauges()
        if outcome in (Outcome.FAILED, Outcome.REJECTED):
            state.span.set_status(trace.StatusCode.ERROR, str(state.error))
        state.span.end()

    # -- token events and lost attempts ---------------------------------------------------------

    def on_token_batch(self, worker_id: str, batch: scheduler_pb2.TokenBatch) -> None:
        """One iteration's first and final events from a worker's ReportTokens stream."""
        for event in batch.events:
            state = self.inflight.by_attempt(event.request_id)
            if state is not None:  # else it ended already (aborted, failed, moved): late reports are dropped
                self._deliver(state, state.placement, worker_id, event)

    def _deliver(self, state: RequestState, placement: Placement, worker_id: str,
                 event: scheduler_pb2.TokenEvent) -> None:
        """A report on the attempt `placement` from `worker_id`, if that attempt is still current: the
        first token and the decode worker's first report advance it, a final event ends it."""
        if state.placement is not placement or state.ending.closed:
            return
        if event.finish_reason == _ERROR:
            event.worker_id = event.worker_id or worker_id
            state.ending.fail(failures.from_event(state, event))
            return
        if event.output_offset == 0 and event.token_ids:
            if state.status < Status.GENERATING and not state.migrations and state.request.model:
                self.ttft.observe(state.request.model, (time.monotonic() - state.arrival) * 1000)
            self.inflight.advance(state, Status.GENERATING)
        if placement.decode is not None and worker_id == placement.decode.info.worker_id:
            self.inflight.advance(state, Status.DECODING)
        if event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            state.finish_reason = event.finish_reason
            state.output_tokens = event.usage.completion_tokens
            state.ending.finish()

    def _attempt_lost(self, state: RequestState, placement: Placement, error: TandemError) -> bool:
        """A worker of the request's attempt was lost: the gateway is told, and submits the
        continuation (True). An attempt that is no longer current changes nothing."""
        if state.placement is not placement or state.ending.closed:
            return False
        worker_id = placement.generator_id or ""
        state.ending.lose(Lost(worker_id, error))
        state.span.add_event(Event.MIGRATED, {Attr.MIGRATION_FROM: worker_id})
        return True

    # -- helpers -------------------------------------------------------------------------------

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


def _outcome(state: RequestState) -> Outcome | None:
    """How the request counts in the stats; None for an attempt whose worker was lost (its
    continuation counts)."""
    if state.moved and state.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
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
    if state.moved:
        return "the request moved to another worker"
    if state.finish_reason == common_pb2.FINISH_REASON_ABORT:
        return "aborted"
    if isinstance(state.error, DeadlineExceeded):
        return "deadline passed"
    if state.error is not None:
        return f"request failed: {state.error}"
    return "client cancelled"

