"""Fault and sharing scenarios that every tier backed by a server must pass (Redis, S3)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import mmap
import random
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import kvtier_async as kt
from kvtier_async.testing import make_key


def make_tier(tier_config: dict[str, Any]) -> tuple[Any, kt.PrimaryTier]:
    spec = kt.OffloadingSpec(block_nbytes=8192 + 100, num_cpu_blocks=16, namespace="remote-tests")
    primary = kt.PrimaryTier(spec, pin_memory=False)
    return kt.SecondaryTierFactory.create_secondary_tier(tier_config, primary.view, spec), primary


def fill(primary: kt.PrimaryTier, slots: list[int], seed: int) -> list[bytes]:
    """Seeded random bytes into `slots`; returns what each got."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for slot in slots:
        data = bytes(torch.randint(0, 256, (primary.block_nbytes,), generator=g, dtype=torch.uint8).tolist())
        primary.slot_view(slot)[:] = data
        out.append(data)
    return out


class Clock:
    """A clock for a tier's fault breaker that moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def killed_and_restarted(
    tier_config: dict[str, Any], stop: Callable[[], Awaitable[None]], start: Callable[[], Awaitable[None]]
) -> None:
    """The server dies during a stream of stores and loads, then comes back empty on the same port:
    nothing raises, the calls in between fail or miss (counted), soon without calling the server
    (the fault breaker), and once the breaker's cool-down is over the same tier object works again."""
    tier, primary = make_tier(tier_config)
    clock = Clock()
    tier.fault_breaker.clock = clock
    async with tier:
        keys = [make_key(i, b"k") for i in range(8)]
        payloads = fill(primary, list(range(8)), seed=2)
        assert await tier.store(keys, list(range(8))) == [True] * 8

        stopped = asyncio.Event()

        async def traffic(after_stop: int) -> None:  # a stream of stores and loads, none may raise
            i = left = 0
            while not stopped.is_set() or left < after_stop:  # runs on past the server's death
                left += stopped.is_set()
                i += 1
                await tier.store([make_key(100 + i, b"s")], [i % 8])
                await tier.load(keys[:2], [8, 9])
                # Once the breaker is open, calls return without suspending: a stream that did
                # not yield would starve the test (and the server's stop) for ever.
                await asyncio.sleep(0)

        stream = asyncio.ensure_future(traffic(10))
        await asyncio.sleep(0)  # under way
        await stop()
        stopped.set()
        await asyncio.wait_for(stream, 120)  # a hang guard only; every call is bounded by timeout_s
        assert await tier.store([make_key(999)], [0]) == [False]
        assert await tier.load(keys, list(range(8, 16))) == [False] * 8
        stats = tier.stats()
        assert stats["errors"] > 0 and stats["calls_skipped_while_down"] > 0
        assert stats["fault_breaker"] == "open"
        await start()  # the same port, and empty: a restarted server may have lost everything
        clock.now += 60.0  # past the longest cool-down: the next call is the probe
        assert await tier.load(keys[:1], [8]) == [False]
        assert tier.stats()["fault_breaker"] == "closed"
        assert await tier.store(keys, list(range(8))) == [True] * 8
        assert await tier.load(keys, list(range(8, 16))) == [True] * 8
        assert [bytes(primary.slot_view(s)) for s in range(8, 16)] == payloads


async def the_primary_memory_is_free_after_the_server_died(
    tier_config: dict[str, Any], stop: Callable[[], Awaitable[None]]
) -> None:
    """vLLM unmaps its /dev/shm region at shutdown only if nothing exports it any more: the
    errors of a server that died under our calls must not keep views of that memory alive."""
    spec = kt.OffloadingSpec(block_nbytes=8192 + 100, num_cpu_blocks=16, namespace="remote-tests")
    region = mmap.mmap(-1, spec.primary_nbytes)
    view = memoryview(region)
    tier = kt.SecondaryTierFactory.create_secondary_tier(tier_config, view, spec)
    keys = [make_key(i, b"m") for i in range(8)]
    async with tier:
        assert await tier.store(keys, list(range(8))) == [True] * 8

        async def traffic(n: int) -> None:
            for i in range(n):
                await tier.store([make_key(100 + i, b"m")], [i % 8])
                await tier.load(keys, list(range(8, 16)))

        streams = asyncio.gather(*(traffic(20) for _ in range(4)))
        await asyncio.sleep(0)  # under way
        await stop()
        await asyncio.wait_for(streams, 120)  # a hang guard only
    view.release()
    region.close()  # BufferError while anything still exports the memory


async def a_dead_server_is_soon_not_called(tier_config: dict[str, Any]) -> None:
    """Against a server that is down or stuck, each call costs a fault (a timeout, or retries)
    until the breaker opens; then calls fail at once, and after a cool-down one probe goes."""
    tier, _primary = make_tier(tier_config)
    clock = Clock()
    tier.fault_breaker.clock = clock
    streak = tier.fault_breaker.streak
    async with tier:
        # The server is down or stuck at start already: the start-up's opening is a counted fault.
        assert tier.stats()["errors"] == 1
        for n in range(30):
            before = tier.stats()
            assert await tier.load([make_key(n)], [0]) == [False]
            after = tier.stats()
            if before["fault_breaker"] == "closed":  # a fault each
                assert after["errors"] == before["errors"] + 1
            else:  # open: failed at once, the server not called
                assert after["errors"] == before["errors"]
                assert after["calls_skipped_while_down"] == before["calls_skipped_while_down"] + 1
        stats = tier.stats()
        assert stats["fault_breaker"] == "open"
        # `streak` faults in a row opened it: the start-up's is one of them, unless an opening that
        # needs no server (S3's, where only the start-up asks the server) succeeded since.
        assert streak <= stats["errors"] <= streak + 1
        assert stats["errors"] + stats["calls_skipped_while_down"] == 1 + 30
        clock.now += 60.0
        loads = [tier.load([make_key(n)], [n % 8]) for n in range(10)]
        assert await asyncio.gather(*loads) == [[False]] * 10
        again = tier.stats()
        assert again["errors"] == stats["errors"] + 1  # one probe went
        assert again["calls_skipped_while_down"] == stats["calls_skipped_while_down"] + 9
        assert again["fault_breaker"] == "open"  # the probe failed: cooling down again


async def unreachable_is_a_counted_miss(tier_config: dict[str, Any]) -> dict[str, Any]:
    """Against a server that is down or stuck: False and misses, no exception; returns the stats."""
    tier, primary = make_tier(tier_config)
    async with tier:
        fill(primary, [0], seed=5)
        assert await tier.store([make_key(0)], [0]) == [False]
        assert await tier.load([make_key(0)], [1]) == [False]
        stats: dict[str, Any] = tier.stats()
    assert stats["errors"] >= 2
    return stats


SHARER = textwrap.dedent(
    """
    import asyncio, json, sys, torch
    import kvtier_async as kt

    async def main(tier_config):
        device = torch.arange(32 * 1024, dtype=torch.int32).reshape(32, 1024) * 7 + 3
        spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=16, namespace="shared",
                                 secondary_tiers=[tier_config])
        keys = kt.block_hashes(range(16 * 12), 16, namespace="shared")
        async with kt.TieredKVCache(spec, device) as cache:
            assert await cache.store(keys, list(range(12))) == 12
            await cache.flush()
            assert cache.stats()["tiers"][tier_config["type"]]["stored_blocks"] == 12

    asyncio.run(main(json.loads(sys.argv[1])))
    """
)


async def shared_between_processes(tier_config: dict[str, Any], work: Path) -> None:
    """Another process stores through its own cache; this one loads the same bytes."""
    script = work / "sharer.py"
    await asyncio.to_thread(script.write_text, SHARER)
    process = await asyncio.create_subprocess_exec(sys.executable, str(script), json.dumps(tier_config))
    assert await process.wait() == 0
    expected = torch.arange(32 * 1024, dtype=torch.int32).reshape(32, 1024) * 7 + 3
    device = torch.zeros((32, 1024), dtype=torch.int32)

    def spec_for(namespace: str) -> kt.OffloadingSpec:
        return kt.OffloadingSpec(
            block_nbytes=4096, num_cpu_blocks=16, namespace=namespace, secondary_tiers=[tier_config]
        )

    keys = kt.block_hashes(range(16 * 12), 16, namespace="shared")
    async with kt.TieredKVCache(spec_for("shared"), device) as cache:
        assert await cache.lookup(keys) == 12
        assert await cache.load(keys, list(range(20, 32))) == 12
    assert torch.equal(device[20:32], expected[:12])
    other = kt.block_hashes(range(16 * 12), 16, namespace="other")
    async with kt.TieredKVCache(spec_for("other"), device) as cache:
        assert await cache.lookup(other) == 0  # another namespace sees none of it


#: A serving frontend's burst: this many callers at once, each mixing stores, lookups and loads.
CALLERS = 256
BATCH = 4  # blocks per call
SHARED_KEYS = 64  # every caller stores and reads some of these too, as requests share prefixes


def content_of(key: bytes, nbytes: int) -> bytes:
    """A block's bytes as a function of its key, so any caller can check any block it loads."""
    return hashlib.shake_256(key).digest(nbytes)


async def many_callers_at_once(
    tier_config: dict[str, Any], caplog: pytest.LogCaptureFixture, *, rounds: int = 4
) -> dict[str, Any]:
    """`CALLERS` tasks start together at default settings, each storing, looking up and loading
    batches of 64 KiB blocks, private and shared. However far that outruns the tier's
    connections or requests, nothing fails for the tier's own reasons: no call raises, no error
    or fault is counted, nothing is logged at WARNING, the breaker stays closed, every store
    the pending budget accepted is acknowledged, and every acknowledged block is found and
    loads byte-exact. Returns the tier's stats."""
    nbytes = 64 << 10
    spec = kt.OffloadingSpec(block_nbytes=nbytes, num_cpu_blocks=CALLERS * 2 * BATCH, namespace="burst")
    primary = kt.PrimaryTier(spec, pin_memory=False)
    tier = kt.SecondaryTierFactory.create_secondary_tier(tier_config, primary.view, spec)
    shared = [make_key(i, b"shared") for i in range(SHARED_KEYS)]
    acknowledged: set[bytes] = set()
    refused = 0
    start = asyncio.Event()

    async def caller(n: int) -> None:
        nonlocal refused
        rng = random.Random(n)
        mine = [make_key(n * 1000 + i, b"private") for i in range(rounds * BATCH)]
        sources = [n * 2 * BATCH + i for i in range(BATCH)]
        targets = [n * 2 * BATCH + BATCH + i for i in range(BATCH)]
        await start.wait()
        for r in range(rounds):
            fresh = mine[r * BATCH : (r + 1) * BATCH]
            keys = fresh if rng.random() < 0.5 else rng.sample(shared, BATCH)
            for key, slot in zip(keys, sources):
                primary.slot_view(slot)[:] = content_of(key, nbytes)
            stored = await tier.store(keys, sources)
            acknowledged.update(k for k, ok in zip(keys, stored) if ok)
            refused += stored.count(False)
            known = [k for k in keys if k in acknowledged]
            if rng.random() < 0.5:
                assert await tier.lookup(known) == len(known), "an acknowledged block was not found"
            loaded = await tier.load(known, targets[: len(known)])
            assert loaded == [True] * len(known), "an acknowledged block did not load"
            for key, slot in zip(known, targets):
                assert bytes(primary.slot_view(slot)) == content_of(key, nbytes), "wrong bytes"

    with caplog.at_level(logging.WARNING, logger="kvtier_async"):
        async with tier:
            callers = [asyncio.ensure_future(caller(n)) for n in range(CALLERS)]
            start.set()
            await asyncio.gather(*callers)
            stats: dict[str, Any] = tier.stats()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert stats["errors"] == 0 and stats["calls_skipped_while_down"] == 0, stats
    assert stats["fault_breaker"] == "closed"
    assert stats["store_failed_blocks"] == 0 and refused == stats["stores_dropped"], stats
    assert stats["load_misses"] == 0, stats
    return stats
