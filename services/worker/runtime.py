"""What every worker role shares around its engines: the models resident (one engine, engine
thread and KV hand-off each, loaded on demand: services/worker/residency.py), the requests' token
streams to the gateway, their start and end reports to the scheduler, the registry membership, the
prefix-cache reports, the request spans, metrics, and the load and stats it publishes.

A role's servicer (prefill, decode, colocated) calls into the runtime and awaits what it needs
per request (`await runtime.first_output(rid)`); the runtime never calls a servicer. A servicer
admits each request inside `async with runtime.serving(model) as served`, which loads the model
if needed and keeps it resident meanwhile. Aborts, whoever asks for them (an Abort RPC, a lost
token stream, shutdown), go through `abort`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import grpc
from opentelemetry import trace

from services.common.blocks import ceil_div
from services.common.errors import FailedPrecondition, NotFound, Overloaded
from services.common.metrics import ServiceMetrics
from services.common.spans import Attr, SpanName
from services.common.step_cost import HYBRID_STEP_HEADROOM, STEP_HEADROOM, StepCost, StepCostFit, aimed_step_ms
from services.runtime.batch_scheduler import StepTarget
from services.runtime.counters import EngineCounters
from services.runtime.engine import Engine, RequestOutput
from services.runtime.kv_handoff import KvHandoff
from services.worker.block_reporter import BlockReporter
from services.worker.engine_loop import EngineLoop, EngineSnapshot, StepResult, combined
from services.worker.events import TokenBatcher, TrackedRequest
from services.worker.registration import Registration
from services.worker.reporter import TokenReporter
from services.worker.request_spans import RequestSpans
from services.worker.request_waiters import RequestWaiters
from services.worker.residency import ModelLoadError, ModelMemoryExhausted, ModelRecord, ResidentModels
from services.worker.served_model import ServedModel, free_memory
from services.worker.stats import policy_attributes, record_policy, residency_to_pb, update_metrics, worker_stats
from services.worker.store_renewal import StoreRenewal
from services.worker.token_streams import RequestStreams
from tandem.v1 import common_pb2, scheduler_pb2, worker_pb2

log = logging.getLogger(__name__)
tracer = trace.get_tracer("tandem.worker")
STEP_COST_REFIT_STEPS = 16  # under a step target, the engines get the refitted cost model this often,
# and at once after a step that ran past the target
PREFILL_FIT_MIN_STEPS = 6  # a prefill worker's step-cost fit needs this many steps, after its first
PREFILL_FIT_WARMUP_STEPS = 2  # few: they take a chunk each (0.4-3 s on a CPU)
# Prefix-cache changes with no token batch to ride wait this long for one before going alone. A stored
# block waits longer: reported late it only delays a hit (the blocks a request's decode fills are asked
# for by a follow-up that comes after its final event, whose batch carries them), where each block-only
# batch costs the scheduler a message (at 0.5 s, 2 to 3 a request of 256 tokens, 100 workers). An evicted
# block goes sooner: reported late, the index promises a hit the worker can no longer give.
STORED_WAIT_S = 5.0
EVICTED_WAIT_S = 0.5
# A model's name -> its engine, loaded (services/worker/main_common.py's load_engine).
EngineLoader = Callable[[str], Awaitable[Engine]]


@dataclass(frozen=True, slots=True)
class ModelPlan:
    """What a worker may hold: its catalogue's models (name -> weight bytes, the primary first), the
    --model-memory budget, and the models pinned and preloaded at start (the primary always is)."""

    sizes: Mapping[str, int]
    budget: int
    pinned: tuple[str, ...] = ()
    preloaded: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    worker_id: str
    role: int  # common_pb2.WorkerRole
    address: str  # advertised HOST:PORT
    model: str  # the primary model: loaded at start, what a request naming no model runs under
    device: str
    local_prefill: bool = False  # a decode worker that also serves Assign (WorkerInfo.local_prefill)


class WorkerRuntime:
    """Call order: await start() -> ... -> await stop().

    The worker registers with and heartbeats to every scheduler replica (`schedulers`): any of them
    may place a request here, and each must keep listing it when another dies; one of them writes
    each heartbeat to the store they share (store_renewal.py). A request's start and end go to the
    replica that placed it (services/common/placer.py), or to every one when the worker cannot tell
    which. Its prefix-cache changes go to the first one whose report stream is up (the replicas share
    the index through the store). With no scheduler channel (standalone, for tests and benchmarks) nothing is registered or
    reported; the worker still serves its RPCs.
    """

    def __init__(
        self,
        identity: WorkerIdentity,
        plan: ModelPlan,
        make_engine: EngineLoader,
        schedulers: Sequence[grpc.aio.Channel],
        metadata: tuple[tuple[str, str], ...] = (),
        metrics: ServiceMetrics | None = None,
        report_blocks: bool = True,
    ) -> None:
        self.identity = identity
        self.plan = plan
        self.metrics = metrics
        self._make_engine = make_engine
        self.models: ResidentModels[ServedModel] = ResidentModels(
            plan.sizes, plan.budget, self._load_model, self._unload_model, ServedModel.active_requests)
        self.batcher = TokenBatcher(identity.worker_id)
        self.spans = RequestSpans()
        self.streams = RequestStreams(self._abandoned, on_left=self._left)
        self._waiters = RequestWaiters()
        self.blocks = BlockReporter(schedulers[0] if schedulers and report_blocks else None, identity.worker_id,
                                    metadata)
        self.reporters = [TokenReporter(channel, identity.worker_id, metadata,
                                        on_lost=functools.partial(self._on_lost, seat))
                          for seat, channel in enumerate(schedulers)]
        # A Prefill call returns once its blocks are applied (a ReportBlocks call), so the scheduler
        # routes the next request on them; other roles' block changes ride their token stream.
        self._blocks_on_stream = identity.role != common_pb2.WORKER_ROLE_PREFILL
        self._schedulers = list(schedulers)
        self._block_seat = 0  # the scheduler the prefix-cache changes go to: see _block_carrier
        self._metadata = metadata
        self.registrations: list[Registration] = []  # once the primary model is loaded: see start
        self._expired_ids: set[str] = set()  # held when a scheduler forgot this worker: see _on_forgotten
        self.block_size = 0  # tokens per KV block, of every model's pool: known once the primary loads
        self.step_cost = self._step_cost_fit(identity.role)
        self._steps_since_refit = 0
        self.policy = scheduler_pb2.BatchPolicy()
        self._limits: dict[str, int] = {}  # the policy's batch limits, for every engine loaded later too
        self.failed = asyncio.Event()
        self._started = time.monotonic()
        self._retired = EngineCounters()  # counters of the engines evicted so far
        if metrics is not None:
            metrics.models_resident.set_function(lambda: len(self.models.models()))

    @property
    def worker_id(self) -> str:
        return self.identity.worker_id

    async def start(self) -> None:
        """Loads the primary model and the preloaded and pinned ones, then registers (waiting for
        the scheduler) and opens the stream."""
        for name in dict.fromkeys((self.identity.model, *self.plan.preloaded, *self.plan.pinned)):
            await self.models.load(name, pin=name in self.plan.pinned)
        self.block_size = self.info().block_size
        renewal = StoreRenewal(self.worker_id, len(self._schedulers))
        self.registrations = [Registration(channel, self.info(), self.load, self._metadata,
                                           functools.partial(self._on_reregistered, reporter), self.apply_policy,
                                           self._on_forgotten, renewal=(renewal, seat))
                              for seat, (channel, reporter) in enumerate(zip(self._schedulers, self.reporters,
                                                                             strict=True))]
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
        await asyncio.gather(*(served.loop.stop() for served in self.models.models().values()))

    def _busy(self) -> bool:
        return bool(any(served.active_requests() for served in self.models.models().values())
                    or self.batcher.requests or self._waiters.request_ids())

    # -- models -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def serving(self, model: str) -> AsyncIterator[ServedModel]:
        """The model a request names ("" for the primary), loaded if it is not resident and kept
        resident until the block exits: admit the request inside it. NotFound for a model outside
        the catalogue; Overloaded when it cannot fit; FailedPrecondition when its load failed."""
        with self._load_errors():
            async with self.models.lease(self.catalogue_name(model)) as served:
                yield served

    async def load_model(self, model: str, pin: bool) -> tuple[ModelRecord, tuple[str, ...]]:
        """ModelService.LoadModel: the model resident (and pinned if asked), with the models its load
        evicted (none when it was resident already); errors as `serving`'s."""
        name = self.catalogue_name(model)
        was_resident = self.models.resident(name) is not None
        with self._load_errors():
            loaded = await self.models.load(name, pin=pin)
        (record,) = [r for r in self.models.records() if r.name == name]
        return record, () if was_resident else loaded.evicted

    def holding(self, request_id: str) -> ServedModel | None:
        """The resident model whose KV hand-off holds the request (a reservation or an export)."""
        return next((served for served in self.models.models().values()
                     if request_id in served.handoff.request_ids()), None)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """KV blocks of `num_tokens` tokens (every resident model's pool has the worker's block size)."""
        return ceil_div(num_tokens, self.block_size)

    def catalogue_name(self, model: str) -> str:
        """The catalogue model a request names ("": the primary); NotFound naming the catalogue."""
        name = model or self.identity.model
        if name not in self.plan.sizes:
            raise NotFound(f"model {name!r} is not in the catalogue of worker {self.worker_id} "
                           f"({', '.join(self.plan.sizes)}); put its directory under $TANDEM_HOME/models or "
                           "start the worker with --model NAME=DIR")
        return name

    @contextlib.contextmanager
    def _load_errors(self) -> Iterator[None]:
        try:
            yield
        except ModelMemoryExhausted as exc:
            raise Overloaded(f"worker {self.worker_id}: {exc}") from exc
        except ModelLoadError as exc:
            raise FailedPrecondition(f"worker {self.worker_id}: {exc}") from exc

    async def _load_model(self, name: str, evicted: tuple[str, ...]) -> ServedModel:
        """Builds the model's engine (a worker.model_load span, metrics) and starts its thread."""
        started = time.monotonic()
        with tracer.start_as_current_span(SpanName.MODEL_LOAD, attributes={
                Attr.MODEL_NAME: name, Attr.MODEL_BYTES: self.plan.sizes[name],
                Attr.MODEL_EVICTED: list(evicted)}) as span:
            engine = await self._make_engine(name)
            seconds = time.monotonic() - started
            span.set_attribute(Attr.MODEL_LOAD_SECONDS, seconds)
        served = ServedModel(name, engine, EngineLoop(engine, functools.partial(self._on_step, name),
                                                      self._on_failure), KvHandoff(engine))
        served.loop.batch_window_s = self.policy.batch_window_ms / 1000
        engine.scheduler.limits = replace(engine.scheduler.limits, **self._limits)
        engine.scheduler.target = self._step_target()
        served.loop.start()
        if self.metrics is not None:
            self.metrics.model_loaded(name, seconds)
        log.info("model %s loaded in %.2f s (%d bytes of weights%s): %d KV blocks of %d tokens", name, seconds,
                 self.plan.sizes[name], f"; evicted {', '.join(evicted)}" if evicted else "",
                 engine.blocks.num_blocks, engine.blocks.block_size)
        return served

    async def _unload_model(self, name: str, served: ServedModel) -> None:
        """Stops the model's thread, reports its prefix-cache blocks evicted and frees its memory."""
        await served.loop.stop()
        self._retired = self._retired.plus(served.loop.snapshot.counters)
        self.blocks.drop(name)
        self._report(None, (), blocks_wait_s=0.0)
        device = served.engine.config.device
        del served
        free_memory(device)
        log.info("model %s evicted", name)

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

    async def abort(self, request_ids: Iterable[str], dropped: str | None = None) -> list[str]:
        """Drops the requests wherever they are (handler, reservation, engine, export), freeing their
        blocks at once and ending their spans; returns the ones this worker held. `dropped`: the
        worker drops them on its own, for this reason (None: whoever placed them asked), so the
        scheduler must hear it: see `_report_dropped`."""
        ids = list(dict.fromkeys(request_ids))
        if not ids:
            return []
        if dropped is not None:
            self._report_dropped(ids, dropped)
        reason = dropped or "aborted"
        waited = self._drop_handlers(ids, reason)
        served = list(self.models.models().values())
        for model in served:
            for request_id in ids:
                model.handoff.cancel(request_id)  # here, on the loop that imports: no chunk lands after it
        held = await asyncio.gather(*(model.loop.call(functools.partial(_drop_all, model.handoff, ids))
                                      for model in served))
        dropped_ids = [rid for rids in held for rid in rids]
        # A handler that tracked its request after _drop_handlers, and got it into the engine before
        # _drop_all, waits for an output that will never come: it hears of the abort now.
        self._drop_handlers([rid for rid in dropped_ids if rid not in waited and self.is_awaited(rid)], reason)
        return list(dict.fromkeys([*waited, *dropped_ids]))

    def _report_dropped(self, request_ids: list[str], why: str) -> None:
        """The scheduler waits for each request it placed here until its final event: a request the
        worker drops on its own gets one now (FINISH_REASON_ERROR, UNAVAILABLE), which ends its Submit
        call, so the gateway's client hears at once instead of at its deadline. Every one whose final
        event has not gone out: also one the engine finished meanwhile (its final event would no longer
        be reported), and one a handler awaits (a Prefill call answers an abort with FINISH_REASON_ABORT,
        which the scheduler leaves to whoever aborted it)."""
        placers = {rid: tracked.placer for rid in request_ids if (tracked := self.batcher.requests.get(rid))}
        batch = self.batcher.dropped(request_ids, why)
        if batch is not None:
            self._report(batch, tuple(placers.get(event.request_id, "") for event in batch.events))

    def _drop_handlers(self, request_ids: list[str], reason: str) -> list[str]:
        """Ends what the requests' handlers await, their streams and spans; returns those awaited."""
        waited = [r for r in request_ids if self._waiters.abort(r)]
        for request_id in request_ids:
            self.batcher.forget(request_id)
            self.streams.drop(request_id, reason)
            self.spans.end(request_id, "abort")
        return waited

    async def abort_all(self, reason: str) -> None:
        """Drops every request (the scheduler failed them: stream lost or registration expired; or shutdown)."""
        ids = self._request_ids()
        if ids:
            log.warning("aborting %d request(s): %s", len(ids), reason)
            await self.abort(ids)

    def _request_ids(self) -> list[str]:
        handed = [rid for model in self.models.models().values() for rid in model.handoff.request_ids()]
        return list(dict.fromkeys([*self._waiters.request_ids(), *handed, *self.batcher.requests]))

    # -- engine steps -----------------------------------------------------------------------

    def _on_step(self, model: str, step: StepResult) -> None:
        self.blocks.note(model, step.stored, step.evicted)
        produced = self.batcher.batch(step)
        for event in produced.events:
            self.streams.push(event)
        self._report(produced.report, produced.placers)
        served = self.models.resident(model)
        if self.metrics is not None and served is not None:
            update_metrics(self.metrics, self._snapshot(), step.snapshot.counters.since(served.reported),
                           produced.events)
            served.reported = step.snapshot.counters
        self.models.note_used(model)
        self.spans.on_step(step)
        self._waiters.note(step.outputs)
        if step.work:
            self._record_step_cost(step, served)

    def _record_step_cost(self, step: StepResult, served: ServedModel | None) -> None:
        """The step in the cost fit (a one-token chunk is a decode); under a step target the engine's
        batch scheduler gets the refitted model every STEP_COST_REFIT_STEPS steps, and after a step that
        ran past the time steps are sized to (the machine slowed: the margin must follow at once)."""
        works = step.work.values()
        decode_context = sum(w.num_context_tokens for w in works if w.num_new_tokens == 1)
        step_ms = (step.ended_ns - step.started_ns) / 1e6
        self.step_cost.record(sum(w.num_new_tokens for w in works),
                              sum(w.num_context_tokens for w in works) - decode_context, step_ms, decode_context)
        self._steps_since_refit += 1
        target_ms = self.policy.step_target_ms
        if target_ms > 0 and served is not None and (self._steps_since_refit >= STEP_COST_REFIT_STEPS
                                                     or step_ms > aimed_step_ms(target_ms, self.step_headroom)):
            self._steps_since_refit = 0
            served.engine.scheduler.target = self._step_target()

    @staticmethod
    def _step_cost_fit(role: int) -> StepCostFit:
        """A prefill worker's steps hold one chunk each (the same tokens: the fixed cost folds into the
        per-token one) and last up to seconds on a CPU: it fits from fewer of them, or the scheduler would
        price its queue at a decode worker's rates for its first 24 steps (12-40 s of c16-long)."""
        if role == common_pb2.WORKER_ROLE_PREFILL:
            return StepCostFit(min_samples=PREFILL_FIT_MIN_STEPS, warmup=PREFILL_FIT_WARMUP_STEPS, fold_fixed=True)
        return StepCostFit()

    @property
    def step_headroom(self) -> float:
        """The share of the step target a step leaves unused: more on a hybrid decode worker, whose prompts
        the scheduler sends to a prefill worker when its steps have no room (services/common/step_cost.py)."""
        return HYBRID_STEP_HEADROOM if self.identity.local_prefill else STEP_HEADROOM

    def _step_target(self) -> StepTarget | None:
        """The policy's step target with this worker's latest cost fit and the margin by which recent steps
        overran it (None: no target); the margin goes to /metrics (tandem:batch_policy{field="step_margin_ms"})."""
        if self.policy.step_target_ms <= 0:
            return None
        target = StepTarget.of(self.policy.step_target_ms, self.policy.min_prefill_tokens, self.step_cost,
                               self.step_headroom)
        if self.metrics is not None:
            self.metrics.batch_policy("step_margin_ms").set(target.margin_ms)
        return target

    def _report(self, report: scheduler_pb2.TokenBatch | None, placers: Sequence[str] = (),
                blocks_wait_s: float | None = None) -> None:
        """A step's batch (None: the step started and ended nothing), each event to the scheduler that
        placed its request (`placers`, in the events' order; one not known here, to every scheduler),
        with the pending prefix-cache changes on the batch of the scheduler that takes the block reports.
        Changes with no batch to ride wait up to `blocks_wait_s` for one (None: STORED_WAIT_S, or
        EVICTED_WAIT_S for the oldest eviction), then go alone; a prefill worker's go by ReportBlocks,
        and so do all while a full resend is due."""
        batches = self._per_scheduler(report, placers)
        seat = self._block_carrier()
        first = batches[seat] if batches else None
        carrier = first if first is not None else scheduler_pb2.TokenBatch()
        if not (self.reporters and self._blocks_on_stream):
            self.blocks.flush_soon()
        elif self.blocks.attach(carrier, *_block_waits(first is not None, blocks_wait_s)):
            batches[seat] = carrier
        else:
            self.blocks.resend_soon()
        for reporter, batch in zip(self.reporters, batches, strict=True):
            if batch is not None:
                reporter.send(batch)

    def _block_carrier(self) -> int:
        """The scheduler that takes the prefix-cache changes (the replicas share the index through the
        store): the first whose token-report stream is up, the first while none is. ReportBlocks calls
        follow it, so a replica that died takes the reports with it no longer (the stream's loss made
        the next report a full resend)."""
        seat = next((s for s, reporter in enumerate(self.reporters) if reporter.connected.is_set()), 0)
        if seat != self._block_seat:
            self._block_seat = seat
            self.blocks.report_to(self._schedulers[seat])
        return seat

    def _per_scheduler(self, report: scheduler_pb2.TokenBatch | None,
                       placers: Sequence[str]) -> list[scheduler_pb2.TokenBatch | None]:
        """The report's events split by the scheduler to send them to, one batch (or None) per reporter,
        each its own object (the block changes ride one); with one scheduler, all."""
        if report is None or len(self.reporters) <= 1:
            return [report] * len(self.reporters)
        ids = [self._placer_at(seat) for seat in range(len(self.reporters))]
        split: list[scheduler_pb2.TokenBatch | None] = [None] * len(self.reporters)
        for index, event in enumerate(report.events):
            placer = placers[index] if index < len(placers) else ""
            targets = [ids.index(placer)] if placer and placer in ids else range(len(split))
            for target in targets:
                if split[target] is None:
                    split[target] = scheduler_pb2.TokenBatch(iteration=report.iteration, batch_size=report.batch_size)
                split[target].events.append(event)
        return split

    def _on_failure(self, exc: BaseException) -> None:
        log.error("the engine failed (%s: %s); this worker stops", type(exc).__name__, exc)
        self.failed.set()

    def _left(self, request_id: str) -> None:
        """The gateway gave the request up (its client went, its deadline passed, it moved): drop it.
        The gateway ends its Submit call too, so the scheduler counts the request as it ended there."""
        log.info("request %s: its gateway left it; aborting it", request_id)
        asyncio.ensure_future(self.abort([request_id]))

    def _abandoned(self, request_id: str) -> None:
        """Nobody reads the request's tokens (its gateway never attached, or its Follow call ended): drop
        it, and tell the scheduler (nobody else would)."""
        log.info("request %s: no gateway reads its tokens; aborting it", request_id)
        asyncio.ensure_future(self.abort([request_id], dropped="no gateway reads its tokens (its reader left, "
                                                              "or never attached)"))

    def _on_lost(self, seat: int) -> None:
        self.blocks.stream_lost()
        placer = self._placer_at(seat) if len(self.reporters) > 1 else None
        asyncio.ensure_future(self._abort_unread("the scheduler lost this worker's token stream", placer))

    async def _abort_unread(self, reason: str, placer: str | None, among: Container[str] | None = None) -> None:
        """A scheduler failed this worker's requests (its token-report stream broke, or it forgot the
        worker): the ones a gateway reads go on, since their tokens do not pass through a scheduler
        (another one, or this one back, accounts for their end). The ones nobody reads yet are dropped,
        each reported (a scheduler that had not failed it, as one that still held another stream of
        this worker, hears it end): all of them with one scheduler (`placer` None); with several, those
        the one named `placer` placed (their gateways hand them to another: services/gateway/attempt.py),
        and none when it is "" (unknown): those stay, given up after the attach window if no gateway
        comes. `among`: only these of the requests held (default: all)."""
        if placer == "":
            return
        ids = [rid for rid in self._request_ids()
               if (among is None or rid in among) and not self.streams.attached(rid)
               and (placer is None or ((tracked := self.batcher.requests.get(rid)) and tracked.placer == placer))]
        if ids:
            log.warning("aborting %d request(s) no gateway reads: %s", len(ids), reason)
            await self.abort(ids, dropped=reason)

    def _on_forgotten(self) -> None:
        """A heartbeat found this worker forgotten: the scheduler failed what it holds now. Only those
        are dropped once it is taken back; the scheduler places new requests here from then on, and
        their gateways attach only after their placement (a request dropped before that would wait
        out its deadline: the scheduler, which placed it, is never told)."""
        self._expired_ids.update(self._request_ids())

    def _placer_at(self, seat: int) -> str:
        """The id scheduler `seat` names itself by (its last RegisterWorker answer's); "" while unknown."""
        registration = self.registrations[seat] if seat < len(self.registrations) else None
        return registration.response.scheduler_id if registration and registration.response else ""

    async def _on_reregistered(self, reporter: TokenReporter, response: scheduler_pb2.RegisterWorkerResponse) -> None:
        expired, self._expired_ids = self._expired_ids, set()
        await self.apply_policy(response.policy)
        # With several schedulers, which one placed each request held when forgotten is not kept: none dropped.
        await self._abort_unread("the scheduler had expired this worker", None if len(self.reporters) <= 1 else "",
                                 among=expired)
        reporter.announce()
        await self.blocks.reset()

    async def apply_policy(self, policy: scheduler_pb2.BatchPolicy) -> None:
        """The scheduler's batching policy, from the next iteration on; zero fields keep the worker's flags."""
        fields = {"max_num_batched_tokens": policy.max_num_batched_tokens, "max_num_seqs": policy.max_num_seqs,
                  "chunk_size": policy.chunk_size}
        changes = {name: value for name, value in fields.items() if value > 0}
        if not (changes or policy.step_target_ms) or policy == self.policy:
            return
        log.info("applying the scheduler's batch policy %s (batching window %d ms; step target %d ms, at least %d "
                 "prompt tokens a step; step cost here %s)", changes, policy.batch_window_ms, policy.step_target_ms,
                 policy.min_prefill_tokens, self.step_cost.fit())
        self.policy = scheduler_pb2.BatchPolicy()
        self.policy.CopyFrom(policy)
        self._limits = changes
        self.spans.policy_attributes = policy_attributes(policy)
        if self.metrics is not None:
            record_policy(self.metrics, policy)

        target = self._step_target()

        def apply(engine: Engine) -> None:
            engine.scheduler.limits = replace(engine.scheduler.limits, **changes)
            engine.scheduler.target = target

        for served in self.models.models().values():
            served.loop.batch_window_s = policy.batch_window_ms / 1000
            await served.loop.call(apply)

    # -- what the worker publishes ----------------------------------------------------------

    def info(self) -> scheduler_pb2.WorkerInfo:
        """The primary model's KV pool describes the worker (each resident model has one of the same
        --kv-memory); call once it is loaded."""
        primary = self.models.resident(self.identity.model)
        assert primary is not None, "info() before the primary model loaded"
        engine = primary.engine
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
            catalogue=list(self.plan.sizes),
            model_memory_bytes=self.plan.budget,
        )

    def load(self) -> scheduler_pb2.WorkerLoad:
        """Summed over the resident models' KV pools, with each model's residency."""
        snapshot = self._snapshot()
        handoffs = [served.handoff for served in self.models.models().values()]
        return scheduler_pb2.WorkerLoad(
            free_blocks=snapshot.allocatable_blocks,
            cached_blocks=self.blocks.num_cached,
            running=snapshot.running,
            waiting=snapshot.waiting + sum(h.num_in_flight for h in handoffs),
            queued_prefill_tokens=snapshot.queued_prefill_tokens,
            reserved_blocks=sum(h.reserved_blocks for h in handoffs),
            step_cost=_step_cost_to_pb(self.step_cost.fit()),
            models=[residency_to_pb(record) for record in self.models.records()],
            free_model_memory_bytes=self.models.free_bytes,
        )

    def stats(self) -> worker_pb2.WorkerStats:
        handoffs = [served.handoff for served in self.models.models().values()]
        stats = worker_stats(self._snapshot(), sum(h.reserved_blocks for h in handoffs),
                             sum(h.num_in_flight for h in handoffs))
        stats.worker_id = self.identity.worker_id
        stats.role = self.identity.role
        stats.uptime_s = time.monotonic() - self._started
        return stats


    def _snapshot(self) -> EngineSnapshot:
        return combined((served.loop.snapshot for served in self.models.models().values()), self._retired)


def _drop_all(handoff: KvHandoff, request_ids: list[str], engine: Engine) -> list[str]:
    """In the model's engine thread: the requests it held (engine or hand-off), dropped."""
    return [rid for rid in request_ids if handoff.free(rid) | engine.abort(rid)]


def _step_cost_to_pb(cost: StepCost | None) -> scheduler_pb2.StepCostModel | None:
    if cost is None:
        return None
    return scheduler_pb2.StepCostModel(fixed_ms=cost.fixed_ms, per_token_ms=cost.per_token_ms,
                                       per_context_token_ms=cost.per_context_token_ms,
                                       per_decode_context_ms=cost.per_decode_context_ms)


def _block_waits(riding: bool, wait_s: float | None) -> tuple[float, float]:
    """How long the pending prefix-cache changes must have waited to be attached (min_wait_s,
    evicted_wait_s): not at all when a batch goes anyway (`riding`), else `wait_s` for both, or the
    stored and evicted bounds."""
    if riding:
        return 0.0, 0.0
    return (STORED_WAIT_S, EVICTED_WAIT_S) if wait_s is None else (wait_s, wait_s)
