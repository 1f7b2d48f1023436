"""`ServerGate`: how many requests a shared tier has at its server at once, and the deadline of each.

A client library has limits of its own: redis-py's asyncio pool raises `MaxConnectionsError`
the moment its `max_connections` are all busy (it does not wait), and a small S3 server
drops connections past its backlog. A serving frontend easily has hundreds of calls in
flight, each a lookup, a store or a load, so a tier must never meet those limits: every
request to the server first takes a place here. Excess requests wait, best priority first
(demand loads, then prefetches, then stores: `scheduler.current_priority`), in order within a
priority, and the wait is part of the request's deadline.

A request that was still waiting when its deadline passed raises `QueueTimeout`: our own
limit ran out of time, not the server, so the fault breaker does not count it as a server
fault (`SecondaryTierManager` counts it in `queue_timeouts`).
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from collections.abc import Awaitable
from typing import TypeVar

from .scheduler import Lane, current_priority

__all__ = ["QueueTimeout", "ServerGate"]

T = TypeVar("T")


class QueueTimeout(TimeoutError):
    """A request waited for a place at the gate until its deadline: not a server fault."""


class ServerGate:
    """At most `limit` requests at the server at once; each bounded by `timeout_s`, waiting included."""

    def __init__(self, name: str, limit: int, timeout_s: float) -> None:
        self.limit = limit
        self.timeout_s = timeout_s
        self._lane = Lane(name, limit)
        #: Seconds requests spent waiting for a place (how much the limit costs).
        self.waited_s = 0.0

    async def call(self, request: Awaitable[T]) -> T:
        """Await `request` in a place, within the deadline (asyncio.TimeoutError past it, or
        `QueueTimeout` if it never got a place)."""
        started = time.monotonic()
        try:
            if not self._lane.try_admit():  # the common case costs no task and no timer
                await self._wait_for_place(started)
        except BaseException:
            if inspect.iscoroutine(request):
                request.close()  # never started
            raise
        try:
            return await _within(request, self.timeout_s - (time.monotonic() - started))
        finally:
            self._lane.release()

    async def _wait_for_place(self, started: float) -> None:
        try:
            await asyncio.wait_for(self._lane.acquire(current_priority.get()), self.timeout_s)
        except asyncio.TimeoutError:
            raise QueueTimeout(
                f"{self._lane.name}: no place at the server within {self.timeout_s} s "
                f"({self.limit} requests in flight)"
            ) from None
        finally:
            self.waited_s += time.monotonic() - started

    def stats(self) -> dict[str, float]:
        lane = self._lane.stats()
        return {
            "limit": self.limit,
            "inflight": lane["inflight"],
            "queued": lane["queued"],
            "max_inflight_seen": lane["max_inflight_seen"],
            "waited_s": round(self.waited_s, 6),
        }


if sys.version_info >= (3, 11):

    async def _within(request: Awaitable[T], seconds: float) -> T:
        async with asyncio.timeout(seconds):  # no task of its own, unlike wait_for on 3.11
            return await request

else:

    async def _within(request: Awaitable[T], seconds: float) -> T:
        return await asyncio.wait_for(request, seconds)
