from __future__ import annotations

import asyncio
import random
from pathlib import Path

import probe_tier  # imported up front: a first import reads files, which blocks the loop
import pytest
import torch

import kvtier_async as kt
import kvtier_async.tiers.fs  # imported up front too: the fs-tier test builds one on the loop

NUM_DEVICE_BLOCKS = 64


def make_layers(seed: int = 0) -> list[torch.Tensor]:
    """Three layer tensors of different dtypes; one block is 2*4*16*2 + 40 + 4*3*4 = 344 bytes."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(NUM_DEVICE_BLOCKS, 2, 4, 16, generator=g).to(torch.bfloat16),
        torch.randint(-128, 127, (NUM_DEVICE_BLOCKS, 40), generator=g, dtype=torch.int8),
        torch.randn(NUM_DEVICE_BLOCKS, 4, 3, generator=g),
    ]


BLOCK_NBYTES = 2 * 4 * 16 * 2 + 40 + 4 * 3 * 4


def make_spec(
    num_cpu_blocks: int = 16, tiers: list[dict[str, object]] | None = None, **kwargs: object
) -> kt.OffloadingSpec:
    return kt.OffloadingSpec(
        block_nbytes=BLOCK_NBYTES,
        num_cpu_blocks=num_cpu_blocks,
        secondary_tiers=[{"type": "memory"}] if tiers is None else tiers,
        **kwargs,  # type: ignore[arg-type]
    )


def keys_for(n: int, conversation: int = 0) -> list[bytes]:
    return kt.block_hashes([conversation * 100_000 + t for t in range(16 * n)], 16)


def block_bytes(layers: list[torch.Tensor], block: int) -> bytes:
    return b"".join(bytes(layer[block].contiguous().view(torch.uint8).flatten().tolist()) for layer in layers)


def snapshot(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    return [layer.clone() for layer in layers]


def wipe(layers: list[torch.Tensor]) -> None:
    for layer in layers:
        layer.zero_()


def same_blocks(a: list[torch.Tensor], ids_a: list[int], b: list[torch.Tensor], ids_b: list[int]) -> bool:
    return all(torch.equal(x[ids_a], y[ids_b]) for x, y in zip(a, b))


@pytest.mark.asyncio
async def test_round_trip_through_primary_only() -> None:
    layers = make_layers()
    keys = keys_for(8)
    async with kt.TieredKVCache(make_spec(tiers=[]), layers) as cache:
        ids = [5, 60, 3, 17, 0, 33, 9, 40]  # scattered
        assert await cache.store(keys, ids) == 8
        original = snapshot(layers)
        wipe(layers)
        targets = list(range(8))
        assert await cache.load(keys, targets) == 8
        assert same_blocks(original, ids, layers, targets)
        stats = cache.stats()
        assert stats["primary_hit_blocks"] == 8 and stats["primary_pinned_blocks"] == 0


@pytest.mark.asyncio
async def test_round_trip_after_primary_eviction_promotes() -> None:
    layers = make_layers(1)
    n = 40  # more than the primary tier's 16 slots: the store proceeds in chunks
    keys = keys_for(n)
    async with kt.TieredKVCache(make_spec(num_cpu_blocks=16), layers) as cache:
        assert await cache.store(keys, list(range(n))) == n
        await cache.flush()
        assert cache.stats()["tiers"]["memory"]["blocks"] == n
        assert cache.stats()["primary_evictions"] > 0
        original = snapshot(layers)
        wipe(layers)
        targets = list(range(n, NUM_DEVICE_BLOCKS)) + list(range(n - (NUM_DEVICE_BLOCKS - n)))
        assert await cache.load(keys, targets) == n
        assert same_blocks(original, list(range(n)), layers, targets)
        stats = cache.stats()
        assert stats["promoted_blocks"] > 0
        assert stats["primary_pinned_blocks"] == 0
        assert stats["loaded_blocks"] == n


@pytest.mark.asyncio
async def test_store_is_write_through_to_every_tier() -> None:
    layers = make_layers(2)
    tiers = [{"type": "memory", "capacity_bytes": 4 * BLOCK_NBYTES}, {"type": "memory"}]
    async with kt.TieredKVCache(make_spec(num_cpu_blocks=8, tiers=tiers), layers) as cache:
        keys = keys_for(12)
        assert await cache.store(keys, list(range(12))) == 12
        await cache.flush()
        stats = cache.stats()["tiers"]
        assert stats["memory"]["blocks"] == 4  # small tier kept the newest four
        assert stats["memory#1"]["blocks"] == 12
        original = snapshot(layers)
        wipe(layers)
        assert await cache.load(keys, list(range(12))) == 12  # the first ones from the 2nd tier
        assert same_blocks(original, list(range(12)), layers, list(range(12)))
        assert cache.stats()["tiers"]["memory#1"]["load_hits"] > 0


@pytest.mark.asyncio
async def test_load_returns_the_available_prefix() -> None:
    layers = make_layers(3)
    keys = keys_for(10)
    async with kt.TieredKVCache(make_spec(), layers) as cache:
        await cache.store(keys[:4] + keys[5:], [0, 1, 2, 3, 5, 6, 7, 8, 9])
        await cache.flush()
        assert await cache.lookup(keys) == 4
        assert await cache.load(keys, list(range(20, 30))) == 4
        assert await cache.load(keys_for(3, conversation=9), [0, 1, 2]) == 0
        assert await cache.lookup([]) == 0
        assert await cache.load([], []) == 0
        assert cache.stats()["primary_pinned_blocks"] == 0


@pytest.mark.asyncio
async def test_lookup_spans_primary_and_tiers() -> None:
    layers = make_layers(4)
    keys = keys_for(30)
    async with kt.TieredKVCache(make_spec(num_cpu_blocks=8), layers) as cache:
        assert await cache.store(keys, list(range(30))) == 30
        await cache.flush()
        # The primary tier holds only the newest blocks; the rest live in the memory tier.
        assert cache.primary.lookup(keys[0]) is None
        assert await cache.lookup(keys) == 30


@pytest.mark.asyncio
async def test_per_tier_counters_say_where_lookups_found_and_loads_took_each_block() -> None:
    layers = make_layers(5)
    tiers = [{"type": "memory", "capacity_bytes": 4 * BLOCK_NBYTES}, {"type": "memory"}]
    keys = keys_for(12)
    async with kt.TieredKVCache(make_spec(num_cpu_blocks=8, tiers=tiers), layers) as cache:
        # In two flushed steps: in one call of 12 into 8 slots, which blocks stay in the primary
        # depends on which earlier blocks' tier writes still pin their slots (timing). Here blocks
        # 0-3 are written and unpinned before 4-11 come, and are the only ones to evict.
        assert await cache.store(keys[:4], list(range(4))) == 4
        await cache.flush()
        assert await cache.store(keys[4:], list(range(4, 12))) == 8
        await cache.flush()
        # Primary: the newest 8 (blocks 4-11); tier "memory": the newest 4 (8-11); "memory#1": all.
        assert [cache.primary.lookup(k) is not None for k in keys] == [False] * 4 + [True] * 8
        assert await cache.lookup(keys + keys_for(1, conversation=7)) == 12
        stats = cache.stats()
        assert (stats["lookup_calls"], stats["lookup_blocks"]) == (1, 13)
        assert stats["found_blocks"] == {"primary": 8, "memory": 0, "memory#1": 4}
        assert stats["loaded_from"] == {"primary": 0, "memory": 0, "memory#1": 0}
        assert await cache.load(keys[4:10], list(range(20, 26))) == 6
        assert await cache.load(keys[:2], list(range(30, 32))) == 2
        stats = cache.stats()
        assert stats["loaded_from"] == {"primary": 6, "memory": 0, "memory#1": 2}
        assert sum(stats["loaded_from"].values()) == stats["loaded_blocks"]
        # Where each leading block is now: the load promoted blocks 0, 1 and 4-9 into the primary.
        sources = await cache.lookup_sources(keys[:3])
        assert sources == ["primary", "primary", "memory#1"]
        assert await cache.lookup_sources(keys_for(1, conversation=7)) == []


@pytest.mark.asyncio
async def test_prefetch_then_load_hits_primary() -> None:
    layers = make_layers(5)
    keys = keys_for(20)
    async with kt.TieredKVCache(make_spec(num_cpu_blocks=8), layers) as cache:
        await cache.store(keys, list(range(20)))
        await cache.flush()
        assert await cache.prefetch(keys[:6]) == 6
        assert all(cache.primary.lookup(k) is not None for k in keys[:6])
        before = cache.stats()["primary_hit_blocks"]
        original = snapshot(layers)
        wipe(layers)
        assert await cache.load(keys[:6], list(range(6))) == 6
        assert cache.stats()["primary_hit_blocks"] - before == 6
        assert same_blocks(original, list(range(6)), layers, list(range(6)))


@pytest.mark.asyncio
async def test_keys_already_held_are_not_copied_again() -> None:
    layers = make_layers(6)
    keys = keys_for(6)
    async with kt.TieredKVCache(make_spec(), layers) as cache:
        assert await cache.store(keys[:4], list(range(4))) == 4
        copied = cache.stats()["bytes_to_host"]
        assert await cache.store(keys, list(range(6))) == 6
        assert cache.stats()["bytes_to_host"] - copied == 2 * BLOCK_NBYTES


@pytest.mark.asyncio
async def test_store_stops_when_every_slot_is_pinned_by_others() -> None:
    layers = make_layers(7)
    async with kt.TieredKVCache(make_spec(num_cpu_blocks=4, tiers=[]), layers) as cache:
        held = []
        for key in keys_for(4, conversation=1):
            slot = cache.primary.allocate(key)
            assert slot is not None
            held.append(slot)
        assert await cache.store(keys_for(3), [0, 1, 2]) == 0
        assert cache.stats()["store_rejected_blocks"] == 3
        for slot in held:
            cache.primary.abort(slot)
        assert await cache.store(keys_for(3), [0, 1, 2]) == 3


@pytest.mark.asyncio
async def test_load_deadline_returns_the_prefix_done_in_time() -> None:
    layers = make_layers(8)
    tiers = [{"type": "GatedTier", "module_path": "probe_tier"}]
    keys = keys_for(12)
    spec = make_spec(num_cpu_blocks=16, tiers=tiers)
    assert spec.limits.chunk_blocks == 4
    async with kt.TieredKVCache(spec, layers) as cache:
        gated = cache.tiers[0]
        assert isinstance(gated, probe_tier.GatedTier)
        assert await cache.store(keys, list(range(12))) == 12
        await cache.flush()  # unpins them: a store does not wait on other calls' writes
        # 16 other blocks push all of those out of the primary tier; then 0..3 come back.
        assert await cache.store(keys_for(16, conversation=5), list(range(40, 56))) == 16
        await cache.flush()
        assert await cache.store(keys[:4], list(range(4))) == 4
        await cache.flush()
        assert [cache.primary.lookup(k) is not None for k in keys] == [True] * 4 + [False] * 8
        gated.gated.add(keys[8])  # the third chunk's read never finishes until the gate opens
        original = snapshot(layers)
        wipe(layers)
        assert await cache.load(keys, list(range(12)), timeout=1.0) == 8
        assert same_blocks(original, list(range(8)), layers, list(range(8)))
        stats = cache.stats()
        assert stats["deadline_misses"] == 1 and stats["primary_pinned_blocks"] == 0
        assert cache.primary.lookup(keys[8]) is None and not cache.primary.is_filling(keys[8])
        gated.gate.set()
        assert await cache.load(keys, list(range(12))) == 12
        assert same_blocks(original, list(range(12)), layers, list(range(12)))


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("keys", "ids", "message"),
    [
        (keys_for(2), [0], "pair one to one"),
        (keys_for(1), [NUM_DEVICE_BLOCKS], "out of range"),
        (keys_for(2), [1, 1], "must not repeat"),
        (["abc"], [0], "must be bytes"),
        ([b"x" * 200], [0], "1..128"),
    ],
)
async def test_argument_errors_change_nothing(keys: list[bytes], ids: list[int], message: str) -> None:
    layers = make_layers(9)
    async with kt.TieredKVCache(make_spec(), layers) as cache:
        await cache.store(keys_for(3, conversation=7), [10, 11, 12])
        await cache.flush()
        before_layers = snapshot(layers)
        before_stats = cache.stats()
        before_primary = bytes(cache.primary.view)
        for call in (cache.store, cache.load):
            with pytest.raises(kt.InvalidArgumentError, match=message):
                await call(keys, ids)
        with pytest.raises(kt.InvalidArgumentError):
            await cache.load(keys_for(1), [0], timeout=-1)
        assert cache.stats() == before_stats
        assert bytes(cache.primary.view) == before_primary
        assert all(torch.equal(a, b) for a, b in zip(before_layers, layers))


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ([torch.zeros(4, BLOCK_NBYTES + 1, dtype=torch.uint8)], "block_nbytes"),
        ([torch.zeros(4, 300, dtype=torch.uint8), torch.zeros(5, 44, dtype=torch.uint8)], "dim 0"),
        ([torch.zeros(BLOCK_NBYTES, 4, dtype=torch.uint8).t()], "contiguous"),
        ([], "at least one"),
        ("not tensors", "tensor"),
    ],
)
def test_constructor_checks_the_kv_layout(layers: object, message: str) -> None:
    with pytest.raises(kt.InvalidArgumentError, match=message):
        kt.TieredKVCache(make_spec(), layers)


@pytest.mark.asyncio
async def test_closed_cache_refuses_calls_and_close_flushes() -> None:
    layers = make_layers(10)
    cache = kt.TieredKVCache(make_spec(), layers)
    tier = cache.tiers[0]
    assert await cache.store(keys_for(5), list(range(5))) == 5
    await cache.aclose()  # the background writes finish first: acknowledged stores are kept
    assert tier.stats()["stored_blocks"] == 5
    await cache.aclose()
    with pytest.raises(kt.ClosedError):
        await cache.load(keys_for(1), [0])
    with pytest.raises(kt.ClosedError):
        await cache.store(keys_for(1), [0])


@pytest.mark.asyncio
@pytest.mark.parametrize("yields", [0, 1, 2, 3, 4, 6, 9, 14, 20])
async def test_cancelled_store_and_load_leave_no_pins(yields: int) -> None:
    layers = make_layers(11)
    keys = keys_for(40)
    async with kt.TieredKVCache(make_spec(num_cpu_blocks=12), layers) as cache:
        for operation in (cache.store, cache.load, cache.prefetch):
            args = (keys,) if operation == cache.prefetch else (keys, list(range(40)))
            task = asyncio.ensure_future(operation(*args))  # type: ignore[operator]
            for _ in range(yields):
                await asyncio.sleep(0)  # scheduling points, not time
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await cache.flush()
            assert cache.stats()["primary_pinned_blocks"] == 0
        # Still works end to end.
        fresh = keys_for(20, conversation=3)
        assert await cache.store(fresh, list(range(20))) == 20
        await cache.flush()
        original = snapshot(layers)
        wipe(layers)
        assert await cache.load(fresh, list(range(20, 40))) == 20
        assert same_blocks(original, list(range(20)), layers, list(range(20, 40)))
        assert cache.stats()["primary_pinned_blocks"] == 0


@pytest.mark.asyncio
async def test_concurrent_requests_with_random_cancellations_stay_exact() -> None:
    """Many overlapping conversations; a third of the calls are cancelled at random points."""
    rng = random.Random(1234)
    layers = make_layers(12)
    # Device block b of conversation c holds content derived from (c, b) only.
    conversations = {c: keys_for(8, conversation=c) for c in range(6)}
    reference = snapshot(layers)
    tiers = [{"type": "memory", "capacity_bytes": 64 * BLOCK_NBYTES}]  # holds all 48 blocks
    async with kt.TieredKVCache(make_spec(num_cpu_blocks=10, tiers=tiers), layers) as cache:
        for c, keys in conversations.items():
            ids = list(range(c * 8, c * 8 + 8))
            assert await cache.store(keys, ids) == 8
            await cache.flush()  # a store does not wait on other calls' writes

        async def request(c: int) -> tuple[int, int]:
            n = rng.randint(1, 8)
            return c, await cache.prefetch(conversations[c][:n])

        tasks = [asyncio.ensure_future(request(rng.randrange(6))) for _ in range(60)]
        for _ in range(3):
            await asyncio.sleep(0)
        for task in rng.sample(tasks, 20):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert cache.stats()["primary_pinned_blocks"] == 0
        wipe(layers)
        for c, keys in conversations.items():
            ids = list(range(c * 8, c * 8 + 8))
            assert await cache.load(keys, ids) == 8
            assert same_blocks(reference, ids, layers, ids)
        assert cache.stats()["primary_pinned_blocks"] == 0


@pytest.mark.asyncio
async def test_a_load_waits_for_a_block_another_load_is_promoting() -> None:
    layers = make_layers(13)
    tiers = [{"type": "GatedTier", "module_path": "probe_tier"}]
    keys = keys_for(6)
    async with kt.TieredKVCache(make_spec(num_cpu_blocks=16, tiers=tiers), layers) as cache:
        gated = cache.tiers[0]
        assert isinstance(gated, probe_tier.GatedTier)
        await cache.store(keys, list(range(6)))
        await cache.flush()
        await cache.store(keys_for(16, conversation=2), list(range(40, 56)))  # evicts all six
        await cache.flush()
        assert all(cache.primary.lookup(k) is None for k in keys)
        original = snapshot(layers)
        wipe(layers)
        gated.gated.update(keys)
        first = asyncio.ensure_future(cache.load(keys, list(range(6))))
        await gated.waiting.wait()
        assert cache.primary.is_filling(keys[0])
        second = asyncio.ensure_future(cache.load(keys, list(range(10, 16))))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not second.done()  # it waits for the blocks the first load is filling
        gated.gate.set()
        assert await first == 6 and await second == 6
        assert same_blocks(original, list(range(6)), layers, list(range(6)))
        assert same_blocks(original, list(range(6)), layers, list(range(10, 16)))
        assert sorted(gated.reads) == sorted(keys)  # each block was read from the tier once
        assert cache.stats()["primary_pinned_blocks"] == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("num_cpu_blocks", [256, 12], ids=["one-chunk", "many-chunks"])
async def test_large_store_and_cold_load_through_the_fs_tier_never_block_the_loop(
    tmp_path: Path, num_cpu_blocks: int
) -> None:
    """blockbuster is active here: any blocking call on the event-loop thread fails the test."""
    blocks = 60
    layers = [torch.randint(0, 256, (blocks, 8192), dtype=torch.uint8) for _ in range(4)]
    original = snapshot(layers)
    keys = keys_for(blocks)
    fs = [{"type": "fs", "root": str(tmp_path / "kv"), "capacity_bytes": 64 << 20}]
    spec = kt.OffloadingSpec(block_nbytes=4 * 8192, num_cpu_blocks=num_cpu_blocks, secondary_tiers=fs)
    expected_chunks = -(-blocks // spec.limits.chunk_blocks)
    assert (expected_chunks == 1) == (num_cpu_blocks == 256)
    async with kt.TieredKVCache(spec, layers) as cache:
        assert await cache.store(keys, list(range(blocks))) == blocks
        await cache.flush()
    wipe(layers)
    async with kt.TieredKVCache(spec, layers) as cache:  # a cold primary tier: all from disk
        assert await cache.load(keys, list(range(blocks))) == blocks
        assert cache.stats()["promoted_blocks"] == blocks
        assert cache.stats()["primary_pinned_blocks"] == 0
    assert all(torch.equal(a, b) for a, b in zip(original, layers))
