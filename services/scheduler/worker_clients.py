"""Outgoing calls to workers: one grpc.aio channel per worker address, kept open with its stubs (a
stub builds a callable per method: built once, not per call) and, for a colocated or hybrid decode
worker, its Assign stream (assign_stream.py); the metadata (W3C trace context of the request's span,
internal token, this scheduler's id: services/common/placer.py) every call carries, over mutual TLS when set."""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

import grpc
from opentelemetry import trace

from services.common.channels import internal_channel
from services.common.grpc_server import INTERNAL_TOKEN_KEY
from services.common.placer import placer_metadata
from services.common.tls import MutualTLS
from services.common.tracing import inject_metadata
from services.scheduler.assign_stream import AssignStream
from tandem.v1 import worker_pb2_grpc

Stub = TypeVar("Stub")


class WorkerClients:
    def __init__(self, internal_token: str | None = None, tls: MutualTLS | None = None,
                 scheduler_id: str = "") -> None:
        """`scheduler_id`: named on every call, so a worker reports the requests placed here to this replica."""
        self._internal_token = internal_token
        self._placer = placer_metadata(scheduler_id)
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[tuple[type, str], Any] = {}  # (stub class, address) -> stub on that address's channel
        self._assign: dict[str, AssignStream] = {}

    def prefill(self, address: str) -> worker_pb2_grpc.PrefillServiceStub:
        return self._stub(worker_pb2_grpc.PrefillServiceStub, address)

    def decode(self, address: str) -> worker_pb2_grpc.DecodeServiceStub:
        return self._stub(worker_pb2_grpc.DecodeServiceStub, address)

    def colocated(self, address: str) -> worker_pb2_grpc.ColocatedServiceStub:
        return self._stub(worker_pb2_grpc.ColocatedServiceStub, address)

    def assign(self, address: str) -> AssignStream:
        """The Assign stream to the colocated (or hybrid decode) worker at `address`."""
        stream = self._assign.get(address)
        if stream is None:
            token = ((INTERNAL_TOKEN_KEY, self._internal_token),) if self._internal_token else ()
            stream = self._assign[address] = AssignStream(self.colocated(address), token + self._placer)
        return stream

    def models(self, address: str) -> worker_pb2_grpc.ModelServiceStub:
        return self._stub(worker_pb2_grpc.ModelServiceStub, address)

    def metadata(self, span: trace.Span) -> tuple[tuple[str, str], ...]:
        """For a call made on behalf of the request whose span is `span` (its child on the worker)."""
        pairs = trace_context(span)
        if self._internal_token:
            pairs.append((INTERNAL_TOKEN_KEY, self._internal_token))
        return (*pairs, *self._placer)

    def leaving(self, address: str) -> None:
        """A worker is leaving (it deregistered): end its Assign stream once its answers are out, so
        its shutdown does not wait for the call."""
        stream = self._assign.pop(address, None)
        if stream is not None:
            stream.half_close()

    async def forget(self, address: str) -> None:
        """Close the channel to a lost worker, so a worker restarted there gets a fresh connection."""
        stream = self._assign.pop(address, None)
        if stream is not None:
            stream.close()
        channel = self._channels.pop(address, None)
        self._stubs = {key: stub for key, stub in self._stubs.items() if key[1] != address}
        if channel is not None:
            await channel.close(grace=None)

    async def close(self) -> None:
        for stream in self._assign.values():
            stream.close()
        channels, self._channels, self._assign = list(self._channels.values()), {}, {}
        self._stubs = {}
        await asyncio.gather(*(channel.close(grace=None) for channel in channels))

    def _stub(self, kind: type[Stub], address: str) -> Stub:
        stub = self._stubs.get((kind, address))
        if stub is None:
            stub = self._stubs[(kind, address)] = kind(self._channel(address))
        return stub

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = internal_channel(address, self._tls)
        return channel


def trace_context(span: trace.Span) -> list[tuple[str, str]]:
    """The W3C trace context of the request whose span is `span`, as call metadata pairs."""
    return inject_metadata(trace.set_span_in_context(span))
