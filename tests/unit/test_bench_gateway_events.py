"""bench/gateway_events.py runs the real per-event path: each stream's HTTP body is the exact SSE
stream of its tokens (one chunk of text per token, the finish reason on the last, then [DONE],
chunked as uvicorn frames it), and the figures are per event."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import uvloop

from bench import gateway_events
from services.common.tokenizer import TextCodec


@pytest.fixture(scope="module")
def codec(default_model_dir: Path) -> TextCodec:
    return TextCodec.from_model_dir(default_model_dir)


def unchunk(body: bytes) -> bytes:
    """The payload of a chunked HTTP body; asserts it ends with the last chunk."""
    payload, rest = b"", body
    while True:
        size, _, rest = rest.partition(b"\r\n")
        length = int(size, 16)
        if length == 0:
            assert rest == b"\r\n"
            return payload
        payload += rest[:length]
        assert rest[length:length + 2] == b"\r\n"
        rest = rest[length + 2:]


def test_each_stream_is_the_sse_stream_of_its_tokens(codec: TextCodec) -> None:
    tokens = 5
    result = uvloop.run(gateway_events.run(codec, 3, tokens, 2))
    token_ids = codec.encode(gateway_events.TEXT * (tokens // 16 + 1))[:tokens]
    texts = [codec.decode([token_id]) for token_id in token_ids]
    assert len(result.bodies) == 3
    for body in result.bodies:
        events = unchunk(body).split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""]
        chunks = [json.loads(event.removeprefix(b"data: ")) for event in events[:-2]]
        assert [chunk["choices"][0]["text"] for chunk in chunks] == texts
        assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None] * (tokens - 1) + ["length"]
        assert {chunk["id"] for chunk in chunks} == {"cmpl-bench"}
    assert (result.streams, result.tokens, result.rounds) == (3, tokens, 2)
    assert 0 < result.best_us_per_event <= result.median_us_per_event
