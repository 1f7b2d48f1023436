"""`LoadPipeline`: a cache's load path. Locate, stage, promote, copy, within a deadline.

    secondary tiers --promote--> primary slots --copy--> device

A load moves blocks chunk by chunk until the first that is not available anywhere. While
chunk k travels host -> device, the next few are gathered in the primary tier (hits
pinned, misses promoted from the first secondary tier holding them), so tier reads keep
several batches in flight. Whatever a load holds (pins, filling slots) is given back when
it returns or raises, cancellation and a deadline included.
"""

from __future__ import annotations

import asyncio
import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio

from .copy_engine import CopyEngine
from .primary import PrimaryTier
from .releases import Releases
from .scheduler import Priority, wait_uncancellable
from .spec import OffloadingSpec
from .tier import SecondaryTierManager

__all__ = ["LoadPipeline"]


async def _settle(task: asyncio.Future[Any]) -> asyncio.CancelledError | None:
    """Wait until `task` is done, whatever it raises. If we are cancelled meanwhile, cancel
    it (its own clean-up runs) and keep waiting; returns our cancellation, if any."""
    ours: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.wait({task})  # raises only if we ourselves are cancelled
        except asyncio.CancelledError as exc:
            ours = exc
            task.cancel()
    return ours


def _succeeded(task: asyncio.Future[Any]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None


class _Then(enum.Enum):
    """What a load does after one chunk."""

    GO_ON = "go on with the next chunk"
    WAIT = "wait for a primary slot to be released, then try again"
    STOP = "stop: the next key is not available"


@dataclass(slots=True)
class _Staged:
    """A chunk gathered in the primary tier for a load: what it pins and how far it is valid."""

    slots: list[int | None] = field(default_factory=list)  # per key: pinned slot, or None
    filling: set[int] = field(default_factory=set)  # allocated here and not published
    cut: int = 0  # leading blocks now valid
    then: _Then = _Then.GO_ON
    releases_seen: int = 0  # the cache's release count when `then` became WAIT


@dataclass(slots=True)
class _InFlight:
    staged: _Staged
    copy: asyncio.Future[None] | None  # its host -> device copy, if any
    done_up_to: int  # progress once the copy is done


class LoadPipeline:
    """Loads and prefetches of blocks from `primary` and `tiers`, counted in `counters`."""

    def __init__(
        self,
        spec: OffloadingSpec,
        primary: PrimaryTier,
        copy_engine: CopyEngine,
        tiers: list[SecondaryTierManager],
        releases: Releases,
        counters: Counter[str],
        loaded_from: Counter[str],
    ) -> None:
        self.spec = spec
        self.limits = spec.limits
        self.primary = primary
        self.copy_engine = copy_engine
        self.tiers = tiers
        self.releases = releases
        self.counters = counters
        self.loaded_from = loaded_from  # blocks staged, per tier they came from ("primary" too)

    async def locate(self, keys: list[bytes]) -> list[int | None]:
        """The index of the first tier holding each key, None if no tier does."""
        sources: list[int | None] = [None] * len(keys)
        for t, tier in enumerate(self.tiers):
            todo = [i for i, source in enumerate(sources) if source is None]
            if not todo:
                break
            present = await tier.lookup_each([keys[i] for i in todo])
            for i, held in zip(todo, present):
                if held:
                    sources[i] = t
        return sources

    async def run(
        self,
        keys: list[bytes],
        ids: list[int] | None,
        timeout: float | None,
        priority: Priority,
        consumer: Any = None,
    ) -> int:
        """Load `keys` into device blocks `ids` (None: into the primary tier only, a prefetch);
        returns how many leading blocks arrived, within `timeout` seconds if given. The device
        copies wait for what `consumer` marks (`CopyEngine.mark`)."""
        progress = [0]
        if timeout is None:
            await self._load(keys, ids, progress, priority, consumer)
            return progress[0]
        task = asyncio.ensure_future(self._load(keys, ids, progress, priority, consumer))
        ours: asyncio.CancelledError | None = None
        try:
            await asyncio.wait({task}, timeout=timeout)
        except asyncio.CancelledError as exc:
            ours = exc
        if not task.done() and ours is None:
            self.counters["deadline_misses"] += 1  # the deadline, not the caller, ends it
        task.cancel()
        # The load winds down (its copies finish, its pins go back) whoever stopped it; a
        # caller cancelled at any point meanwhile gets its cancellation, always.
        ours = await _settle(task) or ours
        if ours is not None:
            raise ours
        if not task.cancelled():
            task.result()  # the load's own error, if any
        return progress[0]

    async def _load(
        self,
        keys: list[bytes],
        ids: list[int] | None,
        progress: list[int],
        priority: Priority,
        consumer: Any,
    ) -> None:
        """Move blocks chunk by chunk until the first one that is not available anywhere.

        The stages overlap: while chunk k travels host -> device, the next few
        chunks are already being gathered in the primary tier (hits pinned,
        misses read from the secondary tiers), so tier reads keep several
        batches in flight. Only the chunk at the head counts: a chunk gathered
        ahead that came out short is given back and gathered again when it is
        the head. `progress[0]` counts the blocks whose device copy is done.
        """
        chunk = self.limits.chunk_blocks
        depth = max(1, min(4, self.primary.num_slots // 2 // chunk))  # chunks gathered ahead
        starts = list(range(0, len(keys), chunk))
        ahead: dict[int, asyncio.Future[_Staged]] = {}
        inflight: _InFlight | None = None
        head = 0  # index into starts
        try:
            while head < len(starts):
                for k in range(head, min(head + depth, len(starts))):
                    if k not in ahead:
                        end = starts[k + 1] if k + 1 < len(starts) else len(keys)
                        ahead[k] = asyncio.ensure_future(self._stage_chunk(keys, starts[k], end, priority))
                pos = starts[head]
                end = starts[head + 1] if head + 1 < len(starts) else len(keys)
                staged = await self._staged_result(ahead.pop(head))
                copy = None
                if ids is not None and staged.cut:
                    prefix = [slot for slot in staged.slots[: staged.cut] if slot is not None]
                    copy = asyncio.ensure_future(
                        self.copy_engine.to_device(prefix, ids[pos : pos + staged.cut], consumer)
                    )
                # Handed over before the next await: from here the `finally` below releases it.
                previous, inflight = inflight, _InFlight(staged, copy, pos + staged.cut)
                try:
                    if staged.cut < end - pos or staged.then is not _Then.GO_ON:
                        await self._give_back(ahead)  # gathered on a guess that no longer holds
                finally:
                    if previous is not None:
                        await self._finish(previous, progress)
                if staged.then is _Then.STOP:
                    break
                if staged.cut < end - pos:
                    starts[head] = pos + staged.cut  # the rest of this chunk goes again
                else:
                    head += 1
                if staged.then is _Then.WAIT:
                    # Nothing could move without a slot someone else held when it looked;
                    # give ours back and wait for any release since then (ours count).
                    done, inflight = inflight, None
                    await self._finish(done, progress)
                    await self.releases.wait_since(staged.releases_seen)
        finally:
            # Both run, even if the first raises a cancellation (a load can be cancelled twice:
            # by its deadline, then by its caller).
            try:
                await self._give_back(ahead)
            finally:
                if inflight is not None:
                    await self._finish(inflight, progress)

    async def _give_back(self, ahead: dict[int, asyncio.Future[_Staged]]) -> None:
        """Cancel chunks gathered ahead and release what they hold; runs to its end."""
        tasks = list(ahead.values())
        ahead.clear()
        for task in tasks:
            task.cancel()
        ours: asyncio.CancelledError | None = None
        for task in tasks:
            ours = await _settle(task) or ours
            if _succeeded(task):
                self._release(task.result())  # it finished before the cancel reached it
        if ours is not None:
            raise ours

    async def _staged_result(self, task: asyncio.Future[_Staged]) -> _Staged:
        """Wait for a chunk being gathered. If we are cancelled meanwhile, it is cancelled
        too and waited for, and whatever it holds is released before we go on."""
        ours = await _settle(task)
        if ours is not None:
            if _succeeded(task):
                self._release(task.result())
            raise ours
        return task.result()

    async def _finish(self, inflight: _InFlight, progress: list[int]) -> None:
        """Wait for a chunk's device copy (to its end, even if cancelled), then release it."""
        try:
            if inflight.copy is not None:
                await wait_uncancellable(inflight.copy)
                self.counters["bytes_to_device"] += inflight.staged.cut * self.spec.block_nbytes
            progress[0] = inflight.done_up_to
        finally:
            self._release(inflight.staged)

    def _release(self, staged: _Staged) -> None:
        for slot in staged.slots:
            if slot is None:
                continue
            if slot in staged.filling:
                self.primary.abort(slot)
            else:
                self.primary.unpin(slot)

    async def _stage_chunk(self, keys: list[bytes], pos: int, end: int, priority: Priority) -> _Staged:
        """Gather keys[pos:end] in the primary tier, pinned; the caller releases the result.

        Primary hits are pinned; misses are promoted from the first secondary
        tier holding them. `cut` is how many leading blocks are now valid.
        """
        primary = self.primary
        staged = _Staged()
        try:
            # 1. primary hits (pinned), stopping at a key another call is filling right now
            for i in range(pos, end):
                if primary.is_filling(keys[i]):
                    break
                staged.slots.append(primary.acquire(keys[i]))
            if not staged.slots:
                staged.then = _Then.WAIT  # its filler will publish or abort it
                staged.releases_seen = self.releases.count
                return staged
            cut = len(staged.slots)  # the prefix that can be valid
            misses = [j for j, slot in enumerate(staged.slots) if slot is None]
            promoted = 0  # blocks of the valid prefix that came from a secondary tier
            if misses:
                # 2. where each miss is; slots for those before the first that is nowhere
                sources = await self.locate([keys[pos + j] for j in misses])
                # Other calls ran while we located: a miss may be ready or filling by now.
                by_tier: dict[int, list[int]] = {}
                for j, source in zip(misses, sources):
                    key = keys[pos + j]
                    hit = primary.acquire(key)
                    if hit is not None:
                        staged.slots[j] = hit  # published meanwhile: a primary hit now
                        continue
                    if primary.is_filling(key):
                        cut, staged.then = j, _Then.WAIT  # its filler will publish or abort it
                        staged.releases_seen = self.releases.count
                        break
                    if source is None:
                        cut, staged.then = j, _Then.STOP
                        break
                    slot = primary.allocate(key)
                    if slot is None:
                        cut = j  # every slot is pinned: go on (or wait) from here
                        break
                    staged.slots[j] = slot
                    staged.filling.add(slot)
                    by_tier.setdefault(source, []).append(j)
                if cut == 0:
                    if staged.then is _Then.GO_ON:
                        staged.then = _Then.WAIT
                        staged.releases_seen = self.releases.count
                    return staged
                # 3. promote from the tiers, concurrently per tier
                ok = await self._promote(keys, pos, staged.slots, by_tier, priority)
                for j in sorted(ok):
                    slot = staged.slots[j]
                    if ok[j] and slot is not None:  # every promoted j has its slot
                        primary.publish(slot)
                        staged.filling.discard(slot)  # promoted, kept even past the cut
                    elif j < cut:
                        cut, staged.then = j, _Then.STOP  # present, but the read failed
                promoted = sum(1 for j in ok if ok[j] and j < cut)
                for t, js in by_tier.items():
                    self.loaded_from[self.tiers[t].name] += sum(1 for j in js if ok.get(j) and j < cut)
            staged.cut = cut
            self.counters["primary_hit_blocks"] += cut - promoted
            self.loaded_from["primary"] += cut - promoted
            self.counters["promoted_blocks"] += promoted
            return staged
        except BaseException:
            self._release(staged)
            raise

    async def _promote(
        self,
        keys: list[bytes],
        pos: int,
        slots: list[int | None],
        by_tier: dict[int, list[int]],
        priority: Priority,
    ) -> dict[int, bool]:
        ok: dict[int, bool] = {}

        async def from_tier(t: int, js: list[int]) -> None:
            results = await self.tiers[t].load(
                [keys[pos + j] for j in js],
                [slots[j] for j in js],  # type: ignore[misc]
                priority=priority,
            )
            ok.update(zip(js, results))

        async with anyio.create_task_group() as group:
            for t, js in by_tier.items():
                group.start_soon(from_tier, t, js)
        return ok
