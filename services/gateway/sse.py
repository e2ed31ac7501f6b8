"""A streamed HTTP response as server-sent events: one `data: {json}` event per chunk with
something to show, the usage chunk when asked, and the `data: [DONE]` sentinel that ends every
stream, a failed one included (after one error event in the OpenAI error shape). The usage or
error event, the sentinel and the end of the HTTP body go out in one write.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from services.common.errors import TandemError
from services.gateway.choices import ChoiceSet
from services.gateway.http_errors import error_body, error_payload
from services.gateway.openai_responses import ResponseShaper
from services.gateway.output import Chunk

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"


# One encoder for every event: json.dumps with options builds a new encoder per call.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
# Stands for the text in a template; no generated text holds a NUL, and its JSON form is unique.
_MARKER = "\x00text\x00"
_ENCODED_MARKER = _ENCODER.encode(_MARKER).encode()


def event(payload: dict[str, Any]) -> bytes:
    """`data: <compact JSON>` and the blank line that ends the event."""
    return b"data: " + _ENCODER.encode(payload).encode() + b"\n\n"


class TextTemplates:
    """The event of a chunk that is only text (ResponseShaper.only_text), from a template per choice:
    the event the shaper builds for a marker text, split at the marker, with the chunk's text
    encoded into the gap. The same bytes as `event(shaper.chunk(...))`, without building and
    encoding the chunk's JSON each time."""

    def __init__(self, shaper: ResponseShaper) -> None:
        self._shaper = shaper
        self._templates: dict[int, tuple[bytes, bytes]] = {}

    def event(self, index: int, chunk: Chunk) -> bytes | None:
        """The chunk's event; None when it is not only text (the caller builds it from the JSON)."""
        if not self._shaper.only_text(index, chunk):
            return None
        template = self._templates.get(index) or self._template(index, chunk)
        return template[0] + _ENCODER.encode(chunk.text).encode() + template[1]

    def _template(self, index: int, chunk: Chunk) -> tuple[bytes, bytes]:
        payload = self._shaper.chunk(index, dataclasses.replace(chunk, text=_MARKER))
        assert payload is not None, "a chunk with text has a payload"
        before, found, after = event(payload).partition(_ENCODED_MARKER)
        assert found and _ENCODED_MARKER not in after, "the marker stands once for the text"
        self._templates[index] = before, after
        return before, after


# The scope key under which http_server's outermost ASGI layer keeps the HTTP server's own `send`.
SERVER_SEND = "tandem.server_send"


class SseResponse(StreamingResponse):
    """A stream that runs `on_close` however it ends: finished, failed, or the client gone (the
    body is cancelled then, possibly before it was ever started).

    The start message goes through the middleware (it adds the request and trace ids); the body's
    events go straight to the HTTP server's send when the scope carries it (SERVER_SEND), past the
    middleware's send wrappers, which act on the start message alone: one event a token makes
    that path a part of each event's cost. A chunk that ends with the [DONE] sentinel (events()
    makes it the last) ends the body in the same write. The client leaving is watched beside the
    body, as Starlette's StreamingResponse does, without its task group."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type=MEDIA_TYPE, headers={"cache-control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            streaming = asyncio.ensure_future(self._stream(send, scope.get(SERVER_SEND, send)))
            leaving = asyncio.ensure_future(_disconnect(receive))
            try:
                await asyncio.wait((streaming, leaving), return_when=asyncio.FIRST_COMPLETED)
            finally:
                streaming.cancel()
                leaving.cancel()
            if streaming.done() and not streaming.cancelled():
                streaming.result()  # the body's own failure
        finally:
            self._on_close()

    async def _stream(self, send: Send, body_send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            ended = False
            async for chunk in self.body_iterator:
                ended = chunk.endswith(DONE)  # the sentinel, always last, ends the body in its own write
                await body_send({"type": "http.response.body", "body": chunk, "more_body": not ended})
            if not ended:
                await body_send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            raise ClientDisconnect() from None  # as Starlette's: the client is gone


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def events(shaper: ResponseShaper, choices: ChoiceSet, n: int, include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE body: the opening chunks, one event per chunk with something to show, the usage
    chunk when asked, then [DONE]; a failure becomes one error event before [DONE]."""
    for payload in shaper.opening_chunks(n):
        yield event(payload)
    usages = {}
    templates = TextTemplates(shaper)
    try:
        async for index, chunk in choices.chunks():
            if (text_event := templates.event(index, chunk)) is not None:
                yield text_event
                continue
            if chunk.usage is not None:
                usages[index] = chunk.usage
            payload = shaper.chunk(index, chunk)
            if payload is not None:
                yield event(payload)
        tail = event(shaper.usage_chunk([usages[index] for index in sorted(usages)])) if include_usage else b""
    except TandemError as error:
        tail = event(error_payload(error)[1])
    except Exception:
        log.exception("stream of %s failed", shaper.response_id)
        tail = event(error_body(500, "internal error while streaming; see the gateway's log", None, "internal_error"))
    yield tail + DONE
