"""`Coalescer`: calls made in the same event-loop turn share one backend request.

A serving frontend with hundreds of requests in flight asks a shared tier about keys from
all of them at once. One Redis pipeline costs the event loop ~0.2 ms however few commands it
carries, so 256 concurrent existence checks with a pipeline each took more loop time than the
data they were about (`bench/remote_tiers.py`, 64 KiB blocks, when every store checked first:
stores at 0.44x the raw client, 0.49x coalesced). Coalesced, the calls of one turn ride one
request of up to `max_items` items.

The shared request runs at the best priority of the calls that share it, and as a task of its
own: a caller cancelled meanwhile leaves it to finish for the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from .scheduler import Priority, current_priority

__all__ = ["Coalescer"]

K = TypeVar("K")
R = TypeVar("R")


class _Batch(Generic[K, R]):
    __slots__ = ("done", "items", "priority")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.items: list[K] = []
        self.priority = Priority.STORE
        self.done: asyncio.Future[list[R]] = loop.create_future()


class Coalescer(Generic[K, R]):
    """`await coalescer(items)` is `await request(items)`, sharing the request with the calls
    of the same event-loop turn (the answers are cut back apart)."""

    def __init__(self, request: Callable[[list[K]], Awaitable[list[R]]], max_items: int) -> None:
        if max_items < 1:
            raise ValueError(f"Coalescer: max_items must be >= 1, got {max_items}")
        self._request = request
        self.max_items = max_items
        self._open: _Batch[K, R] | None = None
        #: Requests made, and calls that took part in them (their ratio: how much was shared).
        self.requests = 0
        self.calls = 0

    async def __call__(self, items: list[K]) -> list[R]:
        if not items:
            return []
        batch = self._open
        if batch is None or len(batch.items) + len(items) > self.max_items:
            loop = asyncio.get_running_loop()
            batch = self._open = _Batch(loop)
            loop.call_soon(self._send, batch)  # once this turn's callers have joined
        start = len(batch.items)
        batch.items.extend(items)
        batch.priority = min(batch.priority, current_priority.get())
        self.calls += 1
        answers = await asyncio.shield(batch.done)
        return answers[start : start + len(items)]

    def _send(self, batch: _Batch[K, R]) -> None:
        if self._open is batch:
            self._open = None
        self.requests += 1
        current_priority.set(batch.priority)  # this callback's own context: copied into the task
        task = asyncio.ensure_future(self._request(batch.items))
        task.add_done_callback(lambda done: _settle(batch.done, done))


def _settle(future: asyncio.Future[list[R]], task: asyncio.Future[list[R]]) -> None:
    """Hand the request's answer (or error) to the callers still waiting."""
    if future.done():
        return
    if task.cancelled():
        future.cancel()
    elif (error := task.exception()) is not None:
        future.set_exception(error)
    else:
        future.set_result(task.result())
