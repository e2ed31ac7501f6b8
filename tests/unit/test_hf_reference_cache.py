"""The parity references are computed once per cache (tests/hf_reference.py): a second session reads
exactly what the first computed, and a change to anything they depend on computes them again."""

from __future__ import annotations

import os

import pytest
import torch

from tests import hf_reference
from tests.hf_reference import Reference, cached_reference_outputs


@pytest.fixture
def computed(monkeypatch, tmp_path) -> list[tuple]:
    """Each computation the cache asks for, answered with a reference of the prompt's ids reversed."""
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    calls: list[tuple] = []

    def compute(model_dir, prompts, max_new_tokens):
        calls.append((model_dir.name, prompts, max_new_tokens))
        return [Reference(ids, ids[::-1][:max_new_tokens], [torch.full((4,), float(i)) for i in ids])
                for ids in prompts]

    monkeypatch.setattr(hf_reference, "reference_outputs", compute)
    return calls


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"weights")
    (path / "config.json").write_text("{}")
    return path


def test_a_second_session_reads_what_the_first_computed(computed, model):
    first = cached_reference_outputs(model, [[1, 2, 3], [4, 5]], 2)
    again = cached_reference_outputs(model, [[1, 2, 3], [4, 5]], 2)
    assert computed == [("model", [[1, 2, 3], [4, 5]], 2)]
    assert [(r.prompt_ids, r.tokens) for r in again] == [([1, 2, 3], [3, 2]), ([4, 5], [5, 4])]
    assert all(torch.equal(a, b) for x, y in zip(first, again) for a, b in zip(x.logits, y.logits, strict=True))
    assert not [p for p in (model.parent / "home" / "hf-references").iterdir() if p.suffix != ".pt"]


def test_other_prompts_a_longer_answer_or_rewritten_weights_are_computed_again(computed, model):
    cached_reference_outputs(model, [[1, 2]], 2)
    cached_reference_outputs(model, [[1, 3]], 2)
    cached_reference_outputs(model, [[1, 3]], 3)
    weights = model / "model.safetensors"
    weights.write_bytes(b"other weights")
    os.utime(weights, ns=(1, 1))
    cached_reference_outputs(model, [[1, 3]], 3)
    assert computed == [("model", [[1, 2]], 2), ("model", [[1, 3]], 2), ("model", [[1, 3]], 3), ("model", [[1, 3]], 3)]
