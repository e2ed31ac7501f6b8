"""Outgoing gRPC channels of a worker: to the scheduler and to decode workers (KV pushes), with
message limits that fit KV chunks and the internal token every call carries.
"""

from __future__ import annotations

import grpc

from services.common.grpc_server import INTERNAL_TOKEN_KEY, MAX_MESSAGE_BYTES

CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A restarted peer (the scheduler, a decode worker) is back on its address within seconds: try
    # to reconnect at least every second, not after gRPC's default backoff of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def internal_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata pairs that authenticate an internal call (none when no token is configured)."""
    return ((INTERNAL_TOKEN_KEY, token),) if token else ()


def open_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


class ChannelPool:
    """One channel per peer address, opened on first use and shared by all calls to it."""

    def __init__(self, token: str | None = None) -> None:
        self.metadata = internal_metadata(token)
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(address)
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
