"""`CopyEngine`: copies KV blocks between device memory and primary-tier slots.

The device KV is a list of tensors whose dim 0 is the device block id (one per
layer, or one for everything); the bytes of block `b` across them, in order,
make one `block_nbytes` primary slot. This is the one seam between device
memory and the host.

A call's blocks move in chunks of at most `staging_blocks`, at most `chunks_in_flight` of them
queued at once per direction (`_run_chunks`): a chunk's buffers are used again only once its
copy has finished, and a call returns, or raises (cancellation included), only once every
copy it queued has finished, so the caller may release its slots and device blocks at once.
What differs between a GPU and a CPU is behind one small interface (`wait_for` a call's mark,
`start` a chunk's copy, `finish` it, `drain` what a `start` that raised part-way had queued),
so that this logic is the same code, tested on CPU:

- CUDA (device tensors and a pinned primary tier), `copy_streams.StreamCopies`: each direction has two
  streams of its own, one for kernels and one for DMA, so that a chunk's DMA runs beside the
  next chunk's gather or scatter, made through the CUDA driver so that no other code is ever
  handed them (`copy_streams.DriverStreams`), and per chunk in flight a device staging buffer and an index
  buffer, all made once when the cache opens (`open`), under the cache's device, and counted
  in `stats()`; opening also launches every kernel the copies use once (`_warm`), so that none
  loads its module during a store or load. Device to host: one `index_select` per layer
  gathers the chunk's blocks into staging (bytes past `block_nbytes` of a staging row stay
  zero, so a slot's padding is zeros, never old device memory), then one `cudaMemcpyAsync` per
  run of neighbouring slots (a call's blocks go in slot order, at most `MAX_RUNS_PER_CHUNK`
  runs a chunk). Host to device mirrors it with `index_copy_`. Nothing is launched from the
  event loop: one submit thread queues every chunk (a launch blocks while the device's queue
  is full). What a call must wait for is an event recorded when it was called (`mark`): on the
  producer's stream for a store (`after=`, default: the calling thread's current stream), on
  the consumer's for a load (`consumer=`: the blocks' earlier readers). A mark waiter thread
  waits for it on the host before the call takes a buffer, so a slow producer holds that call
  only, never a copy stream (where it would hold every later chunk of every call); nothing
  else waits for the copy: the call returns after it completed. Completion is learned by a
  waiter thread blocking on the chunk's event (a blocking-sync event: it sleeps), then waking
  the loop; the loop thread never synchronizes. Nor does it make or destroy a CUDA object:
  a chunk's end goes in its staging buffer's own event, made at open and recorded again per
  chunk; a mark's event is let go of by its waiter (`Mark`); closing (`CopyEngine.aclose`)
  runs on a worker thread.
- Elsewhere (CPU tensors standing in for device memory, or an unpinned primary tier),
  `_ThreadCopies`: each chunk's copies run on a worker thread, which releases the GIL.
  CPU-to-CPU copies go through numpy, on the worker alone: torch would split each large copy
  over its intra-op OpenMP pool, a second team of busy threads per worker that nobody sized.
  On the 2-core test machine that doubled the event loop's worst stall while storing (six
  interleaved runs of `bench/loop_lag.py`: 14-23 ms with torch, 4-11 ms with numpy).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any, Protocol

import numpy
import torch

from .errors import ClosedError, InvalidArgumentError
from .primary import PrimaryTier
from .workers import WorkerThreads, wait_uncancellable

__all__ = [
    "CHUNKS_IN_FLIGHT",
    "STAGING_TARGET_BYTES",
    "CopyEngine",
    "as_layer_list",
    "block_widths",
]

#: Chunks of a direction queued at once on worker threads: one copying while the next is queued
#: (on a GPU: `copy_streams.GPU_CHUNKS_IN_FLIGHT`).
CHUNKS_IN_FLIGHT = 2
#: Bytes of one chunk (its device staging buffer): large enough that a copy's fixed costs
#: vanish, small enough that three per direction cost the engine little device memory.
STAGING_TARGET_BYTES = 16 << 20
#: Calls of a cache waiting for their marks at once, at most (each on a thread of its own,
#: started as calls need them; more wait in turn).
MARK_WAITERS = 64

TO_HOST = "to_host"
TO_DEVICE = "to_device"

#: A layer as [num_blocks, width] bytes, and its byte offset inside a slot.
Part = tuple[torch.Tensor, int, int]


class Mark:
    """What a call's copies wait for (`CopyEngine.mark`); a call may wait for it more than once
    (a load's hot and cold blocks), from any thread. The first wait that sees it done lets go
    of the event, on that (waiter) thread: an event `mark` made then has its last reference
    dropped there, so its `cudaEventDestroy` never runs on the event loop."""

    __slots__ = ("_event", "_lock")

    def __init__(self, event: Any) -> None:
        self._event = event
        self._lock = threading.Lock()

    def wait(self, synchronize: Callable[[Any], None]) -> None:
        """`synchronize(event)` unless a wait already saw it done (blocks: a worker thread's)."""
        with self._lock:  # a second waiter meanwhile waits for the first one's outcome
            if self._event is not None:
                synchronize(self._event)
                self._event = None


def as_layer_list(kv_caches: Any) -> list[torch.Tensor]:
    """Accept one tensor, a sequence of tensors, or a mapping of name -> tensor (in order)."""
    if isinstance(kv_caches, torch.Tensor):
        layers = [kv_caches]
    elif isinstance(kv_caches, Mapping):
        layers = list(kv_caches.values())
    elif isinstance(kv_caches, Sequence) and not isinstance(kv_caches, (str, bytes)):
        layers = list(kv_caches)
    else:
        raise InvalidArgumentError(
            f"kv_caches must be a tensor or a list of tensors, got {type(kv_caches).__name__}"
        )
    if not layers:
        raise InvalidArgumentError("kv_caches must hold at least one tensor")
    for i, layer in enumerate(layers):
        if not isinstance(layer, torch.Tensor):
            raise InvalidArgumentError(f"kv_caches[{i}] is a {type(layer).__name__}, not a tensor")
    return layers


def block_widths(layers: Sequence[torch.Tensor]) -> list[int]:
    """Bytes of one device block in each layer tensor, after checking the tensors agree.

    Every tensor needs the same dim 0 (the number of device blocks), the same
    device, and a contiguous layout.
    """
    num_blocks = layers[0].shape[0] if layers[0].dim() > 0 else 0
    if num_blocks == 0:
        raise InvalidArgumentError("kv_caches[0] holds no device blocks (dim 0 is 0)")
    widths = []
    for i, layer in enumerate(layers):
        if layer.dim() == 0 or layer.shape[0] != num_blocks:
            raise InvalidArgumentError(
                f"kv_caches[{i}] has shape {tuple(layer.shape)}; every tensor needs dim 0 "
                f"= number of device blocks ({num_blocks})"
            )
        if layer.device != layers[0].device:
            raise InvalidArgumentError(
                f"kv_caches[{i}] is on {layer.device}, kv_caches[0] on {layers[0].device}"
            )
        if not layer.is_contiguous():
            raise InvalidArgumentError(f"kv_caches[{i}] must be contiguous")
        widths.append(layer[0].numel() * layer.element_size())
    return widths


class CopyEngine:
    """Moves blocks between `layers` (dim 0 = device block id) and primary slots."""

    def __init__(self, layers: Sequence[torch.Tensor], primary: PrimaryTier, *, threads: int) -> None:
        widths = block_widths(layers)
        if sum(widths) != primary.block_nbytes:
            raise InvalidArgumentError(
                f"one device block is {sum(widths)} bytes across kv_caches "
                f"({len(layers)} tensors), but spec.block_nbytes is {primary.block_nbytes}"
            )
        num_blocks = layers[0].shape[0]
        self.num_device_blocks = num_blocks
        self.device = layers[0].device
        self._primary = primary
        self._parts: list[Part] = []
        offset = 0
        for layer, width in zip(layers, widths):
            self._parts.append((layer.view(num_blocks, -1).view(torch.uint8), offset, width))
            offset += width
        self.staging_blocks = max(1, STAGING_TARGET_BYTES // primary.stride)
        self._workers = WorkerThreads(threads, "kvtier-copy")
        self._backend: _Copies | None = None
        self._backend_closed = False
        self._free: dict[str, asyncio.Queue[int]] = {}
        self.counters: Counter[str] = Counter()
        #: The most memory copies one chunk took, per direction (the counters hold the totals).
        self._most_copies = {TO_HOST: 0, TO_DEVICE: 0}

    @property
    def uses_streams(self) -> bool:
        """Streams and events: when the device is a GPU and the host buffer is pinned (which it
        is once the primary tier is resident; until then, copies wait in worker threads)."""
        return self.device.type == "cuda" and self._primary.pinned

    async def open(self) -> None:
        """Make the copies' streams and buffers (a worker thread's work); the first copy does
        it otherwise. Call once the primary tier is resident."""
        if self._backend is not None:
            return
        if self.uses_streams:
            from .copy_streams import StreamCopies  # the CUDA driver's bindings: on a GPU only

            backend: _Copies = await self._workers.run(
                StreamCopies, self.device, self._parts, self._primary.buffer, self.staging_blocks
            )
        else:
            backend = _ThreadCopies(self.device, self._parts, self._primary, self._workers)
        if self._backend is not None:  # another call opened it meanwhile: ours goes
            await self._workers.run(backend.close)  # (its streams are the driver's: nothing
            return  # else would free them)
        self._backend = backend
        self._free = {d: asyncio.Queue() for d in (TO_HOST, TO_DEVICE)}
        for free in self._free.values():
            for buffer in range(backend.chunks_in_flight):
                free.put_nowait(buffer)

    # -- what a copy waits for -----------------------------------------------------------------
    def mark(self, on: Any, what: str) -> Mark | None:
        """At a call's entry, on the calling thread: what its copies must wait for.

        `on` is a `torch.cuda.Event` (used as it is), a `torch.cuda.Stream` (an event recorded
        on it now) or None (an event recorded now on the calling thread's current stream of
        the cache's device). With blocks in host memory there is nothing to wait for: None,
        and `on` must be None too. A thread waits for the mark (`_Copies.wait_for`): the
        events made here are blocking-sync, so it sleeps; an event the caller made is waited
        for as it was made (made with `blocking=True`, the thread sleeps too).

        A caller's event is waited for later, by that thread, and CUDA waits for an event's
        most recent record at the time of the wait, returning at once for one never recorded
        (`cudaEventSynchronize`; PyTorch's `CUDAEvent::synchronize` does not even call it
        before the first record). So it must be recorded before the call (checked: refused
        otherwise) and not recorded again until the call returns (documented: recorded again
        meanwhile, the copy may wait for the new record's work instead). Taking a snapshot
        instead (a stream of ours waiting for it, an event recorded after) would order every
        call's mark on that one stream, where a slow producer holds every later call.
        """
        if self.device.type != "cuda":
            if on is not None:
                raise InvalidArgumentError(
                    f"{what} takes a CUDA event or stream; this cache's blocks are in host memory"
                )
            return None
        if on is not None and not isinstance(on, (torch.cuda.Event, torch.cuda.Stream)):
            raise InvalidArgumentError(
                f"{what} must be a torch.cuda.Event, a torch.cuda.Stream or None, got {type(on).__name__}"
            )
        if isinstance(on, torch.cuda.Event):
            if not on.cuda_event:  # made at its first record
                raise InvalidArgumentError(f"{what}: the event was never recorded; record it before the call")
            return Mark(on)
        with torch.cuda.device(self.device):
            stream = on if on is not None else torch.cuda.current_stream(self.device)
            event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            event.record(stream)
        return Mark(event)

    # -- the copies ----------------------------------------------------------------------------
    async def to_host(self, device_ids: Sequence[int], slots: Sequence[int], after: Any = None) -> None:
        """Copy device blocks into primary slots once what `after` marks (`mark`) is done; the
        device blocks may be reused on return."""
        await self._run_chunks(TO_HOST, list(device_ids), list(slots), after)

    async def to_device(self, slots: Sequence[int], device_ids: Sequence[int], consumer: Any = None) -> None:
        """Copy primary slots into device blocks once what `consumer` marks (`mark`) is done;
        they are valid on return, for work queued afterwards on any stream."""
        await self._run_chunks(TO_DEVICE, list(slots), list(device_ids), consumer)

    async def _run_chunks(self, direction: str, sources: list[int], targets: list[int], mark: Any) -> None:
        """Queue the copy chunk by chunk, at most `chunks_in_flight` at once; return (or raise)
        only once every copy queued has finished, and give a chunk's buffers back only then."""
        if not sources:
            return
        await self.open()
        backend, free = self._backend, self._free[direction]
        if backend is None:
            raise RuntimeError("copy engine: not opened")
        if mark is not None:
            # Before taking a buffer, on the host: a call whose producer is slow holds nothing
            # the other calls' chunks need, neither a buffer nor a place in a stream's order.
            await backend.wait_for(mark)
        finishing: list[asyncio.Future[None]] = []
        try:
            for chunk_sources, chunk_targets in backend.chunks(
                direction, sources, targets, self.staging_blocks
            ):
                buffer = await free.get()
                try:
                    handle, copies = await backend.start(direction, buffer, chunk_sources, chunk_targets)
                except BaseException:
                    # It may have queued part of the chunk before it raised: the buffer, and
                    # the caller's slots and device blocks, are free only once that has ended.
                    drained = asyncio.ensure_future(backend.drain(direction))
                    drained.add_done_callback(partial(_give_back, free, buffer))
                    finishing.append(drained)
                    raise
                self._most_copies[direction] = max(self._most_copies[direction], copies)
                self.counters[f"{direction}_chunks"] += 1
                self.counters[f"{direction}_memcpy_calls"] += copies
                done = asyncio.ensure_future(backend.finish(handle))
                done.add_done_callback(partial(_give_back, free, buffer))
                finishing.append(done)
        except BaseException:
            # Cancelled, or queueing failed: every queued copy ends first; what stopped us is
            # what the caller sees.
            await _all_ended(finishing)
            raise
        failed = [o for o in await _all_ended(finishing) if isinstance(o, BaseException)]
        if failed:
            raise failed[0]

    def stats(self) -> dict[str, Any]:
        """The staging memory, and per direction the chunks copied and the memory copies
        (`cudaMemcpyAsync` calls on a GPU; strided copies on worker threads elsewhere) they
        took: in all, on average per chunk (total / chunks, 0 before any chunk) and at most
        in one chunk."""
        backend = self._backend
        chunks = {d: self.counters[f"{d}_chunks"] for d in (TO_HOST, TO_DEVICE)}
        copies = {d: self.counters[f"{d}_memcpy_calls"] for d in (TO_HOST, TO_DEVICE)}
        return {
            "mode": backend.mode if backend is not None else "threads",
            "staging_bytes": backend.nbytes if backend is not None else 0,
            "staging_blocks": self.staging_blocks,
            "chunks_to_host": chunks[TO_HOST],
            "chunks_to_device": chunks[TO_DEVICE],
            "memcpy_calls_to_host": copies[TO_HOST],
            "memcpy_calls_to_device": copies[TO_DEVICE],
            "memcpy_calls_per_chunk": {d: copies[d] / chunks[d] if chunks[d] else 0.0 for d in chunks},
            "memcpy_calls_max_per_chunk": dict(self._most_copies),
        }

    async def aclose(self) -> None:
        """`close`, with the backend's closing (on a GPU: driver calls, the frees of events and
        buffers) on a worker thread, not the event loop's."""
        if self._backend is not None and not self._backend_closed:
            self._backend_closed = True
            await self._workers.run(self._backend.close)
        self.close()

    def close(self) -> None:
        """Off the event loop where it has streams (`aclose`): it waits until they are idle."""
        self._workers.close()
        if self._backend is not None and not self._backend_closed:
            self._backend_closed = True
            self._backend.close()


class _Copies(Protocol):
    """What differs between a GPU and a CPU: waiting for a call's mark, queueing one chunk's
    copy, and learning it ended."""

    mode: str  # "streams" or "threads", in `stats()`
    nbytes: int
    chunks_in_flight: int

    def chunks(
        self, direction: str, sources: list[int], targets: list[int], step: int
    ) -> list[tuple[list[int], list[int]]]:
        """A call's (sources, targets) split into chunks of at most `step` blocks."""

    async def wait_for(self, mark: Any) -> None:
        """Wait, off the event loop, until the work a mark (`CopyEngine.mark`) stands for is done."""

    async def start(
        self, direction: str, buffer: int, sources: list[int], targets: list[int]
    ) -> tuple[Any, int]:
        """Queue one chunk's copy through `buffer` (idle: its last copy finished); (a handle for
        `finish`, the number of memory copies it took)."""

    def finish(self, handle: Any) -> Awaitable[None]:
        """Wait for a queued chunk's copy to end (raising its error)."""

    async def drain(self, direction: str) -> None:
        """Wait until every copy queued so far in `direction` has ended: after a `start` that
        raised, what it had queued before it did."""

    def close(self) -> None: ...


class MarkWaiters:
    """Threads that wait for calls' marks, one call each, so that a call whose producer is slow
    holds no other call's wait: a waiter that takes a call and leaves no thread idle starts
    another, up to `most` (past that, calls wait in turn). Threads are started off the event
    loop (`Thread.start` waits for the new thread to run): the first from the default
    executor, the others by a waiter. A waiter sleeps in `cudaEventSynchronize` where the
    event is blocking-sync (`CopyEngine.mark` makes its own so; a caller's `after=` /
    `consumer=` event should be made with `blocking=True` too: CUDA busy-waits on any
    other, a CPU core spinning per call waiting)."""

    def __init__(self, most: int, name: str) -> None:
        self.most = most
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Future[None], Callable[[], None]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.threads = 0
        self._idle = 0
        self._closed = False

    async def run(self, fn: Callable[..., None], *args: Any) -> None:
        """`fn(*args)` on a waiter thread; returns (or raises) once it has finished."""
        if self.threads == 0 and not self._closed:
            await asyncio.get_running_loop().run_in_executor(None, self._first)
        future: Future[None] = Future()
        with self._lock:  # queued before `close`'s stops (then served), or refused
            if self._closed:
                raise ClosedError(f"{self.name} threads are closed")
            self._jobs.put((future, partial(fn, *args)))
        await wait_uncancellable(asyncio.wrap_future(future))

    def _first(self) -> None:
        with self._lock:
            name = self._reserve() if self.threads == 0 and not self._closed else None
        self._start(name)

    def _reserve(self) -> str:  # under the lock: a thread counted (idle) before it starts
        self.threads += 1
        self._idle += 1
        return f"{self.name}_{self.threads - 1}"

    def _start(self, name: str | None) -> None:
        # Outside the lock, which the loop takes: `start` waits until the thread runs.
        if name is not None:
            threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self._idle -= 1
                grow = self._idle == 0 and self.threads < self.most and not self._closed
                name = self._reserve() if grow else None
            self._start(name)  # the next call does not wait behind this one
            future, fn = job
            if future.set_running_or_notify_cancel():
                try:
                    fn()
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(None)
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        """Let the threads exit once the calls queued are done; never blocks."""
        with self._lock:
            self._closed = True
            for _ in range(self.threads):
                self._jobs.put(None)


class _ThreadCopies:
    """Chunks copied by worker threads (numpy for host to host, torch otherwise)."""

    mode = "threads"
    nbytes = 0
    chunks_in_flight = CHUNKS_IN_FLIGHT

    def __init__(
        self, device: torch.device, parts: list[Part], primary: PrimaryTier, workers: WorkerThreads
    ) -> None:
        self.device = device
        self.parts = parts
        self.primary = primary
        self.workers = workers
        # The same parts as numpy arrays, made once, where the layers are in host memory too.
        self.numpy_parts = (
            [(part.detach().numpy(), offset, width) for part, offset, width in parts]
            if parts[0][0].device.type == "cpu"
            else None
        )
        # Not the copy threads: a call whose producer is slow would hold one while others'
        # copies wait. Started only if a mark ever comes (device blocks, host memory unpinned).
        self.mark_waiters = MarkWaiters(MARK_WAITERS, "kvtier-copy-mark")

    def chunks(
        self, direction: str, sources: list[int], targets: list[int], step: int
    ) -> list[tuple[list[int], list[int]]]:
        # In the caller's order: runs here pair device ids and slots (`paired_runs`).
        return [(sources[i : i + step], targets[i : i + step]) for i in range(0, len(sources), step)]

    async def wait_for(self, mark: Any) -> None:
        """Device blocks, host memory not pinned: their producer's (or readers') work ends first."""
        await self.mark_waiters.run(self._wait, mark)

    def _wait(self, mark: Mark) -> None:
        # Under the cache's device: waiting from a thread with none set would make this process
        # a context on the current device (0) on the way.
        with torch.cuda.device(self.device):
            mark.wait(_synchronize)

    async def start(
        self, direction: str, buffer: int, sources: list[int], targets: list[int]
    ) -> tuple[Any, int]:
        device_ids, slots = (sources, targets) if direction == TO_HOST else (targets, sources)
        runs = paired_runs(device_ids, slots)
        future = await self.workers.submit(self._copy, direction, runs)
        return future, len(runs) * len(self.parts)

    def finish(self, handle: Future[None]) -> Awaitable[None]:
        return asyncio.wrap_future(handle)

    async def drain(self, direction: str) -> None:
        """Nothing to wait for: `start` hands its chunk to a worker as its last step, so one
        that raised handed nothing over."""

    def _copy(self, direction: str, runs: list[tuple[int, int, int]]) -> None:
        host, parts, copy = self._host_side()
        block_nbytes = self.primary.block_nbytes
        for device_first, slot_first, count in runs:
            rows = host[slot_first : slot_first + count]
            for part, offset, width in parts:
                device = part[device_first : device_first + count]
                if direction == TO_HOST:
                    copy(rows[:, offset : offset + width], device)
                else:
                    copy(device, rows[:, offset : offset + width])
            if direction == TO_HOST:
                # The parts fill a slot's first block_nbytes only, and tiers may write whole
                # strides: padding left from the slot's last use (a failed load's disk bytes)
                # must not go out with this block. The CUDA path's zeroed staging rows do this.
                rows[:, block_nbytes:] = 0

    def _host_side(self) -> tuple[Any, list[tuple[Any, int, int]], Callable[[Any, Any], Any]]:
        """(primary buffer, layer parts, copy(into, source)): numpy arrays and `numpy.copyto`,
        single-threaded with the GIL released, where the layers are in host memory; tensors
        and `Tensor.copy_` otherwise."""
        if self.numpy_parts is not None:
            return self.primary.buffer.numpy(), self.numpy_parts, numpy.copyto
        return self.primary.buffer, self.parts, torch.Tensor.copy_

    def close(self) -> None:
        self.mark_waiters.close()


def _synchronize(event: Any) -> None:
    event.synchronize()


async def _all_ended(finishing: list[asyncio.Future[None]]) -> list[Any]:
    """Wait for every queued copy to end, even if cancelled meanwhile (then re-raise that);
    each one's outcome."""
    if not finishing:
        return []
    return await wait_uncancellable(asyncio.gather(*finishing, return_exceptions=True))


def _give_back(free: asyncio.Queue[int], buffer: int, _: object) -> None:
    """A chunk's copy has ended: its buffers are free for the next chunk."""
    free.put_nowait(buffer)


def paired_runs(device_ids: list[int], slots: list[int]) -> list[tuple[int, int, int]]:
    """(first device id, first slot, count) for runs where both go up by one: a serving
    engine's blocks are often neighbours, and so are freshly allocated slots, so
    whole runs move with one strided copy per layer instead of one per block."""
    runs: list[tuple[int, int, int]] = []
    for device_id, slot in zip(device_ids, slots):
        if runs and runs[-1][0] + runs[-1][2] == device_id and runs[-1][1] + runs[-1][2] == slot:
            first_device, first_slot, count = runs[-1]
            runs[-1] = (first_device, first_slot, count + 1)
        else:
            runs.append((device_id, slot, 1))
    return runs
