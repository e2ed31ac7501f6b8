"""Session-wide fixtures for tests that run the default model: its prompts and the HF reference."""

from __future__ import annotations

import pytest

from tests.hf_reference import MAX_NEW_TOKENS, PARITY_PROMPTS, Reference, reference_outputs


@pytest.fixture(scope="session")
def parity_prompts(default_model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return [tokenizer(text)["input_ids"] for text in PARITY_PROMPTS]


@pytest.fixture(scope="session")
def parity_references(default_model_dir, parity_prompts) -> list[Reference]:
    return reference_outputs(default_model_dir, parity_prompts, MAX_NEW_TOKENS)
