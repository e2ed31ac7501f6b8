"""Server-sent events framing of the streaming HTTP API: one `data: {json}` event per chunk and
the `data: [DONE]` sentinel that ends every stream, an aborted one included."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"


def event(payload: dict[str, Any]) -> bytes:
    """`data: <compact JSON>` and the blank line that ends the event."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
