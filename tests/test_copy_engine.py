"""CopyEngine logic that does not need a GPU: runs, chunking, ordering, release on failure and
cancellation (the same code drives CUDA streams; here a stand-in for them, `GatedCopies`, lets
the test decide when each chunk's copy ends), marks, and the CPU copies themselves."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest
import torch

import kvtier_async as kt
from kvtier_async.copy_engine import CHUNKS_IN_FLIGHT, CopyEngine, _paired_runs, _slot_runs
from kvtier_async.integrations.bridge import LoopThread


def test_runs() -> None:
    assert _slot_runs([4, 5, 6, 9, 1, 2]) == [(0, 4, 3), (3, 9, 1), (4, 1, 2)]
    assert _paired_runs([10, 11, 12, 3], [0, 1, 5, 6]) == [(10, 0, 2), (12, 5, 1), (3, 6, 1)]
    assert _slot_runs([]) == [] and _paired_runs([], []) == []


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
    """A stand-in for `_StreamCopies` (a unit test of the chunking logic): each chunk's copy
    ends when the test says so; `start` can be made to fail at a given chunk, before it queued
    anything or (`part_way`) after it queued part of the chunk."""

    nbytes = 0

    def __init__(self, fail_at: int | None = None, part_way: bool = False) -> None:
        self.fail_at = fail_at
        self.part_way = part_way
        self.started: list[tuple[str, int, list[int], object]] = []
        self.ends: list[asyncio.Future[None]] = []
        self.running = 0
        self.most_running = 0

    async def start(self, direction: str, buffer: int, sources: list[int], targets: list[int], mark: object):
        if self.fail_at is not None and len(self.started) == self.fail_at:
            if self.part_way:  # what was queued before the failure runs on, like a stream's copies
                self.ends.append(asyncio.get_running_loop().create_future())
            raise RuntimeError("queueing failed")
        self.started.append((direction, buffer, sources, mark))
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
    engine._backend = backend
    engine._free = {d: asyncio.Queue() for d in ("to_host", "to_device")}
    for queue in engine._free.values():
        for buffer in range(CHUNKS_IN_FLIGHT):
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
    while not task.done():  # end the copies one at a time, oldest first
        await settle()
        pending = [end for end in backend.ends if not end.done()]
        if pending:
            pending[0].set_result(None)
    await task
    assert [s[2] for s in backend.started] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert backend.most_running <= CHUNKS_IN_FLIGHT
    assert [s[3] for s in backend.started] == [mark, None, None, None, None]  # waited for once
    buffers = [s[1] for s in backend.started]
    assert all(a != b for a, b in itertools.pairwise(buffers))  # never the buffer just queued
    assert engine.stats()["chunks_to_host"] == 5


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
        StubEvent.made.append(self)

    def record(self, stream: StubStream) -> None:
        self.recorded_on = stream

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
