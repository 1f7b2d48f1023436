"""`StorePipeline`: a cache's store path. Accept, fill, cascade.

    device --copy--> primary slots --(background, per tier)--> secondary tiers

A store takes filling slots for the keys the primary tier lacks (within the slots stores
may hold, `limits.store_slots`), copies the device blocks in, publishes them, and returns;
the writes to every secondary tier go on in the background, the slots pinned until all
are done (`flush` waits for them). Stores are best effort: a block that would wait on
other calls' work is not accepted.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import anyio

from .copy_engine import CopyEngine
from .fault_log import FaultLog
from .primary import PrimaryTier
from .releases import Releases
from .spec import OffloadingSpec
from .tier import SecondaryTierManager

__all__ = ["StorePipeline"]

log = logging.getLogger(__name__)


class StorePipeline:
    """Stores of device blocks through `primary` to `tiers`, counted in `counters`."""

    def __init__(
        self,
        spec: OffloadingSpec,
        primary: PrimaryTier,
        copy_engine: CopyEngine,
        tiers: list[SecondaryTierManager],
        releases: Releases,
        counters: Counter[str],
    ) -> None:
        self.spec = spec
        self.limits = spec.limits
        self.primary = primary
        self.copy_engine = copy_engine
        self.tiers = tiers
        self.releases = releases
        self.counters = counters
        self.fault_log = FaultLog(log)
        #: The writes to the secondary tiers still running.
        self.background: set[asyncio.Task[None]] = set()
        self.store_slots = 0  # primary slots held by stores: copying, or waiting for the tiers

    async def store(self, keys: list[bytes], ids: list[int], after: Any = None) -> int:
        """Store `keys` from device blocks `ids`; returns how many leading blocks were accepted.
        The device copies wait for what `after` marks (`CopyEngine.mark`)."""
        self.counters["store_calls"] += 1
        own_cascades: set[asyncio.Task[None]] = set()
        pos = 0
        while pos < len(keys):
            end = min(len(keys), pos + self.limits.chunk_blocks)
            copy_keys: list[bytes] = []
            copy_ids: list[int] = []
            slots: list[int] = []
            filled_elsewhere = False
            i = pos
            while i < end:
                key = keys[i]
                held = self.primary.acquire(key)
                if held is not None:
                    self.primary.unpin(held)  # marks it recently used
                elif self.primary.is_filling(key):
                    filled_elsewhere = True  # accepted only once its filler has published it
                    break
                else:
                    slot = self._allocate(key)
                    if slot is None:
                        break
                    copy_keys.append(key)
                    copy_ids.append(ids[i])
                    slots.append(slot)
                i += 1
            if slots:
                cascade = await self._fill_and_cascade(copy_keys, copy_ids, slots, after)
                if cascade is not None:
                    own_cascades.add(cascade)
            if filled_elsewhere and i == pos:
                # Another call is filling this key (copying it from a device or a tier). Its
                # outcome decides: published, it is accepted; aborted, we copy it ourselves.
                await self._until_not_filling(keys[i])
            elif i == pos:
                # No slot to be had: every slot is pinned, or accepted stores hold as many as
                # they may. Our own earlier chunks will free some; others' work is not waited
                # for (stores are best effort).
                own_cascades = {task for task in own_cascades if not task.done()}
                if not own_cascades:
                    break
                await asyncio.wait(own_cascades, return_when=asyncio.FIRST_COMPLETED)
            pos = i
        self.counters["stored_blocks"] += pos
        self.counters["store_rejected_blocks"] += len(keys) - pos
        return pos

    async def flush(self) -> None:
        """Wait until every accepted store has reached every secondary tier (or failed there)."""
        while self.background:
            await asyncio.wait(set(self.background))

    def _allocate(self, key: bytes) -> int | None:
        """A filling slot for a store, within the slots stores may hold (see `store_slots`)."""
        if self.store_slots >= self.limits.store_slots:
            return None
        slot = self.primary.allocate(key)
        if slot is not None:
            self.store_slots += 1
        return slot

    def _unpin(self, slots: list[int]) -> None:
        self.store_slots -= len(slots)
        for slot in slots:
            self.primary.unpin(slot)

    async def _until_not_filling(self, key: bytes) -> None:
        while self.primary.is_filling(key):
            await self.releases.wait_since(self.releases.count)

    async def _fill_and_cascade(
        self, keys: list[bytes], device_ids: list[int], slots: list[int], after: Any
    ) -> asyncio.Task[None] | None:
        try:
            # Returns or raises only once every copy it queued has finished: aborting the slots
            # below never lets a slot be reused while a copy still writes into it.
            await self.copy_engine.to_host(device_ids, slots, after)
        except BaseException:
            self.store_slots -= len(slots)
            for slot in slots:
                self.primary.abort(slot)
            raise
        for slot in slots:
            self.primary.publish(slot)
        self.counters["bytes_to_host"] += len(slots) * self.spec.block_nbytes
        if not self.tiers:
            self._unpin(slots)
            return None
        task = asyncio.ensure_future(self._cascade(keys, slots))
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def _cascade(self, keys: list[bytes], slots: list[int]) -> None:
        """Write-through to every secondary tier; the slots stay pinned until all are done."""
        try:
            async with anyio.create_task_group() as group:
                for tier in self.tiers:
                    group.start_soon(tier.store, keys, slots)
        except Exception:
            self.counters["cascade_errors"] += 1
            self.fault_log.error(
                "cascade", "writing %d blocks to the secondary tiers failed", len(keys), exc_info=True
            )
        finally:
            self._unpin(slots)
