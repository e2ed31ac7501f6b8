"""What every worker role shares around its engine: the engine thread, the KV hand-off, the
requests' token streams to the gateway, their start and end reports to the scheduler, the registry
membership, the prefix-cache reports, the request spans, metrics, and
the load and stats it publishes.

A role's servicer (prefill, decode, colocated) calls into the runtime and awaits what it needs
per request (`await runtime.first_output(rid)`); the runtime never calls a servicer. Aborts,
whoever asks for them (an Abort RPC, a lost token stream, shutdown), go through `abort`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import grpc

from services.common.metrics import ServiceMetrics
from services.runtime.counters import EngineCounters
from services.runtime.engine import Engine, RequestOutput
from services.runtime.kv_handoff import KvHandoff
from services.common.step_cost import StepCost, StepCostFit
from services.worker.block_reporter import BlockReporter
from services.worker.engine_loop import EngineLoop, StepResult
from services.worker.events import TokenBatcher, TrackedRequest
from services.worker.registration import Registration
from services.worker.reporter import TokenReporter
from services.worker.request_spans import RequestSpans
from services.worker.request_waiters import RequestWaiters
from services.worker.stats import policy_attributes, record_policy, update_metrics, worker_stats
from services.worker.token_streams import RequestStreams
from tandem.v1 import scheduler_pb2, worker_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    worker_id: str
    role: int  # common_pb2.WorkerRole
    address: str  # advertised HOST:PORT
    model: str
    device: str
    local_prefill: bool = False  # a decode worker that also serves Run (WorkerInfo.local_prefill)


class WorkerRuntime:
    """Call order: await start() -> ... -> await stop().

    The worker registers with, heartbeats to and reports its requests' starts and ends to every
    scheduler replica (`schedulers`): any of them may place a request here and must see it end,
    and each must keep listing it when another dies. Its prefix-cache changes go to the first one
    (the replicas share the index through the store). With no scheduler channel (standalone, for
    tests and benchmarks) nothing is registered or reported; the worker still serves its RPCs.
    """

    def __init__(
        self,
        engine: Engine,
        identity: WorkerIdentity,
        schedulers: Sequence[grpc.aio.Channel],
        metadata: tuple[tuple[str, str], ...] = (),
        metrics: ServiceMetrics | None = None,
        report_blocks: bool = True,
    ) -> None:
        self.engine = engine
        self.handoff = KvHandoff(engine)
        self.identity = identity
        self.metrics = metrics
        self.batcher = TokenBatcher(identity.worker_id)
        self.spans = RequestSpans()
        self.streams = RequestStreams(self._abandoned)
        self._waiters = RequestWaiters()
        self.loop = EngineLoop(engine, self._on_step, self._on_failure)
        self.blocks = BlockReporter(schedulers[0] if schedulers and report_blocks else None, identity.worker_id,
                                    metadata)
        self.reporters = [TokenReporter(channel, identity.worker_id, metadata, on_lost=self._on_lost)
                          for channel in schedulers]
        self.registrations = [Registration(channel, self.info(), self.load, metadata,
                                           functools.partial(self._on_reregistered, reporter), self.apply_policy)
                              for channel, reporter in zip(schedulers, self.reporters, strict=True)]
        self.step_cost = StepCostFit()
        self.policy = scheduler_pb2.BatchPolicy()
        self.failed = asyncio.Event()
        self._started = time.monotonic()
        self._previous = EngineCounters()

    @property
    def worker_id(self) -> str:
        return self.identity.worker_id

    async def start(self) -> None:
        """Starts the engine thread, then registers (waiting for the scheduler) and opens the stream."""
        self.loop.start()
        if not self.registrations:
            return
        responses = await asyncio.gather(*(registration.register() for registration in self.registrations))
        await self.apply_policy(responses[0].policy)
        for reporter in self.reporters:
            reporter.start()
        await self.blocks.reset()
        for registration in self.registrations:
            registration.start_heartbeats()

    async def stop(self, drain_s: float) -> None:
        """Leaves the registry, lets running requests finish for `drain_s`, then stops everything."""
        await asyncio.gather(*(registration.stop(deregister=True) for registration in self.registrations))
        deadline = time.monotonic() + drain_s
        while self._busy() and time.monotonic() < deadline and not self.failed.is_set():
            await asyncio.sleep(0.05)
        if self._busy() and not self.failed.is_set():
            await self.abort_all("worker shutting down")
        await asyncio.gather(*(reporter.stop() for reporter in self.reporters))
        await self.loop.stop()

    def _busy(self) -> bool:
        snapshot = self.loop.snapshot
        return bool(snapshot.running or snapshot.waiting or self.handoff.num_in_flight or self.batcher.requests
                    or self._waiters.request_ids())

    # -- requests ---------------------------------------------------------------------------

    def track(self, request: TrackedRequest, *, awaited: bool = False, hands_on: bool = False) -> None:
        """Streams the request's tokens from now on; call before the engine gets it. `awaited`: its
        handler awaits `first_output`/`until_aborted` and calls `forget` when done with it.
        `hands_on`: its stream ends at output token 0 (a prefill worker)."""
        self.batcher.track(request)
        self.streams.open(request.request_id, hands_on=hands_on)
        if awaited:
            self._waiters.open(request.request_id)

    def forget(self, request_id: str) -> None:
        """Stops reporting the request's tokens (and ends what its handler could await)."""
        self.batcher.forget(request_id)
        self._waiters.close(request_id)

    def is_awaited(self, request_id: str) -> bool:
        """A handler holds the request (tracked with `awaited`, not yet forgotten)."""
        return request_id in self._waiters

    async def first_output(self, request_id: str) -> RequestOutput | None:
        """The tracked request's first output; None when it was aborted before one."""
        return await self._waiters.first_output(request_id)

    def was_aborted(self, request_id: str) -> bool:
        return self._waiters.was_aborted(request_id)

    async def until_aborted(self, request_id: str) -> None:
        await self._waiters.until_aborted(request_id)

    async def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Drops the requests wherever they are (handler, reservation, engine, export), freeing their
        blocks at once and ending their spans; returns the ones this worker held."""
        ids = list(dict.fromkeys(request_ids))
        waited = [r for r in ids if self._waiters.abort(r)]
        for request_id in ids:
            self.batcher.forget(request_id)
            self.streams.drop(request_id, "aborted")
            self.spans.end(request_id, "abort")
            self.handoff.cancel(request_id)  # here, on the loop that imports: no chunk lands after it
        if not ids:
            return []
        held = await self.loop.call(lambda engine: [r for r in ids if self._drop(engine, r)])
        return list(dict.fromkeys([*waited, *held]))

    async def abort_all(self, reason: str) -> None:
        """Drops every request (the scheduler failed them: stream lost or registration expired; or shutdown)."""
        ids = self._request_ids()
        if ids:
            log.warning("aborting %d request(s): %s", len(ids), reason)
            await self.abort(ids)

    def _request_ids(self) -> list[str]:
        return list(dict.fromkeys([*self._waiters.request_ids(), *self.handoff.request_ids(), *self.batcher.requests]))

    def _drop(self, engine: Engine, request_id: str) -> bool:
        freed = self.handoff.free(request_id)
        return engine.abort(request_id) or freed

    # -- engine steps -----------------------------------------------------------------------

    def _on_step(self, step: StepResult) -> None:
        self.blocks.note(step.stored, step.evicted)
        self.blocks.flush_soon()
        produced = self.batcher.batch(step)
        for event in produced.events:
            self.streams.push(event)
        if produced.report is not None:
            for reporter in self.reporters:
                reporter.send(produced.report)
        if self.metrics is not None:
            update_metrics(self.metrics, step.snapshot, self._previous, produced.events)
        self._previous = step.snapshot.counters
        self.spans.on_step(step)
        self._waiters.note(step.outputs)
        if step.work:
            self.step_cost.record(sum(w.num_new_tokens for w in step.work.values()),
                                  sum(w.num_context_tokens for w in step.work.values()),
                                  (step.ended_ns - step.started_ns) / 1e6)

    def _on_failure(self, exc: BaseException) -> None:
        log.error("the engine failed (%s: %s); this worker stops", type(exc).__name__, exc)
        self.failed.set()

    def _abandoned(self, request_id: str) -> None:
        """Nobody reads the request's tokens (its gateway never attached, or left): drop it."""
        log.info("request %s: no gateway reads its tokens; aborting it", request_id)
        asyncio.ensure_future(self.abort([request_id]))

    def _on_lost(self) -> None:
        asyncio.ensure_future(self._abort_unread("the scheduler lost this worker's token stream"))

    async def _abort_unread(self, reason: str) -> None:
        """A scheduler failed this worker's requests (its token-report stream broke, or it forgot the
        worker): the ones a gateway reads go on, since their tokens do not pass through a scheduler
        (another one, or this one back, accounts for their end). With one scheduler the ones nobody
        reads yet are dropped; with several, this worker cannot tell which one placed them, so they
        stay, and one whose gateway never attaches is given up after the attach window."""
        if len(self.reporters) > 1:
            return
        ids = [rid for rid in self._request_ids() if not self.streams.attached(rid)]
        if ids:
            log.warning("aborting %d request(s) no gateway reads: %s", len(ids), reason)
            await self.abort(ids)

    async def _on_reregistered(self, reporter: TokenReporter, response: scheduler_pb2.RegisterWorkerResponse) -> None:
        await self.apply_policy(response.policy)
        await self._abort_unread("the scheduler had expired this worker")
        reporter.announce()
        await self.blocks.reset()

    async def apply_policy(self, policy: scheduler_pb2.BatchPolicy) -> None:
        """The scheduler's batching policy, from the next iteration on; zero fields keep the worker's flags."""
        fields = {"max_num_batched_tokens": policy.max_num_batched_tokens, "max_num_seqs": policy.max_num_seqs,
                  "chunk_size": policy.chunk_size}
        changes = {name: value for name, value in fields.items() if value > 0}
        if not changes or policy == self.policy:
            return
        log.info("applying the scheduler's batch policy %s (batching window %d ms; step cost here %s)", changes,
                 policy.batch_window_ms, self.step_cost.fit())
        self.policy = scheduler_pb2.BatchPolicy()
        self.policy.CopyFrom(policy)
        self.loop.batch_window_s = policy.batch_window_ms / 1000
        self.spans.policy_attributes = policy_attributes(policy)
        if self.metrics is not None:
            record_policy(self.metrics, policy)

        def apply(engine: Engine) -> None:
            engine.scheduler.limits = replace(engine.scheduler.limits, **changes)

        await self.loop.call(apply)

    # -- what the worker publishes ----------------------------------------------------------

    def info(self) -> scheduler_pb2.WorkerInfo:
        engine = self.engine
        return scheduler_pb2.WorkerInfo(
            worker_id=self.identity.worker_id,
            role=self.identity.role,
            address=self.identity.address,
            model=self.identity.model,
            num_blocks=engine.blocks.num_blocks,
            block_size=engine.blocks.block_size,
            max_model_len=engine.max_model_len,
            kv_block_bytes=engine.cache.block_bytes,
            device=self.identity.device,
            local_prefill=self.identity.local_prefill,
        )

    def load(self) -> scheduler_pb2.WorkerLoad:
        snapshot = self.loop.snapshot
        return scheduler_pb2.WorkerLoad(
            free_blocks=snapshot.allocatable_blocks,
            cached_blocks=len(self.blocks.cached),
            running=snapshot.running,
            waiting=snapshot.waiting + self.handoff.num_in_flight,
            queued_prefill_tokens=snapshot.queued_prefill_tokens,
            reserved_blocks=self.handoff.reserved_blocks,
            step_cost=_step_cost_to_pb(self.step_cost.fit()),
        )

    def stats(self) -> worker_pb2.WorkerStats:
        stats = worker_stats(self.loop.snapshot, self.handoff.reserved_blocks, self.handoff.num_in_flight)
        stats.worker_id = self.identity.worker_id
        stats.role = self.identity.role
        stats.uptime_s = time.monotonic() - self._started
        return stats


def _step_cost_to_pb(cost: StepCost | None) -> scheduler_pb2.StepCostModel | None:
    if cost is None:
        return None
    return scheduler_pb2.StepCostModel(fixed_ms=cost.fixed_ms, per_token_ms=cost.per_token_ms,
                                       per_context_token_ms=cost.per_context_token_ms)
