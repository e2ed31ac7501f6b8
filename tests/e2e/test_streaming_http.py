"""The streaming HTTP API byte by byte (httpx): SSE framing, `[DONE]`, the usage chunk, request
and trace id headers; stop strings spanning tokens and multi-byte characters split across
tokens, streamed and not; and a client that leaves mid-stream, whose blocks free within 1 s.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import tandem
from services.common.model_store import DEFAULT_MODEL_NAME
from services.common.spans import gateway_span_name
from services.common.tokenizer import TextCodec
from tests.e2e.api import API_KEY, AUTH, prompt_of, sse_events, wait_aborted_and_idle
from tests.waiting import DEADLINE_S, wait_until

TRACE_ID = re.compile(r"[0-9a-f]{32}")
FRANCE = "The capital of France is"
KOREAN = "한국어 한국어 한국어 한국어"
EMOJI = "Emoji: 🎉🎉🎉🎉🎉🎉"
TRANSLATE = "Translate to Korean: Hello = 안녕하세요, Thank you ="


@pytest.fixture(scope="module")
def codec(default_model_dir) -> TextCodec:
    return TextCodec.from_model_dir(default_model_dir)


@pytest.fixture(scope="module")
def sdk(mesh) -> Iterator[tandem.Client]:
    with tandem.Client(mesh.endpoint("gateway").address, api_key=API_KEY) as opened:
        yield opened


def stream_text(http, body: dict) -> tuple[str, list[dict]]:
    """(the streamed text of choice 0 joined, the events) of a streaming /v1/completions call."""
    response = http.post("/v1/completions", json={**body, "stream": True})
    assert response.status_code == 200, response.text
    events = sse_events(response.content)
    return "".join(e["choices"][0]["text"] for e in events if e["choices"]), events


def test_sse_framing_done_usage_chunk_and_id_headers(http):
    body = {"prompt": FRANCE, "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    response = http.post("/v1/completions", json=body, headers={"x-request-id": "e2e-sse-1"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-request-id"] == "e2e-sse-1"
    assert TRACE_ID.fullmatch(response.headers["x-trace-id"])
    events = sse_events(response.content)
    *chunks, usage = events
    assert {e["id"] for e in events} == {"cmpl-e2e-sse-1"}
    assert all(e["object"] == "text_completion" and len(e["choices"]) == 1 for e in chunks)
    assert [e["choices"][0]["finish_reason"] for e in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert usage["usage"]["prompt_tokens"] == 5 and usage["usage"]["total_tokens"] == 17

    whole = http.post("/v1/completions", json={**body, "stream": False})
    assert "".join(e["choices"][0]["text"] for e in chunks) == whole.json()["choices"][0]["text"]
    assert whole.headers["x-request-id"].startswith("req-") and TRACE_ID.fullmatch(whole.headers["x-trace-id"])
    assert whole.headers["x-trace-id"] != response.headers["x-trace-id"]


def whole_trace(run_dir: Path, request_id: str) -> dict:
    """`tandem trace REQUEST_ID --format json` once every span of the request is written: `--wait`
    polls the span files until no started span lacks its record."""
    command = [sys.executable, "-m", "tandem.cli", "trace", request_id, "--format", "json", "--wait", str(DEADLINE_S)]
    shown = subprocess.run(command, env={**os.environ, "TANDEM_RUN_DIR": str(run_dir)}, capture_output=True,
                           text=True, timeout=DEADLINE_S + 60)
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def test_the_request_id_header_finds_the_trace_of_the_trace_id_header(http, mesh_run_dir):
    response = http.post("/v1/completions", json={"prompt": FRANCE, "max_tokens": 3},
                         headers={"x-request-id": "e2e-trace-1"})
    trace = whole_trace(mesh_run_dir, "e2e-trace-1")
    (span,) = trace["spans"]  # one root
    assert (span["name"], span["trace_id"], span["attributes"]["tandem.request_id"]) == (
        gateway_span_name("text_completion", DEFAULT_MODEL_NAME), response.headers["x-trace-id"], "e2e-trace-1")
    assert {child["name"] for child in span["children"]} == {"scheduler.submit"}


def test_chat_sse_opens_with_the_role_and_ends_with_done(http):
    body = {"messages": [{"role": "user", "content": "Say hi in French."}], "max_tokens": 8, "temperature": 0,
            "stream": True}
    response = http.post("/v1/chat/completions", json=body)
    events = sse_events(response.content)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" and "usage" not in e for e in events)
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    whole = http.post("/v1/chat/completions", json={**body, "stream": False}).json()
    assert streamed == whole["choices"][0]["message"]["content"] and streamed


def tokens_until(codec: TextCodec, token_ids: list[int], stop: str) -> int:
    """How many tokens the output had when `stop` first appeared in its text."""
    return next(m for m in range(1, len(token_ids) + 1) if stop in codec.decode(token_ids[:m]))


STOPS = [
    (FRANCE, 16, "s.", False),  # " Paris" + "."
    (FRANCE, 16, ".\n\nThe a", False),  # five tokens
    (FRANCE, 16, "\n\nThe", True),
    (KOREAN, 30, "국", False),  # one character, three byte-tokens
    (KOREAN, 30, "어 한국", True),
    (EMOJI, 30, "🎉🎉🎉", True),
]


@pytest.mark.parametrize("prompt, max_tokens, stop, include", STOPS, ids=[repr(s[2]) for s in STOPS])
def test_stop_string_spanning_tokens_cuts_exactly_streamed_or_not(http, sdk, codec, prompt, max_tokens, stop,
                                                                   include):
    full = sdk.complete(prompt, max_tokens=max_tokens, temperature=0)
    needed = tokens_until(codec, full.token_ids, stop)
    assert stop not in codec.decode(full.token_ids[needed - 1:needed]), "the stop string must span tokens"
    cut = full.text.index(stop) + (len(stop) if include else 0)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stop": [stop],
            "include_stop_str_in_output": include}

    whole = http.post("/v1/completions", json=body).json()
    assert whole["choices"][0]["text"] == full.text[:cut]
    assert (whole["choices"][0]["finish_reason"], whole["choices"][0]["stop_reason"]) == ("stop", stop)
    assert whole["usage"]["completion_tokens"] == needed

    streamed, events = stream_text(http, body)
    assert streamed == full.text[:cut]
    assert (events[-1]["choices"][0]["finish_reason"], events[-1]["choices"][0]["stop_reason"]) == ("stop", stop)


def test_a_stop_string_aborts_the_request_upstream(http, mesh):
    body = {"prompt": prompt_of(30, 3), "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    first_tokens = http.post("/v1/completions", json={**body, "max_tokens": 6}).json()["choices"][0]["text"]
    stop = first_tokens[-3:]
    aborted = mesh.scheduler_stats().aborted
    response = http.post("/v1/completions", json={**body, "stop": stop}).json()
    assert response["choices"][0]["finish_reason"] == "stop" and response["usage"]["completion_tokens"] <= 6
    wait_aborted_and_idle(mesh, aborted)  # the stop string cancelled the other 394 tokens


@pytest.mark.parametrize("prompt, max_tokens", [(KOREAN, 30), (EMOJI, 30), (TRANSLATE, 30)],
                         ids=["korean", "emoji", "cut-mid-character"])
def test_multibyte_characters_split_across_tokens_stream_whole(http, sdk, codec, prompt, max_tokens):
    full = sdk.complete(prompt, max_tokens=max_tokens, temperature=0)
    assert full.text == codec.decode(full.token_ids)
    assert len(full.token_ids) == max_tokens > len(full.text), "characters must span several tokens"
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    with ThreadPoolExecutor(3) as pool:  # batched together on the workers
        whole = pool.submit(http.post, "/v1/completions", json=body)
        streamed = pool.submit(stream_text, http, body)
        sdk_chunks = pool.submit(lambda: list(sdk.generate(prompt, max_tokens=max_tokens, temperature=0)))
    assert whole.result().json()["choices"][0]["text"] == full.text
    text, events = streamed.result()
    assert text == full.text
    deltas = [e["choices"][0]["text"] for e in events]
    # a delta never carries part of a character: only the very end of a cut output may be a U+FFFD
    assert all("\ufffd" not in delta for delta in deltas[:-1])
    assert deltas[-1].count("\ufffd") == full.text.count("\ufffd") <= 1
    assert "".join(chunk.text for chunk in sdk_chunks.result()) == full.text


def test_client_disconnect_mid_stream_frees_the_blocks(http, mesh):
    body = {"prompt": prompt_of(40, 4), "max_tokens": 500, "ignore_eos": True, "stream": True}
    aborted = mesh.scheduler_stats().aborted
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: {")
        assert mesh.worker_stats("decode-0").referenced_blocks > 0
    wait_aborted_and_idle(mesh, aborted)


def test_client_disconnect_mid_stream_frees_the_blocks_of_every_choice(http, mesh):
    body = {"prompt": prompt_of(40, 6), "max_tokens": 500, "ignore_eos": True, "stream": True, "n": 2, "seed": 1}
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = (line for line in response.iter_lines() if line)
        indexes = {json.loads(next(events).removeprefix("data: "))["choices"][0]["index"] for _ in range(8)}
        assert indexes == {0, 1}
    mesh.wait_idle(DEADLINE_S)


def test_client_leaving_a_non_streaming_request_frees_the_blocks(http, mesh):
    aborted = mesh.scheduler_stats().aborted
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={"prompt": prompt_of(40, 7), "max_tokens": 500, "ignore_eos": True},
                  timeout=1.5)
    wait_aborted_and_idle(mesh, aborted)


def test_client_disconnect_before_the_first_token_frees_the_blocks(mesh):
    """The client leaves while its long prompt is still being prefilled (no response started yet).

    Prefilling the 1500 tokens takes about 9 s here and the 500 tokens after them longer; the
    abort lands at the prefill worker's next iteration boundary, after at most one 512-token chunk.
    """
    url = urlsplit(mesh.http_url)
    payload = ('{"prompt": [%s], "max_tokens": 500, "ignore_eos": true, "stream": true}'
               % ", ".join(map(str, prompt_of(1500, 5)))).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: {AUTH['authorization']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(head + payload)
        wait_until(lambda: mesh.worker_stats("prefill-0").referenced_blocks, "the request on the prefill worker")
        sock.settimeout(0.0)
        with pytest.raises(BlockingIOError):
            sock.recv(1)  # no response yet: the prompt is still prefilling
    mesh.wait_idle(DEADLINE_S)
