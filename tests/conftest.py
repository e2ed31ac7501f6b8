"""Fixtures shared by the whole suite: the default model, its parity prompts and the HF reference."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.hf_reference import Reference

pytest_plugins = ["tests.redis_fixture"]

# The suite starts services while it talks gRPC: keep gRPC's fork handlers off, as the tandem
# command does (tandem/cli/main.py says why).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# `tandem up` the suite starts serves float32 with dense weights, not its probed default: the mesh
# tests compare tokens with HF's fp32 (reduced precision has tests/integration/test_precision_quality.py).
os.environ.setdefault("TANDEM_DTYPE", "float32")
os.environ.setdefault("TANDEM_QUANTIZATION", "none")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model's HF directory, converted on first use (about 20 s, once per cache)."""
    from services.common.model_store import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def parity_prompts(default_model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    from tests.hf_reference import PARITY_PROMPTS

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return [tokenizer(text)["input_ids"] for text in PARITY_PROMPTS]


@pytest.fixture(scope="session")
def parity_references(default_model_dir, parity_prompts) -> list[Reference]:
    """HF transformers' greedy output for each parity prompt, computed once per cache (tests/hf_reference.py
    says why; torch is imported only here)."""
    from tests.hf_reference import MAX_NEW_TOKENS, cached_reference_outputs

    return cached_reference_outputs(default_model_dir, parity_prompts, MAX_NEW_TOKENS)
