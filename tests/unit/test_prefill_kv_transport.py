"""The prefill worker's KV transport per decode worker: a push through shared memory that the decode
worker refused for want of reading it turns that worker to gRPC, also when grpcio reports the
refusal as INTERNAL (grpc/grpc#36066: a client stream the server ended early, while a message was
being written); any other failure keeps shared memory."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.errors import FailedPrecondition, TandemError, Unavailable, error_from_status
from services.prefill.servicer import PrefillServicer
from services.worker.transport import ChannelPool

DECODE = "127.0.0.1:50061"
UNREADABLE = ("decode worker d-0 cannot read the KV of request 'r1' from shared memory: cannot open the sender's "
              "segment /proc/1/fd/9: [Errno 13] Permission denied; ship it over gRPC")


@pytest.mark.parametrize(("error", "shared_after"), [
    (FailedPrecondition(UNREADABLE), False),
    (error_from_status(grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"), False),
    (FailedPrecondition("request 'r1': the KV was computed by model 'a', the reservation is for 'b'; KV of one "
                        "model is no use to another"), True),
    (Unavailable(f"cannot reach decode worker {DECODE} to ship the KV: Socket closed"), True),
], ids=["refused", "refusal-reported-as-internal", "another-model", "unreachable"])
async def test_a_shared_memory_push_the_decode_worker_could_not_read_turns_it_to_grpc(
        error: TandemError, shared_after: bool) -> None:
    servicer = PrefillServicer(asyncio.get_running_loop().create_future(), kv_chunk_bytes=1 << 20,
                               channels=ChannelPool())
    servicer._shares_memory[DECODE] = True  # probed: the decode worker reads our segments
    servicer._note_failed_push(DECODE, error)  # as _ship_streamed does before the request fails with it
    assert await servicer._reads_our_memory(DECODE) is shared_after
