"""Routing one request: the live workers serving its model under the placement policy
(model_placement.py), their prefix matches for its block-hash chain (model, tenant salt and adapter
included), their load with this scheduler's in-flight requests on top, ranked by the router's costs,
holders of the model first unless none has room (model_placement.prefer_holders). Colocated workers,
when any are live, take every request.

Before routing, room() tells admission whether a decode worker has room for the request's KV now
(its prompt and first token), only later, or never (more blocks than the largest worker holds).
"""

from __future__ import annotations

import dataclasses
from json.encoder import encode_basestring_ascii as _json_string  # json.dumps' string escaping
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import Enum

from services.common.block_hash import BlockHash, hash_chain
from services.common.errors import FailedPrecondition, InvalidRequest, Unavailable
from services.common.store import WorkerRecord, WorkerRole
from services.scheduler.inflight import InflightTable, WorkerLoads
from services.scheduler.prefill_placement import PrefillDecision, PrefillInputs, PrefillPlacement, PrefillSite
from services.scheduler.model_placement import ModelPlacement, catalogue, holds, prefer_holders, serving
from services.scheduler.registry import WorkerRegistry
from services.scheduler.router import (Candidate, Score, blocks_for, cached_tokens, new_candidate, rank_decode,
                                      rank_prefill)
from tandem.v1 import scheduler_pb2

RECORDED_SCORES = 16  # candidates of each kind a decision records (RouteInfo, the request's span), best first


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """Candidates best first: prefill (or colocated) and decode (empty when colocated). `colocated`:
    one worker prefills and generates (an assignment): a colocated worker, or a hybrid decode worker that
    prefills locally, the only prefill candidate then. `placement`: the local-or-remote decision
    when a hybrid decode worker was the choice (prefill_placement.py)."""

    colocated: bool
    prefill: list[Score]
    decode: list[Score]
    workers: dict[str, WorkerRecord]
    degraded: bool
    placement: PrefillDecision | None = None

    def route_info(self, request_id: str, decode_worker_id: str, reserved_blocks: int) -> scheduler_pb2.RouteInfo:
        """The decision as recorded: the best prefill candidate, the decode worker that took the reservation.
        Without the candidates' scores (recorded_scores), which only Stats' recent routes carry on the wire."""
        prefill = self.prefill[0]
        if self.placement is not None and self.placement.site is PrefillSite.LOCAL:
            decode_worker_id = prefill.worker_id
        return scheduler_pb2.RouteInfo(
            request_id=request_id, prefill_worker_id=prefill.worker_id, decode_worker_id=decode_worker_id,
            matched_prefix_blocks=prefill.cached_blocks, reserved_blocks=reserved_blocks, degraded=self.degraded)

    def recorded_scores(self) -> tuple[list[Score], list[Score]]:
        """The best candidates of each kind (RECORDED_SCORES), best first: prefill, then decode."""
        return self.prefill[:RECORDED_SCORES], self.decode[:RECORDED_SCORES]

    def scores_json(self) -> str:
        """The best candidates' score breakdowns (RECORDED_SCORES of each kind), for the request's span:
        a JSON object, worker id -> its breakdown, a worker in both lists once, in its first place with its
        decode breakdown. Written as json.dumps writes it (costs are finite floats, the rest ints), without
        the dicts it would walk: every route writes one (16 candidates: 17 us with json.dumps, 10 without)."""
        entries = {s.worker_id: f'{{"cost": {float(s.cost)!r}, "cached_blocks": {int.__repr__(s.cached_blocks)}, '
                                f'"queued_prefill_tokens": {int.__repr__(s.queued_prefill_tokens)}}}'
                   for s in self.prefill[:RECORDED_SCORES]}
        entries |= {s.worker_id: f'{{"cost": {float(s.cost)!r}, "free_blocks": {int.__repr__(s.free_blocks)}, '
                                 f'"running": {int.__repr__(s.running)}}}'
                    for s in self.decode[:RECORDED_SCORES]}
        return "{" + ", ".join(f"{_json_string(worker_id)}: {entry}" for worker_id, entry in entries.items()) + "}"


class Room(Enum):
    """Whether a request's KV fits on a decode worker, by the registry's last known loads."""

    NOW = "now"  # some worker has the blocks free (or there is no decode worker to wait for)
    LATER = "later"  # every decode worker is short of free blocks now
    NEVER = "never"  # more blocks than the largest worker holds in all


def room(registry: WorkerRegistry, inflight: InflightTable, request: scheduler_pb2.SubmitRequest) -> Room:
    """Colocated workers hold no reservation: they queue what they take, so only NOW or NEVER."""
    generators = _generators(registry, request.model)
    if not generators:
        return Room.NOW  # routing says there is no worker
    num_tokens = len(request.token_ids) + 1
    if all(blocks_for(num_tokens, r.info.block_size) > r.info.num_blocks for r in generators):
        return Room.NEVER
    if generators[0].info.role == WorkerRole.COLOCATED:
        return Room.NOW
    loads = inflight.loads()
    if any(_free_blocks(registry, loads, r) >= blocks_for(num_tokens, r.info.block_size)
           for r in generators):
        return Room.NOW
    return Room.LATER


def never_fits(registry: WorkerRegistry, request: scheduler_pb2.SubmitRequest) -> InvalidRequest:
    """The error of a request whose room() is NEVER."""
    generators = _generators(registry, request.model)
    largest = max(generators, key=lambda r: r.info.num_blocks * r.info.block_size)
    prompt, block_size = len(request.token_ids), largest.info.block_size
    return InvalidRequest("token_ids", (
        f"request {request.request_id}: a prompt of {prompt} tokens needs {blocks_for(prompt + 1, block_size)} "
        f"KV blocks of {block_size} tokens (with the first generated token); the largest {largest.info.role} "
        f"worker holds {largest.info.num_blocks}; shorten the prompt"))


def _generators(registry: WorkerRegistry, model: str) -> list[WorkerRecord]:
    """The workers that would hold the request's KV: colocated ones when any serve the model, else decode ones.
    None for a model latency placement refuses: routing refuses it (never admission, which only waits)."""
    try:
        return _roster(registry.snapshot(), model, registry.model_placement).generators
    except FailedPrecondition:
        return []


@dataclass(frozen=True, slots=True)
class _Roster:
    """The live workers serving one model (model_placement.serving), by the part each may play in a
    route, in the registry's order. Routing reads them on every request; they change only with the
    records (a registration, a heartbeat, a worker lost), so they are kept until then (_roster).
    Shared by every request routed meanwhile: never modified."""

    colocated: list[WorkerRecord]
    prefill: list[WorkerRecord]  # the colocated workers when any, else the prefill ones
    decode: list[WorkerRecord]  # none when colocated workers serve the model
    matchable: list[WorkerRecord]  # those whose prefix hits count: prefill, then decode ones that prefill locally
    workers: dict[str, WorkerRecord]  # records by id
    all_hold: bool  # every one holds the model (resident or loading), or it names none: the usual case

    @property
    def generators(self) -> list[WorkerRecord]:
        """The workers that would hold a request's KV."""
        return self.colocated or self.decode

    @classmethod
    def of(cls, live: Iterable[WorkerRecord], model: str, policy: ModelPlacement) -> _Roster:
        records = serving(list(live), model, policy)
        colocated = _with_role(records, WorkerRole.COLOCATED)
        prefill = colocated or _with_role(records, WorkerRole.PREFILL)
        decode = [] if colocated else _with_role(records, WorkerRole.DECODE)
        return cls(colocated, prefill, decode, matchable=prefill + _local_prefill(decode),
                   workers={r.info.worker_id: r for r in records},
                   all_hold=not model or all(holds(r, model) for r in records))


_ROSTERS_KEPT = 64  # models (and policies) whose roster is kept; past that, all are built afresh
_rosters: dict[tuple[str, ModelPlacement], tuple[tuple[WorkerRecord, ...], _Roster]] = {}


def _roster(live: list[WorkerRecord], model: str, policy: ModelPlacement) -> _Roster:
    """The roster of `model` among `live`: the one kept for the same records (frozen, and a heartbeat
    replaces its worker's, so the same records, compared by identity and else by value, make the same
    roster), else built and kept. Raises FailedPrecondition as serving() does (never kept)."""
    key, records = (model, policy), tuple(live)
    kept = _rosters.get(key)
    if kept is not None and kept[0] == records:
        return kept[1]
    roster = _Roster.of(records, model, policy)
    if len(_rosters) >= _ROSTERS_KEPT and key not in _rosters:
        _rosters.clear()  # names of models nobody serves, say: keep the memory bounded
    _rosters[key] = (records, roster)
    return roster


async def plan_route(registry: WorkerRegistry, inflight: InflightTable,
                     request: scheduler_pb2.SubmitRequest, placement: PrefillPlacement | None = None) -> RoutePlan:
    """Raises Unavailable when no live worker can serve the request's model. A hybrid decode worker
    may be chosen to prefill locally (_place_prefill), by `placement` (none: the default policy, no
    step-cost models)."""
    live = await registry.live_workers()
    roster = _roster(live, request.model, registry.model_placement)
    colocated, prefill, decode, workers = roster.colocated, roster.prefill, roster.decode, roster.workers
    if not roster.matchable or not (colocated or decode):
        raise Unavailable(f"request {request.request_id}: {_no_worker_message(request.model, live, prefill)}")
    matched = await _prefix_matches(registry, request, roster.matchable)
    degraded = registry.degraded
    prompt_tokens = len(request.token_ids)
    loads = inflight.loads()
    prefill_candidates = _candidates(registry, loads, prefill, matched)
    decode_candidates = _candidates(registry, loads, decode, {})
    all_hold = roster.all_hold

    def holders_first(scores: list[Score], room: Iterable[str]) -> list[Score]:
        if all_hold:  # every candidate holds the model: prefer_holders keeps the router's order
            return scores
        ranked = [s.worker_id for s in scores]
        order = prefer_holders(ranked, workers, request.model, room, registry.model_placement)
        if order == ranked:  # the holders already lead: the router's order stands
            return scores
        by_id = {s.worker_id: s for s in scores}
        return [by_id[w] for w in order]

    prefill_room = (_with_room(prefill_candidates, prompt_tokens + 1) if colocated  # a prefill worker holds no KV
                    else (c.worker_id for c in prefill_candidates))
    plan = RoutePlan(
        colocated=bool(colocated),
        prefill=holders_first(rank_prefill(prefill_candidates, prompt_tokens, use_prefix=not degraded), prefill_room),
        decode=holders_first(rank_decode(decode_candidates, prompt_tokens + 1),
                             _with_room(decode_candidates, prompt_tokens + 1)),
        workers=workers,
        degraded=degraded,
    )
    if colocated:
        return plan
    return _place_prefill(plan, placement or PrefillPlacement(), loads, matched, prompt_tokens)


def _place_prefill(plan: RoutePlan, placement: PrefillPlacement, loads: WorkerLoads, matched: dict[str, int],
                   prompt_tokens: int) -> RoutePlan:
    """Where a disaggregated request prefills. The best ranked decode worker (with no prefill worker,
    the best that can prefill) decides when it is hybrid: locally, it is the one worker of an assignment
    (its decode candidates kept for the record); remotely, the plan as it was. Otherwise the plan as it was."""
    capable = [s for s in plan.decode if plan.workers[s.worker_id].info.local_prefill]
    target = plan.decode[0] if plan.prefill else capable[0]
    info = plan.workers[target.worker_id].info
    if not info.local_prefill:
        return plan
    cached_blocks = matched.get(target.worker_id, 0)
    queued = loads.queued_prefill_tokens(target.worker_id)
    uncached = prompt_tokens - cached_tokens(cached_blocks, info.block_size, prompt_tokens)
    inputs = PrefillInputs(uncached_tokens=uncached, queued_tokens=queued, running=target.running,
                           remote_available=bool(plan.prefill), running_context=loads.running_context(target.worker_id),
                           queued_reads=loads.queued_prefill_reads(target.worker_id))
    remote = plan.prefill[0] if plan.prefill else None
    if remote is not None:  # the best ranked prefill worker's queue, for the first-token times
        remote_cached = cached_tokens(remote.cached_blocks, plan.workers[remote.worker_id].info.block_size,
                                      prompt_tokens)
        inputs = dataclasses.replace(inputs, remote_tokens=prompt_tokens - remote_cached,
                                     remote_queued_tokens=remote.queued_prefill_tokens,
                                     remote_queued_reads=loads.queued_prefill_reads(remote.worker_id))
    decision = placement.decide(target.worker_id, inputs, remote.worker_id if remote is not None else "")
    if decision.site is PrefillSite.REMOTE:
        return dataclasses.replace(plan, placement=decision)
    local = Score(target.worker_id, float(uncached + queued), cached_blocks=cached_blocks,
                  queued_prefill_tokens=queued, free_blocks=target.free_blocks, running=target.running)
    return dataclasses.replace(plan, colocated=True, prefill=[local], placement=decision)


def _local_prefill(records: Iterable[WorkerRecord]) -> list[WorkerRecord]:
    """The decode workers that may prefill locally (tandem decode --hybrid)."""
    return [r for r in records if r.info.local_prefill]


def _with_room(candidates: Iterable[Candidate], num_tokens: int) -> Iterator[str]:
    """The workers with the free KV blocks for `num_tokens` now, lazily: prefer_holders reads them only
    when some candidate lacks the model (never when every one holds it, the usual case)."""
    return (c.worker_id for c in candidates if c.free_blocks >= blocks_for(num_tokens, c.block_size))


def _with_role(records: Iterable[WorkerRecord], role: WorkerRole) -> list[WorkerRecord]:
    return [r for r in records if r.info.role == role]


async def _prefix_matches(registry: WorkerRegistry, request: scheduler_pb2.SubmitRequest,
                          workers: list[WorkerRecord]) -> dict[str, int]:
    """Leading blocks of the prompt each worker caches (those caching none left out), hashing the
    prompt once per block size and model. With one such chain for every worker (the usual case) the
    index's answer is taken whole: it may name workers that are no candidates, never looked up."""
    if request.model:  # the usual case: one chain model for all, no call per worker to say so
        keys = {(block_size, request.model) for block_size in {w.info.block_size for w in workers}}
    else:
        keys = {(w.info.block_size, _chain_model(request, w)) for w in workers}
    if len(keys) == 1:
        return await registry.match_prefix(_chain(request, *keys.pop()))
    groups: dict[tuple[int, str], set[str]] = {}
    for w in workers:
        groups.setdefault((w.info.block_size, _chain_model(request, w)), set()).add(w.info.worker_id)
    matched: dict[str, int] = {}
    for (block_size, model), members in sorted(groups.items()):
        found = await registry.match_prefix(_chain(request, block_size, model))
        matched.update({w: blocks for w, blocks in found.items() if w in members})
    return matched


def _chain(request: scheduler_pb2.SubmitRequest, block_size: int, model: str) -> list[BlockHash]:
    return hash_chain(request.token_ids, block_size, salt=request.cache_salt, adapter=request.lora, model=model)


def _chain_model(request: scheduler_pb2.SubmitRequest, record: WorkerRecord) -> str:
    """The model whose blocks the request would use on the worker, the first key of its hash chain:
    the one it names, or the worker's primary for a request naming none (the worker runs it there)."""
    return request.model or record.info.model


def _candidates(registry: WorkerRegistry, loads: WorkerLoads, records: Iterable[WorkerRecord],
                matched: dict[str, int]) -> list[Candidate]:
    """The workers as routing sees them, `matched` their leading cached blocks. (One pass with the
    loads' tables bound once, and _free_blocks only where this scheduler reserved: routing builds one
    per worker on every request.)"""
    running, queued, cached = loads.generating.get, loads.queued_prefill.get, matched.get
    reserving, reported_free = loads.reservations, registry.free_blocks
    candidates = []
    for record in records:
        info = record.info
        worker_id = info.worker_id
        free = _free_blocks(registry, loads, record) if worker_id in reserving else reported_free(record)
        candidates.append(new_candidate((worker_id, info.block_size, free, running(worker_id, 0),
                                         queued(worker_id, 0), cached(worker_id, 0))))
    return candidates


def _free_blocks(registry: WorkerRegistry, loads: WorkerLoads, record: WorkerRecord) -> int:
    """The worker's free KV blocks at its last report, less those this scheduler reserved there since."""
    worker_id = record.info.worker_id
    free = registry.free_blocks(record)
    if not loads.reserves_on(worker_id):  # most workers, on every route
        return free
    return free - loads.reserved_since(worker_id, registry.last_seen(worker_id) or 0.0)


def _no_worker_message(model: str, live: list[WorkerRecord], prefill: list[WorkerRecord]) -> str:
    missing = "decode" if prefill else "prefill (or colocated)"
    served = sorted({name for r in live for name in catalogue(r)})
    known = f"live workers serve {', '.join(map(repr, served))}" if served else "no worker is registered"
    return f"no live {missing} worker serves model {model!r} ({known}); start one or retry later"
