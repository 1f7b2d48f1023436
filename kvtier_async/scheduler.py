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
import contextvars
import heapq
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager
from enum import IntEnum
from typing import Any, Literal, TypeVar

from .spec import OffloadingSpec, SchedulerLimits
from .workers import WorkerThreads, wait_uncancellable

__all__ = ["Lane", "Priority", "Scheduler", "current_priority", "wait_uncancellable"]

T = TypeVar("T")
A = TypeVar("A")
Direction = Literal["load", "store"]


class Priority(IntEnum):
    """Lower goes first."""

    LOAD = 0
    PREFETCH = 1
    STORE = 2


#: The priority of the tier call running in this task, set by `SecondaryTierManager` around its
#: backend hooks, so that a limit deep inside a backend (`ServerGate`) serves loads first too.
current_priority: contextvars.ContextVar[Priority] = contextvars.ContextVar(
    "kvtier_priority", default=Priority.LOAD
)


class Lane:
    """At most `capacity` units held at once (places, or bytes); waiters are admitted best
    priority first, FIFO within.

    A request larger than the capacity is admitted when it would be alone, so it
    cannot wait forever. The best waiter is served first even if a later, smaller
    one would fit: big batches are not starved by a stream of small ones.
    """

    def __init__(self, name: str, capacity: int, max_pending_blocks: int | None = None) -> None:
        self.name = name
        self.capacity = capacity
        self.max_pending_blocks = max_pending_blocks
        self.inflight = 0
        self.max_inflight_seen = 0
        self.pending_blocks = 0
        self._queued = 0
        self._waiters: list[tuple[int, int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    # -- synchronous decisions ---------------------------------------------------------------
    def _fits(self, amount: int) -> bool:
        return self.inflight == 0 or self.inflight + amount <= self.capacity

    def try_admit(self, amount: int = 1) -> bool:
        """Take `amount` now if it fits and nobody is queued (a waiter comes first)."""
        if self._queued == 0 and self._fits(amount):
            self._take(amount)
            return True
        return False

    def release(self, amount: int = 1) -> None:
        """Give `amount` back; it passes straight on to the best live waiters that now fit."""
        if amount > self.inflight:
            raise RuntimeError(f"lane {self.name}: releasing {amount} of {self.inflight} held")
        self.inflight -= amount
        self._admit_waiters()

    def _admit_waiters(self) -> None:
        while self._waiters:
            _, _, wanted, waiter = self._waiters[0]
            if waiter.done():  # cancelled while queued
                heapq.heappop(self._waiters)
                continue
            if not self._fits(wanted):
                break
            heapq.heappop(self._waiters)
            self._queued -= 1
            self._take(wanted)
            waiter.set_result(None)

    def reserve_pending(self, blocks: int) -> int:
        """Reserve room for up to `blocks` waiting blocks; returns how many fit (0..blocks)."""
        if self.max_pending_blocks is None:
            granted = blocks
        else:
            granted = max(0, min(blocks, self.max_pending_blocks - self.pending_blocks))
        self.pending_blocks += granted
        return granted

    def release_pending(self, blocks: int) -> None:
        if blocks > self.pending_blocks:
            raise RuntimeError(f"lane {self.name}: releasing {blocks} of {self.pending_blocks} pending")
        self.pending_blocks -= blocks

    def _take(self, amount: int) -> None:
        self.inflight += amount
        self.max_inflight_seen = max(self.max_inflight_seen, self.inflight)

    # -- awaiting around them ----------------------------------------------------------------
    async def acquire(self, priority: Priority, amount: int = 1) -> None:
        if self.try_admit(amount):
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (int(priority), next(self._seq), amount, waiter))
        self._queued += 1
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release(amount)  # granted just as we were cancelled: pass it on
            else:
                waiter.cancel()
                self._queued -= 1  # the dead entry is skipped by release()
                self._admit_waiters()  # we may have been the head that held smaller ones back
            raise

    @asynccontextmanager
    async def place(self, priority: Priority, amount: int = 1) -> AsyncIterator[None]:
        await self.acquire(priority, amount)
        try:
            yield
        finally:
            self.release(amount)

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
        #: Bytes in hook calls in flight, every tier and direction together.
        self.bytes_in_flight = Lane("bytes_in_flight", limits.max_inflight_bytes)
        self._workers = WorkerThreads(limits.io_threads, "kvtier-io")
        # CPU work a tier can take off its I/O threads (checksums), so that they go straight
        # on to their next read or write.
        self._cpu_workers = WorkerThreads(limits.copy_threads, "kvtier-cpu")

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

    async def start(self) -> None:
        """Start the worker threads now, so that the first operation does not wait for them."""
        await self._workers.start()
        await self._cpu_workers.start()

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on a worker thread; returns (or raises) only once it has finished."""
        return await self._workers.run(fn, *args)

    async def run_blocking_each(self, fn: Callable[[A], T], items: Sequence[A]) -> list[T]:
        """`fn(item)` for each item on the worker threads, queued at once and in order; their
        results once all have finished (see `WorkerThreads.run_each`)."""
        return await self._workers.run_each(fn, items)

    async def run_cpu(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU-bound `fn(*args)` (one that releases the GIL) on the CPU worker threads."""
        return await self._cpu_workers.run(fn, *args)

    async def submit_cpu(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue CPU-bound `fn(*args)` on the CPU worker threads; its future, for a worker thread
        to wait on (see `WorkerThreads.submit`)."""
        return await self._cpu_workers.submit(fn, *args)

    def close(self) -> None:
        """Let the worker threads exit once idle; never blocks."""
        self._workers.close()
        self._cpu_workers.close()

    def stats(self) -> dict[str, dict[str, int]]:
        """Per lane (`<tier>/load`, `<tier>/store`, `bytes_in_flight`): in flight, queued,
        capacity, the most ever in flight, and the pending-store budget."""
        out = {lane.name: lane.stats() for lane in self._lanes.values()}
        out[self.bytes_in_flight.name] = self.bytes_in_flight.stats()
        return out
