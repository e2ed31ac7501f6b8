"""The scheduler's stream-message counts, as /metrics shows them."""

from prometheus_client import CollectorRegistry, generate_latest

from services.scheduler import message_counts
from services.scheduler.message_counts import ASSIGN, IN, OUT, SUBMISSIONS


def test_counts_add_up_by_stream_and_direction_and_show_on_metrics() -> None:
    before = message_counts.counts()
    message_counts.count(ASSIGN, OUT)
    message_counts.count(ASSIGN, OUT)
    message_counts.count(SUBMISSIONS, IN)
    after = message_counts.counts()
    added = {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)}
    assert added == {(ASSIGN, OUT): 2, (SUBMISSIONS, IN): 1}

    registry = CollectorRegistry()
    message_counts.register(registry, "", "scheduler")
    lines = generate_latest(registry).decode().splitlines()
    assert (f'tandem:scheduler_stream_messages_total{{direction="out",model_name="",stream="assign",worker="scheduler"}} '
            f'{float(after[ASSIGN, OUT])}') in lines
