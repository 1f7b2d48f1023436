"""The GPU acceptance script: the CUDA path checked end to end on one device, a line per check.

    python bench/gpu_check.py            # on a CUDA machine: every check, < 5 minutes on one H100
    python bench/gpu_check.py --small    # anywhere: CPU tensors stand in where they can

From a clone, with the README's install or with only the package's dependencies installed: the
script imports the `kvtier_async` of the checkout it sits in, not an installed one.

Each check prints one line and what it measured: PASS (what it asserts held), FAIL (it did not),
SKIP (not run: no CUDA device) or INFO (measured, nothing asserted: throughput without CUDA,
whose goal is a GPU's). The exit status is 1 if any check failed.

Checks:

1. setup: the primary buffer is pinned (the library's flag and CUDA's `is_pinned()`) and the
   stream path is in use; its four copy streams are none of 40 streams made first nor the
   current stream (a pooled stream would be); two caches opened and closed in turn in one
   process; this process has a context on the cache's device only (`nvidia-smi`), the cache
   being on the last device where there are several.
2. round trips: bf16 [N,2,16,8,128], fp8 MLA-like [N,16,576], fp16, and an int8 layer whose
   block is not a multiple of 4096 bytes; random bytes, random device ids, host slots
   fragmented by forced evictions; through the primary tier and through a cold fs tier;
   compared as uint8; blocks not targeted keep a sentinel; slot padding on disk is zeros.
3. producer ordering: a side stream sleeps ~200 ms, then writes the blocks; `store(...,
   after=that_stream)` at once stores the new bytes; the loop's lag stays under 10 ms.
3b. orderings: calls of four chunks each (every staging buffer used again) behind ~200 ms of
   GPU work, with `after=Stream`, `after=Event`, the default from a model thread submitting
   with `run_coroutine_threadsafe`, and `consumer=` (a queued reader still sees the old
   bytes); byte-exact; no device allocation in any call once open; two memory copies per
   chunk of neighbouring slots.
4. no sync on the loop: `torch.cuda.set_sync_debug_mode("error")` around store and load, and
   every `Event.synchronize` / `Stream.synchronize` / `torch.cuda.synchronize` noted if made on
   the loop's thread (sync-debug mode never sees `cudaEventSynchronize`); a 0.5 s sleep on an
   unrelated stream does not delay them.
4b. close and free: a cache stored into and loaded from, closed and dropped; then
   `gc.collect()`, `torch.cuda.synchronize()` and `torch.cuda.empty_cache()` raise nothing and
   the device memory allocated is back to what it was before the cache (its buffers are freed
   before its streams are destroyed); run again in a child process with
   `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, where a block allocated under a copy
   stream would make `empty_cache` synchronize a destroyed stream.
5. overlap, measured: CUDA events around each chunk's copy, anchored to `perf_counter`,
   intersected with the I/O intervals of a tier throttled to the copy's speed; each side a
   union of intervals, so the figure cannot exceed 100%.
6. throughput against raw: contiguous copies of 2 GiB to and from pinned memory (best of 3,
   after a warm-up) beside `cache.store` (new keys each time, no secondary tier) and
   `cache.load` (primary hits) of every block, scattered device ids: goals >= 0.7x at 2 MiB
   blocks and >= 0.5x at 64 KiB, asserted on a GPU only; the event loop's CPU time per GB
   reported (busy polling would show there).

Until a device has run it, the CUDA path is verified by review and CPU tests only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's kvtier_async

import torch
from common import run

import kvtier_async as kt
from kvtier_async import copy_streams
from kvtier_async.tiers.memory import MemoryTier

RESULTS: list[tuple[str, str, str]] = []


def report(name: str, status: str, detail: str) -> None:
    RESULTS.append((name, status, detail))
    print(f"{status:4} {name}: {detail}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_bytes(tensor: torch.Tensor) -> None:
    """Fill any tensor with random bytes (through a uint8 view: every dtype, fp8 included)."""
    flat = tensor.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, device=flat.device))


def as_bytes(layers: Sequence[torch.Tensor], ids: Sequence[int]) -> list[torch.Tensor]:
    """The blocks `ids` of each layer as uint8 rows, on the host (any dtype, fp8 included)."""
    index = torch.tensor(list(ids), device=layers[0].device)
    return [
        layer.reshape(layer.shape[0], -1).view(torch.uint8).index_select(0, index).cpu() for layer in layers
    ]


def layer_sets(device: torch.device, blocks: int) -> dict[str, list[torch.Tensor]]:
    fp8 = getattr(torch, "float8_e4m3fn", torch.uint8)
    return {
        "bf16 [N,2,16,8,128]": [torch.empty((blocks, 2, 16, 8, 128), dtype=torch.bfloat16, device=device)],
        "fp8 MLA [N,16,576]": [torch.empty((blocks, 16, 576), dtype=fp8, device=device) for _ in range(2)],
        "fp16 x3": [torch.empty((blocks, 4, 1024), dtype=torch.float16, device=device) for _ in range(3)],
        "int8 (block % 4096 != 0)": [torch.empty((blocks, 3 * 4096 + 136), dtype=torch.int8, device=device)],
    }


class LagProbe:
    """The event loop's lag while a block of code runs: a 1 ms ticker's worst delay."""

    async def __aenter__(self) -> LagProbe:
        self.worst = 0.0
        self._task = asyncio.ensure_future(self._tick())
        await asyncio.sleep(0)
        return self

    async def _tick(self) -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(0.001)
            self.worst = max(self.worst, time.perf_counter() - started - 0.001)

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def nvidia_smi(query: str) -> str:
    return subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=True
    ).stdout


def gpu_processes() -> dict[str, set[int]] | None:
    """GPU index -> pids with a context there (nvidia-smi), or None where it cannot tell."""
    try:
        gpus = nvidia_smi("--query-gpu=index,uuid")
        apps = nvidia_smi("--query-compute-apps=gpu_uuid,pid")
    except (OSError, subprocess.SubprocessError):
        return None
    index_of = {
        uuid.strip(): index.strip() for index, uuid in (line.split(",") for line in gpus.splitlines() if line)
    }
    found: dict[str, set[int]] = {index: set() for index in index_of.values()}
    for line in apps.splitlines():
        if line.strip():
            uuid, pid = (part.strip() for part in line.split(","))
            found.setdefault(index_of.get(uuid, uuid), set()).add(int(pid))
    return found


# -- 1. setup -----------------------------------------------------------------------------------
async def check_setup(device: torch.device) -> None:
    if device.type != "cuda":
        report("setup", "SKIP", "no CUDA device")
        return
    spec = kt.OffloadingSpec(block_nbytes=4 * 65536, num_cpu_blocks=64, namespace="gpu-check-setup")
    layers = [torch.zeros((32, 65536), dtype=torch.uint8, device=device) for _ in range(4)]
    # More streams than PyTorch's pool holds per device, made first: a copy stream taken from
    # the pool would be one of these (and so possibly the model's).
    others = {torch.cuda.Stream(device).cuda_stream for _ in range(40)}
    others.add(torch.cuda.current_stream(device).cuda_stream)
    modes, shared = [], []
    for _ in range(2):  # two caches in turn: the second must register its buffer afresh
        async with kt.TieredKVCache(spec, layers) as cache:
            keys = kt.block_hashes(range(16 * 8), 16, namespace=spec.namespace)
            await cache.store(keys, list(range(8)))
            # The library's `pinned` flag, and what CUDA itself says of the buffer.
            pinned = cache.primary.pinned and cache.primary.buffer.is_pinned()
            modes.append((pinned, cache.stats()["copies"]["mode"]))
            backend = cache.copy_engine._backend
            streams = {stream.cuda_stream for stream in getattr(backend, "streams", {}).values()}
            shared.append(len(streams) != 4 or bool(streams & others))
    procs = gpu_processes()
    pid = os.getpid()
    elsewhere = sorted(i for i, pids in (procs or {}).items() if pid in pids and i != str(device.index))
    ok = all(pinned and mode == "streams" for pinned, mode in modes) and not elsewhere and not any(shared)
    report(
        "setup",
        "PASS" if ok else "FAIL",
        f"pinned (is_pinned)/mode per cache {modes}; copy streams shared with 40 made before or "
        f"the current one: {shared}; contexts on other devices: {elsewhere or 'none'}"
        + ("" if procs is not None else " (nvidia-smi unavailable: not checked)"),
    )


# -- 2. round trips -----------------------------------------------------------------------------
async def check_round_trips(device: torch.device, work: Path, small: bool) -> None:
    blocks = 96 if small else 512
    failures = []
    for n, (name, layers) in enumerate(layer_sets(device, blocks).items()):
        for layer in layers:
            random_bytes(layer)
        block_nbytes = sum(layer[0].numel() * layer.element_size() for layer in layers)
        slots = blocks // 2
        root = work / f"fs-{n}"
        spec = kt.OffloadingSpec(
            block_nbytes=block_nbytes,
            num_cpu_blocks=slots,
            namespace=f"gpu-check-{block_nbytes}",
            secondary_tiers=[{"type": "fs", "root": str(root)}],
        )
        rng = random.Random(block_nbytes)
        ids = rng.sample(range(blocks // 2), 24)  # sources: the first half of the device blocks
        targets = rng.sample(range(blocks // 2, blocks), 24)  # the second half, scattered
        keys = kt.block_hashes(range(16 * 24), 16, namespace=spec.namespace)
        filler = kt.block_hashes(range(10**6, 10**6 + 16 * slots), 16, namespace=spec.namespace)
        expected = as_bytes(layers, ids)
        async with kt.TieredKVCache(spec, layers) as cache:
            # Fragment the host slots: fill them, then store ours among the evictions.
            for start in range(0, slots, 7):
                part = list(range(start, min(start + 7, slots)))
                await cache.store(
                    filler[start : start + len(part)], rng.sample(range(blocks // 2), len(part))
                )
            await cache.flush()
            stored = await cache.store(keys, ids)
            await cache.flush()
            for layer in layers:
                layer[blocks // 2 :].view(torch.uint8).fill_(0xA5)  # the sentinel
            others = [t for t in range(blocks // 2, blocks) if t not in targets]
            sentinel = as_bytes(layers, others)
            loaded = await cache.load(keys, targets)
            got = as_bytes(layers, targets)
            exact = stored == loaded == 24 and all(torch.equal(a, b) for a, b in zip(got, expected))
            kept = all(torch.equal(a, b) for a, b in zip(sentinel, as_bytes(layers, others)))
        for layer in layers:
            layer[blocks // 2 :].view(torch.uint8).fill_(0xA5)
        async with kt.TieredKVCache(spec, layers) as cold:  # a new primary tier: from the disk
            cold_loaded = await cold.load(keys, targets)
            cold_exact = cold_loaded == 24 and all(
                torch.equal(a, b) for a, b in zip(as_bytes(layers, targets), expected)
            )
        padding_zero = padding_is_zero(root, block_nbytes)
        if not (exact and kept and cold_exact and padding_zero):
            failures.append(
                f"{name}: primary {exact}, sentinel {kept}, cold fs {cold_exact}, padding {padding_zero}"
            )
        shutil.rmtree(root, ignore_errors=True)
    report(
        "round trips",
        "FAIL" if failures else "PASS",
        "; ".join(failures)
        or f"4 layouts byte-exact through the primary tier and a cold fs tier ({device.type})",
    )


def padding_is_zero(root: Path, block_nbytes: int) -> bool:
    record = -(-block_nbytes // 4096) * 4096
    for data in root.glob("kvtier-*/slab-*.kvs"):
        raw = data.read_bytes()
        for start in range(0, len(raw) - record + 1, record):
            if any(raw[start + block_nbytes : start + record]):
                return False
    return True


# -- 3. producer ordering -----------------------------------------------------------------------
async def check_producer_ordering(device: torch.device) -> None:
    if device.type != "cuda":
        report("producer ordering", "SKIP", "no CUDA device")
        return
    layers = [torch.zeros((64, 1 << 20), dtype=torch.uint8, device=device)]
    spec = kt.OffloadingSpec(block_nbytes=1 << 20, num_cpu_blocks=64, namespace="gpu-check-order")
    keys = kt.block_hashes(range(16 * 32), 16, namespace=spec.namespace)
    side = torch.cuda.Stream(device)
    async with kt.TieredKVCache(spec, layers) as cache:
        await cache.store(kt.block_hashes(range(10**6, 10**6 + 16), 16, namespace=spec.namespace), [63])
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(200e-3 * clock_hz(device)))  # ~200 ms of GPU time
            layers[0][:32].fill_(7)  # the new KV, written after the sleep
        async with LagProbe() as lag:
            stored = await cache.store(keys, list(range(32)), after=side)
        layers[0][:32].zero_()
        loaded = await cache.load(keys, list(range(32, 64)))
        sync(device)
        ok = stored == 32 and loaded == 32 and bool((layers[0][32:64] == 7).all())
    report(
        "producer ordering",
        "PASS" if ok and lag.worst < 0.010 else "FAIL",
        f"stored bytes are the producer's: {ok}; loop lag max {lag.worst * 1e3:.2f} ms (bar 10 ms)",
    )


def clock_hz(device: torch.device) -> float:
    rate = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0)  # kHz, where given
    return rate * 1e3 if rate else 1.5e9


# -- 3b. every ordering, many chunks ------------------------------------------------------------
def allocations(device: torch.device) -> int:
    """Device allocations asked of PyTorch's caching allocator so far (cached ones included)."""
    return int(torch.cuda.memory_stats(device).get("allocation.all.allocated", 0))


async def check_orderings(device: torch.device) -> None:
    """Calls of four chunks each (more than are in flight: every staging buffer used again),
    each queued at once behind ~200 ms of GPU work: `after=Stream`, `after=Event`, the default
    from a model thread submitting with `run_coroutine_threadsafe` (its current stream is the
    producer's; the loop thread's has nothing queued), and `consumer=` (the load must not
    overwrite blocks a consumer stream has yet to read). Byte-exact, no device allocation in
    any call once open, two memory copies per chunk of neighbouring slots."""
    if device.type != "cuda":
        report("orderings", "SKIP", "no CUDA device")
        return
    block, n = 1 << 20, 64
    layers = [torch.zeros((256, block), dtype=torch.uint8, device=device)]
    spec = kt.OffloadingSpec(block_nbytes=block, num_cpu_blocks=256, namespace="gpu-check-orderings")
    keys = [
        kt.block_hashes(range(r * 16 * n, (r + 1) * 16 * n), 16, namespace=spec.namespace) for r in range(3)
    ]
    sources, targets = list(range(n)), list(range(128, 128 + n))
    side, consumer = torch.cuda.Stream(device), torch.cuda.Stream(device)
    loop = asyncio.get_running_loop()
    allocated = [0]

    def produce(value: int) -> None:
        """On `side`: ~200 ms of GPU time, then the blocks' new bytes."""
        with torch.cuda.device(device), torch.cuda.stream(side):
            torch.cuda._sleep(int(0.2 * clock_hz(device)))
            layers[0].index_fill_(0, torch.tensor(sources, device=device), value)

    async def counted(call: Awaitable[int]) -> int:
        before = allocations(device)
        try:
            return await call
        finally:
            allocated[0] += allocations(device) - before

    def from_model_thread() -> int:
        with torch.cuda.device(device), torch.cuda.stream(side):  # this thread's current stream
            produce(3)
            future = asyncio.run_coroutine_threadsafe(counted(cache.store(keys[2], sources)), loop)
        return future.result()

    async with kt.TieredKVCache(spec, layers) as cache:
        outcomes = {}
        produce(1)
        outcomes["after=Stream"] = await counted(cache.store(keys[0], sources, after=side))
        produce(2)
        produced = torch.cuda.Event(blocking=True)  # its waiter sleeps (see `mark`)
        produced.record(side)
        outcomes["after=Event"] = await counted(cache.store(keys[1], sources, after=produced))
        outcomes["default, model thread"] = await asyncio.to_thread(from_model_thread)
        exact = {}
        for value, (name, stored) in enumerate(outcomes.items(), start=1):
            layers[0][128 : 128 + n].zero_()
            loaded = await counted(cache.load(keys[value - 1], targets))
            sync(device)
            exact[name] = stored == loaded == n and bool((layers[0][128 : 128 + n] == value).all())
        # consumer=: a reader of the target blocks queued behind ~200 ms on its own stream.
        layers[0][128 : 128 + n].fill_(0xEE)
        reader = torch.empty((n, block), dtype=torch.uint8, device=device)
        sync(device)
        with torch.cuda.stream(consumer):
            torch.cuda._sleep(int(0.2 * clock_hz(device)))
            reader.copy_(layers[0][128 : 128 + n])
        loaded = await counted(cache.load(keys[0], targets, consumer=consumer))
        sync(device)
        exact["consumer="] = loaded == n and bool((layers[0][128 : 128 + n] == 1).all())
        not_overtaken = bool((reader == 0xEE).all())
        copies = cache.stats()["copies"]
    per_chunk = copies["memcpy_calls_max_per_chunk"]
    ok = (
        all(exact.values())
        and not_overtaken
        and allocated[0] == 0
        and per_chunk == {"to_host": 2, "to_device": 2}
    )
    report(
        "orderings",
        "PASS" if ok else "FAIL",
        f"byte-exact over {n // copies['staging_blocks']} chunks a call: {exact}; the consumer read "
        f"the old bytes: {not_overtaken}; device allocations in the calls: {allocated[0]} (goal 0); "
        f"memory copies per chunk at most {per_chunk} (goal 2: the index, one run)",
    )


# -- 4. no sync on the loop ---------------------------------------------------------------------
@contextlib.contextmanager
def syncs_on_this_thread() -> Iterator[list[str]]:
    """Every host wait for the device made on the calling thread (the event loop's) while active:
    `torch.cuda.Event.synchronize`, `torch.cuda.Stream.synchronize` (the copy streams'
    `ExternalStream` too) and `torch.cuda.synchronize`, by name. Sync-debug mode cannot see the
    first: PyTorch's `CUDAEvent::synchronize` calls `cudaEventSynchronize` without
    `warn_or_error_on_sync` (c10/cuda/CUDAEvent.h), which only stream and device synchronizes
    and synchronizing copies call (c10/cuda/CUDAFunctions.h)."""
    thread = threading.get_ident()
    seen: list[str] = []

    def noted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == thread:
                seen.append(name)
            return original(*args, **kwargs)

        return call

    patched = [
        (torch.cuda.Event, "synchronize"),
        (torch.cuda.Stream, "synchronize"),
        (torch.cuda, "synchronize"),
    ]
    originals = [getattr(owner, attr) for owner, attr in patched]
    for (owner, attr), original in zip(patched, originals):
        name = f"{getattr(owner, '__name__', 'torch.cuda').rsplit('.', 1)[-1]}.{attr}"
        setattr(owner, attr, noted(name, original))
    try:
        yield seen
    finally:
        for (owner, attr), original in zip(patched, originals):
            setattr(owner, attr, original)


async def check_no_sync(device: torch.device) -> None:
    if device.type != "cuda":
        report("no sync on the loop", "SKIP", "no CUDA device")
        return
    layers = [torch.randint(0, 256, (64, 1 << 20), dtype=torch.uint8, device=device)]
    spec = kt.OffloadingSpec(block_nbytes=1 << 20, num_cpu_blocks=64, namespace="gpu-check-sync")
    keys = kt.block_hashes(range(16 * 32), 16, namespace=spec.namespace)
    unrelated = torch.cuda.Stream(device)
    async with kt.TieredKVCache(spec, layers) as cache:
        await cache.load(keys[:1], [40])  # opened, streams made
        sync(device)
        with torch.cuda.stream(unrelated):
            torch.cuda._sleep(int(0.5 * clock_hz(device)))
        error = None
        started = time.perf_counter()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with syncs_on_this_thread() as on_the_loop:
                stored = await cache.store(keys, list(range(32)))
                loaded = await cache.load(keys, list(range(32, 64)))
        except RuntimeError as exc:
            error = exc
        finally:
            torch.cuda.set_sync_debug_mode("default")
        took = time.perf_counter() - started
        sync(device)
        exact = error is None and bool(torch.equal(layers[0][32:64], layers[0][:32]))
    ok = error is None and not on_the_loop and stored == 32 and loaded == 32 and exact and took < 0.4
    report(
        "no sync on the loop",
        "PASS" if ok else "FAIL",
        f"store+load {took * 1e3:.1f} ms beside a 500 ms sleep on another stream; exact {exact}; "
        f"host waits on the loop's thread: {on_the_loop or 'none'}"
        + (f"; sync error: {error}" if error else ""),
    )


# -- 4b. close and free -------------------------------------------------------------------------
async def close_and_free(device: torch.device) -> tuple[bool, str]:
    """A cache used, closed and dropped; then collected, synchronized and emptied: (ok, what)."""
    layers = [torch.randint(0, 256, (16, 1 << 16), dtype=torch.uint8, device=device)]
    spec = kt.OffloadingSpec(block_nbytes=1 << 16, num_cpu_blocks=16, namespace="gpu-check-close")
    keys = kt.block_hashes(range(16 * 8), 16, namespace=spec.namespace)
    sync(device)
    before = torch.cuda.memory_allocated(device)
    cache = kt.TieredKVCache(spec, layers)
    async with cache:
        stored = await cache.store(keys, list(range(8)))
        loaded = await cache.load(keys, list(range(8, 16)))
    exact = stored == loaded == 8 and bool(torch.equal(layers[0][8:16], layers[0][:8]))
    del cache
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    after = torch.cuda.memory_allocated(device)
    ok = exact and after == before
    return ok, f"exact {exact}; device memory allocated {before} before the cache, {after} after"


async def check_close_and_free(device: torch.device) -> None:
    if device.type != "cuda":
        report("close and free", "SKIP", "no CUDA device")
        return
    ok, what = await close_and_free(device)
    # Again where the caching allocator maps expandable segments per stream: set before CUDA
    # starts, so in a child process.
    child = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, __file__, "--close-and-free-only"],
        env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    child_ok = child.returncode == 0
    tail = (child.stdout + child.stderr).strip().splitlines()[-1:] or ["no output"]
    report(
        "close and free",
        "PASS" if ok and child_ok else "FAIL",
        f"{what}; with expandable_segments:True: exit {child.returncode} ({tail[0]})",
    )


# -- 5. overlap ---------------------------------------------------------------------------------
class ThrottledTier(MemoryTier):
    """A memory tier as slow as `rate` bytes/s, noting when each write ran."""

    rate: ClassVar[float] = 1e9
    intervals: ClassVar[list[tuple[float, float]]] = []

    async def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        started = time.perf_counter()
        await asyncio.sleep(sum(len(b) for b in blocks) / self.rate)
        result = await super().write_blocks(keys, blocks)
        ThrottledTier.intervals.append((started, time.perf_counter()))
        return result


async def check_overlap(device: torch.device) -> None:
    if device.type != "cuda":
        report("overlap", "SKIP", "no CUDA device")
        return
    block, blocks = 2 << 20, 256  # 512 MiB
    layers = [torch.randint(0, 256, (blocks, block // 4), dtype=torch.uint8, device=device) for _ in range(4)]
    copy_intervals: list[tuple[Any, Any]] = []
    original_queue = copy_streams.StreamCopies._queue

    def timed_queue(self: Any, direction: str, *args: Any) -> tuple[Any, int]:
        # On the engine's submit thread, before the chunk's first stream (the gather's, storing)
        # and after its last (the DMA's): the chunk's copies lie between.
        first, last = (f"{direction}/kernels", f"{direction}/dma")[:: 1 if direction == "to_host" else -1]
        begin = torch.cuda.Event(enable_timing=True)
        begin.record(self.streams[first])
        done, copies = original_queue(self, direction, *args)
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.streams[last])
        copy_intervals.append((begin, end))
        return done, copies

    copy_streams.StreamCopies._queue = timed_queue  # type: ignore[method-assign]
    try:
        # The tier as fast as the device-to-host copy: measured first, copy only.
        spec = kt.OffloadingSpec(block_nbytes=block, num_cpu_blocks=blocks, namespace="gpu-check-overlap")
        async with kt.TieredKVCache(spec, layers) as cache:
            keys = kt.block_hashes(range(16 * blocks), 16, namespace=spec.namespace)
            started = time.perf_counter()
            await cache.store(keys, list(range(blocks)))
            copy_s = time.perf_counter() - started
        ThrottledTier.rate = blocks * block / copy_s
        ThrottledTier.intervals = []
        copy_intervals.clear()
        tiers = [{"type": "ThrottledTier", "module_path": __name__}]
        spec = kt.OffloadingSpec(
            block_nbytes=block, num_cpu_blocks=blocks, namespace="gpu-check-overlap2", secondary_tiers=tiers
        )
        async with kt.TieredKVCache(spec, layers) as cache:
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record(torch.cuda.current_stream(device))
            anchor.synchronize()
            anchor_time = time.perf_counter()
            keys = kt.block_hashes(range(16 * blocks), 16, namespace=spec.namespace)
            started = time.perf_counter()
            await cache.store(keys, list(range(blocks)))
            await cache.flush()
            wall = time.perf_counter() - started
            sync(device)
        gpu = [
            (anchor_time + anchor.elapsed_time(b) / 1e3, anchor_time + anchor.elapsed_time(e) / 1e3)
            for b, e in copy_intervals
        ]
    finally:
        copy_streams.StreamCopies._queue = original_queue  # type: ignore[method-assign]
    copying, writing, both = overlap(gpu, ThrottledTier.intervals)
    fraction = both / max(1e-9, min(copying, writing))
    ratio = wall / max(copying, writing)
    report(
        "overlap",
        "PASS" if fraction >= 0.5 else "FAIL",
        f"copies {copying * 1e3:.0f} ms, tier writes {writing * 1e3:.0f} ms, at once {both * 1e3:.0f} ms "
        f"({fraction:.0%} of the shorter); store+flush {ratio:.2f}x the longer (no overlap ~2x)",
    )


def union(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The same time as disjoint intervals, in order: concurrent writes count once."""
    merged: list[tuple[float, float]] = []
    for begin, end in sorted(intervals):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((begin, end))
    return merged


def overlap(
    copies: Sequence[tuple[float, float]], writes: Sequence[tuple[float, float]]
) -> tuple[float, float, float]:
    """(time copying, time writing, time doing both): each the length of a union of intervals,
    so `both` is at most the shorter of the other two (an overlap figure up to 100%)."""
    a, b = union(copies), union(writes)
    both = sum(max(0.0, min(e1, e2) - max(b1, b2)) for b1, e1 in a for b2, e2 in b)
    return sum(e - b for b, e in a), sum(e - b for b, e in b), both


# -- 6. throughput against raw ------------------------------------------------------------------
async def check_throughput(device: torch.device, small: bool) -> None:
    total = (64 << 20) if small else (2 << 30)
    lines, ok = [], True
    for block, goal in ((2 << 20, 0.7), (64 << 10, 0.5)):
        blocks = total // block
        spec = kt.OffloadingSpec(block_nbytes=block, num_cpu_blocks=blocks, namespace=f"gpu-check-{block}")
        layers = [
            torch.randint(0, 256, (2 * blocks, block // 2), dtype=torch.uint8, device=device)
            for _ in range(2)
        ]
        rng = random.Random(block)
        ids = rng.sample(range(2 * blocks), blocks)
        # New keys per store (each evicts the last round's blocks), made before any timing.
        rounds = [
            kt.block_hashes(range(r * 16 * blocks, (r + 1) * 16 * blocks), 16, namespace=spec.namespace)
            for r in range(4)
        ]
        raw_d2h, raw_h2d = raw_copies(device, total)
        async with kt.TieredKVCache(spec, layers) as cache:
            # Through the cache's pipelines, as a caller sees them, not the copy engine alone.
            store_s, store_cpu = await best_of(3, device, partial(whole_call, cache.store, rounds, ids))
            load_s, load_cpu = await best_of(3, device, partial(whole_call, cache.load, rounds[-1:], ids))
        store_ratio, load_ratio = raw_d2h / store_s, raw_h2d / load_s
        line = (
            f"{block >> 10} KiB: store {total / store_s / 1e9:.1f} GB/s ({store_ratio:.2f}x raw "
            f"{total / raw_d2h / 1e9:.1f}), load {total / load_s / 1e9:.1f} GB/s ({load_ratio:.2f}x raw "
            f"{total / raw_h2d / 1e9:.1f}); the loop's CPU time per GB: store "
            f"{store_cpu / total * 1e12:.0f} ms, load {load_cpu / total * 1e12:.0f} ms (goal >= {goal}x)"
        )
        lines.append(line)
        ok = ok and store_ratio >= goal and load_ratio >= goal
    if device.type != "cuda":  # host-to-host copies against a host memcpy: no goal to meet
        report("throughput", "INFO", "; ".join(lines) + " (CPU tensors: not asserted)")
        return
    report("throughput", "PASS" if ok else "FAIL", "; ".join(lines))


async def whole_call(call: Callable[..., Awaitable[int]], rounds: list[list[bytes]], ids: list[int]) -> None:
    """`cache.store` or `cache.load` of every block, with the next round's keys; each must
    move every block (a store evicts the last round's blocks, a load finds them all)."""
    keys = rounds.pop(0) if len(rounds) > 1 else rounds[0]
    moved = await call(keys, ids)
    if moved != len(ids):
        raise RuntimeError(f"{call.__name__} moved {moved} of {len(ids)} blocks")


def raw_copies(device: torch.device, nbytes: int) -> tuple[float, float]:
    """Best of 3 contiguous copies each way between the device and pinned host memory."""
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = {}
    for name, (dst, src) in {"d2h": (host, dev), "h2d": (dev, host)}.items():
        dst.copy_(src, non_blocking=True)  # warm-up
        sync(device)
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync(device)
            best = min(best, time.perf_counter() - started)
        times[name] = best
    return times["d2h"], times["h2d"]


async def best_of(n: int, device: torch.device, call: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    """The best of `n` runs after a warm-up: (seconds, CPU seconds of the event loop's thread)."""
    await call()  # warm-up
    sync(device)
    best = (float("inf"), 0.0)
    for _ in range(n):
        started, cpu = time.perf_counter(), time.thread_time()
        await call()
        took = time.perf_counter() - started, time.thread_time() - cpu
        best = min(best, took)
    return best


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="reduced sizes; CPU tensors without CUDA")
    parser.add_argument("--close-and-free-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.close_and_free_only:  # check 4b's child process
        device = torch.device("cuda", torch.cuda.device_count() - 1)
        torch.cuda.set_device(device)
        ok, what = await close_and_free(device)
        print(what)
        sys.exit(0 if ok else 1)
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.device_count() - 1)  # not GPU 0 where there are several
        torch.cuda.set_device(device)
        print(f"device: {torch.cuda.get_device_name(device)} ({device}), torch {torch.__version__}")
    else:
        device = torch.device("cpu")
        print("device: none (CPU tensors stand in; CUDA-only checks are skipped)")
    with tempfile.TemporaryDirectory(prefix="kvtier-gpu-check-") as work:
        checks: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("setup", lambda: check_setup(device)),
            ("round trips", lambda: check_round_trips(device, Path(work), args.small)),
            ("producer ordering", lambda: check_producer_ordering(device)),
            ("orderings", lambda: check_orderings(device)),
            ("no sync on the loop", lambda: check_no_sync(device)),
            ("close and free", lambda: check_close_and_free(device)),
            ("overlap", lambda: check_overlap(device)),
            ("throughput", lambda: check_throughput(device, args.small)),
        ]
        for name, check in checks:
            try:
                await check()
            except Exception as exc:  # one broken check does not hide the others
                report(name, "FAIL", f"raised {type(exc).__name__}: {exc}")
    statuses = [status for _, status, _ in RESULTS]
    print(
        f"{statuses.count('PASS')} passed, {statuses.count('FAIL')} failed, "
        f"{statuses.count('SKIP')} skipped, {statuses.count('INFO')} measured only"
    )
    sys.exit(1 if "FAIL" in statuses else 0)


if __name__ == "__main__":
    run(main)
