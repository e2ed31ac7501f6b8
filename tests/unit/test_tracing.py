"""Tracing setup: span files, W3C context across services, request ids, token timings, dead OTLP."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from opentelemetry import baggage, trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from services.common.spans import SpanRecord, gateway_span_name, load_span_files
from services.common.tracing import (
    Attr,
    Event,
    SpanName,
    TokenTimings,
    extract_context,
    inject_metadata,
    kv_transfer_attributes,
    setup_tracing,
)
from tandem.cli.ports import free_port
from tandem.cli.trace_view import trace_gaps
from tests.waiting import DEADLINE_S, wait_until

GENAI_REQUEST = {
    Attr.GEN_AI_OPERATION_NAME: "chat",
    Attr.GEN_AI_REQUEST_MODEL: "SmolLM2-135M-Instruct",
    Attr.GEN_AI_REQUEST_MAX_TOKENS: 32,
    Attr.GEN_AI_REQUEST_TEMPERATURE: 0.0,
    Attr.GEN_AI_REQUEST_TOP_P: 1.0,
}
GATEWAY = gateway_span_name("chat", "SmolLM2-135M-Instruct")
CHILD = "scheduler.child"  # a span the scheduler starts under its own, in the same process


@pytest.fixture(autouse=True)
def _no_otlp(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME"):
        monkeypatch.delenv(name, raising=False)


def _by_name(records: list[SpanRecord]) -> dict[str, SpanRecord]:
    return {r.name: r for r in records}


def test_spans_of_two_services_link_through_grpc_metadata(tmp_path: Path) -> None:
    gateway = setup_tracing("gateway", tmp_path, install_global=False)
    scheduler = setup_tracing("scheduler", tmp_path, instance="127.0.0.1:50052", install_global=False)
    attributes = {Attr.REQUEST_ID: "req-1", **GENAI_REQUEST}
    with gateway.get_tracer("test").start_as_current_span(GATEWAY, kind=SpanKind.SERVER,
                                                          attributes=attributes) as root:
        metadata = inject_metadata()
        remote = extract_context(metadata)
        tracer = scheduler.get_tracer("test")
        # The servicer starts its span under the remote context without making it current,
        # as a worker thread would: the request id must still arrive through baggage.
        submit = tracer.start_span(SpanName.SCHEDULER_SUBMIT, context=remote, kind=SpanKind.SERVER)
        with tracer.start_as_current_span(CHILD, context=trace.set_span_in_context(submit)):
            pass
        submit.end()
        root.set_attribute(Attr.GEN_AI_RESPONSE_FINISH_REASONS, ["stop"])
        root.set_attribute(Attr.GEN_AI_USAGE_INPUT_TOKENS, 12)
        root.set_attribute(Attr.GEN_AI_USAGE_OUTPUT_TOKENS, 32)
    gateway.shutdown()
    scheduler.shutdown()

    loaded = load_span_files(tmp_path)
    spans = _by_name(loaded.spans)
    root_span, submit_span, queue_span = (spans[n] for n in (GATEWAY, SpanName.SCHEDULER_SUBMIT,
                                                              CHILD))
    assert [p.name for p in loaded.files] == ["spans-gateway.jsonl", "spans-scheduler.jsonl"]
    assert len(loaded.spans) == 3 and loaded.malformed_lines == 0
    assert dict(metadata)["traceparent"] == f"00-{root_span.trace_id}-{root_span.span_id}-03"
    assert dict(metadata)["baggage"] == "tandem.request_id=req-1"
    assert {s.trace_id for s in loaded.spans} == {root_span.trace_id}
    assert root_span.parent_span_id is None
    assert submit_span.parent_span_id == root_span.span_id
    assert queue_span.parent_span_id == submit_span.span_id
    assert [s.request_id for s in (root_span, submit_span, queue_span)] == ["req-1"] * 3
    assert (root_span.service, root_span.instance, root_span.kind) == ("gateway", None, "server")
    assert (submit_span.service, submit_span.instance) == ("scheduler", "127.0.0.1:50052")
    assert root_span.attributes == {**attributes, Attr.GEN_AI_RESPONSE_FINISH_REASONS: ["stop"],
                                    Attr.GEN_AI_USAGE_INPUT_TOKENS: 12, Attr.GEN_AI_USAGE_OUTPUT_TOKENS: 32}
    assert root_span.start_ns <= submit_span.start_ns <= queue_span.start_ns <= queue_span.end_ns <= root_span.end_ns


def test_request_id_arrives_from_another_process_in_baggage(tmp_path: Path) -> None:
    metadata = [("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
                ("baggage", "tandem.request_id=req-9"), ("x-tandem-internal-token", "secret")]
    provider = setup_tracing("prefill", tmp_path, install_global=False)
    tracer = provider.get_tracer("test")
    # A worker thread: explicit contexts, nothing made current.
    request_span = tracer.start_span(SpanName.PREFILL, context=extract_context(metadata))
    tracer.start_span(SpanName.PREFILL_ITERATION, context=trace.set_span_in_context(request_span)).end()
    request_span.end()
    provider.shutdown()

    spans = _by_name(load_span_files(tmp_path).spans)
    assert spans[SpanName.PREFILL].trace_id == "0af7651916cd43dd8448eb211c80319c"
    assert spans[SpanName.PREFILL].parent_span_id == "b7ad6b7169203331"
    assert spans[SpanName.PREFILL_ITERATION].parent_span_id == spans[SpanName.PREFILL].span_id
    assert [s.request_id for s in spans.values()] == ["req-9", "req-9"]


def test_metadata_of_a_span_without_request_id_carries_no_baggage() -> None:
    provider = setup_tracing("gateway", exporter=InMemorySpanExporter(), install_global=False)
    with provider.get_tracer("test").start_as_current_span("plain"):
        metadata = dict(inject_metadata())
    provider.shutdown()

    assert set(metadata) == {"traceparent"}


def test_no_metadata_starts_a_new_trace() -> None:
    exporter = InMemorySpanExporter()
    provider = setup_tracing("scheduler", exporter=exporter, install_global=False)
    provider.get_tracer("test").start_span("orphan", context=extract_context(None)).end()
    provider.force_flush()

    (span,) = exporter.get_finished_spans()
    assert span.parent is None and Attr.REQUEST_ID not in (span.attributes or {})
    provider.shutdown()


def test_otel_service_name_overrides_the_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "tandem-prefill-a")
    provider = setup_tracing("prefill", tmp_path, install_global=False)
    provider.get_tracer("test").start_span("x").end()
    provider.shutdown()

    (record,) = load_span_files(tmp_path).spans
    assert record.service == "tandem-prefill-a"
    assert (tmp_path / "spans-prefill.jsonl").exists()


def test_token_timings_aggregate_instead_of_per_token_spans() -> None:
    timings = TokenTimings(start_ns=1_000_000_000)
    gaps = [timings.record(now_ns=1_150_000_000), timings.record(now_ns=1_170_000_000),
            timings.record(now_ns=1_230_000_000), timings.record(num_tokens=2, now_ns=1_240_000_000)]
    exporter = InMemorySpanExporter()
    provider = setup_tracing("gateway", exporter=exporter, install_global=False)
    span = provider.get_tracer("test").start_span(GATEWAY, start_time=1_000_000_000)
    timings.annotate(span)
    span.end(end_time=1_300_000_000)
    provider.force_flush()

    (finished,) = exporter.get_finished_spans()
    assert gaps == [None, 0.02, 0.06, 0.01]
    assert timings.num_tokens == 5
    assert dict(finished.attributes or {}) == {Attr.TTFT_S: 0.15, Attr.ITL_MEAN_S: 0.0225, Attr.ITL_MAX_S: 0.06,
                                               Attr.TOKEN_ARRIVALS_MS: (150.0, 170.0, 230.0, 240.0, 240.0)}
    assert [(e.name, e.timestamp) for e in finished.events] == [(Event.FIRST_TOKEN, 1_150_000_000)]
    provider.shutdown()


def test_token_timings_before_any_token() -> None:
    timings = TokenTimings(start_ns=5)
    assert (timings.ttft_s, timings.mean_itl_s, timings.max_itl_s, timings.attributes()) == (None, None, None, {})


def test_kv_transfer_attributes() -> None:
    assert kv_transfer_attributes(blocks=4, num_bytes=3_000_000, chunks=3, seconds=0.5) == {
        Attr.KV_BLOCKS: 4, Attr.KV_BYTES: 3_000_000, Attr.KV_CHUNKS: 3, Attr.KV_MB_PER_S: 6.0}


def test_unwritable_span_file_drops_spans_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    not_a_dir = tmp_path / "run"
    not_a_dir.write_text("a file where the run directory should be")
    provider = setup_tracing("decode", not_a_dir, install_global=False)
    with caplog.at_level(logging.WARNING, logger="services.common.tracing"):
        provider.get_tracer("test").start_span("x").end()
        provider.force_flush()
    provider.shutdown()

    path = not_a_dir / "spans-decode.jsonl"
    assert [r.getMessage() for r in caplog.records] == [
        f"tracing: cannot export spans to span file {path}; dropping spans for the next 30s "
        "(0 finished span(s) dropped so far)"]


def test_span_file_holds_each_span_from_its_start_and_from_its_end(tmp_path: Path) -> None:
    provider = setup_tracing("decode", tmp_path, install_global=False)
    span = provider.get_tracer("test").start_span(SpanName.DECODE, attributes={Attr.REQUEST_ID: "r1"})

    started = load_span_files(tmp_path)  # no flush: written as the span started
    assert started.spans == []
    assert [(s.name, s.service, s.request_id) for s in started.started] == [(SpanName.DECODE, "decode", "r1")]
    assert trace_gaps([], started.started, "r1").describe() == "1 span(s) not written yet (decode.request)"

    span.end()
    ended = load_span_files(tmp_path)  # no flush: written as the span ended
    assert [(s.name, s.span_id) for s in ended.spans] == [(SpanName.DECODE, started.started[0].span_id)]
    assert trace_gaps(ended.spans, ended.started, "r1").complete
    provider.shutdown()


def test_dead_otlp_endpoint_is_tried_off_the_request_thread_and_warns(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.5")
    exporting_threads: list[threading.Thread] = []
    real_export = OTLPSpanExporter.export

    def export(self: OTLPSpanExporter, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        exporting_threads.append(threading.current_thread())
        return real_export(self, spans)

    monkeypatch.setattr(OTLPSpanExporter, "export", export)
    broken = setup_tracing("gateway", install_global=False)
    tracer = broken.get_tracer("test")
    with caplog.at_level(logging.WARNING, logger="services.common.tracing"):
        for i in range(100):
            with tracer.start_as_current_span(SpanName.DECODE, attributes={Attr.REQUEST_ID: f"r{i}"}):
                pass
        warnings = wait_until(lambda: [r.getMessage() for r in caplog.records if r.name == "services.common.tracing"],
                              "the warning about the dead endpoint")
        stopping = threading.Thread(target=broken.shutdown)
        stopping.start()
        stopping.join(timeout=DEADLINE_S)

    # The request thread only queued its spans: every export attempt ran on the batch worker.
    assert exporting_threads and threading.current_thread() not in exporting_threads
    assert not stopping.is_alive(), "shutdown hung on the dead endpoint"
    # How many spans the first batch held depends on when the worker woke.
    assert re.fullmatch(f"tracing: cannot export spans to OTLP endpoint {re.escape(endpoint)}; dropping spans for "
                        r"the next 30s \(([1-9]\d*) finished span\(s\) dropped so far\)", warnings[0]), warnings


def test_span_file_removed_while_open_is_written_anew(tmp_path: Path) -> None:
    """The exporter keeps its file open between lines; a file removed meanwhile (or its directory)
    is created again by the next line, not written to unlinked."""
    provider = setup_tracing("decode", tmp_path / "run", install_global=False)
    tracer = provider.get_tracer("test")
    tracer.start_span(SpanName.DECODE, attributes={Attr.REQUEST_ID: "r1"}).end()
    assert [s.request_id for s in load_span_files(tmp_path / "run").spans] == ["r1"]

    (tmp_path / "run" / "spans-decode.jsonl").unlink()
    (tmp_path / "run").rmdir()
    tracer.start_span(SpanName.DECODE, attributes={Attr.REQUEST_ID: "r2"}).end()
    loaded = load_span_files(tmp_path / "run")
    assert [s.request_id for s in loaded.spans] == ["r2"]
    assert [s.request_id for s in loaded.started] == ["r2"]
    provider.shutdown()


def test_a_span_line_that_cannot_be_written_is_logged_and_never_fails_the_caller(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    provider = setup_tracing("scheduler", tmp_path, install_global=False)
    span = provider.get_tracer("test").start_span(SpanName.SCHEDULER_SUBMIT, attributes={Attr.REQUEST_ID: "r1"})

    def unwritable(span: ReadableSpan) -> SpanRecord:
        raise ValueError("cannot encode")

    monkeypatch.setattr("services.common.tracing.span_record", unwritable)
    with caplog.at_level(logging.ERROR, logger="services.common.tracing"):
        span.end()  # raises nothing into the request's code
    provider.shutdown()

    loaded = load_span_files(tmp_path)
    assert ([s.request_id for s in loaded.started], loaded.spans) == (["r1"], [])
    assert [r.getMessage() for r in caplog.records] == [
        f"tracing: writing a span line to {tmp_path / 'spans-scheduler.jsonl'} failed"]


def test_the_remote_parent_alone_leaves_the_baggage_unread() -> None:
    metadata = [("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
                ("baggage", "tandem.request_id=req-9")]
    with_baggage, parent_only = extract_context(metadata), extract_context(metadata, baggage=False)

    assert [trace.get_current_span(c).get_span_context() for c in (with_baggage, parent_only)] == [
        trace.SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True,
                          trace_flags=trace.TraceFlags(1))] * 2
    assert (baggage.get_all(with_baggage), baggage.get_all(parent_only)) == ({Attr.REQUEST_ID: "req-9"}, {})
