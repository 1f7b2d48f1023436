"""Benchmark: load latency under store traffic, with the scheduler and with plain asyncio.gather.

    python bench/contention.py                 # 256 KiB blocks, 24 store batches of 64, 64 loads
    python bench/contention.py --repeat 3      # medians of interleaved rounds
    python bench/contention.py --pending-batches 24   # queue every store: priority alone

One file-system tier, one run, the same traffic twice per round:
- a burst of store batches (new keys each round: nothing is deduplicated) and,
  while they are in flight, demand loads of 4 blocks each, one every 2 ms, of
  blocks stored earlier (page cache dropped first, so the reads hit the disk);
- "scheduler": through `tier.store` / `tier.load` (lanes per direction, loads
  first, the pending-store budget drops the excess);
- "gather": the same hook calls (`write_blocks` / `read_blocks`) awaited with
  a plain, unbounded `asyncio.gather`, the way code without a scheduler does it.
Reported: each load's latency from its start to its end, p50 and p99, and how
many store blocks were written or dropped. Nothing asserts: the numbers are for notes and docs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from common import drop_cache, median_tree, percentile, run

import kvtier_async as kt
from kvtier_async.tiers.fs import FileSystemTier

LOAD_BLOCKS = 4


async def one_round(
    tier: FileSystemTier, hot: list[bytes], round_no: int, mode: str, args: argparse.Namespace
) -> dict[str, float]:
    batch = tier.offloading_spec.limits.batch_blocks
    sources = list(range(batch))  # store payloads come from the first slots
    store_keys = [
        [f"r{round_no}-{mode}-b{b}-{i}".encode() for i in range(batch)] for b in range(args.store_batches)
    ]
    latencies: list[float] = []

    async def store(keys: list[bytes]) -> int:
        if mode == "scheduler":
            return sum(await tier.store(keys, sources))
        return sum(await tier.write_blocks(keys, [tier.block_view(s) for s in sources]))

    async def load(n: int) -> None:
        keys = hot[(n * LOAD_BLOCKS) % len(hot) :][:LOAD_BLOCKS]
        slots = list(range(batch + n * LOAD_BLOCKS, batch + n * LOAD_BLOCKS + len(keys)))
        started = time.perf_counter()
        if mode == "scheduler":
            ok = await tier.load(keys, slots)
        else:
            ok = await tier.read_blocks(keys, [tier.block_view(s) for s in slots])
        latencies.append(time.perf_counter() - started)
        assert all(ok), "a load missed"

    async def arrivals() -> None:
        loads = []
        for n in range(args.loads):
            loads.append(asyncio.ensure_future(load(n)))
            await asyncio.sleep(0.002)
        await asyncio.gather(*loads)

    await asyncio.to_thread(drop_cache, Path(tier.root))
    started = time.perf_counter()
    stores = asyncio.gather(*(store(keys) for keys in store_keys))
    await arrivals()
    written = sum(await stores)
    return {
        "load_p50_ms": percentile(latencies, 0.50) * 1e3,
        "load_p99_ms": percentile(latencies, 0.99) * 1e3,
        "stored_blocks": float(written),
        "dropped_blocks": float(args.store_batches * batch - written),
        "wall_s": time.perf_counter() - started,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-kib", type=int, default=256)
    parser.add_argument("--store-batches", type=int, default=24)
    parser.add_argument("--loads", type=int, default=64)
    parser.add_argument(
        "--pending-batches",
        type=int,
        default=4,
        help="store batches that may wait for a write (max_pending_stores); beyond: dropped",
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    block = args.block_kib * 1024
    root = Path(tempfile.mkdtemp(prefix="kvtier-contention-", dir=args.dir))
    probe = kt.OffloadingSpec(block_nbytes=block, num_cpu_blocks=1)
    batch = probe.limits.batch_blocks
    spec = kt.OffloadingSpec(
        block_nbytes=block,
        num_cpu_blocks=batch + args.loads * LOAD_BLOCKS,
        namespace="contention",
        max_pending_stores=args.pending_batches * batch,
    )
    primary = kt.PrimaryTier(spec)
    capacity = (args.repeat * 2 * args.store_batches * batch + 2 * args.loads * LOAD_BLOCKS) * (
        spec.block_stride + 4096
    )
    results: dict[str, list[dict[str, float]]] = {"scheduler": [], "gather": []}
    try:
        async with FileSystemTier(spec, primary.view, root=str(root), capacity_bytes=capacity) as tier:
            hot = [f"hot-{i}".encode() for i in range(args.loads * LOAD_BLOCKS)]
            for start in range(0, len(hot), batch):
                part = hot[start : start + batch]
                assert all(await tier.store(part, list(range(len(part)))))
            for r in range(args.repeat):
                order = ["scheduler", "gather"] if r % 2 == 0 else ["gather", "scheduler"]
                for mode in order:
                    result = await one_round(tier, hot, r, mode, args)
                    results[mode].append(result)
                    print(f"round {r + 1} {mode:<9}: " + ", ".join(f"{k} {v:.1f}" for k, v in result.items()))
    finally:
        await asyncio.to_thread(shutil.rmtree, root, True)
    summary: dict[str, Any] = {mode: median_tree(runs) for mode, runs in results.items()}
    for mode, numbers in summary.items():
        print(
            f"{mode:<9}: load p50 {numbers['load_p50_ms']:.1f} ms, p99 {numbers['load_p99_ms']:.1f} ms; "
            f"stores written {numbers['stored_blocks']:.0f}, dropped {numbers['dropped_blocks']:.0f}"
        )
    if args.json:
        args.json.write_text(json.dumps(summary))


if __name__ == "__main__":
    run(main)
