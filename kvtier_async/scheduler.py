"""`Scheduler`: lanes that bound how much work each tier has in flight, and the worker threads.

The decisions (admit, queue, hand off, drop) are plain synchronous methods on
`Lane`; `Lane.acquire` only awaits around them. A lane per tier and direction
limits concurrent `read_blocks` / `write_blocks` calls; a freed place goes to
the waiter of the best priority (demand loads, then prefetches, then stores).
Stores have a second bound, on blocks waiting for a place: beyond it they are
dropped at once rather than queued without end.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from enum import IntEnum
from typing import Any, Literal, TypeVar

from .spec import OffloadingSpec, SchedulerLimits
from .workers import WorkerThreads, wait_uncancellable

__all__ = ["Lane", "Priority", "Scheduler", "wait_uncancellable"]

T = TypeVar("T")
Direction = Literal["load", "store"]


class Priority(IntEnum):
    """Lower goes first."""

    LOAD = 0
    PREFETCH = 1
    STORE = 2


class Lane:
    """At most `capacity` holders at once; waiters are admitted best priority first, FIFO within."""

    def __init__(self, name: str, capacity: int, max_pending_blocks: int | None = None) -> None:
        self.name = name
        self.capacity = capacity
        self.max_pending_blocks = max_pending_blocks
        self.inflight = 0
        self.max_inflight_seen = 0
        self.pending_blocks = 0
        self._queued = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    # -- synchronous decisions ---------------------------------------------------------------
    def try_admit(self) -> bool:
        """Take a place now if one is free and nobody is queued (a waiter comes first)."""
        if self.inflight < self.capacity and self._queued == 0:
            self._take()
            return True
        return False

    def release(self) -> None:
        """Give a place back; it passes straight to the best live waiter, if any."""
        while self._waiters:
            _, _, waiter = heapq.heappop(self._waiters)
            if not waiter.done():
                self._queued -= 1
                waiter.set_result(None)  # the place moves to the waiter: inflight unchanged
                return
        self.inflight -= 1

    def reserve_pending(self, blocks: int) -> int:
        """Reserve room for up to `blocks` waiting blocks; returns how many fit (0..blocks)."""
        if self.max_pending_blocks is None:
            granted = blocks
        else:
            granted = max(0, min(blocks, self.max_pending_blocks - self.pending_blocks))
        self.pending_blocks += granted
        return granted

    def release_pending(self, blocks: int) -> None:
        self.pending_blocks -= blocks
        assert self.pending_blocks >= 0

    def _take(self) -> None:
        self.inflight += 1
        self.max_inflight_seen = max(self.max_inflight_seen, self.inflight)

    # -- awaiting around them ----------------------------------------------------------------
    async def acquire(self, priority: Priority) -> None:
        if self.try_admit():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (int(priority), next(self._seq), waiter))
        self._queued += 1
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # granted just as we were cancelled: pass it on
            else:
                waiter.cancel()
                self._queued -= 1  # the dead entry is skipped by release()
            raise
        # The place was handed over by release(), which kept inflight as it was.
        self.max_inflight_seen = max(self.max_inflight_seen, self.inflight)

    @asynccontextmanager
    async def place(self, priority: Priority) -> AsyncIterator[None]:
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release()

    def stats(self) -> dict[str, int]:
        out = {
            "inflight": self.inflight,
            "queued": self._queued,
            "capacity": self.capacity,
            "max_inflight_seen": self.max_inflight_seen,
        }
        if self.max_pending_blocks is not None:
            out["pending_blocks"] = self.pending_blocks
            out["max_pending_blocks"] = self.max_pending_blocks
        return out


class Scheduler:
    """Lanes per tier and direction, plus the bounded worker threads for blocking tier work.

    One per cache, shared by its tiers; a tier used on its own makes its own.
    Create and use it on one event loop.
    """

    def __init__(self, limits: SchedulerLimits) -> None:
        self.limits = limits
        self._lanes: dict[tuple[str, str], Lane] = {}
        self._workers = WorkerThreads(limits.io_threads, "kvtier-io")

    @classmethod
    def from_spec(cls, spec: OffloadingSpec) -> Scheduler:
        return cls(spec.limits)

    def lane(self, tier_name: str, direction: Direction) -> Lane:
        lane = self._lanes.get((tier_name, direction))
        if lane is None:
            if direction == "load":
                lane = Lane(f"{tier_name}/load", self.limits.max_inflight_loads)
            else:
                lane = Lane(
                    f"{tier_name}/store", self.limits.max_inflight_stores, self.limits.max_pending_stores
                )
            self._lanes[(tier_name, direction)] = lane
        return lane

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on a worker thread; returns (or raises) only once it has finished."""
        return await self._workers.run(fn, *args)

    def close(self) -> None:
        """Let the worker threads exit once idle; never blocks."""
        self._workers.close()

    def stats(self) -> dict[str, dict[str, int]]:
        return {lane.name: lane.stats() for lane in self._lanes.values()}
