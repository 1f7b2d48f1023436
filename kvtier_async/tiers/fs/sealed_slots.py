"""`SealedSlots`: page-aligned memory where a tier with a secret keeps records while it seals
or opens them.

With a secret, what goes to disk is not the primary slot's bytes but their sealed value
(`block_format.BlockSealer`), a little longer. The records' I/O (`records.RecordIO`) works
on slots of one memory region by their offsets, with O_DIRECT; this is that region for sealed
records: a fixed number of record-sized slots, made once when the tier opens (so nothing is
allocated on the hot path), handed out on the event-loop thread first come, first served.
Like our primary tier's memory it is in transparent huge pages, faulted in order when the
tier opens (`populate`): O_DIRECT into freshly faulted 4 KiB pages that lie scattered in RAM
runs at half the disk's speed here (see `staging`).
"""

from __future__ import annotations

import asyncio
import collections

from ...primary import reserve_host_memory

__all__ = ["SealedSlots"]


class SealedSlots:
    """`count` slots of `record_bytes`; `take(n)` waits until n are free (n <= count)."""

    def __init__(self, count: int, record_bytes: int) -> None:
        if count < 1:
            raise ValueError("SealedSlots: at least one slot")
        self.count = count
        self.record_bytes = record_bytes
        self._map = reserve_host_memory(count * record_bytes)  # page aligned, zero filled
        self.view = memoryview(self._map)
        self._free = list(range(count))
        self._waiters: collections.deque[tuple[int, asyncio.Future[list[int]]]] = collections.deque()

    @property
    def nbytes(self) -> int:
        return self.count * self.record_bytes

    def populate(self) -> None:
        """Fault every page in now, in order (a worker thread's work: it writes every byte)."""
        step = 64 << 20
        zeros = bytes(min(step, self.nbytes))
        for start in range(0, self.nbytes, step):
            end = min(start + step, self.nbytes)
            self.view[start:end] = zeros[: end - start]

    def slot(self, index: int, nbytes: int) -> memoryview:
        """The first `nbytes` of slot `index`."""
        start = index * self.record_bytes
        return self.view[start : start + nbytes]

    async def take(self, n: int) -> list[int]:
        """n free slots, in turn with the callers before (event-loop thread)."""
        if not 1 <= n <= self.count:
            raise ValueError(f"SealedSlots.take: {n} of {self.count} slots")
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
