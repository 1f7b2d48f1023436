"""How one tier call becomes hook calls: batches of `batch_blocks`, each under a lane place and
its share of the bytes in flight, run concurrently.

A batch is one `write_blocks` / `read_blocks` call of the backend. It waits for a place
in the tier's lane of its direction (the scheduler's admission: loads first, at most
`max_inflight_*` calls per tier) and then for its bytes among the cache's bytes in
flight. A store's blocks hold room in the lane's pending budget until their batch is
admitted: each batch gives its share back then, or when it ends without admission.

A call runs its batches on at most as many tasks as its lane has places, each taking the next
batch when its last one ends: a call of many batches (a 2,048-block load is 8 batches at
64 KiB) holds no task, coroutine and lane waiter for a batch that could not run yet anyway.
Batches still begin in order and still queue at the lane by priority.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import suppress

import anyio

# anyio imports its asyncio backend (a dozen modules) on the first task group; here that
# is import time, not the middle of the first store, on the event loop. Should a future
# anyio move it, we pay on first use, as before.
with suppress(ImportError):
    import anyio._backends._asyncio

from .scheduler import Lane, Priority, Scheduler

__all__ = ["run_in_batches"]


async def run_in_batches(
    scheduler: Scheduler,
    lane: Lane,
    priority: Priority,
    call: Callable[[list[bytes], list[memoryview]], Awaitable[list[bool]]],
    keys: list[bytes],
    blocks: list[memoryview],
    results: list[bool],
    *,
    batch: int,
    block_nbytes: int,
    pending: bool = False,
) -> None:
    """`call(keys, blocks)` per batch; its outcomes into `results` at the batch's positions.

    With `pending`, the blocks hold pending room in `lane`, given back batch by batch.
    """

    async def one(start: int) -> None:
        part_keys = keys[start : start + batch]
        n = len(part_keys)
        admitted = False
        try:
            async with lane.place(priority):
                if pending:
                    lane.release_pending(n)
                    admitted = True
                async with scheduler.bytes_in_flight.place(priority, n * block_nbytes):
                    results[start : start + n] = await call(part_keys, blocks[start : start + batch])
        finally:
            if pending and not admitted:
                lane.release_pending(n)

    if len(keys) <= batch:
        await one(0)
        return
    starts = iter(range(0, len(keys), batch))  # shared: each task takes the next batch not begun

    async def take_turns() -> None:
        for start in starts:
            await one(start)

    try:
        async with anyio.create_task_group() as group:
            for _ in range(min(lane.capacity, -(-len(keys) // batch))):
                group.start_soon(take_turns)
    finally:
        if pending:  # the batches never begun (a batch failed, or we were cancelled)
            for start in starts:
                lane.release_pending(len(keys[start : start + batch]))
