"""The disaggregated mesh as real processes on loopback (`tandem up`, real redis-server):
parity with HF, continuous batching, prefix-hash routing, KV transfer, cancellation, leaks,
bad input, and a decode worker killed mid-stream. Runs last in the module: the kill."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tandem.v1 import common_pb2, gateway_pb2
from tests.hf_reference import MAX_NEW_TOKENS, assert_matches
from tests.mesh import Mesh, collect, greedy_request
from tests.e2e.api import prompt_of
from tests.waiting import DEADLINE_S, wait_until

API_KEY = "test-key"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
KV_CHUNK_BYTES = 64 * 1024
KV_BYTES_PER_TOKEN = 46080  # 2 x 30 layers x 3 kv heads x 64 dims x 4 bytes
BLOCK = 16
ENV = {
    "TANDEM_API_KEYS": API_KEY,
    "TANDEM_KV_CHUNK_BYTES": str(KV_CHUNK_BYTES),
    "TANDEM_KV_MEMORY": "256MiB",
    "TANDEM_THREADS": "1",
    "TANDEM_HEARTBEAT_TTL": "3",
    "TANDEM_MIGRATION": "0",  # the killed decode worker's request fails; test_migration.py moves one instead
    "TANDEM_KV_TRANSPORT": "grpc",  # KV in the Push messages here; the other meshes take the same-host path
}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, default_model_dir):
    started = Mesh.start("--prefill", "2", "--decode", "2", "--model", str(default_model_dir),
                         env=ENV, run_dir=tmp_path_factory.mktemp("mesh"))
    yield started
    started.stop()


def generate(mesh: Mesh, request: gateway_pb2.GenerateRequest, timeout: float = 120):
    return collect(mesh.gateway().Generate(request, metadata=AUTH, timeout=timeout))


def test_concurrent_greedy_requests_match_hf(mesh, parity_prompts, parity_references):
    with ThreadPoolExecutor(len(parity_prompts)) as pool:
        results = list(pool.map(lambda p: generate(mesh, greedy_request(p, MAX_NEW_TOKENS)), parity_prompts))
    for i, ((tokens, messages), ref) in enumerate(zip(results, parity_references)):
        assert_matches(tokens, ref, f"mesh prompt {i}")
        assert messages[0].request_id and messages[0].trace_id
        assert messages[-1].usage.prompt_tokens == len(parity_prompts[i])
        assert messages[-1].usage.completion_tokens == len(tokens)
    mesh.wait_idle(DEADLINE_S)


def test_short_request_finishes_before_a_long_one_decoding(mesh):
    finished: list[str] = []
    first_token = threading.Event()

    def long_request():
        request = greedy_request(prompt_of(20, 1), 200)
        request.sampling.ignore_eos = True
        for message in mesh.gateway().Generate(request, metadata=AUTH, timeout=300):
            first_token.set()
        finished.append("long")

    thread = threading.Thread(target=long_request)
    thread.start()
    assert first_token.wait(60)
    short = greedy_request(prompt_of(8, 2), 4)
    short.sampling.ignore_eos = True
    tokens, _ = generate(mesh, short)
    finished.append("short")
    thread.join(300)
    assert finished == ["short", "long"] and len(tokens) == 4
    assert max(mesh.worker_stats(name).max_batch_size for name in mesh.names("decode")) > 1


def test_requests_sharing_a_prefix_route_to_the_worker_caching_it(mesh):
    prefix = prompt_of(256, 3)
    first = greedy_request(prefix + prompt_of(5, 4), 2, request_id="prefix-0")
    _, messages = generate(mesh, first)
    assert messages[-1].usage.cached_tokens == 0
    owner = route_of(mesh, "prefix-0").prefill_worker_id
    for i in range(1, 4):
        _, messages = generate(mesh, greedy_request(prefix + prompt_of(5 + i, 10 + i), 2, request_id=f"prefix-{i}"))
        assert messages[-1].usage.cached_tokens == 256
        assert route_of(mesh, f"prefix-{i}").prefill_worker_id == owner
    _, messages = generate(mesh, greedy_request(prefix + prompt_of(5, 4), 2, cache_salt="tenant-b"))
    assert messages[-1].usage.cached_tokens == 0


def route_of(mesh: Mesh, request_id: str):
    routes = {r.request_id: r for r in mesh.scheduler_stats().recent_routes}
    return routes[request_id]


def kv_bytes_received(mesh: Mesh) -> int:
    return sum(mesh.worker_stats(name).kv_bytes_received for name in mesh.names("decode"))


@pytest.mark.parametrize("length", [16, 100, 301])
def test_kv_transfer_ships_exactly_the_prompt_blocks(mesh, length):
    before = kv_bytes_received(mesh)
    tokens, _ = generate(mesh, greedy_request(prompt_of(length, 5 + length), 3))
    assert len(tokens) == 3
    blocks = -(-length // BLOCK)
    assert kv_bytes_received(mesh) - before == blocks * BLOCK * KV_BYTES_PER_TOKEN


def test_cancel_mid_stream_frees_blocks(mesh):
    request = greedy_request(prompt_of(40, 6), 200)
    request.sampling.ignore_eos = True
    call = mesh.gateway().Generate(request, metadata=AUTH, timeout=120)
    aborted = mesh.scheduler_stats().aborted
    for count, _ in enumerate(call):
        if count == 3:
            break
    call.cancel()
    mesh.wait_idle(DEADLINE_S)
    assert mesh.scheduler_stats().aborted == aborted + 1  # idle because cancelled, not because finished


def test_cancel_while_queued_frees_blocks(mesh):
    request = greedy_request(prompt_of(300, 7), 50)
    call = mesh.gateway().Generate(request, metadata=AUTH, timeout=120)
    call.cancel()
    mesh.wait_idle(DEADLINE_S)


def test_200_mixed_requests_leave_nothing_behind(mesh):
    def one(i: int) -> str:
        kind = ("finish", "cancel", "invalid")[i % 3]
        request = greedy_request(prompt_of(10 + i % 30, 100 + i), 4)
        if kind == "invalid":
            request.sampling.temperature = -1
        call = mesh.gateway().Generate(request, metadata=AUTH, timeout=120)
        try:
            for _ in call:
                if kind == "cancel":
                    call.cancel()
                    break
        except grpc.RpcError as error:
            return error.code().name
        return kind

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(one, range(200)))
    assert outcomes.count("finish") == 67 and outcomes.count("cancel") == 67
    assert outcomes.count("INVALID_ARGUMENT") == 66
    mesh.wait_idle(DEADLINE_S)


BAD_INPUTS = [
    ("prompt", dict(prompt=""), "prompt"),
    ("both", dict(prompt="hi", token_ids=[1, 2]), "prompt"),
    ("too long", dict(token_ids=[200] * 9000), "token_ids"),
    ("max_tokens zero", dict(token_ids=[200, 201], sampling=common_pb2.SamplingParams(max_tokens=0)), "max_tokens"),
    ("max_tokens beyond", dict(token_ids=[200, 201], sampling=common_pb2.SamplingParams(max_tokens=9000)), "max_tokens"),
    ("temperature", dict(token_ids=[200], sampling=common_pb2.SamplingParams(max_tokens=2, temperature=-0.5)), "temperature"),
    ("top_p zero", dict(token_ids=[200], sampling=common_pb2.SamplingParams(max_tokens=2, top_p=0.0)), "top_p"),
    ("top_p above", dict(token_ids=[200], sampling=common_pb2.SamplingParams(max_tokens=2, top_p=1.5)), "top_p"),
]


@pytest.mark.parametrize("case, fields, field_name", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_rejected_naming_the_field(mesh, case, fields, field_name):
    with pytest.raises(grpc.RpcError) as error:
        generate(mesh, gateway_pb2.GenerateRequest(**fields))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_name in error.value.details()
    tokens, _ = generate(mesh, greedy_request(prompt_of(6, 8), 2))
    assert len(tokens) == 2


def test_unknown_model_and_bad_key(mesh):
    with pytest.raises(grpc.RpcError) as error:
        generate(mesh, greedy_request([200, 201], 2, model="no-such-model"))
    assert error.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    assert "model" in error.value.details()
    with pytest.raises(grpc.RpcError) as error:
        collect(mesh.gateway().Generate(greedy_request([200], 2), metadata=(("authorization", "Bearer wrong"),)))
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_killed_decode_worker_fails_its_requests_fast(mesh):
    request = greedy_request(prompt_of(30, 9), 400, request_id="doomed")
    request.sampling.ignore_eos = True
    call = mesh.gateway().Generate(request, metadata=AUTH, timeout=120)
    next(call)
    next(call)
    victim_id = route_of(mesh, "doomed").decode_worker_id
    address = next(w.info.address for w in mesh.scheduler_stats().workers if w.info.worker_id == victim_id)
    victim = next(ep for ep in mesh.endpoints if ep.kind == "grpc" and ep.address == address)
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as error:
        for _ in call:
            pass
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE  # at once: not DEADLINE_EXCEEDED after 120 s
    tokens, _ = generate(mesh, greedy_request(prompt_of(12, 10), 3))
    assert len(tokens) == 3
    wait_until(lambda: all(w.info.address != victim.address for w in mesh.scheduler_stats().workers),
               "the killed worker unregistered after its TTL")
