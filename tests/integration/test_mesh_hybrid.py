"""`tandem up --mode hybrid` as real processes: the decode worker also serves Assign, and the scheduler
prefills a short prompt there (no KV transfer) and a long one on the prefill worker (KV transfer),
both token-exact against HF greedy; the decision is on the route span and in the scheduler's
/metrics. Without a step-cost model yet, the prompt-length rule decides (--local-prefill-tokens 32)."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.spans import Attr, SpanName, SpanRecord, load_span_files
from tandem.v1 import gateway_pb2
from tests.hf_reference import MAX_NEW_TOKENS, PARITY_PROMPTS, assert_matches
from tests.mesh import Mesh, collect, greedy_request
from tests.waiting import DEADLINE_S, wait_until

LOCAL_PREFILL_TOKENS = 32
SHORT, LONG = PARITY_PROMPTS.index("Hello"), 2  # "Hello" is 1 token; the story's summary prompt far more than 32
ENV = {"TANDEM_KV_MEMORY": "256MiB", "TANDEM_THREADS": "1", "TANDEM_LOCAL_PREFILL_TOKENS": str(LOCAL_PREFILL_TOKENS),
       "OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ""}  # spans go to the run directory


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hybrid")


@pytest.fixture(scope="module")
def mesh(run_dir, default_model_dir):
    started = Mesh.start("--mode", "hybrid", "--model", str(default_model_dir), env=ENV, run_dir=run_dir)
    yield started
    started.stop()


def generate(mesh: Mesh, token_ids: list[int]) -> tuple[list[int], list[gateway_pb2.GenerateResponse]]:
    return collect(mesh.gateway().Generate(greedy_request(token_ids, MAX_NEW_TOKENS), timeout=300))


def placements(mesh: Mesh) -> dict[tuple[str, str], float]:
    """tandem:prefill_placement_total by (placement, reason), from the scheduler's /metrics."""
    with urllib.request.urlopen(mesh.endpoint("scheduler", "metrics").address, timeout=10) as response:
        text = response.read().decode()
    return {(s.labels["placement"], s.labels["reason"]): s.value
            for family in text_string_to_metric_families(text) if family.name == "tandem:prefill_placement"
            for s in family.samples if s.name == "tandem:prefill_placement_total"}


def route_span(run_dir: Path, request_id: str) -> SpanRecord:
    """The scheduler's span of the request, which carries its routing decision (written as the request ends)."""
    def found() -> SpanRecord | None:
        return next((s for s in load_span_files(run_dir).spans
                     if s.name == SpanName.SCHEDULER_SUBMIT and s.request_id == request_id), None)

    return wait_until(found, f"the scheduler.submit span of {request_id}")


def test_a_short_prompt_prefills_on_the_decode_worker_a_long_one_on_the_prefill_worker(
        mesh, run_dir, parity_prompts, parity_references):
    decode, prefill = (f"{role}-{mesh.endpoint(f'{role}-0').address}" for role in ("decode", "prefill"))
    assert len(parity_prompts[SHORT]) <= LOCAL_PREFILL_TOKENS < len(parity_prompts[LONG])

    tokens, messages = generate(mesh, parity_prompts[SHORT])
    assert_matches(tokens, parity_references[SHORT], "hybrid, local prefill")
    route = mesh.scheduler_stats().recent_routes[-1]
    assert (route.request_id, route.prefill_worker_id, route.decode_worker_id, route.reserved_blocks) == (
        messages[0].request_id, decode, decode, 0)
    assert mesh.worker_stats("decode-0").kv_bytes_received == 0
    assert placements(mesh) == {("local", "short_prompt"): 1.0}
    span = route_span(run_dir, messages[0].request_id)
    assert (span.attributes[Attr.PREFILL_PLACEMENT], span.attributes[Attr.PREFILL_PLACEMENT_REASON],
            span.attributes[Attr.PREFILL_UNCACHED_TOKENS]) == ("local", "short_prompt", len(parity_prompts[SHORT]))

    tokens, messages = generate(mesh, parity_prompts[LONG])
    assert_matches(tokens, parity_references[LONG], "hybrid, remote prefill")
    route = mesh.scheduler_stats().recent_routes[-1]
    assert (route.request_id, route.prefill_worker_id, route.decode_worker_id) == (
        messages[0].request_id, prefill, decode)
    assert mesh.worker_stats("decode-0").kv_bytes_received > 0
    assert placements(mesh) == {("local", "short_prompt"): 1.0, ("remote", "long_prompt"): 1.0}
    span = route_span(run_dir, messages[0].request_id)
    assert (span.attributes[Attr.PREFILL_PLACEMENT], span.attributes[Attr.PREFILL_PLACEMENT_REASON]) == (
        "remote", "long_prompt")
    mesh.wait_idle(DEADLINE_S)
