"""Registry records at the wire's edge: tandem.v1 WorkerInfo/WorkerLoad <-> the Store's dataclasses."""

from __future__ import annotations

from services.common.errors import InvalidRequest
from services.common.store import WorkerInfo, WorkerLoad, WorkerRole
from tandem.v1 import common_pb2, scheduler_pb2

ROLE_FROM_PROTO = {
    common_pb2.WORKER_ROLE_PREFILL: WorkerRole.PREFILL,
    common_pb2.WORKER_ROLE_DECODE: WorkerRole.DECODE,
    common_pb2.WORKER_ROLE_COLOCATED: WorkerRole.COLOCATED,
}
ROLE_TO_PROTO = {role: number for number, role in ROLE_FROM_PROTO.items()}
MAX_NAME_CHARS = 256  # worker id, address, model and device names: the registry stores each one


def load_from_pb(msg: scheduler_pb2.WorkerLoad) -> WorkerLoad:
    return WorkerLoad(free_blocks=msg.free_blocks, cached_blocks=msg.cached_blocks, running=msg.running,
                      waiting=msg.waiting, queued_prefill_tokens=msg.queued_prefill_tokens,
                      reserved_blocks=msg.reserved_blocks)


def load_to_pb(load: WorkerLoad) -> scheduler_pb2.WorkerLoad:
    return scheduler_pb2.WorkerLoad(free_blocks=load.free_blocks, cached_blocks=load.cached_blocks,
                                    running=load.running, waiting=load.waiting,
                                    queued_prefill_tokens=load.queued_prefill_tokens,
                                    reserved_blocks=load.reserved_blocks)


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
    return WorkerInfo(worker_id=msg.worker_id, role=ROLE_FROM_PROTO[msg.role], address=msg.address,
                      model=msg.model, num_blocks=msg.num_blocks, block_size=msg.block_size,
                      max_model_len=msg.max_model_len, kv_block_bytes=msg.kv_block_bytes, device=msg.device)


def info_to_pb(info: WorkerInfo, load: WorkerLoad) -> scheduler_pb2.WorkerInfo:
    return scheduler_pb2.WorkerInfo(
        worker_id=info.worker_id, role=ROLE_TO_PROTO[info.role], address=info.address, model=info.model,
        num_blocks=info.num_blocks, block_size=info.block_size, max_model_len=info.max_model_len,
        kv_block_bytes=info.kv_block_bytes, device=info.device, load=load_to_pb(load))
