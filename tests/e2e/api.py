"""What the e2e tests share besides fixtures: the mesh's settings and reading an SSE body."""

from __future__ import annotations

import json
from typing import Any

from tests.mesh import Mesh
from tests.waiting import DEADLINE_S

API_KEY = "sk-e2e"
MODEL = "SmolLM2-135M-Instruct"
AUTH = {"authorization": f"Bearer {API_KEY}"}
MESH_ENV = {"TANDEM_API_KEYS": API_KEY, "TANDEM_THREADS": "1", "TANDEM_KV_MEMORY": "256MiB"}


def prompt_of(length: int, seed: int) -> list[int]:
    """A prompt of token ids no other test sends (so no prefix-cache hit comes from elsewhere)."""
    return [(seed * 7919 + i * 131) % 40000 + 200 for i in range(length)]


def sse_events(body: bytes) -> list[Any]:
    """The payloads of a whole SSE body, strictly framed as `data: <json>\\n\\n` and ended by
    `data: [DONE]\\n\\n` (returned as the string "[DONE]")."""
    assert body.endswith(b"\n\n"), body[-200:]
    events = []
    for frame in body[:-2].split(b"\n\n"):
        assert frame.startswith(b"data: ") and b"\n" not in frame, frame
        data = frame.removeprefix(b"data: ")
        events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]", events[-3:]
    return events[:-1]


def wait_aborted_and_idle(mesh: Mesh, aborted_before: int) -> None:
    """Wait until the mesh holds no request and no block, then check that it is idle because one more
    request was aborted (client gone, stop string, deadline), not because it ran to its end."""
    mesh.wait_idle(DEADLINE_S)
    assert mesh.scheduler_stats().aborted == aborted_before + 1
