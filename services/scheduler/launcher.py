"""The calls that start a routed request on its workers, and settle what they hold when it ends.

Disaggregated: Reserve the prompt's KV blocks (and the first token's slot) on the best ranked
decode worker that has room, then Prefill on the prefill worker, which returns after the KV
transfer and repeats token 0. Colocated, or a hybrid decode worker that prefills the request
itself (planner.py): a RunRequest on the worker's Assign stream (assign_stream.py: one long-lived
call per worker, answered per request as a unary call would be), and Abort by its role's service. Every
call and assignment carries the request's remaining deadline, its trace context and the internal
token. A Reserve or assignment still in flight when the request is cancelled completes anyway, and
its Abort is sent after it, so no reservation outlives its request.

Every call is bounded: Reserve, an assignment, Release and Abort by the control timeout (the
heartbeat TTL: a worker that cannot answer within it would be declared lost anyway), but a Reserve
or assignment on a worker that must load the request's model first (a cold start, which its
heartbeats go on through) by a model load's timeout; all of them, and Prefill, by the request's
deadline. A call whose channel is closed under it, or an assignment whose stream broke (its worker
was lost), fails as UNAVAILABLE, like an unreachable worker; whatever fails, the request ends with
a status, or, for a Prefill that found a worker unreachable, the attempt ends and the request may
move on. Each call names the request by its current attempt's id (inflight.Placement).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import grpc

from services.common.errors import Overloaded, TandemError, Unavailable, grpc_status
from services.common.store import WorkerRecord, WorkerRole
from services.scheduler import failures
from services.scheduler.inflight import Placement, RequestState
from services.scheduler.model_loads import LOAD_TIMEOUT_S
from services.scheduler.model_placement import cold_start
from services.scheduler.planner import RoutePlan
from services.scheduler.registry import WorkerRegistry
from services.scheduler.router import Score
from services.scheduler.worker_clients import WorkerClients, trace_context
from tandem.v1 import common_pb2, scheduler_pb2, worker_pb2

log = logging.getLogger(__name__)

PREFILL_TIMEOUT_S = 600.0  # a Prefill without a deadline: queue, compute and KV transfer
# A worker that refused a Reserve holds nothing; after any other failure it may hold a reservation.
_REFUSED = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED)

Spawn = Callable[[Coroutine[Any, Any, None]], asyncio.Task]
OnLost = Callable[[RequestState, Placement, TandemError], None]
Deliver = Callable[[RequestState, Placement, str, scheduler_pb2.TokenEvent], None]


class Launcher:
    """`spawn` runs a background task the dispatcher keeps track of; `control_timeout` bounds the
    quick calls (Reserve, an assignment, Release, Abort); a decode worker that refuses a Reserve is marked
    full in `registry` until it reports again; `on_lost` ends an attempt whose Prefill found a
    worker unreachable (the dispatcher moves the request on, or fails it); `deliver` takes the
    events a PrefillResponse backs up, as if its worker had reported them."""

    def __init__(self, clients: WorkerClients, spawn: Spawn, registry: WorkerRegistry,
                 control_timeout: float, on_lost: OnLost, deliver: Deliver) -> None:
        self.clients = clients
        self._spawn = spawn
        self._on_lost = on_lost
        self._deliver = deliver
        self._registry = registry
        self._control_timeout = control_timeout

    async def reserve(self, state: RequestState, plan: RoutePlan) -> tuple[Score, list[int]] | None:
        """Reserve on the decode candidates in rank order, going on past those that refuse for lack
        of room, cannot be reached, or left the registry since the plan was made. None when none
        took it but one may make room: the request waits. Unavailable when every candidate tried
        was unreachable."""
        placement = state.placement
        request = worker_pb2.ReserveRequest(request_id=placement.attempt_id, num_tokens=placement.prompt_tokens + 1,
                                            token_ids=placement.request.token_ids,
                                            cache_salt=placement.request.cache_salt, lora=placement.request.lora,
                                            model=placement.request.model)
        unreachable: Unavailable | None = None
        short = False
        for score in plan.decode:
            if state.ending.closed:
                return None
            if not self._registry.is_live(score.worker_id):
                continue
            worker = plan.workers[score.worker_id]
            placement.holders[score.worker_id] = worker
            reserve = self.clients.decode(worker.info.address).Reserve
            try:
                response = await self._landing(
                    state, worker, "Reserve",
                    lambda timeout: reserve(request, timeout=timeout, metadata=self._metadata(state)),
                    self._bound(worker, placement.request.model))
            except TandemError as error:
                if grpc_status(error) in _REFUSED:
                    placement.holders.pop(score.worker_id, None)
                if isinstance(error, Overloaded):
                    self._registry.mark_full(score.worker_id)
                    short = True
                elif isinstance(error, Unavailable):
                    unreachable = error
                else:
                    raise
                continue
            placement.decode = worker
            placement.reserved_blocks = len(response.block_ids)
            placement.decode_reused_blocks = response.reused_blocks
            placement.reserved_at = time.monotonic()
            return score, list(response.block_ids)
        if unreachable is not None and not short:
            raise unreachable
        return None

    def prefill(self, state: RequestState, block_ids: list[int]) -> None:
        """Start the Prefill call in the background: token 0 arrives on the worker's token stream."""
        placement = state.placement
        assert placement.prefill is not None
        placement.holders[placement.prefill.info.worker_id] = placement.prefill
        placement.prefill_task = self._spawn(self._prefill(state, placement, block_ids))

    async def run(self, state: RequestState) -> None:
        """Hand the request to its colocated (or hybrid decode) worker on its Assign stream; returns
        once it is queued there."""
        placement = state.placement
        worker = placement.prefill
        assert worker is not None
        request = worker_pb2.RunRequest(request_id=placement.attempt_id, token_ids=placement.request.token_ids,
                                        sampling=_sampling(state), seed=state.seed,
                                        cache_salt=placement.request.cache_salt, lora=placement.request.lora,
                                        model=placement.request.model, trace_context=trace_context(state.span))
        stream = self.clients.assign(worker.info.address)
        await self._landing(state, worker, "Assign", lambda timeout: stream.send(request, timeout),
                            self._bound(worker, placement.request.model))

    def release(self, state: RequestState) -> None:
        """Free the decode reservation of a request that ended before its decode worker reported
        (at its first token): it was never used."""
        placement = state.placement
        decode = placement.decode
        if decode is None:
            return
        request = worker_pb2.ReleaseRequest(request_id=placement.attempt_id)
        call = self.clients.decode(decode.info.address).Release(
            request, timeout=self._control_timeout, metadata=self._metadata(state))
        self._spawn(_quietly(call, f"Release of {placement.attempt_id} on {decode.info.worker_id}"))

    def abort(self, state: RequestState, placement: Placement, reason: str) -> None:
        """Cancel the attempt's Prefill call and Abort it on every worker that may hold it (idempotent there)."""
        if placement.prefill_task is not None:
            placement.prefill_task.cancel()
        if placement.holders or placement.landing is not None:
            self._spawn(self._abort_holders(state, placement, reason))

    async def _prefill(self, state: RequestState, placement: Placement, block_ids: list[int]) -> None:
        """The Prefill call (it returns after the KV transfer); its response backs up token 0.
        An unreachable worker ends the attempt through `on_lost` (the request may move on); any
        other failure ends the request's stream with a status."""
        prefill, decode = placement.prefill, placement.decode
        assert prefill is not None and decode is not None
        request = worker_pb2.PrefillRequest(
            request_id=placement.attempt_id, token_ids=placement.request.token_ids, sampling=_sampling(state),
            seed=state.seed, cache_salt=placement.request.cache_salt, decode_address=decode.info.address,
            decode_worker_id=decode.info.worker_id, decode_block_ids=block_ids, lora=placement.request.lora,
            decode_reused_blocks=placement.decode_reused_blocks, model=placement.request.model)
        try:
            timeout = state.deadline.timeout(PREFILL_TIMEOUT_S)
            response = await self.clients.prefill(prefill.info.address).Prefill(
                request, timeout=timeout, metadata=self._metadata(state))
        except grpc.aio.AioRpcError as exc:
            self._failed(state, placement, failures.from_rpc(state, prefill, "Prefill", exc,
                                                             deadline_bound=timeout < PREFILL_TIMEOUT_S))
            return
        except TandemError as exc:
            state.ending.fail(exc)
            return
        except asyncio.CancelledError:
            if failures.caller_cancelled():
                raise
            self._failed(state, placement, failures.cut(state, prefill, "Prefill"))
            return
        except Exception as exc:
            state.ending.fail(failures.internal(state, exc))
            return
        placement.holders.pop(prefill.info.worker_id, None)
        for event in prefill_events(state, response):
            self._deliver(state, placement, prefill.info.worker_id, event)

    def _failed(self, state: RequestState, placement: Placement, error: TandemError) -> None:
        """A Prefill that failed: a worker that stopped answering ends the attempt, anything else the request."""
        if isinstance(error, Unavailable):
            self._on_lost(state, placement, error)
        elif state.placement is placement:
            state.ending.fail(error)

    async def _abort_holders(self, state: RequestState, placement: Placement, reason: str) -> None:
        if placement.landing is not None:
            await asyncio.wait([placement.landing])  # abort after a Reserve or assignment in flight lands, not before
        request = common_pb2.AbortRequest(request_ids=[placement.attempt_id], reason=reason)
        metadata = self._metadata(state)
        await asyncio.gather(*(
            _quietly(self._stub(worker).Abort(request, timeout=self._control_timeout, metadata=metadata),
                     f"Abort of {placement.attempt_id} on {worker_id}")
            for worker_id, worker in list(placement.holders.items())))

    def _stub(self, worker: WorkerRecord) -> Any:
        stubs = {WorkerRole.PREFILL: self.clients.prefill, WorkerRole.DECODE: self.clients.decode,
                 WorkerRole.COLOCATED: self.clients.colocated}
        return stubs[worker.info.role](worker.info.address)

    def _metadata(self, state: RequestState) -> tuple[tuple[str, str], ...]:
        return self.clients.metadata(state.span)

    def _bound(self, worker: WorkerRecord, model: str) -> float:
        """How long a Reserve or assignment may take on the worker: the control timeout, or a model load's
        when the worker has no copy of the model resident (a cold start: the call waits for the load)."""
        return LOAD_TIMEOUT_S if cold_start(worker, model) else self._control_timeout

    async def _landing(self, state: RequestState, worker: WorkerRecord, call: str,
                       start: Callable[[float], Awaitable[Any]], bound: float) -> Any:
        """Make a call that creates state on a worker (Reserve, an assignment) so that, if the request
        is cancelled meanwhile, the call still completes and the Abort can wait for it. `start(timeout)`
        makes it; it takes at most `bound` seconds, or the request's deadline if that comes first. Its
        failure raises the request's TandemError."""
        timeout = state.deadline.timeout(bound)
        landing = state.placement.landing = asyncio.ensure_future(start(timeout))
        landing.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen, even if unawaited
        try:
            return await asyncio.shield(landing)
        except grpc.aio.AioRpcError as exc:
            raise failures.from_rpc(state, worker, call, exc, deadline_bound=timeout < bound) from None
        except asyncio.CancelledError:
            if failures.caller_cancelled():
                raise
            raise failures.cut(state, worker, call) from None


def _sampling(state: RequestState) -> common_pb2.SamplingParams:
    """The attempt's sampling with the request's resolved seed, so every worker draws the same stream."""
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(state.placement.request.sampling)
    sampling.seed = state.seed
    return sampling


def prefill_events(state: RequestState, response: worker_pb2.PrefillResponse) -> list[scheduler_pb2.TokenEvent]:
    """Token 0 as the PrefillResponse repeats it (a duplicate of the reported one, unless that was
    lost), and the final event when the first token ended the request."""
    if response.finish_reason in (common_pb2.FINISH_REASON_ABORT, common_pb2.FINISH_REASON_ERROR):
        return []  # aborted on the worker: whoever aborted it ends the stream
    prefill = state.placement.prefill
    worker_id = prefill.info.worker_id if prefill else ""
    first = scheduler_pb2.TokenEvent(request_id=state.request_id, output_offset=0,
                                     token_ids=[response.first_token_id], worker_id=worker_id)
    if response.HasField("first_logprob"):
        first.logprobs.append(response.first_logprob)
    if response.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
        return [first]
    final = scheduler_pb2.TokenEvent(request_id=state.request_id, output_offset=1,
                                     finish_reason=response.finish_reason, worker_id=worker_id)
    final.usage.CopyFrom(common_pb2.Usage(prompt_tokens=response.prompt_tokens,
                                          cached_tokens=response.cached_tokens, completion_tokens=1))
    return [first, final]


async def _quietly(call: Any, what: str) -> None:
    """Await a best-effort call to a worker; its failure is logged, not raised."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        log.info("%s failed: %s: %s", what, exc.code().name, exc.details())
    except asyncio.CancelledError:
        if failures.caller_cancelled():
            raise
        log.info("%s was cut: the worker was lost", what)
