"""Outgoing gRPC channels between Tandem's own services: the one place that sets their options.

Every internal client (gateway -> scheduler, scheduler -> workers, worker -> scheduler, prefill ->
decode KV pushes) opens its channel here, so message limits, reconnect backoff, keepalive and mutual
TLS are decided once.
"""

from __future__ import annotations

import grpc

from services.common.grpc_server import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, MAX_MESSAGE_BYTES
from services.common.tls import MutualTLS

# A restarted peer (the scheduler, a worker) is back on its address within seconds: try to
# reconnect at least every second, not after gRPC's default backoff of up to two minutes.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
# Ping as grpc_server.py says servers accept: a silent connection every KEEPALIVE_TIME_MS, idle ones
# too (a worker's channel to the scheduler may carry no call for a while), without a cap on pings.
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> tuple[tuple[str, int | str], ...]:
    return (
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        *RECONNECT_OPTIONS,
        *KEEPALIVE_OPTIONS,
    )


def internal_channel(address: str, tls: MutualTLS | None = None,
                     max_message_bytes: int = MAX_MESSAGE_BYTES) -> grpc.aio.Channel:
    """An asyncio channel to another Tandem service at `address` (host:port), over mutual TLS when
    `tls` is given (the internal plane's; see services.common.internal_auth)."""
    options = channel_options(max_message_bytes)
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    if tls.server_name:
        options += (("grpc.ssl_target_name_override", tls.server_name),)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
