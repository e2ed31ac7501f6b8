"""Outgoing gRPC channels between Tandem's own services: the one place that sets their options.

Every internal client (gateway -> scheduler, scheduler -> workers, worker -> scheduler, prefill ->
decode KV pushes) opens its channel here, so message limits, reconnect backoff and, later,
keepalive and TLS are decided once.
"""

from __future__ import annotations

import grpc

from services.common.grpc_server import MAX_MESSAGE_BYTES

# A restarted peer (the scheduler, a worker) is back on its address within seconds: try to
# reconnect at least every second, not after gRPC's default backoff of up to two minutes.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> tuple[tuple[str, int], ...]:
    return (
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        *RECONNECT_OPTIONS,
    )


def internal_channel(address: str, max_message_bytes: int = MAX_MESSAGE_BYTES) -> grpc.aio.Channel:
    """An asyncio channel to another Tandem service at `address` (host:port)."""
    return grpc.aio.insecure_channel(address, options=channel_options(max_message_bytes))
