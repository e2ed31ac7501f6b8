"""The precision a model computes in and its weights' format: given by flags, or chosen by a probe.

`--dtype` and `--quantization` name a `Precision`; `auto` in either one leaves the choice to the
machine. On CUDA auto means bfloat16 with dense weights. On a CPU it means the probe
(services/runtime/precision_probe.py): the model's own matrix shapes are timed at the batch sizes a
worker sees, and `choose` keeps the candidate that is fastest overall among those never much slower
than float32 at any size. With both flags auto a candidate may also be a hybrid: quantized weights
for small batches (decode, where reading weights is the cost) and a dense copy from the batch size
on which the probe found dense faster (prefill, where arithmetic is). Nothing is assumed about a
CPU: the same bf16 kernels are several times faster than fp32 on one server and far slower on another.
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
    Probes with torch's current thread count, so set it first. ValueError names a bad combination."""
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

    setup = ProbeSetup.for_model(config, (1, 8, 32, prefill_rows), torch.get_num_threads())
    by_name, source = cached_probe(setup, cache_dir)
    times = {option: by_name[option.name] for option in options}
    times.update(hybrids(times, setup.rows))
    return Choice(choose(times, by_name[FLOAT32.name]), f"auto: {source}")


def candidates(dtype: str, quantization: str) -> list[Precision]:
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_CHOICES)}")
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATION_CHOICES)}")
    return [p for p in CANDIDATES
            if (dtype == "auto" or p.dtype == DTYPES[dtype]) and quantization in ("auto", p.quantization)]


def hybrids(times: dict[Precision, list[float | None]], rows: tuple[int, ...]) -> dict[Precision, list[float | None]]:
    """Each quantized option whose dense sibling is also an option, switched to the dense copy from
    the first probed size at which that was faster (none where one format wins at every size)."""
    found: dict[Precision, list[float | None]] = {}
    for option, quantized in times.items():
        dense = times.get(Precision(option.dtype))
        if option.quantization == "none" or dense is None:
            continue
        switch = next((i for i, (q, d) in enumerate(zip(quantized, dense))
                       if d is not None and (q is None or d < q)), None)
        if switch is None or switch == 0:
            continue
        found[replace(option, dense_from_rows=rows[switch])] = quantized[:switch] + dense[switch:]
    return found


def choose(times: dict[Precision, list[float | None]], baseline: list[float | None]) -> Precision:
    """The option with the least geometric-mean time relative to float32 (`baseline`) over the probed
    batch sizes, preferring those that ran every size within RUNS_WELL of float32; the first on a tie.
    `times[option][i]` is milliseconds at the i-th size, None where the probe stopped timing it."""
    def rank(option: Precision) -> tuple[bool, float]:
        measured = times[option]
        if None in measured:
            return True, math.inf
        ratios = [t / b for t, b in zip(measured, baseline)]
        return max(ratios) > RUNS_WELL, math.exp(sum(math.log(r) for r in ratios) / len(ratios))

    return min(times, key=rank)


def _explain_empty(dtype: str, quantization: str, device: torch.device) -> None:
    check_quantization(quantization, DTYPES.get(dtype, torch.bfloat16), device)
    raise ValueError(f"--dtype {dtype} with --quantization {quantization} names no precision this build runs")
