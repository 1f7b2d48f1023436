"""The tier contract as a reusable pytest suite (imported as `kvtier_async.testing`).

A tier proves itself by subclassing `TierContractTests` and supplying one
fixture, `tier_config`, that returns the tier's config dict (`{"type": ...}`):

    from kvtier_async.testing import TierContractTests

    class TestMyTier(TierContractTests):
        @pytest.fixture
        def tier_config(self, tmp_path):
            return {"type": "mytier", "module_path": "mypkg.tiers", "root": str(tmp_path)}

Tests run under pytest-asyncio (strict mode is fine: every test is marked).
A tier without a byte capacity sets `capacity_kwarg = None`; one whose blocks
take more room than `block_nbytes` overrides `capacity_bytes_for`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import pytest
import pytest_asyncio

from ..errors import ClosedError, InvalidArgumentError
from ..factory import SecondaryTierFactory
from ..primary import PrimaryTier
from ..spec import OffloadingSpec
from ..tier import SecondaryTierManager
from .blocks_by_view import BlocksByViewTests
from .keys import make_key
from .loop_hold import LoopHold

__all__ = ["TierContractTests", "make_key"]


class TierContractTests(BlocksByViewTests):
    """What every `SecondaryTierManager` must do. Subclass and provide a `tier_config` fixture."""

    #: Not a multiple of 4096, so slot stride and block size differ.
    block_nbytes: ClassVar[int] = 3 * 4096 + 136
    num_cpu_blocks: ClassVar[int] = 24
    #: The tier's capacity keyword, or None when it has no byte capacity.
    capacity_kwarg: ClassVar[str | None] = "capacity_bytes"
    #: Callers at once in `test_many_concurrent_callers`: what a serving frontend has in flight.
    concurrent_callers: ClassVar[int] = 256
    #: `test_one_call_never_holds_the_loop`: a store and a load of this many blocks of this size,
    #: one call each, and the most CPU time the event loop's thread may spend on them in one
    #: stretch (`LoopHold`). A turn of the loop that copies or hashes a batch of MiB blocks takes
    #: tens of milliseconds; a tier that leaves that work to threads stays under 3 ms.
    loop_hold_blocks: ClassVar[int] = 64
    loop_hold_block_nbytes: ClassVar[int] = 1 << 20
    max_loop_hold_s: ClassVar[float] = 0.010

    def capacity_bytes_for(self, blocks: int, spec: OffloadingSpec) -> int:
        """A capacity that holds exactly `blocks` blocks."""
        return blocks * spec.block_nbytes

    # -- fixtures ---------------------------------------------------------------------------
    @pytest.fixture
    def tier_config(self) -> dict[str, Any]:
        pytest.fail("a TierContractTests subclass must provide a tier_config fixture")

    @pytest.fixture
    def spec(self) -> OffloadingSpec:
        return OffloadingSpec(
            block_nbytes=self.block_nbytes, num_cpu_blocks=self.num_cpu_blocks, namespace="contract-tests"
        )

    @pytest.fixture
    def primary(self, spec: OffloadingSpec) -> PrimaryTier:
        return PrimaryTier(spec, pin_memory=False)

    @pytest_asyncio.fixture
    async def tier(
        self, tier_config: dict[str, Any], primary: PrimaryTier, spec: OffloadingSpec
    ) -> AsyncIterator[SecondaryTierManager]:
        tier = SecondaryTierFactory.create_secondary_tier(tier_config, primary.view, spec)
        try:
            yield tier
        finally:
            await tier.aclose()

    # -- helpers ----------------------------------------------------------------------------
    @staticmethod
    def fill(primary: PrimaryTier, slots: list[int]) -> list[bytes]:
        """Random bytes into `slots`; returns what each got."""
        payloads = []
        for slot in slots:
            data = os.urandom(primary.block_nbytes)
            primary.slot_view(slot)[:] = data
            payloads.append(data)
        return payloads

    @staticmethod
    def wipe(primary: PrimaryTier, slots: list[int]) -> None:
        for slot in slots:
            primary.slot_view(slot)[:] = bytes(primary.block_nbytes)

    @staticmethod
    def read(primary: PrimaryTier, slots: list[int]) -> list[bytes]:
        return [bytes(primary.slot_view(slot)) for slot in slots]

    # -- the contract -----------------------------------------------------------------------
    @pytest.mark.asyncio
    async def test_receives_the_spec_itself(self, tier: SecondaryTierManager, spec: OffloadingSpec) -> None:
        assert tier.offloading_spec is spec

    @pytest.mark.asyncio
    async def test_round_trip_is_byte_exact(self, tier: SecondaryTierManager, primary: PrimaryTier) -> None:
        keys = [make_key(i) for i in range(8)]
        payloads = self.fill(primary, list(range(8)))
        assert await tier.store(keys, list(range(8))) == [True] * 8
        self.wipe(primary, list(range(8, 16)))
        # Into other slots, in another order.
        targets = list(range(15, 7, -1))
        assert await tier.load(keys, targets) == [True] * 8
        assert self.read(primary, targets) == payloads
        stats = tier.stats()
        assert stats["stored_blocks"] == 8 and stats["load_hits"] == 8

    @pytest.mark.asyncio
    async def test_missing_keys_are_misses(self, tier: SecondaryTierManager, primary: PrimaryTier) -> None:
        self.fill(primary, [0])
        assert await tier.store([make_key(0)], [0]) == [True]
        result = await tier.load([make_key(0), make_key(99), make_key(1)], [1, 2, 3])
        assert result == [True, False, False]
        assert await tier.contains([make_key(99), make_key(0)]) == [False, True]
        assert tier.stats()["load_misses"] == 2

    @pytest.mark.asyncio
    async def test_lookup_counts_leading_keys(self, tier: SecondaryTierManager, primary: PrimaryTier) -> None:
        self.fill(primary, [0, 1, 2])
        await tier.store([make_key(0), make_key(1), make_key(3)], [0, 1, 2])
        assert await tier.lookup([make_key(i) for i in range(4)]) == 2
        assert await tier.lookup([make_key(3)]) == 1
        assert await tier.lookup([make_key(2), make_key(3)]) == 0
        assert await tier.lookup([]) == 0

    @pytest.mark.asyncio
    async def test_storing_a_held_key_again_keeps_exact_bytes(
        self, tier: SecondaryTierManager, primary: PrimaryTier
    ) -> None:
        [first] = self.fill(primary, [0])
        assert await tier.store([make_key(0)], [0]) == [True]
        [second] = self.fill(primary, [1])
        assert await tier.store([make_key(0)], [1]) == [True]
        assert await tier.load([make_key(0)], [2]) == [True]
        assert self.read(primary, [2])[0] in (first, second)  # one whole version, never a mix

    @pytest.mark.asyncio
    async def test_delete(self, tier: SecondaryTierManager, primary: PrimaryTier) -> None:
        self.fill(primary, [0, 1])
        await tier.store([make_key(0), make_key(1)], [0, 1])
        assert await tier.delete([make_key(0), make_key(7)]) == 1
        assert await tier.contains([make_key(0), make_key(1)]) == [False, True]
        assert await tier.load([make_key(0)], [2]) == [False]
        assert await tier.delete([]) == 0

    @pytest.mark.asyncio
    async def test_a_whole_primary_tier_in_one_call(
        self, tier: SecondaryTierManager, primary: PrimaryTier, spec: OffloadingSpec
    ) -> None:
        # With default limits, an idle tier accepts a store of num_cpu_blocks blocks whole.
        n = spec.num_cpu_blocks
        keys = [make_key(i, b"many") for i in range(n)]
        payloads = self.fill(primary, list(range(n)))
        assert await tier.store(keys, list(range(n))) == [True] * n
        assert tier.stats()["stores_dropped"] == 0
        self.wipe(primary, list(range(n)))
        targets = list(reversed(range(n)))
        assert await tier.load(keys, targets) == [True] * n
        assert self.read(primary, targets) == payloads

    @pytest.mark.asyncio
    async def test_concurrent_calls(self, tier: SecondaryTierManager, primary: PrimaryTier) -> None:
        payloads = self.fill(primary, list(range(12)))
        keys = [make_key(i, b"conc") for i in range(12)]
        results = await asyncio.gather(
            *(tier.store(keys[i : i + 3], list(range(i, i + 3))) for i in range(0, 12, 3))
        )
        assert all(all(r) for r in results)
        loads = await asyncio.gather(
            *(tier.load(keys[i : i + 3], list(range(12 + i, 15 + i))) for i in range(0, 12, 3))
        )
        assert all(all(r) for r in loads)
        assert self.read(primary, list(range(12, 24))) == payloads

    @pytest.mark.asyncio
    async def test_many_concurrent_callers(
        self, tier_config: dict[str, Any], caplog: pytest.LogCaptureFixture
    ) -> None:
        """A serving frontend's concurrency at default settings: each caller stores two blocks
        (one shared with other callers, one its own), looks them up and loads them back, all at
        once. No call fails for the tier's own limits (connections, requests, queues), nothing
        is logged, and every block comes back exact."""
        callers = self.concurrent_callers
        spec = OffloadingSpec(
            block_nbytes=self.block_nbytes, num_cpu_blocks=4 * callers, namespace="contract-tests"
        )
        primary = PrimaryTier(spec, pin_memory=False)
        shared = [make_key(i, b"many-shared") for i in range(8)]

        def payload(key: bytes) -> bytes:  # the same bytes for the same key, whoever stores it
            return hashlib.shake_256(key).digest(spec.block_nbytes)

        async def caller(tier: SecondaryTierManager, n: int) -> None:
            keys = [shared[n % len(shared)], make_key(n, b"many-own")]
            slots, into = [4 * n, 4 * n + 1], [4 * n + 2, 4 * n + 3]
            for key, slot in zip(keys, slots):
                primary.slot_view(slot)[:] = payload(key)
            assert await tier.store(keys, slots) == [True, True]
            assert await tier.lookup(keys) == 2
            self.wipe(primary, into)
            assert await tier.load(keys, into) == [True, True]
            assert self.read(primary, into) == [payload(key) for key in keys]

        caplog.set_level(logging.WARNING)
        tier = SecondaryTierFactory.create_secondary_tier(tier_config, primary.view, spec)
        async with tier:
            await asyncio.gather(*(caller(tier, n) for n in range(callers)))
            stats = tier.stats()
        failed = {
            name: stats[name]
            for name in ("errors", "queue_timeouts", "calls_skipped_while_down", "stores_dropped")
        }
        assert failed == dict.fromkeys(failed, 0)
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []

    @pytest.mark.asyncio
    async def test_one_call_never_holds_the_loop(self, tier_config: dict[str, Any]) -> None:
        """A store and a load of 64 blocks of 1 MiB, one call each: the event loop's thread never
        computes for longer than `max_loop_hold_s` (its own CPU time, so a busy machine does not
        move it) without coming back to the loop. The blocking-call detector sees a call that
        waits on the loop, not one that keeps it busy: a long copy, a checksum, a join, or a
        batch's blocks each copied in the same turn of the loop."""
        n = self.loop_hold_blocks
        spec = OffloadingSpec(
            block_nbytes=self.loop_hold_block_nbytes, num_cpu_blocks=2 * n, namespace="contract-tests"
        )
        primary = PrimaryTier(spec, pin_memory=False)
        keys = [make_key(i, b"loop-hold") for i in range(n)]
        payloads = self.fill(primary, list(range(n)))
        tier = SecondaryTierFactory.create_secondary_tier(tier_config, primary.view, spec)
        async with tier:
            # What a first call does once (imports, connections) is not what this measures.
            assert await tier.store(keys[:1], [0]) == [True]
            assert await tier.load(keys[:1], [n]) == [True]
            with LoopHold() as store_hold:
                stored = await tier.store(keys, list(range(n)))
            with LoopHold() as load_hold:
                loaded = await tier.load(keys, list(range(n, 2 * n)))
            await tier.delete(keys)
        assert stored == [True] * n and loaded == [True] * n
        assert self.read(primary, list(range(n, 2 * n))) == payloads
        held = {"store": store_hold, "load": load_hold}
        assert max(hold.longest_s for hold in held.values()) <= self.max_loop_hold_s, (
            "the loop's thread computed without coming back to the loop for "
            + ", ".join(f"{call}: {hold.describe()}" for call, hold in held.items())
        )

    @pytest.mark.asyncio
    async def test_capacity_is_respected(
        self, tier_config: dict[str, Any], primary: PrimaryTier, spec: OffloadingSpec
    ) -> None:
        if self.capacity_kwarg is None:
            pytest.skip("this tier has no byte capacity")
        config = {**tier_config, self.capacity_kwarg: self.capacity_bytes_for(4, spec)}
        tier = SecondaryTierFactory.create_secondary_tier(config, primary.view, spec)
        async with tier:
            keys = [make_key(i, b"cap") for i in range(10)]
            payloads = {}
            for key in keys:
                [payloads[key]] = self.fill(primary, [0])
                assert await tier.store([key], [0]) == [True]
            held = await tier.contains(keys)
            assert 1 <= sum(held) <= 4
            assert held[-1], "the most recently stored block is kept"
            for key, is_held in zip(keys, held):
                if is_held and await tier.load([key], [1]) == [True]:
                    assert self.read(primary, [1])[0] == payloads[key]

    @pytest.mark.asyncio
    @pytest.mark.parametrize(
        ("keys", "block_ids", "message"),
        [
            ([make_key(0)], [0, 1], "pair one to one"),
            ([make_key(0)], [10_000], "out of range"),
            ([make_key(0)], [-1], "out of range"),
            ([make_key(0), make_key(1)], [3, 3], "must not repeat"),
            ([make_key(0), make_key(0)], [3, 4], "must not repeat"),
            (["not-bytes"], [0], "must be bytes"),
            ([bytearray(b"mutable")], [0], "must be bytes"),
            ([b""], [0], "1..128 bytes"),
            ([b"x" * 129], [0], "1..128 bytes"),
            ([make_key(0)], [1.0], "must be an int"),
            (make_key(0), [0], "sequence"),
        ],
    )
    async def test_argument_errors_change_nothing(
        self,
        tier: SecondaryTierManager,
        primary: PrimaryTier,
        keys: Any,
        block_ids: Any,
        message: str,
    ) -> None:
        self.fill(primary, list(range(4)))
        before = self.read(primary, list(range(primary.num_slots)))
        stats = tier.stats()
        for call in (tier.store, tier.load):
            with pytest.raises(InvalidArgumentError, match=message) as info:
                await call(keys, block_ids)
            assert isinstance(info.value, ValueError)
        assert self.read(primary, list(range(primary.num_slots))) == before
        assert tier.stats() == stats
        assert await tier.contains([make_key(0)]) == [False]

    @pytest.mark.asyncio
    @pytest.mark.parametrize("yields", [0, 1, 2, 3, 5, 8, 13])
    async def test_cancelled_calls_leave_the_tier_usable(
        self,
        tier: SecondaryTierManager,
        primary: PrimaryTier,
        spec: OffloadingSpec,
        yields: int,
    ) -> None:
        n = spec.num_cpu_blocks // 2
        keys = [make_key(i, b"cancel") for i in range(n)]
        self.fill(primary, list(range(n)))
        for operation in ("store", "load"):
            task = asyncio.ensure_future(getattr(tier, operation)(keys, list(range(n))))
            for _ in range(yields):
                await asyncio.sleep(0)  # a scheduling point, not a wait for time
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            lanes = tier.stats().get("lanes", {})
            for lane in lanes.values():
                assert lane["inflight"] == 0 and lane["queued"] == 0
                assert lane.get("pending_blocks", 0) == 0
        # Still a working tier: a full round trip after the cancellations.
        payloads = self.fill(primary, list(range(n)))
        fresh = [make_key(i, b"after") for i in range(n)]
        assert await tier.store(fresh, list(range(n))) == [True] * n
        assert await tier.load(fresh, list(range(n, 2 * n))) == [True] * n
        assert self.read(primary, list(range(n, 2 * n))) == payloads

    @pytest.mark.asyncio
    async def test_usable_without_entering_and_closes_once(
        self, tier_config: dict[str, Any], primary: PrimaryTier, spec: OffloadingSpec
    ) -> None:
        tier = SecondaryTierFactory.create_secondary_tier(tier_config, primary.view, spec)
        self.fill(primary, [0])
        assert await tier.store([make_key(0)], [0]) == [True]
        await tier.aclose()
        await tier.aclose()
        assert tier.closed
        with pytest.raises(ClosedError):
            await tier.load([make_key(0)], [1])
        with pytest.raises(ClosedError):
            await tier.lookup([make_key(0)])

    @pytest.mark.asyncio
    async def test_async_context_manager(
        self, tier_config: dict[str, Any], primary: PrimaryTier, spec: OffloadingSpec
    ) -> None:
        tier = SecondaryTierFactory.create_secondary_tier(tier_config, primary.view, spec)
        async with tier as entered:
            assert entered is tier
            self.fill(primary, [0])
            assert await tier.store([make_key(0)], [0]) == [True]
        assert tier.closed
