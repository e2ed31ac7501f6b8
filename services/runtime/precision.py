"""The precision a model computes in and its weights' format: given by flags, or chosen by a probe.

`--dtype` and `--quantization` name a `Precision`; `auto` in either one leaves the choice to the
machine. On CUDA auto means bfloat16 with dense weights. On a CPU it means the probe
(services/runtime/precision_probe.py): the model's own matrix shapes are timed at the batch sizes a
worker sees, relative to float32. With both flags auto a quantized candidate becomes a hybrid:
quantized weights for small batches (decode, where reading weights is the cost) and a dense copy
from the first batch size at which the probe found dense as fast, within MARGIN (prefill, where
arithmetic is). `choose` then keeps the candidate that is fastest overall among those never much
slower than float32 at any size, unless one with smaller weights is within MARGIN of it. So a
measurement overturns what the hardware's balance predicts (fewer bytes win where weights are read,
dense kernels where arithmetic is) only by a clear margin, and a probe on a loaded machine does not
flip between near-equal formats. Nothing else is assumed about a CPU: the same bf16 kernels are
several times faster than fp32 on one server and far slower on another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from services.common.model_config import ModelConfig
from services.runtime.quantization import QUANTIZATIONS, check_quantization

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
QUANTIZATION_CHOICES = ("auto", *QUANTIZATIONS)
# A candidate may be up to this much slower than float32 at one batch size and still win overall.
RUNS_WELL = 1.5
# Options whose overall times are within this fraction of the fastest's count as a tie, which the
# smaller weights win: they leave more memory to the KV cache, their lead grows with the model (a
# decode step reads every weight), and a few percent between two formats is within what a probe on a
# loaded machine can tell apart.
MARGIN = 0.1


@dataclass(frozen=True, slots=True)
class Precision:
    dtype: torch.dtype = torch.float32  # activations, KV cache and dense weights
    quantization: str = "none"  # weight-only: none | int8 | int4
    dense_from_rows: int | None = None  # quantized only: batches of this many rows or more run a dense copy

    @property
    def name(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        name = dtype if self.quantization == "none" else f"{dtype}+{self.quantization}"
        return name if self.dense_from_rows is None else f"{name}, dense from {self.dense_from_rows} rows"


FLOAT32 = Precision()
CANDIDATES = (
    FLOAT32, Precision(torch.bfloat16), Precision(torch.float16),
    Precision(torch.bfloat16, "int8"), Precision(torch.float16, "int8"),
    Precision(torch.bfloat16, "int4"), Precision(torch.float16, "int4"),
)


@dataclass(frozen=True, slots=True)
class Choice:
    precision: Precision
    reason: str  # how it was chosen, for the log and `tandem up`'s banner

    def line(self) -> str:
        return f"{self.precision.name} ({self.reason})"


def resolve(dtype: str, quantization: str, device: torch.device | str, config: ModelConfig,
            prefill_rows: int, cache_dir: Path | None = None) -> Choice:
    """The precision for these flags; runs (or reads the cached) probe when a CPU choice is left open.
    ValueError names a bad combination."""
    device = torch.device(device)
    options = candidates(dtype, quantization)
    if device.type != "cpu":  # no probe off the CPU: bfloat16, dense weights
        options = [p for p in options if (dtype != "auto" or p.dtype == torch.bfloat16)
                   and (quantization != "auto" or p.quantization == "none")]
    if not options:
        _explain_empty(dtype, quantization, device)
    for option in options:
        check_quantization(option.quantization, option.dtype, device)
    if len(options) == 1:
        given = dtype != "auto" and quantization != "auto"
        return Choice(options[0], "given" if given else f"auto on {device.type}")
    from services.runtime.precision_probe import ProbeSetup, cached_probe

    setup = ProbeSetup.for_model(config, (1, 8, 32, prefill_rows))
    probe, source = cached_probe(setup, cache_dir)
    relative = with_dense_copies({option: probe.relative[option.name] for option in options}, setup.rows)
    chosen = choose(relative)
    return Choice(chosen, f"auto: {source}; {explain(relative, chosen, setup.rows)}")


def candidates(dtype: str, quantization: str) -> list[Precision]:
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_CHOICES)}")
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATION_CHOICES)}")
    return [p for p in CANDIDATES
            if (dtype == "auto" or p.dtype == DTYPES[dtype]) and quantization in ("auto", p.quantization)]


def with_dense_copies(relative: dict[Precision, list[float | None]],
                      rows: tuple[int, ...]) -> dict[Precision, list[float | None]]:
    """The options, each quantized one whose dense sibling is also an option made a hybrid: its
    dense copy runs from the first probed size at which the dense sibling was faster or within MARGIN
    of it (where the two tie, the dense kernels, made for arithmetic, keep the larger batches)."""
    made: dict[Precision, list[float | None]] = {}
    for option, quantized in relative.items():
        dense = relative.get(Precision(option.dtype))
        ties = [] if option.quantization == "none" or dense is None else [
            i for i, (q, d) in enumerate(zip(quantized, dense)) if d is not None and (q is None or d <= q * (1 + MARGIN))]
        if not ties or ties[0] == 0:
            made[option] = quantized
        else:
            made[replace(option, dense_from_rows=rows[ties[0]])] = quantized[:ties[0]] + dense[ties[0]:]
    return made


def choose(relative: dict[Precision, list[float | None]]) -> Precision:
    """The option with the least geometric mean of its times relative to float32 over the probed
    batch sizes, preferring those that ran every size within RUNS_WELL of float32; the first on a tie.
    Of the options within MARGIN of it, though, the one with the smallest weights (a hybrid counts as
    its quantized format), so that noise between near-equal formats does not flip the choice.
    `relative[option][i]` is its time over float32's at the i-th size, None where the probe stopped timing it."""
    best = min(relative, key=lambda option: _rank(relative[option]))
    runs_well, score = _rank(relative[best])
    if math.isinf(score):
        return best
    near = [option for option in relative if _rank(relative[option]) <= (runs_well, score * (1 + MARGIN))]
    return min(near, key=lambda option: (weight_bits(option), _rank(relative[option])))


def explain(relative: dict[Precision, list[float | None]], chosen: Precision, rows: tuple[int, ...]) -> str:
    """The figures that decided: the chosen option's and the fastest other's, relative to float32."""
    sizes = "/".join(str(r) for r in rows)
    others = [option for option in relative if option != chosen and not math.isinf(_rank(relative[option])[1])]
    line = f"{_figures(chosen, relative[chosen])} of float32's time at {sizes} rows"
    if not others:
        return line
    other = min(others, key=lambda option: _rank(relative[option]))
    kept = " (within the margin: the smaller weights kept)" if _rank(relative[other]) < _rank(relative[chosen]) else ""
    return f"{line}; next {_figures(other, relative[other])}{kept}"


def weight_bits(option: Precision) -> int:
    """Bits a weight takes in the option's stored format."""
    return {"int4": 4, "int8": 8}.get(option.quantization) or torch.finfo(option.dtype).bits


def _rank(relative: list[float | None]) -> tuple[bool, float]:
    """(whether it ran some size more than RUNS_WELL slower than float32, its geometric mean); inf if unfinished."""
    if None in relative:
        return True, math.inf
    return max(relative) > RUNS_WELL, math.exp(sum(math.log(r) for r in relative) / len(relative))


def _figures(option: Precision, relative: list[float | None]) -> str:
    each = "/".join("-" if r is None else f"{r:.2f}" for r in relative)
    return f"{option.name} {_rank(relative)[1]:.3f} ({each})"


def _explain_empty(dtype: str, quantization: str, device: torch.device) -> None:
    check_quantization(quantization, DTYPES.get(dtype, torch.bfloat16), device)
    raise ValueError(f"--dtype {dtype} with --quantization {quantization} names no precision this build runs")
