"""LMCache's objects as kvtier blocks: one tier per object size, each over staging memory of its own.

LMCache hands its L2 adapter memory objects anywhere in its own memory, of sizes
that vary with the chunk. A kvtier tier moves fixed-size blocks between its
primary memory and its backend, so `SizeClasses` keeps one tier per object size
(`SizeClass`), each over a staging region of at most `MAX_SLOTS` slots: a store
copies each object into a staging slot and stores the slot; a load loads into
slots and copies out the blocks that arrived exact. The copies run on kvtier's
worker threads, the GIL released. Everything here runs on the adapter's event
loop thread.

This module does not import LMCache: an object is anything with a `byte_array`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from ..buffers import copy_into
from ..factory import SecondaryTierFactory
from ..primary import reserve_host_memory
from ..spec import OffloadingSpec
from ..tier import SecondaryTierManager as KVTier

__all__ = ["MAX_SLOTS", "PART_BYTES", "SizeClass", "SizeClasses", "check_objects", "object_view", "parts"]

#: Staging slots per object size, at most.
MAX_SLOTS = 256
#: Bytes of objects copied and moved together: a task's parts run at once, so the copies of one
#: part overlap the I/O of the others.
PART_BYTES = 8 << 20


def object_view(obj: Any) -> memoryview:
    """The object's bytes, in its own memory: LMCache's `byte_array` (its logical size)."""
    return memoryview(obj.byte_array).cast("B")


def check_objects(keys: Sequence[Any], objects: Sequence[Any]) -> None:
    """Refuse a task LMCache could not mean, before it gets an id: raises ValueError."""
    if len(keys) != len(objects):
        raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
    for obj in objects:
        try:
            object_view(obj)
        except (AttributeError, TypeError, NotImplementedError) as exc:
            raise ValueError(f"{type(obj).__name__} exposes no byte_array to copy: {exc}") from exc


def parts(objects: Sequence[Any]) -> list[tuple[int, list[int]]]:
    """The objects by size, cut in parts of about `PART_BYTES`: (size, indices) each."""
    by_size: dict[int, list[int]] = {}
    for i, obj in enumerate(objects):
        by_size.setdefault(object_view(obj).nbytes, []).append(i)
    cut = []
    for nbytes, members in by_size.items():
        step = max(1, PART_BYTES // nbytes)
        cut += [(nbytes, members[i : i + step]) for i in range(0, len(members), step)]
    return cut


class SizeClass:
    """One object size: a kvtier tier over a staging region of `slots` slots."""

    def __init__(self, nbytes: int, tier: KVTier, memory: Any, stride: int) -> None:
        self.nbytes = nbytes
        self.tier = tier
        self.memory = memory  # the staging mapping, `slots` slots `stride` bytes apart
        self.stride = stride
        self.slots = len(memory) // stride
        self._free = list(range(self.slots))
        self._freed = asyncio.Condition()

    async def take(self, wanted: int) -> list[int]:
        """Between 1 and `wanted` free slots, waiting for one if none is free."""
        async with self._freed:
            await self._freed.wait_for(lambda: bool(self._free))
            taken, self._free = self._free[:wanted], self._free[wanted:]
            return taken

    def slot(self, slot: int) -> memoryview:
        return memoryview(self.memory)[slot * self.stride : slot * self.stride + self.nbytes]

    async def give(self, slots: list[int]) -> None:
        async with self._freed:
            self._free.extend(slots)
            self._freed.notify_all()

    async def store(self, names: list[bytes], objects: list[Any]) -> list[str]:
        """Each object's outcome: "new" (stored now), "held" (the tier had it: not copied, not
        written, not counted again) or "failed"."""
        held = await self.tier.lookup_each(names)
        states = ["held" if h else "failed" for h in held]
        todo = [j for j, h in enumerate(held) if not h]
        done = 0
        while done < len(todo):
            slots = await self.take(len(todo) - done)
            chunk = todo[done : done + len(slots)]
            try:
                moved = [objects[j] for j in chunk]
                await self.tier.run_cpu(self.nbytes * len(chunk), _copy_in, self, slots, moved)
                results = await self.tier.store([names[j] for j in chunk], slots)
            finally:
                await self.give(slots)
            for j, ok in zip(chunk, results):
                states[j] = "new" if ok else "failed"
            done += len(chunk)
        return states

    async def load(self, names: list[bytes], objects: list[Any]) -> list[bool]:
        """Load each name into its object; True only where the object now holds the exact bytes."""
        results: list[bool] = []
        while len(results) < len(names):
            slots = await self.take(len(names) - len(results))
            start = len(results)
            try:
                arrived = await self.tier.load(names[start : start + len(slots)], slots)
                hits = [(slot, objects[start + j]) for j, (slot, ok) in enumerate(zip(slots, arrived)) if ok]
                if hits:
                    copied = [slot for slot, _ in hits]
                    await self.tier.run_cpu(
                        self.nbytes * len(hits), _copy_out, self, copied, [obj for _, obj in hits]
                    )
            finally:
                await self.give(slots)
            results += arrived
        return results


class SizeClasses:
    """The size classes opened so far, each opened on first use (concurrent first uses share it)."""

    def __init__(self, tier_config: dict[str, Any], limits: dict[str, Any], staging_bytes: int) -> None:
        self.tier_config = tier_config
        self.limits = limits
        self.staging_bytes = staging_bytes
        self._classes: dict[int, SizeClass] = {}
        self._opening: dict[int, asyncio.Future[SizeClass]] = {}

    def opened(self) -> list[SizeClass]:
        return list(self._classes.values())

    async def get(self, nbytes: int) -> SizeClass:
        """The size class of objects of `nbytes`, its tier opened."""
        if nbytes in self._classes:
            return self._classes[nbytes]
        opening = self._opening.get(nbytes)
        if opening is None:
            opening = asyncio.ensure_future(self._open(nbytes))
            self._opening[nbytes] = opening
        try:
            return await asyncio.shield(opening)
        finally:
            if opening.done():
                self._opening.pop(nbytes, None)

    async def store(self, nbytes: int, names: list[bytes], objects: list[Any]) -> list[str]:
        """Store objects of `nbytes` under `names` (`SizeClass.store`)."""
        return await (await self.get(nbytes)).store(names, objects)

    async def load(self, nbytes: int, names: list[bytes], objects: list[Any]) -> list[bool]:
        """Load `names` into objects of `nbytes` (`SizeClass.load`)."""
        return await (await self.get(nbytes)).load(names, objects)

    async def _open(self, nbytes: int) -> SizeClass:
        stride = -(-nbytes // 4096) * 4096
        slots = max(1, min(MAX_SLOTS, self.staging_bytes // stride))
        memory = reserve_host_memory(slots * stride)
        spec = OffloadingSpec(
            block_nbytes=nbytes,
            num_cpu_blocks=slots,
            secondary_tiers=[self.tier_config],
            namespace=f"lmcache:{nbytes}",
            **self.limits,
        )
        tier = SecondaryTierFactory.create_secondary_tier(self.tier_config, memoryview(memory), spec)
        try:
            await tier.open()
        except BaseException:
            await tier.aclose()
            raise
        size_class = SizeClass(nbytes, tier, memory, stride)
        self._classes[nbytes] = size_class
        return size_class

    async def close(self) -> None:
        """Close every tier; afterwards none holds a view of its staging memory."""
        for size_class in self._classes.values():
            await size_class.tier.aclose()
        self._classes.clear()


def _copy_in(size_class: SizeClass, slots: list[int], objects: list[Any]) -> None:
    """Worker thread: each object's bytes into its staging slot (the GIL released)."""
    for slot, obj in zip(slots, objects):
        copy_into(size_class.slot(slot), object_view(obj))


def _copy_out(size_class: SizeClass, slots: list[int], objects: list[Any]) -> None:
    """Worker thread: each loaded slot into its object (the GIL released)."""
    for slot, obj in zip(slots, objects):
        copy_into(object_view(obj), size_class.slot(slot))
