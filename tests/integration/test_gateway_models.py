"""The gateway's side of several models on a real mesh (`tandem up --mode colocated`): the catalogue
under $TANDEM_HOME/models holds the default model and a tiny random-weights Llama. Both doors list
both, with where the worker holds each (its residency, through the scheduler's Stats); a request
naming the tiny model is submitted under its name, loads it on the worker and gets HF's greedy
tokens; afterwards the listing shows it resident.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tandem.v1 import gateway_pb2
from tests.hf_reference import assert_matches, reference_outputs
from tests.integration.test_model_residency import DEFAULT, TINY, build_tiny_llama
from tests.mesh import Mesh
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(300)]

PROMPT = "The three primary colors are red, yellow and blue. Mixing red and blue gives"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    home = tmp_path_factory.mktemp("gateway-models") / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / DEFAULT).symlink_to(default_model_dir)
    build_tiny_llama(default_model_dir, home / "models" / TINY)
    return home


@pytest.fixture(scope="module")
def mesh(home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    # Room for both models' weights: loading the tiny one evicts nothing.
    started = Mesh.start("--mode", "colocated", "--model", str(home / "models" / DEFAULT), "--dtype", "float32",
                         "--quantization", "none", env={"TANDEM_HOME": str(home), "TANDEM_MODEL_MEMORY": "2GiB"},
                         run_dir=tmp_path_factory.mktemp("gateway-models-run"))
    try:
        yield started
    finally:
        started.stop()


def listing(mesh: Mesh) -> list[tuple[str, bool, int]]:
    cards = httpx.get(f"{mesh.http_url}/v1/models", timeout=30).json()["data"]
    return [(card["id"], card["resident"], card["resident_workers"]) for card in cards]


def test_both_doors_list_every_catalogue_model_with_its_residency(mesh: Mesh) -> None:
    expected = [(DEFAULT, True, 1), (TINY, False, 0)]  # the worker loaded its primary model only
    wait_until(lambda: listing(mesh) == expected, f"/v1/models listing {expected}")
    cards = mesh.gateway().ListModels(gateway_pb2.ListModelsRequest(), timeout=30).models
    assert [(c.id, c.resident, c.resident_workers, c.max_model_len) for c in cards] == [
        (DEFAULT, True, 1, 8192), (TINY, False, 0, 2048)]


def test_a_request_for_another_model_runs_it_under_its_name_and_it_becomes_resident(
    mesh: Mesh, home: Path, default_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    request = gateway_pb2.GenerateRequest(model=TINY, prompt=PROMPT,
                                          sampling={"max_tokens": MAX_TOKENS, "temperature": 0.0})
    responses = list(mesh.gateway().Generate(request, timeout=120))
    prompt_ids = AutoTokenizer.from_pretrained(default_model_dir)(PROMPT)["input_ids"]  # the tiny model's tokenizer
    (reference,) = reference_outputs(home / "models" / TINY, [prompt_ids], MAX_TOKENS)
    assert_matches([t for r in responses for t in r.token_ids], reference, label=TINY)
    completion = httpx.post(f"{mesh.http_url}/v1/completions", timeout=120,
                            json={"model": TINY, "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert (completion.status_code, completion.json()["model"]) == (200, TINY)
    wait_until(lambda: listing(mesh) == [(DEFAULT, True, 1), (TINY, True, 1)], "the tiny model listed resident")
    card = httpx.get(f"{mesh.http_url}/v1/models/{TINY}", timeout=30).json()
    assert (card["id"], card["resident_workers"], card["max_model_len"]) == (TINY, 1, 2048)


def test_tandem_models_lists_and_provisions_through_the_real_services(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem.cli import models

    def run(*argv: str) -> tuple[int, str, str]:
        parser = argparse.ArgumentParser(prog="tandem models")
        models.add_arguments(parser)
        code = models.main(parser.parse_args(list(argv)))
        return (code, *capsys.readouterr())

    monkeypatch.setenv("TANDEM_INTERNAL_TOKEN", mesh.internal_token)
    scheduler = mesh.endpoint("scheduler").address
    worker = f"colocated-{mesh.endpoint('colocated-0').address}"
    assert run("provision", TINY, "--scheduler", scheduler) == (
        0, f"model '{TINY}' is pinned on 1 worker ({scheduler}): {worker}\n", "")
    code, _, err = run("provision", "nope", "--scheduler", scheduler)
    assert (code, err.split(";")[0]) == (
        1, "tandem models provision: NOT_FOUND: no live worker's catalogue holds model 'nope'")
    code, out, _ = run("list", "--url", mesh.http_url)
    assert code == 0 and out.splitlines()[1:] == [f"{DEFAULT}  yes       1        8192",
                                                 f"{TINY}       yes       1        2048"]
