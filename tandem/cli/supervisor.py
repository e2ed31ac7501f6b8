"""Child processes of `tandem up`: start each in its own process group with its log in the run
directory, wait until it answers (gRPC health SERVING, or a probe), restart one that exits on its
own (same command, ports and environment) with exponential backoff, and stop the lot: SIGTERM, a
grace period, then SIGKILL for stragglers, group by group so no grandchild is left behind.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None) if sys.platform == "linux" else None  # loaded before any fork
_POLL_S = 0.2
_WATCH_S = 0.5
_LOG_TAIL_LINES = 30
_MAX_DOUBLINGS = 64  # 2**64 times any first delay is past every cap: no float overflow


class StopRequest:
    """Ctrl-C or SIGTERM, set from a signal handler and waited for by the main thread.

    Not a threading.Event: its set() takes the lock its wait() holds around each wake-up, so a
    signal landing there (the handler runs on the main thread) deadlocks `tandem up` for good.
    This is a flag and a self-pipe: set() takes no lock, wait() sleeps in select() on the pipe.
    """

    def __init__(self) -> None:
        self._set = False
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)

    def set(self) -> None:
        self._set = True
        try:
            os.write(self._write, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of earlier wake-ups: the waiter wakes anyway

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """True once set; False when `timeout` seconds pass first."""
        if not self._set:
            select.select([self._read], [], [], timeout)
        return self._set

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


class StartFailed(RuntimeError):
    """A child exited or did not become ready while the system was starting."""


class Interrupted(RuntimeError):
    """SIGINT or SIGTERM arrived while the system was starting."""


@dataclass(slots=True)
class Child:
    """One child process. `ready` says whether it answers yet (it may raise grpc.RpcError or
    OSError while the child starts)."""

    name: str
    argv: list[str]
    log_path: Path
    ready: Callable[[], bool]
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # the child's own, over the launcher's

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was not started"
        return self.process.pid

    def start(self, env: dict[str, str]) -> None:
        self.env = {**env, **self.env}
        self._spawn("wb")

    def restart(self) -> None:
        """Start again with the same command and environment, appending to the same log."""
        status = self.exit_code()
        assert status is not None, f"{self.name} is still running"
        _signal_group(self, signal.SIGKILL)  # whatever the dead child left in its group
        with self.log_path.open("ab") as log:
            log.write(f"\n--- tandem up: restarting {self.name} after exit status {status} ---\n".encode())
        self._spawn("ab")

    def _spawn(self, mode: str) -> None:
        with self.log_path.open(mode) as log:
            self.process = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self.env,
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


def wait_ready(children: Sequence[Child], timeout: float, stop: StopRequest,
               on_ready: Callable[[Child], None] = lambda child: None) -> None:
    """Return once every child is ready, calling `on_ready` for each as it gets there. StartFailed
    when one exits or the time is up; Interrupted on `stop`."""
    deadline = time.monotonic() + timeout
    pending = list(children)
    while True:
        for child in pending:
            if child.exit_code() is not None:
                raise StartFailed(child.died_message())
        ready = [child for child in pending if _is_ready(child)]
        for child in ready:
            on_ready(child)
        pending = [child for child in pending if child not in ready]
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


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When a child exits on its own it is restarted after `first_delay_s`, doubled with each
    failure in a row up to `max_delay_s`. A child that ran `stable_s` or longer before it exited
    starts the count afresh. The failure after `max_restarts` restarts in a row gives up
    (max_restarts 0: the first exit gives up)."""

    max_restarts: int = 5
    first_delay_s: float = 0.5
    max_delay_s: float = 30.0
    stable_s: float = 30.0

    def delay(self, failures: int) -> float:
        """Seconds to wait before the restart that follows the `failures`-th failure in a row."""
        return min(self.first_delay_s * 2.0 ** min(failures - 1, _MAX_DOUBLINGS), self.max_delay_s)


@dataclass(slots=True)
class Backoff:
    """One child's failures in a row under a RestartPolicy; `clock` (monotonic seconds) is injectable."""

    policy: RestartPolicy
    clock: Callable[[], float] = time.monotonic
    failures: int = 0
    started_at: float = 0.0

    def started(self) -> None:
        self.started_at = self.clock()

    def failed(self) -> float | None:
        """The child exited just now: seconds to wait before restarting it, or None to give up."""
        if self.clock() - self.started_at >= self.policy.stable_s:
            self.failures = 0
        self.failures += 1
        return self.policy.delay(self.failures) if self.failures <= self.policy.max_restarts else None


@dataclass(slots=True)
class _Watched:
    child: Child
    backoff: Backoff
    restart_at: float | None = None  # set while the child is dead and waits for its restart
    recovering: bool = False  # restarted, not ready yet


class Supervisor:
    """Keeps started children running. Each round, a child found dead is announced with its exit
    status and log tail and scheduled for a restart after its backoff delay; at that time it starts
    again on the same command, ports and environment; once it answers again that is announced too.
    Announcements go to `say` (stderr by default), one line each, prefixed `tandem up: `."""

    def __init__(self, children: Sequence[Child], policy: RestartPolicy, clock: Callable[[], float] = time.monotonic,
                 say: Callable[[str], None] | None = None) -> None:
        self.policy = policy
        self._clock = clock
        self._say = say or _say
        self._watched = [_Watched(child, Backoff(policy, clock)) for child in children]
        for watched in self._watched:
            watched.backoff.started()

    def run(self, stop: StopRequest, interval: float = _WATCH_S) -> int:
        """Until `stop` is set (0), or until a child fails more often in a row than the policy allows (1)."""
        while not stop.wait(interval):
            if not self.check():
                return 1
        return 0

    def check(self) -> bool:
        """One round over the children; False when one failed too often (the caller stops everything)."""
        return all(self._check(watched) for watched in self._watched)

    def _check(self, watched: _Watched) -> bool:
        child = watched.child
        if child.exit_code() is None:
            if watched.recovering and _is_ready(child):
                watched.recovering = False
                self._say(f"{child.name} is ready again (pid {child.pid})")
            return True
        if watched.restart_at is None:
            self._say(child.died_message())
            delay = watched.backoff.failed()
            if delay is None:
                self._say(f"{child.name} exited {watched.backoff.failures} time(s) in a row, each within "
                          f"{self.policy.stable_s:.0f} s of its start, after {self.policy.max_restarts} restart(s) "
                          f"(--max-restarts); giving up and stopping everything")
                return False
            watched.restart_at = self._clock() + delay
            self._say(f"restarting {child.name} in {delay:.1f} s "
                      f"(restart {watched.backoff.failures} of at most {self.policy.max_restarts} in a row)")
        elif self._clock() >= watched.restart_at:
            child.restart()
            watched.backoff.started()
            watched.restart_at = None
            watched.recovering = True
            self._say(f"{child.name} restarted, pid {child.pid}")
        return True


def _say(line: str) -> None:
    print(f"tandem up: {line}", file=sys.stderr, flush=True)


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
