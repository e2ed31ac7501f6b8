"""Migration arithmetic without a network: the continuation of a request after some delivered
tokens (prompt, max_tokens, min_tokens, seed, salt, attempt id), when a request may not move, its
restated usage, and the relay going on at the same output offset after an interruption."""

from __future__ import annotations

import pytest

from services.common.errors import Unavailable
from services.common.wire import DEFAULT_MAX_TOKENS
from services.gateway.relay import restate_usage
from services.scheduler.migration import MAX_MIGRATIONS, attempt_id, continuation, refusal
from services.gateway.relay import Interrupted, Relay
from tandem.v1 import common_pb2, scheduler_pb2

LENGTH = common_pb2.FINISH_REASON_LENGTH


def submit(**sampling) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(request_id="r1", model="smol", token_ids=[5, 6, 7], cache_salt="tenant",
                                       sampling=common_pb2.SamplingParams(seed=42, **sampling))


def event(offset: int, *tokens: int, finish: int = common_pb2.FINISH_REASON_UNSPECIFIED) -> scheduler_pb2.TokenEvent:
    return scheduler_pb2.TokenEvent(request_id="r1", output_offset=offset, token_ids=tokens, finish_reason=finish)


def test_a_continuation_appends_the_delivered_tokens_and_takes_them_off_the_limits() -> None:
    original = submit(max_tokens=10, min_tokens=4, temperature=0.7, repetition_penalty=1.2)
    moved = continuation(original, [100, 101, 102], attempt_id("r1", 1, taken=()))
    assert moved.request_id == "r1#migrated-1"
    assert list(moved.token_ids) == [5, 6, 7, 100, 101, 102]
    assert (moved.sampling.max_tokens, moved.sampling.min_tokens) == (7, 1)
    assert (moved.sampling.seed, moved.cache_salt, moved.model) == (42, "tenant", "smol")
    assert moved.sampling.temperature == pytest.approx(0.7) and moved.sampling.repetition_penalty == pytest.approx(1.2)
    assert list(original.token_ids) == [5, 6, 7] and original.sampling.max_tokens == 10  # untouched


def test_min_tokens_never_goes_below_zero_and_an_unset_max_tokens_is_the_default() -> None:
    moved = continuation(submit(min_tokens=2), [100, 101, 102], "r1#migrated-2")
    assert (moved.sampling.max_tokens, moved.sampling.min_tokens) == (DEFAULT_MAX_TOKENS - 3, 0)
    assert continuation(submit(max_tokens=5), [], "r1#migrated-1").sampling.max_tokens == 5


def test_an_attempt_id_skips_the_ids_in_flight() -> None:
    assert attempt_id("r1", 2, taken={"r1", "r1#migrated-1"}) == "r1#migrated-2"
    assert attempt_id("r1", 1, taken={"r1#migrated-1", "r1#migrated-2"}) == "r1#migrated-3"


def test_penalties_on_output_tokens_keep_a_request_from_moving_once_it_has_tokens() -> None:
    assert refusal(submit(presence_penalty=0.5), delivered=0, migrations=0) is None
    assert refusal(submit(presence_penalty=0.5), delivered=1, migrations=0) == (
        "presence and frequency penalties count output tokens, which a continuation cannot tell apart")
    assert refusal(submit(frequency_penalty=-1.0), delivered=3, migrations=0) is not None
    assert refusal(submit(repetition_penalty=1.3), delivered=3, migrations=0) is None
    assert refusal(submit(), delivered=3, migrations=MAX_MIGRATIONS) == f"it moved {MAX_MIGRATIONS} times already"


def test_the_usage_of_a_continued_request_counts_its_delivered_tokens_as_output() -> None:
    usage = common_pb2.Usage(prompt_tokens=6, cached_tokens=5, completion_tokens=4)
    restate_usage(usage, prompt_tokens=3, completion_tokens=7)
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (3, 3, 7)


async def test_the_relay_goes_on_at_the_same_offset_after_an_interruption() -> None:
    relay = Relay("r1")
    relay.push(event(0, 100))
    relay.push(event(1, 101))
    relay.push(event(3, 103))  # held: its gap never fills, its worker is lost
    lost = Unavailable("request r1: lost")
    relay.interrupt(lost)
    relay.push(event(0, 102))  # the continuation numbers its outputs from 0
    relay.push(event(2, 104, finish=LENGTH))  # ahead of the cursor: held
    relay.push(event(1, 103))

    delivered, interruptions = [], []
    while True:
        try:
            async for item in relay.events(lambda: None):
                delivered.append((item.output_offset, list(item.token_ids), item.finish_reason))
            break
        except Interrupted as interruption:
            interruptions.append((interruption.error, interruption.offset))
    assert interruptions == [(lost, 2)]
    # Tokens waiting for the reader join one event, never across the interruption or into the final one.
    assert delivered == [(0, [100, 101], 0), (2, [102, 103], 0), (4, [104], LENGTH)]
    assert relay.tokens == [100, 101, 102, 103, 104] and relay.next_offset == 5 and relay.closed


def test_an_interruption_after_the_stream_ended_changes_nothing() -> None:
    relay = Relay("r1")
    relay.push(event(0, 100, finish=LENGTH))
    relay.interrupt(Unavailable("late"))
    assert relay.base == 0 and relay.next_offset == 1
