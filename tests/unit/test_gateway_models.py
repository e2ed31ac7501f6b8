"""The gateway's models (services/gateway/models.py): every catalogue model served by name, its
tokenizer and limits loaded on first use and kept, unknown names refused naming the served ones,
and the listings of both doors (/v1/models, /v1/models/{id}, ListModels) carrying how many
workers hold each model, from the scheduler's Stats (the first scheduler that answers)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider

from services.common.errors import FailedPrecondition, InvalidRequest, NotFound
from services.common.grpc_server import INTERNAL_TOKEN_KEY
from services.common.tokenizer import TextCodec
from services.gateway import main as gateway_main
from services.gateway.generation import GenerationPipeline
from services.gateway.http_app import HttpConfig, create_http_app
from services.gateway.models import GatewayModels, LoadedModel, resident_workers
from services.gateway.request import GenerationRequest
from services.gateway.servicer import GenerateServicer
from services.gateway.upstream import Upstream
from tandem.cli.ports import free_port
from tandem.v1 import common_pb2, gateway_pb2, scheduler_pb2
from tests.placing_scheduler import PlacingScheduler
from tests.waiting import START_S, wait_until

TOKEN = "internal-secret"
RESIDENT, LOADING = scheduler_pb2.MODEL_STATE_RESIDENT, scheduler_pb2.MODEL_STATE_LOADING
SERVED = ["smol", "other", "smol:fr"]


def _worker(worker_id: str, model: str, *held: tuple[str, int]) -> scheduler_pb2.WorkerStatus:
    load = scheduler_pb2.WorkerLoad(models=[scheduler_pb2.ModelResidency(name=n, state=s) for n, s in held])
    return scheduler_pb2.WorkerStatus(info=scheduler_pb2.WorkerInfo(worker_id=worker_id, model=model), load=load)


# smol on three workers (one still loading other, one reporting no residency), other on one.
STATS = scheduler_pb2.SchedulerStats(workers=[
    _worker("w1", "smol", ("smol", RESIDENT), ("other", LOADING)),
    _worker("w2", "smol"),
    _worker("w3", "smol", ("other", RESIDENT), ("smol", scheduler_pb2.MODEL_STATE_UNSPECIFIED)),
])  # fmt: skip


class StatsScheduler(PlacingScheduler):
    """Answers Stats with STATS (recording the metadata) and every request with EOS at once."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.submits: list[scheduler_pb2.SubmitRequest] = []
        self.stats_metadata: list[dict[str, str]] = []

    async def Stats(self, request, context) -> scheduler_pb2.SchedulerStats:
        self.stats_metadata.append(dict(context.invocation_metadata()))
        return STATS

    async def events(self, request, context) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        self.submits.append(request)
        yield scheduler_pb2.TokenEvent(request_id=request.request_id, token_ids=[self.codec.eos_token_ids[0]],
                                       finish_reason=common_pb2.FINISH_REASON_STOP,
                                       usage=common_pb2.Usage(prompt_tokens=len(request.token_ids),
                                                              completion_tokens=1))


@pytest.fixture(scope="module")
def codec(default_model_dir: Path) -> TextCodec:
    return TextCodec.from_model_dir(default_model_dir)


@pytest.fixture(scope="module")
def other_model_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's tokenizer without its chat template, and a 1024-token context: all the
    gateway reads of a model (no weights)."""
    directory = tmp_path_factory.mktemp("catalogue") / "other-dir"
    directory.mkdir()
    shutil.copy(default_model_dir / "tokenizer.json", directory)
    tokenizer_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template")
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = json.loads((default_model_dir / "config.json").read_text()) | {"max_position_embeddings": 1024}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture
async def scheduler(codec: TextCodec) -> AsyncIterator[tuple[StatsScheduler, grpc.aio.Channel]]:
    fake = StatsScheduler(codec)
    async with fake.served() as channel:
        yield fake, channel


@pytest.fixture
async def pipeline(default_model_dir, other_model_dir, scheduler) -> AsyncIterator[GenerationPipeline]:
    primary = LoadedModel.from_model_dir("smol", default_model_dir, loras=("fr",))
    models = GatewayModels(primary, {"smol": default_model_dir, "other": other_model_dir})
    unreachable = grpc.aio.insecure_channel("127.0.0.1:9")  # the first scheduler is down: the next answers
    upstream = Upstream([unreachable, scheduler[1]])
    pipeline = GenerationPipeline(primary.codec, primary.model, upstream, TOKEN,
                                  tracer=TracerProvider().get_tracer("test"), models=models)
    yield pipeline
    pipeline.close()
    await unreachable.close()


@pytest.fixture
async def http(pipeline) -> AsyncIterator[httpx.AsyncClient]:
    app = create_http_app(pipeline, HttpConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tandem") as client:
        yield client


def test_resident_workers_counts_each_worker_holding_a_loaded_model() -> None:
    assert resident_workers(STATS) == {"smol": 3, "other": 1}
    assert resident_workers(scheduler_pb2.SchedulerStats()) == {}


async def test_v1_models_lists_every_catalogue_model_and_adapter_with_its_workers(http, pipeline, scheduler):
    body = (await http.get("/v1/models")).json()
    created = pipeline.model.created
    common = {"object": "model", "owned_by": "tandem"}
    assert body["object"] == "list"
    assert body["data"] == [
        {"id": "smol", **common, "created": created, "root": "smol", "max_model_len": 8192,
         "resident": True, "resident_workers": 3},
        {"id": "other", **common, "created": body["data"][1]["created"], "root": "other", "max_model_len": 1024,
         "resident": True, "resident_workers": 1},
        {"id": "smol:fr", **common, "created": created, "root": "smol", "max_model_len": 8192, "parent": "smol",
         "resident": True, "resident_workers": 3},
    ]  # fmt: skip
    assert scheduler[0].stats_metadata[-1][INTERNAL_TOKEN_KEY] == TOKEN


async def test_v1_models_id_answers_one_model_and_404_names_the_served_ones(http):
    other = await http.get("/v1/models/other")
    assert other.status_code == 200
    assert {k: other.json()[k] for k in ("id", "max_model_len", "resident", "resident_workers")} == {
        "id": "other", "max_model_len": 1024, "resident": True, "resident_workers": 1}
    missing = await http.get("/v1/models/gpt-4o")
    assert missing.status_code == 404
    assert missing.json()["error"] == {
        "message": "the model 'gpt-4o' does not exist; this server serves 'smol', 'other', 'smol:fr' (GET /v1/models)",
        "type": "not_found_error", "param": "model", "code": "model_not_found"}


async def test_grpc_list_models_carries_the_residency(pipeline):
    response = await GenerateServicer(pipeline, 60.0).ListModels(gateway_pb2.ListModelsRequest(), None)
    assert [(m.id, m.max_model_len, m.has_chat_template, m.resident, m.resident_workers) for m in response.models] == [
        ("smol", 8192, True, True, 3), ("other", 1024, False, True, 1), ("smol:fr", 8192, True, True, 3)]


async def test_listing_answers_not_resident_when_no_scheduler_answers(default_model_dir, codec):
    primary = LoadedModel.from_model_dir("smol", default_model_dir)
    down = grpc.aio.insecure_channel("127.0.0.1:9")
    pipeline = GenerationPipeline(codec, primary.model, Upstream([down]), models=GatewayModels(primary))
    try:
        (entry,) = await pipeline.model_entries()
        assert (entry.id, entry.resident, entry.resident_workers) == ("smol", False, 0)
    finally:
        pipeline.close()
        await down.close()


async def test_another_model_loads_once_on_first_use_and_runs_under_its_name(pipeline, scheduler, codec, monkeypatch):
    loads: list[str] = []
    original = LoadedModel.from_model_dir

    def counting(name: str, model_dir: Path, loras: tuple[str, ...] = ()) -> LoadedModel:
        loads.append(name)
        return original(name, model_dir, loras)

    monkeypatch.setattr(LoadedModel, "from_model_dir", staticmethod(counting))
    requests = [GenerationRequest(model="other", prompt=f"Hello {i}") for i in range(3)]
    assert await asyncio.gather(*map(pipeline.tokenize, requests)) == [codec.encode(f"Hello {i}") for i in range(3)]
    generation = await pipeline.start(GenerationRequest(model="other", prompt="Hello"), timeout=30)
    chunks = [chunk async for chunk in generation]
    assert loads == ["other"]  # once, for four requests
    assert chunks[-1].finish_reason == "stop"
    assert [(s.model, s.lora) for s in scheduler[0].submits] == [("other", "")]
    with pytest.raises(InvalidRequest) as error:  # its own tokenizer config: no chat template
        await pipeline.tokenize(GenerationRequest(model="other", messages=[{"role": "user", "content": "Hi"}]))
    assert error.value.field == "messages"
    adapter = await pipeline.start(GenerationRequest(model="smol:fr", prompt="Hello"), timeout=30)
    [chunk async for chunk in adapter]
    assert [(s.model, s.lora) for s in scheduler[0].submits][1:] == [("smol", "fr")]


async def test_an_unknown_model_is_not_found_naming_the_served_ones(pipeline, scheduler):
    for name in ("gpt-4o", "other:fr", "smol:de"):
        with pytest.raises(NotFound) as error:
            await pipeline.start(GenerationRequest(model=name, prompt="Hello"), timeout=30)
        assert error.value.message == f"model {name!r} not found; this gateway serves 'smol', 'other', 'smol:fr'"
    assert scheduler[0].submits == []


async def test_a_catalogue_model_that_cannot_load_fails_its_requests_naming_the_directory(default_model_dir, codec,
                                                                                          tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(default_model_dir / "config.json", broken)  # no tokenizer.json
    models = GatewayModels(LoadedModel.from_model_dir("smol", default_model_dir), {"broken": broken})
    for _ in range(2):  # not cached: a fixed directory serves the next request
        with pytest.raises(FailedPrecondition) as error:
            await models.for_request("broken")
        assert error.value.message.startswith(f"model 'broken' cannot be served from {broken}: ")
        assert "tokenizer.json: missing" in error.value.message
    assert (await models.for_request("")).model.name == "smol"
    assert [entry.id for entry in await models.entries({})] == ["smol"]  # the listing leaves it out


async def test_http_requests_for_another_model_are_answered_under_its_name_and_limits(http, scheduler, codec):
    completion = await http.post("/v1/completions", json={"model": "other", "prompt": "Hello", "max_tokens": 1})
    assert (completion.status_code, completion.json()["model"]) == (200, "other")
    assert scheduler[0].submits[-1].model == "other"
    tokenized = await http.post("/tokenize", json={"model": "other", "prompt": "Hello"})
    assert tokenized.json() == {"tokens": codec.encode("Hello"), "count": len(codec.encode("Hello")),
                                "max_model_len": 1024}
    detokenized = await http.post("/detokenize", json={"model": "other", "tokens": codec.encode("Hello")})
    assert detokenized.json() == {"prompt": "Hello"}
    unknown = await http.post("/v1/completions", json={"model": "gpt-4o", "prompt": "Hello"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == ("model 'gpt-4o' not found; this gateway serves 'smol', 'other', "
                                                  "'smol:fr'")


def test_the_gateway_command_serves_each_model_flag_and_the_models_under_tandem_home(
    default_model_dir, other_model_dir, tmp_path
) -> None:
    home = tmp_path / "home"
    shutil.copytree(other_model_dir, home / "models" / "found")  # served under its directory's name
    grpc_port, http_port = free_port(), free_port()
    scheduler_port = free_port()  # no scheduler listens: nothing is resident
    env = {**os.environ, "TANDEM_HOME": str(home), "TANDEM_RUN_DIR": str(tmp_path / "run")}
    argv = [sys.executable, "-m", "tandem.cli", "gateway", "--insecure-internal", "--port", str(grpc_port),
            "--http-port", str(http_port), "--scheduler", f"127.0.0.1:{scheduler_port}",
            "--model", f"smol={default_model_dir}", "--model", str(other_model_dir)]
    log = tmp_path / "gateway.log"
    with log.open("wb") as output:
        gateway = subprocess.Popen(argv, env=env, stdout=output, stderr=subprocess.STDOUT)
    try:
        def listing() -> list[tuple[str, bool, int]] | None:
            assert gateway.poll() is None, log.read_text()
            try:
                cards = httpx.get(f"http://127.0.0.1:{http_port}/v1/models", timeout=5).json()["data"]
            except httpx.TransportError:
                return None
            return [(card["id"], card["resident"], card["resident_workers"]) for card in cards]

        # The gateway's start (imports, two tokenizers) took over 30 s at load 14; one that exits fails at once.
        assert wait_until(listing, "the gateway's model listing", timeout=START_S) == [
            ("smol", False, 0), ("other-dir", False, 0), ("found", False, 0)]
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)


def test_a_bad_model_flag_stops_the_gateway_saying_what_to_write(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser(prog="tandem gateway")
    gateway_main.add_arguments(parser)
    args = parser.parse_args(["--insecure-internal", "--model", f"x={tmp_path}"])
    assert gateway_main.main(args) == 2
    assert capsys.readouterr().err.endswith(
        f"tandem gateway: --model x={tmp_path}: {tmp_path} is not a model directory (no config.json)\n")
