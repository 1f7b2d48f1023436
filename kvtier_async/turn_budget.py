"""`TurnBudget`: calls that start in one turn of the event loop share a bounded slice of it.

asyncio runs every task that is ready in one turn of the loop, each to its next wait. A serving
frontend that issues 256 stores at once (one per request) starts 256 tier calls in one turn,
and each runs its checks and bookkeeping (tens of microseconds) before it waits for its lane:
12-29 ms in which nothing else on the loop runs, a timer included (`bench/remote_tiers.py`,
Redis at 64 KiB). A call that finds the turn's budget spent by the calls before it yields
first, and goes on in a later turn: the loop gets back to its other work between slices.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["TurnBudget"]

#: Seconds of one turn of the loop the calls that start in it may use together.
TURN_BUDGET_S = 0.001


class TurnBudget:
    """One loop's turns, as the calls that start in them see them (used on that loop only)."""

    def __init__(self, seconds: float = TURN_BUDGET_S) -> None:
        self.seconds = seconds
        self._turn_began: float | None = None  # when the first call of the current turn began

    async def enter(self) -> None:
        """Return at once if the current turn's budget is not spent (the first call of a turn
        always goes on); else yield, turn after turn, until it finds one whose is not."""
        while True:
            now = time.perf_counter()
            if self._turn_began is None:
                self._turn_began = now
                # Runs in the next turn, before the calls that yield below go on.
                asyncio.get_running_loop().call_soon(self._next_turn)
                return
            if now - self._turn_began < self.seconds:
                return
            await asyncio.sleep(0)  # a scheduling point, not a wait for time

    def _next_turn(self) -> None:
        self._turn_began = None
