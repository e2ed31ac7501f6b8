"""PrefillService: computes a prompt's KV and first token, streams the token at once, then ships
the KV to the decode worker's reserved blocks (KvTransferService.Push) and frees it here.

One request's life here: queued in the engine -> prefilled (chunked, prefix cache reused) ->
first token sampled and put on the request's token stream (the gateway reads it) -> KV exported layer by layer in chunks
of at most --kv-chunk-bytes and pushed -> blocks released (full ones stay cached) -> the
prefix-cache changes reported -> PrefillResponse. An Abort ends it wherever it is.

The chunks' bytes travel in the Push messages, or, to a decode worker that can read this worker's
shared-memory segments (probed once per address: the same host), in a segment of this worker's
pool, the messages saying only where (services/runtime/kv_shm.py). That path is layer-pipelined:
the push opens while the prompt's last chunk computes, the forward pass gathers each layer into
the segment as soon as it is computed, and each message tells the decode worker which layers are
in, so it imports layer l while later layers still compute; the last message carries the first
token (the header's rest), and what is left to move after the first token is the last layers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from services.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidRequest,
    TandemError,
    Unavailable,
    error_from_rpc,
    grpc_status,
)
from services.common.grpc_server import remaining_timeout
from services.common.placer import placer_of
from services.common.tracing import Attr, SpanName, extract_context, inject_metadata, kv_transfer_attributes
from services.common.wire import logprob_to_proto
from services.runtime.engine import RequestOutput
from services.runtime.kv_handoff import LayerStream
from services.runtime.kv_shm import Segment, SegmentId, SegmentPool, probe_segment
from services.runtime.kv_transfer import DTYPE_NAMES, KvChunk
from services.worker.events import TrackedRequest, finish_reason_to_proto, is_final, ms_between
from services.worker.runtime import WorkerRuntime
from services.worker.served_model import ServedModel
from services.worker.servicer_base import WorkerServicerBase, check_request, engine_rejection, sampling_params
from services.worker.transport import ChannelPool
from tandem.v1 import common_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
tracer = trace.get_tracer("tandem.prefill")

# Deadline of a KV push when the Prefill call itself carries none.
PUSH_TIMEOUT_S = 60.0
PROBE_TIMEOUT_S = 5.0
KV_TRANSPORTS = ("auto", "grpc")  # --kv-transport: auto probes each decode worker for shared memory


@dataclass(slots=True)
class PrefillJob:
    """A request on this worker, from admission to its response."""

    tracked: TrackedRequest
    push: grpc.aio.StreamUnaryCall | None = None
    transfer: worker_pb2.KvTransferStats = field(default_factory=worker_pb2.KvTransferStats)


class PrefillServicer(WorkerServicerBase, worker_pb2_grpc.PrefillServiceServicer):
    def __init__(self, loaded: asyncio.Future[WorkerRuntime], kv_chunk_bytes: int, channels: ChannelPool,
                 kv_transport: str = "auto") -> None:
        super().__init__(loaded)
        if kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {', '.join(KV_TRANSPORTS)}, got {kv_transport!r}")
        self.kv_chunk_bytes = kv_chunk_bytes
        self.kv_transport = kv_transport
        self._channels = channels
        self._segments = SegmentPool()
        self._shares_memory: dict[str, bool] = {}  # decode address -> whether it reads our segments

    async def Prefill(self, request: worker_pb2.PrefillRequest, context) -> worker_pb2.PrefillResponse:
        rid = request.request_id
        check_request(rid, request.token_ids)
        if not request.decode_address:
            raise InvalidRequest("decode_address", "is empty; reserve blocks on a decode worker first")
        if self.runtime.is_awaited(rid):
            raise InvalidRequest("request_id", f"{rid!r} is already being prefilled on this worker")
        params = sampling_params(request.sampling)
        self._check_reservation(request)
        parent = extract_context(context.invocation_metadata())
        with tracer.start_as_current_span(SpanName.PREFILL, context=parent, kind=trace.SpanKind.SERVER,
                                          attributes={Attr.REQUEST_ID: rid}) as span:
            response = await self._prefill(request, params, context)
            span.set_attributes({
                Attr.PREFILL_TOKENS_CACHED: response.cached_tokens,
                Attr.PREFILL_TOKENS_COMPUTED: response.prompt_tokens - response.cached_tokens,
            })
            return response

    # -- one request ------------------------------------------------------------------------

    async def _prefill(self, request: worker_pb2.PrefillRequest, params, context) -> worker_pb2.PrefillResponse:
        rid = request.request_id
        ids = list(request.token_ids)
        runtime = self.runtime
        job = PrefillJob(TrackedRequest(rid, len(ids), logprobs=params.logprobs is not None,
                                        placer=placer_of(context.invocation_metadata())))
        runtime.track(job.tracked, awaited=True, hands_on=True)
        runtime.spans.follow(rid, trace.get_current_span())
        output: RequestOutput | None = None
        done = False
        try:
            # Once its engine holds the request, the model stays resident until the request leaves it.
            async with runtime.serving(request.model) as served:
                segment = await self._segment_for(request, served)
                feed = _LayerFeed(asyncio.get_running_loop()) if segment is not None else None
                try:
                    await served.loop.call(lambda engine: self._add(engine, served, request, params, segment, feed))
                except BaseException as exc:
                    if segment is not None and feed is not None:  # the engine may hold the stream: stop it first
                        asyncio.ensure_future(self._end_stream(served, rid, segment, feed, reuse=False))
                    if isinstance(exc, ValueError):
                        raise engine_rejection(exc) from exc
                    raise
            if segment is None:
                output = await runtime.first_output(rid)
                if _ships(output) and not runtime.was_aborted(rid):
                    await self._ship(request, job, output, context, served)
            else:
                output = await self._ship_streamed(request, job, context, served, segment, feed)
            # None: aborted before its first token; a final reason: the first token ended it.
            if _ships(output) and not runtime.was_aborted(rid):  # else the abort freed the blocks
                await served.loop.call(lambda engine: served.handoff.release_export(rid))
            done = True
        finally:
            aborted = runtime.was_aborted(rid)
            runtime.forget(rid)
            runtime.spans.end(rid, "abort")  # stops following the call's span if no token came
            if not done:
                if job.push is not None:
                    job.push.cancel()
                asyncio.ensure_future(self._abort_in_engine(rid))
        await runtime.blocks.flush()
        return self._response(request, job, output, aborted)

    def _check_reservation(self, request: worker_pb2.PrefillRequest) -> None:
        """The decode blocks must hold the prompt's KV in this worker's block size, and the blocks the
        decode worker reused leave at least the last prompt token's block to ship."""
        needed = self.runtime.blocks_for_tokens(len(request.token_ids))
        if not 0 <= request.decode_reused_blocks < needed:
            raise InvalidRequest("decode_reused_blocks", f"must be in [0, {needed - 1}] for a prompt of "
                                                         f"{len(request.token_ids)} tokens ({needed} blocks), "
                                                         f"got {request.decode_reused_blocks}")
        if not request.decode_block_ids:
            return
        block_size = self.runtime.block_size
        if len(request.decode_block_ids) < needed:
            raise FailedPrecondition(
                f"decode_block_ids: {len(request.decode_block_ids)} block(s) reserved, but the prompt's "
                f"{len(request.token_ids)} tokens need {needed} blocks of {block_size} tokens on this worker; "
                "prefill and decode workers must use the same block size"
            )

    def _add(self, engine, served: ServedModel, request: worker_pb2.PrefillRequest, params,
             segment: Segment | None, feed: _LayerFeed | None) -> None:
        """Queues the request in the engine (engine thread); with a segment, its KV is gathered into it
        layer by layer as the forward pass of its last prompt chunk computes it."""
        rid = request.request_id
        engine.add_request(rid, list(request.token_ids), params, request.cache_salt, stop_after_prefill=True,
                           seed=request.seed, lora=request.lora)
        if segment is not None and feed is not None:
            served.handoff.stream_layers(rid, LayerStream(request.decode_reused_blocks, feed.into(segment),
                                                          feed.on_layers))

    async def _ship(self, request, job: PrefillJob, output: RequestOutput, context, served: ServedModel) -> None:
        """Pushes the request's KV over gRPC, its bytes in the messages; returns once the decode worker
        acknowledged the transfer."""
        rid = request.request_id
        max_bytes = request.max_chunk_bytes or self.kv_chunk_bytes
        try:
            export = await served.loop.call(
                lambda engine: served.handoff.export(rid, max_bytes, request.decode_reused_blocks))
        except ValueError as exc:  # max_chunk_bytes below one block of one layer
            raise InvalidRequest("max_chunk_bytes", str(exc)) from exc
        header = self._header(request, job, output, export.num_chunks)
        header.model = served.name
        job.transfer.blocks = export.num_blocks
        opened = time.monotonic()
        with self._send_span(request, export.skipped_blocks, "grpc") as span, self._timed(span, job, opened):
            job.push = self._stub(request).Push(self._messages(rid, header, export.chunks, job.transfer),
                                                timeout=remaining_timeout(context, PUSH_TIMEOUT_S),
                                                metadata=(*inject_metadata(), *self._channels.metadata))
            try:
                ack = await self._await_push(rid, job.push, request.decode_address)
            finally:
                _close_quietly(export.chunks)
        self._check_admitted(request, ack)

    async def _ship_streamed(self, request, job: PrefillJob, context, served: ServedModel, segment: Segment,
                             feed: _LayerFeed) -> RequestOutput | None:
        """Pushes the request's KV through `segment` as the engine gathers it, layer by layer: the push
        opens once the first layer is in, and its last message waits for the first token. Returns
        the first output (None: aborted before it); once acknowledged the segment goes back to the
        pool, after anything else it is closed (the receiver may read on)."""
        rid = request.request_id
        runtime = self.runtime
        cache = served.engine.cache
        shipped = served.engine.blocks_for_tokens(len(request.token_ids)) - request.decode_reused_blocks
        layout = _Layout(cache.num_layers, request.decode_reused_blocks, shipped,
                         DTYPE_NAMES[cache.dtype], (2, shipped, *cache.block_shape), shipped * cache.layer_block_bytes)
        first = asyncio.ensure_future(runtime.first_output(rid))
        started = asyncio.ensure_future(feed.beyond(0))
        ack = None
        span, opened = trace.INVALID_SPAN, time.monotonic()
        with contextlib.ExitStack() as sending:  # the send span, from the push's opening: errors land on it
            try:
                await asyncio.wait((first, started), return_when=asyncio.FIRST_COMPLETED)
                if started.done():  # the last prompt chunk is computing: open the push, in its span
                    span = sending.enter_context(self._send_span(request, request.decode_reused_blocks, "shm"))
                    opened = time.monotonic()
                    header = self._partial_header(request, served.name, segment)
                    job.push = self._stub(request).Push(
                        self._streamed_messages(rid, header, layout, feed, first, job),
                        timeout=remaining_timeout(context, PUSH_TIMEOUT_S),
                        metadata=(*inject_metadata(), *self._channels.metadata))
                output = await first
                if not _ships(output) or runtime.was_aborted(rid):
                    job.transfer.Clear()  # the layers sent go with the cancelled push: nothing was shipped
                    return output
                if feed.ready < layout.num_layers:  # the engine thread posts every layer before the token
                    raise RuntimeError(f"request {rid}: the first token came with {feed.ready} of "
                                       f"{layout.num_layers} KV layers gathered")
                job.transfer.blocks = await served.loop.call(
                    lambda engine: served.handoff.hold_streamed(rid, request.decode_reused_blocks))
                assert job.push is not None
                with self._timed(span, job, opened):
                    ack = await self._await_push(rid, job.push, request.decode_address)
                self._check_admitted(request, ack)
                return output
            except TandemError as exc:
                self._note_failed_push(request.decode_address, exc)
                raise
            finally:
                started.cancel()
                if not first.done():
                    first.cancel()
                if ack is None and job.push is not None:
                    job.push.cancel()
                await self._end_stream(served, rid, segment, feed, reuse=ack is not None)

    async def _end_stream(self, served: ServedModel, rid: str, segment: Segment, feed: _LayerFeed,
                          reuse: bool) -> None:
        """Stops the engine gathering the request's layers, then gives its segment back (`reuse`: the
        receiver acknowledged it) or closes it. The segment goes only once the engine thread has
        stopped, even when this handler is cancelled meanwhile (the stop is shielded from that)."""
        stopping = asyncio.ensure_future(served.loop.call(lambda engine: served.handoff.stop_stream(rid)))

        def stopped(done: asyncio.Future[None]) -> None:
            if not done.cancelled():
                done.exception()  # retrieved; a RuntimeError: the engine loop stopped, it gathers nothing more
            feed.close()
            self._segments.release(segment, reuse=reuse)

        stopping.add_done_callback(stopped)
        with contextlib.suppress(RuntimeError):
            await asyncio.shield(stopping)

    def _note_failed_push(self, address: str, error: TandemError) -> None:
        """A push through shared memory failed: when for want of reading our segments, the decode
        worker at `address` gets gRPC from now on."""
        if _refused_shared_memory(error):
            self._shares_memory[address] = False

    def _check_admitted(self, request, ack: kv_transfer_pb2.PushAck | None) -> None:
        rid = request.request_id
        if ack is not None and not ack.admitted and not self.runtime.was_aborted(rid):
            raise Unavailable(f"decode worker {request.decode_address} dropped request {rid} during its KV "
                              "transfer (its reservation was aborted or expired)")

    def _stub(self, request) -> kv_transfer_pb2_grpc.KvTransferServiceStub:
        return kv_transfer_pb2_grpc.KvTransferServiceStub(self._channels.get(request.decode_address))

    @staticmethod
    def _send_span(request, reused_blocks: int, transport: str) -> contextlib.AbstractContextManager[trace.Span]:
        """The transfer's span, current while the push opens so the decode worker's receive span is its child."""
        attributes = {Attr.KV_PEER: request.decode_address, Attr.KV_REUSED_BLOCKS: reused_blocks,
                      Attr.KV_TRANSPORT: transport}
        return tracer.start_as_current_span(SpanName.KV_SEND, attributes=attributes)

    @contextlib.contextmanager
    def _timed(self, span: trace.Span, job: PrefillJob, opened: float) -> Iterator[None]:
        """Times the transfer, from here (the first token is out) to the ack: what the hand-off adds
        before the decode worker may start, on `span`, the response and the metrics. The span's rate
        is over its whole life, from `opened` (the push's opening, earlier when layer-pipelined)."""
        started = time.monotonic()
        yield
        ended = time.monotonic()
        seconds = ended - started
        job.transfer.duration_ms = seconds * 1000
        span.set_attributes(kv_transfer_attributes(job.transfer.blocks, job.transfer.bytes, job.transfer.chunks,
                                                   ended - opened))
        span.set_attribute(Attr.KV_AFTER_FIRST_TOKEN_MS, seconds * 1000)
        if self.runtime.metrics is not None:
            self.runtime.metrics.kv_transfer_time.observe(seconds)

    async def _segment_for(self, request: worker_pb2.PrefillRequest, served: ServedModel) -> Segment | None:
        """A segment of the pool big enough for the KV to ship, when the decode worker reads our
        shared memory; None: ship over gRPC."""
        if not await self._reads_our_memory(request.decode_address):
            return None
        engine = served.engine
        shipped = engine.blocks_for_tokens(len(request.token_ids)) - request.decode_reused_blocks
        return self._segments.acquire(shipped * engine.cache.block_bytes)

    async def _reads_our_memory(self, address: str) -> bool:
        """Whether the decode worker at `address` can read this worker's segments (ProbeShm, asked
        once per address; an unreachable worker is asked again next time)."""
        if self.kv_transport == "grpc":
            return False
        known = self._shares_memory.get(address)
        if known is not None:
            return known
        nonce = os.urandom(16)
        probe = probe_segment(nonce)
        stub = kv_transfer_pb2_grpc.KvTransferServiceStub(self._channels.get(address))
        try:
            result = await stub.ProbeShm(kv_transfer_pb2.ShmProbe(segment=_segment_pb(probe.id), nonce=nonce),
                                         timeout=PROBE_TIMEOUT_S, metadata=self._channels.metadata)
            visible, reason = result.visible, result.reason
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return False
            visible, reason = False, f"{error.code().name}: {error.details()}"  # e.g. an older worker
        finally:
            probe.close()
        self._shares_memory[address] = visible
        log.info("KV for decode worker %s goes %s", address,
                 "through shared memory (same host)" if visible else f"over gRPC ({reason})")
        return visible

    async def _await_push(self, rid: str, push: grpc.aio.StreamUnaryCall,
                          address: str) -> kv_transfer_pb2.PushAck | None:
        """The decode worker's ack; None when the request was aborted first (the push is cancelled)."""
        acked = asyncio.ensure_future(_ack(push))
        aborted = asyncio.ensure_future(self.runtime.until_aborted(rid))
        try:
            await asyncio.wait((acked, aborted), return_when=asyncio.FIRST_COMPLETED)
        finally:
            aborted.cancel()
            if not acked.done():
                push.cancel()
                acked.cancel()
        if not acked.done() or acked.cancelled():
            return None
        try:
            return acked.result()
        except grpc.aio.AioRpcError as error:
            if self.runtime.was_aborted(rid) and error.code() == grpc.StatusCode.CANCELLED:
                return None
            raise _transfer_error(error, address) from error

    @staticmethod
    def _header(request, job: PrefillJob, output: RequestOutput, num_chunks: int) -> kv_transfer_pb2.KvRequestHeader:
        header = PrefillServicer._partial_header(request, "", None)
        header.MergeFrom(PrefillServicer._final_header(job, output, num_chunks))
        return header

    @staticmethod
    def _partial_header(request, model: str, segment: Segment | None) -> kv_transfer_pb2.KvRequestHeader:
        """What the header holds before the first token is sampled."""
        header = kv_transfer_pb2.KvRequestHeader(prompt_token_ids=request.token_ids, sampling=request.sampling,
                                                 seed=request.seed, cache_salt=request.cache_salt,
                                                 lora=request.lora, model=model)
        if segment is not None:
            header.shm_segment.CopyFrom(_segment_pb(segment.id))
        return header

    @staticmethod
    def _final_header(job: PrefillJob, output: RequestOutput, num_chunks: int) -> kv_transfer_pb2.KvRequestHeader:
        """What the header learns with the first token."""
        return kv_transfer_pb2.KvRequestHeader(output_token_ids=output.new_token_ids, num_chunks=num_chunks,
                                               cached_tokens=output.num_cached_tokens, timings=job.tracked.timings)

    @staticmethod
    async def _messages(rid: str, header: kv_transfer_pb2.KvRequestHeader, chunks: Iterator[KvChunk],
                        stats: worker_pb2.KvTransferStats) -> AsyncIterator[kv_transfer_pb2.KvChunk]:
        """The chunks as wire messages, their bytes in them, the header on the first; exported off the event loop."""
        while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
            message = kv_transfer_pb2.KvChunk(
                request_id=rid, layer=chunk.layer, first_block=chunk.first_block, num_blocks=chunk.num_blocks,
                dtype=chunk.dtype, shape=chunk.shape, num_layers=chunk.num_layers, data=chunk.data,
            )
            if stats.chunks == 0:
                message.header.CopyFrom(header)
            stats.chunks += 1
            stats.bytes += len(chunk.data)
            yield message

    @staticmethod
    async def _streamed_messages(rid: str, header: kv_transfer_pb2.KvRequestHeader, layout: _Layout,
                                 feed: _LayerFeed, first: asyncio.Future[RequestOutput | None],
                                 job: PrefillJob) -> AsyncIterator[kv_transfer_pb2.KvChunk]:
        """One message per run of layers gathered into the segment since the last, with where it lies
        (the layout of export_kv's one chunk of every layer); the partial header on the first, the
        rest of it on the last, which waits for the first token."""
        stats, sent = job.transfer, 0
        while sent < layout.num_layers:
            ready = await feed.beyond(sent)
            message = kv_transfer_pb2.KvChunk(
                request_id=rid, layer=sent, num_layers=ready - sent, first_block=layout.first_block,
                num_blocks=layout.num_blocks, dtype=layout.dtype, shape=layout.shape,
                shm_offset=sent * layout.layer_bytes)
            if stats.chunks == 0:
                message.header.CopyFrom(header)
            if ready == layout.num_layers:
                output = await first
                if output is None or not _ships(output):
                    await asyncio.get_running_loop().create_future()  # _ship_streamed cancels the push
                message.header.MergeFrom(PrefillServicer._final_header(job, output, stats.chunks + 1))
            stats.chunks += 1
            stats.bytes += (ready - sent) * layout.layer_bytes
            sent = ready
            yield message

    def _response(self, request, job: PrefillJob, output: RequestOutput | None,
                  aborted: bool) -> worker_pb2.PrefillResponse:
        tracked = job.tracked
        reason = common_pb2.FINISH_REASON_ABORT if aborted or output is None else finish_reason_to_proto(
            output.finish_reason)
        response = worker_pb2.PrefillResponse(
            request_id=request.request_id,
            prompt_tokens=len(request.token_ids),
            finish_reason=reason,
            transfer=job.transfer,
            timings=worker_pb2.PrefillTimings(
                queue_ms=ms_between(tracked.arrival_ns, tracked.started_ns),
                compute_ms=ms_between(tracked.started_ns, tracked.first_token_ns),
                time_to_first_token_ms=ms_between(tracked.arrival_ns, tracked.first_token_ns),
                transfer_ms=job.transfer.duration_ms,
                total_ms=ms_between(tracked.arrival_ns, time.time_ns()),
            ),
        )
        if output is not None:
            response.first_token_id = output.new_token_ids[0]
            response.cached_tokens = output.num_cached_tokens
            if tracked.logprobs:
                sampled = output.new_logprobs[0]
                response.first_logprob.CopyFrom(logprob_to_proto(sampled.token_id, sampled.logprob,
                                                                 sampled.top_logprobs))
        return response

    # -- aborts -----------------------------------------------------------------------------

    async def _abort_in_engine(self, rid: str) -> None:
        try:
            await self.runtime.abort([rid])
        except RuntimeError:  # the engine loop stopped: nothing left to free
            pass


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where a streamed request's KV lies in its segment: `num_layers` layers back to back, each
    `layer_bytes` of `shape` (`num_blocks` blocks from the request's block `first_block`)."""

    num_layers: int
    first_block: int
    num_blocks: int
    dtype: str
    shape: tuple[int, ...]
    layer_bytes: int


class _LayerFeed:
    """The layers the engine thread has gathered into a request's segment, as the event loop sees
    them, and the one view of the segment the engine writes through."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.ready = 0
        self._loop = loop
        self._changed = asyncio.Event()
        self._view: memoryview | None = None

    def into(self, segment: Segment) -> memoryview:
        self._view = memoryview(segment.buffer)
        return self._view

    def on_layers(self, count: int) -> None:
        """The first `count` layers are in (engine thread)."""
        try:
            self._loop.call_soon_threadsafe(self._set, count)
        except RuntimeError:  # the asyncio loop is closed: the process is exiting
            pass

    def _set(self, count: int) -> None:
        self.ready = max(self.ready, count)
        self._changed.set()

    async def beyond(self, count: int) -> int:
        """Layers in, once more than `count` are."""
        while self.ready <= count:
            self._changed.clear()
            await self._changed.wait()
        return self.ready

    def close(self) -> None:
        """Releases the view (after the engine thread stopped writing through it)."""
        if self._view is not None:
            self._view.release()


def _ships(output: RequestOutput | None) -> bool:
    """Whether a request's KV crosses after this first output: not when it was aborted before (None)
    or the first token ended it."""
    return output is not None and not is_final(output.finish_reason)


def _close_quietly(chunks: Iterator[KvChunk]) -> None:
    """Stops an export's chunks; one still being read in its copy thread stops when that read ends."""
    try:
        chunks.close()
    except ValueError:  # generator already executing
        pass


async def _ack(push: grpc.aio.StreamUnaryCall) -> kv_transfer_pb2.PushAck:
    return await push


def _refused_shared_memory(error: TandemError) -> bool:
    """Whether a push through shared memory failed because the decode worker cannot read it. It says
    so in a FailedPrecondition after the first message, while the rest are still being written, and
    grpcio may then report INTERNAL instead (grpc/grpc#36066): that counts too, since the cost of
    taking another INTERNAL for it is only the slower transport to that decode worker."""
    if isinstance(error, FailedPrecondition):
        return "from shared memory" in error.message
    return grpc_status(error) == grpc.StatusCode.INTERNAL


def _transfer_error(error: grpc.aio.AioRpcError, address: str) -> TandemError:
    """What the scheduler hears when the push failed: the decode worker lost, or refusing the KV."""
    code, details = error.code(), error.details()
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"cannot reach decode worker {address} to ship the KV: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"the KV transfer to {address} ran past the request's deadline")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return FailedPrecondition(f"decode worker {address} refused the KV: {details}; do both workers "
                                  "serve the same model with the same block size and dtype?")
    return error_from_rpc(error)


def _segment_pb(segment: SegmentId) -> kv_transfer_pb2.ShmSegment:
    return kv_transfer_pb2.ShmSegment(pid=segment.pid, fd=segment.fd, inode=segment.inode, size=segment.size)
