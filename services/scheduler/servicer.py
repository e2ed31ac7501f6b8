"""SchedulerService: validates, converts at the edge, and hands over to the dispatcher and the registry."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from services.common.block_hash import BlockHash
from services.common.errors import InvalidRequest
from services.common.wire import abort_ids
from services.scheduler.convert import info_from_pb, load_from_pb
from services.common.step_cost import StepCost
from services.common.store import WorkerRole
from services.scheduler import membership, migration, submissions
from services.scheduler.batch_policy import SloPolicy
from services.scheduler.dispatcher import Dispatcher
from services.scheduler.model_loads import ModelLoads
from services.scheduler.submissions import SubmissionCall
from tandem.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

SERVICE_NAME = "tandem.v1.SchedulerService"
HEARTBEATS_PER_TTL = 3


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, dispatcher: Dispatcher, scheduler_id: str,
                 policy: scheduler_pb2.BatchPolicy | None = None, slo: SloPolicy | None = None) -> None:
        """`policy`: what every worker gets when it registers; `slo`: once a worker reports its step-cost
        model, its heartbeat answers carry the policy that meets these targets instead."""
        self._dispatcher = dispatcher
        self._policy = policy or scheduler_pb2.BatchPolicy()
        self._slo = slo
        self._registry = dispatcher.registry
        self._scheduler_id = scheduler_id

    def Submit(self, request: scheduler_pb2.SubmitRequest,
               context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.SubmitEvent]:
        return self._submit(request, context)

    def Submissions(self, request_iterator: AsyncIterator[scheduler_pb2.SubmitCommands],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.SubmitUpdates]:
        return submissions.serve(self._submit, request_iterator, context)

    def _submit(self, request: scheduler_pb2.SubmitRequest,
                context: grpc.aio.ServicerContext | SubmissionCall) -> AsyncIterator[scheduler_pb2.SubmitEvent]:
        """One request, on its own Submit call or on a Submissions stream."""
        if not request.request_id:
            raise InvalidRequest("request_id", "must not be empty")
        if not request.token_ids:
            raise InvalidRequest("token_ids", "must hold the prompt's tokens")
        migration.check_continuation(request)
        return self._dispatcher.submit(request, context)

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(aborted_ids=self._dispatcher.abort(abort_ids(request)))

    async def Stats(self, request: scheduler_pb2.SchedulerStatsRequest, context) -> scheduler_pb2.SchedulerStats:
        return await self._dispatcher.stats(request.recent_routes)

    async def RegisterWorker(self, request: scheduler_pb2.RegisterWorkerRequest,
                             context) -> scheduler_pb2.RegisterWorkerResponse:
        info = info_from_pb(request.worker)
        await self._registry.register(info, load_from_pb(request.worker.load))
        self._dispatcher.membership.registered()
        ttl_ms = round(self._registry.ttl * 1000)
        return scheduler_pb2.RegisterWorkerResponse(
            heartbeat_ttl_ms=ttl_ms, heartbeat_interval_ms=max(1, ttl_ms // HEARTBEATS_PER_TTL),
            policy=self._registration_policy(info.role), scheduler_id=self._scheduler_id)

    def _registration_policy(self, role: WorkerRole) -> scheduler_pb2.BatchPolicy:
        """The configured policy; under SLOs with the step target a worker keeps until its heartbeats bring the rest."""
        numbers = self._slo.before_fit(role) if self._slo is not None else None
        if numbers is None:
            return self._policy
        policy = scheduler_pb2.BatchPolicy()
        policy.CopyFrom(self._policy)
        policy.step_target_ms, policy.min_prefill_tokens = numbers.step_target_ms, numbers.min_prefill_tokens
        return policy

    def Heartbeats(self, request_iterator: AsyncIterator[scheduler_pb2.HeartbeatRequest],
                   context) -> AsyncIterator[scheduler_pb2.HeartbeatResponse]:
        return membership.answer_in_order(request_iterator, lambda request: self.Heartbeat(request, context))

    async def Heartbeat(self, request: scheduler_pb2.HeartbeatRequest, context) -> scheduler_pb2.HeartbeatResponse:
        known = await self._dispatcher.membership.heartbeat(request.worker_id, load_from_pb(request.load),
                                                            renew_store=not request.renewed_elsewhere)
        if not known:
            return scheduler_pb2.HeartbeatResponse(known=False)
        cost = _step_cost(request.load)
        self._dispatcher.placement.observe(request.worker_id, cost)
        return scheduler_pb2.HeartbeatResponse(known=True, policy=self._slo_policy(request.worker_id, cost))

    def _slo_policy(self, worker_id: str, cost: StepCost | None) -> scheduler_pb2.BatchPolicy | None:
        if self._slo is None or cost is None:
            return None
        info = next((r.info for r in self._registry.snapshot() if r.info.worker_id == worker_id), None)
        if info is None or info.block_size <= 0:
            return None
        numbers = self._slo.for_worker(cost, info.block_size, info.role)
        if numbers is None:
            return None
        return scheduler_pb2.BatchPolicy(max_num_batched_tokens=numbers.max_num_batched_tokens,
                                         max_num_seqs=numbers.max_num_seqs, chunk_size=numbers.chunk_size,
                                         batch_window_ms=numbers.batch_window_ms,
                                         step_target_ms=numbers.step_target_ms,
                                         min_prefill_tokens=numbers.min_prefill_tokens)

    async def DeregisterWorker(self, request: scheduler_pb2.DeregisterWorkerRequest,
                               context) -> scheduler_pb2.DeregisterWorkerResponse:
        await self._dispatcher.membership.deregistered(request.worker_id)
        return scheduler_pb2.DeregisterWorkerResponse()

    async def ReportBlocks(self, request: scheduler_pb2.ReportBlocksRequest,
                           context) -> scheduler_pb2.ReportBlocksResponse:
        if not request.worker_id:
            raise InvalidRequest("worker_id", "must not be empty")
        await self._registry.report_blocks(request.worker_id, [BlockHash(h) for h in request.stored],
                                           [BlockHash(h) for h in request.evicted], reset=request.reset)
        return scheduler_pb2.ReportBlocksResponse()

    async def ProvisionModel(self, request: scheduler_pb2.ProvisionModelRequest,
                             context) -> scheduler_pb2.ProvisionModelResponse:
        if not request.model:
            raise InvalidRequest("model", "must name a catalogue model")
        if request.replicas < 0:
            raise InvalidRequest("replicas", f"must be >= 0 (0 means 1), got {request.replicas}")
        loads = ModelLoads(self._registry, self._dispatcher.clients)
        return scheduler_pb2.ProvisionModelResponse(
            worker_ids=await loads.provision(request.model, request.replicas or 1))

    async def ReportTokens(self, request_iterator: AsyncIterator[scheduler_pb2.TokenBatch], context) -> None:
        await self._dispatcher.streams.consume(request_iterator, context.write)


def _step_cost(load: scheduler_pb2.WorkerLoad) -> StepCost | None:
    """The step-cost model a heartbeat carries; None before the worker has fitted one."""
    if not load.HasField("step_cost"):
        return None
    model = load.step_cost
    return StepCost(model.fixed_ms, model.per_token_ms, model.per_context_token_ms, model.per_decode_context_ms)
