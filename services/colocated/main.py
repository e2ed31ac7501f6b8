"""`tandem colocated`: one worker that prefills and decodes (see services/colocated/servicer.py and services/worker/main_common.py)."""

from __future__ import annotations

import argparse

from services.colocated.servicer import ColocatedServicer
from services.worker import main_common
from services.worker.servicer_base import MODEL_SERVICE, TOKEN_STREAM_SERVICE
from tandem.v1 import common_pb2, worker_pb2_grpc

SPEC = main_common.RoleSpec(
    name="colocated",
    role=common_pb2.WORKER_ROLE_COLOCATED,
    port=50081,
    metrics_port=9105,
    make_servicer=lambda config, channels, loaded: ColocatedServicer(loaded),
    services=(("tandem.v1.ColocatedService", worker_pb2_grpc.add_ColocatedServiceServicer_to_server),
              TOKEN_STREAM_SERVICE, MODEL_SERVICE),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    main_common.add_arguments(parser, SPEC)


def main(args: argparse.Namespace) -> int:
    return main_common.main(args, SPEC)
