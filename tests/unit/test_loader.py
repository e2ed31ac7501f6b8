"""Loading refuses what it cannot load, with a message naming the file and what was expected."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from services.common.model_config import ModelConfig, ModelLoadError
from services.runtime.attention import TorchAttention
from services.runtime.model import CausalLM

CONFIG = dict(model_type="llama", vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True)


def weights(hidden=8, inter=16, vocab=32, kv=4) -> dict[str, torch.Tensor]:
    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": torch.zeros(vocab, hidden), "model.norm.weight": torch.ones(hidden),
        p + "input_layernorm.weight": torch.ones(hidden), p + "post_attention_layernorm.weight": torch.ones(hidden),
        p + "self_attn.q_proj.weight": torch.zeros(hidden, hidden), p + "self_attn.k_proj.weight": torch.zeros(kv, hidden),
        p + "self_attn.v_proj.weight": torch.zeros(kv, hidden), p + "self_attn.o_proj.weight": torch.zeros(hidden, hidden),
        p + "mlp.gate_proj.weight": torch.zeros(inter, hidden), p + "mlp.up_proj.weight": torch.zeros(inter, hidden),
        p + "mlp.down_proj.weight": torch.zeros(hidden, inter),
    }


def write_model(directory, config=CONFIG, tensors=None):
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors if tensors is not None else weights(), str(directory / "model.safetensors"))
    return directory


def load(directory):
    return CausalLM.from_model_dir(directory, TorchAttention())


def test_a_valid_directory_loads(tmp_path):
    model = load(write_model(tmp_path))
    assert model.config.num_kv_heads == 1 and model.lm_head.weight is model.embed


def test_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config.json: missing; a model directory needs an HF config.json"):
        load(tmp_path)


def test_unsupported_architecture(tmp_path):
    write_model(tmp_path, {**CONFIG, "model_type": "gpt2"})
    with pytest.raises(ModelLoadError, match=r"model_type 'gpt2' is not supported; expected one of llama, mistral"):
        load(tmp_path)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth"])
def test_pickle_checkpoints_are_refused(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / name).write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match=rf"{name}: pickle checkpoints are refused .* convert the weights to safetensors"):
        load(tmp_path)


def test_no_weights_at_all(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors weights found"):
        load(tmp_path)


def test_missing_shard_of_an_index(tmp_path):
    write_model(tmp_path)
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"lists shard model-00002-of-00002.safetensors which is missing"):
        load(tmp_path)


def test_sharded_weights_load(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    tensors = weights()
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {n: f"model-0000{1 if i < half else 2}-of-00002.safetensors" for i, n in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert load(tmp_path).config.num_layers == 1


def test_tensor_of_the_wrong_shape(tmp_path):
    write_model(tmp_path, tensors=weights(kv=8))
    with pytest.raises(ModelLoadError, match=r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape \(8, 8\), "
                                             r"expected \(4, 8\) from config.json"):
        load(tmp_path)


def test_missing_tensor(tmp_path):
    tensors = weights()
    del tensors["model.layers.0.mlp.down_proj.weight"]
    write_model(tmp_path, tensors=tensors)
    with pytest.raises(ModelLoadError, match=r"tensor 'model.layers.0.mlp.down_proj.weight' is missing"):
        load(tmp_path)


def test_unsupported_rope_type(tmp_path):
    with pytest.raises(ModelLoadError, match=r"rope_type 'yarn' is not supported"):
        ModelConfig.from_dict({**CONFIG, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
