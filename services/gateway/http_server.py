"""uvicorn embedded in the gateway's event loop: the HTTP app served on a socket the gateway binds
(HTTPS when given a certificate), with no signal handlers of its own (the gateway's main owns
SIGTERM/SIGINT), stopped gracefully. It parses and frames HTTP with httptools (C), not h11: at one
token per SSE event, the server's own work to write each event is a third of the stream's cost.
The app is served behind `ServerSend`, which hands the server's own send to SSE bodies (sse.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from services.common.tls import ServerCertificate
from services.gateway.sse import SERVER_SEND


@dataclass(slots=True)
class HttpServer:
    """A running uvicorn server; `port` is the bound one (useful with port 0)."""

    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int

    async def stop(self) -> None:
        """Stop accepting, let running responses finish (the config's graceful timeout), return."""
        self.server.should_exit = True
        await self.task


async def start_http(app: FastAPI, host: str, port: int, grace: float = 5.0,
                     tls: ServerCertificate | None = None) -> HttpServer:
    """Serve `app` on host:port from the running event loop (port 0 picks a free one), over TLS
    with `tls`'s certificate when given.

    The gateway's main owns SIGTERM/SIGINT (grpc_server.run_until_signal), so uvicorn installs
    no signal handlers; stop it with `HttpServer.stop()`.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, reuse_port=False)
    except OSError as exc:
        raise OSError(f"cannot listen on {host}:{port} for HTTP: {exc}; is another process using the port?") from exc
    certificate = {"ssl_certfile": str(tls.cert_file), "ssl_keyfile": str(tls.key_file)} if tls else {}
    config = uvicorn.Config(ServerSend(app), http="httptools", lifespan="off", log_level="warning",
                            timeout_graceful_shutdown=grace, **certificate)
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()
        raise RuntimeError(f"the HTTP server on {host}:{port} stopped while starting")
    return HttpServer(server, task, sock.getsockname()[1])


class ServerSend:
    """The outermost ASGI layer: an HTTP request's scope keeps the server's own `send` under
    sse.SERVER_SEND, for a stream's body to bypass the middleware's send wrappers. Nothing else
    changes: every message still may go through the app's whole stack."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await self.app(scope, receive, send)


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
