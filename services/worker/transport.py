"""Outgoing gRPC channels of a worker: to the scheduler and to decode workers (KV pushes), with
message limits that fit KV chunks, the internal token every call carries and mutual TLS when set.
"""

from __future__ import annotations

import grpc

from services.common.channels import internal_channel
from services.common.grpc_server import INTERNAL_TOKEN_KEY
from services.common.tls import MutualTLS


def internal_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata pairs that authenticate an internal call (none when no token is configured)."""
    return ((INTERNAL_TOKEN_KEY, token),) if token else ()


def open_channel(address: str, tls: MutualTLS | None = None) -> grpc.aio.Channel:
    return internal_channel(address, tls)


class ChannelPool:
    """One channel per peer address, opened on first use and shared by all calls to it."""

    def __init__(self, token: str | None = None, tls: MutualTLS | None = None) -> None:
        self.metadata = internal_metadata(token)
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(address, self._tls)
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
