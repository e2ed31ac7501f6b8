"""Which workers serve a model, and where a model should load or unload: pure functions over the
registry's records (each worker's last registration and load report, kept in the state store, so
every scheduler replica reads the same answers).

The routing map is model -> the workers where it is resident or loading (`routing_map`). A worker
*can serve* a model its catalogue holds; a worker with no catalogue (a one-model worker) serves
and holds its `model` alone, pinned.

Routing (planner.py) ranks the workers that can serve the request's model by prefix hits and load,
as for one model, then puts the holders first, in that order (`prefer_holders`). Only when no holder
has room for the request (the free KV blocks of its prompt; a prefill worker always has room) and no
copy is loading does cost placement put a worker that would load the model first: the others in
bin-packing order (`loader_order`): the least loaded (running plus waiting), among them the most
free model memory, among them the one whose coldest evictable model (resident, unpinned, idle) has
been idle longest, then by id.

Placement policies: COST serves any catalogue model (a worker loads it on demand); the scheduler
replicates a model whose every copy is busy or whose recent TTFT passed a threshold, one extra load
of a model at a time, and drops copies that went cold (`rebalance`). LATENCY serves only
provisioned models (pinned on a live worker, or a worker's primary model, loaded at start), and
only from their holders: a request never starts a load.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

from services.common.errors import FailedPrecondition
from services.common.store import ModelResidency, ModelState, WorkerRecord, WorkerRole


class ModelPlacement(StrEnum):
    COST = "cost"
    LATENCY = "latency"


@dataclass(frozen=True, slots=True)
class ReplicaRule:
    """When cost placement copies a model onto another worker, or drops a copy.

    hot_active: a model is hot when each of its copies has at least this many requests queued or
    running (ModelResidency.active_requests). hot_ttft_ms: a model is hot, too, when its recent time
    to first token (the p90 the scheduler observed, model_ttft.py) is at least this (0: off).
    cold_idle_ms: a copy idle this long, unpinned, is dropped while another copy of the model stays."""

    hot_active: int = 8
    cold_idle_ms: int = 120_000
    hot_ttft_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.hot_active < 1:
            raise ValueError(f"--replicate-active must be >= 1 request per copy, got {self.hot_active}")
        if self.hot_ttft_ms < 0:
            raise ValueError(f"--replicate-ttft-ms must be >= 0 (0: off), got {self.hot_ttft_ms:g}")
        if self.cold_idle_ms < 0:
            raise ValueError(f"--drop-idle-s must be >= 0, got {self.cold_idle_ms / 1000:g}")


class ActionKind(StrEnum):
    LOAD = "load"
    UNLOAD = "unload"


@dataclass(frozen=True, slots=True)
class Action:
    """A ModelService call the scheduler makes: load `model` on `worker_id`, or unload it there."""

    kind: ActionKind
    model: str
    worker_id: str


def catalogue(record: WorkerRecord) -> tuple[str, ...]:
    """Every model the worker may serve."""
    return record.info.catalogue or (record.info.model,)


def can_serve(record: WorkerRecord, model: str) -> bool:
    """`model in catalogue(record)`, without building a one-model worker's catalogue (routing asks per
    worker on every request)."""
    info = record.info
    return model in info.catalogue if info.catalogue else model == info.model


def residency(record: WorkerRecord) -> tuple[ModelResidency, ...]:
    """The models the worker holds or is loading; a one-model worker (no catalogue) holds its `model`, pinned."""
    if record.info.catalogue:
        return record.load.models
    return record.load.models or _pinned_primary(record.info.model)


@lru_cache(maxsize=1024)
def _pinned_primary(model: str) -> tuple[ModelResidency, ...]:
    """A one-model worker's residency, built once per model name (immutable; routing asks for it per
    worker on every request)."""
    return (ModelResidency(model, pinned=True),)


def holding(record: WorkerRecord, model: str) -> ModelResidency | None:
    """The worker's residency of `model` (resident or loading), None when it holds no copy."""
    for held in residency(record):
        if held.name == model:
            return held
    return None


def holds(record: WorkerRecord, model: str) -> bool:
    """`holding(record, model) is not None`, without walking a one-model worker's residency (routing
    asks per worker on every request)."""
    if not record.info.catalogue and not record.load.models:
        return model == record.info.model
    return holding(record, model) is not None


def routing_map(records: Iterable[WorkerRecord]) -> dict[str, list[str]]:
    """Model -> the ids of the workers where it is resident or loading, each list in record order."""
    holders: dict[str, list[str]] = {}
    for record in records:
        for model in residency(record):
            holders.setdefault(model.name, []).append(record.info.worker_id)
    return holders


def provisioned(records: Iterable[WorkerRecord], model: str) -> bool:
    """Some live worker holds the model pinned (provisioned, --pin, or a one-model worker's model) or
    as its primary model: one loaded at start is provisioned by definition, its workers its group."""
    return any((m := holding(r, model)) is not None and (m.pinned or r.info.model == model) for r in records)


def loading(records: Iterable[WorkerRecord], model: str) -> bool:
    """Some worker is loading the model (an extra copy is on its way)."""
    return any((m := holding(r, model)) is not None and m.state is ModelState.LOADING for r in records)


def cold_start(record: WorkerRecord, model: str) -> bool:
    """A request for `model` ("": the worker's primary) on this worker waits for a load: no copy of it is
    resident there."""
    held = holding(record, model or record.info.model)
    return held is None or held.state is ModelState.LOADING


def serving(records: Sequence[WorkerRecord], model: str, policy: ModelPlacement) -> list[WorkerRecord]:
    """The workers a request for `model` may go to (every worker for an empty model name). Under
    LATENCY only the holders of a provisioned model: FailedPrecondition for one never provisioned."""
    if not model:
        return list(records)
    able = [r for r in records if can_serve(r, model)]
    if policy is ModelPlacement.COST:
        return able
    if able and not provisioned(able, model):
        raise FailedPrecondition(
            f"model {model!r} is not provisioned: --placement latency serves only provisioned models and never "
            f"loads one for a request; provision it first: tandem models provision {model} --replicas N")
    return [r for r in able if holding(r, model) is not None]


def coldest_idle_ms(record: WorkerRecord) -> int:
    """How long the worker's coldest evictable model (resident, unpinned, no requests) has been idle;
    -1 when it has none."""
    idle = [m.idle_ms for m in residency(record)
            if m.state is ModelState.RESIDENT and not m.pinned and m.active_requests == 0]
    return max(idle, default=-1)


def loader_order(records: Iterable[WorkerRecord]) -> list[WorkerRecord]:
    """Workers best first to load a model (bin-packing): least loaded, then the most free model
    memory, then the coldest model to evict, then id."""
    return sorted(records, key=lambda r: (r.load.running + r.load.waiting, -r.load.free_model_memory_bytes,
                                          -coldest_idle_ms(r), r.info.worker_id))


def prefer_holders(ranked: Sequence[str], records: Mapping[str, WorkerRecord], model: str,
                   room: Iterable[str], policy: ModelPlacement) -> list[str]:
    """`ranked` (worker ids, the router's order) reordered: the holders of `model` in that order, then
    (COST) the others in loader_order; those others first when no holder is in `room` and no copy is
    loading (one extra load of a model at a time: a request waits for the copy on its way). An empty
    model name keeps the router's order."""
    if not model:
        return list(ranked)
    holders = [w for w in ranked if holds(records[w], model)]
    if policy is ModelPlacement.LATENCY or len(holders) == len(ranked):
        return holders
    held = set(holders)
    loaders = [r.info.worker_id for r in loader_order(records[w] for w in ranked if w not in held)]
    if held.intersection(room) or loading((records[w] for w in holders), model):
        return holders + loaders
    return loaders + holders


def rebalance(records: Sequence[WorkerRecord], rule: ReplicaRule,
              ttft_ms: Mapping[str, float] | None = None) -> list[Action]:
    """Cost placement's copies, per role: one LOAD for each hot model (every copy busy, or, on the
    workers that make first tokens, its recent TTFT `ttft_ms[model]` over the rule's; none while a
    copy is loading: one extra load of a model at a time) on the first worker of loader_order that
    can serve it, and one UNLOAD for each model with a cold unpinned copy and another copy kept (its
    coldest such copy)."""
    actions: list[Action] = []
    for role in WorkerRole:
        group = [r for r in records if r.info.role is role]
        for model in sorted(routing_map(group)):
            first_token = (ttft_ms or {}).get(model, 0.0) if role is not WorkerRole.DECODE else 0.0
            hot = _hot(group, model, rule, first_token)
            actions += (_replicate(group, model) if hot else []) + _drop_cold(group, model, rule)
    return actions


def _hot(group: Sequence[WorkerRecord], model: str, rule: ReplicaRule, ttft_ms: float) -> bool:
    copies = [m for r in group if (m := holding(r, model)) is not None]
    return (min(m.active_requests for m in copies) >= rule.hot_active
            or 0 < rule.hot_ttft_ms <= ttft_ms)


def _replicate(group: Sequence[WorkerRecord], model: str) -> list[Action]:
    if loading(group, model):
        return []
    spare = loader_order(r for r in group if can_serve(r, model) and holding(r, model) is None)
    return [Action(ActionKind.LOAD, model, spare[0].info.worker_id)] if spare else []


def _drop_cold(group: Sequence[WorkerRecord], model: str, rule: ReplicaRule) -> list[Action]:
    copies = [(r, m) for r in group if (m := holding(r, model)) is not None]
    cold = [(r, m) for r, m in copies if m.state is ModelState.RESIDENT and not m.pinned
            and m.active_requests == 0 and m.idle_ms >= rule.cold_idle_ms]
    if not cold or len(copies) < 2:
        return []
    record, _ = max(cold, key=lambda c: (c[1].idle_ms, c[0].info.worker_id))
    return [Action(ActionKind.UNLOAD, model, record.info.worker_id)]
