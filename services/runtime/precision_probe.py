"""The start-up probe behind `--dtype auto`: times every candidate precision on the model's own
matrix shapes at the batch sizes a worker sees, and caches the result per machine.

Rule: the batch sizes go in ascending order. At each one, the candidates still in the race run
ROUNDS rounds, each candidate once a round, the order rotated from round to round. A run is one
pass over the matrices of a few layers (enough weight to spill the caches, as the real model does),
repeated until it has lasted MEASURE_MS; its time is the mean per pass. Each round gives every
candidate its time relative to float32's in that round, and the candidate's figure is the median of
those ratios over the rounds: a load that comes and goes slows a whole round alike and leaves its
ratios, and a round that it hit unevenly is outvoted. The probe computes on one thread and times
by that thread's CPU time, so time that other work takes the core away counts for nothing. The
formats' kernels (oneDNN's, the native ones) all split their rows over torch's threads, so their
ratios on one thread hold on more; timed on several by the wall clock, a shared machine's scheduler
decides instead (2 threads beside two busy loops: bf16 measured 2.2 to 7.1 times float32's time
at one row, against 0.7 to 0.9 on one thread by its CPU time).
A candidate whose figure is more than RUNS_WELL times float32's leaves the race (later sizes None):
it can no longer win (precision.choose), and bf16 on a CPU without bf16 hardware would take minutes.
The cache key is the CPU model and flags, the torch version, which native build runs (none, or its
build key, the hash of its sources: a kernel change probes again), the shapes and the rounds, under
$TANDEM_HOME/probes; one process probes at a time (file lock), so the workers of one machine share
one result.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from services.common.model_config import ModelConfig
from services.common.paths import tandem_home
from services.runtime import native
from services.runtime.precision import CANDIDATES, FLOAT32, RUNS_WELL
from services.runtime.quantization import Linear, make_linear

ROUNDS = 5
MEASURE_MS = 20.0  # a run repeats its pass until it has lasted this long: a 1 ms pass is not one time slice
SPILL_BYTES = 64 << 20  # float32 weight bytes the probe runs per pass, capped at the model's


@dataclass(frozen=True, slots=True)
class ProbeSetup:
    shapes: tuple[tuple[int, int], ...]  # one layer's (out, in) matrices
    layers: int
    rows: tuple[int, ...]  # batch sizes (activation rows), ascending

    @classmethod
    def for_model(cls, config: ModelConfig, rows: tuple[int, ...]) -> ProbeSetup:
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        hidden, inter = config.hidden_size, config.intermediate_size
        shapes = ((q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter))
        layer_bytes = 4 * sum(n * k for n, k in shapes)
        layers = max(1, min(config.num_layers, math.ceil(SPILL_BYTES / layer_bytes)))
        return cls(shapes, layers, tuple(sorted(set(rows))))

    def key(self) -> dict[str, object]:
        return {"cpu": _cpu_identity(), "torch": torch.__version__, **asdict(self), "rounds": ROUNDS,
                "candidates": [c.name for c in CANDIDATES], "native_kernels": native.build_dir().name if native.loaded() else None}


@dataclass(frozen=True, slots=True)
class Probe:
    """Each candidate's time relative to float32's at each of the setup's rows (the median over the
    rounds; None once it left the race), and float32's own milliseconds a pass (the median)."""
    relative: dict[str, list[float | None]]
    float32_ms: list[float]


# A probe taken while other work loads the CPU more than this (load average per core) is kept only
# until a start on a quieter machine probes again.
BUSY_LOAD = 0.5


def cached_probe(setup: ProbeSetup, cache_dir: Path | None = None) -> tuple[Probe, str]:
    """The probe's result for this machine and where it came from."""
    directory = cache_dir or tandem_home() / "probes"
    directory.mkdir(parents=True, exist_ok=True)
    key = setup.key()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = directory / f"precision-{digest}.json"
    with open(directory / "precision.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        busy = machine_load() > BUSY_LOAD
        cached = json.loads(path.read_text()) if path.is_file() else None
        if cached is not None and (busy or not cached.get("busy", False)):
            return Probe(cached["relative"], cached["float32_ms"]), f"cached probe {path}"
        probe = run_probe(setup)
        path.write_text(json.dumps({"key": key, **asdict(probe), "busy": busy}, indent=1))
    if busy:
        return probe, f"probed on a busy machine (load {machine_load():.1f} per core), probed again when it is quiet"
    return probe, f"probed, cached in {path}"


def machine_load() -> float:
    """The 1-minute load average per CPU core."""
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def run_probe(setup: ProbeSetup, clock: Callable[[], float] = time.thread_time) -> Probe:
    """The probe's figures, timed on one thread (torch's thread count is restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _probe(setup, clock)
    finally:
        torch.set_num_threads(threads)


def _probe(setup: ProbeSetup, clock: Callable[[], float]) -> Probe:
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator) * 0.02 for _ in range(setup.layers) for shape in setup.shapes]
    layers = {c: [make_linear(w, None, c.quantization, c.dtype) for w in weights] for c in CANDIDATES}
    relative: dict[str, list[float | None]] = {c.name: [] for c in CANDIDATES}
    float32_ms: list[float] = []
    for rows in setup.rows:
        inputs = [torch.randn(rows, w.shape[1], generator=generator) for w in weights]
        runs = {c.name: _pass(layers[c], [x.to(c.dtype) for x in inputs]) for c in layers}
        rounds = time_rounds(runs, clock)
        medians = median_ratios(rounds, FLOAT32.name)
        float32_ms.append(statistics.median(r[FLOAT32.name] for r in rounds))
        for candidate in CANDIDATES:
            relative[candidate.name].append(medians.get(candidate.name))
        layers = {c: linears for c, linears in layers.items() if medians[c.name] <= RUNS_WELL}
    return Probe(relative, float32_ms)


def time_rounds(runs: dict[str, Callable[[], None]], clock: Callable[[], float]) -> list[dict[str, float]]:
    """ROUNDS rounds of milliseconds a pass, per run, each round in another rotation of `runs`' order."""
    passes = {name: _passes_to_fill(run, clock) for name, run in runs.items()}
    names = list(runs)
    rounds = []
    for index in range(ROUNDS):
        turn = index % len(names)
        rounds.append({name: _mean_ms(runs[name], passes[name], clock) for name in names[turn:] + names[:turn]})
    return rounds


def median_ratios(rounds: list[dict[str, float]], baseline: str) -> dict[str, float]:
    """Per name, the median over `rounds` of its time divided by `baseline`'s in the same round."""
    return {name: statistics.median(r[name] / r[baseline] for r in rounds) for name in rounds[0]}


def _passes_to_fill(run: Callable[[], None], clock: Callable[[], float]) -> int:
    """How many passes last MEASURE_MS, after a warm-up pass (first calls pay for packing and allocation)."""
    if _mean_ms(run, 1, clock) >= MEASURE_MS:
        return 1
    return max(1, math.ceil(MEASURE_MS / max(_mean_ms(run, 1, clock), 1e-3)))


def _mean_ms(run: Callable[[], None], passes: int, clock: Callable[[], float]) -> float:
    start = clock()
    for _ in range(passes):
        run()
    return (clock() - start) * 1000 / passes


def _pass(layers: list[Linear], inputs: list[torch.Tensor]) -> Callable[[], None]:
    @torch.inference_mode()
    def run() -> None:
        for layer, x in zip(layers, inputs):
            layer(x)

    return run


def _cpu_identity() -> str:
    """The CPU model name and its feature flags, from /proc/cpuinfo where there is one."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return f"{fields.get('model name', platform.machine())} | {fields.get('flags', '')}"
