"""Registry records at the wire's edge: tandem.v1 WorkerInfo/WorkerLoad <-> the Store's dataclasses."""

from __future__ import annotations

from services.common.errors import InvalidRequest
from services.common.store import ModelResidency, ModelState, WorkerInfo, WorkerLoad, WorkerRole
from tandem.v1 import common_pb2, scheduler_pb2

ROLE_FROM_PROTO = {
    common_pb2.WORKER_ROLE_PREFILL: WorkerRole.PREFILL,
    common_pb2.WORKER_ROLE_DECODE: WorkerRole.DECODE,
    common_pb2.WORKER_ROLE_COLOCATED: WorkerRole.COLOCATED,
}
ROLE_TO_PROTO = {role: number for number, role in ROLE_FROM_PROTO.items()}
STATE_FROM_PROTO = {scheduler_pb2.MODEL_STATE_LOADING: ModelState.LOADING,
                    scheduler_pb2.MODEL_STATE_RESIDENT: ModelState.RESIDENT}
STATE_TO_PROTO = {state: number for number, state in STATE_FROM_PROTO.items()}
MAX_NAME_CHARS = 256  # worker id, address, model and device names: the registry stores each one
MAX_CATALOGUE = 4096  # models one worker may list: the registry stores the list with its record


def load_from_pb(msg: scheduler_pb2.WorkerLoad) -> WorkerLoad:
    """A residency in an unknown state (an older worker's MODEL_STATE_UNSPECIFIED) counts as resident."""
    return WorkerLoad(free_blocks=msg.free_blocks, cached_blocks=msg.cached_blocks, running=msg.running,
                      waiting=msg.waiting, queued_prefill_tokens=msg.queued_prefill_tokens,
                      reserved_blocks=msg.reserved_blocks, models=tuple(map(residency_from_pb, msg.models)),
                      free_model_memory_bytes=msg.free_model_memory_bytes)


def load_to_pb(load: WorkerLoad) -> scheduler_pb2.WorkerLoad:
    return scheduler_pb2.WorkerLoad(free_blocks=load.free_blocks, cached_blocks=load.cached_blocks,
                                    running=load.running, waiting=load.waiting,
                                    queued_prefill_tokens=load.queued_prefill_tokens,
                                    reserved_blocks=load.reserved_blocks,
                                    models=[residency_to_pb(m) for m in load.models],
                                    free_model_memory_bytes=load.free_model_memory_bytes)


def residency_from_pb(msg: scheduler_pb2.ModelResidency) -> ModelResidency:
    return ModelResidency(name=msg.name, state=STATE_FROM_PROTO.get(msg.state, ModelState.RESIDENT),
                          pinned=msg.pinned, weight_bytes=msg.weight_bytes, active_requests=msg.active_requests,
                          idle_ms=msg.idle_ms)


def residency_to_pb(residency: ModelResidency) -> scheduler_pb2.ModelResidency:
    return scheduler_pb2.ModelResidency(name=residency.name, state=STATE_TO_PROTO[residency.state],
                                        pinned=residency.pinned, weight_bytes=residency.weight_bytes,
                                        active_requests=residency.active_requests, idle_ms=residency.idle_ms)


def info_from_pb(msg: scheduler_pb2.WorkerInfo) -> WorkerInfo:
    """Validated: InvalidRequest names the first bad field (worker.role, worker.address, ...)."""
    if not msg.worker_id:
        raise InvalidRequest("worker.worker_id", "must not be empty")
    for field in ("worker_id", "address", "model", "device"):
        if len(getattr(msg, field)) > MAX_NAME_CHARS:
            raise InvalidRequest(f"worker.{field}", f"at most {MAX_NAME_CHARS} characters, "
                                                    f"got {len(getattr(msg, field))}")
    if msg.role not in ROLE_FROM_PROTO:
        raise InvalidRequest("worker.role", f"must be PREFILL, DECODE or COLOCATED, got {msg.role}")
    host, sep, port = msg.address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidRequest("worker.address", f"must be HOST:PORT, got {msg.address!r}")
    if msg.block_size < 1:
        raise InvalidRequest("worker.block_size", f"must be >= 1, got {msg.block_size}")
    if msg.num_blocks < 1:
        raise InvalidRequest("worker.num_blocks", f"must be >= 1, got {msg.num_blocks}")
    _check_catalogue(msg)
    if msg.local_prefill and msg.role != common_pb2.WORKER_ROLE_DECODE:
        raise InvalidRequest("worker.local_prefill", "only a decode worker prefills locally (tandem decode --hybrid); "
                                                     f"got it on a {ROLE_FROM_PROTO[msg.role]} worker")
    return WorkerInfo(worker_id=msg.worker_id, role=ROLE_FROM_PROTO[msg.role], address=msg.address,
                      model=msg.model, num_blocks=msg.num_blocks, block_size=msg.block_size,
                      max_model_len=msg.max_model_len, kv_block_bytes=msg.kv_block_bytes, device=msg.device,
                      catalogue=tuple(msg.catalogue), model_memory_bytes=msg.model_memory_bytes,
                      local_prefill=msg.local_prefill)


def info_to_pb(info: WorkerInfo, load: WorkerLoad) -> scheduler_pb2.WorkerInfo:
    return scheduler_pb2.WorkerInfo(
        worker_id=info.worker_id, role=ROLE_TO_PROTO[info.role], address=info.address, model=info.model,
        num_blocks=info.num_blocks, block_size=info.block_size, max_model_len=info.max_model_len,
        kv_block_bytes=info.kv_block_bytes, device=info.device, catalogue=info.catalogue,
        model_memory_bytes=info.model_memory_bytes, local_prefill=info.local_prefill,
        load=load_to_pb(load))


def _check_catalogue(msg: scheduler_pb2.WorkerInfo) -> None:
    if len(msg.catalogue) > MAX_CATALOGUE:
        raise InvalidRequest("worker.catalogue", f"at most {MAX_CATALOGUE} models, got {len(msg.catalogue)}")
    for name in msg.catalogue:
        if not name or len(name) > MAX_NAME_CHARS:
            raise InvalidRequest("worker.catalogue", f"each name must have 1 to {MAX_NAME_CHARS} characters, "
                                                     f"got {name[:MAX_NAME_CHARS]!r}")
    if msg.model_memory_bytes < 0:
        raise InvalidRequest("worker.model_memory_bytes", f"must be >= 0 (0: no budget), got {msg.model_memory_bytes}")
