"""A streamed HTTP response as server-sent events: one `data: {json}` event per chunk with
something to show, the usage chunk when asked, and the `data: [DONE]` sentinel that ends every
stream, a failed one included (after one error event in the OpenAI error shape).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.common.errors import TandemError
from services.gateway.choices import ChoiceSet
from services.gateway.http_errors import error_body, error_payload
from services.gateway.openai_responses import ResponseShaper

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"


# One encoder for every event: json.dumps with options builds a new encoder per call.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def event(payload: dict[str, Any]) -> bytes:
    """`data: <compact JSON>` and the blank line that ends the event."""
    return b"data: " + _ENCODER.encode(payload).encode() + b"\n\n"


class SseResponse(StreamingResponse):
    """A stream that runs `on_close` however it ends: finished, failed, or the client gone
    (Starlette cancels the body then, possibly before it was ever started)."""

    def __init__(self, content: Any, on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type=MEDIA_TYPE, headers={"cache-control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def events(shaper: ResponseShaper, choices: ChoiceSet, n: int, include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE body: the opening chunks, one event per chunk with something to show, the usage
    chunk when asked, then [DONE]; a failure becomes one error event before [DONE]."""
    for payload in shaper.opening_chunks(n):
        yield event(payload)
    usages = {}
    try:
        async for index, chunk in choices.chunks():
            if chunk.usage is not None:
                usages[index] = chunk.usage
            payload = shaper.chunk(index, chunk)
            if payload is not None:
                yield event(payload)
        if include_usage:
            yield event(shaper.usage_chunk([usages[index] for index in sorted(usages)]))
    except TandemError as error:
        yield event(error_payload(error)[1])
    except Exception:
        log.exception("stream of %s failed", shaper.response_id)
        yield event(error_body(500, "internal error while streaming; see the gateway's log", None, "internal_error"))
    yield DONE
