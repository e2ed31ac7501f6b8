"""One model resident on a worker: its engine, the thread that steps it, and its KV hand-off.

A worker holds one per resident model (services/worker/residency.py decides which); each has its
own KV pool of the worker's --kv-memory, so loading a model never shrinks another's cache.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch

from services.runtime.counters import EngineCounters
from services.runtime.engine import Engine
from services.runtime.kv_handoff import KvHandoff
from services.worker.engine_loop import EngineLoop


@dataclass(slots=True)
class ServedModel:
    name: str
    engine: Engine
    loop: EngineLoop
    handoff: KvHandoff
    reported: EngineCounters = field(default_factory=EngineCounters)  # counters as last fed to Prometheus

    def active_requests(self) -> int:
        """Requests queued or running in its engine, or holding its blocks in a KV hand-off."""
        snapshot = self.loop.snapshot
        return snapshot.running + snapshot.waiting + self.handoff.num_in_flight


def free_memory(device: str) -> None:
    """Returns the memory of models just dropped: their engines hold reference cycles, and CUDA
    keeps freed blocks cached for the process unless asked to give them back. Objects frozen by
    `freeze_memory` are collected too, and what stays is frozen again."""
    frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def freeze_memory() -> None:
    """Collects, then takes every object left out of the collector's generations: a worker's loaded
    model is about 220,000 objects, whose full collection took 150 ms of CPU (500 ms under load) and
    stopped the engine thread's step with it (the slowest inter-token gaps of the long-prompt mix).
    The worker process calls it once its models are loaded."""
    gc.collect()
    gc.freeze()
