"""DecodeService and KvTransferService of a decode worker: block reservations, KV import, and
admission of each request into the running batch at the next iteration once its KV is complete.

A request's life here: Reserve (blocks allocated, owned by no sequence) -> Push (each chunk's
bytes written straight into those blocks, outside the engine thread: nothing else touches them)
-> admit_imported at the next iteration boundary -> one token per iteration on the ReportTokens
stream -> blocks freed when it finishes. Release, Abort and the reservation's TTL free the
blocks at any point; once a reservation is cancelled no further chunk is written into it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context

from services.common.errors import FailedPrecondition, InvalidRequest, NotFound, Overloaded
from services.common.sampling_params import SamplingParams
from services.common.tracing import Attr, SpanName, extract_context, kv_transfer_attributes
from services.common.wire import abort_ids
from services.runtime.block_manager import NoFreeBlocksError
from services.runtime.kv_transfer import KvChunk
from services.worker.engine_loop import StepResult
from services.worker.events import TrackedRequest
from services.worker.request_spans import RequestSpans
from services.worker.servicer_base import WorkerServicerBase, sampling_params
from tandem.v1 import common_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
tracer = trace.get_tracer("tandem.decode")

# A backstop for a prefill worker lost without an Abort; the scheduler normally releases or aborts first.
# Also the longest a caller may ask for: a reservation pins its blocks until then.
DEFAULT_RESERVATION_TTL_S = 300.0
MAX_RESERVATION_TTL_MS = round(DEFAULT_RESERVATION_TTL_S * 1000)
RETRY_AFTER_S = 1.0


@dataclass(slots=True)
class Reservation:
    request_id: str
    block_ids: list[int]
    trace_context: Context  # of the Reserve call (the scheduler's span): the decode span's parent
    expiry: asyncio.TimerHandle | None = None
    receiving: bool = False
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True
        if self.expiry is not None:
            self.expiry.cancel()


@dataclass(slots=True)
class Received:
    """Progress of one Push."""

    chunks: int = 0
    bytes: int = 0
    blocks: int = 0


class DecodeServicer(WorkerServicerBase, worker_pb2_grpc.DecodeServiceServicer,
                     kv_transfer_pb2_grpc.KvTransferServiceServicer):
    def __init__(self) -> None:
        super().__init__()
        self._reservations: dict[str, Reservation] = {}
        self._spans = RequestSpans()  # decode.request of each admitted request

    # -- RoleServicer -----------------------------------------------------------------------

    def on_step(self, step: StepResult) -> None:
        self._spans.on_step(step)

    async def abort_all(self, reason: str) -> None:
        ids = [*self._reservations, *self.runtime.batcher.requests]
        if ids:
            log.warning("aborting %d request(s): %s", len(ids), reason)
            await self._abort(ids)

    @property
    def reserved_blocks(self) -> int:
        return sum(len(r.block_ids) for r in self._reservations.values())

    @property
    def num_pending(self) -> int:
        return len(self._reservations)

    # -- reservations -----------------------------------------------------------------------

    async def Reserve(self, request: worker_pb2.ReserveRequest, context) -> worker_pb2.ReserveResponse:
        rid = request.request_id
        engine = self.runtime.engine
        if not rid:
            raise InvalidRequest("request_id", "is empty; the scheduler must give every request an id")
        if not 0 < request.num_tokens <= engine.max_model_len:
            raise InvalidRequest("num_tokens", f"must be in [1, {engine.max_model_len}] (the model's context), "
                                               f"got {request.num_tokens}")
        if engine.blocks_for_tokens(request.num_tokens) > engine.blocks.num_blocks:
            raise InvalidRequest("num_tokens", f"{request.num_tokens} tokens need more KV blocks than decode worker "
                                               f"{self.runtime.worker_id} has ({engine.blocks.num_blocks})")
        if not 0 <= request.ttl_ms <= MAX_RESERVATION_TTL_MS:
            raise InvalidRequest("ttl_ms", f"must be in [0, {MAX_RESERVATION_TTL_MS}] (0: the default, "
                                           f"{DEFAULT_RESERVATION_TTL_S:.0f} s), got {request.ttl_ms}")
        try:
            block_ids, free = await self.runtime.loop.call(
                lambda e: (e.reserve(rid, request.num_tokens), e.blocks.num_free_blocks))
        except NoFreeBlocksError as exc:
            raise Overloaded(f"decode worker {self.runtime.worker_id} cannot reserve KV for request {rid}: {exc}",
                             retry_after=RETRY_AFTER_S) from exc
        except ValueError as exc:
            raise InvalidRequest("request_id", str(exc)) from exc
        reservation = Reservation(rid, block_ids, extract_context(context.invocation_metadata()))
        ttl = request.ttl_ms / 1000 if request.ttl_ms > 0 else DEFAULT_RESERVATION_TTL_S
        reservation.expiry = asyncio.get_running_loop().call_later(ttl, self._expire, rid)
        self._reservations[rid] = reservation
        return worker_pb2.ReserveResponse(block_ids=block_ids, free_blocks=free,
                                          block_size=engine.blocks.block_size)

    async def Release(self, request: worker_pb2.ReleaseRequest, context) -> worker_pb2.ReleaseResponse:
        reservation = self._reservations.get(request.request_id)
        if reservation is None:
            return worker_pb2.ReleaseResponse(released_blocks=0)
        await self._abort([request.request_id])
        return worker_pb2.ReleaseResponse(released_blocks=len(reservation.block_ids))

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(aborted_ids=await self._abort(abort_ids(request)))

    def _expire(self, rid: str) -> None:
        log.warning("reservation of request %s expired before its KV arrived; freeing its blocks", rid)
        self._drop_reservations([rid])
        asyncio.ensure_future(self.abort_requests([rid]))

    async def _abort(self, request_ids) -> list[str]:
        known = self._drop_reservations(request_ids)
        for rid in request_ids:
            self._spans.end(rid, "abort")
        in_engine = await self.abort_requests(request_ids)
        return list(dict.fromkeys([*known, *in_engine]))

    def _drop_reservations(self, request_ids) -> list[str]:
        """Cancels the reservations (no chunk is written into them after this) before the engine frees them."""
        dropped = []
        for rid in request_ids:
            reservation = self._reservations.pop(rid, None)
            if reservation is not None:
                reservation.cancel()
                dropped.append(rid)
        return dropped

    # -- KV transfer ------------------------------------------------------------------------

    async def Push(self, request_iterator, context) -> kv_transfer_pb2.PushAck:
        started = time.monotonic()
        first = await anext(aiter(request_iterator), None)
        if first is None:
            raise InvalidRequest("chunks", "the stream carried no KvChunk")
        rid = first.request_id
        reservation, params = self._receiving(first)
        parent = extract_context(context.invocation_metadata())
        with tracer.start_as_current_span(SpanName.KV_RECEIVE, context=parent, kind=trace.SpanKind.SERVER,
                                          attributes={Attr.REQUEST_ID: rid}) as span:
            try:
                received = await self._import_all(reservation, first, request_iterator)
            except BaseException:  # a partial KV is useless: free the blocks (also when the sender went away)
                if not reservation.cancelled:
                    self._drop_reservations([rid])
                    asyncio.ensure_future(self.abort_requests([rid]))
                raise
            seconds = time.monotonic() - started
            span.set_attributes(kv_transfer_attributes(received.blocks, received.bytes, received.chunks, seconds))
            admitted = not reservation.cancelled and await self._admit(reservation, first.header, params, seconds)
        self.runtime.counters.kv_bytes_received += received.bytes
        return kv_transfer_pb2.PushAck(request_id=rid, chunks=received.chunks, bytes=received.bytes,
                                       blocks=received.blocks, duration_ms=seconds * 1000, admitted=admitted)

    def _receiving(self, first: kv_transfer_pb2.KvChunk) -> tuple[Reservation, SamplingParams]:
        """The reservation a stream fills, once its header checks out (nothing is written before)."""
        rid = first.request_id
        reservation = self._reservations.get(rid)
        if reservation is None:
            raise NotFound(f"no reservation for request {rid!r} on decode worker {self.runtime.worker_id}: "
                           "it expired, was aborted, or was never made; Reserve before Push")
        if reservation.receiving:
            raise FailedPrecondition(f"request {rid!r} is already receiving its KV on another stream")
        if not first.HasField("header"):
            raise InvalidRequest("header", "the first KvChunk of a stream must carry the request header")
        header = first.header
        if not header.prompt_token_ids or not header.output_token_ids:
            raise InvalidRequest("header", "needs the prompt token ids and the first output token id")
        params = sampling_params(header.sampling)
        reservation.receiving = True
        return reservation, params

    async def _import_all(self, reservation: Reservation, first, rest) -> Received:
        received = Received()
        self._import(reservation, first, received)
        async for message in rest:
            if reservation.cancelled:
                break
            self._import(reservation, message, received)
        expected = first.header.num_chunks
        if not reservation.cancelled and expected and received.chunks != expected:
            raise InvalidRequest("num_chunks", f"the stream carried {received.chunks} chunks, the header "
                                               f"announced {expected}; the transfer was cut short")
        return received

    def _import(self, reservation: Reservation, message: kv_transfer_pb2.KvChunk, received: Received) -> None:
        """Writes one chunk into the reserved blocks (on the event loop: cancel cannot interleave)."""
        if reservation.cancelled:
            return
        if message.request_id != reservation.request_id:
            raise InvalidRequest("request_id", f"chunk of {message.request_id!r} on the stream of "
                                               f"{reservation.request_id!r}; one stream carries one request")
        chunk = KvChunk(message.layer, message.first_block, message.num_blocks, message.dtype,
                        tuple(message.shape), message.data)
        try:
            self.runtime.engine.import_chunk(reservation.request_id, chunk)
        except ValueError as exc:
            raise InvalidRequest("chunk", str(exc)) from exc
        received.chunks += 1
        received.bytes += len(message.data)
        received.blocks = max(received.blocks, message.first_block + message.num_blocks)

    async def _admit(self, reservation: Reservation, header: kv_transfer_pb2.KvRequestHeader,
                     params: SamplingParams, seconds: float) -> bool:
        """Hands the request to the engine for the next iteration; False if it was aborted meanwhile."""
        rid = reservation.request_id
        timings = common_pb2.RequestTimings()
        timings.CopyFrom(header.timings)
        timings.kv_transfer_ms = seconds * 1000
        tracked = TrackedRequest(rid, len(header.prompt_token_ids), logprobs=params.logprobs is not None,
                                 cached_tokens=header.cached_tokens, timings=timings)
        tracked.started_ns = tracked.first_token_ns = time.time_ns()
        self._reservations.pop(rid, None)
        if reservation.expiry is not None:
            reservation.expiry.cancel()
        self.runtime.batcher.track(tracked)
        self._spans.start(SpanName.DECODE, rid, reservation.trace_context, prefilling=False)
        try:
            await self.runtime.loop.call(lambda engine: engine.admit_imported(
                rid, list(header.prompt_token_ids), list(header.output_token_ids), params, header.seed,
                header.cache_salt))
        except (KeyError, ValueError) as exc:  # aborted between the last chunk and here
            self.runtime.batcher.forget(rid)
            self._spans.end(rid, "abort")
            log.info("request %s not admitted: %s", rid, exc)
            return False
        return True
