"""The start-up probe behind `--dtype auto`: times every candidate precision on the model's own
matrix shapes at the batch sizes a worker sees, and caches the times per machine.

Rule: the batch sizes go in ascending order; at each one, every candidate still in the race runs
the matrices of a few layers (enough weight to spill the caches, as the real model does) REPS
times, interleaved with the others so a busy neighbour slows all alike, and keeps its best time.
A candidate slower than float32 by more than RUNS_WELL leaves the race (later sizes None): it can
no longer win (precision.choose), and bf16 on a CPU without bf16 hardware would take minutes. The
cache key is the CPU model and flags, the torch version, which native build runs (none, or its
build key, the hash of its sources: a kernel change probes again), the thread count and the
shapes, under $TANDEM_HOME/probes; one process probes at a time (file lock), so the workers of one
machine share one result.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from services.common.model_config import ModelConfig
from services.common.paths import tandem_home
from services.runtime import native
from services.runtime.precision import CANDIDATES, FLOAT32, RUNS_WELL, Precision
from services.runtime.quantization import Linear, make_linear

REPS = 3
SPILL_BYTES = 64 << 20  # float32 weight bytes the probe runs per pass, capped at the model's


@dataclass(frozen=True, slots=True)
class ProbeSetup:
    shapes: tuple[tuple[int, int], ...]  # one layer's (out, in) matrices
    layers: int
    rows: tuple[int, ...]  # batch sizes (activation rows), ascending
    threads: int

    @classmethod
    def for_model(cls, config: ModelConfig, rows: tuple[int, ...], threads: int) -> ProbeSetup:
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        hidden, inter = config.hidden_size, config.intermediate_size
        shapes = ((q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter))
        layer_bytes = 4 * sum(n * k for n, k in shapes)
        layers = max(1, min(config.num_layers, math.ceil(SPILL_BYTES / layer_bytes)))
        return cls(shapes, layers, tuple(sorted(set(rows))), threads)

    def key(self) -> dict[str, object]:
        return {"cpu": _cpu_identity(), "torch": torch.__version__, **asdict(self),
                "candidates": [c.name for c in CANDIDATES], "native_kernels": native.build_dir().name if native.loaded() else None}


# A probe taken while other work loads the CPU more than this (load average per core) times that
# work, not the kernels: it is kept only until a start on a quieter machine probes again.
BUSY_LOAD = 0.5


def cached_probe(setup: ProbeSetup, cache_dir: Path | None = None) -> tuple[dict[str, list[float | None]], str]:
    """The candidates' times (ms per pass at each of setup.rows) and where they came from."""
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
            return cached["times_ms"], f"cached probe {path}"
        times = run_probe(setup)
        path.write_text(json.dumps({"key": key, "times_ms": times, "busy": busy}, indent=1))
    if busy:
        return times, f"probed on a busy machine (load {machine_load():.1f} per core), probed again when it is quiet"
    return times, f"probed, cached in {path}"


def machine_load() -> float:
    """The 1-minute load average per CPU core."""
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def run_probe(setup: ProbeSetup) -> dict[str, list[float | None]]:
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator) * 0.02 for _ in range(setup.layers) for shape in setup.shapes]
    times: dict[str, list[float | None]] = {c.name: [] for c in CANDIDATES}
    racing = list(CANDIDATES)
    for rows in setup.rows:
        best = _race(racing, weights, rows)
        for candidate in CANDIDATES:
            times[candidate.name].append(best.get(candidate.name))
        racing = [c for c in racing if best[c.name] <= RUNS_WELL * best[FLOAT32.name]]
    return times


def _race(racing: list[Precision], weights: list[torch.Tensor], rows: int) -> dict[str, float]:
    """Best milliseconds of one pass over `weights` at `rows` rows, per racing candidate."""
    best = {c.name: math.inf for c in racing}
    runs = {c.name: _pass(c, weights, rows) for c in racing}
    for _ in range(REPS):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], (time.perf_counter() - start) * 1000)
    return best


def _pass(precision: Precision, weights: list[torch.Tensor], rows: int):
    layers: list[Linear] = [make_linear(w, None, precision.quantization, precision.dtype) for w in weights]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(precision.dtype) for w in weights}

    @torch.inference_mode()
    def run() -> None:
        for layer, weight in zip(layers, weights):
            layer(inputs[weight.shape[1]])

    run()  # warm-up: first calls pay for packing and allocation
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
