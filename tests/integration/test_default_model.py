"""The converted default model is a plain HF checkpoint: transformers loads it without the GGUF
file and, greedy in fp32, answers the reference question exactly."""

from __future__ import annotations

import pytest

PARIS_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris." + <|im_end|>


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(default_model_dir)


def test_loads_as_plain_fp32_with_tied_embeddings(hf_model):
    import torch

    assert hf_model.dtype == torch.float32
    assert getattr(hf_model.config, "quantization_config", None) is None
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()


def test_greedy_chat_answers_paris(default_model_dir, hf_model):
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = hf_model.generate(**prompt, do_sample=False, max_new_tokens=16)
    new_ids = output[0, prompt["input_ids"].shape[1] :].tolist()
    assert new_ids == PARIS_IDS
    assert tokenizer.decode(new_ids, skip_special_tokens=True) == "The capital of France is Paris."
