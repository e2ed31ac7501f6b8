"""`tandem prefill`: a prefill worker (see services/prefill/servicer.py and services/worker/main_common.py)."""

from __future__ import annotations

import argparse

from services.prefill.servicer import PrefillServicer
from services.worker import main_common
from services.worker.servicer_base import MODEL_SERVICE, TOKEN_STREAM_SERVICE
from tandem.v1 import common_pb2, worker_pb2_grpc

SPEC = main_common.RoleSpec(
    name="prefill",
    role=common_pb2.WORKER_ROLE_PREFILL,
    port=50061,
    metrics_port=9103,
    make_servicer=lambda config, channels, loaded: PrefillServicer(loaded, config.kv_chunk_bytes, channels),
    services=(("tandem.v1.PrefillService", worker_pb2_grpc.add_PrefillServiceServicer_to_server), TOKEN_STREAM_SERVICE,
              MODEL_SERVICE),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    main_common.add_arguments(parser, SPEC)


def main(args: argparse.Namespace) -> int:
    return main_common.main(args, SPEC)
