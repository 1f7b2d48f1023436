"""`SecondaryTierManager`: the contract every secondary tier implements.

The base class owns argument checks, deduplication (`single_flight`), batching
(`batches`), counters and cancellation; opening, closing and the scheduler are
its own base's (`tier_resource.TierResource`). A backend writes four batched
hooks (`write_blocks`, `read_blocks`, `contains`, `delete`) and, if it needs
them, `open_backend` / `close_backend` / `backend_stats`.

Block `i` of the primary tier is `primary_kv_view[i*stride : i*stride + block_nbytes]`;
`store_views` / `load_views` take blocks anywhere in that memory instead, by their views
(an engine whose allocator places blocks at any aligned offset: LMCache's L1 arena).
When `store` or `load` returns or raises (cancellation included), nothing in the
background touches those primary slots any more: backends finish or abandon
their use of the buffers before their hook returns, and worker-thread work is
awaited to the end (`Scheduler.run_blocking`).
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar

from .batches import run_in_batches
from .errors import InvalidArgumentError
from .keys import check_block_ids, check_keys, check_lengths
from .scheduler import Lane, Priority
from .single_flight import SingleFlight
from .spec import OffloadingSpec
from .tier_resource import TierResource
from .turn_budget import TurnBudget

__all__ = ["SecondaryTierManager"]

#: The counters `stats()` reports, zero or not.
STATS_COUNTERS = (
    "store_calls",
    "stored_blocks",
    "stored_bytes",
    "store_failed_blocks",
    "stores_dropped",
    "stores_deduplicated",
    "load_calls",
    "load_hits",
    "load_misses",
    "loaded_bytes",
    "lookup_calls",
    "errors",
    "calls_skipped_while_down",
    "queue_timeouts",
)


class SecondaryTierManager(TierResource):
    """Async store / load / lookup of primary-tier slots to and from one secondary tier.

    `async with tier:` starts it (`start`: a configuration that can never work raises its
    `ConfigError` there) and closes it at the end. Usable at once after construction too
    (`await tier.store(...)`): opening work a backend needs then runs before its first
    operation. Either way off the event-loop thread.
    """

    #: Whether `store` asks `contains` first and writes only the keys not held. A backend whose
    #: existence check costs a request per key may turn it off: what an engine stores is mostly
    #: what its lookup has just missed, and writing a held key again is harmless.
    check_held_before_write: ClassVar[bool] = True

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        self._single_flight = SingleFlight()  # keys being written by a store in flight
        # Blocks per hook call. Resolved once: `spec.limits` builds its whole answer on every read.
        self._batch_blocks = offloading_spec.limits.batch_blocks
        # Calls started together share a slice of a turn of the loop; the rest go on later.
        self._turn = TurnBudget()
        #: Called on the event-loop thread with the keys this tier stopped holding (evicted,
        #: replaced or deleted), where the backend knows it; a shared tier's server may also
        #: drop keys without telling anyone.
        self.removal_listeners: list[Callable[[list[bytes]], None]] = []

    # -- the backend's part ----------------------------------------------------------------
    @abc.abstractmethod
    async def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        """Write each block under its key; True where the tier now holds exactly those bytes.

        A key the tier already holds may be skipped (True). Must not keep a
        reference to `blocks` after returning.
        """

    @abc.abstractmethod
    async def read_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        """Read each key into its block; True only where the block now holds the exact bytes."""

    @abc.abstractmethod
    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is held (a later read may still miss)."""

    @abc.abstractmethod
    async def delete(self, keys: Sequence[bytes]) -> int:
        """Remove the keys; returns how many were held."""

    def hold(self, keys: Sequence[bytes]) -> list[bool]:
        """Keep each key from this tier's own eviction until `release` (event-loop thread, no I/O).

        True where the tier holds the key and promises to keep it: until as many `release`
        calls, new blocks neither evict nor overwrite it (a store finding no other room fails
        instead; `delete` still removes it). False where it does not hold the key or cannot
        promise: the default, right for a tier whose server evicts on its own (Redis under
        `maxmemory`). Engines that lock what a lookup found (LMCache's L2 adapters) use it.
        """
        check_keys(keys)
        return [False] * len(keys)

    def release(self, keys: Sequence[bytes]) -> None:
        """Give back one `hold` of each key that `hold` answered True for (event-loop thread)."""

    def notify_removed(self, keys: list[bytes]) -> None:
        """Tell the `removal_listeners` that this tier no longer holds `keys` (event-loop thread)."""
        if not keys:
            return
        for listener in self.removal_listeners:
            try:
                listener(keys)
            except Exception:
                self.fault_log.error(
                    "listener", "tier %r: a removal listener failed", self.name, exc_info=True
                )

    # -- the public operations -----------------------------------------------------------------
    async def store(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> list[bool]:
        """Write primary slots `block_ids` to this tier under `keys`.

        True for each block the tier now holds. Blocks beyond the tier's
        pending-store budget are dropped at once (False, counted in
        `stores_dropped`); backend faults are False too, counted in `errors`.
        A key the tier already holds, or is writing for another call right now,
        is not written again (`stores_deduplicated`); a sharer gets the outcome
        of the write in flight.
        """
        await self._turn.enter()
        keys, views = self._check_args(keys, block_ids)
        return await self._store_checked(keys, views)

    async def store_views(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> list[bool]:
        """`store`, the blocks given by their bytes: each a C-contiguous buffer of
        `block_nbytes` bytes inside the primary memory, at a multiple of 4096 bytes from its
        start (`block_nbytes` must be a multiple of 4096 too). Nothing is copied on the way.
        """
        await self._turn.enter()
        keys, views = self._check_views(keys, blocks, writable=False)
        return await self._store_checked(keys, views)

    async def _store_checked(self, keys: list[bytes], views: list[memoryview]) -> list[bool]:
        results = [False] * len(keys)
        if not keys:
            return results
        with self._operation("store"):
            lane = self.scheduler.lane(self.name, "store")
            accepted = lane.reserve_pending(len(keys))
            self.counters["store_calls"] += 1
            self.counters["stores_dropped"] += len(keys) - accepted

            async def write(own: list[int]) -> list[bool]:
                lane.release_pending(accepted - len(own))  # the others share writes in flight
                return await self._write_new(lane, [keys[i] for i in own], [views[i] for i in own])

            # A key this tier is writing right now is not written again: this call shares the
            # outcome of the write in flight.
            results[:accepted], shared = await self._single_flight.write(keys[:accepted], write)
            self.counters["stores_deduplicated"] += shared
        return results

    async def _write_new(self, lane: Lane, keys: list[bytes], views: list[memoryview]) -> list[bool]:
        """Write the keys this call owns (their pending room reserved); held ones are skipped."""
        results = [False] * len(keys)
        reserved = len(keys)
        try:
            if not keys:
                return results
            if not await self._ensure_open():
                self.counters["store_failed_blocks"] += len(keys)
                return results
            if self.check_held_before_write:
                held = await self._guard.call("contains", self.contains(keys), len(keys), Priority.STORE)
            else:
                held = [False] * len(keys)
            todo = [i for i, h in enumerate(held) if not h]
            lane.release_pending(len(keys) - len(todo))
            self.counters["stores_deduplicated"] += len(keys) - len(todo)
            for i, h in enumerate(held):
                results[i] = h  # already held: no second write
            written = [False] * len(todo)
            reserved = 0  # from here _run_batches gives the room back, batch by batch
            await self._run_batches(
                lane,
                Priority.STORE,
                self.write_blocks,
                [keys[i] for i in todo],
                [views[i] for i in todo],
                written,
                pending=True,
            )
            for i, ok in zip(todo, written):
                results[i] = ok
            stored = sum(written)
            self.counters["stored_blocks"] += stored
            self.counters["stored_bytes"] += stored * self.block_nbytes
            self.counters["store_failed_blocks"] += len(todo) - stored
            return results
        finally:
            if reserved:
                lane.release_pending(reserved)

    async def load(
        self,
        keys: Sequence[bytes],
        block_ids: Sequence[int],
        *,
        priority: Priority = Priority.LOAD,
    ) -> list[bool]:
        """Read `keys` into primary slots `block_ids`; True only where the exact bytes arrived."""
        await self._turn.enter()
        keys, views = self._check_args(keys, block_ids)
        return await self._load_checked(keys, views, priority)

    async def load_views(
        self, keys: Sequence[bytes], blocks: Sequence[Any], *, priority: Priority = Priority.LOAD
    ) -> list[bool]:
        """`load` into blocks given by their bytes, as `store_views` takes them (writable)."""
        await self._turn.enter()
        keys, views = self._check_views(keys, blocks, writable=True)
        return await self._load_checked(keys, views, priority)

    async def _load_checked(
        self, keys: list[bytes], views: list[memoryview], priority: Priority
    ) -> list[bool]:
        results = [False] * len(keys)
        if not keys:
            return results
        with self._operation("load"):
            if not await self._ensure_open():
                self.counters["load_misses"] += len(keys)
                return results
            lane = self.scheduler.lane(self.name, "load")
            self.counters["load_calls"] += 1
            await self._run_batches(lane, priority, self.read_blocks, keys, views, results)
            hits = sum(results)
            self.counters["load_hits"] += hits
            self.counters["load_misses"] += len(keys) - hits
            self.counters["loaded_bytes"] += hits * self.block_nbytes
        return results

    async def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys this tier holds."""
        present = await self.lookup_each(keys, stop_at_miss=True)
        return present.index(False) if False in present else len(present)

    async def lookup_each(self, keys: Sequence[bytes], *, stop_at_miss: bool = False) -> list[bool]:
        """Whether this tier holds each key; a backend fault reads as absent (counted).

        With `stop_at_miss`, batches after the first absent key are not asked
        about and read as absent.
        """
        await self._turn.enter()
        check_keys(keys)
        self._check_not_closed()
        keys = list(keys)
        present = [False] * len(keys)
        if not keys:
            return present
        with self._operation():
            if not await self._ensure_open():
                return present
            self.counters["lookup_calls"] += 1
            batch = self._batch_blocks
            for start in range(0, len(keys), batch):
                part = keys[start : start + batch]
                found = await self._guard.call("contains", self.contains(part), len(part), Priority.LOAD)
                present[start : start + len(part)] = found
                if stop_at_miss and not all(found):
                    break
        return present

    def stats(self) -> dict[str, Any]:
        """Counters (calls, blocks, bytes, hits, misses, drops, errors), lanes and backend gauges."""
        out: dict[str, Any] = {"type": self.tier_type}
        out.update((name, self.counters[name]) for name in STATS_COUNTERS)
        out["fault_breaker"] = self.fault_breaker.state()
        for direction, seconds in self.busy_seconds.items():
            out[f"{direction}_busy_seconds"] = round(seconds, 6)
        if self._scheduler is not None:
            out["lanes"] = {
                direction: self._scheduler.lane(self.name, direction).stats()
                for direction in ("load", "store")
            }
        out.update(self.backend_stats())
        return out

    # -- internals ---------------------------------------------------------------------------
    def _check_args(
        self, keys: Sequence[bytes], block_ids: Sequence[int]
    ) -> tuple[list[bytes], list[memoryview]]:
        """The keys and their primary slots' views; raises `InvalidArgumentError`."""
        self._check_keys(keys)
        ids = check_block_ids(block_ids, self.num_blocks)
        self._check_pairs(keys, ids)
        return list(keys), [self.block_view(i) for i in ids]

    def _check_views(
        self, keys: Sequence[bytes], blocks: Sequence[Any], *, writable: bool
    ) -> tuple[list[bytes], list[memoryview]]:
        """The keys and the primary memory's views of `blocks` (see `store_views`); raises
        `InvalidArgumentError`."""
        self._check_keys(keys)
        if isinstance(blocks, (bytes, bytearray, memoryview, str)) or not isinstance(blocks, Sequence):
            raise InvalidArgumentError(f"blocks must be a sequence of buffers, got {type(blocks).__name__}")
        self._check_pairs(keys, blocks)
        return list(keys), self.block_views(blocks, writable=writable)

    def _check_keys(self, keys: Sequence[bytes]) -> None:
        if isinstance(keys, (bytes, str)):
            raise InvalidArgumentError("keys must be a sequence of bytes, not a single key")
        check_keys(keys)

    def _check_pairs(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> None:
        """One block per key, and a tier still open (its primary memory still held)."""
        check_lengths(keys, blocks)
        self._check_not_closed()

    async def _run_batches(
        self,
        lane: Lane,
        priority: Priority,
        hook: Callable[[Sequence[bytes], Sequence[memoryview]], Awaitable[list[bool]]],
        keys: list[bytes],
        views: list[memoryview],
        results: list[bool],
        *,
        pending: bool = False,
    ) -> None:
        """The call as batches (`batches.run_in_batches`), each one guarded hook call."""

        def call(part_keys: list[bytes], part_views: list[memoryview]) -> Awaitable[list[bool]]:
            return self._guard.call(hook.__name__, hook(part_keys, part_views), len(part_keys), priority)

        batch, nbytes = self._batch_blocks, self.block_nbytes
        await run_in_batches(
            self.scheduler,
            lane,
            priority,
            call,
            keys,
            views,
            results,
            batch=batch,
            block_nbytes=nbytes,
            pending=pending,
        )
