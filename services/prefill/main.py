"""`tandem prefill`: a prefill worker (see services/prefill/servicer.py and services/worker/main_common.py).

--kv-transport auto (the default) ships KV through shared memory to each decode worker that can read
this worker's segments (the same host: services/runtime/kv_shm.py), over gRPC to the others; grpc
always ships over gRPC.

Its steps hold one chunk (--max-batched-tokens defaults to --chunk-size's 512 here, against 2,048 on the
other roles), so prompts prefill in arrival order, each in the next steps once the ones ahead are done,
and a prompt whose last chunk leaves room shares its step with the next one. With a budget of four
chunks, four 1,000-word prompts that arrived together advanced a chunk each a step and all got their
first tokens at the end, 8.8-12.6 s in on one core (and the short prompts queued behind them with
them), where in turn the first gets its token after its own 2-3 s. The scheduler's hybrid placement
prices a prompt sent here as waiting for the prompts queued ahead of it
(services/scheduler/prefill_placement.py): in arrival order, that is when its first token comes.
"""

from __future__ import annotations

import argparse
import dataclasses

from services.common.config import add_option
from services.prefill.servicer import KV_TRANSPORTS, PrefillServicer
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
    max_batched_tokens=main_common.DEFAULT_CHUNK_SIZE,  # one chunk a step: prompts in arrival order
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    main_common.add_arguments(parser, SPEC)
    add_option(parser, "--kv-transport", default="auto", choices=KV_TRANSPORTS,
               help="auto: KV through shared memory to decode workers on this host, gRPC to the others; "
                    "grpc: always gRPC")


def main(args: argparse.Namespace) -> int:
    spec = dataclasses.replace(SPEC, make_servicer=lambda config, channels, loaded: PrefillServicer(
        loaded, config.kv_chunk_bytes, channels, args.kv_transport))
    return main_common.main(args, spec)
