"""`SingleFlight`: a key being written is written once, however many calls store it at once.

A call that stores a key another call is writing right now does not write it again: it
waits for that write and shares its outcome.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

__all__ = ["SingleFlight"]


class SingleFlight:
    """The keys being written by calls in flight, each with its outcome to come (one loop)."""

    def __init__(self) -> None:
        self._outcomes: dict[bytes, asyncio.Future[bool]] = {}

    def shared(self, keys: Sequence[bytes]) -> dict[int, asyncio.Future[bool]]:
        """The positions in `keys` of those another call is writing, with their outcomes."""
        return {i: self._outcomes[key] for i, key in enumerate(keys) if key in self._outcomes}

    @contextmanager
    def writing(self, keys: Sequence[bytes], results: list[bool]) -> Iterator[None]:
        """This call writes `keys`: until it leaves the block, other calls share its writes, and
        then each gets the matching entry of `results` (False where the block raised early)."""
        loop = asyncio.get_running_loop()
        outcomes = [loop.create_future() for _ in keys]
        self._outcomes.update(zip(keys, outcomes))
        try:
            yield
        finally:
            for key, outcome, ok in zip(keys, outcomes, results):
                outcome.set_result(ok)
                del self._outcomes[key]

    @staticmethod
    async def outcomes(shared: dict[int, asyncio.Future[bool]]) -> dict[int, bool]:
        """Wait for the writes `shared` names; their outcomes by position."""
        await asyncio.wait(set(shared.values()))
        return {i: outcome.result() for i, outcome in shared.items()}
