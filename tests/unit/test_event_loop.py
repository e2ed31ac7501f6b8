"""A service's event loop (the gateway's and the scheduler's --event-loop): uvloop's when installed
(auto) or asked, asyncio's when asked or when uvloop is missing under auto; asking for uvloop without
it, or for a loop that does not exist, fails with what to do."""

from __future__ import annotations

import argparse
import asyncio
import sys

import pytest

from services.common import event_loop
from services.scheduler import main as scheduler_main


async def _loop_name() -> str:
    return event_loop.loop_name(asyncio.get_running_loop())


def test_auto_and_uvloop_run_on_uvloop() -> None:
    pytest.importorskip("uvloop")
    assert event_loop.run(_loop_name(), "auto") == "uvloop"
    assert event_loop.run(_loop_name(), "uvloop") == "uvloop"


def test_asyncio_runs_on_asyncios_loop() -> None:
    assert event_loop.loop_factory("asyncio") is None
    assert event_loop.run(_loop_name(), "asyncio") == "asyncio"


def test_without_uvloop_auto_falls_back_and_uvloop_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    assert event_loop.loop_factory("auto") is None
    assert event_loop.run(_loop_name(), "auto") == "asyncio"
    with pytest.raises(event_loop.EventLoopError, match="pip install uvloop"):
        event_loop.loop_factory("uvloop")


def test_an_unknown_loop_is_refused() -> None:
    with pytest.raises(event_loop.EventLoopError, match="expected one of auto, uvloop, asyncio"):
        event_loop.loop_factory("trio")


def _scheduler_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    scheduler_main.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_scheduler_runs_on_uvloop_unless_told_otherwise() -> None:
    assert _scheduler_args().event_loop == "auto"
    assert _scheduler_args("--event-loop", "asyncio").event_loop == "asyncio"
    with pytest.raises(SystemExit):
        _scheduler_args("--event-loop", "trio")


def test_the_scheduler_asked_for_uvloop_without_it_says_what_to_do(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)
    args = _scheduler_args("--event-loop", "uvloop", "--metrics-port", "0", "--insecure-internal")
    assert scheduler_main.main(args) == 2
    assert ("tandem scheduler: --event-loop uvloop: uvloop is not installed (pip install uvloop)"
            in capsys.readouterr().err)
