"""`StreamCopies`: the copy engine's GPU path, on CUDA streams of its own.

What `copy_engine` says of the CUDA path is done here: per direction a kernel stream and a DMA
stream made through the CUDA driver (`DriverStreams`), staging and index buffers made once at
open, every kernel launched once at open (`StreamCopies._warm`), one submit thread that queues
every chunk, waiter threads that learn when a chunk ended, and a call's blocks in slot order,
chunked with a cap on runs (`slot_ordered_chunks`). Imported by `CopyEngine.open` only where the
copies use streams: elsewhere nothing here runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import traceback
from collections.abc import Awaitable, Iterator
from typing import Any

import torch

from .copy_engine import MARK_WAITERS, TO_DEVICE, TO_HOST, Mark, MarkWaiters, Part, paired_runs
from .workers import WorkerThreads

__all__ = ["GPU_CHUNKS_IN_FLIGHT", "MAX_RUNS_PER_CHUNK", "DriverStreams", "StreamCopies"]

#: Chunks of a direction queued at once on a GPU: one in its gather or scatter kernel, one in
#: its DMA, one being queued.
GPU_CHUNKS_IN_FLIGHT = 3
#: Runs of neighbouring slots (one `cudaMemcpyAsync` each) in one GPU chunk at most: a chunk's
#: launches stay far below the device's queue of pending launches (about a thousand, past which
#: a launch blocks its thread), even with small blocks scattered over the slots.
MAX_RUNS_PER_CHUNK = 256


class StreamCopies:
    """Chunks through device staging buffers on two CUDA streams per direction (kernels, DMA),
    queued by one submit thread; a waiter thread learns when each chunk ended."""

    mode = "streams"
    chunks_in_flight = GPU_CHUNKS_IN_FLIGHT

    def __init__(
        self, device: torch.device, parts: list[Part], host: torch.Tensor, staging_blocks: int
    ) -> None:
        # A worker thread's work: allocations, and a wait for the zeroing to end. Every tensor
        # the copies use is made here, on the current stream, before any copy stream is: the
        # caching allocator ties a block (with expandable segments, its whole segment) to the
        # stream current at its allocation, and synchronizes that stream when it unmaps the
        # segment (`ExpandableSegment::unmapHandles`, c10/cuda/CUDACachingAllocator.cpp), which
        # after `close` would be a destroyed stream. Nothing is allocated under a copy stream.
        self.device = device
        self.parts = parts
        self.host = host
        stride = host.shape[1]
        pinned = device.type == "cuda"  # (a CPU device only under the tests' stand-in for CUDA)
        with torch.cuda.device(device):
            # Zeroed once: gathers write each row's first block_nbytes only, so a slot's padding
            # that comes from here is zeros.
            self.staging = {
                d: [
                    torch.zeros((staging_blocks, stride), dtype=torch.uint8, device=device)
                    for _ in range(GPU_CHUNKS_IN_FLIGHT)
                ]
                for d in (TO_HOST, TO_DEVICE)
            }
            self.index_host = {
                d: [
                    torch.empty(staging_blocks, dtype=torch.long, pin_memory=pinned)
                    for _ in range(GPU_CHUNKS_IN_FLIGHT)
                ]
                for d in (TO_HOST, TO_DEVICE)
            }
            self.index_device = {
                d: [
                    torch.empty(staging_blocks, dtype=torch.long, device=device)
                    for _ in range(GPU_CHUNKS_IN_FLIGHT)
                ]
                for d in (TO_HOST, TO_DEVICE)
            }
            # Per staging buffer, the event its chunk's end is recorded in, again at each use:
            # a buffer is used again only once the host saw its last end (`finish`), so no
            # thread still waits for the event then; none is made or destroyed per chunk.
            self.ends = {
                d: [torch.cuda.Event(blocking=True) for _ in range(GPU_CHUNKS_IN_FLIGHT)]  # type: ignore[no-untyped-call]
                for d in (TO_HOST, TO_DEVICE)
            }
            # `_warm`'s scatters write here, never into the model's blocks.
            self.scratch = {
                TO_DEVICE: [torch.empty((1, width), dtype=torch.uint8, device=device) for *_, width in parts]
            }
            torch.cuda.current_stream(device).synchronize()  # the zeros are there before any use
            self._driver = DriverStreams(device)
            self._handles: dict[str, int] = {}
            self.streams: dict[str, Any] = {}
            try:
                # Per direction, kernels (index uploads, gathers or scatters) and DMA on streams
                # apart: a chunk's DMA runs beside the next chunk's kernel.
                for name in (f"{d}/{role}" for d in (TO_HOST, TO_DEVICE) for role in ("kernels", "dma")):
                    self._handles[name] = self._driver.create()
                self.streams = {
                    name: torch.cuda.ExternalStream(handle, device=device)  # type: ignore[no-untyped-call]
                    for name, handle in self._handles.items()
                }
                self._warm(staging_blocks)
            except BaseException as exc:
                # `_warm` may have queued kernels that still read and write our buffers: the
                # streams are idle before a buffer is freed or a stream destroyed. The frames
                # the error passed through still hold buffers (`_warm`'s locals): let go first.
                traceback.clear_frames(exc.__traceback__)
                with contextlib.suppress(Exception):  # then leaked, never freed in use;
                    self._release()  # the caller sees why opening failed
                raise
        self.nbytes = 2 * GPU_CHUNKS_IN_FLIGHT * staging_blocks * (stride + 2 * 8)
        # One thread queues every chunk, in call order: no launch from the event loop (a launch
        # blocks while the device's queue is full), and `drain` follows what was queued before.
        self._submit = WorkerThreads(1, "kvtier-cuda-submit")
        self._waiters = WorkerThreads(2 * GPU_CHUNKS_IN_FLIGHT, "kvtier-cuda-wait")
        # Each call waits for its producer (or consumer) here, on the host, before its first
        # chunk is queued: a copy stream that waited on the device would hold every later chunk
        # of every other call behind that one call's producer.
        self._mark_waiters = MarkWaiters(MARK_WAITERS, "kvtier-cuda-mark")

    def _warm(self, staging_blocks: int) -> None:
        """Launch every kernel the copies use once, now, on the copy streams, and wait for them.

        With lazy module loading (the CUDA_MODULE_LOADING default of recent CUDA releases) a
        kernel's module loads at its first launch, which may synchronize the context while the
        model runs: let that happen while the cache opens, not in a store. Which kernels, from
        ATen's CUDA sources: `index_select` launches `indexSelectSmallIndex` for up to 16
        indices (its variant set by the collapsed dims of the same part and staging tensors)
        and `gather` beyond; `index_copy_` one kernel per element size (all parts are uint8).
        So: gathers of 1, 16 and a whole chunk of block 0 from every part (reads only: the
        rows are overwritten by every real gather, their padding stays zero), and scatters of
        one row into a scratch row per part, never into the model's blocks.
        """
        counts = sorted({1, min(16, staging_blocks), staging_blocks})
        with torch.cuda.stream(self.streams[f"{TO_HOST}/kernels"]):
            index = self.index_device[TO_HOST][0]
            index.zero_()
            rows = self.staging[TO_HOST][0]
            for n in counts:
                for part, offset, width in self.parts:
                    torch.index_select(part, 0, index[:n], out=rows[:n, offset : offset + width])
        with torch.cuda.stream(self.streams[f"{TO_DEVICE}/kernels"]):
            index = self.index_device[TO_DEVICE][0]
            index.zero_()
            rows = self.staging[TO_DEVICE][0]
            for (_part, offset, width), scratch in zip(self.parts, self.scratch[TO_DEVICE]):
                scratch.index_copy_(0, index[:1], rows[:1, offset : offset + width])
        for stream in self.streams.values():
            stream.synchronize()

    def chunks(
        self, direction: str, sources: list[int], targets: list[int], step: int
    ) -> list[tuple[list[int], list[int]]]:
        return slot_ordered_chunks(direction, sources, targets, step, MAX_RUNS_PER_CHUNK)

    async def wait_for(self, mark: Any) -> None:
        await self._mark_waiters.run(self._wait_mark, mark)

    async def start(
        self, direction: str, buffer: int, sources: list[int], targets: list[int]
    ) -> tuple[Any, int]:
        return await self._submit.run(self._queue, direction, buffer, sources, targets)

    def _queue(self, direction: str, buffer: int, sources: list[int], targets: list[int]) -> tuple[Any, int]:
        """On the submit thread: queue one chunk's copy (in slot order: `chunks`) on the
        direction's streams."""
        device_ids, slots = (sources, targets) if direction == TO_HOST else (targets, sources)
        n = len(slots)
        rows = self.staging[direction][buffer][:n]
        index_host = self.index_host[direction][buffer][:n]
        index_device = self.index_device[direction][buffer][:n]
        kernels, dma = self.streams[f"{direction}/kernels"], self.streams[f"{direction}/dma"]
        index_host.copy_(torch.as_tensor(device_ids, dtype=torch.long))  # idle buffer: host side
        copies = 1  # the index upload
        # Each stream waits for the other only where this chunk's bytes pass from one to the
        # other (`wait_stream`: an event recorded there now); buffers are used again only once
        # the host saw the chunk end, on the stream that finishes it.
        with torch.cuda.device(self.device):
            if direction == TO_HOST:
                with torch.cuda.stream(kernels):
                    index_device.copy_(index_host, non_blocking=True)
                    for part, offset, width in self.parts:
                        torch.index_select(part, 0, index_device, out=rows[:, offset : offset + width])
                with torch.cuda.stream(dma):
                    dma.wait_stream(kernels)
                    for start, first, count in slot_runs(slots):
                        self.host[first : first + count].copy_(rows[start : start + count], non_blocking=True)
                        copies += 1
                last = dma
            else:
                with torch.cuda.stream(dma):
                    for start, first, count in slot_runs(slots):
                        rows[start : start + count].copy_(self.host[first : first + count], non_blocking=True)
                        copies += 1
                with torch.cuda.stream(kernels):
                    index_device.copy_(index_host, non_blocking=True)
                    kernels.wait_stream(dma)
                    for part, offset, width in self.parts:
                        part.index_copy_(0, index_device, rows[:, offset : offset + width])
                last = kernels
            end = self.ends[direction][buffer]
            end.record(last)
        return end, copies

    def _record_ends(self, direction: str) -> list[Any]:
        """Events after all that the direction's streams hold (their waiter sleeps)."""
        ends = []
        with torch.cuda.device(self.device):
            for role in ("kernels", "dma"):
                ends.append(torch.cuda.Event(blocking=True))  # type: ignore[no-untyped-call]
                ends[-1].record(self.streams[f"{direction}/{role}"])
        return ends

    def finish(self, handle: Any) -> Awaitable[None]:
        return self._waiters.run(self._wait, handle)  # the buffer's own event: it stays

    async def drain(self, direction: str) -> None:
        # Through the submit thread: after whatever it had queued when `start` raised. The
        # waiter takes the events out of the list: their last references go there.
        ends = await self._submit.run(self._record_ends, direction)
        await self._waiters.run(self._wait_each, ends)

    def _wait(self, event: Any) -> None:
        with torch.cuda.device(self.device):
            event.synchronize()

    def _wait_mark(self, mark: Mark) -> None:
        mark.wait(self._wait)

    def _wait_each(self, events: list[Any]) -> None:
        while events:
            self._wait(events.pop())

    def close(self) -> None:
        """Once every copy queued has ended (the cache's calls have all returned); blocks, in
        driver calls: off the event loop (`CopyEngine.aclose`)."""
        self._submit.close()
        self._waiters.close()
        self._mark_waiters.close()
        self._release()

    def _release(self) -> None:
        """Wait until the copy streams are idle, free every tensor used on them, then destroy
        them and let go of the context, in that order.

        Freed last, a tensor would use a destroyed stream: PyTorch's caching host allocator
        notes each stream that a pinned block was copied on (`record_event`, called for every
        `non_blocking` copy of a `pin_memory=True` tensor) and, when the block is freed, records
        an event on each of them (`CachingHostAllocatorImpl::free`, ATen/core/
        CachingHostAllocator.h): the index buffers are such blocks. And the device caching
        allocator hands a freed block to the next allocation on the stream it was made on
        (the current one, not ours) at once: freed while a copy stream might still use it, a
        staging buffer could be written by two users.
        """
        # If a stream cannot be synchronized (a broken context), this raises here: everything
        # stays, leaked rather than freed or destroyed while in use.
        with torch.cuda.device(self.device):
            for stream in self.streams.values():
                stream.synchronize()
        self.staging, self.index_host, self.index_device, self.scratch = {}, {}, {}, {}
        self.ends = {}
        self._destroy_streams()

    def _destroy_streams(self) -> None:
        self.streams = {}
        try:
            while self._handles:
                self._driver.destroy(self._handles.popitem()[1])
        finally:
            self._driver.release()


class DriverStreams:
    """Copy streams made through the CUDA driver, so that no other code is ever handed them.

    `torch.cuda.Stream(device)` takes the next of a fixed pool of streams per device, in turn
    (torch/cuda/streams.py: a stream without `stream_ptr` or `stream_id` comes from the pool):
    once a process has asked for that many, our copy stream may be the model's own, and copies
    queue behind its kernels. And `torch.cuda.cudart()` offers only `cudaStreamCreate`, whose
    streams synchronize with the legacy default stream (where many models run). So: a
    non-blocking stream of the device's primary context (the one PyTorch's runtime calls use,
    retained here so that it outlives our streams), at the default priority, which is the
    lowest (a gather never preempts the model's kernels), wrapped by `torch.cuda.ExternalStream`,
    which leaves its life to us: destroyed at `close`. cuStreamDestroy returns at once and frees
    the stream once its queued work has ended.
    """

    NON_BLOCKING = 0x1  # CU_STREAM_NON_BLOCKING: no implicit sync with the legacy default stream

    def __init__(self, device: torch.device) -> None:
        self.lib = cuda_driver()
        self.device = ctypes.c_int()
        self._check(
            self.lib.cuDeviceGet(ctypes.byref(self.device), ctypes.c_int(device.index or 0)), "cuDeviceGet"
        )
        self.context = ctypes.c_void_p()
        self._check(
            self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), self.device),
            "cuDevicePrimaryCtxRetain",
        )
        self._retained = True

    def create(self) -> int:
        handle = ctypes.c_void_p()
        with self._current():
            self._check(
                self.lib.cuStreamCreate(ctypes.byref(handle), ctypes.c_uint(self.NON_BLOCKING)),
                "cuStreamCreate",
            )
        if not handle.value:
            raise RuntimeError("cuStreamCreate returned no stream")
        return handle.value

    def destroy(self, handle: int) -> None:
        with self._current():
            self._check(self.lib.cuStreamDestroy_v2(ctypes.c_void_p(handle)), "cuStreamDestroy")

    def release(self) -> None:
        if self._retained:
            self._retained = False
            self._check(self.lib.cuDevicePrimaryCtxRelease_v2(self.device), "cuDevicePrimaryCtxRelease")

    @contextlib.contextmanager
    def _current(self) -> Iterator[None]:
        """The primary context current on this thread for the call (the driver's streams belong
        to the current context; the thread's own, if any, is restored after)."""
        self._check(self.lib.cuCtxPushCurrent_v2(self.context), "cuCtxPushCurrent")
        try:
            yield
        except BaseException:
            # Popped, unchecked: the body's error is what the caller must see, not the pop's.
            self.lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
            raise
        self._check(self.lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p())), "cuCtxPopCurrent")

    @staticmethod
    def _check(result: int, call: str) -> None:
        if result != 0:
            raise RuntimeError(f"{call} failed: CUresult {result}")


def cuda_driver() -> Any:
    """The CUDA driver library (the one every CUDA process has loaded), through ctypes."""
    return ctypes.CDLL("libcuda.so.1")


def slot_ordered_chunks(
    direction: str, sources: list[int], targets: list[int], step: int, max_runs: int
) -> list[tuple[list[int], list[int]]]:
    """A call's pairs in slot order (neighbouring slots make one run, one copy, whatever order
    the caller listed them in; a call's copies may go in any order, as it returns only once
    all have ended), cut into chunks of at most `step` blocks and `max_runs` runs."""
    slots = targets if direction == TO_HOST else sources
    chunks: list[tuple[list[int], list[int]]] = []
    chunk: tuple[list[int], list[int]] = ([], [])
    runs, last = 0, None
    for i in sorted(range(len(slots)), key=slots.__getitem__):
        new_run = last is None or slots[i] != last + 1
        if chunk[0] and (len(chunk[0]) == step or (new_run and runs == max_runs)):
            chunks.append(chunk)
            chunk, runs, new_run = ([], []), 0, True
        runs += new_run
        chunk[0].append(sources[i])
        chunk[1].append(targets[i])
        last = slots[i]
    if chunk[0]:
        chunks.append(chunk)
    return chunks


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(position in `slots`, first slot, count) for each run of consecutive slot numbers."""
    return paired_runs(list(range(len(slots))), slots)  # positions always go up by one
