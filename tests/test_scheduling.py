"""The scheduler seen through a probe tier: limits, priorities, drops, single flight, byte budget.

The probe (`probe_tier.ProbeTier`, loaded through `module_path` like any
out-of-tree tier) holds hook calls at gates and records concurrency and
per-key reads and writes, so every test here is deterministic: it waits for
states, never for time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import probe_tier  # imported up front: a first import reads files, which blocks the loop
import pytest
import torch

import kvtier_async as kt
from kvtier_async.turn_budget import TURN_BUDGET_S

BLOCK = 4096
NUM_SLOTS = 64


def make_tier(**limits: int) -> tuple[probe_tier.ProbeTier, bytearray]:
    spec = kt.OffloadingSpec(block_nbytes=BLOCK, num_cpu_blocks=NUM_SLOTS, **limits)  # type: ignore[arg-type]
    primary = bytearray(spec.primary_nbytes)
    for slot in range(NUM_SLOTS):
        primary[slot * BLOCK : (slot + 1) * BLOCK] = bytes([slot]) * BLOCK
    tier = kt.SecondaryTierFactory.create_secondary_tier(
        {"type": "ProbeTier", "module_path": "probe_tier"}, memoryview(primary), spec
    )
    assert isinstance(tier, probe_tier.ProbeTier)
    return tier, primary


async def yield_until(predicate: Callable[[], bool], rounds: int = 1000) -> None:
    """Let the other tasks run until `predicate` holds (for states the probe does not see)."""
    for _ in range(rounds):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("the state was not reached")


def keys(n: int, start: int = 0) -> list[bytes]:
    return [f"key-{i}".encode() for i in range(start, start + n)]


@pytest.mark.asyncio
@pytest.mark.parametrize("turn_budget_s", [TURN_BUDGET_S, pytest.param(0.0, id="no_turn_budget")])
async def test_lane_limits_are_never_exceeded(turn_budget_s: float) -> None:
    tier, _ = make_tier(max_inflight_loads=2, max_inflight_stores=3)
    # With no budget, every call after a turn's first goes on in a later turn: what a turn slower
    # than the budget does (a loaded machine, a collection in the middle), here every time.
    tier._turn.seconds = turn_budget_s
    async with tier:
        tier.gates["write"].clear()
        stores = [asyncio.ensure_future(tier.store([k], [i])) for i, k in enumerate(keys(20))]
        await tier.until(lambda: tier.held["write"] == 3)
        # The other 17 queue as they come on: calls begun in one turn of the loop share a slice
        # of it (`TurnBudget`), so some may go on in a later turn.
        await yield_until(lambda: tier.stats()["lanes"]["store"]["queued"] == 17)
        lanes = tier.stats()["lanes"]
        assert lanes["store"]["inflight"] == 3 and lanes["store"]["queued"] == 17
        tier.gates["write"].set()
        assert all(r == [True] for r in await asyncio.gather(*stores))

        tier.gates["read"].clear()
        loads = [asyncio.ensure_future(tier.load([k], [30 + i])) for i, k in enumerate(keys(20))]
        await tier.until(lambda: tier.held["read"] == 2)
        # As the stores: the other 18 queue as they come on, some in a later turn.
        await yield_until(lambda: tier.stats()["lanes"]["load"]["queued"] == 18)
        lanes = tier.stats()["lanes"]
        assert lanes["load"]["inflight"] == 2 and lanes["load"]["queued"] == 18
        tier.gates["read"].set()
        assert all(r == [True] for r in await asyncio.gather(*loads))
        assert (tier.max_running["read"], tier.max_running["write"]) == (2, 3)
        lanes = tier.stats()["lanes"]
        assert lanes["load"]["max_inflight_seen"] == 2 and lanes["store"]["max_inflight_seen"] == 3
        assert all(lanes[d]["inflight"] == lanes[d]["queued"] == 0 for d in ("load", "store"))


@pytest.mark.asyncio
async def test_a_failure_while_calls_wait_at_a_shut_gate_is_reported_not_hung() -> None:
    # Closing waits for the calls in flight: with the gates left shut, a failed assertion would
    # wait there for ever instead of failing the test.
    tier, _ = make_tier()
    with pytest.raises(AssertionError, match="a failed check"):
        async with asyncio.timeout(probe_tier.HANG_S):  # a guard against a hang, not a timing bound
            async with tier:
                tier.gates["write"].clear()
                store = asyncio.ensure_future(tier.store(keys(1), [0]))
                await tier.until(lambda: tier.held["write"] == 1)
                raise AssertionError("a failed check")
    assert tier.closed and await store == [True]


@pytest.mark.asyncio
async def test_a_load_completes_while_every_store_place_is_blocked() -> None:
    tier, primary = make_tier(max_inflight_loads=1, max_inflight_stores=2, max_pending_stores=8)
    async with tier:
        assert await tier.store(keys(1), [5]) == [True]
        tier.gates["write"].clear()
        stores = [asyncio.ensure_future(tier.store([k], [i])) for i, k in enumerate(keys(10, start=100))]
        await tier.until(lambda: tier.held["write"] == 2)
        assert await tier.load(keys(1), [40]) == [True]  # not behind the 8 queued stores
        assert primary[40 * BLOCK : 41 * BLOCK] == bytes([5]) * BLOCK
        assert tier.held["write"] == 2 and not any(s.done() for s in stores)
        tier.gates["write"].set()
        await asyncio.gather(*stores)


@pytest.mark.asyncio
async def test_a_freed_place_goes_to_a_waiting_load_before_a_waiting_store() -> None:
    # One place for both, through the byte budget: one block's bytes at a time.
    tier, _ = make_tier(max_inflight_bytes=BLOCK)
    async with tier:
        assert await tier.store(keys(1), [1]) == [True]
        tier.gates["write"].clear()
        first = asyncio.ensure_future(tier.store(keys(1, start=50), [2]))
        await tier.until(lambda: tier.held["write"] == 1)
        store = asyncio.ensure_future(tier.store(keys(1, start=51), [3]))
        load = asyncio.ensure_future(tier.load(keys(1), [4]))
        await yield_until(lambda: tier.scheduler.bytes_in_flight.stats()["queued"] == 2)
        tier.gates["read"].clear()
        tier.gates["write"].set()
        await tier.until(lambda: tier.held["read"] == 1)
        assert tier.running["write"] == 0 and not store.done()  # the load went first
        tier.gates["read"].set()
        assert await asyncio.gather(first, load, store) == [[True], [True], [True]]
        assert tier.scheduler.bytes_in_flight.max_inflight_seen == BLOCK


@pytest.mark.asyncio
async def test_excess_stores_are_dropped_at_once() -> None:
    tier, _ = make_tier(max_inflight_stores=1, max_pending_stores=4)
    async with tier:
        tier.gates["write"].clear()
        first = asyncio.ensure_future(tier.store(keys(1), [0]))
        await tier.until(lambda: tier.held["write"] == 1)
        waiting = asyncio.ensure_future(tier.store(keys(4, start=1), [1, 2, 3, 4]))
        await yield_until(lambda: tier.stats()["lanes"]["store"]["pending_blocks"] == 4)
        # The gate is still shut, yet this returns: nothing of it fits.
        assert await tier.store(keys(3, start=5), [5, 6, 7]) == [False] * 3
        assert tier.stats()["stores_dropped"] == 3
        tier.gates["write"].set()
        assert await first == [True] and await waiting == [True] * 4
        assert tier.stats()["lanes"]["store"]["pending_blocks"] == 0


@pytest.mark.asyncio
async def test_a_key_being_written_or_already_held_is_not_written_again() -> None:
    tier, _ = make_tier()
    async with tier:
        tier.gates["write"].clear()
        calls = [asyncio.ensure_future(tier.store(keys(8), list(range(8)))) for _ in range(10)]
        await tier.until(lambda: tier.held["write"] == 1)
        tier.gates["write"].set()
        assert await asyncio.gather(*calls) == [[True] * 8] * 10
        assert tier.key_writes == {k: 1 for k in keys(8)}
        # Stored already: answered from `contains`, no write at all.
        assert await tier.store(keys(8), list(range(8))) == [True] * 8
        assert tier.key_writes == {k: 1 for k in keys(8)}
        assert tier.stats()["stores_deduplicated"] == 9 * 8 + 8


@pytest.mark.asyncio
async def test_sharers_of_a_failed_write_see_it_fail() -> None:
    tier, _ = make_tier()
    async with tier:
        tier.gates["write"].clear()
        owner = asyncio.ensure_future(tier.store(keys(2), [0, 1]))
        await tier.until(lambda: tier.held["write"] == 1)
        sharer = asyncio.ensure_future(tier.store(keys(2), [0, 1]))
        await yield_until(lambda: tier.stats()["store_calls"] == 2)  # registered as a sharer
        owner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await owner
        assert await sharer == [False, False]  # not stored: no claim that it was
        tier.gates["write"].set()
        assert await tier.store(keys(2), [0, 1]) == [True, True]  # and the next store writes it


@pytest.mark.asyncio
async def test_one_read_per_key_for_100_concurrent_loads_of_one_prefix() -> None:
    layers = [torch.randint(-100, 100, (16 + 8 * 100, 1024), dtype=torch.int32)]
    spec = kt.OffloadingSpec(
        block_nbytes=4096,
        num_cpu_blocks=32,
        secondary_tiers=[{"type": "ProbeTier", "module_path": "probe_tier"}],
    )
    prefix = kt.block_hashes(range(16 * 8), 16)
    async with kt.TieredKVCache(spec, layers) as cache:
        probe = cache.tiers[0]
        assert isinstance(probe, probe_tier.ProbeTier)
        assert await cache.store(prefix, list(range(8))) == 8
        await cache.flush()
        for n in range(1, 5):  # other blocks push the prefix out of the primary tier
            others = kt.block_hashes(range(10**6 * n, 10**6 * n + 16 * 8), 16)
            assert await cache.store(others, list(range(8, 16))) == 8
            await cache.flush()
        assert all(cache.primary.lookup(k) is None for k in prefix)
        expected = layers[0][:8].clone()
        probe.gates["read"].clear()
        requests = []
        for r in range(100):  # every third one a prefetch; the loads into their own device blocks
            if r % 3 == 0:
                requests.append(asyncio.ensure_future(cache.prefetch(prefix)))
            else:
                ids = list(range(16 + 8 * r, 24 + 8 * r))
                requests.append(asyncio.ensure_future(cache.load(prefix, ids)))
        try:
            await probe.until(lambda: probe.held["read"] >= 1)
        finally:
            probe.gates["read"].set()  # a failure above must not leave the cache's close waiting on it
        assert await asyncio.gather(*requests) == [8] * 100
        assert probe.key_reads == {k: 1 for k in prefix}
        assert cache.stats()["primary_pinned_blocks"] == 0
        for r in range(100):
            if r % 3:
                assert torch.equal(layers[0][16 + 8 * r : 24 + 8 * r], expected)


@pytest.mark.asyncio
async def test_the_defaults_admit_a_whole_primary_tier_of_stores_on_an_idle_tier() -> None:
    # 512 blocks of 64 KiB in batches of 256: one batch in flight (one thread), one pending.
    spec = kt.OffloadingSpec(block_nbytes=64 << 10, num_cpu_blocks=512, io_threads=1)
    assert spec.limits.max_inflight_stores == 1 and spec.limits.batch_blocks == 256
    primary = bytearray(spec.primary_nbytes)
    tier = kt.SecondaryTierFactory.create_secondary_tier(
        {"type": "ProbeTier", "module_path": "probe_tier"}, memoryview(primary), spec
    )
    assert isinstance(tier, probe_tier.ProbeTier)
    async with tier:
        tier.gates["write"].clear()  # nothing is written until every block has been offered
        store = asyncio.ensure_future(tier.store(keys(512), list(range(512))))
        await tier.until(lambda: tier.held["write"] == 1)
        assert tier.stats()["lanes"]["store"]["pending_blocks"] == 256
        tier.gates["write"].set()
        assert await store == [True] * 512
        assert tier.stats()["stores_dropped"] == 0


@pytest.mark.asyncio
async def test_by_default_a_store_burst_takes_every_io_thread_and_a_load_still_goes_first() -> None:
    tier, primary = make_tier(io_threads=3)
    async with tier:
        assert await tier.store(keys(1), [5]) == [True]
        tier.gates["write"].clear()
        stores = [asyncio.ensure_future(tier.store([k], [i])) for i, k in enumerate(keys(9, start=100))]
        await tier.until(lambda: tier.held["write"] == 3)  # every thread writes
        load = asyncio.ensure_future(tier.load(keys(1), [40]))
        await tier.until(lambda: tier.stats()["lanes"]["load"]["inflight"] == 1)  # admitted at once
        tier.gates["write"].set()
        assert await load == [True]
        assert primary[40 * BLOCK : 41 * BLOCK] == bytes([5]) * BLOCK
        await asyncio.gather(*stores)
        assert tier.stats()["lanes"]["store"]["max_inflight_seen"] == 3
