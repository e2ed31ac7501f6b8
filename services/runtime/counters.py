"""What an engine counts since it started, as one record: the engine, its scheduler and the KV
hand-off add to it in the engine thread; the worker copies it into each snapshot, puts it on the
wire as WorkerStats and feeds Prometheus the growth between two copies. A new counter is a field
here plus a line in services/worker/stats.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(slots=True)
class EngineCounters:
    iterations: int = 0
    last_batch_size: int = 0  # a gauge: sequences in the last iteration
    batch_sizes: dict[int, int] = field(default_factory=dict)  # batch size -> iterations that ran with it
    preemptions: int = 0
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, tokens found cached
    generated_tokens: int = 0
    kv_bytes_sent: int = 0  # KV of requests exported and released
    kv_bytes_received: int = 0  # KV of requests imported and admitted

    @property
    def max_batch_size(self) -> int:
        return max(self.batch_sizes, default=0)

    def record_batch(self, size: int) -> None:
        self.iterations += 1
        self.last_batch_size = size
        self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1

    def copy(self) -> EngineCounters:
        return EngineCounters(**{f.name: getattr(self, f.name) for f in fields(self)} | {
            "batch_sizes": dict(self.batch_sizes)})

    def plus(self, other: EngineCounters) -> EngineCounters:
        """Two engines' counters as one worker's (a worker holding several models): sums, the
        histograms merged, the gauge the larger."""
        total = self.copy()
        for name in _MONOTONIC:
            setattr(total, name, getattr(self, name) + getattr(other, name))
        total.last_batch_size = max(self.last_batch_size, other.last_batch_size)
        for size, count in other.batch_sizes.items():
            total.batch_sizes[size] = total.batch_sizes.get(size, 0) + count
        return total

    def since(self, before: EngineCounters) -> EngineCounters:
        """How much each counter grew after `before` (the gauge and the histogram as they are now)."""
        grown = self.copy()
        for name in _MONOTONIC:
            setattr(grown, name, getattr(self, name) - getattr(before, name))
        return grown


_MONOTONIC = ("iterations", "preemptions", "prefix_queried_tokens", "prefix_hit_tokens", "generated_tokens",
              "kv_bytes_sent", "kv_bytes_received")
