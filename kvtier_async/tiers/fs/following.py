"""`Following`: this process's view of the other processes' slabs, brought up to date.

The index holds what this process has read of the other slabs' logs. A refresh reads
their new log entries on a worker thread (`SlabFiles.read_news`: new blocks, slabs
whose files vanished, and our own slabs' files removed under us) and applies them to
the index, then lets `Room` claim again. One refresh runs at a time, as a task of its
own, so that a caller cancelled meanwhile never leaves news (and the files it opened)
unapplied. A lookup or load that finds a key unknown refreshes when the last refresh
is older than `interval_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from .index import SlabIndex
from .room import Room
from .slab_files import SlabFiles, close_fd

__all__ = ["Following"]

log = logging.getLogger(__name__)


def _retrieve_exception(task: asyncio.Future[None]) -> None:
    """Done-callback of a shared task: its exception is its awaiters' to handle, not an
    "exception was never retrieved" at exit when none was left."""
    if not task.cancelled():
        task.exception()


class Following:
    """Refreshes `index` from the other processes' logs through `files`."""

    def __init__(self, index: SlabIndex, files: SlabFiles, room: Room, interval_s: float) -> None:
        self.index = index
        self.files = files
        self.room = room
        self.interval_s = interval_s
        #: The refresh running now, if one is.
        self.refreshing: asyncio.Future[None] | None = None
        self._last_refresh = float("-inf")

    async def refresh(self) -> None:
        """Read and apply the other processes' news now (joining a refresh already running)."""
        if self.refreshing is None:
            self.refreshing = asyncio.ensure_future(self._refresh_task())
            self.refreshing.add_done_callback(_retrieve_exception)
        await asyncio.shield(self.refreshing)

    async def refresh_if_missing(self, keys: Sequence[bytes]) -> None:
        """Refresh when a key is unknown and the last refresh is older than the interval."""
        if self.due() and not all(self.index.holds_each(keys)):
            await self.refresh()

    async def holds_each(self, keys: Sequence[bytes]) -> list[bool]:
        """`SlabIndex.holds_each`, after a refresh if a key is unknown and one is due."""
        found = self.index.holds_each(keys)
        if not all(found) and self.due():
            await self.refresh()
            found = self.index.holds_each(keys)
        return found

    def due(self) -> bool:
        """Whether the last refresh is older than the interval."""
        return time.monotonic() - self._last_refresh >= self.interval_s

    async def _refresh_task(self) -> None:
        index = self.index
        try:
            known = {slab: (o.log_inode, o.log_offset) for slab, o in index.others.items()}
            news, gone, removed = await self.files.off_loop(self.files.read_news, known, dict(index.own))
            newly_removed = [slab for slab in removed if not index.own[slab].removed]
            if newly_removed:
                for slab in newly_removed:
                    index.own[slab].removed = True
                log.warning(
                    "fs tier %r: the files of slabs %s, which this process writes, were removed "
                    "under it; it keeps using them until it exits (their space is freed then, and "
                    "other processes' new slabs of those numbers stay unseen here until then). "
                    "Clear a root in use with `kvtier fs gc`, not by removing files",
                    self.files.name,
                    newly_removed,
                )
            for slab in gone:
                close_fd(index.forget_other(slab))
            for item in news:
                close_fd(index.apply_news(item))
            self._last_refresh = time.monotonic()
            await self.room.refreshed()
        finally:
            # Cleared by the task itself, not by a done-callback that runs later: meanwhile a
            # caller would get the finished task back and not read the news it asked for.
            self.refreshing = None
