"""CopyEngine logic that does not need a GPU: runs, chunking, ordering, release on failure and
cancellation (the same code drives CUDA streams; here a stand-in for them, `GatedCopies`, lets
the test decide when each chunk's copy ends), marks, and the CPU copies themselves."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvtier_async as kt
from kvtier_async import copy_engine, copy_streams
from kvtier_async.copy_engine import CHUNKS_IN_FLIGHT, CopyEngine, paired_runs
from kvtier_async.copy_streams import slot_runs
from kvtier_async.integrations.bridge import LoopThread


def test_runs() -> None:
    assert slot_runs([4, 5, 6, 9, 1, 2]) == [(0, 4, 3), (3, 9, 1), (4, 1, 2)]
    assert paired_runs([10, 11, 12, 3], [0, 1, 5, 6]) == [(10, 0, 2), (12, 5, 1), (3, 6, 1)]
    assert slot_runs([]) == [] and paired_runs([], []) == []


def test_gpu_chunks_go_in_slot_order_with_a_cap_on_runs() -> None:
    """Issue 68, defect 4: a chunk's copies are one per run of neighbouring slots, so the pairs
    go in slot order (the caller's order costs one copy per block when it runs against the
    slots), and a chunk ends at `step` blocks or at `max_runs` runs (scattered small blocks
    would otherwise queue a launch per block per chunk)."""
    chunks = copy_streams.slot_ordered_chunks
    # Storing: targets are the slots. Listed backwards, still one run.
    assert chunks("to_host", [7, 8, 9], [12, 11, 10], 4, 2) == [([9, 8, 7], [10, 11, 12])]
    slots = [9, 1, 2, 3, 7, 5, 20, 21]  # runs [1-3], [5], [7], [9], [20-21] in slot order
    device = [90, 10, 20, 30, 70, 50, 200, 210]
    assert chunks("to_device", slots, device, 4, 2) == [
        ([1, 2, 3, 5], [10, 20, 30, 50]),  # four blocks (the step), two runs
        ([7, 9], [70, 90]),  # a third run would pass the cap
        ([20, 21], [200, 210]),
    ]
    assert chunks("to_device", slots, device, 3, 99) == [
        ([1, 2, 3], [10, 20, 30]),
        ([5, 7, 9], [50, 70, 90]),
        ([20, 21], [200, 210]),
    ]
    assert chunks("to_host", [], [], 4, 2) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float16])
async def test_scattered_copies_are_exact_for_any_dtype(dtype: torch.dtype) -> None:
    layers = [torch.randn(40, 3, 8).to(dtype) for _ in range(3)] + [torch.randn(40, 5).to(dtype)]
    nbytes = sum(layer[0].numel() * layer.element_size() for layer in layers)
    spec = kt.OffloadingSpec(block_nbytes=nbytes, num_cpu_blocks=16)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    engine = CopyEngine(layers, primary, threads=2)
    device_ids = [7, 3, 4, 5, 30, 0, 1, 39]
    slots = [15, 2, 3, 4, 9, 10, 11, 0]
    original = [layer.clone() for layer in layers]
    await engine.to_host(device_ids, slots)
    targets = [20, 21, 22, 23, 24, 25, 26, 27]
    await engine.to_device(slots, targets)
    for before, after in zip(original, layers):
        assert torch.equal(after[targets], before[device_ids])
        assert torch.equal(after[:20], before[:20])  # nothing else was touched
    engine.close()


@pytest.mark.asyncio
async def test_cpu_copies_stay_off_torchs_thread_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host-to-host copies run on the worker alone: `Tensor.copy_` would fan large copies out
    over torch's intra-op threads, which stalled the event loop (see copy_engine's docstring)."""
    layers = [torch.randint(0, 256, (8, 1 << 16), dtype=torch.uint8) for _ in range(2)]
    spec = kt.OffloadingSpec(block_nbytes=2 << 16, num_cpu_blocks=8)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    engine = CopyEngine(layers, primary, threads=1)
    original = [layer.clone() for layer in layers]

    def no_torch_copy(*args: object) -> None:
        raise AssertionError("Tensor.copy_ used for a host-to-host copy")

    monkeypatch.setattr(torch.Tensor, "copy_", no_torch_copy)
    await engine.to_host([0, 1, 5], [7, 2, 3])
    for layer in layers:
        layer.zero_()
    await engine.to_device([7, 2, 3], [0, 1, 5])
    monkeypatch.undo()
    for before, after in zip(original, layers):
        assert torch.equal(after[[0, 1, 5]], before[[0, 1, 5]])
    engine.close()


class GatedCopies:
    """A stand-in for `StreamCopies` (a unit test of the chunking logic): each chunk's copy
    ends when the test says so; `start` can be made to fail at a given chunk, before it queued
    anything or (`part_way`) after it queued part of the chunk."""

    mode = "threads"
    nbytes = 0
    chunks_in_flight = CHUNKS_IN_FLIGHT

    def __init__(self, fail_at: int | None = None, part_way: bool = False) -> None:
        self.fail_at = fail_at
        self.part_way = part_way
        self.started: list[tuple[str, int, list[int]]] = []
        self.ends: list[asyncio.Future[None]] = []
        self.running = 0
        self.most_running = 0
        #: (mark, its wait ends), per call of `wait_for`.
        self.marks: list[tuple[object, asyncio.Future[None]]] = []

    def chunks(self, direction: str, sources: list[int], targets: list[int], step: int):
        return [(sources[i : i + step], targets[i : i + step]) for i in range(0, len(sources), step)]

    async def wait_for(self, mark: object) -> None:
        done = asyncio.get_running_loop().create_future()
        self.marks.append((mark, done))
        await done

    async def start(self, direction: str, buffer: int, sources: list[int], targets: list[int]):
        if self.fail_at is not None and len(self.started) == self.fail_at:
            if self.part_way:  # what was queued before the failure runs on, like a stream's copies
                self.ends.append(asyncio.get_running_loop().create_future())
            raise RuntimeError("queueing failed")
        self.started.append((direction, buffer, sources))
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        end = asyncio.get_running_loop().create_future()
        self.ends.append(end)
        return end, len(sources)

    async def finish(self, handle: asyncio.Future[None]) -> None:
        try:
            await handle
        finally:
            self.running -= 1

    async def drain(self, direction: str) -> None:
        await asyncio.gather(*self.ends, return_exceptions=True)  # one stream: all queued so far

    def close(self) -> None:
        pass


def gated_engine(blocks: int, backend: GatedCopies) -> CopyEngine:
    layers = [torch.zeros(blocks, 4096, dtype=torch.uint8)]
    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=blocks)
    engine = CopyEngine(layers, kt.PrimaryTier(spec, pin_memory=False), threads=1)
    engine.staging_blocks = 2  # chunks of two blocks
    return with_backend(engine, backend)


def with_backend(engine: CopyEngine, backend: Any) -> CopyEngine:
    """`engine`, opened with `backend` (what `CopyEngine.open` would do with its own)."""
    engine._backend = backend
    engine._free = {d: asyncio.Queue() for d in ("to_host", "to_device")}
    for queue in engine._free.values():
        for buffer in range(backend.chunks_in_flight):
            queue.put_nowait(buffer)
    return engine


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_chunks_are_bounded_in_flight_and_wait_once_for_the_mark() -> None:
    backend = GatedCopies()
    engine = gated_engine(16, backend)
    mark = object()
    task = asyncio.ensure_future(engine.to_host(list(range(10)), list(range(10)), mark))
    await settle()
    assert [m for m, _ in backend.marks] == [mark] and backend.started == []  # nothing before it
    backend.marks[0][1].set_result(None)
    while not task.done():  # end the copies one at a time, oldest first
        await settle()
        pending = [end for end in backend.ends if not end.done()]
        if pending:
            pending[0].set_result(None)
    await task
    assert [s[2] for s in backend.started] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert backend.most_running <= CHUNKS_IN_FLIGHT
    assert len(backend.marks) == 1  # waited for once
    buffers = [s[1] for s in backend.started]
    assert all(a != b for a, b in itertools.pairwise(buffers))  # never the buffer just queued
    assert engine.stats()["chunks_to_host"] == 5


@pytest.mark.asyncio
async def test_a_call_waiting_for_its_mark_holds_nothing_other_calls_need() -> None:
    """Issue 68, defect 3: a store whose producer is slow must not hold the others' chunks. Its
    mark is waited for before it takes a buffer (so it holds none), and not by the copy stream
    (where every later chunk of every call would queue behind it): another call's chunks run
    meanwhile."""
    backend = GatedCopies()
    engine = gated_engine(16, backend)
    slow = asyncio.ensure_future(engine.to_host([0, 1, 2, 3], [0, 1, 2, 3], "slow producer"))
    await settle()
    assert engine._free["to_host"].qsize() == CHUNKS_IN_FLIGHT  # waiting, it holds no buffer
    other = asyncio.ensure_future(engine.to_host([4, 5, 6, 7, 8, 9], [4, 5, 6, 7, 8, 9]))
    while not other.done():
        await settle()
        for end in backend.ends:
            if not end.done():
                end.set_result(None)
    await other
    assert [s[2] for s in backend.started] == [[4, 5], [6, 7], [8, 9]] and not slow.done()
    backend.marks[0][1].set_result(None)  # the producer is done: now the slow call's chunks go
    while not slow.done():
        await settle()
        for end in backend.ends:
            if not end.done():
                end.set_result(None)
    await slow
    assert [s[2] for s in backend.started][3:] == [[0, 1], [2, 3]]


@pytest.mark.asyncio
async def test_a_failure_part_way_returns_only_after_the_queued_copies_ended() -> None:
    backend = GatedCopies(fail_at=1)
    engine = gated_engine(16, backend)
    task = asyncio.ensure_future(engine.to_device(list(range(6)), list(range(6))))
    await settle()
    assert len(backend.started) == 1 and not task.done()  # chunk 2 failed to queue; chunk 1 runs
    backend.ends[0].set_result(None)
    with pytest.raises(RuntimeError, match="queueing failed"):
        await task
    assert backend.running == 0
    assert engine._free["to_device"].qsize() == CHUNKS_IN_FLIGHT  # every buffer back, after its copy


@pytest.mark.asyncio
async def test_a_start_that_fails_part_way_frees_its_buffer_after_what_it_queued_ended() -> None:
    """`start` raised after queueing part of its chunk: that part still reads the device blocks
    and writes the buffer and the slots, so the call returns (and the buffer is free) only once
    it has ended."""
    backend = GatedCopies(fail_at=1, part_way=True)
    engine = gated_engine(16, backend)
    task = asyncio.ensure_future(engine.to_host(list(range(6)), list(range(6))))
    await settle()
    assert len(backend.ends) == 2  # chunk 1, and the part of chunk 2 queued before the failure
    backend.ends[0].set_result(None)
    await settle()
    assert not task.done()
    assert engine._free["to_host"].qsize() == CHUNKS_IN_FLIGHT - 1  # chunk 2's buffer is in use
    backend.ends[1].set_result(None)
    with pytest.raises(RuntimeError, match="queueing failed"):
        await task
    assert engine._free["to_host"].qsize() == CHUNKS_IN_FLIGHT


@pytest.mark.asyncio
async def test_copies_per_chunk_are_counted_over_every_chunk() -> None:
    backend = GatedCopies()  # one copy per block: chunks of 2, 2 and 1 copies
    engine = gated_engine(16, backend)
    task = asyncio.ensure_future(engine.to_host(list(range(5)), list(range(5))))
    while not task.done():
        await settle()
        for end in backend.ends:
            if not end.done():
                end.set_result(None)
    await task
    stats = engine.stats()
    assert stats["chunks_to_host"] == 3 and stats["memcpy_calls_to_host"] == 5
    assert stats["memcpy_calls_per_chunk"] == {"to_host": 5 / 3, "to_device": 0.0}
    assert stats["memcpy_calls_max_per_chunk"] == {"to_host": 2, "to_device": 0}


@pytest.mark.asyncio
async def test_a_cancelled_copy_returns_only_after_its_queued_chunks_ended() -> None:
    backend = GatedCopies()
    engine = gated_engine(16, backend)
    task = asyncio.ensure_future(engine.to_host(list(range(8)), list(range(8))))
    await settle()
    assert len(backend.started) == CHUNKS_IN_FLIGHT
    task.cancel()
    await settle()
    assert not task.done()  # the copies queued still read the device blocks
    for end in backend.ends:
        end.set_result(None)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backend.running == 0 and len(backend.started) == CHUNKS_IN_FLIGHT  # nothing more queued


@pytest.mark.asyncio
async def test_a_copy_that_fails_is_raised_after_the_others_ended() -> None:
    backend = GatedCopies()
    engine = gated_engine(16, backend)
    task = asyncio.ensure_future(engine.to_host(list(range(4)), list(range(4))))
    await settle()
    backend.ends[0].set_exception(RuntimeError("the device failed"))
    await settle()
    assert not task.done()
    backend.ends[1].set_result(None)
    with pytest.raises(RuntimeError, match="device failed"):
        await task


def test_marks_on_a_machine_without_cuda() -> None:
    layers = [torch.zeros(4, 4096, dtype=torch.uint8)]
    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=4)
    engine = CopyEngine(layers, kt.PrimaryTier(spec, pin_memory=False), threads=1)
    assert engine.mark(None, "after") is None
    with pytest.raises(kt.InvalidArgumentError, match="after takes a CUDA event or stream"):
        engine.mark(object(), "after")
    engine.close()


class StubStream:
    """Stands in for a `torch.cuda.Stream`: the thread whose current stream it is."""

    def __init__(self, thread: str) -> None:
        self.thread = thread


class StubEvent:
    """Stands in for a `torch.cuda.Event`: the stream it was recorded on, and whether a copy
    waited for it."""

    made: ClassVar[list[StubEvent]] = []

    def __init__(self, **kwargs: object) -> None:
        self.recorded_on: StubStream | None = None
        self.waited_under: object = None  # the device set on the thread that waited for it
        self.cuda_event = 0  # PyTorch makes the CUDA event at the first record
        StubEvent.made.append(self)

    def record(self, stream: StubStream) -> None:
        self.recorded_on = stream
        self.cuda_event = 0xE0

    def synchronize(self) -> None:
        self.waited_under = getattr(CURRENT, "device", "none set")


#: Per thread, the device a stubbed `torch.cuda.device(...)` has set.
CURRENT = threading.local()


@contextlib.contextmanager
def stub_device(device: object) -> Iterator[None]:
    before = getattr(CURRENT, "device", "none set")
    CURRENT.device = device
    try:
        yield
    finally:
        CURRENT.device = before


@pytest.fixture
def stub_cuda_marks(monkeypatch: pytest.MonkeyPatch) -> type[StubEvent]:
    """The part of `torch.cuda` that `CopyEngine.mark` uses, on a machine without CUDA: each
    thread's current stream is its own, so a test sees on which thread a mark was taken."""
    streams = threading.local()

    def current_stream(device: object = None) -> StubStream:
        if not hasattr(streams, "current"):
            streams.current = StubStream(threading.current_thread().name)
        return streams.current  # type: ignore[no-any-return]

    monkeypatch.setattr(torch.cuda, "Event", StubEvent)
    monkeypatch.setattr(torch.cuda, "Stream", StubStream)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "device", stub_device)
    StubEvent.made = []
    return StubEvent


def test_the_default_mark_is_taken_on_the_thread_that_calls(stub_cuda_marks: type[StubEvent]) -> None:
    """A model thread that hands `cache.store(...)` / `cache.load(...)` to the cache's loop with
    `run_coroutine_threadsafe` (what `integrations.bridge.LoopThread` does): the copies wait for
    the work queued on the model thread's current stream, not on the loop thread's."""
    layers = [torch.randint(0, 256, (8, 4096), dtype=torch.uint8)]
    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=8)
    keys = kt.block_hashes(range(16 * 4), 16, namespace=spec.namespace)
    cache = kt.TieredKVCache(spec, layers)
    # Its blocks stand in for those of a second device (host memory, not pinned: copies on
    # worker threads, which wait for the mark themselves).
    cache.copy_engine.device = torch.device("cuda", 1)
    bridge = LoopThread("kvtier-test-loop")
    try:
        bridge.call(opened(cache))
        model = threading.current_thread().name
        stored = asyncio.run_coroutine_threadsafe(cache.store(keys, [0, 1, 2, 3]), bridge.loop).result()
        loaded = asyncio.run_coroutine_threadsafe(cache.load(keys, [4, 5, 6, 7]), bridge.loop).result()
        assert stored == 4 and loaded == 4 and torch.equal(layers[0][4:8], layers[0][0:4])
        marks = stub_cuda_marks.made
        assert [mark.recorded_on.thread for mark in marks if mark.recorded_on] == [model, model]
        # Each copy waited for its mark, under the cache's device (not a new context on device 0).
        assert [mark.waited_under for mark in marks] == [torch.device("cuda", 1)] * 2
        bridge.call(cache.aclose())
    finally:
        bridge.stop()


async def opened(cache: kt.TieredKVCache) -> kt.TieredKVCache:
    await cache.__aenter__()
    return cache


def test_bad_arguments_raise_at_the_call(stub_cuda_marks: type[StubEvent]) -> None:
    """`store` / `load` check and mark at the call, before a coroutine exists: the caller's thread
    gets the error, and nothing was recorded or counted."""
    layers = [torch.zeros(8, 4096, dtype=torch.uint8)]
    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=8)
    cache = kt.TieredKVCache(spec, layers)
    cache.copy_engine.device = torch.device("cuda", 0)
    keys = kt.block_hashes(range(16 * 2), 16, namespace=spec.namespace)
    with pytest.raises(kt.InvalidArgumentError, match="after must be"):
        cache.store(keys, [0, 1], after="stream")
    with pytest.raises(kt.InvalidArgumentError, match="device_block_ids"):
        cache.load(keys, [0, 99])
    with pytest.raises(kt.InvalidArgumentError, match="timeout"):
        cache.load(keys, [0, 1], timeout=-1)
    assert stub_cuda_marks.made == [] and cache.stats()["load_calls"] == 0
    cache.copy_engine.close()


@pytest.mark.asyncio
async def test_cache_refuses_a_mark_before_any_change_and_reports_its_copies() -> None:
    layers = [torch.randint(0, 256, (8, 4096), dtype=torch.uint8)]
    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=8)
    keys = kt.block_hashes(range(16 * 4), 16, namespace=spec.namespace)
    async with kt.TieredKVCache(spec, layers) as cache:
        with pytest.raises(kt.InvalidArgumentError, match="after"):
            await cache.store(keys, [0, 1, 2, 3], after="stream")
        with pytest.raises(kt.InvalidArgumentError, match="consumer"):
            await cache.load(keys, [4, 5, 6, 7], consumer="stream")
        assert cache.stats()["stored_blocks"] == 0 and cache.stats()["load_calls"] == 0
        assert await cache.store(keys, [0, 1, 2, 3], after=None) == 4
        assert await cache.load(keys, [4, 5, 6, 7], consumer=None) == 4
        assert torch.equal(layers[0][4:8], layers[0][0:4])
        copies = cache.stats()["copies"]
        assert copies["mode"] == "threads" and copies["chunks_to_host"] >= 1
        assert copies["memcpy_calls_per_chunk"]["to_host"] >= 1


@pytest.mark.asyncio
async def test_a_cancelled_call_raises_its_cancellation_even_when_a_queued_copy_failed() -> None:
    backend = GatedCopies()
    engine = gated_engine(16, backend)
    task = asyncio.ensure_future(engine.to_host(list(range(6)), list(range(6))))
    await settle()
    assert len(backend.started) == CHUNKS_IN_FLIGHT  # the third chunk waits for a buffer
    task.cancel()
    await settle()
    backend.ends[0].set_exception(RuntimeError("the device failed"))
    backend.ends[1].set_result(None)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backend.running == 0


@pytest.mark.asyncio
async def test_a_cpu_store_zeroes_the_slot_padding_whatever_was_there() -> None:
    """A slot's bytes past `block_nbytes` reach a tier with the block (the fs tier writes whole
    strides): after a failed cold load left disk bytes there, the next store into that slot must
    not carry them out again."""
    layers = [torch.randint(0, 256, (6, width), dtype=torch.uint8) for width in (300, 604)]
    spec = kt.OffloadingSpec(block_nbytes=904, num_cpu_blocks=4)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    assert primary.stride > spec.block_nbytes  # there is padding to check
    primary.buffer.fill_(0xA5)  # what a failed load (or any earlier use) may leave in every slot
    engine = CopyEngine(layers, primary, threads=1)
    await engine.to_host([0, 1, 4], [2, 3, 0])
    for slot, device_id in zip([2, 3, 0], [0, 1, 4]):
        row = primary.buffer[slot]
        assert torch.equal(row[:300], layers[0][device_id]) and torch.equal(
            row[300:904], layers[1][device_id]
        )
        assert not row[904:].any(), f"slot {slot}: stale padding would be stored"
    assert (primary.buffer[1] == 0xA5).all()  # a slot no store touched keeps its bytes
    engine.close()


class FakeDriver:
    """Stands in for libcuda (`DriverStreams`): streams are numbers; it notes each call with the
    contexts current then, and which streams are alive."""

    CONTEXT = 0xC0

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, list[int]]] = []
        self.current: list[int] = []  # the calling thread's context stack
        self.alive: set[int] = set()
        self.retained = 0
        self.made = 0x1000
        #: Run at each cuStreamDestroy, before it: what a test checks still holds then.
        self.before_destroy: list[Callable[[], None]] = []

    def cuDeviceGet(self, out: Any, ordinal: Any) -> int:
        out._obj.value = ordinal.value
        return 0

    def cuDevicePrimaryCtxRetain(self, out: Any, device: Any) -> int:
        out._obj.value = self.CONTEXT
        self.retained += 1
        return 0

    def cuDevicePrimaryCtxRelease_v2(self, device: Any) -> int:
        self.retained -= 1
        return 0

    def cuCtxPushCurrent_v2(self, context: Any) -> int:
        self.current.append(context.value)
        return 0

    def cuCtxPopCurrent_v2(self, out: Any) -> int:
        out._obj.value = self.current.pop()
        return 0

    def cuStreamCreate(self, out: Any, flags: Any) -> int:
        self.made += 16
        out._obj.value = self.made
        self.alive.add(self.made)
        self.calls.append(("create", flags.value, list(self.current)))
        return 0

    def cuStreamDestroy_v2(self, stream: Any) -> int:
        for check in self.before_destroy:
            check()
        self.alive.discard(stream.value)
        self.calls.append(("destroy", stream.value, list(self.current)))
        return 0


class StandInCuda:
    """What `StreamCopies` uses of `torch.cuda` and the driver, on a machine without CUDA (CPU
    tensors, copies that end when they are made): notes, in order, on which thread each stream
    was entered (where the copies are launched), each event recorded and each mark waited for."""

    def __init__(self) -> None:
        self.driver = FakeDriver()
        self.log: list[tuple[str, str]] = []
        self.entered: list[int] = []  # the stream of each launch
        self.waits: list[tuple[int, int]] = []  # (stream, the stream it waited for)
        #: Per thread, the stream a stand-in `torch.cuda.stream(...)` made current (0: none).
        self.current = threading.local()

    def note(self, what: str) -> None:
        self.log.append((what, threading.current_thread().name))

    def threads(self, what: str) -> set[str]:
        return {thread.rsplit("_", 1)[0] for w, thread in self.log if w == what}


class StandInStream:
    def __init__(self, handle: int, device: object = None) -> None:
        self.handle = handle

    def synchronize(self) -> None:
        pass


@pytest.fixture
def stand_in_cuda(monkeypatch: pytest.MonkeyPatch) -> StandInCuda:
    cuda = StandInCuda()

    class Event:
        def __init__(self, **kwargs: object) -> None:
            self.blocking = kwargs.get("blocking", False)
            self.stream: int | None = None  # where it was last recorded
            cuda.note("make event")

        def record(self, stream: StandInStream) -> None:
            self.stream = stream.handle
            cuda.note("record")

        def synchronize(self) -> None:
            cuda.note("mark" if getattr(self, "is_mark", False) else "end")

        def __del__(self) -> None:
            cuda.note("drop event")

    @contextlib.contextmanager
    def stream(stream: StandInStream) -> Iterator[None]:
        cuda.note("launch")
        cuda.entered.append(stream.handle)
        cuda.current.stream = stream.handle
        try:
            yield
        finally:
            cuda.current.stream = 0

    monkeypatch.setattr(copy_streams, "cuda_driver", lambda: cuda.driver)

    class Stream(StandInStream):
        def wait_stream(self, other: StandInStream) -> None:
            cuda.waits.append((self.handle, other.handle))

        def synchronize(self) -> None:
            cuda.note(f"synchronize {self.handle}")

    monkeypatch.setattr(torch.cuda, "ExternalStream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: StandInStream(0))
    return cuda


@pytest.mark.asyncio
async def test_the_stream_path_copies_exactly_off_the_loop_on_streams_of_its_own(
    stand_in_cuda: StandInCuda,
) -> None:
    """`StreamCopies` (the GPU path) run on CPU tensors under a stand-in for CUDA: scattered blocks
    in many chunks (each buffer used again) byte-exact both ways, slot padding zeroed whatever
    was there, other blocks untouched, neighbouring slots one copy whatever their order; every
    copy launched on its submit thread, never the loop's; the mark waited for on a thread of its
    own before anything is queued; its two streams made by the driver (non-blocking, in the
    device's primary context), and destroyed, with the context released, at close."""
    layers = [torch.randint(0, 256, (24, width), dtype=torch.uint8) for width in (300, 604)]
    original = [layer.clone() for layer in layers]
    spec = kt.OffloadingSpec(block_nbytes=904, num_cpu_blocks=16)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    primary.buffer.fill_(0xA5)  # what earlier use (a failed load's disk bytes) left in the slots
    engine = CopyEngine(layers, primary, threads=1)
    engine.staging_blocks = 3  # 10 blocks: chunks of 3, 3, 3 and 1
    backend = copy_streams.StreamCopies(torch.device("cpu"), engine._parts, primary.buffer, 3)
    # Opening warmed the kernels on the copy streams (checked in the next test): the rest is
    # about the copies.
    stand_in_cuda.log.clear()
    stand_in_cuda.entered.clear()
    with_backend(engine, backend)
    streams = {name: stream.handle for name, stream in backend.streams.items()}
    device_ids = [7, 3, 4, 5, 20, 0, 1, 23, 12, 9]
    slots = [15, 2, 3, 4, 9, 10, 11, 0, 6, 5]
    mark = torch.cuda.Event(blocking=True)
    mark.is_mark = True  # type: ignore[attr-defined]
    loop_thread = threading.current_thread().name
    await engine.to_host(device_ids, slots, copy_engine.Mark(mark))
    # Per chunk: the gathers on the kernel stream, then the DMA stream waits for them (for them
    # only: nothing else orders the two) and copies to the host.
    kernels, dma = streams["to_host/kernels"], streams["to_host/dma"]
    assert stand_in_cuda.entered == [kernels, dma] * 4 and stand_in_cuda.waits == [(dma, kernels)] * 4
    stand_in_cuda.entered.clear()
    stand_in_cuda.waits.clear()
    for slot, device_id in zip(slots, device_ids):
        row = primary.buffer[slot]
        assert torch.equal(row[:300], layers[0][device_id]) and torch.equal(
            row[300:904], layers[1][device_id]
        )
        assert not row[904:].any(), f"slot {slot}: stale padding"
    assert (primary.buffer[1] == 0xA5).all()  # a slot not stored into is untouched
    for layer in layers:
        layer[12:].zero_()
    targets = [13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    await engine.to_device(slots, targets)
    # Mirrored: the DMA into staging, then the kernel stream waits for it and scatters.
    kernels, dma = streams["to_device/kernels"], streams["to_device/dma"]
    assert stand_in_cuda.entered == [dma, kernels] * 4 and stand_in_cuda.waits == [(kernels, dma)] * 4
    for before, after in zip(original, layers):
        assert torch.equal(after[targets], before[device_ids])
        assert torch.equal(after[:12], before[:12]) and not after[23].any()  # nothing else touched
    assert engine.stats()["chunks_to_host"] == 4
    # A chunk listed against slot order still makes one copy per run of neighbouring slots.
    before = engine.stats()["memcpy_calls_to_host"]
    await engine.to_host([0, 1, 2], [8, 7, 6])
    assert engine.stats()["memcpy_calls_to_host"] - before == 2  # the index upload and one run
    assert all(torch.equal(primary.buffer[8 - i][:300], layers[0][i]) for i in range(3))

    assert stand_in_cuda.threads("launch") == {"kvtier-cuda-submit"}, stand_in_cuda.log
    assert stand_in_cuda.threads("record") == {"kvtier-cuda-submit"}
    assert stand_in_cuda.threads("mark") == {"kvtier-cuda-mark"}
    queued = [what for what, _ in stand_in_cuda.log if what not in ("make event", "drop event")]
    assert queued[0] == "mark"  # before anything was queued
    assert loop_thread not in {thread for what, thread in stand_in_cuda.log if what != "make event"}
    driver = stand_in_cuda.driver
    made = [call for call in driver.calls if call[0] == "create"]
    assert made == [("create", 1, [FakeDriver.CONTEXT])] * 4  # non-blocking, in the primary context
    assert len(driver.alive) == 4 and set(streams.values()) == driver.alive
    engine.close()
    assert driver.alive == set() and driver.retained == 0 and driver.current == []


def test_opening_the_stream_path_warms_every_kernel_without_writing_a_device_block(
    stand_in_cuda: StandInCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 68, defect 5: the gather's variants (up to 16 indices, more) and the scatter are
    launched once when the cache opens, on the copy streams, so that no store or load loads a
    kernel module while the model runs; the scatter writes a scratch row, never the model's
    blocks (whose bytes do not change)."""
    layers = [torch.randint(0, 256, (40, width), dtype=torch.uint8) for width in (300, 604)]
    original = [layer.clone() for layer in layers]
    spec = kt.OffloadingSpec(block_nbytes=904, num_cpu_blocks=40)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    engine = CopyEngine(layers, primary, threads=1)
    gathers: list[int] = []
    scatters: list[bool] = []
    index_select, index_copy = torch.index_select, torch.Tensor.index_copy_

    def counted_select(part: torch.Tensor, dim: int, index: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        gathers.append(len(index))
        return index_select(part, dim, index, **kwargs)

    def counted_copy(self: torch.Tensor, *args: Any) -> torch.Tensor:
        scatters.append(any(self.data_ptr() == layer.data_ptr() for layer in layers))
        return index_copy(self, *args)

    monkeypatch.setattr(torch, "index_select", counted_select)
    monkeypatch.setattr(torch.Tensor, "index_copy_", counted_copy)
    backend = copy_streams.StreamCopies(torch.device("cpu"), engine._parts, primary.buffer, 24)
    assert sorted(gathers) == [1, 1, 16, 16, 24, 24]  # each count for each of the two parts
    assert scatters == [False, False]  # one per part, into scratch rows
    kernel_streams = {backend.streams[f"{d}/kernels"].handle for d in ("to_host", "to_device")}
    assert set(stand_in_cuda.entered) == kernel_streams  # the model's streams see none of it
    assert all(torch.equal(a, b) for a, b in zip(layers, original))
    assert not backend.staging["to_host"][0][:, 904:].any()  # staging padding still zero
    backend.close()
    engine.close()


def buffers_of(backend: Any) -> list[weakref.ref[torch.Tensor]]:
    """Weak references to every tensor `StreamCopies` uses on its copy streams."""
    return [
        weakref.ref(tensor)
        for name in ("staging", "index_host", "index_device", "scratch")
        for tensors in getattr(backend, name, {}).values()
        for tensor in tensors
    ]


def test_closing_the_stream_path_frees_its_buffers_before_it_destroys_their_streams(
    stand_in_cuda: StandInCuda,
) -> None:
    """Freeing a pinned index buffer records an event on every stream it was copied on (PyTorch's
    caching host allocator), and a freed staging buffer goes to the next allocation at once:
    at close the copy streams are synchronized, then every tensor used on them is freed, and
    only then are the streams destroyed."""
    layers = [torch.randint(0, 256, (8, 904), dtype=torch.uint8)]
    spec = kt.OffloadingSpec(block_nbytes=904, num_cpu_blocks=8)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    engine = CopyEngine(layers, primary, threads=1)
    backend = copy_streams.StreamCopies(torch.device("cpu"), engine._parts, primary.buffer, 3)
    with_backend(engine, backend)
    buffers = buffers_of(backend)
    assert len(buffers) >= 3 * 2 * copy_streams.GPU_CHUNKS_IN_FLIGHT
    driver = stand_in_cuda.driver
    alive_at_destroy: list[int] = []
    driver.before_destroy.append(lambda: alive_at_destroy.append(sum(b() is not None for b in buffers)))
    driver.before_destroy.append(lambda: stand_in_cuda.note("destroy"))
    stand_in_cuda.log.clear()
    engine.close()
    assert alive_at_destroy == [0] * 4
    events = [w.split()[0] for w, _ in stand_in_cuda.log if w.split()[0] in ("synchronize", "destroy")]
    assert events == ["synchronize"] * 4 + ["destroy"] * 4
    assert driver.alive == set() and driver.retained == 0


#: The aten ops that make a new tensor (what a caching allocator would serve).
FACTORIES = {"empty", "empty_strided", "empty_like", "zeros", "zeros_like", "ones", "full", "new_empty"}


class Allocations(TorchDispatchMode):
    """Each tensor made while active, with the stand-in stream current on its thread then."""

    def __init__(self, cuda: StandInCuda) -> None:
        super().__init__()
        self.cuda = cuda
        self.made: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ in FACTORIES:
            self.made.append((func.overloadpacket.__name__, getattr(self.cuda.current, "stream", 0)))
        return func(*args, **(kwargs or {}))


def test_the_stream_path_allocates_nothing_while_a_copy_stream_is_current(
    stand_in_cuda: StandInCuda,
) -> None:
    """The caching allocator ties a block (with expandable segments, its segment) to the stream
    current when it was allocated, and synchronizes that stream when it gives the segment back:
    a tensor allocated under a copy stream would, after close, synchronize a destroyed stream.
    Every tensor the engine uses (the warm-up's scratch rows too) is made on the current
    stream, before any copy stream is entered."""
    layers = [torch.randint(0, 256, (8, width), dtype=torch.uint8) for width in (300, 604)]
    spec = kt.OffloadingSpec(block_nbytes=904, num_cpu_blocks=8)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    engine = CopyEngine(layers, primary, threads=1)
    with Allocations(stand_in_cuda) as allocations:
        backend = copy_streams.StreamCopies(torch.device("cpu"), engine._parts, primary.buffer, 3)
    assert allocations.made and all(stream == 0 for _, stream in allocations.made), allocations.made
    backend.close()
    engine.close()


def test_a_stream_path_that_fails_to_open_frees_nothing_its_queued_work_may_still_use(
    stand_in_cuda: StandInCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening failed after the warm-up had queued gathers into the staging buffers: every copy
    stream made is synchronized before any buffer is freed or any stream destroyed, and the
    caller sees why opening failed."""
    layers = [torch.randint(0, 256, (8, 904), dtype=torch.uint8)]
    spec = kt.OffloadingSpec(block_nbytes=904, num_cpu_blocks=8)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    engine = CopyEngine(layers, primary, threads=1)
    buffers: list[weakref.ref[torch.Tensor]] = []

    warm = copy_streams.StreamCopies._warm

    def noted_warm(self: Any, staging_blocks: int) -> None:
        buffers.extend(buffers_of(self))  # to see when they are freed
        warm(self, staging_blocks)

    def failing_scatter(self: torch.Tensor, *args: Any) -> torch.Tensor:
        raise RuntimeError("the scatter's module failed to load")  # the gathers are queued

    monkeypatch.setattr(copy_streams.StreamCopies, "_warm", noted_warm)
    monkeypatch.setattr(torch.Tensor, "index_copy_", failing_scatter)
    driver = stand_in_cuda.driver
    alive_at_destroy: list[int] = []
    driver.before_destroy.append(lambda: alive_at_destroy.append(sum(b() is not None for b in buffers)))
    driver.before_destroy.append(lambda: stand_in_cuda.note("destroy"))
    stand_in_cuda.log.clear()
    with pytest.raises(RuntimeError, match="failed to load"):
        copy_streams.StreamCopies(torch.device("cpu"), engine._parts, primary.buffer, 3)
    assert buffers and alive_at_destroy == [0] * 4
    events = [w.split()[0] for w, _ in stand_in_cuda.log if w.split()[0] in ("synchronize", "destroy")]
    assert events == ["synchronize"] * 4 + ["destroy"] * 4
    assert driver.alive == set() and driver.retained == 0
    engine.close()


@pytest.mark.asyncio
async def test_the_stream_path_makes_and_destroys_no_cuda_object_on_the_loop(
    stand_in_cuda: StandInCuda,
) -> None:
    """Issue 68, CUDA review finding 6: a chunk's end is recorded in its staging buffer's own
    event, made at open, so calls make no events; the default marks' last references go on
    their waiter thread; closing (stream synchronizes, the events' and buffers' frees, the
    driver's stream destroys and context release) runs on a worker thread."""
    layers = [torch.randint(0, 256, (24, 904), dtype=torch.uint8)]
    spec = kt.OffloadingSpec(block_nbytes=904, num_cpu_blocks=16)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    engine = CopyEngine(layers, primary, threads=1)
    engine.staging_blocks = 3
    backend = copy_streams.StreamCopies(torch.device("cpu"), engine._parts, primary.buffer, 3)
    with_backend(engine, backend)
    made_at_open = [what for what, _ in stand_in_cuda.log].count("make event")
    assert made_at_open == 2 * copy_streams.GPU_CHUNKS_IN_FLIGHT
    driver = stand_in_cuda.driver
    driver.before_destroy.append(lambda: stand_in_cuda.note("destroy"))
    stand_in_cuda.log.clear()
    engine.device = torch.device("cuda", 0)  # `mark` makes an event, as on a GPU
    for _ in range(2):
        await engine.to_host(list(range(10)), list(range(10)), engine.mark(None, "after"))
        await engine.to_device(list(range(10)), list(range(12, 22)), engine.mark(None, "consumer"))
    made = [thread for what, thread in stand_in_cuda.log if what == "make event"]
    assert len(made) == 4  # the marks only (the caller's, on its thread): none per chunk
    ends = [event.stream for event in backend.ends["to_host"] + backend.ends["to_device"]]
    dma, kernels = backend.streams["to_host/dma"].handle, backend.streams["to_device/kernels"].handle
    assert ends == [dma] * 3 + [kernels] * 3  # each recorded where its chunk ends
    await engine.aclose()
    loop_thread = threading.current_thread().name
    on_the_loop = [what for what, thread in stand_in_cuda.log if thread == loop_thread]
    assert on_the_loop == ["make event", "record"] * 4, on_the_loop  # the four marks, nothing else
    dropped = [what for what, _ in stand_in_cuda.log if what == "drop event"]
    assert len(dropped) == 4 + 2 * copy_streams.GPU_CHUNKS_IN_FLIGHT  # the marks, then the ends
    assert [what for what, _ in stand_in_cuda.log].count("destroy") == 4
    assert driver.alive == set() and driver.retained == 0


@pytest.mark.asyncio
async def test_calls_with_slow_producers_hold_no_other_calls_wait_for_its_mark(
    stand_in_cuda: StandInCuda,
) -> None:
    """Issue 68, CUDA review finding 4: five calls whose producers have not finished (more than
    the mark waiters there used to be) do not hold a later call's wait for its own mark: mark
    waiters are started as calls need them, up to `MARK_WAITERS`."""
    layers = [torch.randint(0, 256, (16, 904), dtype=torch.uint8)]
    spec = kt.OffloadingSpec(block_nbytes=904, num_cpu_blocks=16)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    engine = CopyEngine(layers, primary, threads=1)
    backend = copy_streams.StreamCopies(torch.device("cpu"), engine._parts, primary.buffer, 3)
    with_backend(engine, backend)
    produced = threading.Event()

    class Producer:
        """A producer's event: its work ends when the test says so."""

        def synchronize(self) -> None:
            produced.wait()

    class Done:
        def synchronize(self) -> None:
            pass

    slow = [asyncio.ensure_future(engine.to_host([i], [i], copy_engine.Mark(Producer()))) for i in range(5)]
    fast = asyncio.ensure_future(engine.to_host([8], [8], copy_engine.Mark(Done())))
    # A guard against hanging, not a timing check: the fast call needs no slow one to end.
    finished, _ = await asyncio.wait({fast}, timeout=30)
    produced.set()
    await asyncio.gather(fast, *slow)
    assert fast in finished and not any(task in finished for task in slow)
    assert torch.equal(primary.buffer[8][:904], layers[0][8])
    assert 6 <= backend._mark_waiters.threads <= copy_engine.MARK_WAITERS
    await engine.aclose()


def test_a_driver_call_that_fails_is_the_error_seen_even_when_the_context_pop_fails_too(
    stand_in_cuda: StandInCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 68, CUDA review finding 7: the context pushed around a driver call is popped
    whatever happens, but a failed pop after a failed call must not hide why the call failed
    (a pop that fails after a call that worked is still raised)."""
    driver = stand_in_cuda.driver
    streams = copy_streams.DriverStreams(torch.device("cpu"))
    pop = driver.cuCtxPopCurrent_v2

    def failing_pop(out: Any) -> int:
        pop(out)
        return 201  # CUDA_ERROR_INVALID_CONTEXT

    monkeypatch.setattr(driver, "cuCtxPopCurrent_v2", failing_pop)
    monkeypatch.setattr(driver, "cuStreamCreate", lambda out, flags: 2)  # CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(RuntimeError, match="cuStreamCreate failed: CUresult 2"):
        streams.create()
    assert driver.current == []  # popped all the same
    monkeypatch.setattr(driver, "cuStreamDestroy_v2", lambda stream: 0)
    with pytest.raises(RuntimeError, match="cuCtxPopCurrent failed: CUresult 201"):
        streams.destroy(0x10)
    assert driver.current == []
    streams.release()
    assert driver.retained == 0


def test_an_event_never_recorded_is_refused_at_the_call(stub_cuda_marks: type[StubEvent]) -> None:
    """Issue 68, CUDA review finding 5: CUDA's wait for an event never recorded returns at once,
    so an `after=` / `consumer=` event not yet recorded would let the copy run before its
    producer: refused at the call, before any change; a recorded one is taken as it is."""
    layers = [torch.zeros(8, 4096, dtype=torch.uint8)]
    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=8)
    cache = kt.TieredKVCache(spec, layers)
    cache.copy_engine.device = torch.device("cuda", 0)
    keys = kt.block_hashes(range(16 * 2), 16, namespace=spec.namespace)
    event = torch.cuda.Event(blocking=True)
    with pytest.raises(kt.InvalidArgumentError, match="after: the event was never recorded"):
        cache.store(keys, [0, 1], after=event)
    with pytest.raises(kt.InvalidArgumentError, match="consumer: the event was never recorded"):
        cache.load(keys, [0, 1], consumer=event)
    assert cache.stats()["load_calls"] == 0
    event.record(torch.cuda.current_stream())
    mark = cache.copy_engine.mark(event, "after")
    waited: list[object] = []
    assert mark is not None
    mark.wait(waited.append)
    mark.wait(waited.append)  # seen done once: not waited for again
    assert waited == [event]
    cache.copy_engine.close()


@pytest.mark.asyncio
async def test_mark_waiters_refuse_calls_once_closed_and_serve_those_queued_before() -> None:
    waiters = copy_engine.MarkWaiters(2, "kvtier-test-mark")
    ran: list[int] = []
    await waiters.run(ran.append, 1)
    assert waiters.threads == 2  # the one that ran it left none idle: a second was started
    waiters.close()
    with pytest.raises(kt.ClosedError):
        await waiters.run(ran.append, 2)
    assert ran == [1]
