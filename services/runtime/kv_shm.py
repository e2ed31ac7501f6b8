"""Shared-memory segments for the same-host KV path: the sender's pool, and the receiver's view.

A segment is a Linux memfd (shared memory with no name in /dev/shm), so nothing outlives the
processes that use it: the kernel frees it once the sender has closed it and the receiver has
unmapped it, whether they exit, crash or are killed. The receiver opens it at /proc/PID/fd/FD of the
sender (the same host, and processes it may see), checks its inode and size, and maps it read-only
for one transfer. The sender keeps a few idle segments mapped and faulted in, for the next
transfers: writing into fresh pages costs more than the copy itself.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

SEGMENT_NAME = "tandem-kv"  # what /proc/PID/fd and /proc/PID/maps show: memfd:tandem-kv
MAX_IDLE_SEGMENTS = 4
_ROUNDING = 8 << 20  # sizes round up to this, so a slightly longer prompt reuses a segment


class ShmUnavailable(OSError):
    """The receiver cannot open or check the sender's segment."""


@dataclass(frozen=True, slots=True)
class SegmentId:
    """What names a segment to the receiver (kv_transfer.proto's ShmSegment)."""

    pid: int
    fd: int
    inode: int
    size: int


class Segment:
    """A memfd of this process, mapped read-write and faulted in."""

    def __init__(self, size: int) -> None:
        self.fd = os.memfd_create(SEGMENT_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.buffer = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.close(self.fd)
            raise
        self.id = SegmentId(os.getpid(), self.fd, os.fstat(self.fd).st_ino, size)

    @property
    def size(self) -> int:
        return self.id.size

    def close(self) -> None:
        try:
            self.buffer.close()
        except BufferError:  # a view of it is still out: the mapping goes when that view does
            pass
        os.close(self.fd)


class SegmentPool:
    """Segments lent one per transfer: `acquire` -> write -> the receiver acknowledges -> `release`.

    A segment is never lent twice at once, and it goes back to the pool only once the receiver is
    done with it (`reuse=False` after a failed or cancelled transfer: the receiver may still read
    it, so it is closed, not lent again). At most MAX_IDLE_SEGMENTS stay idle."""

    def __init__(self, max_idle: int = MAX_IDLE_SEGMENTS) -> None:
        self._max_idle = max_idle
        self._idle: list[Segment] = []
        self._lent = 0
        self._lock = threading.Lock()

    def acquire(self, size: int) -> Segment:
        """The smallest idle segment of at least `size` bytes, or a new one."""
        with self._lock:
            fitting = [s for s in self._idle if s.size >= size]
            segment = min(fitting, key=lambda s: s.size) if fitting else None
            if segment is not None:
                self._idle.remove(segment)
            self._lent += 1
        if segment is None:
            try:
                segment = Segment(-(-size // _ROUNDING) * _ROUNDING)
            except BaseException:
                with self._lock:
                    self._lent -= 1
                raise
        return segment

    def release(self, segment: Segment, reuse: bool = True) -> None:
        with self._lock:
            self._lent -= 1
            if reuse:
                self._idle.append(segment)
                self._idle.sort(key=lambda s: s.size, reverse=True)
                extra = self._idle[self._max_idle :]
                del self._idle[self._max_idle :]
            else:
                extra = [segment]
        for closing in extra:
            closing.close()

    @property
    def num_segments(self) -> int:
        """Segments open now: idle and lent."""
        with self._lock:
            return len(self._idle) + self._lent

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for segment in idle:
            segment.close()


def open_segment(segment: SegmentId) -> mmap.mmap:
    """The sender's segment mapped read-only (close it after the transfer); ShmUnavailable when it
    cannot be opened here or is not the segment named."""
    path = f"/proc/{segment.pid}/fd/{segment.fd}"
    if segment.size < 1:
        raise ShmUnavailable(f"the segment named at {path} has {segment.size} bytes; a segment has at least one")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ShmUnavailable(f"cannot open the sender's segment {path}: {exc.strerror} (is the sender on "
                             "another host, or in another process namespace?)") from exc
    try:
        stat = os.fstat(fd)
        if stat.st_ino != segment.inode or stat.st_size < segment.size:
            raise ShmUnavailable(f"{path} is inode {stat.st_ino} of {stat.st_size} bytes, not the segment named "
                                 f"(inode {segment.inode}, {segment.size} bytes): the sender closed it")
        return mmap.mmap(fd, segment.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


@contextlib.contextmanager
def segment_view(mapping: mmap.mmap, offset: int, length: int) -> Iterator[memoryview]:
    """`length` bytes of a mapped segment from `offset`, released on exit (the mapping cannot close
    while a view is out); ValueError when they run past its end."""
    if offset < 0 or offset + length > len(mapping):
        raise ValueError(f"KV chunk of {length} bytes at shm_offset {offset} runs past the segment's "
                         f"{len(mapping)} bytes")
    with memoryview(mapping) as whole, whole[offset : offset + length] as view:
        yield view


def probe_segment(nonce: bytes) -> Segment:
    """A one-page segment holding `nonce`, for the receiver to read back (ProbeShm)."""
    segment = Segment(mmap.PAGESIZE)
    segment.buffer[: len(nonce)] = nonce
    return segment


def reads_back(segment: SegmentId, nonce: bytes) -> str:
    """Why the probe's segment cannot be read here ("" when it can and holds `nonce`)."""
    try:
        mapping = open_segment(segment)
    except ShmUnavailable as exc:
        return str(exc)
    with mapping:
        return "" if mapping[: len(nonce)] == nonce else "the segment does not hold the probe's nonce"
