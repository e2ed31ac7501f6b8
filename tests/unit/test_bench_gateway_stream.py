"""bench/gateway_stream.py without a cluster: --split's arithmetic (the gateway's CPU per request as a fixed part
and a part per token) and the context switches read from /proc."""

from __future__ import annotations

import pytest

from bench.gateway_stream import per_request_and_token, switch_counts


def test_two_lengths_give_the_fixed_cost_and_the_cost_per_token() -> None:
    # 1.5 ms a request plus 0.08 ms a token: 128 tokens cost 11.74 ms, 2 tokens 1.66 ms.
    fixed, per_token = per_request_and_token(11.74, 128, 1.66, 2)

    assert per_token == pytest.approx(0.08)
    assert fixed == pytest.approx(1.5)


def test_a_cost_that_does_not_grow_with_length_is_all_fixed() -> None:
    assert per_request_and_token(3.0, 256, 3.0, 2) == (3.0, 0.0)


def test_context_switches_are_read_from_a_status_file() -> None:
    status = "Name:\tpython\nState:\tS (sleeping)\nvoluntary_ctxt_switches:\t1234\nnonvoluntary_ctxt_switches:\t56\n"

    assert switch_counts(status) == (1234, 56)
