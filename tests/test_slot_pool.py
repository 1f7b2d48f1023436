"""SlotPool: how many slots a tier's pool gets, and slots handed out in turn, never lost."""

from __future__ import annotations

import asyncio

import pytest

import kvtier_async as kt
from kvtier_async.slot_pool import SlotPool, for_batches_in_flight

MIB = 1 << 20


def limits() -> kt.SchedulerLimits:
    # 1 MiB blocks: batches of 16; 2 loads and a store at once, so 48 blocks in flight.
    spec = kt.OffloadingSpec(
        block_nbytes=MIB, num_cpu_blocks=64, namespace="pool", max_inflight_loads=2, max_inflight_stores=1
    )
    assert spec.limits.batch_blocks == 16
    return spec.limits


def test_a_pool_holds_the_batches_in_flight_within_its_cap() -> None:
    assert for_batches_in_flight(limits(), MIB, 1 << 30).count == 48
    assert for_batches_in_flight(limits(), MIB, 20 * MIB).count == 20
    assert for_batches_in_flight(limits(), MIB, 4 * MIB).count == 16  # never less than a batch


def test_min_slots_overrides_the_cap_but_not_what_is_in_flight() -> None:
    assert for_batches_in_flight(limits(), MIB, 4 * MIB, min_slots=24).count == 24
    assert for_batches_in_flight(limits(), MIB, 4 * MIB, min_slots=100).count == 48


def test_slots_are_page_aligned() -> None:
    pool = for_batches_in_flight(limits(), MIB + 52, 1 << 30)
    assert pool.slot_bytes == MIB + 4096
    assert len(pool.slot(1, MIB + 52)) == MIB + 52


def test_parts_cover_a_call_in_pieces_the_pool_holds() -> None:
    pool = SlotPool(4, 4096)
    assert pool.parts(10) == [slice(0, 4), slice(4, 8), slice(8, 12)]
    assert [len(range(10)[part]) for part in pool.parts(10)] == [4, 4, 2]


@pytest.mark.asyncio
async def test_slots_go_to_callers_in_turn() -> None:
    pool = SlotPool(4, 4096)
    first = await pool.take(3)
    big = asyncio.ensure_future(pool.take(3))  # waits: one slot free
    small = asyncio.ensure_future(pool.take(1))  # one is free, but the bigger caller came first
    await asyncio.sleep(0)
    assert not big.done() and not small.done()
    pool.give(first)
    assert len(await big) == 3
    assert len(await small) == 1
    assert set(big.result()).isdisjoint(small.result())


@pytest.mark.asyncio
async def test_a_cancelled_caller_loses_no_slot_and_holds_up_no_one() -> None:
    pool = SlotPool(2, 4096)
    held = await pool.take(1)
    waiting = asyncio.ensure_future(pool.take(2))  # needs both
    behind = asyncio.ensure_future(pool.take(1))  # one is free, but it waits its turn
    await asyncio.sleep(0)
    assert not waiting.done() and not behind.done()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.sleep(0)
    assert behind.done()  # the free slot went on to the next caller at once
    pool.give(held)
    pool.give(behind.result())
    assert sorted(await pool.take(2)) == [0, 1]  # and no slot was lost


@pytest.mark.asyncio
async def test_a_caller_asking_for_more_than_the_pool_holds_is_refused() -> None:
    with pytest.raises(ValueError, match="5 of 4"):
        await SlotPool(4, 4096).take(5)
