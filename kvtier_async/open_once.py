"""`OpenOnce`: opening work run once, shared by every caller that needs it open.

A caller cancelled while it waits leaves the opening to the others; an opening that
failed or was cancelled is forgotten, so the next call tries again; closing waits for an
opening in progress (`settle`), so that what it opens is closed too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

__all__ = ["OpenOnce"]


class OpenOnce:
    """Runs an opening until one has succeeded (event-loop thread).

    The opening is passed with each call, not kept: the owner's bound method here would be a
    reference cycle, and its owner freed by the cycle collector instead of when dropped.
    """

    def __init__(self) -> None:
        self._task: asyncio.Future[None] | None = None
        #: Whether an opening has succeeded.
        self.opened = False

    async def __call__(self, opening: Callable[[], Awaitable[None]]) -> None:
        """Run `opening`, or wait for the one in progress; raises what a failed opening raised."""
        if self.opened:
            return
        if self._task is None:
            self._task = asyncio.ensure_future(opening())
            self._task.add_done_callback(self._finished)
        await asyncio.shield(self._task)
        self.opened = True

    def _finished(self, task: asyncio.Future[None]) -> None:
        # Runs however the opening ended, even if every caller waiting for it was cancelled:
        # an opening that succeeded counts (so that closing closes what it opened), and a
        # failed or cancelled one is forgotten, so that the next call tries again.
        if not task.cancelled() and task.exception() is None:
            self.opened = True
        elif self._task is task:
            self._task = None

    async def settle(self) -> None:
        """Wait until no opening is in progress, however it ends."""
        if self._task is not None and not self._task.done():
            await asyncio.wait([self._task])
