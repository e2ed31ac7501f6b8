"""The span record Tandem's services write and `tandem trace` reads, and the names it uses.

`spans-<service>.jsonl` files of the run directory hold one JSON object a line: a `SpanStart` when a
span starts and its `SpanRecord` when it ends, so a reader can tell a span still open from one that
never was. `Attr`, `SpanName` and `Event` are the span vocabulary
(OpenTelemetry GenAI conventions where they exist, `tandem.*` for ours). Jaeger's query JSON is
converted to the same records. Plain Python (no OpenTelemetry, no torch), so `tandem trace` stays light.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPAN_FILE_PREFIX = "spans-"
SPAN_FILE_SUFFIX = ".jsonl"


class Attr:
    """Span attribute keys. `gen_ai.*` follow the OpenTelemetry GenAI semantic conventions."""

    GEN_AI_OPERATION_NAME = "gen_ai.operation.name"  # "chat" | "text_completion"
    GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
    GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"  # list of str, e.g. ["stop"]
    GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
    GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"

    REQUEST_ID = "tandem.request_id"  # on every span of a request (see services.common.tracing)
    WORKER = "tandem.worker"  # resource attribute: HOST:PORT of the worker that recorded the span
    ROUTE_PREFILL_WORKER = "tandem.route.prefill_worker"
    ROUTE_DECODE_WORKER = "tandem.route.decode_worker"
    ROUTE_SCORES = "tandem.route.scores"  # JSON object: worker -> score breakdown
    PREFILL_TOKENS_COMPUTED = "tandem.prefill.tokens_computed"
    PREFILL_TOKENS_CACHED = "tandem.prefill.tokens_cached"
    BATCH_SIZE = "tandem.batch_size"  # sequences in the iteration
    BATCH_TOKENS = "tandem.batch_tokens"  # tokens in the iteration
    KV_BLOCKS = "tandem.kv.blocks"
    KV_BYTES = "tandem.kv.bytes"
    KV_CHUNKS = "tandem.kv.chunks"
    KV_MB_PER_S = "tandem.kv.mb_per_s"
    KV_PEER = "tandem.kv.peer"  # the other end of a KV transfer
    KV_REUSED_BLOCKS = "tandem.kv.reused_blocks"  # leading blocks the receiver held already: not shipped
    KV_TRANSPORT = "tandem.kv.transport"  # "grpc", or "shm" on the same host
    KV_AFTER_FIRST_TOKEN_MS = "tandem.kv.after_first_token_ms"  # what the hand-off adds: the rest after the first token
    DECODE_ITERATIONS = "tandem.decode.iterations"
    DECODE_PREEMPTIONS = "tandem.decode.preemptions"
    TTFT_S = "tandem.ttft_s"  # time to first token, from the span's start
    ITL_MEAN_S = "tandem.itl.mean_s"  # mean inter-token gap
    ITL_MAX_S = "tandem.itl.max_s"  # largest inter-token gap
    TOKEN_ARRIVALS_MS = "tandem.token_arrivals_ms"  # each output token's arrival, ms after the span's start
    MODEL_NAME = "tandem.model.name"  # a model a worker loads
    MODEL_BYTES = "tandem.model.bytes"  # its weight bytes
    MODEL_LOAD_SECONDS = "tandem.model.load_seconds"
    MODEL_EVICTED = "tandem.model.evicted"  # list of str: the models evicted to make room for it
    MIGRATION_FROM = "tandem.migration.from_worker"  # the generating worker of the attempt that ended
    MIGRATION_OFFSET = "tandem.migration.output_offset"  # tokens delivered before the continuation
    # Conditional disaggregation (services/scheduler/prefill_placement.py), on the scheduler.submit span:
    PREFILL_PLACEMENT = "tandem.prefill.placement"  # "local" (on the decode worker) | "remote" (a prefill worker)
    PREFILL_PLACEMENT_REASON = "tandem.prefill.placement_reason"  # prefill_placement.Reason
    PREFILL_UNCACHED_TOKENS = "tandem.prefill.uncached_tokens"  # the decode worker's prefix hit taken off
    PREFILL_QUEUED_TOKENS = "tandem.prefill.queued_tokens"  # prompt tokens queued on the decode worker before it
    PREFILL_DECODE_RUNNING = "tandem.prefill.decode_running"  # sequences generating on the decode worker
    PREFILL_PREDICTED_STEP_MS = "tandem.prefill.predicted_step_ms"  # its next step with the prefill, by its cost model
    PREFILL_REMOTE_QUEUED_TOKENS = "tandem.prefill.remote_queued_tokens"  # prompt tokens queued on the prefill worker
    PREFILL_LOCAL_TTFT_MS = "tandem.prefill.local_ttft_ms"  # predicted first token if chunked locally (-1: never)
    PREFILL_REMOTE_TTFT_MS = "tandem.prefill.remote_ttft_ms"  # predicted first token on the prefill worker


class SpanName:
    """The hops of one request, in the order they happen. The root, the gateway's HTTP or gRPC
    server span, is named as the GenAI conventions ask: see `gateway_span_name`."""

    # The scheduler's one span, from the Submit call to the request's end: its queue wait ends at the
    # `admitted` event, the routing decision (attributes: workers, candidate scores) at `routed`; from
    # there the request runs on its workers, the tokens flowing beside the scheduler to the gateway.
    SCHEDULER_SUBMIT = "scheduler.submit"
    PREFILL = "prefill.request"  # the request's stay on a prefill worker
    PREFILL_ITERATION = "prefill.iteration"  # one per iteration (chunk) the request was part of
    KV_SEND = "kv_transfer.send"
    KV_RECEIVE = "kv_transfer.receive"
    DECODE = "decode.request"
    COLOCATED = "colocated.request"  # a colocated worker's stay: its prefill iterations, then its decode
    MODEL_LOAD = "worker.model_load"  # a worker loading a catalogue model (not a request's hop)


def gateway_span_name(operation: str, model: str) -> str:
    """The gateway's root span: `{gen_ai.operation.name} {gen_ai.request.model}`, e.g. "chat SmolLM2-135M-Instruct"."""
    return f"{operation} {model}"


class Event:
    """Span event names (token timings are events and attributes, never per-token spans)."""

    FIRST_TOKEN = "first_token"
    PREEMPTED = "preempted"
    MIGRATED = "migrated"  # the request moved to another worker after its worker was lost
    ADMITTED = "admitted"  # scheduler.submit: the request left the scheduler's queue (once per turn)
    ROUTED = "routed"  # scheduler.submit: its workers were chosen (the route attributes are set then)
    NO_ROOM = "no_decode_room"  # scheduler.submit: every decode worker refused its reservation; back to the queue


@dataclass(slots=True)
class SpanEvent:
    name: str
    time_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class SpanRecord:
    """One finished span. Ids are lowercase hex (trace 32, span 16); times are Unix nanoseconds."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[SpanEvent] = field(default_factory=list)
    status: str = "UNSET"  # UNSET | OK | ERROR
    status_message: str = ""
    kind: str = "internal"  # internal | server | client | producer | consumer
    instance: str | None = None  # the worker that recorded it (resource `tandem.worker`), e.g. HOST:PORT

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def request_id(self) -> str | None:
        value = self.attributes.get(Attr.REQUEST_ID)
        return str(value) if value is not None else None

    def to_json(self) -> dict[str, Any]:
        return {
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "parent_span_id": self.parent_span_id,
            "name": self.name,
            "service": self.service,
            "instance": self.instance,
            "kind": self.kind,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "attributes": self.attributes,
            "events": [{"name": e.name, "time_ns": e.time_ns, "attributes": e.attributes} for e in self.events],
            "status": self.status,
            "status_message": self.status_message,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SpanRecord:
        """Parse one record; raises KeyError/TypeError/ValueError on a malformed one."""
        return cls(
            trace_id=str(obj["trace_id"]),
            span_id=str(obj["span_id"]),
            parent_span_id=obj.get("parent_span_id") or None,
            name=str(obj["name"]),
            service=str(obj["service"]),
            start_ns=int(obj["start_ns"]),
            end_ns=int(obj["end_ns"]),
            attributes=dict(obj.get("attributes") or {}),
            events=[SpanEvent(str(e["name"]), int(e["time_ns"]), dict(e.get("attributes") or {}))
                    for e in obj.get("events") or ()],
            status=str(obj.get("status") or "UNSET"),
            status_message=str(obj.get("status_message") or ""),
            kind=str(obj.get("kind") or "internal"),
            instance=obj.get("instance"),
        )


@dataclass(slots=True, frozen=True)
class SpanStart:
    """A span that has started. Until its `SpanRecord` is written too, it is open (or its process died)."""

    trace_id: str
    span_id: str
    name: str
    service: str
    start_ns: int
    request_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"started": True, "trace_id": self.trace_id, "span_id": self.span_id, "name": self.name,
                "service": self.service, "start_ns": self.start_ns, "request_id": self.request_id}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SpanStart:
        """Parse one start line; raises KeyError/TypeError/ValueError on a malformed one."""
        request_id = obj.get("request_id")
        return cls(trace_id=str(obj["trace_id"]), span_id=str(obj["span_id"]), name=str(obj["name"]),
                   service=str(obj["service"]), start_ns=int(obj["start_ns"]),
                   request_id=str(request_id) if request_id is not None else None)


def span_file(run_dir: Path, service: str) -> Path:
    """The file a service appends its finished spans to."""
    return run_dir / f"{SPAN_FILE_PREFIX}{service}{SPAN_FILE_SUFFIX}"


# Built once (json.dumps with separators builds one a call); records hold no cycles to look for.
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"), check_circular=False)


def encode_records(records: Iterable[SpanRecord | SpanStart]) -> bytes:
    """JSON lines for `records`, ready to append to a span file in one write."""
    return b"".join(_COMPACT_JSON.encode(r.to_json()).encode() + b"\n" for r in records)


@dataclass(slots=True)
class LoadedSpans:
    spans: list[SpanRecord]  # finished spans
    files: list[Path]
    malformed_lines: int  # a line cut short by a crash, for example; skipped
    started: list[SpanStart] = field(default_factory=list)  # every span that started, finished or not


def load_span_files(run_dir: Path) -> LoadedSpans:
    """Every span in the run directory's span files (all services)."""
    files = sorted(run_dir.glob(f"{SPAN_FILE_PREFIX}*{SPAN_FILE_SUFFIX}"))
    loaded = LoadedSpans([], files, 0)
    for path in files:
        for line in _read_lines(path):
            try:
                obj = json.loads(line)
                if obj.get("started"):
                    loaded.started.append(SpanStart.from_json(obj))
                else:
                    loaded.spans.append(SpanRecord.from_json(obj))
            except (ValueError, KeyError, TypeError, AttributeError):
                loaded.malformed_lines += 1
    return loaded


def _read_lines(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                yield line


def spans_from_jaeger(payload: dict[str, Any]) -> list[SpanRecord]:
    """Convert the JSON of Jaeger's query API (`/api/traces...`) into span records."""
    records: list[SpanRecord] = []
    for trace in payload.get("data") or ():
        processes = trace.get("processes") or {}
        for span in trace.get("spans") or ():
            records.append(_jaeger_span(span, processes.get(span.get("processID"), {})))
    return records


def _jaeger_span(span: dict[str, Any], process: dict[str, Any]) -> SpanRecord:
    tags = _jaeger_tags(span.get("tags"))
    parent = next((r["spanID"] for r in span.get("references") or () if r.get("refType") == "CHILD_OF"), None)
    start_ns = int(span["startTime"]) * 1000
    status = str(tags.pop("otel.status_code", "ERROR" if tags.get("error") is True else "UNSET"))
    tags.pop("error", None)
    return SpanRecord(
        trace_id=str(span["traceID"]).zfill(32),
        span_id=str(span["spanID"]).zfill(16),
        parent_span_id=str(parent).zfill(16) if parent else None,
        name=str(span["operationName"]),
        service=str(process.get("serviceName", "?")),
        start_ns=start_ns,
        end_ns=start_ns + int(span.get("duration", 0)) * 1000,
        attributes={k: v for k, v in tags.items() if not k.startswith(("otel.", "span.kind", "internal."))},
        events=[_jaeger_event(log) for log in span.get("logs") or ()],
        status=status,
        status_message=str(tags.get("otel.status_description", "")),
        kind=str(tags.get("span.kind", "internal")),
        instance=_jaeger_tags(process.get("tags")).get(Attr.WORKER),
    )


def _jaeger_event(log: dict[str, Any]) -> SpanEvent:
    fields = _jaeger_tags(log.get("fields"))
    return SpanEvent(str(fields.pop("event", "event")), int(log.get("timestamp", 0)) * 1000, fields)


def _jaeger_tags(tags: Iterable[dict[str, Any]] | None) -> dict[str, Any]:
    """Jaeger key/type/value tags -> dict; OTLP array attributes arrive as JSON strings."""
    out: dict[str, Any] = {}
    for tag in tags or ():
        value = tag.get("value")
        if isinstance(value, str) and value.startswith("["):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        out[str(tag.get("key"))] = value
    return out
