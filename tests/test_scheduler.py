"""The lane's decisions are synchronous; these tests drive them without any I/O."""

from __future__ import annotations

import asyncio

import pytest

from kvtier_async.scheduler import Lane, Priority, wait_uncancellable


def test_admits_up_to_capacity() -> None:
    lane = Lane("t/load", 2)
    assert lane.try_admit()
    assert lane.try_admit()
    assert not lane.try_admit()
    lane.release()
    assert lane.inflight == 1 and lane.max_inflight_seen == 2


def test_pending_budget_drops_the_excess() -> None:
    lane = Lane("t/store", 1, max_pending_blocks=10)
    assert lane.reserve_pending(7) == 7
    assert lane.reserve_pending(7) == 3
    assert lane.reserve_pending(1) == 0
    lane.release_pending(10)
    assert lane.pending_blocks == 0


@pytest.mark.asyncio
async def test_waiters_go_best_priority_first() -> None:
    lane = Lane("t/load", 1)
    await lane.acquire(Priority.LOAD)
    order: list[str] = []

    async def wait(name: str, priority: Priority) -> None:
        await lane.acquire(priority)
        order.append(name)
        lane.release()

    tasks = [
        asyncio.ensure_future(wait(n, p))
        for n, p in [
            ("store", Priority.STORE),
            ("prefetch", Priority.PREFETCH),
            ("load1", Priority.LOAD),
            ("load2", Priority.LOAD),
        ]
    ]
    await asyncio.sleep(0)  # let every task queue up
    assert lane.stats()["queued"] == 4
    lane.release()
    await asyncio.gather(*tasks)
    assert order == ["load1", "load2", "prefetch", "store"]
    assert lane.inflight == 0 and lane.stats()["queued"] == 0


@pytest.mark.asyncio
async def test_cancelled_waiter_gives_its_turn_away() -> None:
    lane = Lane("t/load", 1)
    await lane.acquire(Priority.LOAD)
    first = asyncio.ensure_future(lane.acquire(Priority.LOAD))
    second = asyncio.ensure_future(lane.acquire(Priority.STORE))
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    lane.release()
    await second
    assert lane.inflight == 1
    lane.release()
    assert lane.inflight == 0 and lane.stats()["queued"] == 0


@pytest.mark.asyncio
async def test_granted_then_cancelled_passes_the_place_on() -> None:
    lane = Lane("t/load", 1)
    await lane.acquire(Priority.LOAD)
    first = asyncio.ensure_future(lane.acquire(Priority.LOAD))
    second = asyncio.ensure_future(lane.acquire(Priority.LOAD))
    await asyncio.sleep(0)
    lane.release()  # hands the place to `first`...
    first.cancel()  # ...which is cancelled before it runs
    await asyncio.gather(first, return_exceptions=True)
    await second
    assert lane.inflight == 1
    lane.release()
    assert lane.inflight == 0


@pytest.mark.asyncio
async def test_wait_uncancellable_outlives_a_cancel() -> None:
    loop = asyncio.get_running_loop()
    inner: asyncio.Future[int] = loop.create_future()
    outer = asyncio.ensure_future(wait_uncancellable(inner))
    await asyncio.sleep(0)
    outer.cancel()
    await asyncio.sleep(0)
    assert not outer.done()  # still waiting for the work it guards
    inner.set_result(3)
    with pytest.raises(asyncio.CancelledError):
        await outer


def test_amounts_fit_under_the_capacity_and_an_oversize_one_goes_alone() -> None:
    budget = Lane("bytes", 10)
    assert budget.try_admit(6)
    assert not budget.try_admit(5)
    assert budget.try_admit(4)
    budget.release(6)
    budget.release(4)
    assert budget.try_admit(25)  # larger than the whole budget, but nothing else is in flight
    assert not budget.try_admit(1)
    budget.release(25)
    assert budget.inflight == 0 and budget.max_inflight_seen == 25


@pytest.mark.asyncio
async def test_the_best_waiter_is_not_overtaken_by_a_smaller_one() -> None:
    budget = Lane("bytes", 10)
    await budget.acquire(Priority.LOAD, 8)
    big = asyncio.ensure_future(budget.acquire(Priority.LOAD, 6))
    small = asyncio.ensure_future(budget.acquire(Priority.STORE, 2))
    await asyncio.sleep(0)
    assert not big.done() and not small.done()  # 2 would fit, but the load is ahead
    budget.release(8)
    await big
    await small
    assert budget.inflight == 8


@pytest.mark.asyncio
async def test_a_cancelled_head_lets_the_waiters_behind_it_in() -> None:
    budget = Lane("bytes", 10)
    await budget.acquire(Priority.LOAD, 8)
    big = asyncio.ensure_future(budget.acquire(Priority.LOAD, 6))
    small = asyncio.ensure_future(budget.acquire(Priority.STORE, 2))
    await asyncio.sleep(0)
    big.cancel()
    await small  # fits beside the 8 once the head is gone
    assert budget.inflight == 10 and budget.stats()["queued"] == 0
    with pytest.raises(asyncio.CancelledError):
        await big
