"""`TieredKVCache`: the front door. Device blocks <-> primary tier <-> secondary tiers.

    store:  device --copy--> primary slots --(background, per tier)--> secondary tiers
    load:   secondary tiers --promote--> primary slots --copy--> device

The cache checks each call's arguments, owns the lifecycle (open, close, stats) and hands
the work to its two pipelines: `store_pipeline.StorePipeline` and
`load_pipeline.LoadPipeline`.

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
import logging
from collections import Counter
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import asdict
from typing import Any

from anyio.abc import AsyncResource

from .copy_engine import CopyEngine, as_layer_list, block_widths
from .errors import ClosedError, InvalidArgumentError
from .factory import SecondaryTierFactory
from .in_flight import CallsInFlight
from .keys import check_block_ids, check_keys, check_lengths
from .load_pipeline import LoadPipeline
from .open_once import OpenOnce
from .primary import PrimaryTier
from .releases import Releases
from .scheduler import Priority, Scheduler, wait_uncancellable
from .spec import OffloadingSpec
from .store_pipeline import StorePipeline
from .tier import SecondaryTierManager

__all__ = ["TieredKVCache"]

log = logging.getLogger(__name__)


def _check_timeout(timeout: float | None) -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise InvalidArgumentError(f"timeout must be None or a number >= 0, got {timeout!r}")


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
        if layers[0].device.type == "cuda":
            self.primary.cuda_device = layers[0].device  # registered under it, not device 0
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
        #: Per tier ("primary", then each secondary tier's name): leading blocks a `lookup` found
        #: there, and blocks a load or prefetch took from there. A deployment's hit rate per tier.
        self.found_blocks: Counter[str] = Counter()
        self.loaded_from: Counter[str] = Counter()
        # The primary tier calls into the pipelines' `Releases`, not into the cache: a callback
        # into the cache would be a reference cycle, freed by the cycle collector (on whatever
        # thread, often the event loop's) instead of when its owner drops it.
        releases = Releases()
        self.primary.on_release = releases.note
        self._stores = StorePipeline(
            spec, self.primary, self.copy_engine, self.tiers, releases, self.counters
        )
        self._loads = LoadPipeline(
            spec, self.primary, self.copy_engine, self.tiers, releases, self.counters, self.loaded_from
        )
        self._opening = OpenOnce()
        self._calls = CallsInFlight()  # store, load and prefetch; `aclose` waits for them
        self._closed = False

    async def __aenter__(self) -> TieredKVCache:
        try:
            await self._open()
            await self._start_tiers()
        except BaseException:
            await self.aclose()  # `async with` will not: its body never started
            raise
        return self

    async def _open(self) -> None:
        """Make the primary tier resident (and pinned) on a worker thread, once; the first
        store or load does this too. A failure is raised to every waiter and tried again."""
        await self._opening(self._make_resident)

    async def _start_tiers(self) -> None:
        """Open every secondary tier, all at once: a tier configured so that it can never work
        raises its `ConfigError` here; one whose server is down, or disk full, runs degraded
        and tries again on later calls (`TierResource.start`)."""
        outcomes = await asyncio.gather(*(tier.start() for tier in self.tiers), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _make_resident(self) -> None:
        await self.scheduler.run_blocking(self.primary.make_resident)
        await self.copy_engine.open()  # its streams and staging, once the buffer is pinned

    @contextlib.contextmanager
    def _operation(self) -> Iterator[None]:
        """A store, load or prefetch call: refused once closed, counted until it returns."""
        self._check_open()
        with self._calls.track():
            yield

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
    def store(
        self, keys: Sequence[bytes], device_block_ids: Sequence[int], after: Any = None
    ) -> Coroutine[Any, Any, int]:
        """Offload device blocks under `keys`; returns how many leading blocks were accepted.

        Keys already held count as accepted and are not copied again. Returns
        once the device blocks may be reused; the writes to the secondary tiers
        continue in the background (`flush()` waits for them). A block is not
        accepted when no primary slot can be had without waiting on other
        calls' work: stores are best effort.

        `after` says what produced those blocks, so that the copy reads them only once that
        is done: a `torch.cuda.Event` (recorded before the call, and not recorded again until
        it returns: the copy waits for its latest record), or a `torch.cuda.Stream` (its work
        queued so far). The
        default is the work queued so far on the calling thread's current stream of the
        cache's device, at the moment of the call: pass the stream explicitly when the model
        writes its KV from another thread or on a side stream. On a machine without CUDA,
        leave it None.

        Not a coroutine function, so that "the calling thread" is the thread that calls it:
        the arguments are checked and the mark is taken here, at the call, and the returned
        coroutine does the rest. `await cache.store(...)` reads as ever; a model thread may
        hand `cache.store(...)` to `asyncio.run_coroutine_threadsafe`. Bad arguments, and a
        closed cache, raise `InvalidArgumentError` / `ClosedError` at the call, before any
        state changes and before a coroutine exists.
        """
        keys, ids = self._check_args(keys, device_block_ids)
        mark = self.copy_engine.mark(after, "after")  # now, on the calling thread
        return self._store(keys, ids, mark)

    async def _store(self, keys: list[bytes], ids: list[int], mark: Any) -> int:
        with self._operation():
            await self._open()
            return await self._stores.store(keys, ids, mark)

    async def flush(self) -> None:
        """Wait until every accepted store has reached every secondary tier (or failed there)."""
        await self._stores.flush()

    # -- lookup ------------------------------------------------------------------------------------
    async def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are available in the primary or any secondary tier."""
        return len(await self.lookup_sources(keys))

    async def lookup_sources(self, keys: Sequence[bytes]) -> list[str]:
        """`lookup`, telling where each leading available key is: "primary", or the name of the
        first secondary tier holding it (where a load would take it from, as of now)."""
        check_keys(keys)
        self._check_open()
        keys = list(keys)
        self.counters["lookup_calls"] += 1
        self.counters["lookup_blocks"] += len(keys)
        found: list[str] = []
        while len(found) < len(keys) and self.primary.lookup(keys[len(found)]) is not None:
            found.append("primary")
        if len(found) < len(keys) and self.tiers:
            sources = await self._loads.locate(keys[len(found) :])
            for key, source in zip(keys[len(found) :], sources):
                if self.primary.lookup(key) is not None:  # there already, or promoted meanwhile
                    found.append("primary")
                elif source is not None:
                    found.append(self.tiers[source].name)
                else:
                    break
        self.found_blocks.update(found)
        return found

    # -- load and prefetch --------------------------------------------------------------------------
    def load(
        self,
        keys: Sequence[bytes],
        device_block_ids: Sequence[int],
        timeout: float | None = None,
        consumer: Any = None,
    ) -> Coroutine[Any, Any, int]:
        """Copy the longest available prefix of `keys` into `device_block_ids`; returns its length.

        Blocks come from the primary tier, else from the first secondary tier
        holding them (promoted into the primary tier on the way). With a
        `timeout` (seconds), returns the prefix complete by then.

        `consumer` is the `torch.cuda.Stream` that will read the blocks (or an event, recorded
        before the call and not again until it returns, as for `store`'s `after`): the copy
        first waits for the work queued there so far (the device blocks' earlier readers);
        default: the calling thread's current stream of the cache's device, at the moment of
        the call. The blocks are complete when the call returns, for work queued afterwards
        on any stream: no stream is made to wait on the copy. On a machine without CUDA,
        leave it None.

        Like `store`, not a coroutine function: the arguments are checked and the mark is
        taken at the call, on the calling thread (bad arguments and a closed cache raise
        there), and the returned coroutine does the rest.
        """
        keys, ids = self._check_args(keys, device_block_ids)
        _check_timeout(timeout)
        mark = self.copy_engine.mark(consumer, "consumer")  # now, on the calling thread
        return self._load(keys, ids, timeout, mark)

    async def _load(self, keys: list[bytes], ids: list[int], timeout: float | None, mark: Any) -> int:
        with self._operation():
            await self._open()
            self.counters["load_calls"] += 1
            loaded = await self._loads.run(keys, ids, timeout, Priority.LOAD, mark)
            self.counters["loaded_blocks"] += loaded
            return loaded

    async def prefetch(self, keys: Sequence[bytes], timeout: float | None = None) -> int:
        """Bring the leading available keys into the primary tier; returns how many are there."""
        check_keys(keys)
        _check_timeout(timeout)
        with self._operation():
            await self._open()
            self.counters["prefetch_calls"] += 1
            return await self._loads.run(list(keys), None, timeout, Priority.PREFETCH)

    # -- the rest ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """A plain dict: primary-tier gauges, call and block counters, per tier the leading
        blocks lookups found there (`found_blocks`) and the blocks loads took from there
        (`loaded_from`, "primary" first, then each secondary tier by name), the copy engine's
        (`copies`), limits, the scheduler's lanes (`<tier>/load`, `<tier>/store`,
        `bytes_in_flight`) and per-tier stats."""
        out: dict[str, Any] = dict(self.primary.stats())
        for name in (
            "lookup_calls",
            "lookup_blocks",
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
        out["found_blocks"] = {"primary": self.found_blocks["primary"]} | {
            tier.name: self.found_blocks[tier.name] for tier in self.tiers
        }
        out["loaded_from"] = {"primary": self.loaded_from["primary"]} | {
            tier.name: self.loaded_from[tier.name] for tier in self.tiers
        }
        out["background_stores"] = len(self._stores.background)
        out["copies"] = self.copy_engine.stats()  # staging memory, chunks, memory copies
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
            for task in self._stores.background:
                task.cancel()
            await wait_uncancellable(asyncio.ensure_future(self._close_all()))

    async def _close_all(self) -> None:
        await self._calls.wait_until_none()
        await self._stores.flush()
        try:
            for tier in self.tiers:
                await tier.aclose()
        finally:
            try:
                await self._opening.settle()
                # Nothing touches the buffer any more: its pages go back on a worker thread.
                await self.scheduler.run_blocking(self.primary.release_memory)
            finally:
                try:
                    await self.copy_engine.aclose()
                finally:
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
