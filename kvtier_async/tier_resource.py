"""`TierResource`: what every secondary tier is as a resource, apart from what it stores.

Its spec and the primary memory it moves blocks to and from (slots by number, or blocks
anywhere on its 4096-byte grid by view); the scheduler whose worker threads run its blocking
work; opening once, at a start-up (`start`: `async with tier:`, a cache's `async with`) or
before its first operation (a failed opening retried by the next, counted as a fault; at
start-up, a `ConfigError` raised); closing once, after the operations in flight, letting go
of the primary view; its name, counters and fault guard. `SecondaryTierManager` (in `tier`)
builds the store / load / lookup contract on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any, TypeVar

from anyio.abc import AsyncResource

from .buffers import address_of
from .busy_time import BusyTime
from .errors import ClosedError, InvalidArgumentError
from .fault_breaker import FaultBreaker
from .fault_guard import FaultGuard
from .fault_log import FaultLog
from .in_flight import CallsInFlight
from .open_once import OpenOnce
from .scheduler import Scheduler, wait_uncancellable
from .spec import ALIGNMENT, OffloadingSpec

__all__ = ["INLINE_CPU_BYTES", "TierResource"]

# The name a tier's faults have always been logged under.
log = logging.getLogger("kvtier_async.tier")
T = TypeVar("T")
R = TypeVar("R", bound="TierResource")

#: CPU work over at most this many bytes runs on the event loop (`run_cpu`): copying and hashing
#: 1 MiB takes ~0.1 ms, less than a worker thread takes to wake, run it and wake the loop again
#: on a busy machine (the workers run at a lower priority). The Redis tier's hooks, 64 KiB blocks
#: in batches of 8 against a local server: 40-50% more throughput inline.
INLINE_CPU_BYTES = 1 << 20


class TierResource(AsyncResource):
    """A tier's spec, primary memory, scheduler, opening and closing (see the module docstring)."""

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str) -> None:
        if not isinstance(offloading_spec, OffloadingSpec):
            raise InvalidArgumentError(
                f"offloading_spec must be a kvtier_async.OffloadingSpec, got {type(offloading_spec).__name__}"
            )
        view = offloading_spec.primary_view(primary_kv_view)
        if not isinstance(tier_type, str) or not tier_type:
            raise InvalidArgumentError(f"tier_type must be a non-empty str, got {tier_type!r}")
        self.offloading_spec = offloading_spec
        self.primary_kv_view = view
        #: Where the primary memory starts in this process: blocks by view are placed from it.
        self.primary_base = address_of(view)
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

    # -- the backend's part ----------------------------------------------------------------
    async def open_backend(self) -> None:
        """Opening work (connections, index rebuild); runs once before the first operation."""

    async def check_config(self) -> None:
        """At a start-up, after `open_backend`: raise `ConfigError` for a configuration that
        can never work but that only the server can tell (a bucket that does not exist). Any
        other error fails the opening as a fault that may pass. Not run by a lazy opening: a
        call's deadline has no room for it."""

    async def close_backend(self) -> None:
        """Release what `open_backend` or the constructor acquired; runs once."""

    def backend_stats(self) -> dict[str, Any]:
        """Backend-specific gauges and counters merged into `stats()`."""
        return {}

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

    def primary_offset(self, block: Any) -> int | None:
        """Where `store_views` / `load_views` find `block` (a C-contiguous buffer): its offset in
        the primary memory, a multiple of 4096 with `block_nbytes` bytes to the memory's end;
        None if it is not so placed."""
        offset = address_of(block) - self.primary_base
        if 0 <= offset <= self.primary_kv_view.nbytes - self.block_nbytes and offset % ALIGNMENT == 0:
            return offset
        return None

    def block_views(self, blocks: Sequence[Any], *, writable: bool) -> list[memoryview]:
        """The primary memory's own views of `blocks`, each a buffer of `block_nbytes` bytes that
        `primary_offset` places (writable and distinct, if `writable`); raises
        `InvalidArgumentError`. The block size must be a multiple of 4096: a backend may read a
        whole record into a block, and on the 4096 grid the record is the block."""
        if blocks and self.block_nbytes % ALIGNMENT:
            raise InvalidArgumentError(
                f"blocks by view need block_nbytes a multiple of {ALIGNMENT}, got {self.block_nbytes}"
            )
        offsets = []
        for i, block in enumerate(blocks):
            try:
                view = memoryview(block).cast("B")
            except TypeError as exc:
                raise InvalidArgumentError(f"blocks[{i}] must be a C-contiguous buffer: {exc}") from exc
            if view.nbytes != self.block_nbytes:
                raise InvalidArgumentError(f"blocks[{i}] has {view.nbytes} bytes, not {self.block_nbytes}")
            if writable and view.readonly:
                raise InvalidArgumentError(f"blocks[{i}] is read-only")
            offset = self.primary_offset(view)
            if offset is None:
                raise InvalidArgumentError(
                    f"blocks[{i}] is not at a multiple of {ALIGNMENT} bytes inside the primary memory"
                )
            offsets.append(offset)
        if writable and len(set(offsets)) != len(offsets):
            raise InvalidArgumentError("blocks must not repeat within one load")
        return [self.primary_kv_view[o : o + self.block_nbytes] for o in offsets]

    # -- opening and closing ----------------------------------------------------------------
    async def open(self) -> None:
        """Open the backend now (lock, connect, rebuild the index), raising what opening raised.

        Optional: the first operation opens a tier that was not opened, and reports a failure
        to open as misses. Call it where a tier that cannot open should stop a start-up.
        """
        with self._operation():
            await self._open_once(partial(self._start_and_open, True))

    async def start(self) -> None:
        """Open the backend as a start-up does (`async with tier:`, a cache's `async with`): a
        configuration that can never work raises its `ConfigError`; a fault that may pass (a
        server down, a full disk) is counted and logged, and the next operation tries again.
        """
        with self._operation():
            await self._ensure_open(starting=True)

    async def __aenter__(self: R) -> R:
        """Start the tier (`start`); if that raises, close it before raising."""
        try:
            await self.start()
        except BaseException:
            await self.aclose()  # `async with` will not: its body never started
            raise
        return self

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

    # -- internals ---------------------------------------------------------------------------
    def _check_not_closed(self) -> None:
        if self._closed:
            raise ClosedError(f"tier {self.name!r} is closed")

    async def _ensure_open(self, *, starting: bool = False) -> bool:
        """Open the backend once; False (counted, logged) if opening failed this time, but a
        `ConfigError` raised when `starting` (`FaultGuard.open`)."""
        return self._open_once.opened or await self._guard.open(
            partial(self._open_once, partial(self._start_and_open, starting)), starting=starting
        )

    async def _start_and_open(self, starting: bool = False) -> None:
        # The worker threads start with the backend, not inside the first load of a restarted
        # process (starting them takes milliseconds: a noticeable part of a short load).
        await self.scheduler.start()
        await self.open_backend()
        if starting:
            await self.check_config()

    @contextmanager
    def _operation(self, direction: str | None = None) -> Iterator[None]:
        """Counts operations in flight (so that `aclose` can wait for them), busy time and latency."""
        self._check_not_closed()
        with self._calls.track(), self._busy.call(direction) if direction else nullcontext():
            yield
