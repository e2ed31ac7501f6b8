"""The `tandem` dispatcher, `tandem model`, and the streaming view of `tandem generate`."""

from __future__ import annotations

import importlib.metadata
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cli import main as cli
from tandem.cli.generate import Completion, StreamView
from tandem.cli.main import COMMANDS, Command

ALL_COMMANDS = [
    "up", "gateway", "scheduler", "prefill", "decode", "colocated", "sim-worker", "health", "model", "models",
    "generate", "chat", "trace", "deploy",
]


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    listed = [line.split()[0] for line in lines[lines.index("commands:") + 1 :]]
    assert listed == ALL_COMMANDS == list(COMMANDS)


def test_help_imports_no_command_module():
    script = (
        "import sys\nfrom tandem.cli import main as cli\n"
        "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "loaded = [m for m in ('torch', 'transformers', 'tandem.cli.trace', 'tandem.cli.model') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                   cwd=Path(__file__).parents[2])


def test_python_m_tandem_cli_is_the_tandem_command():
    done = subprocess.run([sys.executable, "-m", "tandem.cli", "--help"], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: tandem ")
    assert "commands:" in done.stdout


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"tandem {importlib.metadata.version('tandem')}\n"


def test_no_command_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "commands:" in capsys.readouterr().out


def test_missing_command_module_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(COMMANDS, "gateway", Command("services.gateway.not_written_yet", "run the gateway"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["gateway", "--port", "1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "tandem: error: `tandem gateway` is not available in this installation "
        "(module services.gateway.not_written_yet not found)\n"
    )


def test_a_missing_dependency_is_not_hidden(monkeypatch, tmp_path):
    (tmp_path / "needs_missing_dep.py").write_text("import a_dependency_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(COMMANDS, "gateway", Command("needs_missing_dep", "run the gateway"))
    with pytest.raises(ModuleNotFoundError, match="a_dependency_that_is_not_installed"):
        cli.main(["gateway"])


def test_model_info_command(default_model_dir, capsys):
    assert cli.main(["model", "info", str(default_model_dir), "--memory", "4GiB"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out
    assert "134,515,008" in out
    assert "kv bytes per token            46,080" in out
    assert "kv tokens in 4 GiB            93,206" in out


def test_model_info_error_goes_to_stderr(tmp_path, capsys):
    assert cli.main(["model", "info", str(tmp_path)]) == 1
    assert "config.json: missing" in capsys.readouterr().err


def test_pull_default_prints_the_directory(default_model_dir, capsys):
    assert cli.main(["model", "pull-default"]) == 0
    assert capsys.readouterr().out == f"{default_model_dir}\n"


def test_stream_view_shows_prompts_in_order(default_model_dir):
    from services.common.tokenizer import TextCodec

    codec = TextCodec.from_model_dir(default_model_dir)
    first, second = (Completion(prompt, codec.incremental()) for prompt in ("A?", "B?"))
    out = io.StringIO()
    view = StreamView([first, second], out)
    second.push(codec.encode(" second"))
    first.push(codec.encode(" first"))
    view.update()
    assert out.getvalue() == "\n=== prompt 1: A?\n first"
    second.push(codec.encode(" 日本"))
    second.finish("length")
    first.finish("stop")
    view.update()
    assert out.getvalue() == "\n=== prompt 1: A?\n first\n\n=== prompt 2: B?\n second 日本\n[finished: length]\n"



def test_every_command_runs_with_grpcs_fork_handlers_off(monkeypatch, capsys):
    """`tandem up` forks services while it polls them over gRPC, and gRPC's fork handlers could abort
    a child before exec (status -6, 'epoll_wait error: Bad file descriptor' in its log)."""
    monkeypatch.delenv(cli.GRPC_FORK_SUPPORT_ENV, raising=False)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert os.environ[cli.GRPC_FORK_SUPPORT_ENV] == "false"
