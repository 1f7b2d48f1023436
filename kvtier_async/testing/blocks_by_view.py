"""The part of the tier contract about blocks given by view (`store_views` / `load_views`).

`TierContractTests` includes it: every tier that passes the contract moves blocks placed
anywhere on the primary memory's 4096-byte grid, not only slots, and refuses views it could
not use before changing anything. It uses the contract's `tier_config` and `tier` fixtures.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from ..errors import InvalidArgumentError
from ..factory import SecondaryTierFactory
from ..primary import PrimaryTier
from ..spec import OffloadingSpec
from ..tier import SecondaryTierManager
from .keys import make_key

__all__ = ["BlocksByViewTests"]


class BlocksByViewTests:
    """Blocks by view, against the subclass's `tier_config` (see the module docstring)."""

    @pytest_asyncio.fixture
    async def views_tier(
        self, tier_config: dict[str, Any]
    ) -> AsyncIterator[tuple[SecondaryTierManager, memoryview]]:
        """A tier of 8 KiB blocks over 64 KiB of primary memory, for blocks given by view."""
        spec = OffloadingSpec(block_nbytes=2 * 4096, num_cpu_blocks=8, namespace="contract-views")
        memory = PrimaryTier(spec, pin_memory=False).view
        tier = SecondaryTierFactory.create_secondary_tier(tier_config, memory, spec)
        try:
            yield tier, memory
        finally:
            await tier.aclose()

    @pytest.mark.asyncio
    async def test_blocks_by_view_anywhere_in_the_primary_memory(
        self, views_tier: tuple[SecondaryTierManager, memoryview]
    ) -> None:
        tier, memory = views_tier
        memory[:] = os.urandom(memory.nbytes)
        # Blocks between slots (4096 bytes off the slot grid), stored and loaded elsewhere.
        sources = [4096, 20480, 36864]
        payloads = [bytes(memory[o : o + 8192]) for o in sources]
        keys = [make_key(i, b"view") for i in range(3)]
        assert await tier.store_views(keys, [memory[o : o + 8192] for o in sources]) == [True] * 3
        memory[:] = bytes(memory.nbytes)
        before = bytes(memory)
        targets = [53248, 12288, 28672]
        assert await tier.load_views(keys, [memory[o : o + 8192] for o in targets]) == [True] * 3
        assert [bytes(memory[o : o + 8192]) for o in targets] == payloads
        # Nothing outside the targets was written.
        after = bytearray(memory)
        for o in targets:
            after[o : o + 8192] = before[o : o + 8192]
        assert bytes(after) == before
        # The same blocks by slot number.
        assert await tier.load(keys, [0, 1, 2]) == [True] * 3
        assert [bytes(memory[i * 8192 : (i + 1) * 8192]) for i in range(3)] == payloads

    @pytest.mark.asyncio
    async def test_blocks_by_view_argument_errors_change_nothing(
        self, views_tier: tuple[SecondaryTierManager, memoryview], tier: SecondaryTierManager
    ) -> None:
        views, memory = views_tier
        memory[:] = os.urandom(memory.nbytes)
        before = bytes(memory)
        key = [make_key(0, b"bad-view")]
        elsewhere = PrimaryTier(views.offloading_spec, pin_memory=False).view
        cases: list[tuple[Any, Any, str]] = [
            (key, [elsewhere[:8192]], "inside the primary memory"),
            (key, [memory[2048 : 2048 + 8192]], "multiple of 4096"),
            (key, [memory[memory.nbytes - 4096 :]], "4096 bytes, not 8192"),
            (key, [memory[:4096]], "4096 bytes, not 8192"),
            (key, [memory[:8192], memory[8192:16384]], "pair one to one"),
            (key, memory[:8192], "sequence of buffers"),
            (key, [object()], "C-contiguous buffer"),
        ]
        stats = views.stats()
        for keys, blocks, message in cases:
            for call in (views.store_views, views.load_views):
                with pytest.raises(InvalidArgumentError, match=message):
                    await call(keys, blocks)
        with pytest.raises(InvalidArgumentError, match="read-only"):
            await views.load_views(key, [memory[:8192].toreadonly()])
        two = [make_key(1, b"bad-view"), make_key(2, b"bad-view")]
        with pytest.raises(InvalidArgumentError, match="must not repeat"):
            await views.load_views(two, [memory[:8192], memory[:8192]])
        # A block size off the 4096-byte grid has no views (its records would overrun them).
        size = tier.block_nbytes
        with pytest.raises(InvalidArgumentError, match="multiple of 4096"):
            await tier.store_views(key, [tier.primary_kv_view[:size]])
        assert bytes(memory) == before
        assert views.stats() == stats
        assert await views.contains(key) == [False]
