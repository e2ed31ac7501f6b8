"""What every deployment writer shares: the roles, their ports, and how many of each run.

`tandem deploy compose` (deploy.py) and `tandem deploy kubernetes` (kubernetes.py) both render a
`Topology`, so a port or a role changes in one place for every target.
"""

from __future__ import annotations

from dataclasses import dataclass

TANDEM_HOME = "/var/lib/tandem"  # the model cache, mounted in every Tandem container
SCHEDULER_PORT, SCHEDULER_METRICS_PORT = 50052, 9102
GATEWAY_PORT, GATEWAY_HTTP_PORT = 50051, 8000


@dataclass(frozen=True, slots=True)
class Role:
    """A worker role: its `tandem` subcommand and the ports each of its containers listens on."""

    name: str
    port: int
    metrics_port: int


PREFILL = Role("prefill", 50061, 9103)
DECODE = Role("decode", 50071, 9104)


def scheduler_name(index: int) -> str:
    """The `index`-th scheduler replica's name: "scheduler", then "scheduler-1", ... (as `tandem up`)."""
    return f"scheduler-{index}" if index else "scheduler"


@dataclass(frozen=True, slots=True)
class Topology:
    """How many workers of each role, and scheduler replicas; prefill workers take the first GPUs,
    decode the next. The replicas share Redis, and every gateway and worker is given them all."""

    prefill: int = 1
    decode: int = 1
    schedulers: int = 1

    def __post_init__(self) -> None:
        for flag, count in (("prefill", self.prefill), ("decode", self.decode), ("schedulers", self.schedulers)):
            if count < 1:
                raise ValueError(f"--{flag} must be at least 1, got {count}")

    @property
    def scheduler_names(self) -> list[str]:
        return [scheduler_name(i) for i in range(self.schedulers)]

    @property
    def num_gpus(self) -> int:
        return self.prefill + self.decode

    def count(self, role: Role) -> int:
        return {PREFILL.name: self.prefill, DECODE.name: self.decode}[role.name]
