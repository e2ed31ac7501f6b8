"""The gRPC stream messages this scheduler process reads and writes, by stream and direction, counted
as they pass: what a request costs in messages (each one a trip through gRPC's threads on both sides,
the largest share of the scheduler's CPU a request). /metrics shows them as
`tandem:scheduler_stream_messages_total{stream, direction}`; bench/control_plane.py divides them by
the requests of a run.

One process-wide table, as Prometheus' own registry is: the streams that pass messages are many
objects (one per gateway, per worker, per call) that share nothing else. A count is a dict update
(well under a microsecond) beside a message's 0.1 to 0.2 ms.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

IN, OUT = "in", "out"
SUBMISSIONS = "submissions"  # the gateways' Submissions streams: SubmitCommands in, SubmitUpdates out
ASSIGN = "assign"  # the colocated and hybrid workers' Assign streams: RunRequest out, RunResult in
REPORT_TOKENS = "report_tokens"  # the workers' ReportTokens streams: TokenBatch in, ReportAck out
HEARTBEATS = "heartbeats"  # the workers' Heartbeats streams: one each way a heartbeat

_COUNTS: Counter[tuple[str, str]] = Counter()


def count(stream: str, direction: str) -> None:
    """One message of `stream` passed in `direction` (IN: read here; OUT: written here)."""
    _COUNTS[stream, direction] += 1


def counts() -> dict[tuple[str, str], int]:
    """(stream, direction) -> messages so far."""
    return dict(_COUNTS)


class _MessageCollector(Collector):
    """The counts under the service's own `model_name` and `worker` labels, as every tandem: series carries."""

    def __init__(self, model_name: str, worker: str) -> None:
        self._service = (model_name, worker)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("tandem:scheduler_stream_messages", "gRPC stream messages the scheduler "
                                     "read (in) or wrote (out), by stream.",
                                     labels=("model_name", "worker", "stream", "direction"))
        for (stream, direction), number in sorted(_COUNTS.items()):
            family.add_metric((*self._service, stream, direction), number)
        yield family


def register(registry: CollectorRegistry, model_name: str, worker: str) -> None:
    """Show the counts on `registry`'s /metrics, labelled as the service's other series."""
    registry.register(_MessageCollector(model_name, worker))
