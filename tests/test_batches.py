"""`run_in_batches` driven with a hook that waits for the test: what one call holds while its
batches wait for the lane (no I/O; the lane is the real one)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest

from kvtier_async.batches import run_in_batches
from kvtier_async.scheduler import Priority, Scheduler
from kvtier_async.spec import SchedulerLimits

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup  # anyio's dependency there

BLOCKS = 12


@pytest.fixture
def scheduler() -> Iterator[Scheduler]:
    limits = SchedulerLimits(
        io_threads=1,
        copy_threads=1,
        max_inflight_loads=2,
        max_inflight_stores=2,
        max_pending_stores=BLOCKS,
        max_inflight_bytes=1 << 30,
        batch_blocks=2,
        chunk_blocks=2,
        store_slots=BLOCKS,
    )
    scheduler = Scheduler(limits)
    yield scheduler
    scheduler.close()


class HeldHook:
    """A `write_blocks` stand-in: each call waits until the test lets it go, in order of arrival."""

    def __init__(self) -> None:
        self.begun: list[list[bytes]] = []
        self.go = asyncio.Event()
        self.fail_at: bytes | None = None

    async def __call__(self, keys: list[bytes], blocks: list[memoryview]) -> list[bool]:
        self.begun.append(keys)
        if self.fail_at in keys:
            raise OSError("the backend failed")
        await self.go.wait()
        return [True] * len(keys)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def work() -> tuple[list[bytes], list[memoryview]]:
    return [bytes([i]) for i in range(BLOCKS)], [memoryview(bytes(1))] * BLOCKS


@pytest.mark.asyncio
async def test_a_call_holds_no_waiter_for_a_batch_that_cannot_run(scheduler: Scheduler) -> None:
    lane, hook = scheduler.lane("t", "store"), HeldHook()
    keys, blocks = work()
    results = [False] * BLOCKS
    tasks_before = len(asyncio.all_tasks())
    call = asyncio.ensure_future(
        run_in_batches(scheduler, lane, Priority.STORE, hook, keys, blocks, results, batch=2, block_nbytes=1)
    )
    await settle()
    # 6 batches, 2 places: the two running, nothing queued at the lane, one task per place.
    assert lane.stats()["inflight"] == 2 and lane.stats()["queued"] == 0
    assert len(asyncio.all_tasks()) - tasks_before <= 1 + lane.capacity
    hook.go.set()
    await call
    assert results == [True] * BLOCKS
    assert hook.begun == [keys[i : i + 2] for i in range(0, BLOCKS, 2)]  # begun in order
    assert lane.inflight == 0 and lane.max_inflight_seen == 2


@pytest.mark.asyncio
async def test_batches_never_begun_give_their_pending_room_back(scheduler: Scheduler) -> None:
    lane, hook = scheduler.lane("t", "store"), HeldHook()
    keys, blocks = work()
    assert lane.reserve_pending(BLOCKS) == BLOCKS

    def stores() -> Coroutine[Any, Any, None]:  # a store of every block, batches of two
        return run_in_batches(
            scheduler,
            lane,
            Priority.STORE,
            hook,
            keys,
            blocks,
            [False] * BLOCKS,
            batch=2,
            block_nbytes=1,
            pending=True,
        )

    call = asyncio.ensure_future(stores())
    await settle()
    assert lane.pending_blocks == BLOCKS - 4  # the two admitted batches gave theirs back
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert lane.pending_blocks == 0 and lane.inflight == 0

    # A failed batch ends the call; the batches after it give their room back too.
    assert lane.reserve_pending(BLOCKS) == BLOCKS
    hook.fail_at, hook.begun = keys[0], []  # the first batch fails while the second is held
    with pytest.raises(ExceptionGroup) as failed:
        await stores()
    assert failed.group_contains(OSError)
    assert lane.pending_blocks == 0 and lane.inflight == 0
    assert hook.begun == [keys[0:2], keys[2:4]]
