"""One disaggregated mesh (one prefill, one decode worker, an API key, a 3 s heartbeat TTL) for the
whole fuzz package, and the reference tokens it gave before any fuzzing."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from tests.fuzz.serving import MESH_ENV, reference_tokens
from tests.mesh import Mesh


@pytest.fixture(scope="package")
def mesh(tmp_path_factory, default_model_dir) -> Iterator[Mesh]:
    """Its run dir (logs of every service) is printed when a test fails, with the tandem up output."""
    started = Mesh.start("--prefill", "1", "--decode", "1", "--model", str(default_model_dir),
                         env=MESH_ENV, run_dir=tmp_path_factory.mktemp("fuzz-mesh"))
    yield started
    started.stop()


@pytest.fixture(scope="package")
def reference(mesh) -> list[int]:
    """The reference request's greedy tokens, taken before any fuzz example ran."""
    return reference_tokens(mesh)


@pytest.fixture(scope="package")
def gateway(mesh) -> Iterator[grpc.Channel]:
    """One channel to the gateway's gRPC door for every example."""
    with grpc.insecure_channel(mesh.endpoint("gateway").address) as channel:
        yield channel
