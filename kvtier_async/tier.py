"""`SecondaryTierManager`: the contract every secondary tier implements.

The base class owns argument checks, scheduling, batching, opening, closing,
counters and cancellation. A backend writes four batched hooks (`write_blocks`,
`read_blocks`, `contains`, `delete`) and, if it needs them, `open_backend` /
`close_backend` / `backend_stats`.

Block `i` of the primary tier is `primary_kv_view[i*stride : i*stride + block_nbytes]`.
When `store` or `load` returns or raises (cancellation included), nothing in the
background touches those primary slots any more: backends finish or abandon
their use of the buffers before their hook returns, and worker-thread work is
awaited to the end (`Scheduler.run_blocking`).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from functools import partial
from typing import Any, ClassVar, TypeVar

import anyio
from anyio.abc import AsyncResource

# anyio imports its asyncio backend (a dozen modules) on the first task group; here that
# is import time, not the middle of the first store, on the event loop. Should a future
# anyio move it, we pay on first use, as before.
with suppress(ImportError):
    import anyio._backends._asyncio

from .busy_time import BusyTime
from .errors import ClosedError, InvalidArgumentError
from .fault_breaker import FaultBreaker
from .fault_guard import FaultGuard
from .fault_log import FaultLog
from .in_flight import CallsInFlight
from .keys import check_block_ids, check_keys, check_lengths
from .open_once import OpenOnce
from .scheduler import Lane, Priority, Scheduler, wait_uncancellable
from .single_flight import SingleFlight
from .spec import OffloadingSpec

__all__ = ["SecondaryTierManager"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: CPU work over at most this many bytes runs on the event loop (`run_cpu`): copying and hashing
#: 1 MiB takes ~0.1 ms, less than a worker thread takes to wake, run it and wake the loop again
#: on a busy machine (the workers run at a lower priority). The Redis tier's hooks, 64 KiB blocks
#: in batches of 8 against a local server: 40-50% more throughput inline.
INLINE_CPU_BYTES = 1 << 20


class SecondaryTierManager(AsyncResource):
    """Async store / load / lookup of primary-tier slots to and from one secondary tier.

    Usable at once after construction (`await tier.store(...)`); `async with tier:`
    closes it at the end. Opening work a backend needs runs before its first
    operation, off the event-loop thread.
    """

    #: Whether `store` asks `contains` first and writes only the keys not held. A backend whose
    #: existence check costs a request per key may turn it off: what an engine stores is mostly
    #: what its lookup has just missed, and writing a held key again is harmless.
    check_held_before_write: ClassVar[bool] = True

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str) -> None:
        if not isinstance(offloading_spec, OffloadingSpec):
            raise InvalidArgumentError(
                f"offloading_spec must be a kvtier_async.OffloadingSpec, got {type(offloading_spec).__name__}"
            )
        try:
            view = memoryview(primary_kv_view).cast("B")
        except TypeError as exc:
            raise InvalidArgumentError(
                f"primary_kv_view must be a C-contiguous writable buffer: {exc}"
            ) from exc
        if view.readonly:
            raise InvalidArgumentError("primary_kv_view must be writable")
        if view.nbytes < offloading_spec.primary_nbytes:
            raise InvalidArgumentError(
                f"primary_kv_view has {view.nbytes} bytes; the spec needs "
                f"num_cpu_blocks * block_stride = {offloading_spec.primary_nbytes}"
            )
        if not isinstance(tier_type, str) or not tier_type:
            raise InvalidArgumentError(f"tier_type must be a non-empty str, got {tier_type!r}")
        self.offloading_spec = offloading_spec
        self.primary_kv_view = view
        self.tier_type = tier_type
        self.block_nbytes = offloading_spec.block_nbytes
        self.block_stride = offloading_spec.block_stride
        self.num_blocks = offloading_spec.num_cpu_blocks
        self.counters: Counter[str] = Counter()
        #: Faults that repeat (a server down fails every call) are logged once a minute per kind.
        self.fault_log = FaultLog(log)
        # After faults in a row, calls fail at once for a while: a dead server costs no timeouts.
        self._guard = FaultGuard(tier_type, self.counters, FaultBreaker(), self.fault_log)
        self._scheduler: Scheduler | None = None
        self._owns_scheduler = False
        self._open_once = OpenOnce()
        self._closed = False
        self._calls = CallsInFlight()  # `aclose` waits for them
        self._busy = BusyTime()
        #: Seconds this tier had a store / load in flight, and each call's latency.
        self.busy_seconds, self.latency = self._busy.seconds, self._busy.latency
        self._single_flight = SingleFlight()  # keys being written by a store in flight
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

    async def open_backend(self) -> None:
        """Opening work (connections, index rebuild); runs once before the first operation."""

    async def close_backend(self) -> None:
        """Release what `open_backend` or the constructor acquired; runs once."""

    def backend_stats(self) -> dict[str, Any]:
        """Backend-specific gauges and counters merged into `stats()`."""
        return {}

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

    # -- helpers for backends ----------------------------------------------------------------
    @property
    def scheduler(self) -> Scheduler:
        if self._scheduler is None:
            self._scheduler = Scheduler.from_spec(self.offloading_spec)
            self._owns_scheduler = True
        return self._scheduler

    def use_scheduler(self, scheduler: Scheduler) -> None:
        """Share a cache's scheduler (lanes and worker threads); call before the first operation."""
        if self._scheduler is not None and self._scheduler is not scheduler:
            raise RuntimeError(f"tier {self.name!r} already has a scheduler")
        self._scheduler = scheduler

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking work on the scheduler's worker threads, awaited to its end."""
        return await self.scheduler.run_blocking(fn, *args)

    async def run_cpu(self, nbytes: int, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU work over `nbytes` bytes (copies, checksums, that release the GIL): on the
        event loop when that takes less than handing it to a thread would, else on the
        scheduler's CPU threads, awaited to its end."""
        if nbytes <= INLINE_CPU_BYTES:
            return fn(*args)
        return await self.scheduler.run_cpu(fn, *args)

    def block_view(self, block_id: int) -> memoryview:
        start = block_id * self.block_stride
        return self.primary_kv_view[start : start + self.block_nbytes]

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
        keys, ids = self._check_args(keys, block_ids)
        results = [False] * len(keys)
        if not keys:
            return results
        with self._operation("store"):
            lane = self.scheduler.lane(self.name, "store")
            accepted = lane.reserve_pending(len(keys))
            self.counters["store_calls"] += 1
            self.counters["stores_dropped"] += len(keys) - accepted
            # A key this tier is writing right now is not written again: this call shares the
            # outcome of the write in flight.
            shared = self._single_flight.shared(keys[:accepted])
            lane.release_pending(len(shared))
            own = [i for i in range(accepted) if i not in shared]
            written = [False] * len(own)
            with self._single_flight.writing([keys[i] for i in own], written):
                written[:] = await self._write_new(lane, [keys[i] for i in own], [ids[i] for i in own])
            for i, ok in zip(own, written):
                results[i] = ok
            if shared:
                for i, ok in (await SingleFlight.outcomes(shared)).items():
                    results[i] = ok
                self.counters["stores_deduplicated"] += len(shared)
        return results

    async def _write_new(self, lane: Lane, keys: list[bytes], ids: list[int]) -> list[bool]:
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
                [ids[i] for i in todo],
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
        keys, ids = self._check_args(keys, block_ids)
        results = [False] * len(keys)
        if not keys:
            return results
        with self._operation("load"):
            if not await self._ensure_open():
                self.counters["load_misses"] += len(keys)
                return results
            lane = self.scheduler.lane(self.name, "load")
            self.counters["load_calls"] += 1
            await self._run_batches(lane, priority, self.read_blocks, keys, ids, results)
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
            batch = self.offloading_spec.limits.batch_blocks
            for start in range(0, len(keys), batch):
                part = keys[start : start + batch]
                found = await self._guard.call("contains", self.contains(part), len(part), Priority.LOAD)
                present[start : start + len(part)] = found
                if stop_at_miss and not all(found):
                    break
        return present

    async def open(self) -> None:
        """Open the backend now (lock, connect, rebuild the index), raising what opening raised.

        Optional: the first operation opens a tier that was not opened, and reports a failure
        to open as misses. Call it where a tier that cannot open should stop a start-up.
        """
        with self._operation():
            await self._open_once(self._start_and_open)

    async def aclose(self) -> None:
        """Wait for operations in flight, then close the backend and let go of the primary view.

        Closing twice is harmless. Once closed, the tier holds no view of the primary
        buffer, so its owner may unmap it.
        """
        if self._closed:
            return
        self._closed = True
        await self._calls.wait_until_none()
        await wait_uncancellable(asyncio.ensure_future(self._close_backend_once()))

    async def _close_backend_once(self) -> None:
        try:
            await self._open_once.settle()  # an opening in progress settles first
            if self._open_once.opened:
                await self.close_backend()
        finally:
            if self._owns_scheduler and self._scheduler is not None:
                self._scheduler.close()
            try:
                self.primary_kv_view.release()  # so that the buffer's owner may unmap it
            except BufferError:
                log.error("tier %r: closed, but something still exports its primary view", self.name)

    @property
    def name(self) -> str:
        """Name in stats and lane names; a cache makes it unique among its tiers."""
        return self._guard.name

    @name.setter
    def name(self, value: str) -> None:
        self._guard.name = value

    @property
    def fault_breaker(self) -> FaultBreaker:
        """After faults in a row, calls fail at once for a while: a dead server costs no timeouts."""
        return self._guard.breaker

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> dict[str, Any]:
        """Counters (calls, blocks, bytes, hits, misses, drops, errors), lanes and backend gauges."""
        out: dict[str, Any] = {"type": self.tier_type}
        for name in (
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
        ):
            out[name] = self.counters[name]
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
    def _check_args(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> tuple[list[bytes], list[int]]:
        if isinstance(keys, (bytes, str)):
            raise InvalidArgumentError("keys must be a sequence of bytes, not a single key")
        check_keys(keys)
        ids = check_block_ids(block_ids, self.num_blocks)
        check_lengths(keys, ids)
        self._check_not_closed()
        return list(keys), ids

    def _check_not_closed(self) -> None:
        if self._closed:
            raise ClosedError(f"tier {self.name!r} is closed")

    async def _ensure_open(self) -> bool:
        """Open the backend once; False (counted, logged) if opening failed this time."""
        return self._open_once.opened or await self._guard.open(
            partial(self._open_once, self._start_and_open)
        )

    async def _start_and_open(self) -> None:
        # The worker threads start with the backend, not inside the first load of a restarted
        # process (starting them takes milliseconds: a noticeable part of a short load).
        await self.scheduler.start()
        await self.open_backend()

    @contextmanager
    def _operation(self, direction: str | None = None) -> Iterator[None]:
        """Counts operations in flight (so that `aclose` can wait for them), busy time and latency."""
        self._check_not_closed()
        with self._calls.track(), self._busy.call(direction) if direction else nullcontext():
            yield

    async def _run_batches(
        self,
        lane: Lane,
        priority: Priority,
        hook: Callable[[Sequence[bytes], Sequence[memoryview]], Awaitable[list[bool]]],
        keys: list[bytes],
        ids: list[int],
        results: list[bool],
        *,
        pending: bool = False,
    ) -> None:
        """Split into batches, each one hook call under a lane place, run concurrently."""
        batch = self.offloading_spec.limits.batch_blocks

        async def one(start: int) -> None:
            part_keys = keys[start : start + batch]
            n = len(part_keys)
            admitted = False
            try:
                async with lane.place(priority):
                    if pending:
                        lane.release_pending(n)
                        admitted = True
                    async with self.scheduler.bytes_in_flight.place(priority, n * self.block_nbytes):
                        views = [self.block_view(i) for i in ids[start : start + batch]]
                        what = hook.__name__
                        results[start : start + n] = await self._guard.call(
                            what, hook(part_keys, views), n, priority
                        )
            finally:
                if pending and not admitted:
                    lane.release_pending(n)

        if len(keys) <= batch:
            await one(0)
            return
        async with anyio.create_task_group() as group:
            for start in range(0, len(keys), batch):
                group.start_soon(one, start)
