"""`CallsInFlight`: how many calls are running, so that closing can wait until none is."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["CallsInFlight"]


class CallsInFlight:
    """A count of the calls inside `track()`, and a way to wait until it is zero (one loop)."""

    def __init__(self) -> None:
        self.count = 0
        self._none = asyncio.Event()
        self._none.set()

    @contextmanager
    def track(self) -> Iterator[None]:
        self.count += 1
        self._none.clear()
        try:
            yield
        finally:
            self.count -= 1
            if self.count == 0:
                self._none.set()

    async def wait_until_none(self) -> None:
        await self._none.wait()
