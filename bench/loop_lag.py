"""Benchmark: how late does a 1 ms ticker wake while the cache stores and loads at full speed?

    python bench/loop_lag.py                  # 0.5 GiB of 2 MiB blocks through the fs tier
    python bench/loop_lag.py --no-gc-freeze   # leave torch's objects to the garbage collector
    python bench/loop_lag.py --io-threads 2   # fewer threads competing with the loop for the GIL
    python bench/loop_lag.py --secret         # the fs tier with a tier secret (AES-256-GCM)

A ticker coroutine sleeps 1 ms in a loop and records how late each wake-up
comes: first with the loop idle (the baseline), then while a `TieredKVCache`
stores every block to a file-system tier and loads them back cold. The targets
on this 2-core machine are p99 <= 2 ms and max <= 10 ms.

After start-up the script calls `gc.freeze()`, as a serving process should:
torch alone leaves ~166,000 objects that every full collection walks, which
takes ~150 ms here and holds the GIL, so the loop stalls that long whoever
allocated last. The full collections seen in each window are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from common import LoopLag, drop_cache, freeze_startup_heap, run

import kvtier_async as kt
from kvtier_async.secret import new_secret

SECRET_ENV = "KVTIER_LOOP_LAG_SECRET"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=0.5)
    parser.add_argument("--block-kib", type=int, default=2048)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--no-gc-freeze", action="store_true", help="undo gc.freeze() after start-up")
    parser.add_argument("--io-threads", type=int, default=None, help="OffloadingSpec.io_threads")
    parser.add_argument("--secret", action="store_true", help="give the fs tier a fresh tier secret")
    args = parser.parse_args()
    block = args.block_kib * 1024
    blocks = max(8, int(args.gib * (1 << 30)) // block)
    layers = [torch.randint(0, 256, (blocks, block // 32), dtype=torch.uint8) for _ in range(32)]
    keys = kt.block_hashes(range(blocks * 16), 16, namespace="loop-lag")
    root = Path(tempfile.mkdtemp(prefix="kvtier-lag-", dir=args.dir))
    tier: dict[str, object] = {"type": "fs", "root": str(root), "capacity_bytes": 4 * blocks * block}
    if args.secret:
        os.environ[SECRET_ENV] = new_secret()  # this process's own, never shown
        tier["secret_env"] = SECRET_ENV
    spec = kt.OffloadingSpec(
        block_nbytes=block,
        num_cpu_blocks=max(8, blocks // 2),
        namespace="loop-lag",
        io_threads=args.io_threads,
        secondary_tiers=[tier],
    )
    if args.no_gc_freeze:
        gc.unfreeze()  # run() froze the start-up heap
    else:
        freeze_startup_heap()  # what was built since start-up too
    try:
        with LoopLag() as idle:
            await asyncio.sleep(1.0)
        async with kt.TieredKVCache(spec, layers) as cache:
            await cache.lookup(keys[:1])  # opened before the measurement
            with LoopLag() as busy:
                assert await cache.store(keys, list(range(blocks))) == blocks
                await cache.flush()
        await asyncio.to_thread(drop_cache, root)
        async with kt.TieredKVCache(spec, layers) as cache:
            await cache.lookup(keys[:1])
            with LoopLag() as busy_load:
                assert await cache.load(keys, list(range(blocks))) == blocks
    finally:
        await asyncio.to_thread(shutil.rmtree, root, True)
    results = {"idle": idle.summary(), "store": busy.summary(), "load": busy_load.summary()}
    for name, lag in results.items():
        print(
            f"{name:<6} lag p50 {lag['p50_ms']:.3f} ms, p99 {lag['p99_ms']:.3f} ms, "
            f"max {lag['max_ms']:.3f} ms over {int(lag['ticks'])} ticks; "
            f"{int(lag['full_gcs'])} full gc, longest {lag['full_gc_max_ms']:.1f} ms; "
            f"{lag['stolen_ms']:.0f} ms stolen by the hypervisor in {lag['seconds']:.2f} s"
        )
    if args.json:
        timelines = {"store": busy.timeline(), "load": busy_load.timeline()}
        args.json.write_text(json.dumps({**results, "timeline": timelines}))


if __name__ == "__main__":
    run(main)
