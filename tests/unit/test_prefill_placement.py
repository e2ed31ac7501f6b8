"""Conditional disaggregation: where a request prefills, from prompt length, prefix hits and queues."""

import pytest

from services.common.step_cost import StepCost
from services.scheduler.prefill_placement import PlacementModel, PrefillInputs, PrefillSite

MODEL = PlacementModel(cost=StepCost(fixed_ms=10.0, per_token_ms=0.05, per_context_token_ms=0.0),
                       chunk_size=256, max_local_prefill_tokens=256, transfer_ms_per_token=0.01)


def inputs(prompt: int, local_hit: int = 0, remote_hit: int = 0, local_queue: int = 0, remote_queue: int = 0,
           remote: bool = True) -> PrefillInputs:
    return PrefillInputs(prompt_tokens=prompt, local_hit_tokens=local_hit, remote_hit_tokens=remote_hit,
                         local_queued_tokens=local_queue, remote_queued_tokens=remote_queue, remote_available=remote)


def test_short_prompt_prefills_locally() -> None:
    decision = MODEL.decide(inputs(100))
    assert decision.site is PrefillSite.LOCAL
    assert decision.local_ttft_ms == pytest.approx(10 + 5)
    assert decision.remote_ttft_ms == pytest.approx(10 + 5 + 1)


def test_long_prompt_goes_to_the_prefill_worker() -> None:
    assert MODEL.decide(inputs(1000)).site is PrefillSite.REMOTE


def test_long_prompt_mostly_cached_locally_stays_local() -> None:
    assert MODEL.decide(inputs(1000, local_hit=800)).site is PrefillSite.LOCAL


def test_short_prompt_behind_a_long_local_queue_goes_remote() -> None:
    decision = MODEL.decide(inputs(100, local_queue=2000))
    assert decision.site is PrefillSite.REMOTE
    assert decision.local_ttft_ms == pytest.approx(8 * 10 + 100 + 15)


def test_without_a_prefill_worker_everything_is_local() -> None:
    assert MODEL.decide(inputs(5000, remote=False)).site is PrefillSite.LOCAL


def test_span_attributes_name_the_decision_and_its_inputs() -> None:
    given = inputs(100, local_hit=32)
    attributes = MODEL.decide(given).span_attributes(given)
    assert attributes["tandem.prefill.site"] == "local"
    assert attributes["tandem.prefill.local_hit_tokens"] == 32
    assert attributes["tandem.prefill.remote_available"] is True
