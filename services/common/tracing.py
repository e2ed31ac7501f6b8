"""OpenTelemetry for Tandem's services: exporter setup, W3C context in gRPC metadata, token timings.

Spans go to OTLP/gRPC when OTEL_EXPORTER_OTLP_ENDPOINT is set, on a batch worker thread with a
bounded queue (a dead backend costs dropped spans, not time). Otherwise they go to the run directory
as JSON lines for `tandem trace`, written as each span starts and ends, so a request's spans are all
readable the moment its response ends (one small append each, about 25 µs on the ending thread).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry import baggage, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.common.paths import run_dir as default_run_dir
from services.common.spans import Attr, Event, SpanEvent, SpanName, SpanRecord, SpanStart, encode_records, span_file

__all__ = [
    "Attr", "Event", "SpanName", "TokenTimings", "JsonlSpanExporter", "setup_tracing",
    "inject_metadata", "extract_context", "kv_transfer_attributes", "span_record",
]

_log = logging.getLogger(__name__)
_PARENT_PROPAGATOR = TraceContextTextMapPropagator()
_PROPAGATOR = CompositePropagator([_PARENT_PROPAGATOR, W3CBaggagePropagator()])
_PROPAGATED_KEYS = frozenset(_PROPAGATOR.fields)  # traceparent, tracestate, baggage
_SCHEDULE_DELAY_MS = 500
_DROP_PAUSE_S = 30.0


def setup_tracing(
    service_name: str,
    run_dir: Path | None = None,
    *,
    instance: str | None = None,
    exporter: SpanExporter | None = None,
    install_global: bool = True,
) -> TracerProvider:
    """A tracer provider for one service, installed as the global one unless `install_global` is False.

    The exporter is `exporter` when given (tests pass an in-memory one; it gets each span as it
    ends), OTLP/gRPC when OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) is set, else a
    JSON-lines file `spans-<service_name>.jsonl` in `run_dir` (default $TANDEM_RUN_DIR or
    $TANDEM_HOME/run) that holds each span from the moment it ends.
    OTEL_SERVICE_NAME, when set, overrides the reported service name; `instance` (a worker's
    HOST:PORT) becomes `service.instance.id` and `tandem.worker` (the SDK's default instance id is a
    random UUID). Give the root span of a request `attributes={Attr.REQUEST_ID: id}`: the provider
    copies it onto every span of the request. Call `provider.shutdown()` when the service stops.
    """
    attributes: dict[str, str] = {SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or service_name}
    if instance:
        attributes[SERVICE_INSTANCE_ID] = instance
        attributes[Attr.WORKER] = instance
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(_RequestIdProcessor())
    provider.add_span_processor(_export_processor(service_name, run_dir, exporter))
    if install_global:
        trace.set_tracer_provider(provider)
    return provider


def _export_processor(service_name: str, run_dir: Path | None, exporter: SpanExporter | None) -> SpanProcessor:
    if exporter is not None:
        return SimpleSpanProcessor(exporter)
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return _batch_processor(_DropWhileFailing(OTLPSpanExporter(), f"OTLP endpoint {endpoint}"))
    return _SpanFileWriter(span_file(run_dir or default_run_dir(), service_name))


def _batch_processor(exporter: SpanExporter) -> BatchSpanProcessor:
    """Bounded queue (OTEL_BSP_MAX_QUEUE_SIZE, default 2048): when full, new spans are dropped."""
    delay = None if "OTEL_BSP_SCHEDULE_DELAY" in os.environ else _SCHEDULE_DELAY_MS
    return BatchSpanProcessor(exporter, schedule_delay_millis=delay)


class _SpanFileWriter(SpanProcessor):
    """Writes a start line when a span starts and its record when it ends, on the thread that starts
    or ends it: nothing waits in a queue, so there is nothing to lose or flush at shutdown. (Not a
    SimpleSpanProcessor: the instrumentation it suppresses around each export, with a context attach
    and detach per span, is none that an os.write reaches.)"""

    def __init__(self, path: Path) -> None:
        self._file = JsonlSpanExporter(path)
        self._guard = _DropWhileFailing(self._file, f"span file {path}")
        self._shutdown = False

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        if not self._shutdown and span.context.trace_flags.sampled:  # on_end would not write it either
            self._write(lambda: self._file.export_starts((span_start(span),)), spans=0)

    def on_end(self, span: ReadableSpan) -> None:
        if not self._shutdown and span.context.trace_flags.sampled:
            self._write(lambda: self._file.export((span,)), spans=1)

    def _write(self, write: Callable[[], SpanExportResult], spans: int) -> None:
        """A failed write drops the line (and pauses writing): it never fails the span's caller."""
        try:
            self._guard.attempt(write, spans)
        except Exception:  # noqa: BLE001 - a span the file cannot take must not fail the request
            _log.exception("tracing: writing a span line to %s failed", self._file.path)

    def shutdown(self) -> None:
        self._shutdown = True
        self._guard.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True  # nothing is held back


# (trace_id, span_id) -> request id of the process's open spans, so children inherit it.
_open_request_ids: dict[tuple[int, int], str] = {}


class _RequestIdProcessor(SpanProcessor):
    """Puts `tandem.request_id` on every span of a request. A span gets it from its start attributes,
    else from its parent span in this process, else from the baggage of a remote parent (which
    `inject_metadata` adds), so only the root span has to be given the id."""

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        request_id = (span.attributes or {}).get(Attr.REQUEST_ID)
        if request_id is None and span.parent is not None:
            request_id = _open_request_ids.get((span.parent.trace_id, span.parent.span_id))
        if request_id is None:
            request_id = baggage.get_baggage(Attr.REQUEST_ID, parent_context)
        if request_id is None:
            return
        span.set_attribute(Attr.REQUEST_ID, str(request_id))
        _open_request_ids[(span.context.trace_id, span.context.span_id)] = str(request_id)

    def on_end(self, span: ReadableSpan) -> None:
        _open_request_ids.pop((span.context.trace_id, span.context.span_id), None)


class _DropWhileFailing(SpanExporter):
    """After a failed export, drops batches for a pause instead of trying again: each OTLP attempt
    holds the batch worker for up to its timeout. Says so in a warning, at most once per pause."""

    def __init__(self, inner: SpanExporter, target: str, pause_s: float = _DROP_PAUSE_S) -> None:
        self._inner = inner
        self._target = target
        self._pause_s = pause_s
        self._resume_at = 0.0
        self._dropped = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self.attempt(lambda: self._inner.export(spans), len(spans))

    def attempt(self, write: Callable[[], SpanExportResult], spans: int) -> SpanExportResult:
        """`write` (which carries `spans` finished spans) unless paused; a failure starts a pause."""
        if time.monotonic() < self._resume_at:
            self._dropped += spans
            return SpanExportResult.FAILURE
        result = write()
        if result is SpanExportResult.FAILURE:
            self._dropped += spans
            self._resume_at = time.monotonic() + self._pause_s
            _log.warning("tracing: cannot export spans to %s; dropping spans for the next %.0fs "
                         "(%d finished span(s) dropped so far)", self._target, self._pause_s, self._dropped)
        return result

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        self._inner.shutdown(timeout_millis=timeout_millis)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._inner.force_flush(timeout_millis)


_APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT


class JsonlSpanExporter(SpanExporter):
    """Appends spans to a file, one JSON record per line: finished spans (`export`) and start lines
    (`export_starts`). Each call is one O_APPEND write, so several processes of one service can share
    the file without interleaving lines. The file stays open between writes (an open and a close a
    line cost twice the write); it is opened again, and the old descriptor closed at shutdown, when
    it was removed (a write to it would be lost) or a write failed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._retired: list[int] = []  # descriptors replaced while another thread may still write to them
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self._append(encode_records(span_record(s) for s in spans))

    def export_starts(self, starts: Sequence[SpanStart]) -> SpanExportResult:
        return self._append(encode_records(starts))

    def _append(self, data: bytes) -> SpanExportResult:
        fd = self._fd
        try:
            if fd is None or os.fstat(fd).st_nlink == 0:
                fd = self._reopen(fd)
            _write_all(fd, data)
        except OSError as exc:
            _log.debug("tracing: writing %s failed: %s", self.path, exc)
            with self._lock:
                if fd is not None and self._fd == fd:
                    self._retired.append(fd)
                    self._fd = None
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def _reopen(self, stale: int | None) -> int:
        """The open file, opened now unless another thread just did; `stale` is retired, not closed."""
        with self._lock:
            if self._fd is not None and self._fd != stale:
                return self._fd
            try:
                fd = os.open(self.path, _APPEND_FLAGS, 0o644)
            except FileNotFoundError:  # its directory is not there yet (or was removed)
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, _APPEND_FLAGS, 0o644)
            if stale is not None:
                self._retired.append(stale)
            self._fd = fd
            return fd

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        with self._lock:
            fds, self._retired = [*self._retired, *([self._fd] if self._fd is not None else [])], []
            self._fd = None
        for fd in fds:
            os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def span_record(span: ReadableSpan) -> SpanRecord:
    """The file record of a finished SDK span."""
    context, parent, status = span.context, span.parent, span.status
    service, instance = _service_of(span.resource)
    return SpanRecord(
        trace_id=format(context.trace_id, "032x"),
        span_id=format(context.span_id, "016x"),
        parent_span_id=format(parent.span_id, "016x") if parent else None,
        name=span.name,
        service=service,
        instance=instance,
        kind=_KIND_NAMES[span.kind],
        start_ns=span.start_time or 0,
        end_ns=span.end_time or 0,
        attributes=_plain(span.attributes),
        events=[SpanEvent(e.name, e.timestamp, _plain(e.attributes)) for e in span.events],
        status=_STATUS_NAMES[status.status_code],
        status_message=status.description or "",
    )


def span_start(span: ReadableSpan) -> SpanStart:
    """The start line of a span that has just started."""
    request_id = (span.attributes or {}).get(Attr.REQUEST_ID)
    return SpanStart(trace_id=format(span.context.trace_id, "032x"), span_id=format(span.context.span_id, "016x"),
                     name=span.name, service=_service_of(span.resource)[0],
                     start_ns=span.start_time or 0, request_id=str(request_id) if request_id is not None else None)


# Enum names, looked up once (a member's .name is a property): every span line names its kind and status.
_KIND_NAMES = {kind: kind.name.lower() for kind in trace.SpanKind}
_STATUS_NAMES = {code: code.name for code in trace.StatusCode}
_resource_fields: tuple[Resource, str, str | None] | None = None  # the last resource asked about, and its answer


def _service_of(resource: Resource) -> tuple[str, str | None]:
    """The service and instance (`tandem.worker`) a provider's resource names; the last answer is kept,
    since a process has one provider (tests have a few: a new resource is read afresh)."""
    global _resource_fields
    kept = _resource_fields
    if kept is not None and kept[0] is resource:
        return kept[1], kept[2]
    attributes = resource.attributes
    service = str(attributes.get(SERVICE_NAME, ""))
    instance = str(attributes[Attr.WORKER]) if Attr.WORKER in attributes else None
    _resource_fields = (resource, service, instance)
    return service, instance


def _plain(attributes: Mapping[str, object] | None) -> dict[str, object]:
    """OTel attribute values with tuples as lists (JSON arrays). (A span's attributes read through a
    mapping proxy, item by item in Python: read once, and not at all when there are none, as on most events.)"""
    if not attributes:
        return {}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in attributes.items()}


def inject_metadata(context: Context | None = None) -> list[tuple[str, str]]:
    """gRPC metadata (`traceparent`, `tracestate`, `baggage`) carrying `context` (default: the current
    one): its span becomes the remote parent, and its request id travels as baggage."""
    span_context = trace.get_current_span(context).get_span_context()
    request_id = _open_request_ids.get((span_context.trace_id, span_context.span_id))
    if request_id is not None and baggage.get_baggage(Attr.REQUEST_ID, context) is None:
        context = baggage.set_baggage(Attr.REQUEST_ID, request_id, context)
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return list(carrier.items())


def extract_context(metadata: Iterable[tuple[str, str | bytes]] | None, *, baggage: bool = True) -> Context:
    """The remote context in incoming gRPC metadata (e.g. `context.invocation_metadata()`);
    an empty context when there is none, so spans started under it become new roots. `baggage`
    False: the remote parent alone, for a span given its request id, the one thing Tandem's baggage
    carries (its parsing is half the extraction's cost)."""
    carrier = {key.lower(): value for key, value in metadata or () if isinstance(value, str)}
    if not _PROPAGATED_KEYS.intersection(carrier):
        return Context()  # what the propagators make of no context, without their parsing
    return (_PROPAGATOR if baggage else _PARENT_PROPAGATOR).extract(carrier, context=Context())


def kv_transfer_attributes(blocks: int, num_bytes: int, chunks: int, seconds: float) -> dict[str, int | float]:
    """Attributes of a KV transfer span (either end); MB/s is 10^6 bytes per second."""
    return {
        Attr.KV_BLOCKS: blocks,
        Attr.KV_BYTES: num_bytes,
        Attr.KV_CHUNKS: chunks,
        Attr.KV_MB_PER_S: num_bytes / 1e6 / seconds if seconds > 0 else 0.0,
    }


@dataclass(slots=True)
class TokenTimings:
    """A request's token arrival times folded into aggregates: time to first token, mean and max
    inter-token gap. Put on the span with `annotate` at the end, never one span per token."""

    start_ns: int = field(default_factory=time.time_ns)
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    num_tokens: int = 0
    max_gap_ns: int = 0
    arrivals_ns: list[int] = field(default_factory=list)  # one per token, so a trace can mark each

    def record(self, num_tokens: int = 1, now_ns: int | None = None) -> float | None:
        """Note `num_tokens` arriving now. Returns the gap since the previous arrival in seconds
        (an inter-token latency observation), None for the first arrival."""
        now = time.time_ns() if now_ns is None else now_ns
        previous = self.last_token_ns
        if previous is None:
            self.first_token_ns = now
        else:
            self.max_gap_ns = max(self.max_gap_ns, now - previous)
        self.last_token_ns = now
        self.num_tokens += num_tokens
        self.arrivals_ns += [now] * num_tokens
        return None if previous is None else (now - previous) / 1e9

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_ns is None else (self.first_token_ns - self.start_ns) / 1e9

    @property
    def mean_itl_s(self) -> float | None:
        """Mean gap per token after the first: (last - first) / (tokens - 1)."""
        if self.num_tokens < 2 or self.first_token_ns is None or self.last_token_ns is None:
            return None
        return (self.last_token_ns - self.first_token_ns) / (self.num_tokens - 1) / 1e9

    @property
    def max_itl_s(self) -> float | None:
        return self.max_gap_ns / 1e9 if self.num_tokens >= 2 else None

    def attributes(self) -> dict[str, float | list[float]]:
        values = {Attr.TTFT_S: self.ttft_s, Attr.ITL_MEAN_S: self.mean_itl_s, Attr.ITL_MAX_S: self.max_itl_s}
        attributes: dict[str, float | list[float]] = {k: v for k, v in values.items() if v is not None}
        if self.arrivals_ns:
            attributes[Attr.TOKEN_ARRIVALS_MS] = [round((t - self.start_ns) / 1e6, 3) for t in self.arrivals_ns]
        return attributes

    def annotate(self, span: trace.Span) -> None:
        """Set the aggregates as attributes and a `first_token` event at its time."""
        span.set_attributes(self.attributes())
        if self.first_token_ns is not None:
            span.add_event(Event.FIRST_TOKEN, timestamp=self.first_token_ns)
