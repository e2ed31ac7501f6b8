"""Span trees for one request, and the waterfall views `tandem trace` prints.

Pure functions over `SpanRecord`s: select a request's spans, find what its trace still lacks,
link them into a tree by parent ids (across services), and render it as terminal text, JSON or a
self-contained HTML page.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from services.common.spans import Attr, Event, SpanName, SpanRecord, SpanStart

_HIDDEN_ATTRS = {Attr.REQUEST_ID, Attr.TOKEN_ARRIVALS_MS}  # the arrivals are drawn as ticks
_MAX_VALUE_CHARS = 80


@dataclass(slots=True)
class SpanNode:
    span: SpanRecord
    children: list[SpanNode] = field(default_factory=list)


def request_spans(spans: Iterable[SpanRecord], request_id: str) -> list[SpanRecord]:
    """All spans of the traces that carry `request_id` (also their spans without the attribute)."""
    spans = list(spans)
    trace_ids = {s.trace_id for s in spans if s.request_id == request_id}
    unique = {(s.trace_id, s.span_id): s for s in spans if s.trace_id in trace_ids}
    return list(unique.values())


@dataclass(slots=True, frozen=True)
class Gaps:
    """What a request's trace lacks before it is whole: spans that started but are not written
    (still open, or their process died), and written spans whose parent is neither written nor
    known to have started (Jaeger keeps no start lines, so there only these show a gap)."""

    open: tuple[SpanStart, ...] = ()
    orphans: tuple[SpanRecord, ...] = ()

    @property
    def complete(self) -> bool:
        return not self.open and not self.orphans

    def describe(self) -> str:
        """'N span(s) not written yet (names); M span(s) whose parent is not written yet'."""
        parts = []
        if self.open:
            names = ", ".join(sorted({s.name for s in self.open}))
            parts.append(f"{len(self.open)} span(s) not written yet ({names})")
        if self.orphans:
            parts.append(f"{len(self.orphans)} span(s) whose parent is not written yet")
        return "; ".join(parts)


def trace_gaps(spans: list[SpanRecord], started: Iterable[SpanStart] = (), request_id: str | None = None) -> Gaps:
    """The gaps of a request's trace: `spans` are its written spans (`request_spans`), `started` the
    start lines of the span files. Start lines that carry `request_id` count even when none of
    their trace is written yet: the request is still running."""
    trace_ids = {s.trace_id for s in spans}
    written = {(s.trace_id, s.span_id) for s in spans}
    open_spans = tuple(s for s in started if (s.trace_id in trace_ids or (request_id and s.request_id == request_id))
                       and (s.trace_id, s.span_id) not in written)
    known = written | {(s.trace_id, s.span_id) for s in open_spans}
    orphans = tuple(s for s in spans if s.parent_span_id and (s.trace_id, s.parent_span_id) not in known)
    return Gaps(open_spans, orphans)


def build_tree(spans: Iterable[SpanRecord]) -> list[SpanNode]:
    """Link spans by parent id. A span whose parent is missing becomes a root; siblings by start."""
    nodes = {(s.trace_id, s.span_id): SpanNode(s) for s in spans}
    roots: list[SpanNode] = []
    for node in nodes.values():
        parent = nodes.get((node.span.trace_id, node.span.parent_span_id or ""))
        (parent.children if parent else roots).append(node)
    for node in nodes.values():
        node.children.sort(key=_order)
    roots.sort(key=_order)
    return roots


def _order(node: SpanNode) -> tuple[int, int, str]:
    return node.span.start_ns, -node.span.end_ns, node.span.name


def walk(roots: list[SpanNode], depth: int = 0) -> Iterator[tuple[int, SpanNode]]:
    """(depth, node) in depth-first pre-order: the rows of a waterfall."""
    for node in roots:
        yield depth, node
        yield from walk(node.children, depth + 1)


def tree_to_json(roots: list[SpanNode]) -> list[dict[str, Any]]:
    """The tree as nested span records, each with a `children` list."""
    return [{**node.span.to_json(), "children": tree_to_json(node.children)} for node in roots]


@dataclass(slots=True)
class RequestSummary:
    """One request as `tandem trace --last` lists it, read from its root span."""

    request_id: str
    trace_id: str
    start_ns: int
    total_s: float
    ttft_s: float | None
    input_tokens: int | None
    output_tokens: int | None
    finish_reason: str | None
    status: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def recent_requests(spans: Iterable[SpanRecord], n: int) -> list[RequestSummary]:
    """The `n` most recent requests (root spans carrying a request id), newest first."""
    roots = [s for s in spans if s.parent_span_id is None and s.request_id is not None]
    roots.sort(key=lambda s: s.start_ns, reverse=True)
    return [_summary(s) for s in roots[:n]]


def _summary(root: SpanRecord) -> RequestSummary:
    attrs = root.attributes
    reasons = attrs.get(Attr.GEN_AI_RESPONSE_FINISH_REASONS)
    return RequestSummary(
        request_id=root.request_id or "",
        trace_id=root.trace_id,
        start_ns=root.start_ns,
        total_s=root.duration_ns / 1e9,
        ttft_s=_ttft_s(root),
        input_tokens=attrs.get(Attr.GEN_AI_USAGE_INPUT_TOKENS),
        output_tokens=attrs.get(Attr.GEN_AI_USAGE_OUTPUT_TOKENS),
        finish_reason=",".join(map(str, reasons)) if isinstance(reasons, list) else reasons,
        status=root.status,
    )


def _ttft_s(root: SpanRecord) -> float | None:
    if Attr.TTFT_S in root.attributes:
        return float(root.attributes[Attr.TTFT_S])
    first = next((e for e in root.events if e.name == Event.FIRST_TOKEN), None)
    return (first.time_ns - root.start_ns) / 1e9 if first else None


@dataclass(slots=True, frozen=True)
class Phase:
    """One stretch of the road to the first token, on the request's time axis (Unix ns)."""

    name: str
    start_ns: int
    end_ns: int

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def ttft_phases(spans: Iterable[SpanRecord]) -> list[Phase]:
    """Where the time to first token went, in order: the gateway before the scheduler's queue, the
    queue, routing, prefill (until its first token), the KV transfer, and the decode worker's first
    step (from the KV's arrival to its first token). A phase whose spans are missing is left out; a
    colocated worker has no transfer and its prefill ends at its first token. The queue and routing
    are stretches of the scheduler's span, up to its last `admitted` and `routed` events (a request
    sent back to the queue for lack of decode room queues again)."""
    by_name: dict[str, SpanRecord] = {}
    for span in sorted(spans, key=lambda s: s.start_ns):
        by_name.setdefault(span.name if span.parent_span_id else "root", span)
    root, submit = by_name.get("root"), by_name.get(SpanName.SCHEDULER_SUBMIT)
    prefill = by_name.get(SpanName.PREFILL) or by_name.get(SpanName.COLOCATED)
    sent, received = by_name.get(SpanName.KV_SEND), by_name.get(SpanName.KV_RECEIVE)
    decode = by_name.get(SpanName.DECODE)
    phases = []
    if root and submit:
        phases.append(Phase("gateway", root.start_ns, submit.start_ns))
    if submit:
        phases += _scheduler_phases(submit)
    if prefill:
        phases.append(Phase("prefill", prefill.start_ns, _first_token_ns(prefill) or prefill.end_ns))
    if sent:
        phases.append(Phase("transfer", sent.start_ns, received.end_ns if received else sent.end_ns))
    if decode and (first := _first_token_ns(decode)):
        phases.append(Phase("first decode step", received.end_ns if received else decode.start_ns, first))
    return phases


def _scheduler_phases(submit: SpanRecord) -> list[Phase]:
    """The queue (the span's start to its last `admitted`) and routing (from there to the last `routed`)."""
    admitted = _last_event_ns(submit, Event.ADMITTED)
    if admitted is None:
        return []
    phases = [Phase("queue", submit.start_ns, admitted)]
    routed = _last_event_ns(submit, Event.ROUTED)
    if routed is not None and routed >= admitted:
        phases.append(Phase("routing", admitted, routed))
    return phases


def _last_event_ns(span: SpanRecord, name: str) -> int | None:
    return max((e.time_ns for e in span.events if e.name == name), default=None)


def _first_token_ns(span: SpanRecord) -> int | None:
    return next((e.time_ns for e in span.events if e.name == Event.FIRST_TOKEN), None)


def token_arrivals_ns(span: SpanRecord) -> list[int]:
    """Each output token's arrival on `span` (the gateway's: when the client got it), Unix ns."""
    offsets = span.attributes.get(Attr.TOKEN_ARRIVALS_MS) or []
    return [span.start_ns + round(float(ms) * 1e6) for ms in offsets]


def render_requests(summaries: list[RequestSummary]) -> str:
    """The `--last N` table."""
    rows = [("STARTED", "REQUEST ID", "TTFT", "IN", "OUT", "TOTAL", "FINISH", "STATUS")]
    for s in summaries:
        rows.append((
            datetime.fromtimestamp(s.start_ns / 1e9).strftime("%Y-%m-%d %H:%M:%S"),
            s.request_id,
            _ms(s.ttft_s) if s.ttft_s is not None else "-",
            _or_dash(s.input_tokens),
            _or_dash(s.output_tokens),
            _ms(s.total_s),
            s.finish_reason or "-",
            s.status,
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}ms"


def render_text(request_id: str, roots: list[SpanNode], bar_width: int = 40, color: bool = False,
                gaps: Gaps = Gaps()) -> str:
    """The terminal waterfall: one row per span (indented by depth), start offset, duration,
    a bar placed on the request's time axis, and the span's key attributes under it. The first
    line ends with INCOMPLETE and the gaps while the trace has any."""
    rows = list(walk(roots))
    t0, t1 = _time_range(rows)
    total = max(t1 - t0, 1)
    name_width = min(max(2 * d + len(n.span.name) for d, n in rows), 48)
    service_width = max(len(_service(n.span)) for _, n in rows)
    traces = sorted({n.span.trace_id for _, n in rows})
    incomplete = "" if gaps.complete else f"  INCOMPLETE: {gaps.describe()}"
    lines = [f"request {request_id}  trace {', '.join(traces)}  "
             f"{len({n.span.service for _, n in rows})} services  {len(rows)} spans  {_ms(total / 1e9)}{incomplete}",
             f"{'SPAN'.ljust(name_width)}  {'SERVICE'.ljust(service_width)}  {'START':>9}  {'DURATION':>9}  "
             f"|{'0'.ljust(bar_width // 2)}{_ms(total / 1e9).rjust(bar_width - bar_width // 2)}|"]
    for depth, node in rows:
        span = node.span
        label = ("  " * depth + span.name)[:name_width].ljust(name_width)
        bar = _bar(span.start_ns - t0, span.end_ns - t0, total, bar_width)
        if color:
            bar = _paint(bar, span.service)
        flag = f"  ! {span.status_message or 'error'}" if span.status == "ERROR" else ""
        lines.append(f"{label}  {_service(span).ljust(service_width)}  {_ms((span.start_ns - t0) / 1e9):>9}  "
                     f"{_ms(span.duration_ns / 1e9):>9}  |{bar}|{flag}")
        arrivals = token_arrivals_ns(span)
        if arrivals:
            label = ("  " * (depth + 1) + f"tokens ({len(arrivals)})")[:name_width].ljust(name_width)
            lines.append(f"{label}  {''.ljust(service_width)}  {_ms((arrivals[0] - t0) / 1e9):>9}  "
                         f"{_ms((arrivals[-1] - arrivals[0]) / 1e9):>9}  |{_marks(arrivals, t0, total, bar_width)}|")
        details = _details(span, t0)
        if details:
            lines.append(" " * (2 * depth + 4) + details)
    phases = ttft_phases(n.span for _, n in rows)
    if phases:
        lines.append(_ttft_heading(rows))
        for phase in phases:
            bar = _bar(phase.start_ns - t0, phase.end_ns - t0, total, bar_width)
            lines.append(f"{('  ' + phase.name).ljust(name_width)}  {''.ljust(service_width)}  "
                         f"{_ms((phase.start_ns - t0) / 1e9):>9}  {_ms(phase.duration_ns / 1e9):>9}  |{bar}|")
    return "\n".join(lines)


def _ttft_heading(rows: list[tuple[int, SpanNode]]) -> str:
    ttft = _ttft_s(rows[0][1].span)
    at = f": the client's first token at {_ms(ttft)}" if ttft is not None else ""
    return f"where the time to first token went{at}"


def _marks(arrivals: list[int], t0: int, total: int, width: int) -> str:
    """A tick in each column of the time axis where a token arrived."""
    columns = {min(int((t - t0) / total * width), width - 1) for t in arrivals}
    return "".join("╵" if i in columns else " " for i in range(width))


def _time_range(rows: list[tuple[int, SpanNode]]) -> tuple[int, int]:
    return min(n.span.start_ns for _, n in rows), max(n.span.end_ns for _, n in rows)


def _service(span: SpanRecord) -> str:
    return f"{span.service}@{span.instance}" if span.instance else span.service


def _bar(start: int, end: int, total: int, width: int) -> str:
    first = min(int(start / total * width), width - 1)
    last = max(math.ceil(end / total * width), first + 1)
    return " " * first + "█" * (min(last, width) - first) + " " * (width - min(last, width))


_COLORS = (36, 33, 35, 32, 34, 31)


def _paint(text: str, service: str) -> str:
    code = _COLORS[sum(service.encode()) % len(_COLORS)]
    return f"\x1b[{code}m{text}\x1b[0m"


def _details(span: SpanRecord, t0: int) -> str:
    """Key attributes and events on one line: `gen_ai.`/`tandem.` prefixes dropped."""
    parts = [f"{_short(k)}={_value(v)}" for k, v in span.attributes.items() if k not in _HIDDEN_ATTRS]
    parts += [f"{e.name}@{_ms((e.time_ns - t0) / 1e9)}" for e in span.events]
    return "  ".join(parts)


def _short(key: str) -> str:
    return key.removeprefix("gen_ai.").removeprefix("tandem.")


def _value(value: Any) -> str:
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, list):
        text = "[" + ",".join(map(str, value)) + "]"
    else:
        text = str(value)
    return text if len(text) <= _MAX_VALUE_CHARS else text[: _MAX_VALUE_CHARS - 1] + "…"


def render_json(request_id: str, roots: list[SpanNode], gaps: Gaps = Gaps()) -> str:
    """`complete` is false while the trace has gaps, and `missing` says which."""
    spans = [node.span for _, node in walk(roots)]
    t0 = min((s.start_ns for s in spans), default=0)
    phases = [{"phase": p.name, "start_ms": (p.start_ns - t0) / 1e6, "duration_ms": p.duration_ns / 1e6}
              for p in ttft_phases(spans)]
    document = {"request_id": request_id, "complete": gaps.complete, "missing": gaps.describe(),
                "ttft_phases": phases, "spans": tree_to_json(roots)}
    return json.dumps(document, indent=2)


def render_html(request_id: str, roots: list[SpanNode], gaps: Gaps = Gaps()) -> str:
    """A self-contained page (inline CSS, no scripts or remote assets) with the waterfall."""
    rows = list(walk(roots))
    t0, t1 = _time_range(rows)
    total = max(t1 - t0, 1)
    body = "\n".join(_html_row(depth, node.span, t0, total) for depth, node in rows)
    phases = ttft_phases(node.span for _, node in rows)
    if phases:
        body += '\n<div class="row head"><div>where the time to first token went</div></div>\n'
        body += "\n".join(_html_phase(phase, t0, total) for phase in phases)
    incomplete = "" if gaps.complete else f" (INCOMPLETE: {gaps.describe()})"
    title = html.escape(f"Tandem trace {request_id}{incomplete}")
    return _HTML_PAGE.format(title=title, total=_ms(total / 1e9), count=len(rows), rows=body)


def _html_row(depth: int, span: SpanRecord, t0: int, total: int) -> str:
    left = (span.start_ns - t0) / total * 100
    width = max(span.duration_ns / total * 100, 0.3)
    hue = sum(span.service.encode()) * 47 % 360
    error = " error" if span.status == "ERROR" else ""
    return (
        f'<div class="row{error}"><div class="name" style="padding-left:{depth * 1.2:.1f}em">'
        f"{html.escape(span.name)}</div><div class=\"svc\">{html.escape(_service(span))}</div>"
        f'<div class="num">{_ms((span.start_ns - t0) / 1e9)}</div><div class="num">{_ms(span.duration_ns / 1e9)}</div>'
        f'<div class="track"><div class="bar" style="left:{left:.3f}%;width:{width:.3f}%;'
        f'background:hsl({hue},60%,55%)" title="{html.escape(span.name)}"></div>{_html_ticks(span, t0, total)}</div>'
        f'<div class="attrs">{html.escape(_details(span, t0))}</div></div>'
    )


def _html_ticks(span: SpanRecord, t0: int, total: int) -> str:
    return "".join(f'<div class="tick" style="left:{(t - t0) / total * 100:.3f}%"></div>'
                   for t in token_arrivals_ns(span))


def _html_phase(phase: Phase, t0: int, total: int) -> str:
    left = (phase.start_ns - t0) / total * 100
    width = max(phase.duration_ns / total * 100, 0.3)
    return (
        f'<div class="row phase"><div class="name">{html.escape(phase.name)}</div><div class="svc"></div>'
        f'<div class="num">{_ms((phase.start_ns - t0) / 1e9)}</div><div class="num">{_ms(phase.duration_ns / 1e9)}</div>'
        f'<div class="track"><div class="bar" style="left:{left:.3f}%;width:{width:.3f}%;background:#888"></div>'
        f"</div></div>"
    )


_HTML_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 13px/1.4 ui-monospace, SFMono-Regular, Menlo, monospace; margin: 1.5em; color: #222; }}
h1 {{ font-size: 15px; }}
.row {{ display: grid; grid-template-columns: 22em 12em 6em 6em 1fr; gap: 0 .8em;
        border-bottom: 1px solid #eee; padding: 2px 0; }}
.row.head {{ font-weight: bold; }}
.row.error .name {{ color: #c00; }}
.num {{ text-align: right; }}
.track {{ position: relative; background: #f6f6f6; height: 1.1em; align-self: center; }}
.bar {{ position: absolute; top: 0; bottom: 0; border-radius: 2px; }}
.tick {{ position: absolute; top: -2px; bottom: -2px; width: 1px; background: #000; }}
.row.phase .name {{ padding-left: 1.2em; font-style: italic; }}
.attrs {{ grid-column: 1 / -1; color: #777; font-size: 11px; padding-left: 2em; word-break: break-all; }}
.attrs:empty {{ display: none; }}
</style></head><body>
<h1>{title} &middot; {count} spans &middot; {total}</h1>
<div class="row head"><div>span</div><div>service</div><div class="num">start</div><div class="num">duration</div>
<div></div></div>
{rows}
</body></html>
"""
