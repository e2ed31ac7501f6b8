"""The KV hand-off between engines: the one owner of the blocks a request's KV occupies while it
crosses from a prefill engine to a decode engine.

Prefill side: `export` takes a prefilled request (first token sampled) out of the engine with
its blocks and says how many chunks its KV makes -> the chunks are read and shipped ->
`release_export` frees the blocks (full ones stay in the prefix cache).
Decode side: `reserve` allocates blocks owned by no sequence, taking the prompt's leading blocks
from the prefix cache when it holds them -> `import_chunk` writes each chunk into the others ->
`admit` starts decoding the request at the next step. `cancel` then `free` drop a reservation or an
export at any point. A prefill side told that the receiver reused `n` blocks exports only the rest.

Layer-pipelined, into a buffer shared with the receiver: `stream_layers` before the request's last
prompt chunk runs -> the forward pass gathers each layer's KV into the buffer as soon as that layer
is computed, and says so (`on_layers`), so the sender ships layer `l` while later layers still
compute -> `hold_streamed` takes the prefilled request with its blocks, as `export` does, with no
copy left to make -> `release_export`. `stop_stream` ends the gathering at any point.

Threads. Only the engine thread touches the engine: `reserve`, `admit`, `free`, `export` and
`release_export` allocate or free blocks or change the batch, so they run there. Chunk bytes are
the one exception, and it lives here: `import_chunk` and an export's chunks touch only blocks this
object holds, which no running sequence references, so the copies run outside the engine thread
(imports on the worker's event loop, exports in a copy thread) and overlap the model's steps.
`cancel` runs on the thread that imports, so no chunk is written into a reservation after it; its
blocks go back to the engine only later, in `free`. A lock guards the bookkeeping across threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from services.runtime.block_manager import NoFreeBlocksError
from services.runtime.engine import Engine
from services.runtime.batch_scheduler import ScheduledChunk
from services.runtime.kv_transfer import KvChunk, blocks_per_chunk, export_kv, gather_layer, import_kv, num_export_chunks
from services.runtime.sampler import SamplingParams
from services.runtime.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Reservation:
    """Blocks held for a request's incoming KV (all its tokens but the last). The first
    `reused_blocks` are prefix-cache hits that already hold the KV: no chunk is written into them."""

    request_id: str
    block_ids: list[int]
    reused_blocks: int = 0
    receiving: bool = False  # a stream is filling it; a second one is refused
    cancelled: bool = False  # no chunk is written after this
    received_bytes: int = 0


@dataclass(slots=True)
class KvExport:
    """A prefilled request's KV as chunks: their count is known before the first is read.
    `num_blocks` are shipped, after the `skipped_blocks` the receiver already holds."""

    request_id: str
    num_blocks: int
    num_chunks: int
    chunks: Iterator[KvChunk]
    skipped_blocks: int = 0


@dataclass(slots=True)
class LayerStream:
    """Where a prefilling request's KV goes layer by layer: blocks from `skip_blocks` on, into `into`
    laid out as export_kv's one chunk of every layer; `on_layers(n)` (engine thread) once the first
    `n` layers are in."""

    skip_blocks: int
    into: memoryview
    on_layers: Callable[[int], None]


@dataclass(frozen=True, slots=True)
class PromptKey:
    """What finds a prompt's blocks in the prefix cache: its tokens, the tenant's salt, the adapter."""

    token_ids: list[int]
    salt: str = ""
    lora: str = ""


class KvHandoff:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._reservations: dict[str, Reservation] = {}
        self._exports: dict[str, tuple[Sequence, int]] = {}  # request id -> (sequence, blocks shipped)
        self._streams: dict[str, LayerStream] = {}  # engine thread only
        engine.scheduler.incoming = self.importing_contexts

    # -- the prefill side (engine thread) ---------------------------------------------------

    def export(self, request_id: str, max_chunk_bytes: int, skip_blocks: int = 0,
               into: memoryview | None = None) -> KvExport:
        """The KV of every computed token of a prefilled request but its first `skip_blocks` blocks
        (the receiver holds those), layer by layer, in chunks of at most `max_chunk_bytes`, gathered
        into `into` when given (kv_transfer.export_kv). ValueError
        when one block of one layer is larger (nothing changes) or `skip_blocks` leaves no block
        (the request is held as an export: `free` returns its blocks)."""
        cache = self.engine.cache
        blocks_per_chunk(cache, max_chunk_bytes)  # ValueError for too small a bound, before anything changes
        block_ids = self._hold(request_id, skip_blocks)
        shipped = len(block_ids) - skip_blocks
        return KvExport(request_id, shipped, num_export_chunks(cache, shipped, max_chunk_bytes, into is not None),
                        export_kv(cache, block_ids, max_chunk_bytes, skip_blocks, into), skip_blocks)

    def stream_layers(self, request_id: str, stream: LayerStream) -> None:
        """Gathers the request's KV into `stream.into` layer by layer during the forward pass of its
        last prompt chunk (engine thread; call it before that chunk runs)."""
        if not self._streams:
            self.engine.runner.after_layer = self._layer_done
        self._streams[request_id] = stream

    def stop_stream(self, request_id: str) -> None:
        """No layer of the request is gathered after this (engine thread)."""
        self._streams.pop(request_id, None)
        if not self._streams:
            self.engine.runner.after_layer = None

    def hold_streamed(self, request_id: str, skip_blocks: int) -> int:
        """Takes a prefilled request whose KV was streamed (`stream_layers`) with its blocks, as
        `export` does; the number of blocks shipped. ValueError as `export`'s."""
        self.stop_stream(request_id)
        return len(self._hold(request_id, skip_blocks)) - skip_blocks

    def _hold(self, request_id: str, skip_blocks: int) -> list[int]:
        """Takes the prefilled request out of the engine, holding its blocks as an export; their ids."""
        seq = self.engine.take_prefilled(request_id)
        num_blocks = self.engine.blocks_for_tokens(seq.num_computed_tokens)
        with self._lock:  # held from here on, so `free` returns the blocks whatever happens next
            self._exports[request_id] = (seq, max(num_blocks - skip_blocks, 0))
        if not 0 <= skip_blocks < num_blocks:
            raise ValueError(f"cannot skip {skip_blocks} of the request's {num_blocks} KV blocks; "
                             f"the receiver may hold at most {num_blocks - 1} of them")
        return seq.block_table[:num_blocks]

    def _layer_done(self, chunks: list[ScheduledChunk], layer: int) -> None:
        """The forward pass computed `layer` of `chunks`: the streamed requests whose prompt it
        completes gather that layer (engine thread)."""
        for chunk in chunks:
            stream = self._streams.get(chunk.seq.request_id) if chunk.completes else None
            if stream is None:
                continue
            seq = chunk.seq
            num_blocks = self.engine.blocks_for_tokens(seq.num_computed_tokens + chunk.num_new_tokens)
            try:
                gather_layer(self.engine.cache, seq.block_table[stream.skip_blocks : num_blocks], layer, stream.into)
            except ValueError as exc:  # its buffer went (a bug on the sender's side): fail that request only
                log.error("request %s: stopped streaming its KV at layer %d: %s", seq.request_id, layer, exc)
                self.stop_stream(seq.request_id)
                continue
            stream.on_layers(layer + 1)

    def release_export(self, request_id: str) -> None:
        """Frees the shipped request's blocks; its full blocks stay in the prefix cache."""
        with self._lock:
            export = self._exports.pop(request_id, None)
        if export is None:
            raise KeyError(f"request {request_id!r} has no exported KV to release")
        seq, shipped = export
        self.engine.counters.kv_bytes_sent += shipped * self.engine.cache.block_bytes
        self.engine.scheduler.release_blocks(seq)

    # -- the decode side --------------------------------------------------------------------

    def reserve(self, request_id: str, num_tokens: int, prompt: PromptKey | None = None) -> Reservation:
        """Holds the blocks for a request's `num_tokens` tokens (imported KV plus the last sampled
        token): the prefix cache's hits on `prompt`'s leading blocks (all but the block of its last
        token at most), then fresh blocks. Engine thread; NoFreeBlocksError (nothing held) when the
        fresh ones are not free now."""
        with self._lock:
            in_use = request_id in self._reservations or request_id in self._exports
        if in_use or self.engine.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        blocks = self.engine.blocks
        hits: list[int] = []
        if prompt is not None:
            hits, _ = blocks.match_tokens(prompt.token_ids, (len(prompt.token_ids) - 1) // blocks.block_size,
                                          prompt.salt, prompt.lora)
        blocks.acquire(hits)
        try:
            fresh = blocks.allocate(self.engine.blocks_for_tokens(num_tokens) - len(hits))
        except NoFreeBlocksError:
            blocks.release(hits)
            raise
        self.engine.cache.initialize(fresh)
        reservation = Reservation(request_id, hits + fresh, len(hits))
        with self._lock:
            self._reservations[request_id] = reservation
        return reservation

    def reservation(self, request_id: str) -> Reservation | None:
        with self._lock:
            return self._reservations.get(request_id)

    def import_chunk(self, reservation: Reservation, chunk: KvChunk) -> bool:
        """Writes one chunk into the reserved blocks; False (nothing written) once cancelled.
        ValueError when the chunk does not fit this cache or the reservation."""
        if reservation.cancelled:
            return False
        if chunk.first_block < reservation.reused_blocks:
            raise ValueError(f"KV chunk starts at block {chunk.first_block}, but this worker reused the first "
                             f"{reservation.reused_blocks} blocks from its prefix cache; ship blocks from "
                             f"{reservation.reused_blocks} on")
        import_kv(self.engine.cache, reservation.block_ids, chunk)
        reservation.received_bytes += len(chunk.data)
        return True

    def importing_contexts(self) -> list[int]:
        """The KV entries (at most) each request whose KV is being imported will decode from: the batch
        scheduler leaves room for their first decode step. Any thread."""
        block_size = self.engine.blocks.block_size
        with self._lock:
            return [len(r.block_ids) * block_size for r in self._reservations.values()
                    if r.receiving and not r.cancelled]

    def admit(self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
              params: SamplingParams, seed: int, salt: str = "", lora: str = "",
              arrived_at: float | None = None) -> None:
        """Starts decoding a request whose KV (all tokens but the last) was imported, from the next
        step on; `arrived_at` (time.monotonic()): when its first token arrived, the start of the gap its
        first decode step ends. Engine thread; KeyError when its reservation is gone (cancelled meanwhile). When the
        engine refuses the sequence (an unknown adapter, a grammar it cannot compile) the reserved
        blocks go back to the pool before the error propagates."""
        with self._lock:
            reservation = self._reservations.get(request_id)
            if reservation is None or reservation.cancelled:
                raise KeyError(f"request {request_id!r} has no reserved blocks; reserve before admitting")
            del self._reservations[request_id]
        seq = Sequence(request_id, list(prompt_token_ids), params, seed, salt=salt, lora=lora,
                       token_ids=list(prompt_token_ids) + list(output_token_ids))
        seq.block_table = reservation.block_ids
        seq.num_computed_tokens = seq.num_tokens - 1
        try:
            self.engine.add_running(seq, arrived_at)
        except BaseException:
            self.engine.blocks.release(reservation.block_ids)
            raise
        self.engine.counters.kv_bytes_received += reservation.received_bytes

    # -- either side ------------------------------------------------------------------------

    def cancel(self, request_id: str) -> Reservation | None:
        """Stops imports into the request's reservation at once (on the importing thread); call
        `free` in the engine thread to return its blocks."""
        with self._lock:
            reservation = self._reservations.get(request_id)
        if reservation is not None:
            reservation.cancelled = True
        return reservation

    def free(self, request_id: str) -> bool:
        """Returns the blocks of the request's reservation or export (engine thread); False if it has neither."""
        with self._lock:
            reservation = self._reservations.pop(request_id, None)
            export = self._exports.pop(request_id, None)
        if reservation is not None:
            reservation.cancelled = True
            self.engine.blocks.release(reservation.block_ids)
        if export is not None:
            self.engine.scheduler.release_blocks(export[0])
        return reservation is not None or export is not None

    @property
    def reserved_blocks(self) -> int:
        with self._lock:
            return sum(len(r.block_ids) for r in self._reservations.values())

    @property
    def num_in_flight(self) -> int:
        """Requests whose KV is crossing: reserved here, or exported and not yet released."""
        with self._lock:
            return len(self._reservations) + len(self._exports)

    def request_ids(self) -> list[str]:
        with self._lock:
            return [*self._reservations, *self._exports]
