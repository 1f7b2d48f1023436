"""LMCache's objects as kvtier blocks: one tier per object size, over LMCache's own memory or staging.

LMCache hands its L2 adapter memory objects anywhere in its L1 memory, of sizes
that vary with the chunk. A kvtier tier moves fixed-size blocks between its
primary memory and its backend, so `SizeClasses` keeps one tier per object size:

- `InPlace`, where LMCache described its L1 arena (`l1_memory_desc`, as its server
  and `lmcache bench l2` do) and the size is a multiple of 4096: the tier's primary
  memory is the arena itself, and objects are stored from and loaded into their own
  bytes (`store_views` / `load_views`), nothing copied on the way;
- `Staged` otherwise: a staging region of at most `MAX_SLOTS` slots; a store copies
  each object into a staging slot and stores the slot, a load loads into slots and
  copies out the blocks that arrived exact, on kvtier's worker threads.

Everything here runs on the adapter's event loop thread. This module does not
import LMCache: an object is anything with a `byte_array`.
"""

from __future__ import annotations

import abc
import asyncio
import ctypes
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ..buffers import copy_into
from ..primary import reserve_host_memory
from ..spec import OffloadingSpec
from ..tier import SecondaryTierManager as KVTier
from .bridge import start_tier

__all__ = [
    "MAX_SLOTS",
    "PART_BYTES",
    "InPlace",
    "SizeClass",
    "SizeClasses",
    "Staged",
    "arena_view",
    "check_objects",
    "object_view",
    "parts",
]

log = logging.getLogger("kvtier_async.integrations.lmcache")

#: Staging slots per object size, at most.
MAX_SLOTS = 256
#: Bytes of objects copied and moved together: a task's parts run at once, so the copies of one
#: part overlap the I/O of the others.
PART_BYTES = 8 << 20


def object_view(obj: Any) -> memoryview:
    """The object's bytes, in its own memory: LMCache's `byte_array` (its logical size)."""
    return memoryview(obj.byte_array).cast("B")


def arena_view(desc: Any) -> memoryview | None:
    """LMCache's L1 arena as writable bytes, from its `L1MemoryDesc` (None: no usable description).

    The arena is LMCache's to map and unmap; a view of it must be released before LMCache
    frees it (the adapter's `close`).
    """
    ptr, size = getattr(desc, "ptr", None), getattr(desc, "size", None)
    if not isinstance(ptr, int) or not isinstance(size, int) or ptr <= 0 or size <= 0:
        return None
    return memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B")


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


class SizeClass(abc.ABC):
    """One object size and its kvtier tier; `store` / `load` move objects of that size.

    At most `places` objects are in the tier's hands at once, a store or load waiting for a
    place: the tier's pending-store budget is `places` blocks, and a store beyond it would be
    dropped, where LMCache wants it written.
    """

    def __init__(self, nbytes: int, tier: KVTier, places: int) -> None:
        self.nbytes = nbytes
        self.tier = tier
        self.places = places
        self._free = list(range(places))
        self._freed = asyncio.Condition()

    async def take(self, wanted: int) -> list[int]:
        """Between 1 and `wanted` free places, waiting for one if none is free."""
        async with self._freed:
            await self._freed.wait_for(lambda: bool(self._free))
            taken, self._free = self._free[:wanted], self._free[wanted:]
            return taken

    async def give(self, places: list[int]) -> None:
        async with self._freed:
            self._free.extend(places)
            self._freed.notify_all()

    async def store(self, names: list[bytes], objects: list[Any]) -> list[str]:
        """Each object's outcome: "new" (stored now), "held" (the tier had it: not copied, not
        written, not counted again) or "failed"."""
        held = await self.tier.lookup_each(names)
        states = ["held" if h else "failed" for h in held]
        todo = [j for j, h in enumerate(held) if not h]
        done = 0
        while done < len(todo):
            places = await self.take(len(todo) - done)
            part = todo[done : done + len(places)]
            try:
                written = await self.write(places, [names[j] for j in part], [objects[j] for j in part])
            finally:
                await self.give(places)
            for j, ok in zip(part, written):
                states[j] = "new" if ok else "failed"
            done += len(part)
        return states

    async def load(self, names: list[bytes], objects: list[Any]) -> list[bool]:
        """Load each name into its object; True only where the object now holds the exact bytes."""
        results: list[bool] = []
        while len(results) < len(names):
            places = await self.take(len(names) - len(results))
            part = slice(len(results), len(results) + len(places))
            try:
                results += await self.read(places, names[part], objects[part])
            finally:
                await self.give(places)
        return results

    @abc.abstractmethod
    async def write(self, places: list[int], names: list[bytes], objects: list[Any]) -> list[bool]:
        """Store each object under its name, one place each; True where the tier holds it now."""

    @abc.abstractmethod
    async def read(self, places: list[int], names: list[bytes], objects: list[Any]) -> list[bool]:
        """Load each name into its object, one place each; True where the exact bytes arrived."""


class InPlace(SizeClass):
    """Objects of one size moved straight between LMCache's L1 arena (the tier's primary
    memory) and the tier. An object outside the arena, or not 4096-aligned in it, fails
    (LMCache's objects all lie there: it allocates them in the arena, aligned)."""

    async def write(self, places: list[int], names: list[bytes], objects: list[Any]) -> list[bool]:
        return await self._move(self.tier.store_views, names, objects)

    async def read(self, places: list[int], names: list[bytes], objects: list[Any]) -> list[bool]:
        return await self._move(self.tier.load_views, names, objects)

    async def _move(
        self,
        move: Callable[[list[bytes], list[memoryview]], Awaitable[list[bool]]],
        names: list[bytes],
        objects: list[Any],
    ) -> list[bool]:
        """`move` (the tier's `store_views` or `load_views`) of the objects inside the arena."""
        inside = self._inside(objects)
        results = [False] * len(names)
        if inside:
            views = [object_view(objects[j]) for j in inside]
            for j, ok in zip(inside, await move([names[j] for j in inside], views)):
                results[j] = ok
        return results

    def _inside(self, objects: list[Any]) -> list[int]:
        """The objects the tier can move in place; the others are logged and fail."""
        offsets = [self.tier.primary_offset(object_view(obj)) for obj in objects]
        inside = [j for j, offset in enumerate(offsets) if offset is not None]
        if len(inside) < len(objects):
            self.tier.counters["objects_outside_arena"] += len(objects) - len(inside)
            self.tier.fault_log.warning(
                "outside-arena",
                "kvtier LMCache adapter: %d objects of %d bytes lie outside LMCache's L1 arena "
                "(or off its 4096-byte alignment): not moved",
                len(objects) - len(inside),
                self.nbytes,
            )
        return inside


class Staged(SizeClass):
    """Objects of one size moved through the tier's staging memory: place `i` is slot `i`,
    `stride` bytes apart."""

    def __init__(self, nbytes: int, tier: KVTier, places: int, memory: Any, stride: int) -> None:
        super().__init__(nbytes, tier, places)
        self.memory = memory
        self.stride = stride

    def slot(self, slot: int) -> memoryview:
        return memoryview(self.memory)[slot * self.stride : slot * self.stride + self.nbytes]

    async def write(self, places: list[int], names: list[bytes], objects: list[Any]) -> list[bool]:
        await self.tier.run_cpu(self.nbytes * len(places), _copy_in, self, places, objects)
        return await self.tier.store(names, places)

    async def read(self, places: list[int], names: list[bytes], objects: list[Any]) -> list[bool]:
        arrived = await self.tier.load(names, places)
        hits = [(slot, obj) for slot, obj, ok in zip(places, objects, arrived) if ok]
        if hits:
            slots, targets = [slot for slot, _ in hits], [obj for _, obj in hits]
            await self.tier.run_cpu(self.nbytes * len(hits), _copy_out, self, slots, targets)
        return arrived


class SizeClasses:
    """The size classes opened so far, each opened on first use (concurrent first uses share it).

    `arena`: LMCache's L1 arena (`arena_view`), or None where LMCache described none.
    """

    def __init__(
        self,
        tier_config: dict[str, Any],
        limits: dict[str, Any],
        staging_bytes: int,
        arena: memoryview | None = None,
        on_removed: Callable[[list[bytes]], None] | None = None,
    ) -> None:
        self.tier_config = tier_config
        self.limits = limits
        self.staging_bytes = staging_bytes
        self.arena = arena
        #: Told of the keys each size class's tier stops holding (evicted, deleted).
        self.on_removed = on_removed
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
        arena = self.arena if self.arena is not None and nbytes % 4096 == 0 else None
        if arena is not None and arena.nbytes >= nbytes:
            # The tier's primary memory is the whole arena, though its spec counts `slots` blocks
            # of it: the limits derived from the spec stay those of a staged size.
            primary, memory, slots = arena, None, min(slots, arena.nbytes // stride)
        else:
            memory = reserve_host_memory(slots * stride)
            primary = memoryview(memory)
        spec = OffloadingSpec(
            block_nbytes=nbytes,
            num_cpu_blocks=slots,
            secondary_tiers=[self.tier_config],
            namespace=f"lmcache:{nbytes}",
            **self.limits,
        )
        tier = await start_tier(self.tier_config, primary, spec)
        if self.on_removed is not None:
            tier.removal_listeners.append(self.on_removed)
        # Never more in the tier's hands than its pending-store budget (`SizeClass`).
        places = min(slots, spec.limits.max_pending_stores)
        if memory is None:
            size_class: SizeClass = InPlace(nbytes, tier, places)
        else:
            size_class = Staged(nbytes, tier, places, memory, stride)
        self._classes[nbytes] = size_class
        return size_class

    async def close(self) -> None:
        """Close every tier; afterwards none holds a view of its staging memory or LMCache's arena."""
        for size_class in self._classes.values():
            await size_class.tier.aclose()
        self._classes.clear()
        if self.arena is not None:
            try:
                self.arena.release()
            except BufferError:  # as a tier does: say so, and let the close go on
                log.error("kvtier LMCache adapter: closed, but something still exports LMCache's L1 arena")


def _copy_in(size_class: Staged, slots: list[int], objects: list[Any]) -> None:
    """Worker thread: each object's bytes into its staging slot (the GIL released)."""
    for slot, obj in zip(slots, objects):
        copy_into(size_class.slot(slot), object_view(obj))


def _copy_out(size_class: Staged, slots: list[int], objects: list[Any]) -> None:
    """Worker thread: each loaded slot into its object (the GIL released)."""
    for slot, obj in zip(slots, objects):
        copy_into(object_view(obj), size_class.slot(slot))
