"""Many requests at once against a memory tier and a real file-system tier.

- 1,000 operations cancelled at random points: afterwards every pin, filling
  slot, lane place, pending-store reservation and byte of budget is back, and
  the cache still round-trips exact bytes.
- 10,000 concurrent requests sharing prefixes: every block that a load
  reports is byte-exact.

Block contents are a function of the key, so any request can check any block.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from pathlib import Path
from typing import Any

import pytest
import torch

import kvtier_async as kt
import kvtier_async.tiers.fs

BLOCK_NBYTES = 512
WIDTH = BLOCK_NBYTES // 4  # int32 per block


def content(key: bytes) -> torch.Tensor:
    seed = hashlib.blake2b(key, digest_size=64).digest()
    return torch.frombuffer(bytearray(seed * (BLOCK_NBYTES // 64)), dtype=torch.int32)


def documents(count: int, blocks: int) -> list[list[bytes]]:
    """`count` token streams, each `blocks` blocks long; their keys are chained prefixes."""
    return [kt.block_hashes(range(d * 10**6, d * 10**6 + 16 * blocks), 16) for d in range(count)]


def make_cache(root: Path, device_blocks: int, **limits: Any) -> tuple[kt.TieredKVCache, torch.Tensor]:
    device = torch.zeros((device_blocks, WIDTH), dtype=torch.int32)
    spec = kt.OffloadingSpec(
        block_nbytes=BLOCK_NBYTES,
        num_cpu_blocks=limits.pop("num_cpu_blocks", 128),
        secondary_tiers=[
            {"type": "memory", "capacity_bytes": 64 * BLOCK_NBYTES},  # small: many fall to fs
            {"type": "fs", "root": str(root), "capacity_bytes": 64 << 20},
        ],
        **limits,
    )
    return kt.TieredKVCache(spec, device), device


def assert_quiet(cache: kt.TieredKVCache) -> None:
    """Nothing is held by anyone: the state a cache must return to once its calls are over."""
    stats = cache.stats()
    assert stats["primary_pinned_blocks"] == 0
    assert stats["primary_used_blocks"] == stats["primary_ready_blocks"]  # no slot left filling
    assert stats["background_stores"] == 0
    for name, lane in stats["scheduler"].items():
        assert lane["inflight"] == 0 and lane["queued"] == 0, name
        assert lane.get("pending_blocks", 0) == 0, name


async def request(
    cache: kt.TieredKVCache, device: torch.Tensor, keys: list[bytes], ids: list[int], action: str
) -> int:
    if action == "store":
        for key, block in zip(keys, ids):
            device[block] = content(key)
        return await cache.store(keys, ids)
    if action == "prefetch":
        return await cache.prefetch(keys)
    if action == "lookup":
        return await cache.lookup(keys)
    timeout = 0.05 if action == "load-deadline" else None
    loaded = await cache.load(keys, ids, timeout=timeout)
    for key, block in zip(keys[:loaded], ids[:loaded]):
        assert torch.equal(device[block], content(key)), "a load reported wrong bytes"
    return loaded


ACTIONS = ["store", "store", "load", "load", "load-deadline", "prefetch", "lookup"]


@pytest.mark.asyncio
async def test_1000_random_cancellations_give_everything_back(tmp_path: Path) -> None:
    rng = random.Random(5)
    docs = documents(12, 8)
    per_wave, width = 100, 8
    cache, device = make_cache(
        tmp_path,
        per_wave * width,
        num_cpu_blocks=48,
        max_inflight_loads=2,
        max_inflight_stores=1,
        max_pending_stores=24,
        max_inflight_bytes=6 * BLOCK_NBYTES,
    )
    cancelled = 0
    async with cache:
        while cancelled < 1000:
            tasks = []
            for r in range(per_wave):
                keys = rng.choice(docs)[: rng.randint(1, 8)]
                ids = list(range(r * width, r * width + len(keys)))
                tasks.append(asyncio.ensure_future(request(cache, device, keys, ids, rng.choice(ACTIONS))))
            victims = rng.sample(tasks, per_wave // 2)
            for _ in range(rng.randint(0, 40)):  # let the wave get under way, a random distance
                await asyncio.sleep(0)
            for victim in victims:
                if not victim.done() and cancelled < 1000:
                    victim.cancel()
                    cancelled += 1
                await asyncio.sleep(0)  # and cancel the next one a little later
            results = await asyncio.gather(*tasks, return_exceptions=True)
            errors = [r for r in results if isinstance(r, Exception)]  # CancelledError is not one
            assert not errors, errors[:3]
            await cache.flush()
            assert_quiet(cache)
        # Still whole: a fresh prefix round-trips exactly.
        fresh = documents(13, 8)[12]
        assert await request(cache, device, fresh, list(range(8)), "store") == 8
        device.zero_()
        assert await request(cache, device, fresh, list(range(8)), "load") == 8
        await cache.flush()
        assert_quiet(cache)


@pytest.mark.asyncio
async def test_10000_concurrent_requests_with_shared_prefixes_are_byte_exact(tmp_path: Path) -> None:
    rng = random.Random(7)
    docs = documents(40, 8)
    requests = 10_000
    # 160 blocks stored up front into 128 slots: loads find work in the secondary tiers too.
    cache, device = make_cache(tmp_path, requests * 8, num_cpu_blocks=128)
    async with cache:
        # Half the documents are stored up front, so loads find work in every tier.
        for r, doc in enumerate(docs[:20]):
            assert await request(cache, device, doc, list(range(r * 8, r * 8 + 8)), "store") == 8
            await cache.flush()  # set-up: each store is accepted whole (stores may hold half the slots)
        device.zero_()
        work = []
        for r in range(requests):
            keys = rng.choice(docs)[: rng.randint(1, 8)]
            action = rng.choice(["store", "load", "load", "prefetch", "lookup"])
            work.append(request(cache, device, keys, list(range(r * 8, r * 8 + len(keys))), action))
        results = await asyncio.gather(*work)
        await cache.flush()
        assert_quiet(cache)
        assert sum(results) > requests  # most requests moved blocks
        stats = cache.stats()
        assert stats["loaded_blocks"] > 0 and stats["promoted_blocks"] > 0
        # Everything stored is still there, exact, from whichever tier holds it.
        for r, doc in enumerate(docs):
            loaded = await request(cache, device, doc, list(range(r * 8, r * 8 + 8)), "load")
            assert loaded == 8 or r >= 20  # stored up front: must be complete
