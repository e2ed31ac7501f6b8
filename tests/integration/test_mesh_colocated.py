"""The colocated baseline behind the same scheduler: one process prefills and decodes, no transfer."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.hf_reference import MAX_NEW_TOKENS, assert_matches
from tests.mesh import Mesh, collect, greedy_request
from tests.waiting import DEADLINE_S


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, default_model_dir):
    started = Mesh.start("--mode", "colocated", "--model", str(default_model_dir),
                         env={"TANDEM_KV_MEMORY": "256MiB", "TANDEM_THREADS": "1"},
                         run_dir=tmp_path_factory.mktemp("colocated"))
    yield started
    started.stop()


def test_concurrent_greedy_requests_match_hf(mesh, parity_prompts, parity_references):
    assert mesh.names("prefill") == [] and mesh.names("decode") == []
    with ThreadPoolExecutor(len(parity_prompts)) as pool:
        results = list(pool.map(lambda p: collect(mesh.gateway().Generate(greedy_request(p, MAX_NEW_TOKENS),
                                                                           timeout=300)), parity_prompts))
    for i, ((tokens, messages), ref) in enumerate(zip(results, parity_references)):
        assert_matches(tokens, ref, f"colocated prompt {i}")
        assert messages[-1].usage.completion_tokens == len(tokens)
    (worker,) = mesh.names("colocated")
    stats = mesh.worker_stats(worker)
    assert stats.max_batch_size > 1 and stats.kv_bytes_received == 0 and stats.kv_bytes_sent == 0
    mesh.wait_idle(DEADLINE_S)
