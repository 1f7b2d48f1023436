"""`SlotPool`: page-aligned memory in fixed slots, made once, handed out first come, first served.

A tier with a secret cannot move a block straight between the primary memory and its store:
what it stores is the block's sealed value (`block_format.BlockSealer`), a little longer. It
seals into, and reads sealed values into, slots of a pool like this one, made when the tier is
made (nothing allocated on the hot path) and faulted in when it opens (`populate`): memory
faulted page by page while a load reads into it costs the reading thread the faults (the
event loop's, for the Redis tier's direct connections), and O_DIRECT into freshly faulted
4 KiB pages that lie scattered in RAM runs at half the disk's speed here (see the fs tier's
`staging`). The pool is in transparent huge pages, like our primary tier's memory.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

from .primary import reserve_host_memory
from .spec import SchedulerLimits

__all__ = ["SlotPool", "for_batches_in_flight"]


def for_batches_in_flight(
    limits: SchedulerLimits, slot_bytes: int, cap_bytes: int, *, min_slots: int = 1
) -> SlotPool:
    """A pool with a slot for every block of every load and store the scheduler runs at once
    (a batch each), within `cap_bytes` unless that holds fewer than `min_slots`, and never less
    than one batch; slots page aligned."""
    stride = -(-slot_bytes // 4096) * 4096
    in_flight = (limits.max_inflight_loads + limits.max_inflight_stores) * limits.batch_blocks
    return SlotPool(max(limits.batch_blocks, min(in_flight, max(min_slots, cap_bytes // stride))), stride)


class SlotPool:
    """`count` slots of `slot_bytes`; `take(n)` waits until n are free (n <= count)."""

    def __init__(self, count: int, slot_bytes: int) -> None:
        if count < 1:
            raise ValueError("SlotPool: at least one slot")
        self.count = count
        self.slot_bytes = slot_bytes
        self._map = reserve_host_memory(count * slot_bytes)  # page aligned, zero filled
        self.view = memoryview(self._map)
        self._free = list(range(count))
        self._waiters: collections.deque[tuple[int, asyncio.Future[list[int]]]] = collections.deque()

    @property
    def nbytes(self) -> int:
        return self.count * self.slot_bytes

    def populate(self) -> None:
        """Fault every page in now, in order (a worker thread's work: it writes every byte)."""
        step = 64 << 20
        zeros = bytes(min(step, self.nbytes))
        for start in range(0, self.nbytes, step):
            end = min(start + step, self.nbytes)
            self.view[start:end] = zeros[: end - start]

    def slot(self, index: int, nbytes: int) -> memoryview:
        """The first `nbytes` of slot `index`."""
        start = index * self.slot_bytes
        return self.view[start : start + nbytes]

    async def take(self, n: int) -> list[int]:
        """n free slots, in turn with the callers before (event-loop thread)."""
        if not 1 <= n <= self.count:
            raise ValueError(f"SlotPool.take: {n} of {self.count} slots")
        if not self._waiters and len(self._free) >= n:
            return self._taken(n)
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, future))
        try:
            return await future
        except BaseException:
            if future.done() and not future.cancelled():
                self.give(future.result())  # granted as we were cancelled: give them back
            else:
                self._waiters.remove((n, future))
                self._wake()
            raise

    def parts(self, total: int) -> list[slice]:
        """Consecutive slices of `range(total)`, each of at most `count` items: a call's blocks in
        pieces the pool can hold at once."""
        return [slice(start, start + self.count) for start in range(0, total, self.count)]

    @contextlib.asynccontextmanager
    async def borrowed(self, n: int, nbytes: int) -> AsyncIterator[list[memoryview]]:
        """The first `nbytes` of n slots, given back when the block ends. Whoever uses them
        finishes every thread's and every connection's use of them inside the block."""
        taken = await self.take(n)
        try:
            yield [self.slot(i, nbytes) for i in taken]
        finally:
            self.give(taken)

    def give(self, slots: list[int]) -> None:
        """Give slots back (event-loop thread): the records' I/O into them has finished."""
        self._free += slots
        self._wake()

    def _taken(self, n: int) -> list[int]:
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def _wake(self) -> None:
        """Hand slots to the waiters in order while there are enough for the first."""
        while self._waiters and self._waiters[0][0] <= len(self._free):
            n, future = self._waiters.popleft()
            future.set_result(self._taken(n))
