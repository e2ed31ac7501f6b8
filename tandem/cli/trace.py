"""`tandem trace`: a request's end-to-end waterfall, from local span files or Jaeger.

`tandem trace REQUEST_ID [--format text|json] [--html FILE] [--jaeger URL] [--wait SECONDS]` draws
one request; `tandem trace --last N` lists recent requests to pick one from. Exit status: 0 a whole
trace, 1 none found (or no source), 2 bad arguments, 3 a trace with spans not written yet (drawn,
marked INCOMPLETE).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from services.common.paths import run_dir
from services.common.spans import Attr, LoadedSpans, SpanRecord, load_span_files, spans_from_jaeger
from tandem.cli.trace_view import (
    Gaps,
    build_tree,
    recent_requests,
    render_html,
    render_json,
    render_requests,
    render_text,
    request_spans,
    trace_gaps,
)

_JAEGER_TIMEOUT_S = 10.0
_WAIT_POLL_S = 0.1
EXIT_INCOMPLETE = 3


class TraceSourceError(RuntimeError):
    """The spans could not be read (no span files, Jaeger unreachable, ...)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("request_id", nargs="?", help="the request id (x-request-id header or first gRPC message)")
    parser.add_argument("--last", type=int, metavar="N", help="list the N most recent requests instead")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")
    parser.add_argument("--html", type=Path, metavar="FILE", help="also write a self-contained HTML waterfall")
    parser.add_argument("--jaeger", metavar="URL",
                        help="read from a Jaeger query endpoint, e.g. http://localhost:16686")
    parser.add_argument("--run-dir", type=Path, default=None, metavar="DIR",
                        help="directory of the local span files (default $TANDEM_RUN_DIR or $TANDEM_HOME/run)")
    parser.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                        help="wait up to SECONDS for the request's trace to be whole (default 0: show it as it is)")


def main(args: argparse.Namespace) -> int:
    if (args.request_id is None) == (args.last is None):
        print("tandem trace: give either a REQUEST_ID or --last N", file=sys.stderr)
        return 2
    if args.last is not None and args.last < 1:
        print(f"tandem trace: --last must be at least 1, got {args.last}", file=sys.stderr)
        return 2
    if not args.wait >= 0:
        print(f"tandem trace: --wait must be 0 or more seconds, got {args.wait}", file=sys.stderr)
        return 2
    try:
        if args.last is not None:
            return _list_recent(args)
        return _show_request(args)
    except TraceSourceError as exc:
        print(f"tandem trace: {exc}", file=sys.stderr)
        return 1


def _list_recent(args: argparse.Namespace) -> int:
    if args.jaeger:
        spans = _jaeger_recent(args.jaeger, args.last)
    else:
        loaded = _local_spans(args.run_dir)
        _warn_malformed(loaded.malformed_lines, args.run_dir)
        spans = loaded.spans
    summaries = recent_requests(spans, args.last)
    if args.format == "json":
        print(json.dumps([s.to_json() for s in summaries], indent=2))
    elif summaries:
        print(render_requests(summaries))
    else:
        print("no requests recorded yet", file=sys.stderr)
    return 0


def _show_request(args: argparse.Namespace) -> int:
    request_id: str = args.request_id
    spans, gaps, malformed = _request_trace(args)
    deadline = time.monotonic() + args.wait
    while not (spans and gaps.complete) and time.monotonic() < deadline:
        time.sleep(_WAIT_POLL_S)
        spans, gaps, malformed = _request_trace(args)
    _warn_malformed(malformed, args.run_dir)
    if not spans:
        return _nothing_written(args, gaps)
    roots = build_tree(spans)
    if args.format == "json":
        print(render_json(request_id, roots, gaps))
    else:
        print(render_text(request_id, roots, color=sys.stdout.isatty() and "NO_COLOR" not in os.environ, gaps=gaps))
    if args.html:
        args.html.write_text(render_html(request_id, roots, gaps), encoding="utf-8")
        print(f"wrote {args.html}", file=sys.stderr)
    if gaps.complete:
        return 0
    print(f"tandem trace: trace incomplete: {gaps.describe()}; rerun in a moment, or pass --wait SECONDS",
          file=sys.stderr)
    return EXIT_INCOMPLETE


def _request_trace(args: argparse.Namespace) -> tuple[list[SpanRecord], Gaps, int]:
    """The request's written spans, what its trace still lacks, and the malformed lines skipped."""
    if args.jaeger:
        spans = _jaeger_request(args.jaeger, args.request_id)
        return spans, trace_gaps(spans), 0
    loaded = _local_spans(args.run_dir)
    spans = request_spans(loaded.spans, args.request_id)
    return spans, trace_gaps(spans, loaded.started, args.request_id), loaded.malformed_lines


def _nothing_written(args: argparse.Namespace, gaps: Gaps) -> int:
    if gaps.open:
        print(f"tandem trace: request {args.request_id!r} is still running: {gaps.describe()}; rerun in a "
              "moment, or pass --wait SECONDS", file=sys.stderr)
        return EXIT_INCOMPLETE
    where = args.jaeger or _resolve_run_dir(args.run_dir)
    print(f"tandem trace: no spans for request {args.request_id!r} in {where}. Spans are written as they "
          "start and end; check the id, or list recent requests with --last N.", file=sys.stderr)
    return 1


def _resolve_run_dir(explicit: Path | None) -> Path:
    return explicit if explicit is not None else run_dir()


def _local_spans(explicit_dir: Path | None) -> LoadedSpans:
    directory = _resolve_run_dir(explicit_dir)
    loaded = load_span_files(directory)
    if not loaded.files:
        raise TraceSourceError(
            f"no span files (spans-*.jsonl) in {directory}. Services write them there when "
            "OTEL_EXPORTER_OTLP_ENDPOINT is unset; pass --run-dir DIR, or --jaeger URL if they export to Jaeger.")
    return loaded


def _warn_malformed(lines: int, explicit_dir: Path | None) -> None:
    if lines:
        print(f"tandem trace: skipped {lines} malformed line(s) in {_resolve_run_dir(explicit_dir)}", file=sys.stderr)


def _jaeger_request(base_url: str, request_id: str) -> list[SpanRecord]:
    """Find the request's traces by tag in every service Jaeger knows, then fetch them whole."""
    tags = json.dumps({Attr.REQUEST_ID: request_id})
    trace_ids: set[str] = set()
    for service in _jaeger_get(base_url, "/api/services").get("data") or ():
        found = _jaeger_get(base_url, "/api/traces", {"service": service, "tags": tags, "limit": "20"})
        trace_ids |= {t["traceID"] for t in found.get("data") or ()}
    spans: list[SpanRecord] = []
    for trace_id in sorted(trace_ids):
        spans += spans_from_jaeger(_jaeger_get(base_url, f"/api/traces/{trace_id}"))
    return spans


def _jaeger_recent(base_url: str, n: int) -> list[SpanRecord]:
    spans: list[SpanRecord] = []
    for service in _jaeger_get(base_url, "/api/services").get("data") or ():
        spans += spans_from_jaeger(_jaeger_get(base_url, "/api/traces", {"service": service, "limit": str(n)}))
    return list({(s.trace_id, s.span_id): s for s in spans}.values())


def _jaeger_get(base_url: str, path: str, params: dict[str, str] | None = None) -> dict[str, Any]:
    url = base_url.rstrip("/") + path + ("?" + urllib.parse.urlencode(params) if params else "")
    try:
        with urllib.request.urlopen(url, timeout=_JAEGER_TIMEOUT_S) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise TraceSourceError(f"cannot query Jaeger at {url}: {exc}. Is --jaeger the query UI address "
                               "(port 16686)?") from exc
