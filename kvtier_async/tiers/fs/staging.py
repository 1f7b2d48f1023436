"""Staged O_DIRECT I/O: through a physically contiguous buffer, for primary memory whose
pages lie scattered in physical memory.

An O_DIRECT read or write hands the device one scatter-list segment per physically
contiguous run of the caller's pages. vLLM's primary region is a `/dev/shm` mapping in
4 KiB pages; on a host that has been up a while, neighbouring pages of it are rarely
neighbours in RAM, so a 2 MiB record becomes 512 segments. On this project's VMs
(virtio-blk, at most 254 segments a request) that halved the disk's speed both ways:
2 MiB reads ran at 1.1 GB/s into scattered pages, 2.2 GB/s into contiguous ones, with
any number of threads. Reading into a huge-page buffer and copying out (a memcpy costs a
fraction of a core at disk speed) brought them back to 2.1 GB/s.

So the fs tier looks at where a sample of the primary region's pages lie
(`pages_scattered`) when it opens, and stages its I/O only when more than a fifth of
neighbouring pages lie apart (`SCATTERED_ABOVE` has the measurements): memory in huge
pages, like our own `PrimaryTier`'s, or laid out mostly in order, goes straight to the
device as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import mmap
import os
import struct
import threading
from collections.abc import Iterator

from ...primary import reserve_host_memory

__all__ = ["SCATTERED_ABOVE", "STAGE_BYTES", "Stager", "address_of", "pages_scattered", "scattered_fraction"]

#: Bytes one staged read or write moves (a multiple of the huge page size).
STAGE_BYTES = 8 << 20
_PAGE = mmap.PAGESIZE
_SAMPLES = 16  # windows of the region looked at
_WINDOW_PAGES = 128  # pages in each window
#: The fraction of neighbouring pages apart (`scattered_fraction`) past which staging pays.
#: Measured on this project's VMs (`bench/fs_staging.py`, on the performance page), 2 and
#: 32 MiB records: from a quarter of neighbours apart up, direct I/O ran at 0.62-0.99x of
#: staged I/O both ways (worse the more apart); below a fifth it depends on the size and the
#: direction (direct 32 MiB loads 1.08x at 0.15; direct 2 MiB stores 1.00-1.18x and loads
#: 0.90-0.97x at 0.03-0.08), the copy costing about what the segments do. Not only the 254
#: segments a virtio request holds count: each one costs the device.
SCATTERED_ABOVE = 0.2
_PRESENT = 1 << 63
_PFN_MASK = (1 << 55) - 1


def address_of(view: memoryview) -> int:
    """Where a (writable) buffer's first byte lies in this process's memory."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def scattered_fraction(view: memoryview) -> float | None:
    """The fraction of neighbouring pages of `view` that are apart in physical memory.

    Looks at up to 16 windows of 128 pages spread over the region, in `/proc/self/pagemap`.
    None when that cannot tell: not Linux, pages not yet faulted in, or no permission to see
    frame numbers (the kernel shows them to CAP_SYS_ADMIN only, as zeros to others).
    """
    address, pages = address_of(view), len(view) // _PAGE
    if address % _PAGE or pages < 2:
        return None
    window = min(_WINDOW_PAGES, pages)
    starts = sorted({(pages - window) * k // max(1, _SAMPLES - 1) for k in range(_SAMPLES)})
    pairs = apart = 0
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
            for start in starts:
                pagemap.seek((address // _PAGE + start) * 8)
                raw = pagemap.read(window * 8)
                frames = [
                    entry & _PFN_MASK if entry & _PRESENT else 0
                    for entry in struct.unpack(f"{len(raw) // 8}Q", raw)
                ]
                for a, b in itertools.pairwise(frames):
                    if a and b:
                        pairs += 1
                        apart += b != a + 1
    except OSError:
        return None
    if pairs < window:  # frame numbers hidden, or too few pages in memory to judge
        return None
    return apart / pairs


def pages_scattered(view: memoryview) -> bool | None:
    """Whether enough neighbouring pages of `view` are apart in physical memory that staged
    I/O beats direct I/O into them (None: unknown)."""
    fraction = scattered_fraction(view)
    return None if fraction is None else fraction > SCATTERED_ABOVE


class Stager:
    """Huge-page buffers, one per I/O call in flight, and reads and writes of scatter lists
    through them.

    `reserve` makes them ahead, when the tier opens: faulting a new buffer's pages in took
    3-415 ms on this project's VMs (the hypervisor backs the memory on first touch), and a
    first store or load waited for every thread's. A call that finds none free makes another,
    which then stays for later calls; `release` lets them all go.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[tuple[mmap.mmap, memoryview, int]] = []  # (mapping, its view, address)
        self._held = 0  # buffers made and not released: free or in use

    @property
    def buffers(self) -> int:
        """How many buffers this holds (`STAGE_BYTES` each)."""
        return self._held

    def reserve(self, count: int) -> None:
        """Make buffers until `count` are free (blocks: call off the event loop)."""
        with self._lock:
            missing = count - len(self._free)
        made = [_new_buffer() for _ in range(missing)]
        with self._lock:
            self._free += made
            self._held += len(made)

    def release(self) -> None:
        """Let go of the free buffers; unmapping them blocks, so call off the event loop."""
        with self._lock:
            freed, self._free = self._free, []
            self._held -= len(freed)
        del freed  # the last references: unmapped here

    @contextlib.contextmanager
    def _buffer(self) -> Iterator[tuple[memoryview, int]]:
        with self._lock:
            buffer = self._free.pop() if self._free else None
        if buffer is None:
            buffer = _new_buffer()
            with self._lock:
                self._held += 1
        try:
            yield buffer[1], buffer[2]
        finally:
            with self._lock:
                self._free.append(buffer)

    def pwritev(self, fd: int, iov: list[memoryview], offset: int) -> int:
        """Write the pieces of `iov` back to back at `offset`; the bytes written (short on a full disk)."""
        spans = [(address_of(piece), len(piece)) for piece in iov]
        total, done = sum(n for _, n in spans), 0
        with self._buffer() as (stage, stage_address):
            while done < total:
                n = min(STAGE_BYTES, total - done)
                _copy(spans, done, n, stage_address, to_stage=True)
                written = os.pwrite(fd, stage[:n], offset + done)
                done += written
                if written < n:
                    break
        return done

    def preadv(self, fd: int, iov: list[memoryview], offset: int) -> int:
        """Read into the pieces of `iov`, back to back, from `offset`; the bytes read (short at the end)."""
        spans = [(address_of(piece), len(piece)) for piece in iov]
        total, done = sum(n for _, n in spans), 0
        with self._buffer() as (stage, stage_address):
            while done < total:
                n = min(STAGE_BYTES, total - done)
                got = os.preadv(fd, [stage[:n]], offset + done)
                _copy(spans, done, got, stage_address, to_stage=False)
                done += got
                if got < n:
                    break
        return done


def _new_buffer() -> tuple[mmap.mmap, memoryview, int]:
    mapping = reserve_host_memory(STAGE_BYTES)
    mapping.write(bytes(STAGE_BYTES))  # fault every page in now, in order
    view = memoryview(mapping)
    return mapping, view, address_of(view)


def _copy(
    spans: list[tuple[int, int]],
    start: int,
    n: int,
    stage_address: int,
    *,
    to_stage: bool,
) -> None:
    """Copy bytes [start, start + n) of the concatenated `spans` to or from the stage buffer.

    `ctypes.memmove` releases the GIL: other threads run while it copies.
    """
    position = 0  # where the current span starts in the concatenation
    for address, length in spans:
        end = position + length
        if end > start and position < start + n:
            lo, hi = max(start, position), min(start + n, end)
            piece, staged = address + lo - position, stage_address + lo - start
            if to_stage:
                ctypes.memmove(staged, piece, hi - lo)
            else:
                ctypes.memmove(piece, staged, hi - lo)
        position = end
        if position >= start + n:
            break
