"""`tandem trace` over synthetic span files of requests that crossed all four services, and Jaeger."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from services.common.spans import (
    Attr,
    Event,
    SpanEvent,
    SpanName,
    SpanRecord,
    SpanStart,
    encode_records,
    gateway_span_name,
    span_file,
)
from services.common.tracing import extract_context, inject_metadata, setup_tracing
from tandem.cli import main as cli
from tandem.cli import trace
from tandem.cli.trace_view import ttft_phases

GATEWAY = gateway_span_name("chat", "SmolLM2-135M-Instruct")
T0 = 1_700_000_000_000_000_000
MS = 1_000_000
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PREFILL = "127.0.0.1:50061"
DECODE = "127.0.0.1:50071"


def _span(span_id: int, parent: int | None, name: str, service: str, start_ms: int, end_ms: int,
          trace_id: str = TRACE, request_id: str | None = "req-7", instance: str | None = None,
          t0: int = T0, **attributes: Any) -> SpanRecord:
    attrs = {Attr.REQUEST_ID: request_id} if request_id else {}
    return SpanRecord(trace_id=trace_id, span_id=f"{span_id:016x}",
                      parent_span_id=f"{parent:016x}" if parent is not None else None, name=name,
                      service=service, instance=instance, start_ns=t0 + start_ms * MS, end_ns=t0 + end_ms * MS,
                      attributes={**attrs, **attributes}, kind="server" if parent in (None, 1) else "internal")


# The gateway's 20 tokens: the first at 120 ms, then every 10 ms, with a stall of 100 ms before the 11th.
TOKEN_ARRIVALS_MS = [120.0 + 10 * i for i in range(10)] + [310.0 + 10 * i for i in range(10)]


def _request_7() -> list[SpanRecord]:
    """One request through gateway, scheduler, prefill (two chunks) and decode."""
    root = _span(1, None, GATEWAY, "gateway", 0, 400, **{
        Attr.GEN_AI_OPERATION_NAME: "chat", Attr.GEN_AI_REQUEST_MODEL: "SmolLM2-135M-Instruct",
        Attr.GEN_AI_USAGE_INPUT_TOKENS: 28, Attr.GEN_AI_USAGE_OUTPUT_TOKENS: 20,
        Attr.GEN_AI_RESPONSE_FINISH_REASONS: ["stop"], Attr.TTFT_S: 0.12, Attr.ITL_MAX_S: 0.031,
        Attr.TOKEN_ARRIVALS_MS: TOKEN_ARRIVALS_MS})
    root.events = [SpanEvent("first_token", T0 + 120 * MS)]
    prefill = _span(5, 2, SpanName.PREFILL, "prefill", 10, 130, instance=PREFILL)
    prefill.events = [SpanEvent("first_token", T0 + 111 * MS)]
    decode = _span(11, 2, SpanName.DECODE, "decode", 128, 395, instance=DECODE, **{Attr.DECODE_ITERATIONS: 19})
    decode.events = [SpanEvent("first_token", T0 + 135 * MS)]
    # The scheduler's one span: queued from 3 to 8 ms, routed at 9 ms.
    submit = _span(2, 1, SpanName.SCHEDULER_SUBMIT, "scheduler", 3, 398, **{
        Attr.ROUTE_PREFILL_WORKER: PREFILL, Attr.ROUTE_DECODE_WORKER: DECODE,
        Attr.ROUTE_SCORES: json.dumps({PREFILL: {"cached_tokens": 16, "queued_tokens": 0}})})
    submit.events = [SpanEvent(Event.ADMITTED, T0 + 8 * MS), SpanEvent(Event.ROUTED, T0 + 9 * MS)]
    return [
        root,
        submit,
        prefill,
        _span(6, 5, SpanName.PREFILL_ITERATION, "prefill", 11, 60, instance=PREFILL, **{
            Attr.PREFILL_TOKENS_COMPUTED: 8, Attr.PREFILL_TOKENS_CACHED: 16, Attr.BATCH_SIZE: 2}),
        _span(7, 5, SpanName.PREFILL_ITERATION, "prefill", 60, 110, instance=PREFILL, **{
            Attr.PREFILL_TOKENS_COMPUTED: 4, Attr.PREFILL_TOKENS_CACHED: 0, Attr.BATCH_SIZE: 1}),
        _span(8, 5, SpanName.KV_SEND, "prefill", 112, 128, instance=PREFILL, **{
            Attr.KV_BLOCKS: 2, Attr.KV_BYTES: 552960, Attr.KV_CHUNKS: 30, Attr.KV_MB_PER_S: 34.56}),
        # Spans are selected by trace, so one that lacks the request id still belongs.
        _span(9, 8, SpanName.KV_RECEIVE, "decode", 113, 127, instance=DECODE, request_id=None, **{
            Attr.KV_BLOCKS: 2, Attr.KV_BYTES: 552960, Attr.KV_CHUNKS: 30}),
        decode,
    ]


# Pre-order of the tree above: (depth, name).
EXPECTED_ROWS = [
    (0, GATEWAY), (1, SpanName.SCHEDULER_SUBMIT), (2, SpanName.PREFILL), (3, SpanName.PREFILL_ITERATION),
    (3, SpanName.PREFILL_ITERATION), (3, SpanName.KV_SEND), (4, SpanName.KV_RECEIVE), (2, SpanName.DECODE),
]


def _other_request(request_id: str, trace_id: str, t0: int) -> list[SpanRecord]:
    root = _span(1, None, GATEWAY, "gateway", 0, 50, trace_id=trace_id, request_id=request_id, t0=t0,
                 **{Attr.GEN_AI_USAGE_INPUT_TOKENS: 5, Attr.GEN_AI_USAGE_OUTPUT_TOKENS: 1,
                    Attr.GEN_AI_RESPONSE_FINISH_REASONS: ["length"], Attr.TTFT_S: 0.04})
    return [root, _span(2, 1, SpanName.SCHEDULER_SUBMIT, "scheduler", 1, 49, trace_id=trace_id,
                        request_id=request_id, t0=t0)]


def _all_spans() -> list[SpanRecord]:
    return (_other_request("req-6", "11" * 16, T0 - 10**9) + _request_7()
            + _other_request("req-8", "22" * 16, T0 + 10**9))


def _start(span: SpanRecord) -> SpanStart:
    return SpanStart(span.trace_id, span.span_id, span.name, span.service, span.start_ns, span.request_id)


def _write(run_dir: Path, spans: list[SpanRecord], started: list[SpanRecord]) -> None:
    """Span files as the services write them: a start line per started span, a record per ended one."""
    for service in ("gateway", "scheduler", "prefill", "decode"):
        lines = [_start(s) for s in started if s.service == service] + [s for s in spans if s.service == service]
        with span_file(run_dir, service).open("ab") as f:
            f.write(encode_records(lines))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    _write(tmp_path, _all_spans(), started=_all_spans())
    with span_file(tmp_path, "decode").open("a") as f:
        f.write('{"trace_id": "cut short by a cr\n')
    return tmp_path


def _by_name(name: str) -> SpanRecord:
    return next(s for s in _request_7() if s.name == name)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["trace", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _rows(text: str) -> list[tuple[int, str]]:
    names = {name for _, name in EXPECTED_ROWS}
    rows = []
    for line in text.splitlines():
        name = re.split(r"\s{2,}", line.strip())[0]  # columns are two spaces apart; a name has single ones
        if name in names and "|" in line:
            rows.append(((len(line) - len(line.lstrip())) // 2, name))
    return rows


def test_text_waterfall_shows_every_hop_in_order(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "req-7", "--run-dir", str(run_dir))

    assert code == 0
    assert _rows(out) == EXPECTED_ROWS
    assert out.splitlines()[0] == f"request req-7  trace {TRACE}  4 services  8 spans  400.0ms"
    lines = out.splitlines()
    submit_row = next(i for i, line in enumerate(lines) if line.lstrip().startswith(SpanName.SCHEDULER_SUBMIT))
    assert lines[submit_row + 1].split()[:2] == [f"route.prefill_worker={PREFILL}", f"route.decode_worker={DECODE}"]
    assert lines[submit_row + 1].split()[-2:] == ["admitted@8.0ms", "routed@9.0ms"]
    first_chunk = next(i for i, line in enumerate(lines) if line.lstrip().startswith(SpanName.PREFILL_ITERATION))
    assert lines[first_chunk].split()[1:4] == [f"prefill@{PREFILL}", "11.0ms", "49.0ms"]
    assert lines[first_chunk + 1].split() == ["prefill.tokens_computed=8", "prefill.tokens_cached=16", "batch_size=2"]
    root_row = lines[2]
    assert root_row.endswith("|" + "█" * 40 + "|")
    assert "first_token@120.0ms" in lines[4] and "token_arrivals" not in out
    assert "skipped 1 malformed line(s)" in err


def test_json_is_the_span_tree(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "req-7", "--run-dir", str(run_dir), "--format", "json")
    document = json.loads(out)

    flat: list[tuple[int, dict[str, Any]]] = []

    def visit(nodes: list[dict[str, Any]], depth: int, parent_id: str | None) -> None:
        for node in nodes:
            children = node.pop("children")
            assert node["parent_span_id"] == parent_id
            flat.append((depth, node))
            visit(children, depth + 1, node["span_id"])

    visit(document["spans"], 0, None)
    assert code == 0 and document["request_id"] == "req-7"
    assert [(d, n["name"]) for d, n in flat] == EXPECTED_ROWS
    assert sorted((n for _, n in flat), key=lambda n: n["span_id"]) == [s.to_json() for s in _request_7()]


def test_html_page_is_written_and_self_contained(run_dir: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "req-7.html"
    code, _, err = _run(capsys, "req-7", "--run-dir", str(run_dir), "--html", str(page))
    html = page.read_text()

    assert code == 0 and f"wrote {page}" in err
    assert html.startswith("<!DOCTYPE html>") and html.count('<div class="row') == 2 + len(EXPECTED_ROWS) + 6
    position = 0
    for _, name in EXPECTED_ROWS:  # index() raises when a row is missing or out of order
        position = html.index(f">{name}</div>", position) + 1
    assert "<script" not in html and "http://" not in html and "https://" not in html
    assert "prefill.tokens_cached=16" in html


def test_last_lists_recent_requests_newest_first(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--last", "2", "--run-dir", str(run_dir))
    header, *rows = out.splitlines()

    assert code == 0
    assert header.split() == ["STARTED", "REQUEST", "ID", "TTFT", "IN", "OUT", "TOTAL", "FINISH", "STATUS"]
    assert [row.split()[2:] for row in rows] == [
        ["req-8", "40.0ms", "5", "1", "50.0ms", "length", "UNSET"],
        ["req-7", "120.0ms", "28", "20", "400.0ms", "stop", "UNSET"],
    ]


def test_last_as_json(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--last", "5", "--run-dir", str(run_dir), "--format", "json")

    assert code == 0
    listed = [(r["request_id"], r["ttft_s"], r["input_tokens"], r["output_tokens"], r["total_s"], r["finish_reason"])
              for r in json.loads(out)]
    assert listed == [("req-8", 0.04, 5, 1, 0.05, "length"), ("req-7", 0.12, 28, 20, 0.4, "stop"),
                      ("req-6", 0.04, 5, 1, 0.05, "length")]


def test_a_span_still_open_marks_the_trace_incomplete(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    written = [s for s in _request_7() if s.name != SpanName.DECODE]
    _write(tmp_path, written, started=_request_7())

    code, out, err = _run(capsys, "req-7", "--run-dir", str(tmp_path))
    assert code == trace.EXIT_INCOMPLETE == 3
    assert out.splitlines()[0] == (f"request req-7  trace {TRACE}  4 services  7 spans  400.0ms  "
                                   "INCOMPLETE: 1 span(s) not written yet (decode.request)")
    assert err == ("tandem trace: trace incomplete: 1 span(s) not written yet (decode.request); rerun in a "
                   "moment, or pass --wait SECONDS\n")

    code, out, _ = _run(capsys, "req-7", "--run-dir", str(tmp_path), "--format", "json")
    document = json.loads(out)
    assert (code, document["complete"], document["missing"]) == (3, False, "1 span(s) not written yet (decode.request)")


def test_spans_whose_parent_is_not_written_mark_the_trace_incomplete(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The scheduler's span and its start line are both missing: its two children (prefill, decode) are orphans.
    spans = [s for s in _request_7() if s.name != SpanName.SCHEDULER_SUBMIT]
    _write(tmp_path, spans, started=spans)

    code, out, err = _run(capsys, "req-7", "--run-dir", str(tmp_path), "--format", "json")
    document = json.loads(out)
    assert (code, document["complete"]) == (3, False)
    assert document["missing"] == "2 span(s) whose parent is not written yet"
    assert err.startswith("tandem trace: trace incomplete: 2 span(s) whose parent is not written yet;")


def test_a_request_with_only_start_lines_is_still_running(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, [], started=_request_7()[:2])

    code, out, err = _run(capsys, "req-7", "--run-dir", str(tmp_path))
    assert (code, out) == (3, "")
    assert err == ("tandem trace: request 'req-7' is still running: 2 span(s) not written yet "
                   f"({GATEWAY}, scheduler.submit); rerun in a moment, or pass --wait SECONDS\n")


def test_wait_polls_until_the_trace_is_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    decode = _by_name(SpanName.DECODE)
    _write(tmp_path, [s for s in _request_7() if s.name != decode.name], started=_request_7())
    polls: list[float] = []

    def decode_ends_during_the_first_poll(seconds: float) -> None:
        if not polls:
            _write(tmp_path, [decode], started=[])
        polls.append(seconds)

    monkeypatch.setattr(trace.time, "sleep", decode_ends_during_the_first_poll)
    code, out, err = _run(capsys, "req-7", "--run-dir", str(tmp_path), "--wait", "30")
    assert (code, err, len(polls)) == (0, "", 1)
    assert _rows(out) == EXPECTED_ROWS
    assert out.splitlines()[0] == f"request req-7  trace {TRACE}  4 services  8 spans  400.0ms"


def test_wait_gives_up_on_a_trace_that_stays_incomplete(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, [s for s in _request_7() if s.name != SpanName.DECODE], started=_request_7())
    code, _, err = _run(capsys, "req-7", "--run-dir", str(tmp_path), "--wait", "0.2")
    assert code == 3 and err.startswith("tandem trace: trace incomplete: 1 span(s) not written yet")

    code, _, err = _run(capsys, "req-7", "--run-dir", str(tmp_path), "--wait", "-1")
    assert (code, err) == (2, "tandem trace: --wait must be 0 or more seconds, got -1.0\n")


def test_unknown_request_and_missing_files_say_what_to_do(run_dir: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "nope", "--run-dir", str(run_dir))
    assert code == 1 and "no spans for request 'nope'" in err and "--last N" in err

    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _run(capsys, "req-7", "--run-dir", str(empty))
    assert code == 1 and f"no span files (spans-*.jsonl) in {empty}" in err

    code, _, err = _run(capsys, "--run-dir", str(run_dir))
    assert code == 2 and "either a REQUEST_ID or --last N" in err


def test_run_dir_defaults_to_the_environment(run_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TANDEM_RUN_DIR", str(run_dir))
    code, out, _ = _run(capsys, "req-7")
    assert code == 0 and _rows(out) == EXPECTED_ROWS


def test_traces_written_by_the_services_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    gateway = setup_tracing("gateway", tmp_path, install_global=False)
    decode = setup_tracing("decode", tmp_path, instance=DECODE, install_global=False)
    with gateway.get_tracer("t").start_as_current_span(GATEWAY, attributes={Attr.REQUEST_ID: "r1"}):
        remote = extract_context(inject_metadata())
        with decode.get_tracer("t").start_as_current_span(SpanName.DECODE, context=remote):
            pass
    gateway.shutdown()
    decode.shutdown()

    code, out, _ = _run(capsys, "r1", "--run-dir", str(tmp_path))
    assert code == 0 and _rows(out) == [(0, GATEWAY), (1, SpanName.DECODE)]
    assert f"decode@{DECODE}" in out


# --- Jaeger: a fake query endpoint serving the same spans in Jaeger's JSON ---------------------


def _jaeger_trace(spans: list[SpanRecord]) -> dict[str, Any]:
    processes: dict[str, dict[str, Any]] = {}
    out = []
    for span in spans:
        key = f"{span.service}|{span.instance}"
        process_tags = [{"key": Attr.WORKER, "type": "string", "value": span.instance}] if span.instance else []
        processes.setdefault(key, {"serviceName": span.service, "tags": process_tags})
        tags = [_jaeger_tag(k, v) for k, v in span.attributes.items()]
        if span.kind != "internal":
            tags.append({"key": "span.kind", "type": "string", "value": span.kind})
        out.append({
            "traceID": span.trace_id, "spanID": span.span_id, "operationName": span.name,
            "references": [{"refType": "CHILD_OF", "traceID": span.trace_id, "spanID": span.parent_span_id}]
            if span.parent_span_id else [],
            "startTime": span.start_ns // 1000, "duration": span.duration_ns // 1000, "tags": tags,
            "logs": [{"timestamp": e.time_ns // 1000, "fields": [{"key": "event", "type": "string", "value": e.name}]}
                     for e in span.events],
            "processID": key,
        })
    return {"traceID": spans[0].trace_id, "spans": out, "processes": processes}


def _jaeger_tag(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, list):  # OTLP arrays reach Jaeger as JSON strings
        return {"key": key, "type": "string", "value": json.dumps(value)}
    kind = {bool: "bool", int: "int64", float: "float64"}.get(type(value), "string")
    return {"key": key, "type": kind, "value": value}


@pytest.fixture
def jaeger() -> Iterator[str]:
    traces: dict[str, list[SpanRecord]] = {}
    for span in _all_spans():
        traces.setdefault(span.trace_id, []).append(span)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urllib.parse.urlparse(self.path)
            query = dict(urllib.parse.parse_qsl(url.query))
            if url.path == "/api/services":
                body: Any = {"data": ["gateway", "scheduler", "prefill", "decode", "jaeger-all-in-one"]}
            elif url.path.startswith("/api/traces/"):
                body = {"data": [_jaeger_trace(traces[url.path.rsplit("/", 1)[1]])]}
            else:
                wanted = json.loads(query.get("tags", "{}")).get(Attr.REQUEST_ID)
                body = {"data": [_jaeger_trace(spans) for spans in traces.values()
                                 if any(s.service == query["service"] for s in spans)
                                 and (wanted is None or any(s.request_id == wanted for s in spans))]}
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_jaeger_gives_the_same_tree_as_the_span_files(run_dir: Path, jaeger: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    _, from_files, _ = _run(capsys, "req-7", "--run-dir", str(run_dir), "--format", "json")
    code, from_jaeger, _ = _run(capsys, "req-7", "--jaeger", jaeger, "--format", "json")

    assert code == 0
    assert json.loads(from_jaeger) == json.loads(from_files)


def test_jaeger_last(jaeger: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--last", "2", "--jaeger", jaeger, "--format", "json")
    assert code == 0 and [r["request_id"] for r in json.loads(out)] == ["req-8", "req-7"]


def test_unreachable_jaeger_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "req-7", "--jaeger", "http://127.0.0.1:9")
    assert code == 1 and "cannot query Jaeger at http://127.0.0.1:9/api/services" in err


def test_piped_into_head_it_ends_quietly(tmp_path: Path) -> None:
    """`tandem trace --last N | head -1`: the reader leaves early; no BrokenPipe traceback."""
    roots = [_span(i + 1, None, GATEWAY, "gateway", i, i + 5, trace_id=f"{i + 1:032x}",
                   request_id=f"req-{i}") for i in range(3000)]  # ~250 KB of rows, past any pipe buffer
    _write(tmp_path, roots, started=[])
    command = f"{sys.executable} -m tandem.cli trace --last 3000 --run-dir {tmp_path} | head -1; " \
              "echo \"status ${PIPESTATUS[0]}\""
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[2])
    assert done.stderr == ""
    first, status = done.stdout.splitlines()
    assert first.split()[:2] == ["STARTED", "REQUEST"]
    assert status == "status 141"


def test_waterfall_breaks_ttft_down_and_marks_each_token(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "req-7", "--run-dir", str(run_dir))
    assert code == 0
    lines = out.splitlines()
    # 40 columns of 10 ms: ticks where tokens arrived (12..21, then 31..39 after the stall; 400 ms is the last)
    tokens = lines[3]
    assert tokens.split("|")[0].split() == ["tokens", "(20)", "120.0ms", "280.0ms"]
    assert tokens.split("|")[1] == " " * 12 + "╵" * 10 + " " * 9 + "╵" * 9
    start = lines.index("where the time to first token went: the client's first token at 120.0ms")
    phases = [line.split("|")[0].rsplit(None, 2) for line in lines[start + 1:]]
    assert [(name.strip(), begin, duration) for name, begin, duration in phases] == [
        ("gateway", "0.0ms", "3.0ms"), ("queue", "3.0ms", "5.0ms"), ("routing", "8.0ms", "1.0ms"),
        ("prefill", "10.0ms", "101.0ms"), ("transfer", "112.0ms", "15.0ms"), ("first decode step", "127.0ms", "8.0ms")]


def test_json_carries_the_ttft_phases(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = _run(capsys, "req-7", "--run-dir", str(run_dir), "--format", "json")
    assert [(p["phase"], p["start_ms"], p["duration_ms"]) for p in json.loads(out)["ttft_phases"]] == [
        ("gateway", 0.0, 3.0), ("queue", 3.0, 5.0), ("routing", 8.0, 1.0), ("prefill", 10.0, 101.0),
        ("transfer", 112.0, 15.0), ("first decode step", 127.0, 8.0)]


def test_a_request_sent_back_to_the_queue_queues_until_its_last_admission() -> None:
    submit = _by_name(SpanName.SCHEDULER_SUBMIT)
    submit.events = [SpanEvent(Event.ADMITTED, T0 + 5 * MS), SpanEvent(Event.NO_ROOM, T0 + 6 * MS),
                     SpanEvent(Event.ADMITTED, T0 + 20 * MS), SpanEvent(Event.ROUTED, T0 + 22 * MS)]
    phases = ttft_phases([_by_name(GATEWAY), submit])
    assert [(p.name, (p.start_ns - T0) // MS, p.duration_ns // MS) for p in phases] == [
        ("gateway", 0, 3), ("queue", 3, 17), ("routing", 20, 2)]
