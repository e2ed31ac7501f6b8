"""What a client is told when its request fails on a worker or in the scheduler, and where the detail goes.

The client's status carries a stable message that names the request id: which worker, at which
address, said what, is internal. That detail goes to the scheduler's log and, as an OpenTelemetry
`exception` event, to the request's span, where `tandem trace REQUEST_ID` shows it.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.common.errors import DeadlineExceeded, TandemError, Unavailable, error_from_status
from services.common.store import WorkerRecord
from services.scheduler.inflight import RequestState
from tandem.v1 import scheduler_pb2
from tandem.v1.errors import code_from_number

log = logging.getLogger(__name__)

_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)


def caller_cancelled() -> bool:
    """Whether the running task is being cancelled (the Submit call ended, the scheduler stops), as
    opposed to a CancelledError raised by a call whose channel was closed under it."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def from_rpc(state: RequestState, worker: WorkerRecord, call: str, error: grpc.aio.AioRpcError, *,
             deadline_bound: bool) -> TandemError:
    """A failed call to a worker. `deadline_bound`: the call's timeout was the request's deadline."""
    code = error.code()
    detail = f"{call} on {_where(worker)} failed: {code.name}: {error.details()}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and deadline_bound:
        _note(state, detail, code.name)
        return DeadlineExceeded(f"request {state.request_id}: its deadline passed")
    if code in _UNREACHABLE:
        return _unreachable(state, worker, detail)
    return _failed(state, code, detail, tuple(error.trailing_metadata() or ()))


def cut(state: RequestState, worker: WorkerRecord, call: str) -> Unavailable:
    """A call to a worker raised CancelledError: its channel was closed, because the worker was lost."""
    return _unreachable(state, worker, f"{call} on {_where(worker)} was cut: the worker was lost")


def from_event(state: RequestState, event: scheduler_pb2.TokenEvent) -> TandemError:
    """A worker's FINISH_REASON_ERROR event (its RequestError's code and message); UNAVAILABLE is a
    request the worker dropped on its own (services/worker/runtime.py `abort`), which may be retried."""
    code = code_from_number(event.error.code)
    detail = f"worker {event.worker_id} failed the request: {code.name}: {event.error.message}"
    if code == grpc.StatusCode.UNAVAILABLE:
        _note(state, detail, code.name)
        return Unavailable(f"request {state.request_id}: the worker serving it dropped it; retry the request")
    return _failed(state, code, detail)


def lost(state: RequestState, worker_id: str, reason: str) -> Unavailable:
    _note(state, f"worker {worker_id} was lost ({reason}) while it held the request", "Unavailable")
    return Unavailable(f"request {state.request_id}: a worker serving it was lost; retry the request")


def interrupted(state: RequestState) -> Unavailable:
    """A CancelledError reached the request that its own call did not ask for: something it awaited was cut."""
    log.warning("request %s: an awaited call was cancelled under it", state.request_id, exc_info=True)
    state.span.add_event("exception", {"exception.type": "CancelledError",
                                       "exception.message": "an awaited call was cancelled under the request"})
    return Unavailable(f"request {state.request_id}: a call it needed was cut; retry the request")


def internal(state: RequestState, error: BaseException) -> TandemError:
    """An unexpected exception in the scheduler: INTERNAL, its traceback in the log and on the span."""
    log.error("request %s failed in the scheduler", state.request_id, exc_info=error)
    state.span.record_exception(error)
    return TandemError(f"request {state.request_id}: the scheduler failed it (internal error); "
                       f"its log has the detail")


def _unreachable(state: RequestState, worker: WorkerRecord, detail: str) -> Unavailable:
    _note(state, detail, "Unavailable")
    return Unavailable(f"request {state.request_id}: a {worker.info.role} worker it needed stopped answering; "
                       f"retry the request")


def _failed(state: RequestState, code: grpc.StatusCode, detail: str,
            metadata: tuple[tuple[str, str | bytes], ...] = ()) -> TandemError:
    _note(state, detail, code.name)
    return error_from_status(code, f"request {state.request_id}: a worker failed it with {code.name}; "
                                   f"its trace has the detail", metadata)


def _note(state: RequestState, detail: str, kind: str) -> None:
    log.warning("request %s: %s", state.request_id, detail)
    state.span.add_event("exception", {"exception.type": kind, "exception.message": detail})


def _where(worker: WorkerRecord) -> str:
    return f"{worker.info.role} worker {worker.info.worker_id} at {worker.info.address}"
