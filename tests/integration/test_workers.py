"""The prefill, decode and colocated workers as real processes on loopback, driven the way the
scheduler and the gateway drive them: Reserve on the decode worker, Prefill with its address, the
tokens read from the workers' TokenStreamService (as the gateway does), each request's first and
final event on their ReportTokens streams. A recording stand-in for the scheduler runs in this process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from services.common.block_hash import hash_chain
from services.common.health_cli import check, wait_until_serving
from tandem.cli.ports import free_port
from tandem.v1 import common_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tests.assign import assign
from tests.hf_reference import LONG_PREFIX, MAX_NEW_TOKENS, assert_matches
from tests.waiting import DEADLINE_S, START_S, wait_until

pytestmark = [pytest.mark.timeout(300)]

KV_MEMORY = "64MiB"
NUM_BLOCKS = (64 << 20) // 737_280  # SmolLM2-135M: 30 layers x K,V x 16 tokens x 3 heads x 64 x fp32
BLOCK_SIZE = 16
NUM_LAYERS = 30
BLOCK_BYTES = 737_280  # one block, all layers
LAYER_BLOCK_BYTES = BLOCK_BYTES // NUM_LAYERS
TANDEM = Path(sys.executable).parent / "tandem"
GREEDY = dict(temperature=0.0)
RPC_S = DEADLINE_S  # the bound on a worker's answer to a call, reached only by one that never answers (was 5 s:
# a prefill worker computing a prompt at load 12 answered an Abort after more than that)
POLICY = scheduler_pb2.BatchPolicy(chunk_size=256)  # the workers' flag says 512


# -- a recording scheduler ------------------------------------------------------------------


class RecordingScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Accepts every worker and records what they send. Heartbeats of workers that did not
    register here answer known=false, and so does the next one after `forget(worker_id)`."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.registrations: list[scheduler_pb2.WorkerInfo] = []
        self.deregistered: list[str] = []
        self.loads: dict[str, scheduler_pb2.WorkerLoad] = {}
        self.block_reports: list[scheduler_pb2.ReportBlocksRequest] = []
        self.batches: list[scheduler_pb2.TokenBatch] = []
        self.streamed: list[scheduler_pb2.TokenEvent] = []  # read from the workers, as the gateway reads them
        self._forgotten: set[str] = set()

    def _record(self, update: Callable[[], None]) -> None:
        with self.cond:
            update()
            self.cond.notify_all()

    def RegisterWorker(self, request, context):
        self._record(lambda: self.registrations.append(request.worker))
        return scheduler_pb2.RegisterWorkerResponse(heartbeat_ttl_ms=3000, heartbeat_interval_ms=200,
                                                    policy=POLICY, scheduler_id="recording")

    def Heartbeat(self, request, context):
        with self.cond:
            registered = any(info.worker_id == request.worker_id for info in self.registrations)
            known = registered and request.worker_id not in self._forgotten
            self._forgotten.discard(request.worker_id)
            self.loads[request.worker_id] = request.load
            self.cond.notify_all()
        return scheduler_pb2.HeartbeatResponse(known=known)

    def DeregisterWorker(self, request, context):
        self._record(lambda: self.deregistered.append(request.worker_id))
        return scheduler_pb2.DeregisterWorkerResponse()

    def ReportBlocks(self, request, context):
        self._record(lambda: self.block_reports.append(request))
        return scheduler_pb2.ReportBlocksResponse()

    def ReportTokens(self, request_iterator, context):
        """Records each batch; acks each numbered one once recorded, as the scheduler does."""
        count = 0
        for batch in request_iterator:
            count += 1
            self._record(lambda: self._take(batch))
            if batch.sequence:
                yield scheduler_pb2.ReportAck(batches=count, applied_through=batch.sequence)

    def _take(self, batch: scheduler_pb2.TokenBatch) -> None:
        """A batch's prefix-cache changes count as a block report, in the order they arrived."""
        self.batches.append(batch)
        if batch.stored_blocks or batch.evicted_blocks:
            self.block_reports.append(scheduler_pb2.ReportBlocksRequest(
                worker_id=batch.worker_id, stored=batch.stored_blocks, evicted=batch.evicted_blocks))

    def read(self, worker: Worker, request_id: str) -> None:
        """Read the request's token stream from `worker` in the background, as the gateway does."""
        def follow() -> None:
            attach = worker_pb2.FollowControl(attach=worker_pb2.StreamRequest(request_id=request_id))
            call = worker_pb2_grpc.TokenStreamServiceStub(worker.channel).Follow(iter([attach]), timeout=120)
            try:
                for batch in call:  # ends after the request's stream did (the controls are done)
                    self._record(lambda: self.streamed.extend(batch.events))
            except grpc.RpcError:
                pass  # the worker dropped the request (an abort, a release), or the test ended

        threading.Thread(target=follow, daemon=True).start()

    def reported(self, worker_id: str, request_id: str) -> list[int]:
        """The offsets of the request's events `worker_id` reported to the scheduler."""
        with self.cond:
            return [e.output_offset for b in self.batches if b.worker_id == worker_id for e in b.events
                    if e.request_id == request_id]

    def forget(self, worker_id: str) -> None:
        with self.cond:
            self._forgotten.add(worker_id)

    def wait(self, predicate: Callable[[], object], timeout: float, what: str):
        deadline = time.monotonic() + timeout
        with self.cond:
            while not (result := predicate()):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"waited {timeout} s for {what}")
                self.cond.wait(left)
            return result

    def events(self, request_id: str) -> list[scheduler_pb2.TokenEvent]:
        with self.cond:
            return sorted((e for e in self.streamed if e.request_id == request_id), key=lambda e: e.output_offset)

    def finished(self, request_id: str) -> list[scheduler_pb2.TokenEvent]:
        """The request's events once its final one arrived (empty list until then)."""
        events = self.events(request_id)
        return events if any(e.finish_reason for e in events) else []

    def stream(self, request_id: str, silence: float = DEADLINE_S) -> list[scheduler_pb2.TokenEvent]:
        """The request's events once its final one arrived; TimeoutError once `silence` seconds pass with
        no new one (a request that stopped: a loaded machine only slows one, 93 s for 48 tokens at load 15)."""
        while not (events := self.finished(request_id)):
            heard = len(self.events(request_id))
            self.wait(lambda: self.finished(request_id) or len(self.events(request_id)) > heard, silence,
                      f"event {heard} of {request_id}")
        return events


def tokens_of(events: list[scheduler_pb2.TokenEvent]) -> list[int]:
    tokens: list[int] = []
    for event in events:
        assert event.output_offset == len(tokens), f"gap or duplicate at offset {event.output_offset}"
        tokens.extend(event.token_ids)
    return tokens


@dataclass
class Scheduler:
    servicer: RecordingScheduler
    server: grpc.Server
    address: str


def start_scheduler(port: int = 0) -> Scheduler:
    servicer = RecordingScheduler()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return Scheduler(servicer, server, f"127.0.0.1:{bound}")


# -- worker processes -----------------------------------------------------------------------


@dataclass
class Worker:
    role: str
    address: str
    process: subprocess.Popen
    log: Path
    metrics_port: int
    channel: grpc.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.address)

    @property
    def worker_id(self) -> str:
        return f"{self.role}-{self.address}"

    def stats(self) -> worker_pb2.WorkerStats:
        stub = {"prefill": worker_pb2_grpc.PrefillServiceStub, "decode": worker_pb2_grpc.DecodeServiceStub,
                "colocated": worker_pb2_grpc.ColocatedServiceStub}[self.role](self.channel)
        return stub.Stats(worker_pb2.WorkerStatsRequest(), timeout=RPC_S)

    def metric(self, name: str) -> float:
        """The value of one sample of the worker's /metrics page, e.g. 'tandem:kv_transfer_bytes_total'."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=RPC_S) as response:
            page = response.read().decode()
        values = [line.rsplit(" ", 1)[1] for line in page.splitlines() if line.startswith(name + "{")]
        assert len(values) == 1, f"{name}: {values}"
        return float(values[0])

    def stop(self) -> None:
        self.channel.close()
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def spawn_worker(role: str, scheduler: str, tmp: Path, *extra: str) -> Worker:
    port, metrics_port = free_port(), free_port()
    log = tmp / f"{role}-{port}.log"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TANDEM_INTERNAL_TOKEN")},
           "TANDEM_RUN_DIR": str(tmp / "run")}
    # The stand-in scheduler checks no token; tests/integration/test_closed_by_default.py covers auth.
    command = [str(TANDEM), role, "--host", "127.0.0.1", "--port", str(port), "--scheduler", scheduler,
               "--kv-memory", KV_MEMORY, "--threads", "1", "--metrics-port", str(metrics_port),
               "--insecure-internal", *extra]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    return Worker(role, f"127.0.0.1:{port}", process, log, metrics_port)


def wait_serving(worker: Worker, timeout: float = START_S) -> None:
    try:
        wait_until_serving(worker.address, timeout)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{worker.log.read_text()}") from exc


@dataclass
class Mesh:
    scheduler: Scheduler
    prefill: Worker
    decode: Worker
    colocated: Worker

    @property
    def recorder(self) -> RecordingScheduler:
        return self.scheduler.servicer

    def decode_stub(self) -> worker_pb2_grpc.DecodeServiceStub:
        return worker_pb2_grpc.DecodeServiceStub(self.decode.channel)

    def prefill_stub(self) -> worker_pb2_grpc.PrefillServiceStub:
        return worker_pb2_grpc.PrefillServiceStub(self.prefill.channel)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, default_model_dir) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("workers")
    scheduler = start_scheduler()
    workers: list[Worker] = []
    try:
        for role in ("prefill", "decode", "colocated"):
            workers.append(spawn_worker(role, scheduler.address, tmp, "--model", str(default_model_dir)))
        for worker in workers:
            wait_serving(worker)
        yield Mesh(scheduler, *workers)
    finally:
        for worker in workers:
            worker.stop()
        scheduler.server.stop(grace=None)


# -- driving a disaggregated request --------------------------------------------------------


def sampling(**fields) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**{"max_tokens": MAX_NEW_TOKENS, **GREEDY, **fields})


def reserve(mesh: Mesh, rid: str, prompt: list[int]) -> worker_pb2.ReserveResponse:
    request = worker_pb2.ReserveRequest(request_id=rid, num_tokens=len(prompt) + 1)
    return mesh.decode_stub().Reserve(request, timeout=RPC_S)


def prefill(mesh: Mesh, rid: str, prompt: list[int], reservation: worker_pb2.ReserveResponse | None,
            salt: str = "", max_chunk_bytes: int = 0, timeout: float = 60, **fields) -> worker_pb2.PrefillResponse:
    mesh.recorder.read(mesh.prefill, rid)
    if reservation is not None:
        mesh.recorder.read(mesh.decode, rid)
    request = worker_pb2.PrefillRequest(
        request_id=rid, token_ids=prompt, sampling=sampling(**fields), seed=7, cache_salt=salt,
        decode_address=mesh.decode.address, decode_worker_id=mesh.decode.worker_id,
        decode_block_ids=reservation.block_ids if reservation else [], max_chunk_bytes=max_chunk_bytes,
    )
    return mesh.prefill_stub().Prefill(request, timeout=timeout)


def cache_index(reports: list[scheduler_pb2.ReportBlocksRequest]) -> set[str]:
    """The cache contents the reports describe, as the scheduler's prefix index would hold them."""
    index: set[str] = set()
    for report in reports:
        if report.reset:
            index.clear()
        index |= set(report.stored)
        index -= set(report.evicted)
    return index


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def wait_idle(worker: Worker) -> worker_pb2.WorkerStats:
    """Stats once nothing holds a block (finished and aborted requests freed theirs)."""
    def idle() -> worker_pb2.WorkerStats | None:
        stats = worker.stats()
        return stats if stats.referenced_blocks == 0 and stats.running == 0 and stats.waiting == 0 else None

    return wait_until(idle, f"{worker.role} holding no block")


# -- tests ----------------------------------------------------------------------------------


def test_workers_register_and_heartbeat_with_their_load(mesh):
    recorder = mesh.recorder
    infos = {info.worker_id: info for info in recorder.registrations}
    roles = {"prefill": common_pb2.WORKER_ROLE_PREFILL, "decode": common_pb2.WORKER_ROLE_DECODE,
             "colocated": common_pb2.WORKER_ROLE_COLOCATED}
    for worker in (mesh.prefill, mesh.decode, mesh.colocated):
        info = infos[worker.worker_id]
        assert (info.role, info.address, info.model) == (roles[worker.role], worker.address, "SmolLM2-135M-Instruct")
        assert (info.num_blocks, info.block_size, info.kv_block_bytes) == (NUM_BLOCKS, BLOCK_SIZE, BLOCK_BYTES)
        assert (info.max_model_len, info.device) == (8192, "cpu")
        assert info.load.free_blocks == NUM_BLOCKS
    load = recorder.wait(lambda: recorder.loads.get(mesh.decode.worker_id), DEADLINE_S, "a decode heartbeat")
    assert load.free_blocks == NUM_BLOCKS
    # Each token stream opens with an empty batch naming its worker.
    hellos = {b.worker_id for b in recorder.batches if not b.events}
    assert {mesh.prefill.worker_id, mesh.decode.worker_id, mesh.colocated.worker_id} <= hellos
    # Workers that prefill publish their (empty) cache on registering; the decode worker does not.
    resets = {r.worker_id for r in recorder.block_reports if r.reset}
    assert resets == {mesh.prefill.worker_id, mesh.colocated.worker_id}


def test_disaggregated_greedy_matches_hf(mesh, parity_prompts, parity_references):
    longest = max(range(len(parity_prompts)), key=lambda i: len(parity_prompts[i]))
    chunk_bytes = {longest: 2 * LAYER_BLOCK_BYTES}  # a bound the shared-memory path does not need
    received_before = mesh.decode.stats().kv_bytes_received
    rids = [f"parity-{i}" for i in range(len(parity_prompts))]
    reservations = [reserve(mesh, rid, prompt) for rid, prompt in zip(rids, parity_prompts)]
    for reservation, prompt in zip(reservations, parity_prompts):
        assert len(reservation.block_ids) == blocks_for(len(prompt) + 1)
        assert reservation.block_size == BLOCK_SIZE
    with futures.ThreadPoolExecutor(len(rids)) as pool:
        calls = [pool.submit(prefill, mesh, rid, prompt, reservation, max_chunk_bytes=chunk_bytes.get(i, 0))
                 for i, (rid, prompt, reservation) in enumerate(zip(rids, parity_prompts, reservations))]
        responses = [call.result() for call in calls]

    total_bytes = 0
    for i, (rid, prompt, response) in enumerate(zip(rids, parity_prompts, responses)):
        events = mesh.recorder.stream(rid)
        tokens = tokens_of(events)
        assert_matches(tokens, parity_references[i], f"disaggregated prompt {i}")
        # The prefill worker reports the first token; the decode worker the rest.
        assert events[0].worker_id == mesh.prefill.worker_id and events[0].output_offset == 0
        assert response.first_token_id == tokens[0]
        final = events[-1]
        if len(tokens) > 1:
            assert {e.worker_id for e in events[1:]} == {mesh.decode.worker_id}
            blocks = blocks_for(len(prompt))
            assert (response.transfer.blocks, response.transfer.bytes) == (blocks, blocks * BLOCK_BYTES)
            # Through shared memory (one host): a message per run of layers the prefill computed, whatever
            # max_chunk_bytes says (it bounds the bytes in a message, and these carry none).
            assert 1 <= response.transfer.chunks <= NUM_LAYERS
            assert response.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
            total_bytes += response.transfer.bytes
        else:  # the first token ended it: no KV shipped, the scheduler releases the reservation (unless the
            # decode worker freed it first: the layers streamed meanwhile came on a push that was cancelled)
            assert response.finish_reason == final.finish_reason and response.transfer.chunks == 0
            release = worker_pb2.ReleaseRequest(request_id=rid)
            released = mesh.decode_stub().Release(release, timeout=RPC_S).released_blocks
            assert released in (0, blocks_for(len(prompt) + 1))
        assert final.usage == common_pb2.Usage(prompt_tokens=len(prompt), cached_tokens=response.cached_tokens,
                                               completion_tokens=len(tokens))
        assert final.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)

    decode = wait_idle(mesh.decode)
    assert decode.kv_bytes_received - received_before == total_bytes
    assert mesh.prefill.stats().kv_bytes_sent == mesh.prefill.metric("tandem:kv_transfer_bytes_total") >= total_bytes
    assert decode.reserved_blocks == 0 and decode.free_blocks + decode.cached_blocks == NUM_BLOCKS
    assert decode.max_batch_size > 1
    # Each decode iteration is one message holding all its requests' tokens.
    # The scheduler gets each request's first and final event on each worker, none of the tokens between.
    for rid, prompt in zip(rids, parity_prompts):
        tokens = tokens_of(mesh.recorder.events(rid))
        decoded = sorted({1, len(tokens) - 1}) if len(tokens) > 1 else []
        assert mesh.recorder.wait(lambda: mesh.recorder.reported(mesh.decode.worker_id, rid) == decoded or None,
                                  DEADLINE_S, f"the decode worker's reports of {rid}")
        assert mesh.recorder.reported(mesh.prefill.worker_id, rid) == [0]
    decode_batches = [b for b in mesh.recorder.batches if b.worker_id == mesh.decode.worker_id and b.events]
    assert all(len({e.request_id for e in b.events}) == len(b.events) for b in decode_batches)
    assert all(b.batch_size >= len(b.events) for b in decode_batches)
    assert wait_idle(mesh.prefill).referenced_blocks == 0


def test_first_token_that_ends_the_request_ships_no_kv(mesh, parity_prompts):
    prompt = parity_prompts[5]  # its first token is not EOS: max_tokens ends it
    reservation = reserve(mesh, "one-token", prompt)
    response = prefill(mesh, "one-token", prompt, reservation, max_tokens=1, logprobs=2)
    assert response.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert response.transfer == worker_pb2.KvTransferStats()
    (event,) = mesh.recorder.stream("one-token")
    assert event.worker_id == mesh.prefill.worker_id
    assert list(event.token_ids) == [response.first_token_id]
    assert event.usage == common_pb2.Usage(prompt_tokens=len(prompt), cached_tokens=response.cached_tokens,
                                           completion_tokens=1)
    assert event.logprobs[0].token_id == response.first_token_id and len(event.logprobs[0].top_logprobs) == 2
    assert response.first_logprob == event.logprobs[0]
    # The push opened while the prompt computed (layer-pipelined) and was cut by the ending token: the
    # decode worker frees the reservation on that cut or on this Release, whichever reaches it first.
    released = mesh.decode_stub().Release(worker_pb2.ReleaseRequest(request_id="one-token"), timeout=RPC_S)
    assert released.released_blocks in (0, len(reservation.block_ids))
    assert wait_idle(mesh.decode).reserved_blocks == 0


def test_prefix_cache_hits_and_block_reports(mesh, default_model_dir):
    from services.common.tokenizer import TextCodec

    codec = TextCodec.from_model_dir(default_model_dir)
    prefix = "Notes of the tenant orchard society. " + LONG_PREFIX
    first = codec.encode(prefix + "Question: when does the library close on Saturdays?")
    second = codec.encode(prefix + "Question: how many books can a member borrow?")
    response = prefill(mesh, "prefix-a", first, None, max_tokens=1)
    assert response.cached_tokens == 0
    # The blocks were reported before Prefill returned, so the scheduler can route on them at once.
    stored = {h for r in mesh.recorder.block_reports if r.worker_id == mesh.prefill.worker_id for h in r.stored}
    full_blocks = len(first) // BLOCK_SIZE
    assert set(hash_chain(first, BLOCK_SIZE, model="SmolLM2-135M-Instruct")[:full_blocks]) <= stored

    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    expected = min(common // BLOCK_SIZE, (len(second) - 1) // BLOCK_SIZE) * BLOCK_SIZE
    assert expected >= 64
    hit = prefill(mesh, "prefix-b", second, None, max_tokens=1)
    assert hit.cached_tokens == expected
    assert mesh.recorder.stream("prefix-b")[-1].usage.cached_tokens == expected
    # Another tenant's salt shares nothing.
    salted = prefill(mesh, "prefix-c", second, None, salt="tenant-b", max_tokens=1)
    assert salted.cached_tokens == 0


def reserve_prompt(mesh: Mesh, rid: str, prompt: list[int]) -> worker_pb2.ReserveResponse:
    """Reserve as the scheduler does: with the prompt, so the decode worker reuses its cached prefix."""
    request = worker_pb2.ReserveRequest(request_id=rid, num_tokens=len(prompt) + 1, token_ids=prompt)
    return mesh.decode_stub().Reserve(request, timeout=RPC_S)


def test_a_second_turn_ships_only_the_blocks_the_decode_worker_does_not_hold(mesh, default_model_dir):
    from services.common.tokenizer import TextCodec
    from tests.hf_reference import LONG_STORY, reference_outputs

    codec = TextCodec.from_model_dir(default_model_dir)
    first = codec.encode("Minutes of the harbour choir. " + LONG_STORY + " Question: which tree came first?")
    turns: list[tuple[list[int], list[int], int]] = []  # (prompt, tokens, reused blocks)
    prompt = first
    for turn in range(2):
        sent, received = mesh.prefill.stats().kv_bytes_sent, mesh.decode.stats().kv_bytes_received
        reservation = reserve_prompt(mesh, f"turn-{turn}", prompt)
        request = worker_pb2.PrefillRequest(
            request_id=f"turn-{turn}", token_ids=prompt, sampling=sampling(max_tokens=16), seed=7,
            decode_address=mesh.decode.address, decode_worker_id=mesh.decode.worker_id,
            decode_block_ids=reservation.block_ids, decode_reused_blocks=reservation.reused_blocks)
        mesh.recorder.read(mesh.prefill, request.request_id)
        mesh.recorder.read(mesh.decode, request.request_id)
        response = mesh.prefill_stub().Prefill(request, timeout=60)
        tokens = tokens_of(mesh.recorder.stream(request.request_id))
        shipped = blocks_for(len(prompt)) - reservation.reused_blocks
        assert (response.transfer.blocks, response.transfer.bytes) == (shipped, shipped * BLOCK_BYTES)
        assert wait_idle(mesh.decode).kv_bytes_received - received == shipped * BLOCK_BYTES
        assert mesh.prefill.stats().kv_bytes_sent - sent == shipped * BLOCK_BYTES
        turns.append((prompt, tokens, reservation.reused_blocks))
        prompt = prompt + tokens + codec.encode(" Question: and which tree came last?")
    assert turns[0][2] == 0
    # The decode worker cached every full block of the first turn's KV (all its tokens but the last).
    computed = len(first) + len(turns[0][1]) - 1
    assert turns[1][2] == min(computed // BLOCK_SIZE, (len(turns[1][0]) - 1) // BLOCK_SIZE) >= 10
    references = reference_outputs(default_model_dir, [p for p, _, _ in turns], 16)
    for turn, ((_, tokens, _), reference) in enumerate(zip(turns, references)):
        assert_matches(tokens, reference, f"turn {turn}")


def test_the_schedulers_batch_policy_sets_the_chunk_size(mesh):
    before = mesh.prefill.stats().iterations
    response = prefill(mesh, "policy", [2000 + i for i in range(600)], None, max_tokens=1)
    assert response.cached_tokens == 0
    assert mesh.prefill.stats().iterations - before == 3  # 256 + 256 + 88 tokens


def test_reserve_push_and_release_errors(mesh):
    stub = mesh.decode_stub()
    too_many = (NUM_BLOCKS + 1) * BLOCK_SIZE
    with pytest.raises(grpc.RpcError) as refused:
        stub.Reserve(worker_pb2.ReserveRequest(request_id="huge", num_tokens=too_many), timeout=RPC_S)
    assert (refused.value.code(), refused.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"num_tokens: {too_many} tokens need more KV blocks than decode worker {mesh.decode.worker_id} has "
        f"({NUM_BLOCKS})")
    # What fits the worker but not its free blocks now is worth a retry.
    stub.Reserve(worker_pb2.ReserveRequest(request_id="hog", num_tokens=NUM_BLOCKS * BLOCK_SIZE), timeout=RPC_S)
    with pytest.raises(grpc.RpcError) as busy:
        stub.Reserve(worker_pb2.ReserveRequest(request_id="busy", num_tokens=BLOCK_SIZE), timeout=RPC_S)
    assert stub.Release(worker_pb2.ReleaseRequest(request_id="hog"), timeout=RPC_S).released_blocks == NUM_BLOCKS
    assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV blocks" in busy.value.details()
    assert ("retry-after", "1") in tuple(busy.value.trailing_metadata())
    # A caller may not pin blocks for longer than the worker's own backstop.
    with pytest.raises(grpc.RpcError) as pinned:
        stub.Reserve(worker_pb2.ReserveRequest(request_id="pinned", num_tokens=8, ttl_ms=2**31 - 1), timeout=RPC_S)
    assert (pinned.value.code(), pinned.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "ttl_ms: must be in [0, 300000] (0: the default, 300 s), got 2147483647")
    with pytest.raises(grpc.RpcError) as many:
        stub.Abort(common_pb2.AbortRequest(request_ids=[f"r{i}" for i in range(1025)]), timeout=RPC_S)
    assert (many.value.code(), many.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "request_ids: at most 1024 ids per Abort, got 1025; send several Aborts")
    assert wait_idle(mesh.decode).reserved_blocks == 0

    reserve(mesh, "twice", [1, 2, 3])
    with pytest.raises(grpc.RpcError) as duplicate:
        reserve(mesh, "twice", [1, 2, 3])
    assert duplicate.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    push = kv_transfer_pb2_grpc.KvTransferServiceStub(mesh.decode.channel).Push
    header = kv_transfer_pb2.KvRequestHeader(prompt_token_ids=[1, 2, 3], output_token_ids=[4], sampling=sampling())
    with pytest.raises(grpc.RpcError) as unknown:
        push(iter([kv_transfer_pb2.KvChunk(request_id="nobody", header=header)]), timeout=RPC_S)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    bad = kv_transfer_pb2.KvChunk(request_id="twice", header=header, layer=0, first_block=0, num_blocks=1,
                                  dtype="float16", shape=[2, 1, 16, 3, 64], data=b"\0" * 12288)
    with pytest.raises(grpc.RpcError) as mismatch:
        push(iter([bad]), timeout=RPC_S)
    assert mismatch.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dtype" in mismatch.value.details()
    # A failed push frees the reservation: its KV is incomplete.
    assert stub.Release(worker_pb2.ReleaseRequest(request_id="twice"), timeout=RPC_S).released_blocks == 0
    assert wait_idle(mesh.decode).reserved_blocks == 0


def test_kv_crosses_through_shared_memory_on_one_host_and_a_segment_out_of_reach_is_refused(mesh):
    # Both workers run on this host: the prefill worker probed the decode worker and ships through memory.
    prompt = [3000 + i for i in range(40)]
    response = prefill(mesh, "shm-here", prompt, reserve(mesh, "shm-here", prompt), max_tokens=2)
    assert response.transfer.bytes == blocks_for(len(prompt)) * BLOCK_BYTES
    assert len(tokens_of(mesh.recorder.stream("shm-here"))) == 2
    assert (f"KV for decode worker {mesh.decode.address} goes through shared memory (same host)"
            in mesh.prefill.log.read_text())
    kv = kv_transfer_pb2_grpc.KvTransferServiceStub(mesh.decode.channel)
    away = kv_transfer_pb2.ShmSegment(pid=1, fd=999, inode=1, size=4096)
    answer = kv.ProbeShm(kv_transfer_pb2.ShmProbe(segment=away, nonce=b"n" * 16), timeout=RPC_S)
    assert not answer.visible and answer.reason.startswith("cannot open the sender's segment /proc/1/fd/999: ")
    with pytest.raises(grpc.RpcError) as empty:
        kv.ProbeShm(kv_transfer_pb2.ShmProbe(segment=away), timeout=RPC_S)
    assert (empty.value.code(), empty.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "nonce: is empty; a probe segment starts with the nonce it carries")

    reserve(mesh, "shm-away", [1, 2, 3])
    header = kv_transfer_pb2.KvRequestHeader(prompt_token_ids=[1, 2, 3], output_token_ids=[4], sampling=sampling(),
                                             shm_segment=away)
    chunk = kv_transfer_pb2.KvChunk(request_id="shm-away", header=header, layer=0, first_block=0, num_blocks=1,
                                    dtype="float32", shape=[2, 1, 16, 3, 64])
    with pytest.raises(grpc.RpcError) as refused:
        kv.Push(iter([chunk]), timeout=RPC_S)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details().startswith(f"decode worker {mesh.decode.worker_id} cannot read the KV of request "
                                              "'shm-away' from shared memory: cannot open the sender's segment")
    assert refused.value.details().endswith("; ship it over gRPC")
    release = worker_pb2.ReleaseRequest(request_id="shm-away")
    wait_until(lambda: mesh.decode_stub().Release(release, timeout=RPC_S).released_blocks == 0,
               "the refused push's blocks freed")
    assert wait_idle(mesh.decode).reserved_blocks == 0


def test_a_streamed_push_cut_before_its_first_token_admits_nothing(mesh):
    """A sender streaming layers while it prefills sends the first token on its last message; a
    stream that ends without it (the sender failed midway) leaves nothing: the reservation is freed."""
    from services.runtime.kv_shm import Segment

    reserve(mesh, "cut-short", [1, 2, 3])
    segment = Segment(BLOCK_BYTES)  # one block of every layer, as the sender gathered it
    try:
        ident = kv_transfer_pb2.ShmSegment(pid=segment.id.pid, fd=segment.id.fd, inode=segment.id.inode,
                                           size=segment.id.size)
        header = kv_transfer_pb2.KvRequestHeader(prompt_token_ids=[1, 2, 3], sampling=sampling(), shm_segment=ident)
        layers = kv_transfer_pb2.KvChunk(request_id="cut-short", header=header, layer=0, num_layers=NUM_LAYERS,
                                         first_block=0, num_blocks=1, dtype="float32", shape=[2, 1, 16, 3, 64])
        with pytest.raises(grpc.RpcError) as cut:
            kv_transfer_pb2_grpc.KvTransferServiceStub(mesh.decode.channel).Push(iter([layers]), timeout=RPC_S)
    finally:
        segment.close()
    assert (cut.value.code(), cut.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "header: needs the first output token id, in the first chunk's header "
                                          "or, when that has none, in the last chunk's")
    wait_until(lambda: mesh.decode_stub().Release(worker_pb2.ReleaseRequest(request_id="cut-short"),
                                                  timeout=RPC_S).released_blocks == 0, "the cut push's blocks freed")
    assert wait_idle(mesh.decode).reserved_blocks == 0


def test_a_push_is_admitted_once_its_announced_chunks_are_in_while_the_sender_keeps_the_stream_open(mesh):
    """The decode worker admits the request when the last chunk the header announced is in, without
    waiting for the sender to half-close the stream: on a loaded machine that wait was a round of
    both event loops after the first token."""
    reserve(mesh, "open-stream", [1, 2, 3])
    mesh.recorder.read(mesh.decode, "open-stream")
    header = kv_transfer_pb2.KvRequestHeader(prompt_token_ids=[1, 2, 3], output_token_ids=[4], num_chunks=1,
                                             sampling=sampling(max_tokens=3))
    chunk = kv_transfer_pb2.KvChunk(request_id="open-stream", header=header, layer=0, num_layers=NUM_LAYERS,
                                    first_block=0, num_blocks=1, dtype="float32", shape=[2, 1, 16, 3, 64],
                                    data=bytes(BLOCK_BYTES))
    acknowledged = threading.Event()

    def sender() -> Iterator[kv_transfer_pb2.KvChunk]:
        yield chunk
        acknowledged.wait(120)  # the stream stays open until the ack came (or the test gave up)

    push = kv_transfer_pb2_grpc.KvTransferServiceStub(mesh.decode.channel).Push.future(sender(), timeout=120)
    try:
        ack = push.result(timeout=60)
    finally:
        acknowledged.set()
    assert (ack.admitted, ack.chunks, ack.bytes, ack.blocks) == (True, 1, BLOCK_BYTES, 1)
    events = mesh.recorder.stream("open-stream")  # the decode worker's: after the first token, sent with the KV
    assert events[0].output_offset == 1 and sum(len(e.token_ids) for e in events) == 2
    assert wait_idle(mesh.decode).reserved_blocks == 0


def test_abort_frees_blocks_on_both_workers(mesh, parity_prompts):
    prompt = parity_prompts[3]
    reservation = reserve(mesh, "long-run", prompt)
    prefill(mesh, "long-run", prompt, reservation, max_tokens=400, ignore_eos=True)
    mesh.recorder.wait(lambda: len(mesh.recorder.events("long-run")) >= 4, 30, "a few decode tokens")
    aborted = mesh.decode_stub().Abort(common_pb2.AbortRequest(request_ids=["long-run", "unknown"]), timeout=RPC_S)
    assert list(aborted.aborted_ids) == ["long-run"]
    wait_idle(mesh.decode)

    # An abort that reaches the prefill worker while it computes the prompt ends it there.
    uncached = [1000 + i for i in range(600)]  # three prefill iterations (256 + 256 + 88 tokens)
    reservation = reserve(mesh, "early-abort", uncached)
    with futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(prefill, mesh, "early-abort", uncached, reservation, max_tokens=8)
        abort = common_pb2.AbortRequest(request_ids=["early-abort"])
        wait_until(lambda: mesh.prefill_stub().Abort(abort, timeout=RPC_S).aborted_ids, "the abort")
        response = pending.result()
    assert response.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert mesh.decode_stub().Release(worker_pb2.ReleaseRequest(request_id="early-abort"),
                                      timeout=RPC_S).released_blocks
    wait_idle(mesh.prefill)
    wait_idle(mesh.decode)


def test_colocated_worker_matches_hf(mesh, parity_prompts, parity_references):
    picked = [0, 2, 5]
    for i in picked:
        mesh.recorder.read(mesh.colocated, f"colocated-{i}")
    assign(mesh.colocated.channel, *(worker_pb2.RunRequest(request_id=f"colocated-{i}", token_ids=parity_prompts[i],
                                                           sampling=sampling(), seed=3) for i in picked), timeout=10)
    for i in picked:
        events = mesh.recorder.stream(f"colocated-{i}")
        assert {e.worker_id for e in events} == {mesh.colocated.worker_id}
        tokens = tokens_of(events)
        assert_matches(tokens, parity_references[i], f"colocated prompt {i}")
        assert events[-1].usage.completion_tokens == len(tokens)
        assert events[0].timings.time_to_first_token_ms > 0
    stats = wait_idle(mesh.colocated)
    assert stats.max_batch_size > 1 and stats.generated_tokens >= len(picked)
    with pytest.raises(grpc.RpcError) as bad:
        assign(mesh.colocated.channel, worker_pb2.RunRequest(request_id="bad", token_ids=[1],
                                                             sampling=sampling(top_p=0.0)), timeout=RPC_S)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in bad.value.details()


def test_forgotten_worker_registers_again_with_its_whole_cache(mesh):
    recorder, worker_id = mesh.recorder, mesh.prefill.worker_id
    registered = sum(1 for info in recorder.registrations if info.worker_id == worker_id)
    reports = len(recorder.block_reports)
    recorder.forget(worker_id)
    recorder.wait(lambda: sum(1 for i in recorder.registrations if i.worker_id == worker_id) > registered,
                  DEADLINE_S, "the second registration")
    reset = recorder.wait(lambda: [r for r in recorder.block_reports[reports:] if r.worker_id == worker_id
                                   and r.reset], DEADLINE_S, "a full block report")[0]
    before = cache_index([r for r in recorder.block_reports[:reports] if r.worker_id == worker_id])
    assert reset.stored and set(reset.stored) == before


def test_worker_follows_its_scheduler_and_stops_cleanly(tmp_path, default_model_dir):
    """NOT_SERVING until registered; a lost token stream drops the worker's requests (the scheduler
    failed them); a restarted scheduler gets the worker back; SIGTERM deregisters and exits 0."""
    port = free_port()
    worker = spawn_worker("decode", f"127.0.0.1:{port}", tmp_path, "--model", str(default_model_dir))
    schedulers: list[Scheduler] = []
    try:
        # Loaded, and a registration attempt failed: there is no scheduler to register with.
        wait_until(lambda: "scheduler not reachable yet" in worker.log.read_text(), "a failed registration",
                   timeout=90)
        assert check(worker.address) == "NOT_SERVING"
        schedulers.append(start_scheduler(port))
        wait_serving(worker, timeout=30)
        assert [i.worker_id for i in schedulers[0].servicer.registrations] == [worker.worker_id]

        stub = worker_pb2_grpc.DecodeServiceStub(worker.channel)
        stub.Reserve(worker_pb2.ReserveRequest(request_id="orphan", num_tokens=40), timeout=RPC_S)
        assert worker.stats().reserved_blocks == 3
        schedulers[0].server.stop(grace=None)
        wait_until(lambda: worker.stats().reserved_blocks == 0, "the orphaned reservation to be freed")

        schedulers.append(start_scheduler(port))
        restarted = schedulers[1].servicer
        restarted.wait(lambda: restarted.registrations, DEADLINE_S, "the worker to register with the new scheduler")
        restarted.wait(lambda: any(b.worker_id == worker.worker_id for b in restarted.batches), DEADLINE_S,
                       "the token stream to reopen")

        worker.process.send_signal(signal.SIGTERM)
        assert worker.process.wait(timeout=20) == 0
        assert restarted.deregistered == [worker.worker_id]
    finally:
        worker.stop()
        for scheduler in schedulers:
            scheduler.server.stop(grace=None)
