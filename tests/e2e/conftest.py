"""The mesh the e2e tests talk to as a user would: `tandem up` with one prefill and one decode
worker, an API key and a small KV budget. One mesh serves every module of tests/e2e that asks
for `mesh` (starting one costs about 10 s); a test that needs other settings starts its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.api import API_KEY, AUTH, MESH_ENV
from tests.mesh import Mesh


@pytest.fixture(scope="package")
def mesh_run_dir(tmp_path_factory) -> Path:
    """The mesh's run directory: its logs and the local span files `tandem trace` reads."""
    return tmp_path_factory.mktemp("e2e-mesh")


@pytest.fixture(scope="package")
def mesh(mesh_run_dir, default_model_dir) -> Iterator[Mesh]:
    started = Mesh.start("--prefill", "1", "--decode", "1", "--model", str(default_model_dir),
                         env=MESH_ENV, run_dir=mesh_run_dir)
    yield started
    started.stop()


@pytest.fixture
def client(mesh) -> Iterator[openai.OpenAI]:
    """The real openai package pointed at the gateway; no retries, so errors surface at once."""
    with openai.OpenAI(base_url=f"{mesh.http_url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as opened:
        yield opened


@pytest.fixture
def http(mesh) -> Iterator[httpx.Client]:
    """Raw HTTP to the gateway, with the API key."""
    with httpx.Client(base_url=mesh.http_url, headers=AUTH, timeout=120) as opened:
        yield opened
