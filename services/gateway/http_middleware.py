"""The HTTP bridge's ASGI middleware: request and trace ids on every request and response."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.request import REQUEST_ID_HEADER, TRACE_ID_HEADER
from services.gateway.validation import request_id_or_new


class RequestIds:
    """Every request gets an id (the caller's `x-request-id` when it is a valid request id, else a
    new one) in `request.state.request_id`; every response carries it, and `x-trace-id` once a
    handler has set `request.state.trace_id`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        incoming = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        state["request_id"] = request_id_or_new(incoming)

        async def send_with_ids(message: Message) -> None:
            if message["type"] == "http.response.start":
                ids = [(REQUEST_ID_HEADER, state["request_id"]), (TRACE_ID_HEADER, state.get("trace_id"))]
                extra = [(name.encode(), value.encode()) for name, value in ids if value]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_ids)
