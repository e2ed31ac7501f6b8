"""A mesh with room for one running and one queued request, and an 8 s request deadline: a full
queue is HTTP 429 with Retry-After (openai's RateLimitError), gRPC RESOURCE_EXHAUSTED with its
retry hint, and the SDK's Overloaded; a deadline is 504 before the first token and one error
event then `[DONE]` after it. Every case leaves the mesh idle.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
import tandem
from tandem.errors import Overloaded
from services.gateway import client_errors
from tests.e2e.api import API_KEY, AUTH, MESH_ENV, MODEL, prompt_of, sse_events
from tests.mesh import Mesh, greedy_request
from tests.waiting import DEADLINE_S, wait_until

REQUEST_TIMEOUT_S = 8
ENV = {**MESH_ENV, "TANDEM_MAX_RUNNING": "1", "TANDEM_MAX_QUEUE": "1",
       "TANDEM_REQUEST_TIMEOUT": str(REQUEST_TIMEOUT_S)}
LONG = {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}  # runs past the deadline


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, default_model_dir) -> Iterator[Mesh]:
    started = Mesh.start("--mode", "colocated", "--model", str(default_model_dir), env=ENV,
                         run_dir=tmp_path_factory.mktemp("overload-mesh"))
    yield started
    started.stop()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as executor:
        yield executor


def stream_until_closed(mesh: Mesh, seed: int, first_event: threading.Event, leave: threading.Event) -> bytes:
    """A long streaming request: the SSE body it received, up to `leave` (then it disconnects) or its end."""
    body = {"prompt": prompt_of(20, seed), **LONG, "stream": True}
    received = b""
    with httpx.stream("POST", f"{mesh.http_url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        for part in response.iter_bytes():
            received += part
            first_event.set()
            if leave.is_set():
                break
    return received


def fill(mesh: Mesh, pool: ThreadPoolExecutor, leave: threading.Event,
         waiting_body: dict | None = None) -> tuple[Future[bytes], Future[httpx.Response]]:
    """One long request running (streaming) and one waiting in the queue (not streaming; short by default)."""
    first_event = threading.Event()
    running = pool.submit(stream_until_closed, mesh, 1, first_event, leave)
    assert first_event.wait(30), "the running request produced nothing"
    body = {"prompt": prompt_of(20, 2), **(waiting_body or {"max_tokens": 4, "temperature": 0})}
    waiting = pool.submit(httpx.post, f"{mesh.http_url}/v1/completions", headers=AUTH, timeout=60, json=body)
    wait_until(lambda: mesh.scheduler_stats().waiting == 1, "the second request to queue")
    return running, waiting


def test_a_full_queue_is_429_resource_exhausted_and_overloaded(mesh, pool):
    leave = threading.Event()
    running, waiting = fill(mesh, pool, leave)

    with openai.OpenAI(base_url=f"{mesh.http_url}/v1", api_key=API_KEY, max_retries=0) as client:
        with pytest.raises(openai.RateLimitError) as error:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert error.value.status_code == 429 and error.value.type == "rate_limit_error"
    assert int(error.value.response.headers["retry-after"]) >= 1
    assert client_errors.BUSY in error.value.message  # stable words, not the scheduler's

    stub = mesh.gateway()
    with pytest.raises(grpc.RpcError) as rpc_error:
        list(stub.Generate(greedy_request([200, 201], 2), metadata=(("authorization", f"Bearer {API_KEY}"),)))
    assert rpc_error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(rpc_error.value.trailing_metadata())["retry-after"]) >= 1

    with tandem.Client(mesh.endpoint("gateway").address, api_key=API_KEY,
                       retry=tandem.RetryPolicy(max_attempts=1)) as sdk:
        with pytest.raises(Overloaded) as overloaded:
            sdk.complete("Hello", max_tokens=4)
    assert overloaded.value.retry_after >= 1 and overloaded.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED

    leave.set()
    running.result(timeout=30)
    assert waiting.result(timeout=30).status_code == 200  # it ran once the first one left
    mesh.wait_idle(DEADLINE_S)


def test_deadline_is_504_before_the_first_token_and_an_error_event_after_it(mesh, pool):
    never = threading.Event()
    started = time.monotonic()
    # The queued request is long too: it reaches the slot a little before its own deadline (it queued
    # after the running one's first token), and a short one could finish in that time on a quick machine.
    running, waiting = fill(mesh, pool, never, waiting_body=LONG)

    queued = waiting.result(timeout=REQUEST_TIMEOUT_S + 10)
    assert queued.status_code == 504
    assert queued.json()["error"]["type"] == "timeout_error" and queued.json()["error"]["code"] == "deadline_exceeded"

    events = sse_events(running.result(timeout=REQUEST_TIMEOUT_S + 10))
    *chunks, failure = events
    assert chunks and all(len(e["choices"]) == 1 and e["choices"][0]["finish_reason"] is None for e in chunks)
    assert set(failure) == {"error"} and failure["error"]["code"] == "deadline_exceeded"
    assert failure["error"]["type"] == "timeout_error"
    assert time.monotonic() - started >= REQUEST_TIMEOUT_S  # not before the deadline (load only adds time)
    mesh.wait_idle(DEADLINE_S)
