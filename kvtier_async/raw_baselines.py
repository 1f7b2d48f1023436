"""The raw baselines of `kvtier bench`: the same bytes in the same requests at the same
concurrency as a tier, with the plainest code for its backend (see `benchmark`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .measure import LoopLag, drop_page_cache, rates, timed_requests
from .primary import reserve_host_memory
from .spec import OffloadingSpec

__all__ = ["baseline"]


async def baseline(
    config: dict[str, Any], block_nbytes: int, blocks: int, request_blocks: int, work: Path
) -> Any:
    spec = OffloadingSpec(block_nbytes=block_nbytes, num_cpu_blocks=blocks)
    limits = spec.limits
    groups = [list(range(i, min(i + request_blocks, blocks))) for i in range(0, blocks, request_blocks)]
    kind = config["type"]
    if kind not in ("fs", "memory", "redis", "s3", "mooncake"):
        return None
    # Each block its own random bytes, in the same kind of memory as a primary tier's, as the
    # tier sends them: not one block sent again and again, whose bytes stay in the CPU's cache.
    remote = ("redis", "s3", "mooncake")
    values = await asyncio.to_thread(_random_blocks, block_nbytes, blocks) if kind in remote else []
    with LoopLag() as lag:  # the same ticker as the tier's: what the raw client costs the loop
        if kind == "fs":
            what, store_s, store_lat, load_s, load_lat = await _raw_files(work, spec, groups, lag)
        elif kind == "memory":
            what, store_s, store_lat, load_s, load_lat = await _raw_memory(spec, groups, lag)
        elif kind == "redis":
            what, store_s, store_lat, load_s, load_lat = await _raw_redis(config, values, groups, limits, lag)
        elif kind == "s3":
            what, store_s, store_lat, load_s, load_lat = await _raw_s3(config, values, groups, limits, lag)
        else:
            what, store_s, store_lat, load_s, load_lat = await _raw_mooncake(
                config, values, groups, limits, lag
            )
    nbytes = blocks * block_nbytes
    return {
        "what": what,
        "store": rates(nbytes, blocks, store_s, store_lat),
        "load": rates(nbytes, blocks, load_s, load_lat),
        "loop_lag": lag.summary(),
    }


def _faulted_in(nbytes: int) -> memoryview:
    memory = memoryview(reserve_host_memory(nbytes))
    memory[:] = bytes(nbytes)
    return memory


def _random_blocks(block_nbytes: int, blocks: int) -> list[memoryview]:
    memory = memoryview(reserve_host_memory(block_nbytes * blocks))
    values = [memory[i * block_nbytes : (i + 1) * block_nbytes] for i in range(blocks)]
    for value in values:
        value[:] = os.urandom(block_nbytes)
    return values


async def _raw_files(
    work: Path, spec: OffloadingSpec, groups: list[list[int]], lag: LoopLag
) -> tuple[Any, ...]:
    stride = spec.block_stride
    threads = spec.limits.io_threads
    path = work / "raw.bin"
    await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)

    def prepare() -> int:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.posix_fallocate(fd, 0, len(groups) * len(groups[0]) * stride)
        os.close(fd)
        return os.open(path, os.O_RDWR | os.O_DIRECT)

    def filled() -> list[memoryview]:
        # The same kind of memory as a primary tier's (huge pages where possible), so the ratio
        # measures the tier's own costs, not the memory it reads into.
        buffers = [memoryview(reserve_host_memory(stride * len(groups[0]))) for _ in groups]
        for buffer in buffers:
            buffer[:] = os.urandom(len(buffer))
        return buffers

    with lag.paused():  # the set-up (on the loop, filling the buffers was a 1 s stall)
        fd = await asyncio.to_thread(prepare)
        buffers = await asyncio.to_thread(filled)
    async with _thread_pool(threads) as pool:
        loop = asyncio.get_running_loop()

        def io(fn: Callable[..., Any], n: int) -> Callable[[], Awaitable[Any]]:
            size = len(groups[n]) * stride
            return lambda: loop.run_in_executor(pool, fn, fd, [buffers[n][:size]], groups[n][0] * stride)

        try:
            store_s, store_lat = await timed_requests([io(os.pwritev, n) for n in range(len(groups))])
            with lag.paused():  # as the tier's measurement: the harness's work is not counted
                await asyncio.to_thread(drop_page_cache, work)
            load_s, load_lat = await timed_requests([io(os.preadv, n) for n in range(len(groups))])
        finally:
            os.close(fd)
            await asyncio.to_thread(path.unlink)  # each round's file: the rounds' would add up
    what = f"O_DIRECT pwritev/preadv, one file, {threads} threads"
    return what, store_s, store_lat, load_s, load_lat


@contextlib.asynccontextmanager
async def _thread_pool(threads: int) -> AsyncIterator[ThreadPoolExecutor]:
    """Threads for a baseline's calls, shut down (joined) off the event loop at the end."""
    pool = ThreadPoolExecutor(threads)
    try:
        yield pool
    finally:
        await asyncio.to_thread(pool.shutdown)


async def _raw_memory(spec: OffloadingSpec, groups: list[list[int]], lag: LoopLag) -> tuple[Any, ...]:
    shape = (sum(map(len, groups)), spec.block_nbytes)
    with lag.paused():  # the set-up
        source = await asyncio.to_thread(torch.randint, 0, 256, shape, dtype=torch.uint8)
    copies: dict[int, torch.Tensor] = {}
    threads = spec.limits.io_threads
    async with _thread_pool(threads) as pool:
        loop = asyncio.get_running_loop()

        def store(group: list[int]) -> None:
            for i in group:
                copies[i] = source[i].clone()

        def load(group: list[int]) -> None:
            for i in group:
                source[i].copy_(copies[i])

        store_s, store_lat = await timed_requests(
            [partial(loop.run_in_executor, pool, store, g) for g in groups]
        )
        load_s, load_lat = await timed_requests(
            [partial(loop.run_in_executor, pool, load, g) for g in groups]
        )
    return f"torch copies, {threads} threads", store_s, store_lat, load_s, load_lat


async def _raw_redis(
    config: dict[str, Any], values: list[memoryview], groups: list[list[int]], limits: Any, lag: LoopLag
) -> tuple[Any, ...]:
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(config.get("url", "redis://localhost:6379/0"), driver_info=None)
    prefix = f"kvtier-bench-raw:{os.getpid()}:{time.monotonic_ns()}:"
    # Memoryviews, as redis-py is best used: it sends one as it is, where a `bytes` value is
    # copied into one string with the command first (hiredis' packer), on the event loop.

    async def put(group: list[int]) -> None:
        async with client.pipeline(transaction=False) as pipe:
            for i in group:
                pipe.set(prefix + str(i), values[i])
            await pipe.execute()

    async def get(group: list[int]) -> None:
        async with client.pipeline(transaction=False) as pipe:
            for i in group:
                pipe.get(prefix + str(i))
            await pipe.execute()

    try:
        store_s, store_lat = await timed_requests(
            [partial(put, g) for g in groups], limits.max_inflight_stores
        )
        load_s, load_lat = await timed_requests([partial(get, g) for g in groups], limits.max_inflight_loads)
        with lag.paused():
            await client.delete(*(prefix + str(i) for g in groups for i in g))
    finally:
        await client.aclose()
    return "redis-py pipelines (hiredis, memoryview values)", store_s, store_lat, load_s, load_lat


async def _raw_s3(
    config: dict[str, Any], values: list[memoryview], groups: list[list[int]], limits: Any, lag: LoopLag
) -> tuple[Any, ...]:
    import obstore
    from obstore.store import S3Store

    options = {
        name: config[name]
        for name in ("endpoint", "region", "access_key_id", "secret_access_key")
        if config.get(name) is not None
    }
    options.setdefault("region", "us-east-1")
    store = S3Store(
        config["bucket"], client_options={"allow_http": bool(config.get("allow_http"))}, **options
    )
    prefix = f"kvtier-bench-raw/{os.getpid()}-{time.monotonic_ns()}/"

    async def put(group: list[int]) -> None:
        await asyncio.gather(
            *(obstore.put_async(store, prefix + str(i), values[i], use_multipart=False) for i in group)
        )

    async def get_one(i: int) -> None:
        await (await obstore.get_async(store, prefix + str(i))).bytes_async()

    async def get(group: list[int]) -> None:
        await asyncio.gather(*(get_one(i) for i in group))

    store_s, store_lat = await timed_requests([partial(put, g) for g in groups], limits.max_inflight_stores)
    load_s, load_lat = await timed_requests([partial(get, g) for g in groups], limits.max_inflight_loads)
    with lag.paused():
        await obstore.delete_async(store, [prefix + str(i) for g in groups for i in g])
    return "obstore PUT/GET (one PUT per block)", store_s, store_lat, load_s, load_lat


async def _raw_mooncake(
    config: dict[str, Any], values: list[memoryview], groups: list[list[int]], limits: Any, lag: LoopLag
) -> tuple[Any, ...]:
    from .buffers import address_of
    from .tiers.mooncake_clients import LOCAL_BUFFER_BYTES, import_store

    # Mooncake's setup() against a closed port holds the GIL for ~90 s: reach the master first.
    host, _, port = config["master"].rpartition(":")
    _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), 5)
    writer.close()
    store = await asyncio.to_thread(import_store)
    client = store.MooncakeDistributedStore()
    rc = await asyncio.to_thread(
        client.setup,
        config.get("local_hostname") or "127.0.0.1",
        config.get("metadata", "P2PHANDSHAKE"),
        config["segment_bytes"],
        LOCAL_BUFFER_BYTES,
        config.get("protocol", "tcp"),
        config.get("device", ""),
        config["master"],
    )
    if rc != 0:
        raise ConnectionError(f"raw Mooncake client: setup failed ({rc})")
    nbytes = sum(v.nbytes for v in values)
    source = values[0]  # one region (`_random_blocks`): registered whole, as the tier's primary memory
    landing = await asyncio.to_thread(_faulted_in, nbytes)  # as a tier's primary memory is
    for region, size in ((source, nbytes), (landing, nbytes)):
        await asyncio.to_thread(client.register_buffer, address_of(region), size)
    size = values[0].nbytes
    prefix = f"kvtier-bench-raw:{os.getpid()}:{time.monotonic_ns()}:"
    put_config = store.ReplicateConfig()
    put_config.replica_num = config.get("replicas", 1)
    threads = ThreadPoolExecutor(max(limits.max_inflight_stores, limits.max_inflight_loads))
    loop = asyncio.get_running_loop()

    def put(group: list[int]) -> None:
        codes = client.batch_put_from(
            [prefix + str(i) for i in group],
            [address_of(values[i]) for i in group],
            [size] * len(group),
            put_config,
        )
        if any(codes):
            raise RuntimeError(f"raw Mooncake put failed: {codes}")

    def get(group: list[int]) -> None:
        targets = [address_of(landing) + i * size for i in group]
        codes = client.batch_get_into([prefix + str(i) for i in group], targets, [size] * len(group))
        if any(code != size for code in codes):
            raise RuntimeError(f"raw Mooncake get failed: {codes}")

    def on_thread(fn: Callable[[list[int]], None], group: list[int]) -> Awaitable[None]:
        return loop.run_in_executor(threads, fn, group)

    try:
        store_s, store_lat = await timed_requests(
            [partial(on_thread, put, g) for g in groups], limits.max_inflight_stores
        )
        load_s, load_lat = await timed_requests(
            [partial(on_thread, get, g) for g in groups], limits.max_inflight_loads
        )
        with lag.paused():
            await asyncio.to_thread(client.batch_remove, [prefix + str(i) for g in groups for i in g], True)
    finally:
        threads.shutdown(wait=False)
        with lag.paused():
            await asyncio.to_thread(client.close)
    return (
        "Mooncake batch_put_from / batch_get_into (registered memory)",
        store_s,
        store_lat,
        load_s,
        load_lat,
    )


# -- the pipeline ---------------------------------------------------------------------------------
