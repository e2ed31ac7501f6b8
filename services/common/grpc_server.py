"""grpc.aio server bootstrap shared by every service: health (NOT_SERVING until marked), reflection,
auth (credentials read as auth.py says) and error-mapping interceptors, keepalive, TLS when given,
graceful shutdown on SIGTERM/SIGINT, and the helpers that pass the remaining deadline and the trace
context on to downstream calls.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import AsyncIterator, Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.auth import API_KEY_HEADERS, presented_secret, secret_matches
from services.common.errors import DeadlineExceeded, InvalidRequest, TandemError, grpc_status

log = logging.getLogger(__name__)

INTERNAL_TOKEN_KEY = "x-tandem-internal-token"
TRACE_METADATA_KEYS = ("traceparent", "tracestate", "baggage")
# Message limits, by what a server receives. A KV chunk (the decode worker's KvTransferService) is
# the largest message any Tandem peer sends; internal control calls carry token ids and stats; the
# gateway's public door takes prompts, and nothing a client sends it needs more.
MAX_MESSAGE_BYTES = 64 << 20
CONTROL_MESSAGE_BYTES = 16 << 20
PUBLIC_MESSAGE_BYTES = 4 << 20
# Keepalive (README "Connections"): a side whose connection has been silent for KEEPALIVE_TIME_MS pings
# the peer and drops the connection when no answer comes within KEEPALIVE_TIMEOUT_MS. The pings keep
# long streams alive through NATs and load balancers that drop idle flows (often after 60 s or more),
# and a dead or frozen peer is noticed within 30 s instead of at the OS's TCP timeout (hours).
# Internal channels (services/common/channels.py) and the SDK ping as often; servers accept pings
# down to MIN_PING_INTERVAL_MS apart, with or without calls, and answer faster ones with GOAWAY.
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000
MIN_PING_INTERVAL_MS = 10_000
SERVER_KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_pings_without_data", 0),
)
# Probes and tooling must work without credentials.
_OPEN_SERVICES = (health.SERVICE_NAME, reflection.SERVICE_NAME)

Behavior = Callable[..., Any]


def _replace_behavior(handler: grpc.RpcMethodHandler, wrap: Callable[[Behavior, bool], Behavior],
                      deserializer: Callable[[bytes], Any] | None = None):
    """A copy of handler whose behaviour is wrap(behaviour, response_streaming) (and whose request
    deserializer is `deserializer`, when given)."""
    kinds = (
        ("unary_unary", grpc.unary_unary_rpc_method_handler, False),
        ("unary_stream", grpc.unary_stream_rpc_method_handler, True),
        ("stream_unary", grpc.stream_unary_rpc_method_handler, False),
        ("stream_stream", grpc.stream_stream_rpc_method_handler, True),
    )
    for attr, factory, streaming in kinds:
        behavior = getattr(handler, attr)
        if behavior is not None:
            return factory(wrap(behavior, streaming), deserializer or handler.request_deserializer,
                           handler.response_serializer)
    raise ValueError(f"handler {handler!r} has no behaviour")


def _service_of(method: str) -> str:
    """'/tandem.v1.GenerateService/Generate' -> 'tandem.v1.GenerateService'."""
    return method.lstrip("/").split("/", 1)[0]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls that present none of the accepted secrets with UNAUTHENTICATED.

    A secret is read from the first of `headers` present in the call's metadata; `authorization`
    must use the Bearer scheme. Health and reflection stay open.
    """

    def __init__(self, secrets: Collection[str], headers: Iterable[str] = API_KEY_HEADERS) -> None:
        if not secrets:
            raise ValueError("AuthInterceptor needs at least one secret; leave it out to disable auth")
        self._secrets = tuple(s.encode() for s in secrets)
        self._headers = tuple(headers)

    def _presented(self, metadata: Iterable[tuple[str, Any]]) -> str | None:
        values = {key: value for key, value in metadata or () if isinstance(value, str)}
        return presented_secret(values.get, self._headers)

    def _accepts(self, presented: str | None) -> bool:
        return presented is not None and secret_matches(presented, self._secrets)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or _service_of(handler_call_details.method) in _OPEN_SERVICES:
            return handler
        presented = self._presented(handler_call_details.invocation_metadata)
        if self._accepts(presented):
            return handler
        reason = "missing credentials" if presented is None else "invalid credentials"
        header = self._headers[0]
        expected = "authorization: Bearer <key>" if header == "authorization" else f"{header}: <token>"
        message = f"{reason}: send `{expected}` metadata with a configured key"
        return _replace_behavior(handler, lambda _behavior, _streaming: _deny(message))


def _deny(message: str) -> Behavior:
    async def deny(_request, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return deny


async def _abort_with(context: grpc.aio.ServicerContext, error: TandemError) -> None:
    """Abort with the error's status; its trailing metadata go after those the handler set."""
    log.debug("request failed: %s: %s", type(error).__name__, error.message)
    trailing = (*(context.trailing_metadata() or ()), *error.trailing_metadata())
    await context.abort(grpc_status(error), error.message, trailing_metadata=trailing)


@dataclass(frozen=True, slots=True)
class _Undecodable:
    """A request message whose bytes did not parse: the call is refused with INVALID_ARGUMENT."""

    problem: str


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """The handler's deserializer, returning _Undecodable instead of raising: grpc answers a
    deserializer's exception with UNKNOWN, a server fault, where the client sent bad bytes."""
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return _Undecodable(str(exc))

    return deserialize


def _decoded(request: Any) -> Any:
    if isinstance(request, _Undecodable):
        raise InvalidRequest("request", f"{request.problem}; send a serialized message of the method's request type")
    return request


async def _each_decoded(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _decoded(request)


def _map_errors(behavior: Behavior, streaming: bool, requests: Callable[[Any], Any] = _decoded) -> Behavior:
    """Wrap a servicer method so TandemErrors become their gRPC status (their `kind`);
    `requests` checks the request (or the stream of them) before the method sees it."""
    if not streaming:

        async def unary_response(request, context):
            try:
                result = behavior(requests(request), context)
                return await result if inspect.isawaitable(result) else result
            except TandemError as error:
                await _abort_with(context, error)

        return unary_response

    async def stream_response(request, context):
        try:
            result = behavior(requests(request), context)
            if inspect.isawaitable(result):  # a servicer that writes with context.write()
                await result
                return
            async for response in result:
                yield response
        except TandemError as error:
            await _abort_with(context, error)

    return stream_response


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps domain exceptions (services.common.errors) to status codes, for every handler kind, and
    refuses request bytes that do not parse with INVALID_ARGUMENT."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        requests = _each_decoded if handler.request_streaming else _decoded
        return _replace_behavior(handler, lambda behavior, streaming: _map_errors(behavior, streaming, requests),
                                 _tolerant(handler.request_deserializer))


class GrpcServer:
    """A grpc.aio server with health and reflection. Call order: add_service(...), start(),
    mark_serving() once ready (the model loaded), then run_until_signal() or stop()."""

    def __init__(self, server: grpc.aio.Server, port: int) -> None:
        self.server = server
        self.port = port
        self.health = health.aio.HealthServicer()
        self._services: list[str] = []
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)

    def add_service(self, name: str, register: Callable[[Any, grpc.aio.Server], None], servicer: Any) -> None:
        """Add a servicer, e.g. add_service("tandem.v1.GenerateService", add_GenerateServiceServicer_to_server, s)."""
        register(servicer, self.server)
        self._services.append(name)

    async def start(self) -> None:
        """Start serving; health reports NOT_SERVING for the server and each service until mark_serving()."""
        for name in ("", *self._services):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        names = (*self._services, *_OPEN_SERVICES)
        reflection.enable_server_reflection(names, self.server)
        await self.server.start()

    async def mark_serving(self) -> None:
        for name in ("", *self._services):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def mark_not_serving(self) -> None:
        for name in ("", *self._services):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float = 5.0) -> None:
        """Report NOT_SERVING for good, refuse new calls, and give running ones `grace` seconds."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    async def run_until_signal(self, grace: float = 5.0) -> None:
        """Serve until SIGTERM or SIGINT (or the server terminates), then stop gracefully."""
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        signals = (signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            loop.add_signal_handler(sig, stopping.set)
        signalled = asyncio.ensure_future(stopping.wait())
        # Never cancel this one: with grpcio 1.85 that also cancels the shutdown below.
        terminated = asyncio.ensure_future(self.server.wait_for_termination())
        try:
            await asyncio.wait([signalled, terminated], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
            signalled.cancel()
        log.info("stopping gRPC server on port %d (grace %.1f s)", self.port, grace)
        await self.stop(grace)
        await terminated


def create_server(
    host: str,
    port: int,
    *,
    api_keys: Collection[str] = (),
    internal_token: str | None = None,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    max_receive_bytes: int = CONTROL_MESSAGE_BYTES,
    max_send_bytes: int = MAX_MESSAGE_BYTES,
    credentials: grpc.ServerCredentials | None = None,
) -> GrpcServer:
    """Create (not start) a server bound to host:port (port 0 picks a free one; see .port).

    api_keys: the gateway's client keys (`authorization: Bearer KEY` or `x-api-key`); empty = no auth.
    internal_token: the shared secret of internal services (`x-tandem-internal-token`); None = no auth
    (services decide that with services.common.internal_auth, which refuses None unless told).
    max_receive_bytes / max_send_bytes: the largest message taken / sent; a bigger one fails the call
    with RESOURCE_EXHAUSTED.
    credentials: TLS (services.common.tls: a public door's certificate, or mutual TLS); None = plaintext.
    Interceptor order: auth, then caller-supplied ones (tracing), then error mapping (innermost).
    """
    chain: list[grpc.aio.ServerInterceptor] = []
    if api_keys:
        chain.append(AuthInterceptor(api_keys))
    if internal_token:
        chain.append(AuthInterceptor([internal_token], headers=(INTERNAL_TOKEN_KEY,)))
    chain += [*interceptors, ErrorInterceptor()]
    options = [
        ("grpc.max_send_message_length", max_send_bytes),
        ("grpc.max_receive_message_length", max_receive_bytes),
        # Without this a second server on a busy port binds silently and steals half the calls.
        ("grpc.so_reuseport", 0),
        *SERVER_KEEPALIVE_OPTIONS,
    ]
    server = grpc.aio.server(interceptors=chain, options=options)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = (server.add_insecure_port(address) if credentials is None
                 else server.add_secure_port(address, credentials))
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {address}: {exc}; is another process using the port?") from exc
    return GrpcServer(server, bound)


def remaining_timeout(context: grpc.aio.ServicerContext, default: float | None = None) -> float | None:
    """Seconds left of the incoming call's deadline, to pass as `timeout=` downstream.

    Returns `default` when the caller set no deadline; raises DeadlineExceeded when it already passed.
    """
    remaining = context.time_remaining()
    if remaining is None:
        return default
    if remaining <= 0:
        raise DeadlineExceeded("the request's deadline passed before it reached this service")
    return remaining


def propagated_metadata(
    context: grpc.aio.ServicerContext | None, internal_token: str | None = None
) -> tuple[tuple[str, str], ...]:
    """Metadata for a downstream call: the incoming W3C trace context, plus the internal token."""
    incoming = context.invocation_metadata() if context is not None else None
    pairs = [(key, value) for key, value in incoming or () if key in TRACE_METADATA_KEYS]
    if internal_token:
        pairs.append((INTERNAL_TOKEN_KEY, internal_token))
    return tuple(pairs)
