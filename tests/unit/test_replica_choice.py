"""The gateway's choice of scheduler replica (services/gateway/replica_choice.py): a request's
leading prefix ranks the replicas (rendezvous hashing), bounded by each replica's share of the
recent submissions, passing over unavailable ones in the key's order."""

from __future__ import annotations

import pytest

from services.gateway.replica_choice import KEY_TOKENS, MIN_SHARE, ReplicaChoice, prefix_key, rendezvous_order

PROMPT = list(range(100, 132))
KEY = prefix_key("m", "", "", PROMPT)


def test_a_keys_order_is_fixed_and_agrees_across_replica_counts() -> None:
    assert rendezvous_order(KEY, 4) == [2, 0, 3, 1]
    assert rendezvous_order(KEY, 3) == [2, 0, 1]  # replica 3 gone: the others keep their order
    assert rendezvous_order(KEY, 2) == [0, 1]
    assert rendezvous_order(prefix_key("m", "tenant-a", "", PROMPT), 4) == [2, 1, 0, 3]


def test_the_key_is_the_model_tenant_adapter_and_first_tokens() -> None:
    assert prefix_key("m", "", "", PROMPT[:KEY_TOKENS] + [7, 8, 9]) == KEY  # the rest of the prompt does not count
    assert prefix_key("m", "", "", PROMPT[:KEY_TOKENS - 1] + [0]) != KEY
    assert len({KEY, prefix_key("other", "", "", PROMPT), prefix_key("m", "salt", "", PROMPT),
                prefix_key("m", "", "adapter", PROMPT)}) == 4


def test_each_key_goes_to_its_first_replica_and_gateways_agree() -> None:
    keys = [prefix_key("m", "", "", [1000 + family * 97 + j for j in range(32)]) for family in range(6)]
    first, second = ReplicaChoice(4), ReplicaChoice(4)
    for key in keys * 2:  # at most MIN_SHARE on any one replica: no bound reached
        assert first.choose(key) == second.choose(key) == rendezvous_order(key, 4)[0]


def test_one_hot_key_spills_over_its_order_within_the_bound() -> None:
    choice = ReplicaChoice(4, window=256, load_factor=1.25)
    assert [choice.choose(KEY) for _ in range(MIN_SHARE)] == [2] * MIN_SHARE  # light traffic stays whole
    assert choice.choose(KEY) == 0  # replica 2 holds its minimum share: the key's next one
    for _ in range(1000):
        choice.choose(KEY)
    # ceil(1.25 * 257 / 4) = 81 of the last 256 at most on each; the rest goes to the last in order.
    assert [choice.share(r) for r in (2, 0, 3, 1)] == [81, 81, 80, 14]


def test_unavailable_replicas_are_passed_over_in_the_keys_order() -> None:
    choice = ReplicaChoice(4)
    assert choice.choose(KEY, lambda r: r != 2) == 0
    assert choice.choose(KEY, lambda r: r not in (2, 0)) == 3
    assert choice.choose(KEY, lambda r: r == 1) == 1
    assert choice.choose(KEY, lambda r: False) == 2  # none available: the key's first (its call fails over)


def test_one_replica_takes_everything() -> None:
    choice = ReplicaChoice(1)
    assert [choice.choose(KEY, lambda r: False) for _ in range(20)] == [0] * 20


@pytest.mark.parametrize(("replicas", "load_factor", "message"), [
    (0, 1.25, "at least one scheduler replica"),
    (2, 0.5, "load_factor is 0.5; give 1 or more"),
])
def test_bad_settings_say_what_to_change(replicas: int, load_factor: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReplicaChoice(replicas, load_factor=load_factor)
