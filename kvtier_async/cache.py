"""`TieredKVCache`: the front door. Device blocks <-> primary tier <-> secondary tiers.

    store:  device --copy--> primary slots --(background, per tier)--> secondary tiers
    load:   secondary tiers --promote--> primary slots --copy--> device

Work proceeds in chunks of `spec.limits.chunk_blocks`, so a call may cover more
blocks than the primary tier holds. `store` returns once the device blocks may
be reused; the writes to the secondary tiers go on in the background and
`flush()` waits for them. Whatever a call holds (pins, filling slots) is given
back when it returns or raises, cancellation included.

Opening (`async with`, or the first store or load) makes the primary tier's
memory resident and pinned, and closing gives it back, both on a worker thread:
each costs ~0.1 to 0.6 s per GiB, which the event loop must not wait through.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
from anyio.abc import AsyncResource

from .copy_engine import CopyEngine, as_layer_list, block_widths
from .errors import ClosedError, InvalidArgumentError
from .factory import SecondaryTierFactory
from .fault_log import FaultLog
from .in_flight import CallsInFlight
from .keys import check_block_ids, check_keys, check_lengths
from .primary import PrimaryTier
from .scheduler import Priority, Scheduler, wait_uncancellable
from .spec import OffloadingSpec
from .tier import SecondaryTierManager

__all__ = ["TieredKVCache"]

log = logging.getLogger(__name__)


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


def _weakly(method: Callable[[], None]) -> Callable[[], None]:
    """A callback that calls a bound `method` without keeping its object alive. The primary
    tier calling back into the cache would otherwise be a reference cycle, freed by the
    cycle collector (on whatever thread, often the event loop's) instead of by its owner."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


def _check_timeout(timeout: float | None) -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise InvalidArgumentError(f"timeout must be None or a number >= 0, got {timeout!r}")


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


class TieredKVCache(AsyncResource):
    """KV blocks of `kv_caches` offloaded to a pinned host tier and the spec's secondary tiers.

    `kv_caches` is a tensor, a list of tensors or a dict of them (one per layer,
    say), each with the device block id as dim 0; the bytes of one block
    across them must add up to `spec.block_nbytes`. Use one event loop per cache.
    """

    def __init__(self, spec: OffloadingSpec, kv_caches: Any, *, pin_memory: bool | None = None) -> None:
        if not isinstance(spec, OffloadingSpec):
            raise InvalidArgumentError(
                f"spec must be a kvtier_async.OffloadingSpec, got {type(spec).__name__}"
            )
        layers = as_layer_list(kv_caches)
        if sum(block_widths(layers)) != spec.block_nbytes:  # checked before allocating anything
            raise InvalidArgumentError(
                f"one device block is {sum(block_widths(layers))} bytes across kv_caches "
                f"({len(layers)} tensors), but spec.block_nbytes is {spec.block_nbytes}"
            )
        self.spec = spec
        self.limits = spec.limits
        self.primary = PrimaryTier(spec, pin_memory=pin_memory, resident=False)  # see `_open`
        self.copy_engine = CopyEngine(layers, self.primary, threads=self.limits.copy_threads)
        self.scheduler = Scheduler(self.limits)
        self.tiers: list[SecondaryTierManager] = []
        try:
            for config in spec.secondary_tiers:
                tier = SecondaryTierFactory.create_secondary_tier(config, self.primary.view, spec)
                tier.name = self._unique_name(tier.tier_type)
                tier.use_scheduler(self.scheduler)
                self.tiers.append(tier)
        except BaseException:
            self.copy_engine.close()
            raise
        self.counters: Counter[str] = Counter()
        self._fault_log = FaultLog(log)
        self._background: set[asyncio.Task[None]] = set()
        self._store_slots = 0  # primary slots held by stores: copying, or waiting for the tiers
        # Releases of primary slots, counted, so a load that found every slot pinned can
        # wait for "a release since I looked" without missing one.
        self._releases = 0
        self._released = asyncio.Event()
        self.primary.on_release = _weakly(self._on_release)
        self._opening: asyncio.Future[None] | None = None
        self._calls = CallsInFlight()  # store, load and prefetch; `aclose` waits for them
        self._closed = False

    async def __aenter__(self) -> TieredKVCache:
        try:
            await self._open()
        except BaseException:
            await self.aclose()  # `async with` will not: its body never started
            raise
        return self

    async def _open(self) -> None:
        """Make the primary tier resident (and pinned) on a worker thread, once; the first
        store or load does this too. A failure is raised to every waiter and tried again."""
        if self.primary.resident:
            return
        if self._opening is None:
            self._opening = asyncio.ensure_future(self.scheduler.run_blocking(self.primary.make_resident))
        opening = self._opening
        try:
            await asyncio.shield(opening)  # a cancelled waiter leaves the opening to the others
        finally:
            if opening.done() and not _succeeded(opening) and self._opening is opening:
                self._opening = None  # it failed: the next call tries again

    @contextlib.contextmanager
    def _operation(self) -> Iterator[None]:
        """A store, load or prefetch call: refused once closed, counted until it returns."""
        self._check_open()
        with self._calls.track():
            yield

    def _on_release(self) -> None:
        self._releases += 1
        self._released.set()

    async def _wait_for_release(self, since: int) -> None:
        while self._releases == since:
            self._released.clear()
            await self._released.wait()

    def _unique_name(self, tier_type: str) -> str:
        taken = {tier.name for tier in self.tiers}
        name, n = tier_type, 1
        while name in taken:
            name, n = f"{tier_type}#{n}", n + 1
        return name

    @property
    def num_device_blocks(self) -> int:
        return self.copy_engine.num_device_blocks

    # -- store -----------------------------------------------------------------------------------
    async def store(self, keys: Sequence[bytes], device_block_ids: Sequence[int]) -> int:
        """Offload device blocks under `keys`; returns how many leading blocks were accepted.

        Keys already held count as accepted and are not copied again. Returns
        once the device blocks may be reused; the writes to the secondary tiers
        continue in the background (`flush()` waits for them). A block is not
        accepted when no primary slot can be had without waiting on other
        calls' work: stores are best effort.
        """
        keys, ids = self._check_args(keys, device_block_ids)
        with self._operation():
            await self._open()
            return await self._store(keys, ids)

    async def _store(self, keys: list[bytes], ids: list[int]) -> int:
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
                    slot = self._allocate_for_store(key)
                    if slot is None:
                        break
                    copy_keys.append(key)
                    copy_ids.append(ids[i])
                    slots.append(slot)
                i += 1
            if slots:
                cascade = await self._fill_and_cascade(copy_keys, copy_ids, slots)
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

    def _allocate_for_store(self, key: bytes) -> int | None:
        """A filling slot for a store, within the slots stores may hold (see `store_slots`)."""
        if self._store_slots >= self.limits.store_slots:
            return None
        slot = self.primary.allocate(key)
        if slot is not None:
            self._store_slots += 1
        return slot

    def _unpin_stored(self, slots: list[int]) -> None:
        self._store_slots -= len(slots)
        for slot in slots:
            self.primary.unpin(slot)

    async def _until_not_filling(self, key: bytes) -> None:
        while self.primary.is_filling(key):
            await self._wait_for_release(self._releases)

    async def _fill_and_cascade(
        self, keys: list[bytes], device_ids: list[int], slots: list[int]
    ) -> asyncio.Task[None] | None:
        try:
            await self.copy_engine.to_host(device_ids, slots)
        except BaseException:
            self._store_slots -= len(slots)
            for slot in slots:
                self.primary.abort(slot)
            raise
        for slot in slots:
            self.primary.publish(slot)
        self.counters["bytes_to_host"] += len(slots) * self.spec.block_nbytes
        if not self.tiers:
            self._unpin_stored(slots)
            return None
        task = asyncio.ensure_future(self._cascade(keys, slots))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _cascade(self, keys: list[bytes], slots: list[int]) -> None:
        """Write-through to every secondary tier; the slots stay pinned until all are done."""
        try:
            async with anyio.create_task_group() as group:
                for tier in self.tiers:
                    group.start_soon(tier.store, keys, slots)
        except Exception:
            self.counters["cascade_errors"] += 1
            self._fault_log.error(
                "cascade", "writing %d blocks to the secondary tiers failed", len(keys), exc_info=True
            )
        finally:
            self._unpin_stored(slots)

    async def flush(self) -> None:
        """Wait until every accepted store has reached every secondary tier (or failed there)."""
        while self._background:
            await asyncio.wait(set(self._background))

    # -- lookup ------------------------------------------------------------------------------------
    async def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are available in the primary or any secondary tier."""
        check_keys(keys)
        self._check_open()
        keys = list(keys)
        n = 0
        while n < len(keys) and self.primary.lookup(keys[n]) is not None:
            n += 1
        if n == len(keys) or not self.tiers:
            return n
        sources = await self._locate(keys[n:])
        for i, key in enumerate(keys[n:]):
            if sources[i] is None and self.primary.lookup(key) is None:
                return n + i
        return len(keys)

    async def _locate(self, keys: list[bytes]) -> list[int | None]:
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

    # -- load and prefetch --------------------------------------------------------------------------
    async def load(
        self, keys: Sequence[bytes], device_block_ids: Sequence[int], timeout: float | None = None
    ) -> int:
        """Copy the longest available prefix of `keys` into `device_block_ids`; returns its length.

        Blocks come from the primary tier, else from the first secondary tier
        holding them (promoted into the primary tier on the way). With a
        `timeout` (seconds), returns the prefix complete by then.
        """
        keys, ids = self._check_args(keys, device_block_ids)
        _check_timeout(timeout)
        with self._operation():
            await self._open()
            self.counters["load_calls"] += 1
            loaded = await self._with_deadline(keys, ids, timeout, Priority.LOAD)
            self.counters["loaded_blocks"] += loaded
            return loaded

    async def prefetch(self, keys: Sequence[bytes], timeout: float | None = None) -> int:
        """Bring the leading available keys into the primary tier; returns how many are there."""
        check_keys(keys)
        _check_timeout(timeout)
        with self._operation():
            await self._open()
            self.counters["prefetch_calls"] += 1
            return await self._with_deadline(list(keys), None, timeout, Priority.PREFETCH)

    async def _with_deadline(
        self,
        keys: list[bytes],
        ids: list[int] | None,
        timeout: float | None,
        priority: Priority,
    ) -> int:
        progress = [0]
        if timeout is None:
            await self._load(keys, ids, progress, priority)
            return progress[0]
        task = asyncio.ensure_future(self._load(keys, ids, progress, priority))
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
        self, keys: list[bytes], ids: list[int] | None, progress: list[int], priority: Priority
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
                        self.copy_engine.to_device(prefix, ids[pos : pos + staged.cut])
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
                    await self._wait_for_release(staged.releases_seen)
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
                staged.releases_seen = self._releases
                return staged
            cut = len(staged.slots)  # the prefix that can be valid
            misses = [j for j, slot in enumerate(staged.slots) if slot is None]
            promoted = 0  # blocks of the valid prefix that came from a secondary tier
            if misses:
                # 2. where each miss is; slots for those before the first that is nowhere
                sources = await self._locate([keys[pos + j] for j in misses])
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
                        staged.releases_seen = self._releases
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
                        staged.releases_seen = self._releases
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
            staged.cut = cut
            self.counters["primary_hit_blocks"] += cut - promoted
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

    # -- the rest ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """A plain dict: primary-tier gauges, call and block counters, limits, the scheduler's
        lanes (`<tier>/load`, `<tier>/store`, `bytes_in_flight`) and per-tier stats."""
        out: dict[str, Any] = dict(self.primary.stats())
        for name in (
            "store_calls",
            "stored_blocks",
            "store_rejected_blocks",
            "bytes_to_host",
            "load_calls",
            "prefetch_calls",
            "loaded_blocks",
            "primary_hit_blocks",
            "promoted_blocks",
            "bytes_to_device",
            "deadline_misses",
            "cascade_errors",
        ):
            out[name] = self.counters[name]
        out["background_stores"] = len(self._background)
        out["limits"] = asdict(self.limits)
        out["tiers"] = {tier.name: tier.stats() for tier in self.tiers}  # makes every tier's lanes
        out["scheduler"] = self.scheduler.stats()
        return out

    async def aclose(self) -> None:
        """Finish the background stores and the calls in flight, close every tier, then give
        the primary tier's memory back. Closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        try:
            # The calls in flight first: a store still running starts background writes of
            # its own, which must reach the tiers before they close.
            await self._calls.wait_until_none()
            await self.flush()
        finally:
            # If waiting was cancelled, the background writes are too; either way the
            # closing itself runs to its end.
            for task in self._background:
                task.cancel()
            await wait_uncancellable(asyncio.ensure_future(self._close_all()))

    async def _close_all(self) -> None:
        await self._calls.wait_until_none()
        while self._background:
            await asyncio.wait(set(self._background))
        try:
            for tier in self.tiers:
                await tier.aclose()
        finally:
            try:
                if self._opening is not None:
                    await asyncio.wait({self._opening})
                # Nothing touches the buffer any more: its pages go back on a worker thread.
                await self.scheduler.run_blocking(self.primary.release_memory)
            finally:
                self.copy_engine.close()
                self.scheduler.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the cache is closed")

    def _check_args(
        self, keys: Sequence[bytes], device_block_ids: Sequence[int]
    ) -> tuple[list[bytes], list[int]]:
        check_keys(keys)
        ids = check_block_ids(device_block_ids, self.num_device_blocks, what="device_block_ids")
        check_lengths(keys, ids)
        self._check_open()
        return list(keys), ids
