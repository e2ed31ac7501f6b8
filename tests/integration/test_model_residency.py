"""Models on a shared worker: a real colocated worker whose catalogue holds the default model and a
tiny random-weights Llama (built here into a temporary $TANDEM_HOME/models), with room for one
model's weights. A request for the model not resident loads it (cold start) and gets HF's exact
greedy tokens; the other model is evicted, its prefix-cache blocks reported evicted, and loaded
again on its next request; each load is a worker.model_load span and counted in /metrics.
ModelService pins and unloads; a name outside the catalogue and a model that cannot fit are refused,
and a decode worker refuses KV computed by another model or adapter than its reservation's.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.common.spans import Attr, SpanName
from tandem.v1 import common_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc, scheduler_pb2, worker_pb2, worker_pb2_grpc
from tests.assign import assign
from tests.hf_reference import Reference, assert_matches, reference_outputs
from tests.integration.test_workers import (
    Scheduler,
    Worker,
    cache_index,
    spawn_worker,
    start_scheduler,
    tokens_of,
    wait_serving,
)
from tests.tiny_models import build_tiny
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(300)]

DEFAULT = "SmolLM2-135M-Instruct"
TINY = "TinyLlama-Random"
DEFAULT_WEIGHT_BYTES = 134_515_008 * 4  # fp32, lm_head tied (tests/unit/test_model_store.py)
MAX_TOKENS = 12
RESIDENT = scheduler_pb2.MODEL_STATE_RESIDENT


def build_tiny_llama(default_model_dir: Path, out: Path) -> Path:
    """A 2-layer Llama with random weights (seeded) and the default model's tokenizer, as safetensors."""
    return build_tiny(default_model_dir, out, "LlamaConfig", hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, initializer_range=0.5)  # logits far apart: no near-ties


@dataclass
class Shared:
    scheduler: Scheduler
    worker: Worker
    run_dir: Path
    tiny_dir: Path
    tiny_bytes: int

    @property
    def recorder(self):
        return self.scheduler.servicer

    def run(self, rid: str, prompt: list[int], model: str = "", **fields) -> list[int]:
        self.recorder.read(self.worker, rid)
        sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **fields)
        request = worker_pb2.RunRequest(request_id=rid, token_ids=prompt, model=model, seed=7, sampling=sampling)
        assign(self.worker.channel, request, timeout=120)
        return tokens_of(self.recorder.stream(rid, silence=120))

    def models(self) -> worker_pb2_grpc.ModelServiceStub:
        return worker_pb2_grpc.ModelServiceStub(self.worker.channel)

    def load(self) -> scheduler_pb2.WorkerLoad:
        return self.recorder.loads[self.worker.worker_id]

    def resident(self) -> list[tuple[str, int, bool]]:
        """(name, state, pinned) of each model the latest heartbeat reports."""
        return [(m.name, m.state, m.pinned) for m in self.load().models]

    def wait_resident(self, expected: list[tuple[str, int, bool]]) -> None:
        wait_until(lambda: self.worker.worker_id in self.recorder.loads and self.resident() == expected,
                   f"heartbeat reporting {expected}")

    def metrics(self) -> dict[str, float]:
        """Each sample of the worker's /metrics page, by its line's name and labels."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.worker.metrics_port}/metrics", timeout=5) as response:
            page = response.read().decode()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                if line and not line.startswith("#")}

    def load_spans(self) -> list[dict]:
        spans: list[dict] = []
        for path in self.run_dir.glob("spans-*.jsonl"):
            for line in path.read_text().splitlines():
                record = json.loads(line)
                if record.get("name") == SpanName.MODEL_LOAD and "end_ns" in record:
                    spans.append(record)
        return sorted(spans, key=lambda r: r["start_ns"])


@pytest.fixture(scope="module")
def shared(tmp_path_factory, default_model_dir) -> Iterator[Shared]:
    from services.common.model_store import model_info

    tmp = tmp_path_factory.mktemp("residency")
    tiny_dir = build_tiny_llama(default_model_dir, tmp / "home" / "models" / TINY)
    scheduler = start_scheduler()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TANDEM_HOME", str(tmp / "home"))
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # spans reach the file soon after they end
        worker = spawn_worker("colocated", scheduler.address, tmp, "--model", str(default_model_dir))
    try:
        wait_serving(worker)
        yield Shared(scheduler, worker, tmp / "run", tiny_dir, model_info(tiny_dir).weight_bytes)
    finally:
        worker.stop()
        scheduler.server.stop(grace=None)


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return [tokenizer(text)["input_ids"] for text in (
        "The three primary colors are red, yellow and blue. Mixing red and blue gives",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    )]


@pytest.fixture(scope="module")
def references(default_model_dir, shared, prompts) -> dict[str, list[Reference]]:
    return {DEFAULT: reference_outputs(default_model_dir, prompts, MAX_TOKENS),
            TINY: reference_outputs(shared.tiny_dir, prompts, MAX_TOKENS)}


def test_registers_its_catalogue_and_budget(shared):
    (info,) = shared.recorder.registrations
    assert (info.model, list(info.catalogue)) == (DEFAULT, [DEFAULT, TINY])
    assert info.model_memory_bytes == DEFAULT_WEIGHT_BYTES
    assert [(m.name, m.state, m.pinned, m.weight_bytes) for m in info.load.models] == [
        (DEFAULT, RESIDENT, False, DEFAULT_WEIGHT_BYTES)]
    assert info.load.free_model_memory_bytes == 0


def test_cold_start_evicts_the_idle_model_and_serves_exact_tokens(shared, prompts, references):
    default_tokens = shared.run("warm-default", prompts[0])
    assert_matches(default_tokens, references[DEFAULT][0], "default model, resident")
    reports = shared.recorder.block_reports
    default_blocks = shared.recorder.wait(lambda: cache_index(reports), 10, "the default model's blocks reported")

    tiny_tokens = shared.run("cold-tiny", prompts[0], model=TINY)
    assert_matches(tiny_tokens, references[TINY][0], "tiny model, cold start")
    assert tiny_tokens != default_tokens
    shared.wait_resident([(TINY, RESIDENT, False)])
    assert shared.load().free_model_memory_bytes == DEFAULT_WEIGHT_BYTES - shared.tiny_bytes
    # The default model's blocks left the index with it; the tiny model stored the same prompt under
    # other hashes (the served model keys the chain), so it holds none of the default model's blocks.
    assert any(set(r.evicted) >= default_blocks for r in shared.recorder.block_reports)
    tiny_blocks = shared.recorder.wait(lambda: cache_index(reports), 10, "the tiny model's blocks reported")
    assert tiny_blocks.isdisjoint(default_blocks)

    again = shared.run("reload-default", prompts[1])
    assert_matches(again, references[DEFAULT][1], "default model, reloaded")
    shared.wait_resident([(DEFAULT, RESIDENT, False)])

    spans = wait_until(lambda: s if len(s := shared.load_spans()) == 3 else None, "three worker.model_load spans")
    assert [(s["attributes"][Attr.MODEL_NAME], s["attributes"][Attr.MODEL_EVICTED]) for s in spans] == [
        (DEFAULT, []), (TINY, [DEFAULT]), (DEFAULT, [TINY])]
    assert [s["attributes"][Attr.MODEL_BYTES] for s in spans] == [
        DEFAULT_WEIGHT_BYTES, shared.tiny_bytes, DEFAULT_WEIGHT_BYTES]
    assert all(s["attributes"][Attr.MODEL_LOAD_SECONDS] > 0 for s in spans)

    metrics = shared.metrics()
    worker = shared.worker.address
    assert metrics[f'tandem:model_loads_total{{model_name="{DEFAULT}",worker="{worker}"}}'] == 2
    assert metrics[f'tandem:model_loads_total{{model_name="{TINY}",worker="{worker}"}}'] == 1
    assert metrics[f'tandem:model_load_seconds_count{{model_name="{TINY}",worker="{worker}"}}'] == 1
    assert metrics[f'tandem:models_resident{{model_name="{DEFAULT}",worker="{worker}"}}'] == 1


def test_model_service_pins_and_unloads_and_refusals_name_the_catalogue(shared, prompts):
    stub = shared.models()
    loaded = stub.LoadModel(worker_pb2.LoadModelRequest(model=TINY, pin=True), timeout=120)
    assert (loaded.model.name, loaded.model.state, loaded.model.pinned) == (TINY, RESIDENT, True)
    assert list(loaded.evicted) == [DEFAULT]

    with pytest.raises(grpc.RpcError) as full:
        shared.run("no-room", prompts[0], model=DEFAULT)
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert full.value.details() == (
        f"worker {shared.worker.worker_id}: model '{DEFAULT}' needs {DEFAULT_WEIGHT_BYTES} bytes of "
        f"weights; {DEFAULT_WEIGHT_BYTES - shared.tiny_bytes} of --model-memory {DEFAULT_WEIGHT_BYTES} are free "
        f"and the models holding the rest are busy, pinned or loading ({TINY}); retry later, or on a worker with room")

    with pytest.raises(grpc.RpcError) as unknown:
        shared.run("unknown", prompts[0], model="nope")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert unknown.value.details() == (
        f"model 'nope' is not in the catalogue of worker {shared.worker.worker_id} ({DEFAULT}, {TINY}); put its "
        "directory under $TANDEM_HOME/models or start the worker with --model NAME=DIR")

    assert stub.UnloadModel(worker_pb2.UnloadModelRequest(model=TINY), timeout=30).unloaded is True
    shared.wait_resident([])
    assert shared.load().free_model_memory_bytes == DEFAULT_WEIGHT_BYTES
    assert len(shared.run("after-unload", prompts[1])) == MAX_TOKENS  # the primary loads again on demand


@pytest.fixture(scope="module")
def decode(shared, default_model_dir) -> Iterator[Worker]:
    """A decode worker with the same catalogue (its tiny model not loaded), registered with the same scheduler."""
    tmp = shared.run_dir.parent
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TANDEM_HOME", str(shared.tiny_dir.parent.parent))
        worker = spawn_worker("decode", shared.scheduler.address, tmp, "--model", str(default_model_dir))
    try:
        wait_serving(worker)
        yield worker
    finally:
        worker.stop()


def test_a_kv_push_for_another_model_or_adapter_is_refused(decode, prompts):
    stub = worker_pb2_grpc.DecodeServiceStub(decode.channel)
    push = kv_transfer_pb2_grpc.KvTransferServiceStub(decode.channel).Push
    prompt = prompts[0]
    for rid, model, lora, expected in (
        ("kv-model", TINY, "", f"request 'kv-model': the KV was computed by model '{TINY}', the reservation is for "
                               f"'{DEFAULT}'; KV of one model is no use to another"),
        ("kv-adapter", DEFAULT, "other", "request 'kv-adapter': the KV was computed under adapter 'other', the "
                                         "reservation is for ''; KV of one adapter is no use to another"),
    ):
        stub.Reserve(worker_pb2.ReserveRequest(request_id=rid, num_tokens=len(prompt) + 1, model=DEFAULT), timeout=10)
        header = kv_transfer_pb2.KvRequestHeader(prompt_token_ids=prompt, output_token_ids=[7], model=model, lora=lora,
                                                 num_chunks=1, sampling=common_pb2.SamplingParams(max_tokens=4))
        with pytest.raises(grpc.RpcError) as refused:
            push(iter([kv_transfer_pb2.KvChunk(request_id=rid, header=header)]), timeout=10)
        assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.FAILED_PRECONDITION, expected)
        assert stub.Release(worker_pb2.ReleaseRequest(request_id=rid), timeout=10).released_blocks > 0


@pytest.fixture(scope="module")
def prefill(shared, default_model_dir) -> Iterator[Worker]:
    tmp = shared.run_dir.parent
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TANDEM_HOME", str(shared.tiny_dir.parent.parent))
        worker = spawn_worker("prefill", shared.scheduler.address, tmp, "--model", str(default_model_dir))
    try:
        wait_serving(worker)
        yield worker
    finally:
        worker.stop()


def test_disaggregated_request_for_a_catalogue_model_loads_it_on_both_workers(shared, prefill, decode, prompts,
                                                                             references):
    """Reserve and Prefill name the tiny model: each worker loads it (evicting its idle default model),
    the KV crosses under its name, and the tokens are HF's for that model."""
    rid, prompt = "disagg-tiny", prompts[1]
    recorder = shared.recorder
    recorder.read(prefill, rid)
    recorder.read(decode, rid)
    reservation = worker_pb2_grpc.DecodeServiceStub(decode.channel).Reserve(
        worker_pb2.ReserveRequest(request_id=rid, num_tokens=len(prompt) + 1, model=TINY), timeout=120)
    response = worker_pb2_grpc.PrefillServiceStub(prefill.channel).Prefill(worker_pb2.PrefillRequest(
        request_id=rid, token_ids=prompt, model=TINY, seed=7, decode_address=decode.address,
        decode_block_ids=reservation.block_ids, sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS,
                                                                                    temperature=0.0)), timeout=120)
    assert response.transfer.blocks > 0
    assert_matches(tokens_of(recorder.stream(rid, silence=120)), references[TINY][1], "tiny model, disaggregated")
    for worker in (prefill, decode):
        wait_until(lambda: _held(recorder, worker) == [(TINY, RESIDENT)], f"{worker.role} holding the tiny model alone")


def _held(recorder, worker: Worker) -> list[tuple[str, int]]:
    load = recorder.loads.get(worker.worker_id, scheduler_pb2.WorkerLoad())
    return [(m.name, m.state) for m in load.models]
