"""A worker's model flags: --model (repeatable, NAME=DIR or DIR), --model-memory, --pin and --preload,
and the plan they make: each catalogue model's weight bytes, the budget (none: the primary's), and
the errors of a flag naming no model; and --shutdown-grace."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.colocated.main import SPEC
from services.common.model_catalogue import ModelCatalogue, ModelCatalogueError
from services.worker.main_common import add_arguments, model_plan, worker_config


LLAMA = {"model_type": "llama", "dtype": "float32", "vocab_size": 32, "hidden_size": 8, "intermediate_size": 16,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}


def _model(root: Path, name: str, elements: int) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(LLAMA))
    save_file({"w": torch.zeros(elements)}, str(path / "model.safetensors"))
    return path


def _config(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser, SPEC)
    return worker_config(parser.parse_args(["--insecure-internal", *argv]), SPEC)


def test_flags(tmp_path):
    a, b = _model(tmp_path, "a", 4), _model(tmp_path, "b", 8)
    config = _config("--model", f"first={a}", "--model", str(b), "--model-memory", "1KiB", "--pin", "b",
                     "--preload", "first", "--preload", "b")
    assert config.model == (f"first={a}", str(b))
    assert (config.model_memory, config.pin, config.preload) == (1024, ("b",), ("first", "b"))
    with pytest.raises(ModelCatalogueError, match=r"^--model x=/nowhere: /nowhere is not a model directory"):
        _config("--model", "x=/nowhere")


def test_plan_sizes_each_model_and_budgets_the_primary_by_default(tmp_path):
    home = tmp_path / "home"
    _model(home / "models", "small", 4)
    broken = home / "models" / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    primary = _model(tmp_path, "big", 64)
    catalogue = ModelCatalogue.from_flags([str(primary)], home)
    config = _config("--model", str(primary))
    plan = model_plan(catalogue, config)
    assert dict(plan.sizes) == {"big": 256, "broken": 0, "small": 16}  # broken: its requests fail, not the worker
    assert plan.budget == 256
    assert model_plan(catalogue, _config("--model", str(primary), "--model-memory", "300")).budget == 300
    with pytest.raises(ValueError) as unknown:
        model_plan(catalogue, _config("--model", str(primary), "--pin", "small", "--pin", "nope"))
    assert str(unknown.value) == "--pin nope: not in the catalogue (big, broken, small)"


def test_the_shutdown_grace_comes_from_its_flag_or_variable_and_is_never_negative(monkeypatch, capsys):
    assert _config().shutdown_grace == 10.0
    assert _config("--shutdown-grace", "0").shutdown_grace == 0.0
    monkeypatch.setenv("TANDEM_SHUTDOWN_GRACE", "120")
    assert _config().shutdown_grace == 120.0
    with pytest.raises(SystemExit):
        _config("--shutdown-grace", "-1")
    assert "argument --shutdown-grace: must be >= 0 seconds, got -1" in capsys.readouterr().err
