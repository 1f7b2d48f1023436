"""Shared by the file-system tier tests and the processes they start."""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import kvtier_async as kt
from kvtier_async.tiers.fs import FileSystemTier

BLOCK_NBYTES = 3 * 4096 + 500


def payload_for(key: bytes, nbytes: int = BLOCK_NBYTES) -> bytes:
    seed = hashlib.blake2b(key, digest_size=64).digest()
    return (seed * (nbytes // 64 + 1))[:nbytes]


def key_for(i: int, tag: bytes = b"k") -> bytes:
    return hashlib.blake2b(tag + i.to_bytes(8, "little"), digest_size=32).digest()


def make_tier(
    root: str, namespace: str = "fs-tests", num_cpu_blocks: int = 32, **kwargs: Any
) -> tuple[FileSystemTier, kt.PrimaryTier]:
    spec = kt.OffloadingSpec(block_nbytes=BLOCK_NBYTES, num_cpu_blocks=num_cpu_blocks, namespace=namespace)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    tier = kt.SecondaryTierFactory.create_secondary_tier(
        {"type": "fs", "root": root, **kwargs}, primary.view, spec
    )
    assert isinstance(tier, FileSystemTier)
    return tier, primary


async def store_keys(tier: FileSystemTier, primary: kt.PrimaryTier, keys: list[bytes]) -> list[bool]:
    for slot, key in enumerate(keys):
        primary.slot_view(slot)[:] = payload_for(key)
    return await tier.store(keys, list(range(len(keys))))


async def store_in_fours(tier: FileSystemTier, primary: kt.PrimaryTier, first: int, end: int) -> list[bool]:
    """Store the keys of `first` .. `end - 1` four at a time: a small tier evicts as it goes."""
    results: list[bool] = []
    for start in range(first, end, 4):
        results += await store_keys(tier, primary, [key_for(i) for i in range(start, min(start + 4, end))])
    return results


async def load_and_check(
    tier: FileSystemTier, primary: kt.PrimaryTier, keys: list[bytes]
) -> list[bool | None]:
    """Per key: True loaded byte-exact, False a miss, None WRONG BYTES (must never happen)."""
    for slot in range(len(keys)):
        primary.slot_view(slot)[:] = bytes(BLOCK_NBYTES)
    got = await tier.load(keys, list(range(len(keys))))
    out: list[bool | None] = []
    for slot, (key, ok) in enumerate(zip(keys, got)):
        if ok and bytes(primary.slot_view(slot)) != payload_for(key):
            out.append(None)
        else:
            out.append(ok)
    return out


async def _writer(root: str, start: int, count: int) -> None:
    """Store keys start.. in batches of 4, printing each acknowledged batch."""
    tier, primary = make_tier(root)
    async with tier:
        for first in range(start, start + count, 4):
            keys = [key_for(i) for i in range(first, first + 4)]
            results = await store_keys(tier, primary, keys)
            print(" ".join(str(i) for i, ok in zip(range(first, first + 4), results) if ok), flush=True)


if __name__ == "__main__":
    import asyncio

    asyncio.run(_writer(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
