"""The model loads and unloads the scheduler orders on workers (ModelService): provisioning a model
ahead of traffic (pinned, for latency placement), and cost placement's rebalancing, as
model_placement.rebalance decides: a hot model copied onto another worker, a cold copy dropped.

Every call carries the internal token and is bounded (a load by `load_timeout`, the time to read a
model's weights). A worker's answer is laid over its record in the registry at once
(WorkerRegistry.record_models), so routing and the other scheduler replicas see the change before
the worker's next heartbeat reports it. Replicas that plan the same copy at the same instant agree
through a claim on the store (`copy:{role}:{model}`): only its holder orders the load.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from itertools import islice

import grpc
from opentelemetry import trace

from services.common.errors import NotFound, Overloaded
from services.common.store import ModelResidency, ModelState, StoreUnavailable, WorkerRecord, WorkerRole
from services.scheduler.convert import residency_from_pb
from services.scheduler.model_placement import (
    Action, ActionKind, ReplicaRule, can_serve, holding, loader_order, rebalance,
)
from services.scheduler.model_ttft import ModelTtft
from services.scheduler.registry import WorkerRegistry
from services.scheduler.worker_clients import WorkerClients
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 300.0
UNLOAD_TIMEOUT_S = 10.0


class ModelLoads:
    def __init__(self, registry: WorkerRegistry, clients: WorkerClients, load_timeout: float = LOAD_TIMEOUT_S) -> None:
        self._registry = registry
        self._clients = clients
        self._load_timeout = load_timeout
        self._owner = uuid.uuid4().hex  # this replica, as the holder of its claims

    async def provision(self, model: str, replicas: int) -> list[str]:
        """Pin `model` on `replicas` workers of each role a request needs (colocated, else prefill and
        decode), counting those that pin it already (by id), preferring those that hold it, then by the
        bin-packing order. Returns their ids. NotFound when no live worker's catalogue holds it;
        Overloaded when fewer than `replicas` of a role could take it (those that did keep it)."""
        able = [r for r in await self._registry.live_workers() if can_serve(r, model)]
        if not able:
            raise NotFound(f"no live worker's catalogue holds model {model!r}; add it to a worker's catalogue "
                           f"($TANDEM_HOME/models/{model}, or --model {model}=DIR) and start the worker")
        chosen: list[str] = []
        short: list[str] = []
        for role, group in _role_groups(able):
            pinned = await self._pin_on(group, model, replicas)
            chosen += pinned
            if len(pinned) < replicas:
                short.append(f"{len(pinned)} of {replicas} {role} workers")
        if short:
            raise Overloaded(f"model {model!r} is pinned on {', '.join(chosen) or 'no worker'}: only "
                             f"{', '.join(short)} could take it; free model memory there (unpin or unload a "
                             "model) or start more workers, then provision again")
        return chosen

    async def rebalance(self, rule: ReplicaRule, ttft: ModelTtft | None = None) -> list[Action]:
        """One round of cost placement's copies over the live workers (`ttft`: the first-token times
        this scheduler observed); returns the actions that succeeded. A copy is ordered only under
        the store's claim on it, held until its load ends (or lapses after the load timeout, should
        this replica die), and shows in the routing map as LOADING before its LoadModel call goes
        out, so another round, another replica or a request's routing starts no second load of that
        model meanwhile; the model's TTFT window starts afresh."""
        records = {r.info.worker_id: r for r in await self._registry.live_workers()}
        planned = rebalance(list(records.values()), rule, ttft.p90() if ttft is not None else None)
        actions = [a for a in planned if a.kind is ActionKind.UNLOAD or await self._claim(a, records[a.worker_id])]
        for action in actions:
            if action.kind is ActionKind.LOAD:
                await self._registry.record_models(action.worker_id, resident=ModelResidency(
                    action.model, state=ModelState.LOADING))
                if ttft is not None:
                    ttft.forget(action.model)
        done = await asyncio.gather(*(self._apply(action, records[action.worker_id]) for action in actions))
        return [action for action, ok in zip(actions, done) if ok]

    async def keep_balanced(self, rule: ReplicaRule, interval: float, ttft: ModelTtft | None = None) -> None:
        """rebalance() every `interval` seconds, until cancelled."""
        while True:
            await asyncio.sleep(interval)
            await self.rebalance(rule, ttft)

    async def _pin_on(self, group: Sequence[WorkerRecord], model: str, replicas: int) -> list[str]:
        pinned = sorted(r.info.worker_id for r in group if (m := holding(r, model)) is not None and m.pinned)
        held = [r for r in group if (m := holding(r, model)) is not None and not m.pinned]
        candidates = iter(held + loader_order(r for r in group if holding(r, model) is None))
        chosen = pinned[:replicas]
        while len(chosen) < replicas and (batch := list(islice(candidates, replicas - len(chosen)))):
            loaded = await asyncio.gather(*(self._load(record, model, pin=True) for record in batch))
            chosen += [record.info.worker_id for record, ok in zip(batch, loaded) if ok]
        return chosen

    async def _claim(self, copy: Action, record: WorkerRecord) -> bool:
        """Whether this replica now holds the claim on the copy; False while another holds it, or
        the store is down (no copy is ordered that other replicas could not see)."""
        try:
            return await self._registry.store.claim(_copy_key(copy, record), self._owner, self._load_timeout)
        except StoreUnavailable as exc:
            log.warning("no copy of %s onto %s while the store is down: %s", copy.model, copy.worker_id, exc)
            return False

    async def _release(self, copy: Action, record: WorkerRecord) -> None:
        try:
            await self._registry.store.release(_copy_key(copy, record), self._owner)
        except StoreUnavailable as exc:
            log.warning("the claim on copying %s lapses by itself, within %g s: %s",
                        copy.model, self._load_timeout, exc)

    async def _apply(self, action: Action, record: WorkerRecord) -> bool:
        log.info("%s %s on %s (cost placement)", action.kind, action.model, action.worker_id)
        if action.kind is ActionKind.UNLOAD:
            return await self._unload(record, action.model)
        try:
            return await self._load(record, action.model, pin=False)
        finally:
            await self._release(action, record)

    async def _load(self, record: WorkerRecord, model: str, *, pin: bool) -> bool:
        worker_id = record.info.worker_id
        try:
            response = await self._clients.models(record.info.address).LoadModel(
                worker_pb2.LoadModelRequest(model=model, pin=pin), timeout=self._load_timeout,
                metadata=self._clients.metadata(trace.get_current_span()))
        except grpc.aio.AioRpcError as error:
            log.warning("worker %s could not load %s: %s %s", worker_id, model, error.code().name, error.details())
            if holding(record, model) is None:  # drop the LOADING entry rebalance laid; the next heartbeat says
                await self._registry.record_models(worker_id, gone=(model,))
            return False
        await self._registry.record_models(worker_id, resident=residency_from_pb(response.model),
                                           gone=response.evicted)
        return True

    async def _unload(self, record: WorkerRecord, model: str) -> bool:
        worker_id = record.info.worker_id
        try:
            response = await self._clients.models(record.info.address).UnloadModel(
                worker_pb2.UnloadModelRequest(model=model), timeout=UNLOAD_TIMEOUT_S,
                metadata=self._clients.metadata(trace.get_current_span()))
        except grpc.aio.AioRpcError as error:
            log.warning("worker %s could not unload %s: %s %s", worker_id, model, error.code().name, error.details())
            return False
        if response.unloaded:
            await self._registry.record_models(worker_id, gone=(model,))
        return response.unloaded


def _copy_key(copy: Action, record: WorkerRecord) -> str:
    """The store's claim on copying a model for a role (rebalance plans one copy per role at a time)."""
    return f"copy:{record.info.role}:{copy.model}"


def _role_groups(records: Sequence[WorkerRecord]) -> list[tuple[WorkerRole, list[WorkerRecord]]]:
    """The roles a request for the model needs: colocated workers when any can serve it, else prefill and decode."""
    colocated = [r for r in records if r.info.role is WorkerRole.COLOCATED]
    if colocated:
        return [(WorkerRole.COLOCATED, colocated)]
    return [(role, [r for r in records if r.info.role is role]) for role in (WorkerRole.PREFILL, WorkerRole.DECODE)]
