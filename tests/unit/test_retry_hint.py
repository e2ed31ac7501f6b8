"""Retry hints on RESOURCE_EXHAUSTED and UNAVAILABLE: sent as `retry-after` (whole seconds) and
`retry-after-ms`, read back preferring the milliseconds, with the default when none was sent."""

from __future__ import annotations

import grpc
import pytest

from services.common.errors import (
    DEFAULT_RETRY_AFTER_S, Overloaded, Unavailable, error_from_status, retry_after_hint, retry_metadata,
)


def test_a_hint_is_sent_in_whole_seconds_rounded_up_and_in_milliseconds():
    assert retry_metadata(2.5) == (("retry-after", "3"), ("retry-after-ms", "2500"))
    assert retry_metadata(0.2) == (("retry-after", "1"), ("retry-after-ms", "200"))
    assert Overloaded("full", retry_after=4).trailing_metadata() == (("retry-after", "4"), ("retry-after-ms", "4000"))
    assert Unavailable("no worker").trailing_metadata() == ()
    assert Unavailable("no worker", retry_after=0.75).trailing_metadata() == (
        ("retry-after", "1"), ("retry-after-ms", "750"))


@pytest.mark.parametrize(("metadata", "seconds"), [
    ((("retry-after-ms", "1500"), ("retry-after", "9")), 1.5),
    ((("retry-after", "9"),), 9.0),
    ((("retry-after-ms", "soon"), ("retry-after", "2")), 2.0),
    ((("retry-after-ms", "-5"),), None),
    ((("retry-after", "nan"),), None),
    ((), None),
])
def test_a_hint_is_read_from_milliseconds_first(metadata, seconds):
    assert retry_after_hint(metadata) == seconds


def test_relayed_statuses_keep_the_hint_or_take_the_default():
    overloaded = error_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", (("retry-after-ms", "2200"),))
    assert isinstance(overloaded, Overloaded) and overloaded.retry_after == 2.2
    unhinted = error_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    assert isinstance(unhinted, Overloaded) and unhinted.retry_after == DEFAULT_RETRY_AFTER_S
    lost = error_from_status(grpc.StatusCode.UNAVAILABLE, "lost", (("retry-after-ms", "300"),))
    assert isinstance(lost, Unavailable) and lost.retry_after == 0.3
    assert error_from_status(grpc.StatusCode.UNAVAILABLE, "lost").retry_after is None
