"""Benchmark: how long a FileSystemTier takes to open a root holding N blocks.

    python bench/fs_open.py                 # 100,000 blocks of 4 KiB

Opening replays the slabs' index logs; it reads no payload. Measured from the
first operation's call (which opens the tier) to its return, in a fresh tier
object, after dropping the page cache of the logs (cold) and again warm.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from common import drop_cache, run

import kvtier_async as kt
from kvtier_async.tiers.fs import FileSystemTier


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--block-kib", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvtier-open-", dir=args.dir))
    batch = 4096
    spec = kt.OffloadingSpec(block_nbytes=args.block_kib * 1024, num_cpu_blocks=batch, namespace="open")
    primary = kt.PrimaryTier(spec, pin_memory=False)
    keys = kt.block_hashes(range(args.blocks * 16), 16, namespace="open")
    try:
        started = time.perf_counter()
        async with FileSystemTier(spec, primary.view, root=str(root)) as tier:
            for start in range(0, args.blocks, batch):
                part = keys[start : start + batch]
                assert all(await tier.store(part, list(range(len(part)))))
        print(f"stored {args.blocks} blocks of {args.block_kib} KiB in {time.perf_counter() - started:.1f} s")
        for label in ("cold", "warm"):
            if label == "cold":
                await asyncio.to_thread(drop_cache, root)
            tier = FileSystemTier(spec, primary.view, root=str(root))
            started = time.perf_counter()
            found = await tier.lookup(keys)
            seconds = time.perf_counter() - started
            await tier.aclose()
            assert found == args.blocks, found
            print(
                f"open ({label}): {seconds:.2f} s for {args.blocks} blocks "
                f"({args.blocks / seconds:,.0f} blocks/s), lookup of all included"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run(main)
