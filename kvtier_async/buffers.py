"""Copies of MiB buffers that let the event loop run meanwhile.

A worker thread that copies with `view[:] = other` or `bytes(view)` holds the GIL for the
whole copy (a millisecond per 8 MiB, more on fresh pages), and the event loop, which needs
the GIL to run at all, waits that long. `ctypes.memmove` releases it, and a buffer from
`new_buffer` is not zero-filled first (`bytearray(n)` zeroes every byte, GIL held).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

__all__ = ["address_of", "copy_into", "new_buffer"]


def address_of(buffer: Any) -> int:
    """Where the first byte of a C-contiguous buffer (read-only ones too) lies in memory."""
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


def copy_into(dst: memoryview, src: Any) -> None:
    """Copy all of `src` (any C-contiguous buffer) to the start of `dst`, the GIL released."""
    n = memoryview(src).nbytes
    if n > dst.nbytes:
        raise ValueError(f"copy_into: {n} bytes do not fit in {dst.nbytes}")
    if n:
        ctypes.memmove(address_of(dst), address_of(src), n)


def new_buffer(nbytes: int) -> memoryview:
    """A writable buffer of `nbytes` whose contents are undefined until written."""
    array: Any = np.empty(nbytes, dtype=np.uint8)
    return memoryview(array).cast("B")
