"""A memory tier whose reads of chosen keys wait until the test opens a gate."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvtier_async.tiers.memory import MemoryTier


class GatedTier(MemoryTier):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.gated: set[bytes] = set()
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()  # set once a read is held at the gate
        self.reads: list[bytes] = []

    async def read_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        self.reads.extend(keys)
        if self.gated.intersection(keys):
            self.waiting.set()
            await self.gate.wait()
        return await super().read_blocks(keys, blocks)


class LyingTier(MemoryTier):
    """Claims every read succeeded but flips a byte: the demo must notice."""

    async def read_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        results = await super().read_blocks(keys, blocks)
        for block, ok in zip(blocks, results):
            if ok:
                block[0] ^= 0xFF
        return results


class FlakyOpenTier(MemoryTier):
    """Its first open fails, as a server that is not up yet would."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.open_attempts = 0

    async def open_backend(self) -> None:
        self.open_attempts += 1
        if self.open_attempts == 1:
            raise OSError("connection refused")
