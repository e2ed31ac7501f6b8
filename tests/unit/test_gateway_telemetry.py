"""The gateway's record of a request's end: GenAI span attributes and status, and its metrics."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from services.common.errors import Unavailable
from services.common.metrics import ServiceMetrics
from services.gateway import telemetry
from tandem.v1 import common_pb2


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def _value(metrics: ServiceMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "smol", "worker": "gateway", **labels})


def test_a_finished_request_carries_the_response_attributes_and_is_counted(spans) -> None:
    provider, exporter = spans
    metrics = ServiceMetrics("smol", "gateway")
    span = provider.get_tracer("t").start_span("chat smol", attributes=telemetry.start_attributes("smol", ("127.0.0.1", 8000)))
    telemetry.record_finished(span, metrics, "req-1", "length", common_pb2.Usage(prompt_tokens=12, completion_tokens=7),
                              0.5)
    span.end()
    (finished,) = exporter.get_finished_spans()
    assert dict(finished.attributes) == {
        "gen_ai.provider.name": "tandem", "gen_ai.response.model": "smol", "gen_ai.response.id": "req-1",
        "gen_ai.response.finish_reasons": ("length",), "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 7, "server.address": "127.0.0.1", "server.port": 8000}
    assert finished.status.status_code is StatusCode.UNSET
    assert _value(metrics, "tandem:request_success_total", finished_reason="length") == 1
    assert _value(metrics, "tandem:request_prompt_tokens_bucket", le="10.0") == 0
    assert _value(metrics, "tandem:request_prompt_tokens_bucket", le="20.0") == 1
    assert _value(metrics, "tandem:request_generation_tokens_sum") == 7
    assert _value(metrics, "tandem:e2e_request_latency_seconds_sum") == 0.5


def test_a_door_that_does_not_know_its_address_sets_no_server_attributes() -> None:
    assert telemetry.start_attributes("smol", None) == {"gen_ai.provider.name": "tandem", "gen_ai.response.model": "smol"}


def test_an_abandoned_request_is_an_error_and_counted_as_abort(spans) -> None:
    provider, exporter = spans
    metrics = ServiceMetrics("smol", "gateway")
    span = provider.get_tracer("t").start_span("chat smol")
    telemetry.record_abandoned(span, metrics, prompt_tokens=30, output_tokens=2, elapsed_s=1.0, failed=False)
    span.end()
    (finished,) = exporter.get_finished_spans()
    assert finished.attributes["error.type"] == "cancelled"
    assert finished.status.status_code is StatusCode.ERROR
    assert _value(metrics, "tandem:request_success_total", finished_reason="abort") == 1
    assert _value(metrics, "tandem:request_prompt_tokens_sum") == 30
    assert _value(metrics, "tandem:request_generation_tokens_sum") == 2


def test_a_failed_request_keeps_its_error_type_and_is_counted_as_abort(spans) -> None:
    provider, exporter = spans
    metrics = ServiceMetrics("smol", "gateway")
    span = provider.get_tracer("t").start_span("chat smol")
    telemetry.record_failed(span, Unavailable("no worker"), "Unavailable: no worker")
    telemetry.record_abandoned(span, metrics, prompt_tokens=5, output_tokens=0, elapsed_s=0.1, failed=True)
    span.end()
    (finished,) = exporter.get_finished_spans()
    assert finished.attributes["error.type"] == "Unavailable"
    assert (finished.status.status_code, finished.status.description) == (StatusCode.ERROR, "Unavailable: no worker")
    assert _value(metrics, "tandem:request_success_total", finished_reason="abort") == 1
