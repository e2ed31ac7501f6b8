"""The internal RPCs under hypothesis-generated messages sent with the valid internal token: the
scheduler's (Submit, Submissions, Abort, Stats, RegisterWorker, Heartbeat, Heartbeats, DeregisterWorker,
ReportBlocks, ReportTokens) and the workers' (Prefill, Reserve, Release, Abort, Stats, KV Push). Pass: no call
ends INTERNAL or UNKNOWN, no process dies, and once the workers a fuzzed RegisterWorker invented
have lapsed (3 s TTL) the mesh serves the reference request's exact tokens and is idle.

An authenticated caller may register invented workers, at bogus addresses or at a real worker's;
the mesh must survive that, not prevent it. Speaking for a live worker (its id) is tested on its
own: the scheduler refuses a registration under a live worker's id with other info. Requests use
a small pool of ids so that calls meet each other's reservations, and every id of the pool is
aborted everywhere after each test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message
from hypothesis import event, given
from hypothesis import strategies as st

from services.common.wire import MAX_ABORT_IDS
from tandem.v1.errors import code_from_number
from tandem.v1 import (
    common_pb2,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.fuzz.serving import FAULTS, Outcome, assert_still_serving, budget, outcome_of
from tests.fuzz.strategies import COMMON_HINTS, INT32, odd_text
from tests.fuzz.strategies import messages as message_strategy
from tests.mesh import Mesh
from tests.waiting import DEADLINE_S, wait_until

pytestmark = pytest.mark.slow

REQUEST_IDS = ["fuzz-0", "fuzz-1", "", "\u00e9/\u202e", "r" * 300]
INTERNAL_TIMEOUT_S = 10.0
# One KV block of one layer of the default model in fp32: block_size x kv_heads x head_dim.
BLOCK_SHAPE = (16, 3, 64)
BLOCK_BYTES = 2 * 16 * 3 * 64 * 4  # K and V of one block of one layer
LAYERS = 30


@dataclass(frozen=True, slots=True)
class Rpc:
    """One internal method: its stub class and name, request type, and whether requests stream."""

    stub: type
    method: str
    request: Descriptor
    client_streaming: bool = False
    server_streaming: bool = False

    def call(self, channel: grpc.Channel, sent: Message | list[Message], token_metadata) -> Callable[[], object]:
        method = getattr(self.stub(channel), self.method)
        arguments = {"timeout": INTERNAL_TIMEOUT_S, "metadata": token_metadata}
        if self.client_streaming and self.server_streaming:
            return lambda: list(method(iter(sent), **arguments))
        if self.client_streaming:
            return lambda: method(iter(sent), **arguments)
        if self.server_streaming:
            return lambda: list(method(sent, **arguments))
        return lambda: method(sent, **arguments)


SCHEDULER_RPCS = [
    Rpc(scheduler_pb2_grpc.SchedulerServiceStub, "Submit", scheduler_pb2.SubmitRequest.DESCRIPTOR,
        server_streaming=True),
    Rpc(scheduler_pb2_grpc.SchedulerServiceStub, "Submissions", scheduler_pb2.SubmitCommands.DESCRIPTOR,
        client_streaming=True, server_streaming=True),
    Rpc(scheduler_pb2_grpc.SchedulerServiceStub, "Abort", common_pb2.AbortRequest.DESCRIPTOR),
    Rpc(scheduler_pb2_grpc.SchedulerServiceStub, "Stats", scheduler_pb2.SchedulerStatsRequest.DESCRIPTOR),
    Rpc(scheduler_pb2_grpc.SchedulerServiceStub, "RegisterWorker", scheduler_pb2.RegisterWorkerRequest.DESCRIPTOR),
    Rpc(scheduler_pb2_grpc.SchedulerServiceStub, "Heartbeat", scheduler_pb2.HeartbeatRequest.DESCRIPTOR),
    Rpc(scheduler_pb2_grpc.SchedulerServiceStub, "Heartbeats", scheduler_pb2.HeartbeatRequest.DESCRIPTOR,
        client_streaming=True, server_streaming=True),
    Rpc(scheduler_pb2_grpc.SchedulerServiceStub, "DeregisterWorker",
        scheduler_pb2.DeregisterWorkerRequest.DESCRIPTOR),
    Rpc(scheduler_pb2_grpc.SchedulerServiceStub, "ReportBlocks", scheduler_pb2.ReportBlocksRequest.DESCRIPTOR),
    Rpc(scheduler_pb2_grpc.SchedulerServiceStub, "ReportTokens", scheduler_pb2.TokenBatch.DESCRIPTOR,
        client_streaming=True, server_streaming=True),
]
PREFILL_RPCS = [
    Rpc(worker_pb2_grpc.PrefillServiceStub, "Prefill", worker_pb2.PrefillRequest.DESCRIPTOR),
    Rpc(worker_pb2_grpc.PrefillServiceStub, "Abort", common_pb2.AbortRequest.DESCRIPTOR),
    Rpc(worker_pb2_grpc.PrefillServiceStub, "Stats", worker_pb2.WorkerStatsRequest.DESCRIPTOR),
]
DECODE_RPCS = [
    Rpc(worker_pb2_grpc.DecodeServiceStub, "Reserve", worker_pb2.ReserveRequest.DESCRIPTOR),
    Rpc(worker_pb2_grpc.DecodeServiceStub, "Release", worker_pb2.ReleaseRequest.DESCRIPTOR),
    Rpc(worker_pb2_grpc.DecodeServiceStub, "Abort", common_pb2.AbortRequest.DESCRIPTOR),
    Rpc(worker_pb2_grpc.DecodeServiceStub, "Stats", worker_pb2.WorkerStatsRequest.DESCRIPTOR),
    Rpc(kv_transfer_pb2_grpc.KvTransferServiceStub, "Push", kv_transfer_pb2.KvChunk.DESCRIPTOR,
        client_streaming=True),
]


@dataclass(frozen=True, slots=True)
class Target:
    """A service of the mesh and a channel to it."""

    name: str
    channel: grpc.Channel


def hints(mesh: Mesh) -> dict[str, st.SearchStrategy]:
    """Field hints that make calls meet: the pool of request ids, invented worker ids, the real
    workers' addresses next to bogus ones (no host names: a DNS lookup would only test the resolver)."""
    workers = [status.info for status in mesh.scheduler_stats().workers]
    addresses = ["127.0.0.1:1", "[::1]:0", "", "no-port", *(w.address for w in workers)]
    request_id = st.sampled_from(REQUEST_IDS)
    return {
        **COMMON_HINTS,
        "request_id": request_id,
        "request_ids": st.one_of(st.lists(request_id, max_size=3), st.just(["z"] * (MAX_ABORT_IDS + 1))),
        "worker_id": st.one_of(st.sampled_from(["fuzz-worker", "fuzz-worker-2"]), odd_text),
        "address": st.one_of(st.sampled_from(addresses), st.from_regex(r"[0-9.:\[\]]{0,16}", fullmatch=True)),
        "decode_address": st.sampled_from(addresses),
        "dtype": st.one_of(st.sampled_from(["float32", "float16", "bfloat16", "int8", ""]), odd_text),
        "shape": st.one_of(st.just([2, 1, *BLOCK_SHAPE]), st.lists(st.integers(-2, 70), max_size=6)),
        "data": st.one_of(st.binary(max_size=64), st.just(bytes(BLOCK_BYTES))),
    }


def calls(rpcs: list[Rpc], field_hints: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """(rpc, request) pairs; a streaming request is a list of one to three messages."""
    def sent(rpc: Rpc) -> st.SearchStrategy:
        one = message_strategy(rpc.request, field_hints)
        return st.lists(one, min_size=1, max_size=3) if rpc.client_streaming else one

    return st.one_of(*(st.tuples(st.just(rpc), sent(rpc)) for rpc in rpcs))


def assert_no_fault(target: Target, rpc: Rpc, sent, token_metadata) -> Outcome:
    outcome, result = outcome_of(rpc.call(target.channel, sent, token_metadata))
    event(f"{rpc.method}: {outcome.code.name}")
    assert outcome.code not in FAULTS, (target.name, rpc.method, sent, outcome)
    for end in _submission_ends(result):  # each submission on a Submissions stream ends as a Submit call
        event(f"{rpc.method} submission: {code_from_number(end.status.code).name}")
        assert code_from_number(end.status.code) not in FAULTS, (target.name, rpc.method, sent, end)
    return outcome


def _submission_ends(result: object) -> list[scheduler_pb2.SubmitEnd]:
    if not isinstance(result, list):
        return []
    return [update.end for message in result if isinstance(message, scheduler_pb2.SubmitUpdates)
            for update in message.updates if update.HasField("end")]


@pytest.fixture(scope="module")
def targets(mesh) -> dict[str, Target]:
    names = ["scheduler", *mesh.names("prefill"), *mesh.names("decode")]
    opened = {name: Target(name, grpc.insecure_channel(mesh.endpoint(name).address)) for name in names}
    yield opened
    for target in opened.values():
        target.channel.close()


def role_target(targets: dict[str, Target], prefix: str) -> Target:
    return next(target for name, target in targets.items() if name.startswith(prefix))


def recover(mesh: Mesh, targets: dict[str, Target], real_workers: set[tuple[str, str, str]]) -> None:
    """Aborts every pooled request id everywhere, then waits until the scheduler lists exactly the
    real workers, as they registered (the invented ones lapsed)."""
    abort = common_pb2.AbortRequest(request_ids=REQUEST_IDS, reason="fuzz cleanup")
    for target in targets.values():
        stub = (scheduler_pb2_grpc.SchedulerServiceStub if target.name == "scheduler" else
                worker_pb2_grpc.PrefillServiceStub if target.name.startswith("prefill") else
                worker_pb2_grpc.DecodeServiceStub)(target.channel)
        stub.Abort(abort, timeout=INTERNAL_TIMEOUT_S, metadata=mesh.internal_metadata)
    wait_until(lambda: registered(mesh) == real_workers, "the scheduler lists exactly the real workers",
               timeout=DEADLINE_S)


def registered(mesh: Mesh) -> set[tuple[str, str, str]]:
    """(worker id, address, model) of each worker the scheduler lists."""
    return {(s.info.worker_id, s.info.address, s.info.model) for s in mesh.scheduler_stats().workers}


@pytest.fixture(scope="module")
def real_workers(mesh) -> set[tuple[str, str, str]]:
    return registered(mesh)


def test_scheduler_rpcs_never_fault(mesh, reference, targets, real_workers):
    @budget(max_examples=150)
    @given(call=calls(SCHEDULER_RPCS, hints(mesh)))
    def fuzz(call) -> None:
        assert_no_fault(targets["scheduler"], *call, mesh.internal_metadata)

    fuzz()
    recover(mesh, targets, real_workers)
    assert_still_serving(mesh, reference)


def test_worker_rpcs_never_fault(mesh, reference, targets, real_workers):
    prefill, decode = role_target(targets, "prefill"), role_target(targets, "decode")
    by_target = st.one_of(calls(PREFILL_RPCS, hints(mesh)).map(lambda call: (prefill, *call)),
                          calls(DECODE_RPCS, hints(mesh)).map(lambda call: (decode, *call)))

    @budget(max_examples=150)
    @given(call=by_target)
    def fuzz(call) -> None:
        assert_no_fault(*call, mesh.internal_metadata)

    fuzz()
    recover(mesh, targets, real_workers)
    assert_still_serving(mesh, reference)


def kv_chunks(request_id: str) -> st.SearchStrategy[list[kv_transfer_pb2.KvChunk]]:
    """Streams of chunks for a reservation of two blocks, near the valid shape: each header field
    valid or just outside, data of the announced size (zeros, NaN, huge floats) or not."""
    def chunk(layer: int, first_block: int, num_blocks: int, valid_shape: bool, fill: bytes, header):
        shape = [2, num_blocks, *BLOCK_SHAPE] if valid_shape else [2, num_blocks, 16, 3]
        size = max(0, num_blocks * BLOCK_BYTES)
        data = (fill * size)[:size] if fill else b""
        return kv_transfer_pb2.KvChunk(request_id=request_id, header=header, layer=layer, first_block=first_block,
                                       num_blocks=num_blocks, dtype="float32", shape=shape, data=data)

    header = message_strategy(kv_transfer_pb2.KvRequestHeader.DESCRIPTOR, {
        **COMMON_HINTS,
        "prompt_token_ids": st.lists(st.integers(0, 49151), max_size=20),
        "sampling": st.builds(common_pb2.SamplingParams, max_tokens=st.integers(1, 4),
                              temperature=st.sampled_from([0.0, 1.0])),
        "num_chunks": st.one_of(st.integers(0, 3), st.integers(*INT32)),
    })
    one = st.builds(chunk, layer=st.sampled_from([-1, 0, LAYERS - 1, LAYERS, 2**31 - 1]),
                    first_block=st.sampled_from([-1, 0, 1, 2]), num_blocks=st.sampled_from([-1, 0, 1, 2, 3]),
                    valid_shape=st.booleans(),
                    fill=st.sampled_from([b"\x00", b"\x00\x00\xc0\x7f", b"\xff\xff\x7f\x7f", b""]), header=header)
    return st.lists(one, min_size=1, max_size=3)


def test_kv_push_into_a_reservation_never_faults(mesh, reference, targets, real_workers):
    decode = role_target(targets, "decode")
    stub = worker_pb2_grpc.DecodeServiceStub(decode.channel)
    push = next(rpc for rpc in DECODE_RPCS if rpc.method == "Push")

    @budget(max_examples=60)
    @given(chunks=kv_chunks("fuzz-kv"))
    def fuzz(chunks) -> None:
        stub.Reserve(worker_pb2.ReserveRequest(request_id="fuzz-kv", num_tokens=32), timeout=INTERNAL_TIMEOUT_S,
                     metadata=mesh.internal_metadata)
        try:
            assert_no_fault(decode, push, chunks, mesh.internal_metadata)
        finally:
            stub.Abort(common_pb2.AbortRequest(request_ids=["fuzz-kv"]), timeout=INTERNAL_TIMEOUT_S,
                       metadata=mesh.internal_metadata)

    fuzz()
    recover(mesh, targets, real_workers)
    assert_still_serving(mesh, reference)


def test_a_registration_under_a_live_workers_id_does_not_stop_serving(mesh, reference, targets, real_workers):
    scheduler = scheduler_pb2_grpc.SchedulerServiceStub(targets["scheduler"].channel)
    decode = next(s.info for s in mesh.scheduler_stats().workers if s.info.role == common_pb2.WORKER_ROLE_DECODE)
    impostor = scheduler_pb2.WorkerInfo()
    impostor.CopyFrom(decode)
    impostor.model = "impostor"
    with pytest.raises(grpc.RpcError) as refused:
        scheduler.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(worker=impostor), timeout=INTERNAL_TIMEOUT_S,
                                 metadata=mesh.internal_metadata)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert registered(mesh) == real_workers
    assert_still_serving(mesh, reference)
