"""`Room`: where a store's next record comes from, and when the disk has none to give.

In turn: our free records; a new slab below the namespace's capacity; a slab whose writer
has exited, if its newest block is older than our oldest (so a restarted process, or
several, take the old slabs over one at a time, as their blocks age out); our least
recently used block. A slab is claimed in the background before the free records run out.
A full disk stops claiming until a refresh finds room for a whole slab again.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter

from ...fault_log import FaultLog
from .index import Claim, Record, SlabIndex
from .slab_files import SlabFiles

__all__ = ["Room"]

log = logging.getLogger(__name__)


class Room:
    """Free records for `index`'s slabs, claimed through `files` on worker threads."""

    def __init__(
        self, index: SlabIndex, files: SlabFiles, counters: Counter[str], fault_log: FaultLog
    ) -> None:
        self.index = index
        self.files = files
        self.counters = counters
        self.fault_log = fault_log
        #: Fewer free records left than this, and the next slab is claimed in the background.
        self.claim_ahead_records = 0
        self.can_claim = True  # False until a refresh once no slab could be claimed
        self.may_create = True  # False once every slab number below the capacity exists
        self.disk_full = False
        self.claiming: asyncio.Future[None] | None = None

    async def take_record(self) -> tuple[Record, bool, bytes | None] | None:
        """A record to write into, whether its last log entry names a block (then a deletion
        goes first) and the key of the block evicted for it, if one was; None when the
        namespace is full and nothing of ours may be evicted."""
        index = self.index
        while not index.free and self._may_claim():
            # Always a claim still running (see _claim_task), so this waits, and the loop runs.
            # A failed claim stops claiming until the next refresh: then we evict instead.
            await asyncio.shield(self.start_claim())
        taken = index.take_free()
        if taken is not None:
            if len(index.free) < self.claim_ahead_records and self.claiming is None and self._may_claim():
                # The next slab, ready before the stores in flight need it: claimed only once the
                # free records ran out, it took 16-93 ms under four writes, and every store waited.
                self.start_claim()
            return (*taken, None)
        evicted = index.evict_oldest()
        if evicted is None:
            return None
        key, where, deletion = evicted
        self.counters["evictions"] += 1
        return where, deletion, key

    def _may_claim(self) -> bool:
        return self.can_claim and (self.may_create or bool(self.index.adoptable()))

    def start_claim(self) -> asyncio.Future[None]:
        """The claim in progress, started if there is none."""
        if self.claiming is None:
            self.claiming = asyncio.ensure_future(self._claim_task())  # which never raises
        return self.claiming

    async def _claim_task(self) -> None:
        """Claim a slab; never raises but for cancellation (a failure is logged and counted)."""
        try:
            own, adoptable = set(self.index.own), self.index.adoptable()
            claim = await self.files.off_loop(self.files.claim, own, self.may_create, adoptable)
            if claim is None:
                self.may_create = False  # every number below the capacity is taken
                self.can_claim = False  # until the next refresh: a writer may exit meanwhile
                return
            if claim.disk_full:
                self.counters["out_of_space"] += 1
                self.disk_full = True
                self.can_claim = False
            if claim.state.records:
                self.take_claim(claim)
            else:  # not a record's room left on the disk
                await self.files.off_loop(SlabFiles.close, [claim.state], [])
        except BaseException as exc:
            self.can_claim = False  # until the next refresh: no retry storm on a failing disk
            if isinstance(exc, asyncio.CancelledError):
                raise
            self.counters["write_errors"] += 1
            self.fault_log.warning("claim", "fs tier %r: claiming a slab failed: %s", self.files.name, exc)
        finally:
            # Cleared by the task itself, not by a done-callback that runs later: meanwhile a
            # store that found no free record got the finished task back from start_claim,
            # awaited it without yielding, and spun on it for ever (bench/fs_steady.py, 32 MiB
            # blocks, a full tier: one batch per block, more of them ready than a slab has records).
            self.claiming = None

    def take_claim(self, claim: Claim) -> None:
        fd = self.index.take_claim(claim)
        if fd is not None:
            os.close(fd)

    def out_of_space(self) -> None:
        """The disk is full: claim nothing more until a refresh finds room for a slab again; new
        blocks evict our least recently used ones from the room our slabs already have."""
        self.counters["out_of_space"] += 1
        self.disk_full = True
        self.can_claim = False
        self.index.shrink_to_disk()

    async def refreshed(self) -> None:
        """After a refresh: claim again (a writer may have exited, leaving its slabs), and once
        the disk has room for a whole slab again, from the disk too."""
        if self.disk_full and await self.files.off_loop(self.files.room_for_a_slab):
            # A long-running server must not stay shrunk once the space comes back (an
            # operator's `kvtier fs gc`, another program's files removed).
            log.info("fs tier %r: the disk has room again; claiming slabs", self.files.name)
            self.disk_full = False
        self.can_claim = not self.disk_full
        self.may_create = len(self.index.own) + len(self.index.others) < self.files.max_slabs
