"""`SingleFlight`: a key being written is written once, however many calls store it at once.

A call that stores a key another call is writing right now does not write it again: it
waits for that write and shares its outcome.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

__all__ = ["SingleFlight"]


class SingleFlight:
    """The keys being written by calls in flight, each with its outcome to come (one loop)."""

    def __init__(self) -> None:
        self._in_flight: dict[bytes, asyncio.Future[bool]] = {}

    async def write(
        self, keys: Sequence[bytes], write: Callable[[list[int]], Awaitable[list[bool]]]
    ) -> tuple[list[bool], int]:
        """Each key's outcome, each key written once.

        `write(positions)` writes the keys at `positions` (those no other call is writing)
        and returns their outcomes in order; until it returns, other calls share these
        writes. The other keys wait for the writes in flight and share their outcomes.
        Returns the outcomes by position and how many were shared.
        """
        shared = {i: self._in_flight[key] for i, key in enumerate(keys) if key in self._in_flight}
        own = [i for i in range(len(keys)) if i not in shared]
        loop = asyncio.get_running_loop()
        outcomes = [loop.create_future() for _ in own]
        self._in_flight.update(zip((keys[i] for i in own), outcomes))
        written = [False] * len(own)  # False where `write` raised
        try:
            written = await write(own)
        finally:
            for i, outcome, ok in zip(own, outcomes, written):
                outcome.set_result(ok)
                del self._in_flight[keys[i]]
        results = [False] * len(keys)
        for i, ok in zip(own, written):
            results[i] = ok
        if shared:
            await asyncio.wait(set(shared.values()))
            for i, outcome in shared.items():
                results[i] = outcome.result()
        return results, len(shared)
