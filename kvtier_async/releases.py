"""`Releases`: waiting for a primary slot to be given back, without missing one.

A load that found every slot pinned, or a store that found its key being filled by
another call, waits for "a release since I looked". Releases are counted, so one that
happens between the look and the wait still wakes the waiter.
"""

from __future__ import annotations

import asyncio

__all__ = ["Releases"]


class Releases:
    """The releases of a primary tier's slots, counted (event-loop thread)."""

    def __init__(self) -> None:
        self.count = 0
        self._released = asyncio.Event()

    def note(self) -> None:
        """A slot was released (the primary tier's `on_release`)."""
        self.count += 1
        self._released.set()

    async def wait_since(self, since: int) -> None:
        """Return once there has been a release after the count was `since`."""
        while self.count == since:
            self._released.clear()
            await self._released.wait()
