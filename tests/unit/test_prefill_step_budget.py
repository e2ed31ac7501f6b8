"""A prefill worker's steps hold one chunk by default, so its prompts prefill in arrival order
(services/prefill/main.py); the roles whose steps hold decodes keep the larger budget."""

from __future__ import annotations

import argparse

import pytest

from services.colocated import main as colocated_main
from services.decode import main as decode_main
from services.prefill import main as prefill_main
from services.worker.main_common import DEFAULT_CHUNK_SIZE, DEFAULT_MAX_BATCHED_TOKENS, worker_config


def _config(role, *argv: str):
    parser = argparse.ArgumentParser()
    role.add_arguments(parser)
    return worker_config(parser.parse_args(["--insecure-internal", *argv]), role.SPEC)


def test_a_prefill_workers_step_budget_is_one_chunk_and_the_other_roles_keep_theirs() -> None:
    prefill = _config(prefill_main)
    assert (prefill.max_batched_tokens, prefill.chunk_size) == (DEFAULT_CHUNK_SIZE, DEFAULT_CHUNK_SIZE) == (512, 512)
    assert prefill.engine_config(precision=None).max_num_batched_tokens == 512
    for role in (decode_main, colocated_main):
        assert _config(role).max_batched_tokens == DEFAULT_MAX_BATCHED_TOKENS == 2048


def test_the_flag_and_its_variable_still_set_a_prefill_workers_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _config(prefill_main, "--max-batched-tokens", "2048").max_batched_tokens == 2048
    monkeypatch.setenv("TANDEM_MAX_BATCHED_TOKENS", "1024")
    assert _config(prefill_main).max_batched_tokens == 1024
