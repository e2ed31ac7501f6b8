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


@dataclass(frozen=True, slots=True)
class Topology:
    """How many workers of each role; prefill workers take the first GPUs, decode the next."""

    prefill: int = 1
    decode: int = 1

    def __post_init__(self) -> None:
        for role, count in (("prefill", self.prefill), ("decode", self.decode)):
            if count < 1:
                raise ValueError(f"--{role} must be at least 1, got {count}")

    @property
    def num_gpus(self) -> int:
        return self.prefill + self.decode

    def count(self, role: Role) -> int:
        return {PREFILL.name: self.prefill, DECODE.name: self.decode}[role.name]
