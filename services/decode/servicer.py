"""DecodeService and KvTransferService of a decode worker: block reservations, KV import, and
admission of each request into the running batch at the next iteration once its KV is complete.

A request's life here: Reserve (the runtime's KV hand-off allocates its blocks) -> Push (each
chunk written into them as it arrives, its bytes in the message or, from a sender on this host, in
the sender's shared-memory segment the header names; such a sender streams layers while its
prefill still computes later ones, and its last message brings the first token) -> admitted at the
next iteration boundary as soon as the chunks the header announced are in (the segment is mapped, and
unmapped after the admission, in a thread) -> one token per iteration on the request's token stream
(the gateway reads it) -> blocks freed when it finishes. Release, Abort and the reservation's TTL free
the blocks at any point. The blocks and their state are the hand-off's
(services/runtime/kv_handoff.py); this servicer keeps only what the wire adds: the Reserve call's trace
context (the decode span's parent) and the reservation's TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import time
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context

from services.common.errors import FailedPrecondition, InvalidRequest, NotFound, Overloaded
from services.common.placer import placer_of
from services.common.sampling_params import SamplingParams
from services.common.tracing import Attr, SpanName, extract_context, kv_transfer_attributes
from services.common.wire import abort_ids
from services.runtime.block_manager import NoFreeBlocksError
from services.runtime.kv_handoff import PromptKey, Reservation
from services.runtime.kv_shm import SegmentId, ShmUnavailable, open_segment, reads_back, segment_view
from services.runtime.kv_transfer import KvChunk, chunk_bytes
from services.worker.events import TrackedRequest
from services.worker.runtime import WorkerRuntime
from services.worker.served_model import ServedModel
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
class Waiting:
    """What the wire adds to a reservation until its KV is admitted."""

    reservation: Reservation
    trace_context: Context  # of the Reserve call (the scheduler's span): the decode span's parent
    expiry: asyncio.TimerHandle
    lora: str = ""  # the adapter the reservation is for: KV computed under another one is refused
    placer: str = ""  # the scheduler replica that reserved it (services/common/placer.py)


@dataclass(slots=True)
class Received:
    """Progress of one Push, and its header once complete."""

    header: kv_transfer_pb2.KvRequestHeader
    started: float = field(default_factory=time.monotonic)  # when the first token arrived
    chunks: int = 0
    bytes: int = 0
    blocks: int = 0

    @property
    def complete(self) -> bool:
        """The first token and every chunk the header announced are in: nothing the stream may still
        carry is needed (a header that announces no count is complete only at the stream's end)."""
        expected = self.header.num_chunks
        return bool(self.header.output_token_ids) and expected > 0 and self.chunks == expected


class DecodeServicer(WorkerServicerBase, worker_pb2_grpc.DecodeServiceServicer,
                     kv_transfer_pb2_grpc.KvTransferServiceServicer):
    def __init__(self, loaded: asyncio.Future[WorkerRuntime]) -> None:
        super().__init__(loaded)
        self._waiting: dict[str, Waiting] = {}

    # -- reservations -----------------------------------------------------------------------

    async def Reserve(self, request: worker_pb2.ReserveRequest, context) -> worker_pb2.ReserveResponse:
        if not request.request_id:
            raise InvalidRequest("request_id", "is empty; the scheduler must give every request an id")
        # Once its hand-off holds the reservation, the model stays resident until the request leaves it.
        async with self.runtime.serving(request.model) as served:
            return await self._reserve(request, context, served)

    async def _reserve(self, request: worker_pb2.ReserveRequest, context,
                       served: ServedModel) -> worker_pb2.ReserveResponse:
        rid = request.request_id
        engine = served.engine
        if not 0 < request.num_tokens <= engine.max_model_len:
            raise InvalidRequest("num_tokens", f"must be in [1, {engine.max_model_len}] (the model's context), "
                                               f"got {request.num_tokens}")
        if engine.blocks_for_tokens(request.num_tokens) > engine.blocks.num_blocks:
            raise InvalidRequest("num_tokens", f"{request.num_tokens} tokens need more KV blocks than decode worker "
                                               f"{self.runtime.worker_id} has ({engine.blocks.num_blocks})")
        if request.token_ids and len(request.token_ids) != request.num_tokens - 1:
            raise InvalidRequest("token_ids", f"carries {len(request.token_ids)} tokens; the prompt of a reservation "
                                              f"for num_tokens {request.num_tokens} has num_tokens - 1")
        if not 0 <= request.ttl_ms <= MAX_RESERVATION_TTL_MS:
            raise InvalidRequest("ttl_ms", f"must be in [0, {MAX_RESERVATION_TTL_MS}] (0: the default, "
                                           f"{DEFAULT_RESERVATION_TTL_S:.0f} s), got {request.ttl_ms}")
        prompt = PromptKey(list(request.token_ids), request.cache_salt, request.lora) if request.token_ids else None
        try:
            reservation, free = await served.loop.call(
                lambda e: (served.handoff.reserve(rid, request.num_tokens, prompt), e.blocks.num_free_blocks))
        except NoFreeBlocksError as exc:
            raise Overloaded(f"decode worker {self.runtime.worker_id} cannot reserve KV for request {rid}: {exc}",
                             retry_after=RETRY_AFTER_S) from exc
        except ValueError as exc:
            raise InvalidRequest("request_id", str(exc)) from exc
        ttl = request.ttl_ms / 1000 if request.ttl_ms > 0 else DEFAULT_RESERVATION_TTL_S
        expiry = asyncio.get_running_loop().call_later(ttl, self._expire, rid, reservation)
        metadata = context.invocation_metadata()
        self._waiting[rid] = Waiting(reservation, extract_context(metadata), expiry, request.lora,
                                     placer_of(metadata))
        return worker_pb2.ReserveResponse(block_ids=reservation.block_ids, free_blocks=free,
                                          block_size=engine.blocks.block_size,
                                          reused_blocks=reservation.reused_blocks)

    async def Release(self, request: worker_pb2.ReleaseRequest, context) -> worker_pb2.ReleaseResponse:
        reservation = self._reservation(request.request_id)
        if reservation is None:
            return worker_pb2.ReleaseResponse(released_blocks=0)
        await self._abort([request.request_id])
        return worker_pb2.ReleaseResponse(released_blocks=len(reservation.block_ids))

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(aborted_ids=await self._abort(abort_ids(request)))

    def _expire(self, rid: str, reservation: Reservation) -> None:
        waiting = self._waiting.get(rid)
        if waiting is not None and waiting.reservation is reservation:
            del self._waiting[rid]
        if self._reservation(rid) is not reservation:
            return  # freed meanwhile (the worker dropped all its requests)
        log.warning("reservation of request %s expired before its KV arrived; freeing its blocks", rid)
        asyncio.ensure_future(self._abort([rid]))

    def _reservation(self, rid: str) -> Reservation | None:
        served = self.runtime.holding(rid)
        return served.handoff.reservation(rid) if served is not None else None

    async def _abort(self, request_ids) -> list[str]:
        for rid in request_ids:
            self._forget_waiting(rid)
        return await self.runtime.abort(request_ids)

    def _forget_waiting(self, rid: str) -> Waiting | None:
        waiting = self._waiting.pop(rid, None)
        if waiting is not None:
            waiting.expiry.cancel()
        return waiting

    # -- KV transfer ------------------------------------------------------------------------

    async def Push(self, request_iterator, context) -> kv_transfer_pb2.PushAck:
        first = await anext(aiter(request_iterator), None)
        if first is None:
            raise InvalidRequest("chunks", "the stream carried no KvChunk")
        rid = first.request_id
        reservation, params = self._receiving(first)
        parent = extract_context(context.invocation_metadata())
        shm = first.header.shm_segment if first.header.HasField("shm_segment") else None
        attributes = {Attr.REQUEST_ID: rid, Attr.KV_TRANSPORT: "shm" if shm else "grpc"}
        with tracer.start_as_current_span(SpanName.KV_RECEIVE, context=parent, kind=trace.SpanKind.SERVER,
                                          attributes=attributes) as span:
            segment = None
            try:
                segment = await self._map(rid, shm)
                received = await self._import_all(reservation, first, request_iterator, segment)
            except Exception:  # a partial KV is useless: its blocks are free before the sender hears why
                _unmap(segment)
                if not reservation.cancelled:
                    await self._abort([rid])
                raise
            except BaseException:  # the sender went away: free the blocks, no one waits for the answer
                _unmap(segment)
                if not reservation.cancelled:
                    asyncio.ensure_future(self._abort([rid]))
                raise
            seconds = time.monotonic() - received.started
            span.set_attributes(kv_transfer_attributes(received.blocks, received.bytes, received.chunks, seconds))
            span.set_attribute(Attr.KV_REUSED_BLOCKS, reservation.reused_blocks)
            try:
                admitted = not reservation.cancelled and await self._admit(reservation, received.header, params,
                                                                           seconds, received.started)
            finally:  # unmapped once the request is admitted, off the event loop: 1-13 ms for 50 MB
                if segment is not None:
                    await asyncio.to_thread(segment.close)
        return kv_transfer_pb2.PushAck(request_id=rid, chunks=received.chunks, bytes=received.bytes,
                                       blocks=received.blocks, duration_ms=seconds * 1000, admitted=admitted)

    def _receiving(self, first: kv_transfer_pb2.KvChunk) -> tuple[Reservation, SamplingParams]:
        """The reservation a stream fills, once its header checks out (nothing is written before)."""
        rid = first.request_id
        reservation = self._reservation(rid)
        if reservation is None:
            raise NotFound(f"no reservation for request {rid!r} on decode worker {self.runtime.worker_id}: "
                           "it expired, was aborted, or was never made; Reserve before Push")
        if reservation.receiving:
            raise FailedPrecondition(f"request {rid!r} is already receiving its KV on another stream")
        if not first.HasField("header"):
            raise InvalidRequest("header", "the first KvChunk of a stream must carry the request header")
        header = first.header
        if not header.prompt_token_ids:
            raise InvalidRequest("header", "needs the prompt token ids")
        reserved_for = self.runtime.holding(rid).name
        if self.runtime.catalogue_name(header.model) != reserved_for:
            raise FailedPrecondition(f"request {rid!r}: the KV was computed by model {header.model!r}, the reservation "
                                     f"is for {reserved_for!r}; KV of one model is no use to another")
        waiting = self._waiting.get(rid)  # gone when the reservation was cancelled meanwhile
        adapter = waiting.lora if waiting is not None else header.lora
        if header.lora != adapter:
            raise FailedPrecondition(f"request {rid!r}: the KV was computed under adapter {header.lora!r}, the "
                                     f"reservation is for {adapter!r}; KV of one adapter is no use to another")
        params = sampling_params(header.sampling)
        reservation.receiving = True
        return reservation, params

    async def ProbeShm(self, request: kv_transfer_pb2.ShmProbe, context) -> kv_transfer_pb2.ShmProbeResult:
        if not request.nonce:
            raise InvalidRequest("nonce", "is empty; a probe segment starts with the nonce it carries")
        reason = reads_back(_segment_id(request.segment), request.nonce)
        return kv_transfer_pb2.ShmProbeResult(visible=not reason, reason=reason)

    async def _map(self, rid: str, shm: kv_transfer_pb2.ShmSegment | None) -> mmap.mmap | None:
        """The sender's segment mapped for one Push (None over gRPC), off the event loop (mapping and
        faulting in 50 MB took 3-100 ms on a loaded machine, every other request's tokens waiting);
        FailedPrecondition when it cannot be opened here."""
        if shm is None:
            return None
        try:
            return await asyncio.to_thread(open_segment, _segment_id(shm))
        except ShmUnavailable as exc:
            raise FailedPrecondition(f"decode worker {self.runtime.worker_id} cannot read the KV of request {rid!r} "
                                     f"from shared memory: {exc}; ship it over gRPC") from exc

    async def _import_all(self, reservation: Reservation, first, rest, segment: mmap.mmap | None) -> Received:
        """Imports every chunk of the stream. The header is the first message's, completed by the last
        message's when the first lacks the first token (a sender that streamed layers while its
        prefill computed); `started` is when the first token arrived. Returns once the last chunk the
        header announced is in, without waiting for the sender to half-close the stream: on a loaded
        machine that wait was a round of both event loops after the first token."""
        received = Received(header=first.header)
        self._import(reservation, first, received, segment)
        if not received.complete:
            async for message in rest:
                if reservation.cancelled:
                    break
                if message.HasField("header") and not received.header.output_token_ids:
                    received.header = _completed(first.header, message.header)
                    received.started = time.monotonic()
                self._import(reservation, message, received, segment)
                if received.complete:
                    break
        if reservation.cancelled:
            return received
        if not received.header.output_token_ids:
            raise InvalidRequest("header", "needs the first output token id, in the first chunk's header or, "
                                           "when that has none, in the last chunk's")
        expected = received.header.num_chunks
        if expected and received.chunks != expected:
            raise InvalidRequest("num_chunks", f"the stream carried {received.chunks} chunks, the header "
                                               f"announced {expected}; the transfer was cut short")
        return received

    def _import(self, reservation: Reservation, message: kv_transfer_pb2.KvChunk, received: Received,
                segment: mmap.mmap | None) -> None:
        """Writes one chunk into the reserved blocks (on the event loop: cancel cannot interleave),
        its bytes read from `segment` at the chunk's offset when the sender shares one."""
        if reservation.cancelled:
            return
        if message.request_id != reservation.request_id:
            raise InvalidRequest("request_id", f"chunk of {message.request_id!r} on the stream of "
                                               f"{reservation.request_id!r}; one stream carries one request")
        with contextlib.ExitStack() as views:
            try:
                num_layers = message.num_layers or 1
                data = message.data if segment is None else views.enter_context(segment_view(
                    segment, message.shm_offset, chunk_bytes(message.dtype, message.shape, num_layers)))
                chunk = KvChunk(message.layer, message.first_block, message.num_blocks, message.dtype,
                                tuple(message.shape), data, num_layers)
                self.runtime.holding(reservation.request_id).handoff.import_chunk(reservation, chunk)
            except ValueError as exc:
                raise InvalidRequest("chunk", str(exc)) from exc
            received.bytes += len(data)
        received.chunks += 1
        received.blocks = max(received.blocks, message.first_block + message.num_blocks - reservation.reused_blocks)

    async def _admit(self, reservation: Reservation, header: kv_transfer_pb2.KvRequestHeader,
                     params: SamplingParams, seconds: float, arrived_at: float) -> bool:
        """Hands the request to the engine for the next iteration, whose step ends within the first-gap
        budget of `arrived_at` (time.monotonic() when its first token arrived); False if it was aborted meanwhile."""
        rid = reservation.request_id
        timings = common_pb2.RequestTimings()
        timings.CopyFrom(header.timings)
        timings.kv_transfer_ms = seconds * 1000
        tracked = TrackedRequest(rid, len(header.prompt_token_ids), logprobs=params.logprobs is not None,
                                 cached_tokens=header.cached_tokens, timings=timings)
        tracked.started_ns = tracked.first_token_ns = time.time_ns()
        waiting = self._forget_waiting(rid)
        assert waiting is not None  # an abort would have cancelled the reservation
        tracked.placer = waiting.placer
        self.runtime.track(tracked)
        self.runtime.spans.start(SpanName.DECODE, rid, waiting.trace_context, prefilling=False)
        try:
            served = self.runtime.holding(rid)
            if served is None:
                raise KeyError(f"request {rid!r} has no reserved blocks any more")
            await served.loop.call(lambda engine: served.handoff.admit(
                rid, list(header.prompt_token_ids), list(header.output_token_ids), params, header.seed,
                header.cache_salt, header.lora, arrived_at))
        except (KeyError, ValueError) as exc:  # aborted between the last chunk and here
            self.runtime.forget(rid)
            self.runtime.spans.end(rid, "abort")
            log.info("request %s not admitted: %s", rid, exc)
            return False
        return True


def _completed(first: kv_transfer_pb2.KvRequestHeader,
               last: kv_transfer_pb2.KvRequestHeader) -> kv_transfer_pb2.KvRequestHeader:
    """The first message's header with what the last one adds: the first token and what came with it."""
    header = kv_transfer_pb2.KvRequestHeader()
    header.CopyFrom(first)
    header.output_token_ids[:] = last.output_token_ids
    header.num_chunks = last.num_chunks
    header.cached_tokens = last.cached_tokens
    header.timings.CopyFrom(last.timings)
    return header


def _unmap(segment: mmap.mmap | None) -> None:
    if segment is not None:
        segment.close()


def _segment_id(segment: kv_transfer_pb2.ShmSegment) -> SegmentId:
    return SegmentId(segment.pid, segment.fd, segment.inode, segment.size)
