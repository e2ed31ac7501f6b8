"""A worker's token event as the gateway gets it from the scheduler: the route on the first event,
the scheduler's own timings on the first and the final one, a migrated request's usage restated,
and no in-band error (failures end the Submit call with a status instead)."""

from __future__ import annotations

from services.scheduler import migration
from services.scheduler.inflight import RequestState
from tandem.v1 import common_pb2, scheduler_pb2


def outgoing(state: RequestState, event: scheduler_pb2.TokenEvent, now: float) -> scheduler_pb2.TokenEvent:
    """The relayed `event` made the gateway's, at time.monotonic() `now`; records the request's
    first-token time, finish reason and events sent."""
    first, final = state.events_sent == 0, event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    if first and state.route is not None:
        event.route.CopyFrom(state.route)
    if event.token_ids and state.first_token_at is None:
        state.first_token_at = now
    if first or final:
        _stamp(state, event.timings, now, final)
    if final:
        state.finish_reason = event.finish_reason
        if state.relay.base:
            migration.restate_usage(event.usage, state.prompt_tokens, event.output_offset + len(event.token_ids))
    event.ClearField("error")
    state.events_sent += 1
    return event


def _stamp(state: RequestState, timings: common_pb2.RequestTimings, now: float, final: bool) -> None:
    """The scheduler's view of the request's timings, over what the worker measured."""
    timings.queue_ms = state.queued_s * 1000
    if state.first_token_at is not None:
        timings.time_to_first_token_ms = (state.first_token_at - state.arrival) * 1000
    if not final:
        return
    timings.prefill_ms = timings.prefill_ms or state.timings.prefill_ms
    timings.kv_transfer_ms = timings.kv_transfer_ms or state.timings.kv_transfer_ms
    if state.first_token_at is not None and not timings.decode_ms:
        timings.decode_ms = (now - state.first_token_at) * 1000
    timings.total_ms = (now - state.arrival) * 1000
