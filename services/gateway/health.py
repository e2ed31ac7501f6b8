"""The gateway's health: SERVING (gRPC health, and 200 on GET /health) while any of its schedulers
(replicas) answers SERVING and its Stats list a live worker set that can take this model's requests (a colocated
worker, or a prefill and a decode worker, as the scheduler's planner requires); NOT_SERVING (503
with Retry-After) otherwise, and SERVING again as soon as one can.

Polled in the background, every call bounded by CHECK_TIMEOUT_S: every CHECK_INTERVAL_S while
serving, every RETRY_INTERVAL_S while not, so a recovery shows quickly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc
from fastapi import FastAPI
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import INTERNAL_TOKEN_KEY, GrpcServer
from services.gateway import http_app
from tandem.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 2.0
RETRY_INTERVAL_S = 0.2
CHECK_TIMEOUT_S = 1.0


def can_serve(stats: scheduler_pb2.SchedulerStats, model: str) -> bool:
    """Whether the live workers of `stats` can take a request for `model` (any model when empty)."""
    roles = {worker.info.role for worker in stats.workers if not model or worker.info.model == model}
    return common_pb2.WORKER_ROLE_COLOCATED in roles or {common_pb2.WORKER_ROLE_PREFILL,
                                                         common_pb2.WORKER_ROLE_DECODE} <= roles


class SchedulerProbe:
    """One health check of the scheduler behind the gateway: `ready()` is True only while it
    answers SERVING and has workers for the model; an unreachable or slow scheduler is not ready."""

    def __init__(self, channel: grpc.aio.Channel, model: str = "", internal_token: str | None = None) -> None:
        self._health = health_pb2_grpc.HealthStub(channel)
        self._scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        self._model = model
        self._metadata = ((INTERNAL_TOKEN_KEY, internal_token),) if internal_token else ()

    async def ready(self) -> bool:
        try:
            answer = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=CHECK_TIMEOUT_S)
            if answer.status != health_pb2.HealthCheckResponse.SERVING:
                return False
            stats = await self._scheduler.Stats(scheduler_pb2.SchedulerStatsRequest(), timeout=CHECK_TIMEOUT_S,
                                                metadata=self._metadata)
        except grpc.aio.AioRpcError:
            return False
        return can_serve(stats, self._model)


async def follow_scheduler_health(channels: Sequence[grpc.aio.Channel], server: GrpcServer,
                                  http: FastAPI | None = None, *, model: str = "",
                                  internal_token: str | None = None) -> None:
    """Keep the gateway's health (and the HTTP app's /health, when given) equal to whether any of
    the schedulers (one channel each) can serve `model` now; runs until cancelled."""
    probes = [SchedulerProbe(channel, model, internal_token) for channel in channels]
    serving = False
    while True:
        up = any(await asyncio.gather(*(probe.ready() for probe in probes)))
        if up != serving:
            await (server.mark_serving() if up else server.mark_not_serving())
            if http is not None:
                http_app.set_serving(http, up)
            log.info("scheduler %s: gateway now %s", "can serve" if up else "cannot serve",
                     "SERVING" if up else "NOT_SERVING")
            serving = up
        await asyncio.sleep(CHECK_INTERVAL_S if serving else RETRY_INTERVAL_S)
