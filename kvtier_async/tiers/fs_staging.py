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
(`pages_scattered`) when it opens, and stages its I/O only when they are scattered:
memory in huge pages, like our own `PrimaryTier`'s, or laid out contiguously, goes
straight to the device as before.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import struct
import threading

from ..primary import reserve_host_memory

__all__ = ["STAGE_BYTES", "Stager", "address_of", "pages_scattered", "scattered_fraction"]

#: Bytes one staged read or write moves (a multiple of the huge page size).
STAGE_BYTES = 8 << 20
_PAGE = mmap.PAGESIZE
_SAMPLES = 16  # windows of the region looked at
_WINDOW_PAGES = 128  # pages in each window
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
    """Whether most neighbouring pages of `view` are apart in physical memory (None: unknown).

    Past half, a 2 MiB record needs more scatter-list segments than a virtio request holds.
    """
    fraction = scattered_fraction(view)
    return None if fraction is None else fraction > 0.5


class Stager:
    """Per-thread huge-page buffers, and reads and writes of scatter lists through them.

    Each I/O thread gets its own `STAGE_BYTES` buffer on first use; it lives as long as the
    thread and this object.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def _buffer(self) -> tuple[memoryview, int]:
        local = self._local
        if not hasattr(local, "view"):
            mapping = reserve_host_memory(STAGE_BYTES)
            mapping.write(bytes(STAGE_BYTES))  # fault every page in now, in order
            local.mapping, local.view = mapping, memoryview(mapping)
            local.address = address_of(local.view)
        return local.view, local.address

    def pwritev(self, fd: int, iov: list[memoryview], offset: int) -> int:
        """Write the pieces of `iov` back to back at `offset`; the bytes written (short on a full disk)."""
        stage, stage_address = self._buffer()
        spans = [(address_of(piece), len(piece)) for piece in iov]
        total, done = sum(n for _, n in spans), 0
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
        stage, stage_address = self._buffer()
        spans = [(address_of(piece), len(piece)) for piece in iov]
        total, done = sum(n for _, n in spans), 0
        while done < total:
            n = min(STAGE_BYTES, total - done)
            got = os.preadv(fd, [stage[:n]], offset + done)
            _copy(spans, done, got, stage_address, to_stage=False)
            done += got
            if got < n:
                break
        return done


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
