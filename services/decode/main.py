"""`tandem decode`: a decode worker (see services/decode/servicer.py and services/worker/main_common.py)."""

from __future__ import annotations

import argparse

from services.common.grpc_server import MAX_MESSAGE_BYTES
from services.decode.servicer import DecodeServicer
from services.worker import main_common
from services.worker.servicer_base import TOKEN_STREAM_SERVICE
from tandem.v1 import common_pb2, kv_transfer_pb2_grpc, worker_pb2_grpc

SPEC = main_common.RoleSpec(
    name="decode",
    role=common_pb2.WORKER_ROLE_DECODE,
    port=50071,
    metrics_port=9104,
    make_servicer=lambda config, channels, loaded: DecodeServicer(loaded),
    services=(
        ("tandem.v1.DecodeService", worker_pb2_grpc.add_DecodeServiceServicer_to_server),
        ("tandem.v1.KvTransferService", kv_transfer_pb2_grpc.add_KvTransferServiceServicer_to_server),
        TOKEN_STREAM_SERVICE,
    ),
    # Routing looks at prefill workers' caches only; a decode worker's cache serves its own recomputes.
    report_blocks=False,
    max_receive_bytes=MAX_MESSAGE_BYTES,  # KV chunks arrive here
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    main_common.add_arguments(parser, SPEC)


def main(args: argparse.Namespace) -> int:
    return main_common.main(args, SPEC)
