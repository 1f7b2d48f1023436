"""`kvtier bench`: what users ask about each configured tier, next to a raw baseline from the same run.

Per tier and block size: store and cold-load GB/s and blocks/s, and call latency
p50 / p99, for requests of `request_blocks` blocks all issued at once (the
scheduler decides what runs). The baseline moves the same bytes in the same
requests at the concurrency the tier's lanes allow, with the plainest code for
that backend:

- fs: O_DIRECT `pwritev` / `preadv` of each request's blocks at its own offset
  of one preallocated file, on as many threads as the tier has;
- memory: a torch copy of each block, on the same threads;
- redis: one redis-py pipeline of SET / GET per request;
- s3: concurrent obstore PUT / GET of each request's blocks;
- other tiers: none (shown as such).

Per tier, for the large blocks: the pipeline overlap of `TieredKVCache` (store +
flush and cold load, against copy-only and I/O-only of the same blocks) and the
event loop's lag during the tier's store and load (a 1 ms ticker).
"""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .cache import TieredKVCache
from .errors import ConfigError
from .factory import SecondaryTierFactory
from .keys import block_hashes
from .primary import PrimaryTier, reserve_host_memory
from .spec import OffloadingSpec
from .tier import SecondaryTierManager

__all__ = [
    "BenchConfig",
    "LoopLag",
    "drop_page_cache",
    "format_table",
    "freeze_startup_heap",
    "percentile",
    "run_bench",
    "save_plot",
]

GB = 1e9
LAYERS = 8  # the stand-in device memory of the pipeline measurement


@dataclass
class BenchConfig:
    #: Tier configs; None: a file-system tier in a temporary directory.
    secondary_tiers: list[dict[str, Any]] | None = None
    block_kib: list[int] = field(default_factory=lambda: [2048, 64])
    mib_per_case: int = 256
    request_blocks: int = 8
    #: Rounds per case (tier and baseline interleaved); numbers are their medians.
    repeat: int = 1
    directory: Path | None = None
    progress: bool = True


def median_tree(runs: list[Any]) -> Any:
    """Runs of the same nested shape, merged: numbers by median, flags by all(), text from the first."""
    first = runs[0]
    if isinstance(first, dict):
        return {key: median_tree([run[key] for run in runs]) for key in first}
    if isinstance(first, bool):
        return all(runs)
    if isinstance(first, (int, float)):
        return statistics.median(runs)
    return first


def percentile(values: list[float], q: float) -> float:
    """The value at quantile `q` (0..1) of `values`; 0 for none."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _rates(nbytes: int, blocks: int, seconds: float, latencies: list[float]) -> dict[str, float]:
    return {
        "gbps": nbytes / seconds / GB,
        "blocks_per_s": blocks / seconds,
        "p50_ms": percentile(latencies, 0.50) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
        "seconds": seconds,
    }


async def _requests(
    calls: list[Callable[[], Awaitable[Any]]], limit: int | None = None
) -> tuple[float, list[float]]:
    """Run every call at once (at most `limit` at a time); total seconds and each call's latency."""
    gate = asyncio.Semaphore(limit) if limit else None
    latencies: list[float] = []

    async def one(call: Callable[[], Awaitable[Any]]) -> None:
        if gate is not None:
            await gate.acquire()
        try:
            started = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - started)
        finally:
            if gate is not None:
                gate.release()

    started = time.perf_counter()
    await asyncio.gather(*(one(call) for call in calls))
    return time.perf_counter() - started, latencies


def freeze_startup_heap() -> None:
    """Take what start-up left alive out of the garbage collector's way, as a serving process
    does (vLLM's engine core calls `gc.freeze()` after start-up; docs/production.md says why).

    With torch imported a process holds ~170,000 objects; a full collection walks them all,
    ~60-100 ms on a small VM with the GIL held, so whichever timed step allocates the object
    that triggers it stalls that long, and a benchmark would measure the collector instead of
    the I/O.
    """
    gc.collect()
    gc.freeze()


def drop_page_cache(directory: Path) -> None:
    """Ask the kernel to forget the cached pages of every file under `directory` (blocking)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class LoopLag:
    """A 1 ms ticker: how late each wake-up of the event loop comes.

    It also times the garbage collector's full (generation 2) collections in
    the same window: with torch imported one takes ~150 ms on a small VM, and
    it stops every thread that wants the GIL, the event loop included. And it
    reads the CPU time the hypervisor stole from this VM in the window (Linux,
    10 ms resolution): a stolen CPU stalls the loop whatever the code does.
    And, per tick, how long the loop's thread waited for a CPU while it was
    ready to run (Linux schedstat): on a small machine shared with a server
    process that is most of the lag, and no code of the loop's can shorten it;
    the rest of the lag is the loop busy with its own work.
    """

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.lags: list[float] = []
        self.cpu_waits: list[float] = []  # per tick, the loop thread's wait for a CPU (Linux)
        self.woke: list[float] = []  # when each wake-up came, seconds into the window
        self.full_gc_pauses: list[float] = []
        self._gc_started = 0.0
        self._task: asyncio.Task[None] | None = None
        self._window = (0.0, 0.0)  # (wall clock, stolen CPU seconds) at the start
        self.seconds = 0.0
        self.stolen = 0.0

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.full_gc_pauses.append(time.perf_counter() - self._gc_started)

    async def _tick(self) -> None:
        try:  # procfs: never waits on a disk. Kept open: a read is then one syscall.
            schedstat = open("/proc/thread-self/schedstat", "rb", buffering=0)  # noqa: SIM115, ASYNC230
        except OSError:
            schedstat = None
        try:
            while True:
                started, waited = time.perf_counter(), _cpu_waited(schedstat)
                await asyncio.sleep(self.period)
                now = time.perf_counter()
                self.lags.append(max(0.0, now - started - self.period))
                self.cpu_waits.append(_cpu_waited(schedstat) - waited)
                self.woke.append(now - self._window[0])
        finally:
            if schedstat is not None:
                schedstat.close()

    def __enter__(self) -> LoopLag:
        gc.callbacks.append(self._on_gc)
        self._window = (time.perf_counter(), _stolen_seconds())
        self._task = asyncio.ensure_future(self._tick())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        gc.callbacks.remove(self._on_gc)
        self.seconds = time.perf_counter() - self._window[0]
        self.stolen = _stolen_seconds() - self._window[1]

    def timeline(self, bucket: float = 0.01) -> list[tuple[float, float]]:
        """(start of the bucket in seconds, worst lag in it in ms) per `bucket` seconds with a tick."""
        worst: dict[int, float] = {}
        for at, lag in zip(self.woke, self.lags):
            n = int(at / bucket)
            worst[n] = max(worst.get(n, 0.0), lag)
        return [(n * bucket, lag * 1e3) for n, lag in sorted(worst.items())]

    def summary(self) -> dict[str, float]:
        return {
            "p50_ms": percentile(self.lags, 0.50) * 1e3,
            "p99_ms": percentile(self.lags, 0.99) * 1e3,
            "max_ms": max(self.lags, default=0.0) * 1e3,
            "cpu_wait_p99_ms": percentile(self.cpu_waits, 0.99) * 1e3,
            # The lag less the tick's wait for a CPU: what the loop's own work cost.
            "busy_p99_ms": percentile([max(0.0, lag - w) for lag, w in zip(self.lags, self.cpu_waits)], 0.99)
            * 1e3,
            "ticks": float(len(self.lags)),
            "full_gcs": float(len(self.full_gc_pauses)),
            "full_gc_max_ms": max(self.full_gc_pauses, default=0.0) * 1e3,
            "seconds": self.seconds,
            "stolen_ms": self.stolen * 1e3,
        }


def _cpu_waited(schedstat: Any) -> float:
    """Seconds the thread whose /proc/thread-self/schedstat is open as `schedstat` has waited for a
    CPU so far (its second field: time runnable but not running, in ns); 0 where unknown."""
    if schedstat is None:
        return 0.0
    try:
        schedstat.seek(0)
        return int(schedstat.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _stolen_seconds() -> float:
    """CPU time the hypervisor has stolen from this machine, all CPUs together (0 if unknown)."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


# -- the tier ------------------------------------------------------------------------------------
async def _measure_tier(
    config: dict[str, Any], block_nbytes: int, blocks: int, request_blocks: int, tag: str
) -> dict[str, Any]:
    spec = OffloadingSpec(block_nbytes=block_nbytes, num_cpu_blocks=blocks, namespace=f"kvtier-bench-{tag}")
    primary = PrimaryTier(spec)
    primary.buffer.view(-1)[:] = torch.randint(0, 256, (primary.buffer.numel(),), dtype=torch.uint8)
    expected = primary.buffer.clone()
    keys = block_hashes(range(blocks * 16), 16, namespace=spec.namespace)
    groups = [list(range(i, min(i + request_blocks, blocks))) for i in range(0, blocks, request_blocks)]
    tier = SecondaryTierFactory.create_secondary_tier(config, primary.view, spec)
    async with tier:
        await tier.lookup(keys[:1])  # opened outside the timing
        with LoopLag() as lag:
            store_s, store_lat = await _requests(
                [partial(tier.store, [keys[i] for i in g], g) for g in groups]
            )
            await _forget_cached_pages(tier)
            # Off the loop: zeroing 256 MiB here was the window's worst stall (10 to 40 ms), not the tier's.
            await asyncio.to_thread(primary.buffer.zero_)
            load_s, load_lat = await _requests([partial(tier.load, [keys[i] for i in g], g) for g in groups])
        stats = tier.stats()
        exact = bool(torch.equal(primary.buffer, expected))
        await tier.delete(keys)  # a shared tier keeps nothing of the benchmark
    nbytes = blocks * block_nbytes
    return {
        "store": _rates(nbytes, blocks, store_s, store_lat),
        "load": _rates(nbytes, blocks, load_s, load_lat),
        "stored_blocks": stats["stored_blocks"],
        "load_hits": stats["load_hits"],
        "exact": exact and stats["load_hits"] == blocks,
        "loop_lag": lag.summary(),
    }


async def _forget_cached_pages(tier: SecondaryTierManager) -> None:
    root = getattr(tier, "directory", None)
    if isinstance(root, Path):
        await asyncio.to_thread(drop_page_cache, root)


# -- the baselines -------------------------------------------------------------------------------
async def _baseline(
    config: dict[str, Any], block_nbytes: int, blocks: int, request_blocks: int, work: Path
) -> Any:
    spec = OffloadingSpec(block_nbytes=block_nbytes, num_cpu_blocks=blocks)
    limits = spec.limits
    groups = [list(range(i, min(i + request_blocks, blocks))) for i in range(0, blocks, request_blocks)]
    payload = os.urandom(block_nbytes)
    kind = config["type"]
    if kind not in ("fs", "memory", "redis", "s3"):
        return None
    with LoopLag() as lag:  # the same ticker as the tier's: what the raw client costs the loop
        if kind == "fs":
            what, store_s, store_lat, load_s, load_lat = await _raw_files(work, spec, groups)
        elif kind == "memory":
            what, store_s, store_lat, load_s, load_lat = await _raw_memory(spec, groups)
        elif kind == "redis":
            what, store_s, store_lat, load_s, load_lat = await _raw_redis(config, payload, groups, limits)
        else:
            what, store_s, store_lat, load_s, load_lat = await _raw_s3(config, payload, groups, limits)
    nbytes = blocks * block_nbytes
    return {
        "what": what,
        "store": _rates(nbytes, blocks, store_s, store_lat),
        "load": _rates(nbytes, blocks, load_s, load_lat),
        "loop_lag": lag.summary(),
    }


async def _raw_files(work: Path, spec: OffloadingSpec, groups: list[list[int]]) -> tuple[Any, ...]:
    stride = spec.block_stride
    threads = spec.limits.io_threads
    path = work / "raw.bin"
    await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)

    def prepare() -> int:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.posix_fallocate(fd, 0, len(groups) * len(groups[0]) * stride)
        os.close(fd)
        return os.open(path, os.O_RDWR | os.O_DIRECT)

    fd = await asyncio.to_thread(prepare)
    # The same kind of memory as a primary tier's (huge pages where possible), so the ratio
    # measures the tier's own costs, not the memory it reads into.
    buffers = [memoryview(reserve_host_memory(stride * len(groups[0]))) for _ in groups]
    for buffer in buffers:
        buffer[:] = os.urandom(len(buffer))
    with ThreadPoolExecutor(threads) as pool:
        loop = asyncio.get_running_loop()

        def io(fn: Callable[..., Any], n: int) -> Callable[[], Awaitable[Any]]:
            size = len(groups[n]) * stride
            return lambda: loop.run_in_executor(pool, fn, fd, [buffers[n][:size]], groups[n][0] * stride)

        try:
            store_s, store_lat = await _requests([io(os.pwritev, n) for n in range(len(groups))])
            await asyncio.to_thread(drop_page_cache, work)
            load_s, load_lat = await _requests([io(os.preadv, n) for n in range(len(groups))])
        finally:
            os.close(fd)
    what = f"O_DIRECT pwritev/preadv, one file, {threads} threads"
    return what, store_s, store_lat, load_s, load_lat


async def _raw_memory(spec: OffloadingSpec, groups: list[list[int]]) -> tuple[Any, ...]:
    source = torch.randint(0, 256, (sum(map(len, groups)), spec.block_nbytes), dtype=torch.uint8)
    copies: dict[int, torch.Tensor] = {}
    threads = spec.limits.io_threads
    with ThreadPoolExecutor(threads) as pool:
        loop = asyncio.get_running_loop()

        def store(group: list[int]) -> None:
            for i in group:
                copies[i] = source[i].clone()

        def load(group: list[int]) -> None:
            for i in group:
                source[i].copy_(copies[i])

        store_s, store_lat = await _requests([partial(loop.run_in_executor, pool, store, g) for g in groups])
        load_s, load_lat = await _requests([partial(loop.run_in_executor, pool, load, g) for g in groups])
    return f"torch copies, {threads} threads", store_s, store_lat, load_s, load_lat


async def _raw_redis(
    config: dict[str, Any], payload: bytes, groups: list[list[int]], limits: Any
) -> tuple[Any, ...]:
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(config.get("url", "redis://localhost:6379/0"), driver_info=None)
    prefix = f"kvtier-bench-raw:{os.getpid()}:{time.monotonic_ns()}:"
    # A memoryview, as redis-py is best used: it sends one as it is, where a `bytes` value is
    # copied into one string with the command first (hiredis' packer), on the event loop.
    value = memoryview(payload)

    async def put(group: list[int]) -> None:
        async with client.pipeline(transaction=False) as pipe:
            for i in group:
                pipe.set(prefix + str(i), value)
            await pipe.execute()

    async def get(group: list[int]) -> None:
        async with client.pipeline(transaction=False) as pipe:
            for i in group:
                pipe.get(prefix + str(i))
            await pipe.execute()

    try:
        store_s, store_lat = await _requests([partial(put, g) for g in groups], limits.max_inflight_stores)
        load_s, load_lat = await _requests([partial(get, g) for g in groups], limits.max_inflight_loads)
        await client.delete(*(prefix + str(i) for g in groups for i in g))
    finally:
        await client.aclose()
    return "redis-py pipelines (hiredis, memoryview values)", store_s, store_lat, load_s, load_lat


async def _raw_s3(
    config: dict[str, Any], payload: bytes, groups: list[list[int]], limits: Any
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
        await asyncio.gather(*(obstore.put_async(store, prefix + str(i), payload) for i in group))

    async def get_one(i: int) -> None:
        await (await obstore.get_async(store, prefix + str(i))).bytes_async()

    async def get(group: list[int]) -> None:
        await asyncio.gather(*(get_one(i) for i in group))

    store_s, store_lat = await _requests([partial(put, g) for g in groups], limits.max_inflight_stores)
    load_s, load_lat = await _requests([partial(get, g) for g in groups], limits.max_inflight_loads)
    await obstore.delete_async(store, [prefix + str(i) for g in groups for i in g])
    return "obstore PUT/GET", store_s, store_lat, load_s, load_lat


# -- the pipeline ---------------------------------------------------------------------------------
async def _measure_pipeline(
    config: dict[str, Any], block_nbytes: int, blocks: int, tag: str
) -> dict[str, float]:
    """Store + flush and cold load through a cache, against copy-only and I/O-only of the same blocks."""
    width = block_nbytes // LAYERS
    layers = [torch.randint(0, 256, (blocks, width), dtype=torch.uint8) for _ in range(LAYERS)]
    spec_bytes = width * LAYERS
    ids = list(range(blocks))
    keys = block_hashes(range(blocks * 16), 16, namespace=f"kvtier-bench-pipe-{tag}")

    def spec(tiers: list[dict[str, Any]], num_cpu_blocks: int) -> OffloadingSpec:
        return OffloadingSpec(
            block_nbytes=spec_bytes,
            num_cpu_blocks=num_cpu_blocks,
            secondary_tiers=tiers,
            namespace=f"pipe-{tag}",
        )

    out: dict[str, float] = {}
    async with TieredKVCache(spec([], blocks), layers) as cache:
        out["store_copy_s"], _ = await _requests([lambda: cache.store(keys, ids)])
        out["load_copy_s"], _ = await _requests([lambda: cache.load(keys, ids)])
        slots = [cache.primary.lookup(key) for key in keys]
        tier = SecondaryTierFactory.create_secondary_tier(config, cache.primary.view, cache.spec)
        async with tier:
            await tier.lookup(keys[:1])
            out["store_io_s"], _ = await _requests([lambda: tier.store(keys, slots)])  # type: ignore[arg-type]
            await _forget_cached_pages(tier)
            out["load_io_s"], _ = await _requests([lambda: tier.load(keys, slots)])  # type: ignore[arg-type]
            await tier.delete(keys)
    primary_blocks = max(8, blocks // 2)  # the work proceeds in chunks through a smaller primary
    async with TieredKVCache(spec([config], primary_blocks), layers) as cache:
        await cache.lookup(keys[:1])

        async def store() -> None:
            await cache.store(keys, ids)
            await cache.flush()

        out["store_pipeline_s"], _ = await _requests([store])
        # Other blocks push every one of ours out of the primary tier: the load is cold.
        others = block_hashes(range(10**9, 10**9 + 16 * primary_blocks), 16, namespace=f"filler-{tag}")
        await cache.store(others, ids[:primary_blocks])
        await cache.flush()
        await _forget_cached_pages(cache.tiers[0])
        loaded: list[int] = []

        async def load() -> None:
            loaded.append(await cache.load(keys, ids))

        out["load_pipeline_s"], _ = await _requests([load])
        out["loaded_blocks"] = float(loaded[0])
        await cache.tiers[0].delete(keys + others)  # a shared tier keeps nothing of the benchmark
    out["store_ratio"] = out["store_pipeline_s"] / max(out["store_copy_s"], out["store_io_s"])
    out["load_ratio"] = out["load_pipeline_s"] / max(out["load_copy_s"], out["load_io_s"])
    return out


# -- the whole run --------------------------------------------------------------------------------
async def run_bench(config: BenchConfig) -> dict[str, Any]:
    """Every case, as plain data: {"config", "idle_loop_lag", "cases", "pipelines"}."""
    if min(config.request_blocks, config.mib_per_case, config.repeat, *config.block_kib, 1) < 1:
        raise ConfigError("kvtier bench: sizes must be positive")
    freeze_startup_heap()
    async with AsyncExitStack() as stack:
        work = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="kvtier-bench-", dir=config.directory))
        stack.push_async_callback(asyncio.to_thread, shutil.rmtree, work, True)
        tiers = config.secondary_tiers or [{"type": "fs"}]
        tiers = [_with_root(tier, work / f"tier{n}") for n, tier in enumerate(tiers)]
        steps = len(tiers) * (2 * len(config.block_kib) + 1) * config.repeat
        bar = tqdm(total=steps, desc="kvtier bench", unit="step", disable=not config.progress)
        stack.callback(bar.close)
        with LoopLag() as idle:  # the lag of this loop with nothing to do: the baseline for the rest
            await asyncio.sleep(0.5)
        cases, pipelines = [], []
        run_id = uuid.uuid4().hex[:8]  # fresh names: a shared tier may hold an earlier run's blocks
        for n, tier_config in enumerate(tiers):
            name = tier_config["type"] if len(tiers) == 1 else f"{tier_config['type']}#{n}"
            for kib in config.block_kib:
                block = kib * 1024
                blocks = max(config.request_blocks, config.mib_per_case * (1 << 20) // block)
                bar.set_postfix_str(f"{name} {kib} KiB")
                measured_runs, baseline_runs = [], []
                for r in range(config.repeat):  # interleaved, so drifts hit both alike
                    tag = f"{run_id}-{n}-{kib}-{r}"
                    measured_runs.append(
                        await _measure_tier(tier_config, block, blocks, config.request_blocks, tag)
                    )
                    bar.update()
                    baseline_runs.append(
                        await _baseline(
                            tier_config, block, blocks, config.request_blocks, work / f"raw-{tag}"
                        )
                    )
                    bar.update()
                measured = median_tree(measured_runs)
                baseline = None if baseline_runs[0] is None else median_tree(baseline_runs)
                case = {"tier": name, "type": tier_config["type"], "block_kib": kib, "blocks": blocks}
                case.update(measured)
                case["baseline"] = baseline
                if baseline is not None:
                    case["store_ratio"] = measured["store"]["gbps"] / baseline["store"]["gbps"]
                    case["load_ratio"] = measured["load"]["gbps"] / baseline["load"]["gbps"]
                cases.append(case)
            block = max(config.block_kib) * 1024
            blocks = max(16, config.mib_per_case * (1 << 20) // block)
            bar.set_postfix_str(f"{name} pipeline")
            pipeline_runs = []
            for r in range(config.repeat):
                pipeline_runs.append(await _measure_pipeline(tier_config, block, blocks, f"{run_id}-{n}-{r}"))
                bar.update()
            pipeline = median_tree(pipeline_runs)
            pipelines.append({"tier": name, "block_kib": max(config.block_kib), "blocks": blocks, **pipeline})
    return {
        "config": {
            "tiers": [_redacted(t) for t in tiers],
            "block_kib": config.block_kib,
            "mib_per_case": config.mib_per_case,
            "request_blocks": config.request_blocks,
            "repeat": config.repeat,
            "cpus": os.cpu_count(),
        },
        "idle_loop_lag": idle.summary(),
        "cases": cases,
        "pipelines": pipelines,
    }


def _with_root(tier: dict[str, Any], root: Path) -> dict[str, Any]:
    if tier.get("type") == "fs" and "root" not in tier:
        return {**tier, "root": str(root)}
    return dict(tier)


def _redacted(tier: dict[str, Any]) -> dict[str, Any]:
    hidden = {"secret_access_key", "access_key_id", "client", "store"}
    out = {k: ("***" if k in hidden else v) for k, v in tier.items()}
    if isinstance(out.get("url"), str):
        from .tiers.redis_tier import redact_url

        out["url"] = redact_url(out["url"])
    return out


def _lag_parts(lag: dict[str, float]) -> str:
    """The p99s of the loop thread's wait for a CPU and of its own work, where recorded."""
    if "busy_p99_ms" not in lag:  # records made before they were measured
        return ""
    return f"; p99 waiting for a CPU {lag['cpu_wait_p99_ms']:.2f} ms, busy {lag['busy_p99_ms']:.2f} ms"


def format_table(result: dict[str, Any]) -> str:
    """The cases as a text table, then the pipeline overlap and loop lag per tier."""
    head = (
        f"{'tier':<10} {'block':>8} | {'store GB/s':>10} {'raw':>6} {'ratio':>6} | "
        f"{'load GB/s':>9} {'raw':>6} {'ratio':>6} | {'blocks/s st/ld':>15} | "
        f"{'p50/p99 ms store':>17} | {'p50/p99 ms load':>16} | exact"
    )
    lines = [head, "-" * len(head)]
    for case in result["cases"]:
        base = case["baseline"]
        raw_store = f"{base['store']['gbps']:6.2f}" if base else "   n/a"
        raw_load = f"{base['load']['gbps']:6.2f}" if base else "   n/a"
        ratio_store = f"{case['store_ratio']:5.2f}x" if base else "   n/a"
        ratio_load = f"{case['load_ratio']:5.2f}x" if base else "   n/a"
        st, ld = case["store"], case["load"]
        block = f"{case['block_kib']} KiB"
        lines.append(
            f"{case['tier']:<10} {block:>8} | {st['gbps']:10.2f} {raw_store} {ratio_store} | "
            f"{ld['gbps']:9.2f} {raw_load} {ratio_load} | "
            f"{st['blocks_per_s']:7.0f}/{ld['blocks_per_s']:<7.0f} | "
            f"{st['p50_ms']:8.1f}/{st['p99_ms']:<8.1f} | "
            f"{ld['p50_ms']:7.1f}/{ld['p99_ms']:<8.1f} | {case['exact']}"
        )
    lines.append("")
    idle = result["idle_loop_lag"]
    lines.append(
        f"idle event loop (baseline): lag p50 {idle['p50_ms']:.2f} ms, p99 {idle['p99_ms']:.2f} ms, "
        f"max {idle['max_ms']:.2f} ms"
    )
    for case in result["cases"]:
        if case["block_kib"] == max(result["config"]["block_kib"]):
            lag = case["loop_lag"]
            line = (
                f"{case['tier']}: event-loop lag during its store and load: p50 {lag['p50_ms']:.2f} ms, "
                f"p99 {lag['p99_ms']:.2f} ms, max {lag['max_ms']:.2f} ms{_lag_parts(lag)}"
            )
            raw = (case["baseline"] or {}).get("loop_lag")  # records made before it was measured
            if raw is not None:
                parts = _lag_parts(raw)
                line += f" (raw baseline: p99 {raw['p99_ms']:.2f} ms, max {raw['max_ms']:.2f} ms{parts})"
            lines.append(line)
    for pipe in result["pipelines"]:
        lines.append(
            f"{pipe['tier']}: pipeline ({pipe['blocks']} x {pipe['block_kib']} KiB through a cache): "
            f"store {pipe['store_ratio']:.2f}x, load {pipe['load_ratio']:.2f}x the slower of copy-only "
            f"and I/O-only (1.00 = full overlap)"
        )
    described = set()
    for case in result["cases"]:
        if case["tier"] not in described:
            described.add(case["tier"])
            what = case["baseline"]["what"] if case["baseline"] else "none for this type"
            lines.append(f"baseline for {case['tier']}: {what}")
    return "\n".join(lines)


def save_plot(result: dict[str, Any], path: Path) -> None:
    """Throughput by tier and block size, ours next to the baseline (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    labels = [f"{c['tier']}\n{c['block_kib']} KiB" for c in cases]
    series = {
        "store (kvtier)": [c["store"]["gbps"] for c in cases],
        "store (raw)": [c["baseline"]["store"]["gbps"] if c["baseline"] else 0.0 for c in cases],
        "load (kvtier)": [c["load"]["gbps"] for c in cases],
        "load (raw)": [c["baseline"]["load"]["gbps"] if c["baseline"] else 0.0 for c in cases],
    }
    figure, axes = plt.subplots(figsize=(2.5 + 2.2 * len(cases), 4))
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        axes.bar([i + k * width for i in range(len(cases))], values, width, label=name)
    axes.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], labels)
    axes.set_ylabel("GB/s")
    axes.set_title("kvtier bench: throughput by tier and block size")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
