"""The first-token times the scheduler keeps per model for cost placement's TTFT trigger
(services/scheduler/model_ttft.py): the p90 of a recent window, nothing below the minimum of samples."""

from __future__ import annotations

import pytest

from services.scheduler.model_ttft import ModelTtft


def test_the_p90_is_the_nearest_rank_of_the_models_window() -> None:
    ttft = ModelTtft(window=10, min_samples=3)
    for ms in (10, 90, 20, 80, 30, 70, 40, 60, 50, 1000):
        ttft.observe("a", ms)
    ttft.observe("b", 5)
    assert ttft.p90() == {"a": 90}  # 9th of 10 sorted; b has too few samples to say anything


def test_the_window_keeps_only_the_last_requests() -> None:
    ttft = ModelTtft(window=4, min_samples=4)
    for ms in (900, 900, 900, 900, 100, 100, 100):
        ttft.observe("a", ms)
    assert ttft.p90() == {"a": 900}  # one slow request of the last four is still the p90
    ttft.observe("a", 100)
    assert ttft.p90() == {"a": 100}


def test_forgetting_a_model_starts_its_window_afresh() -> None:
    ttft = ModelTtft(window=4, min_samples=2)
    for ms in (700, 800):
        ttft.observe("a", ms)
    ttft.forget("a")
    ttft.observe("a", 50)
    assert ttft.p90() == {}
    ttft.observe("a", 60)
    assert ttft.p90() == {"a": 60}


def test_a_window_smaller_than_its_minimum_is_refused() -> None:
    with pytest.raises(ValueError, match="^need 1 <= min_samples <= window, got 5 and 4$"):
        ModelTtft(window=4, min_samples=5)
