"""`kvtier replay`: a request trace through a real tiered cache, and what each tier gave it.

Each request does what an engine does for a prompt: `lookup` of its block chain, `load` of
the hit prefix into (stand-in) device blocks, then `store` of the blocks it had to compute.
Requests arrive at the trace's times compressed by `speed` (X times real time), or, with no
speed, in trace order as fast as `concurrency` requests in flight allow, all on one event
loop, against the configured tiers (a file-system tier in a temporary directory unless
given). A block's bytes are derived from its hash id, so every load is checked byte-exact.

The report: prefix hit rate in blocks and tokens for the whole cache and per tier (where the
loaded blocks came from, by the cache's own counters; a block's tokens count for the tier that
held it when the request looked it up), the hit rate an unbounded cache would get on the same requests,
bytes written and read and evictions per tier, load latency, requests that started after
their arrival slot, and the event loop's lag.

Device memory is bounded (`DEVICE_BUDGET_BYTES`): a request whose chain is longer than its
share moves it in windows, as an engine moves a long prompt in chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .cache import TieredKVCache
from .errors import InvalidArgumentError
from .measure import LoopLag
from .replay_report import Tally, build_report
from .spec import OffloadingSpec
from .sweep import block_key, simulate, unbounded_hits
from .trace import TOKENS_PER_BLOCK, Request, read_trace

__all__ = ["MODEL_GEOMETRIES", "ReplayConfig", "run_replay"]

#: KV bytes per token of some common models (bf16; K and V of every layer), for `--model-geometry`.
MODEL_GEOMETRIES: dict[str, int] = {
    "llama-3.1-8b": 32 * 8 * 128 * 2 * 2,  # 32 layers, 8 KV heads of 128
    "qwen2.5-7b": 28 * 4 * 128 * 2 * 2,  # 28 layers, 4 KV heads of 128
    "llama-3.1-70b": 80 * 8 * 128 * 2 * 2,  # 80 layers, 8 KV heads of 128
    "deepseek-v3": 61 * (512 + 64) * 2,  # MLA: one latent of 512 + 64 per layer
}
#: Stand-in device memory for all requests in flight together.
DEVICE_BUDGET_BYTES = 2 << 30
#: Random bytes that block payloads are cut from (a block's id picks its offset).
PAYLOAD_POOL_BYTES = 64 << 20


@dataclass
class ReplayConfig:
    trace: Path
    #: Secondary tier configs; None: a file-system tier in a temporary directory.
    secondary_tiers: list[dict[str, Any]] | None = None
    primary_bytes: int = 1 << 30
    block_bytes: int = 256 << 10
    #: X times real time; None: as fast as `concurrency` allows, in trace order.
    speed: float | None = None
    concurrency: int = 16
    limit: int | None = None
    directory: Path | None = None
    progress: bool = True
    #: Wait for each request's writes to reach every tier before it counts as done (as the time an
    #: engine spends decoding would let them): at concurrency 1 the replay then takes exactly the
    #: sweep's steps, in the sweep's order.
    settle: bool = False
    #: Set from another thread or a signal handler to stop early (the report still comes).
    stop: asyncio.Event | None = None

    def check(self) -> None:
        if (
            isinstance(self.block_bytes, bool)
            or not isinstance(self.block_bytes, int)
            or self.block_bytes < 4096
        ):
            raise InvalidArgumentError(f"block bytes must be an int >= 4096, got {self.block_bytes!r}")
        if self.block_bytes % 4096:
            raise InvalidArgumentError(f"block bytes must be a multiple of 4096, got {self.block_bytes}")
        if self.primary_bytes < self.block_bytes:
            raise InvalidArgumentError("the primary tier must hold at least one block")
        if (
            isinstance(self.concurrency, bool)
            or not isinstance(self.concurrency, int)
            or self.concurrency < 1
        ):
            raise InvalidArgumentError(f"concurrency must be an int >= 1, got {self.concurrency!r}")
        if self.speed is not None and not (
            isinstance(self.speed, (int, float)) and 0 < self.speed < float("inf")
        ):
            raise InvalidArgumentError(
                f"speed must be a number > 0 (or None: as fast as possible), got {self.speed!r}"
            )
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise InvalidArgumentError(f"limit must be an int >= 1, got {self.limit!r}")


class _Payloads:
    """Deterministic, incompressible block bytes per hash id: a slice of a random pool at an
    offset the id picks, the id itself in the first 8 bytes (so no two ids share bytes)."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        size = max(PAYLOAD_POOL_BYTES, 2 * block_bytes)
        generator = torch.Generator().manual_seed(20251)
        self.pool = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
        self._offsets = (size - block_bytes) // 8

    def _slice(self, hash_id: int) -> torch.Tensor:
        start = (hash_id * 0x9E3779B97F4A7C15 % (1 << 64)) % self._offsets * 8
        return self.pool[start : start + self.block_bytes]

    def fill(self, block: torch.Tensor, hash_id: int) -> None:
        block.copy_(self._slice(hash_id))
        block[:8].copy_(torch.frombuffer(bytearray(hash_id.to_bytes(8, "little")), dtype=torch.uint8))

    def matches(self, block: torch.Tensor, hash_id: int) -> bool:
        head = bytes(block[:8].numpy()) == hash_id.to_bytes(8, "little")
        return head and torch.equal(block[8:], self._slice(hash_id)[8:])


async def run_replay(config: ReplayConfig) -> dict[str, Any]:
    """Replay the trace; the report as a plain dict (`format_replay` prints it). The trace is
    read and checked, and the config too, before any tier is opened."""
    config.check()
    requests = await asyncio.to_thread(read_trace, config.trace, config.limit)
    if config.secondary_tiers is not None:
        return await _replay(config, requests, config.secondary_tiers)
    root = await asyncio.to_thread(tempfile.mkdtemp, prefix="kvtier-replay-", dir=config.directory)
    try:
        return await _replay(config, requests, [{"type": "fs", "root": root}])
    finally:
        await asyncio.to_thread(shutil.rmtree, root, True)


async def _replay(
    config: ReplayConfig, requests: list[Request], tiers: list[dict[str, Any]]
) -> dict[str, Any]:
    block_bytes = config.block_bytes
    longest = max(len(r.hash_ids) for r in requests)
    window = max(1, min(longest, DEVICE_BUDGET_BYTES // (config.concurrency * block_bytes)))
    spec = OffloadingSpec(
        block_nbytes=block_bytes,
        num_cpu_blocks=config.primary_bytes // block_bytes,
        block_size=TOKENS_PER_BLOCK,
        secondary_tiers=tiers,
        namespace=f"replay-{block_bytes}",
    )
    # Zeroing up to DEVICE_BUDGET_BYTES takes a while: not on the loop.
    shape = (config.concurrency * window, block_bytes)
    device = await asyncio.to_thread(lambda: torch.zeros(shape, dtype=torch.uint8))
    groups: asyncio.Queue[list[int]] = asyncio.Queue()
    for g in range(config.concurrency):
        groups.put_nowait(list(range(g * window, (g + 1) * window)))
    payloads = await asyncio.to_thread(_Payloads, block_bytes)
    tally = Tally()
    stop = config.stop or asyncio.Event()
    started = time.perf_counter()  # again once the cache is open: arrivals count from there

    async def replay_one(request: Request, cache: TieredKVCache, due: float | None) -> None:
        ids = await groups.get()
        try:
            if due is not None:
                tally.late_seconds.append(max(0.0, time.perf_counter() - due))
            await _request(request, cache, ids)
        finally:
            groups.put_nowait(ids)

    async def _request(request: Request, cache: TieredKVCache, ids: list[int]) -> None:
        chain = request.hash_ids
        keys = [block_key(h) for h in chain]
        sources = await cache.lookup_sources(keys)
        found = len(sources)
        loaded = 0
        while loaded < found:
            part = keys[loaded : min(found, loaded + window)]
            t = time.perf_counter()
            got = await cache.load(part, ids[: len(part)])
            tally.load_seconds.append(time.perf_counter() - t)
            wrong = await asyncio.to_thread(_check, device, ids[:got], chain[loaded : loaded + got], payloads)
            tally.wrong_bytes += wrong
            loaded += got
            if got < len(part) or wrong:
                break
        for start in range(loaded, len(chain), window):
            part_ids = chain[start : start + window]
            await asyncio.to_thread(_fill, device, ids[: len(part_ids)], part_ids, payloads)
            await cache.store(keys[start : start + window], ids[: len(part_ids)])
        if config.settle:
            await cache.flush()
        tally.requests += 1
        tally.blocks += len(chain)
        tally.tokens += request.input_length
        tally.found_blocks += found
        tally.hit_blocks += loaded
        tally.hit_tokens += sum(request.block_tokens(b) for b in range(loaded))
        for b in range(loaded):
            tally.tier_tokens[sources[b]] += request.block_tokens(b)
        tally.timeline.append((time.perf_counter() - started, len(chain), loaded))

    first_ms = requests[0].timestamp_ms
    with (
        _stop_on_sigint(stop),
        tqdm(total=len(requests), desc="requests", unit="req", disable=not config.progress) as bar,
    ):
        async with TieredKVCache(spec, device) as cache:
            started = time.perf_counter()  # the primary tier is resident: the first request is due now
            with LoopLag() as lag:
                running: set[asyncio.Task[None]] = set()
                failures: list[BaseException] = []

                def done(task: asyncio.Task[None]) -> None:
                    running.discard(task)
                    bar.update(1)
                    if not running:
                        bar.refresh()  # nothing in flight: show it now, the next update may be far
                    if not task.cancelled() and task.exception() is not None:
                        failures.append(task.exception())  # type: ignore[arg-type]
                        stop.set()

                for request in requests:
                    due = None
                    if config.speed is not None:
                        due = started + (request.timestamp_ms - first_ms) / 1e3 / config.speed
                        delay = due - time.perf_counter()
                        if delay > 0:
                            with contextlib.suppress(asyncio.TimeoutError):
                                await asyncio.wait_for(stop.wait(), delay)
                    else:
                        while len(running) >= config.concurrency and not stop.is_set():
                            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                    if stop.is_set():
                        break
                    task = asyncio.ensure_future(replay_one(request, cache, due))
                    running.add(task)
                    task.add_done_callback(done)
                if running:
                    await asyncio.wait(running)
                if failures:
                    raise failures[0]
                await cache.flush()
            stats = cache.stats()
            tier_latency = {tier.name: tier.latency.get("load") for tier in cache.tiers}
    seconds = time.perf_counter() - started
    replayed = requests[: tally.requests]  # started in trace order, and every one finished
    unbounded = unbounded_hits(replayed)
    predicted = await asyncio.to_thread(_predict, replayed, config, tiers, stats)
    return build_report(
        config,
        requests,
        tally,
        stats,
        tier_latency,
        lag,
        seconds,
        unbounded,
        predicted,
        window,
        stop.is_set(),
    )


def _predict(
    requests: list[Request], config: ReplayConfig, tiers: list[dict[str, Any]], stats: dict[str, Any]
) -> dict[str, Any] | None:
    """What the sweep predicts for these requests at concurrency 1 on the capacities the run had
    (the primary tier, and an fs tier as the only secondary tier); None for other tiers."""
    if not tiers:
        return simulate(requests, config.block_bytes, config.primary_bytes, None)
    if len(tiers) == 1 and tiers[0].get("type") == "fs":
        [fs] = stats["tiers"].values()
        return simulate(requests, config.block_bytes, config.primary_bytes, fs["capacity_bytes"])
    return None


def _fill(
    device: torch.Tensor, ids: list[int], chain: tuple[int, ...] | list[int], payloads: _Payloads
) -> None:
    for block, hash_id in zip(ids, chain):
        payloads.fill(device[block], hash_id)


def _check(
    device: torch.Tensor, ids: list[int], chain: tuple[int, ...] | list[int], payloads: _Payloads
) -> int:
    """How many of the loaded blocks are not the bytes their ids were stored with."""
    return sum(not payloads.matches(device[block], hash_id) for block, hash_id in zip(ids, chain))


@contextlib.contextmanager
def _stop_on_sigint(stop: asyncio.Event) -> Iterator[None]:
    """Ctrl-C sets `stop`: no new requests start, those in flight finish, the report comes."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, stop.set)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)
