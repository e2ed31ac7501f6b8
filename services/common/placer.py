"""Which scheduler replica placed a request, as the worker hears it.

A scheduler names itself on every call it makes to a worker for a request (the Assign stream,
Reserve, Prefill) in the PLACER_KEY metadata, with the id its RegisterWorker answers carry
(RegisterWorkerResponse.scheduler_id). The worker reports the request's first and final events to
that replica alone: no other replica holds the request, so the same events sent to every replica
cost each one the whole cluster's traffic. A request whose call names no scheduler (an older one,
a test's direct call) or one the worker knows by no registration is reported to every replica.
"""

from __future__ import annotations

from collections.abc import Iterable

PLACER_KEY = "x-tandem-scheduler-id"


def placer_metadata(scheduler_id: str) -> tuple[tuple[str, str], ...]:
    """The metadata pair naming the scheduler on a call; none for an unnamed one."""
    return ((PLACER_KEY, scheduler_id),) if scheduler_id else ()


def placer_of(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The scheduler id a call's metadata names; "" when it names none."""
    for key, value in metadata or ():
        if key == PLACER_KEY and isinstance(value, str):
            return value
    return ""
