"""`MemoryTier`: the reference backend, blocks in process memory with LRU eviction."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ConfigError
from ..keys import check_keys
from ..spec import OffloadingSpec
from ..tier import SecondaryTierManager

__all__ = ["MemoryTier"]


def _as_tensor(view: memoryview) -> torch.Tensor:
    return torch.frombuffer(view, dtype=torch.uint8)


class MemoryTier(SecondaryTierManager):
    """Blocks in host memory, at most `capacity_bytes` of them; least recently used go first.

    `capacity_bytes` defaults to four times the primary tier. Copies run on
    worker threads (torch copies release the GIL), so the event loop never
    spends time on block bytes.
    """

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str = "memory",
        *,
        capacity_bytes: int | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        if capacity_bytes is None:
            capacity_bytes = 4 * offloading_spec.num_cpu_blocks * offloading_spec.block_nbytes
        if (
            isinstance(capacity_bytes, bool)
            or not isinstance(capacity_bytes, int)
            or (capacity_bytes < offloading_spec.block_nbytes)
        ):
            raise ConfigError(
                "memory tier: capacity_bytes must be an int of at least one block "
                f"({offloading_spec.block_nbytes} bytes), got {capacity_bytes!r}"
            )
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # oldest first
        self._held: Counter[bytes] = Counter()  # `hold`s not yet released: never evicted

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_bytes // self.block_nbytes

    async def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        # docstring inherited
        todo = [i for i, key in enumerate(keys) if key not in self._blocks]
        for key in keys:
            if key in self._blocks:
                self._blocks.move_to_end(key)
        # Keep what fits: the tail of a batch larger than the whole tier is not written.
        todo = todo[: self.capacity_blocks]
        copies = await self.run_blocking(lambda: [_as_tensor(blocks[i]).clone() for i in todo])
        for i, copy in zip(todo, copies):
            if keys[i] in self._blocks:  # stored meanwhile by a concurrent call
                continue
            while len(self._blocks) >= self.capacity_blocks:
                evicted = next((key for key in self._blocks if not self._held[key]), None)
                if evicted is None:
                    break  # every block held: no room for this one
                del self._blocks[evicted]
                self.counters["evictions"] += 1
                self.notify_removed([evicted])
            if len(self._blocks) < self.capacity_blocks:
                self._blocks[keys[i]] = copy
        return [key in self._blocks for key in keys]

    async def read_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        # docstring inherited
        # Taking references now makes the read immune to evictions meanwhile.
        sources = [self._blocks.get(key) for key in keys]
        for key, source in zip(keys, sources):
            if source is not None:
                self._blocks.move_to_end(key)

        def copy() -> None:
            for source, block in zip(sources, blocks):
                if source is not None:
                    _as_tensor(block).copy_(source)

        await self.run_blocking(copy)
        return [source is not None for source in sources]

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        # docstring inherited
        return [key in self._blocks for key in keys]

    def hold(self, keys: Sequence[bytes]) -> list[bool]:
        # docstring inherited
        check_keys(keys)
        held = [key in self._blocks for key in keys]
        self._held.update(key for key, ok in zip(keys, held) if ok)
        return held

    def release(self, keys: Sequence[bytes]) -> None:
        # docstring inherited
        for key in keys:
            if self._held[key] > 1:
                self._held[key] -= 1
            else:
                self._held.pop(key, None)

    async def delete(self, keys: Sequence[bytes]) -> int:
        # docstring inherited
        removed = [key for key in keys if self._blocks.pop(key, None) is not None]
        self.notify_removed(removed)
        return len(removed)

    def backend_stats(self) -> dict[str, Any]:
        return {
            "blocks": len(self._blocks),
            "used_bytes": len(self._blocks) * self.block_nbytes,
            "capacity_bytes": self.capacity_bytes,
            "evictions": self.counters["evictions"],
        }
