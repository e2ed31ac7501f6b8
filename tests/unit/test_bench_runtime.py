"""bench/runtime.py's interleaving: each round takes every figure from every runner in turn, the order
rotated, and the summary keeps per-round ratios' median and range."""

from __future__ import annotations

import pytest

from bench.runtime import HF, TARGETS, Figures, interleaved, summarize


class Recorder:
    """A runner whose every generate is logged, on a clock that moves by this runner's cost per call."""

    def __init__(self, name: str, log: list[str], now: list[float], seconds: float) -> None:
        self.name, self.log, self.now, self.seconds = name, log, now, seconds

    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        self.log.append(f"{self.name} {len(prompts)}x{len(prompts[0])}+{new_tokens}")
        self.now[0] += self.seconds * (1 if new_tokens == 1 and len(prompts[0]) == 16 else new_tokens)


def test_each_round_takes_every_figure_from_every_runner_in_a_rotated_order():
    log: list[str] = []
    now = [0.0]
    runners = {name: Recorder(name, log, now, seconds) for name, seconds in (("auto", 0.01), (HF, 0.05))}
    rounds = interleaved(runners, Figures(batch32_tokens=8, clock=lambda: now[0]), 2)
    assert log == [
        "auto 1x16+65", "auto 1x16+1", f"{HF} 1x16+65", f"{HF} 1x16+1",
        "auto 32x16+8", f"{HF} 32x16+8", "auto 1x512+1", f"{HF} 1x512+1",
        f"{HF} 1x16+65", f"{HF} 1x16+1", "auto 1x16+65", "auto 1x16+1",
        f"{HF} 32x16+8", "auto 32x16+8", f"{HF} 1x512+1", "auto 1x512+1",
    ]
    assert rounds[0]["auto"] == pytest.approx({"decode_b1_ms_per_token": 10.0, "decode_b32_tokens_per_s": 3200.0,
                                               "prefill_tokens_per_s": 51200.0})


def test_the_summary_is_the_median_ratio_with_its_range():
    def figures(b1: float, b32: float, prefill: float) -> dict[str, float]:
        return dict(zip(TARGETS, (b1, b32, prefill)))

    rounds = [{"auto": figures(10.0, 400.0, 1000.0), HF: figures(80.0, 100.0, 500.0)},
              {"auto": figures(20.0, 300.0, 900.0), HF: figures(100.0, 150.0, 300.0)},  # a round the load moved
              {"auto": figures(10.0, 420.0, 1100.0), HF: figures(70.0, 140.0, 500.0)}]
    summary = summarize(rounds, HF)
    assert summary[HF] == figures(80.0, 140.0, 500.0)
    assert summary["auto"] == {
        **figures(10.0, 400.0, 1000.0),
        "ratio_over_hf": figures(7.0, 3.0, 2.2),
        "ratio_range": dict(zip(TARGETS, ([5.0, 8.0], [2.0, 4.0], [2.0, 3.0]))),
    }
