"""Child processes of `tandem up`: start each in its own process group with its log in the run
directory, wait until it answers (gRPC health SERVING, or a probe), and stop the lot: SIGTERM,
a grace period, then SIGKILL for stragglers, group by group so no grandchild is left behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None) if sys.platform == "linux" else None  # loaded before any fork
_POLL_S = 0.2
_LOG_TAIL_LINES = 30


class StartFailed(RuntimeError):
    """A child exited or did not become ready while the system was starting."""


class Interrupted(RuntimeError):
    """SIGINT or SIGTERM arrived while the system was starting."""


@dataclass(slots=True)
class Child:
    """One child process. `ready` says whether it answers yet (it may raise grpc.RpcError or
    OSError while the child starts); `essential` children take the system down when they die."""

    name: str
    argv: list[str]
    log_path: Path
    ready: Callable[[], bool]
    essential: bool = True
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was not started"
        return self.process.pid

    def start(self, env: dict[str, str]) -> None:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=_die_with_parent,
            )

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def died_message(self) -> str:
        tail = self.log_tail()
        return (f"{self.name} exited with status {self.exit_code()} (log {self.log_path})"
                + (f"; last lines:\n{tail}" if tail else ""))


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if the launcher dies, even by SIGKILL (Linux)."""
    if sys.platform == "linux":
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def wait_ready(children: Sequence[Child], timeout: float, stop: threading.Event) -> None:
    """Return once every child is ready. StartFailed when one exits or the time is up; Interrupted on `stop`."""
    deadline = time.monotonic() + timeout
    pending = list(children)
    while True:
        for child in pending:
            if child.exit_code() is not None:
                raise StartFailed(child.died_message())
        pending = [child for child in pending if not _is_ready(child)]
        if not pending:
            return
        if stop.is_set():
            raise Interrupted("interrupted while starting")
        if time.monotonic() > deadline:
            names = ", ".join(child.name for child in pending)
            tails = "\n".join(f"--- {c.name} ({c.log_path}):\n{c.log_tail()}" for c in pending)
            raise StartFailed(f"{names} not ready after {timeout:.0f} s\n{tails}")
        stop.wait(_POLL_S)


def _is_ready(child: Child) -> bool:
    try:
        return child.ready()
    except (grpc.RpcError, OSError):
        return False


def stop_all(tiers: Sequence[Sequence[Child]], grace: float) -> None:
    """Stop tier after tier (the first first): SIGTERM to each group, `grace` seconds, then SIGKILL."""
    for tier in tiers:
        started = [child for child in tier if child.process is not None]
        for child in started:
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in started:
            assert child.process is not None
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"tandem up: {child.name} did not stop in {grace:.0f} s; killing it", file=sys.stderr)
            _signal_group(child, signal.SIGKILL)  # stragglers, and any grandchild left in the group
            child.process.wait()


def _signal_group(child: Child, sig: int) -> None:
    try:
        os.killpg(child.pid, sig)
    except ProcessLookupError:
        pass  # the group is gone already
