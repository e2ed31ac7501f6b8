"""`tandem decode`: a decode worker (see services/decode/servicer.py and services/worker/main_common.py).

With --hybrid it also serves ColocatedService.Assign on the same engine, so the scheduler may prefill a
request here instead of on a prefill worker (conditional disaggregation,
services/scheduler/prefill_placement.py): that KV never moves. A hybrid worker registers with
WorkerInfo.local_prefill and reports its prefix cache, since its cache hits now shorten prefills.
"""

from __future__ import annotations

import argparse
import dataclasses

from services.colocated.servicer import ColocatedServicer
from services.common.config import add_switch
from services.common.grpc_server import MAX_MESSAGE_BYTES
from services.decode.servicer import DecodeServicer
from services.worker import main_common
from services.worker.servicer_base import MODEL_SERVICE, TOKEN_STREAM_SERVICE
from tandem.v1 import common_pb2, kv_transfer_pb2_grpc, worker_pb2_grpc


class HybridServicer(DecodeServicer, ColocatedServicer):
    """A decode worker's services and Assign, over one runtime. Abort (DecodeServicer's) ends either
    kind of request: a reservation or KV waiting for the engine, or a request the engine holds."""


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
        MODEL_SERVICE,
    ),
    # Routing looks at prefill workers' caches only; a decode worker's cache serves its own recomputes.
    report_blocks=False,
    max_receive_bytes=MAX_MESSAGE_BYTES,  # KV chunks arrive here
)

HYBRID_SPEC = dataclasses.replace(
    SPEC,
    make_servicer=lambda config, channels, loaded: HybridServicer(loaded),
    services=(*SPEC.services, ("tandem.v1.ColocatedService", worker_pb2_grpc.add_ColocatedServiceServicer_to_server)),
    report_blocks=True,  # its prefix hits shorten the prefills it runs itself
    local_prefill=True,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    main_common.add_arguments(parser, SPEC)
    add_switch(parser, "--hybrid", help="also prefill requests the scheduler places here (ColocatedService.Assign on "
                                        "this engine), beside the KV that prefill workers send")


def main(args: argparse.Namespace) -> int:
    return main_common.main(args, HYBRID_SPEC if args.hybrid else SPEC)
