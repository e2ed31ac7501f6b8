"""bench/control_plane.py's figures without a cluster: routing's added latency read from span files, the
scheduler's messages per request; the paced phase's niceness."""

from __future__ import annotations

import datetime
import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from bench.control_plane import messages_per_request, niceness, route_hops_ms, scheduler_stalls
from services.common.loop_stalls import Collection, Stall
from services.common.spans import Attr, Event, SpanEvent, SpanName, SpanRecord, SpanStart, encode_records, span_file

MS = 1_000_000  # ns


def start(name: str, service: str, request_id: str, at_ms: float) -> SpanStart:
    return SpanStart("t" * 32, f"{name}-{request_id}", name, service, int(at_ms * MS), request_id)


def test_paced_hops_are_read_per_request_from_every_services_spans(tmp_path: Path) -> None:
    submit = SpanRecord("t" * 32, "s", None, SpanName.SCHEDULER_SUBMIT, "scheduler", 100 * MS, 200 * MS,
                        attributes={Attr.REQUEST_ID: "r-1"},
                        events=[SpanEvent(Event.ADMITTED, 100 * MS + MS // 2), SpanEvent(Event.ROUTED, 101 * MS),
                                SpanEvent(Event.ROUTED, 150 * MS)])  # moved later: its first decision counts
    span_file(tmp_path, "gateway").write_bytes(encode_records([start("chat m", "gateway", "r-1", 98.0),
                                                               start("chat m", "gateway", "other", 1.0)]))
    span_file(tmp_path, "scheduler").write_bytes(encode_records([start(SpanName.SCHEDULER_SUBMIT, "scheduler",
                                                                       "r-1", 100.0), submit]))
    span_file(tmp_path, "worker").write_bytes(encode_records([start(SpanName.COLOCATED, "worker", "r-1", 103.5),
                                                              start(SpanName.COLOCATED, "worker", "r-1", 151.0)]))

    hops = route_hops_ms(tmp_path, {"r-1"})

    assert (hops.hop, hops.decide, hops.route, hops.assign) == ([2.0], [1.0], [3.5], [2.5])


def test_the_scheduler_stalls_of_a_window_are_read_from_its_logs(tmp_path: Path) -> None:
    inside = Stall(12.3, 17.3, 2.5, 3.5, 8.1, (Collection(2, 0.0, 9.8),))
    outside = Stall(40.0, 45.0, 1.0, 1.0, 0.0, ())
    (tmp_path / "scheduler.log").write_text(
        f"2026-12-02 15:18:40,000 WARNING tandem.stalls: {outside.describe()}\n"
        "2026-12-02 15:18:46,000 INFO tandem.scheduler: serving\n"
        f"2026-12-02 15:18:46,941 WARNING tandem.stalls: {inside.describe()}\n")
    (tmp_path / "sim-0.log").write_text(f"2026-12-02 15:18:46,941 WARNING sim-worker tandem.stalls: {outside.describe()}\n")
    at = lambda text: datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S").timestamp()  # noqa: E731

    assert scheduler_stalls(tmp_path, at("2026-12-02 15:18:45"), at("2026-12-02 15:18:50")) == [inside]


def test_messages_per_request_keep_the_heartbeats_out_of_the_request_path() -> None:
    messages = Counter({"submissions in": 100, "submissions out": 80, "assign out": 100, "assign in": 100,
                        "report_tokens in": 200, "heartbeats in": 60, "heartbeats out": 60})

    figures = messages_per_request(messages, 100)

    assert (figures["scheduler_messages_in_per_request"], figures["scheduler_messages_out_per_request"]) == (4.0, 1.8)
    assert figures["scheduler_messages_per_request"] == {
        "assign in": 1.0, "assign out": 1.0, "heartbeats in": 0.6, "heartbeats out": 0.6, "report_tokens in": 2.0,
        "submissions in": 1.0, "submissions out": 0.8}


def autogroup_nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/proc/self/autogroup").exists(),
                    reason="lowering a nice takes root; autogroups take Linux with autogroup scheduling")
def test_niceness_sets_the_threads_and_the_autogroup_of_each_process_then_restores_them() -> None:
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a session, so an autogroup, of its own
    try:
        assert (os.getpriority(os.PRIO_PROCESS, child.pid), autogroup_nice(child.pid)) == (0, 0)
        with niceness([child.pid], -7):
            assert (os.getpriority(os.PRIO_PROCESS, child.pid), autogroup_nice(child.pid)) == (-7, -7)
        assert (os.getpriority(os.PRIO_PROCESS, child.pid), autogroup_nice(child.pid)) == (0, 0)
    finally:
        child.kill()
        child.wait()
