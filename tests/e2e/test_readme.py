"""The README's "Use it" examples, run as written against the mesh (only the ports rewritten):
the five-line SDK example and the `curl` SSE example, their output checked exactly."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tandem
from tests.e2e.api import API_KEY, sse_events

README = Path(__file__).resolve().parents[2] / "README.md"
GRPC_TARGET = "127.0.0.1:50051"
HTTP_URL = "http://127.0.0.1:8000"
CHAT = [{"role": "user", "content": "Say hi in French."}]


def use_it_block(language: str, containing: str) -> str:
    """The code block of `language` in README's "## Use it" section that contains `containing`."""
    section = README.read_text().split("\n## Use it\n", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(rf"^```{language}\n(.*?)^```$", section, re.S | re.M) if containing in b]
    assert len(blocks) == 1, f"README's Use it section needs one {language} block with {containing!r}"
    return blocks[0]


@pytest.fixture(scope="module")
def env(mesh) -> dict[str, str]:
    return {**os.environ, "TANDEM_API_KEY": API_KEY}


@pytest.fixture(scope="module")
def expected_chat(mesh) -> tandem.Completion:
    with tandem.Client(mesh.endpoint("gateway").address, api_key=API_KEY) as client:
        return client.chat(CHAT, max_tokens=16, temperature=0)


def test_sdk_example(mesh, env, expected_chat):
    code = use_it_block("python", "tandem.Client(")
    assert len([line for line in code.splitlines() if line.strip()]) == 5 and GRPC_TARGET in code
    with tandem.Client(mesh.endpoint("gateway").address, api_key=API_KEY) as client:
        generated = client.complete("The capital of France is", max_tokens=16, temperature=0)
    run = subprocess.run([sys.executable, "-c", code.replace(GRPC_TARGET, mesh.endpoint("gateway").address)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"{generated.text}\n{expected_chat.text}\n"
    assert generated.text and expected_chat.text


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_sse_example(mesh, env, expected_chat):
    command = use_it_block("sh", "curl ")
    assert HTTP_URL in command
    run = subprocess.run(["bash", "-c", command.replace(HTTP_URL, mesh.http_url)], env=env, capture_output=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    *chunks, usage = sse_events(run.stdout)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected_chat.text
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == expected_chat.usage.completion_tokens
    assert usage["usage"]["prompt_tokens"] == expected_chat.usage.prompt_tokens
