"""The model catalogue: directories under $TANDEM_HOME/models plus --model flags, the primary
model, and the errors a bad flag or an unknown name gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.model_catalogue import ModelCatalogue, ModelCatalogueError, UnknownModelError


def _model(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def _no_default() -> Path:
    raise AssertionError("the default model was asked for although --model was given")


def test_flags_then_home_models_primary_first(tmp_path):
    home = tmp_path / "home"
    a, b = _model(home / "models", "a"), _model(home / "models", "b")
    (home / "models" / "not-a-model").mkdir()
    _model(home / "models", ".staging")
    own = _model(tmp_path / "elsewhere", "own")
    catalogue = ModelCatalogue.from_flags([f"mine={own}", str(b)], home, _no_default)
    assert catalogue.primary == "mine"
    assert catalogue.names() == ("mine", "b", "a")
    assert catalogue.path("mine") == own and catalogue.path("a") == a and catalogue.path("b") == b
    assert "a" in catalogue and "own" not in catalogue


def test_no_flag_serves_the_default_model_first(tmp_path):
    home = tmp_path / "home"
    default = _model(home / "models", "SmolLM2-135M-Instruct")
    _model(home / "models", "Another")
    catalogue = ModelCatalogue.from_flags([], home, lambda: default)
    assert catalogue.primary == "SmolLM2-135M-Instruct"
    assert catalogue.names() == ("SmolLM2-135M-Instruct", "Another")


def test_flag_name_wins_over_a_home_directory(tmp_path):
    home = tmp_path / "home"
    _model(home / "models", "x")
    other = _model(tmp_path / "other", "y")
    catalogue = ModelCatalogue.from_flags([f"x={other}"], home, _no_default)
    assert catalogue.path("x") == other and catalogue.names() == ("x",)


def test_unknown_model_names_the_catalogue(tmp_path):
    catalogue = ModelCatalogue.from_flags([str(_model(tmp_path, "m"))], tmp_path / "home", _no_default)
    with pytest.raises(UnknownModelError) as caught:
        catalogue.path("nope")
    assert str(caught.value) == (
        "model 'nope' is not in this worker's catalogue (m); put its directory under $TANDEM_HOME/models "
        "or start the worker with --model nope=DIR")


def test_bad_flags(tmp_path):
    home = tmp_path / "home"
    m = _model(tmp_path, "m")
    with pytest.raises(ModelCatalogueError, match=r"^--model x=/nowhere: /nowhere is not a model directory \(no config.json\)$"):
        ModelCatalogue.from_flags(["x=/nowhere"], home, _no_default)
    with pytest.raises(ModelCatalogueError, match="NAME without ':'"):
        ModelCatalogue.from_flags([f"a:b={m}"], home, _no_default)
    with pytest.raises(ModelCatalogueError, match="NAME without ':'"):
        ModelCatalogue.from_flags([f"={m}"], home, _no_default)
    with pytest.raises(ModelCatalogueError, match=r"^--model names 'm' twice"):
        ModelCatalogue.from_flags([str(m), f"m={m}"], home, _no_default)
