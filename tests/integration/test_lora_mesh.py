"""A LoRA adapter through the whole mesh, disaggregated and colocated: HTTP requests name it as
model "BASE:NAME", the prefill worker computes under it and the KV header carries it to the
decode worker (or one colocated worker does both), and the greedy text equals HF transformers +
PEFT's; /v1/models lists it."""

from __future__ import annotations

import httpx
import pytest
import torch

from services.common.model_store import model_name
from tests.mesh import Mesh

PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, default_model_dir):
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    torch.manual_seed(7)
    config = peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, lora_dropout=0.0,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    directory = tmp_path_factory.mktemp("adapter") / "fr"
    peft.get_peft_model(base, config).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module", params=[(), ("--mode", "colocated")], ids=["disaggregated", "colocated"])
def mesh(request, tmp_path_factory, default_model_dir, adapter_dir):
    started = Mesh.start(*request.param, "--model", str(default_model_dir),
                         env={"TANDEM_KV_MEMORY": "256MiB", "TANDEM_THREADS": "1", "TANDEM_LORA": f"fr={adapter_dir}"},
                         run_dir=tmp_path_factory.mktemp("lora-mesh"))
    yield started
    started.stop()


def _hf_text(model_dir, adapter_dir) -> str:
    import peft
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             min_new_tokens=MAX_TOKENS)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.fixture(scope="module")
def expected(default_model_dir, adapter_dir) -> dict[str, str]:
    """HF's greedy text with the adapter and without, computed once for both meshes."""
    return {"fr": _hf_text(default_model_dir, adapter_dir), "": _hf_text(default_model_dir, None)}


def _complete(mesh: Mesh, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{mesh.http_url}/v1/completions", json=body, timeout=300)


def test_http_request_with_an_adapter_matches_peft(mesh, default_model_dir, expected):
    base = model_name(default_model_dir)
    with_adapter = _complete(mesh, f"{base}:fr")
    assert with_adapter.status_code == 200, with_adapter.text
    plain = _complete(mesh, base)
    assert plain.status_code == 200, plain.text
    assert with_adapter.json()["choices"][0]["text"] == expected["fr"]
    assert plain.json()["choices"][0]["text"] == expected[""] != expected["fr"]


def test_models_list_the_adapter_and_unknown_adapters_are_404(mesh, default_model_dir):
    base = model_name(default_model_dir)
    listed = httpx.get(f"{mesh.http_url}/v1/models", timeout=30).json()["data"]
    assert [(m["id"], m["root"], m.get("parent")) for m in listed] == [(base, base, None), (f"{base}:fr", base, base)]
    assert httpx.get(f"{mesh.http_url}/v1/models/{base}:fr", timeout=30).json()["parent"] == base
    missing = _complete(mesh, f"{base}:nope")
    assert missing.status_code == 404
    assert f"model '{base}:nope' not found; this gateway serves '{base}', '{base}:fr'" in missing.text
