"""Benchmark: the stores of a full fs tier (a cache in service) against the raw disk.

    python bench/fs_steady.py                    # 0.5 GiB (32 blocks at least), 2 and 32 MiB blocks

A cache in service is full: each new block evicts the oldest. Our fs tier then writes the new
block over the evicted one's record, in place; a cache of one file per block (LMCache's
LocalDiskBackend) deletes the evicted block's file and writes a new one. Where a disk writes
never-written extents more slowly than written ones (this project's virtual disk does, by
about half), that choice decides a full cache's store speed, and the first fill of an empty
cache (bench/fs_tier.py) does not show it. Per round, from one region of random bytes (anon:
our PrimaryTier), with the same threads and O_DIRECT throughout:
- tier: a `FileSystemTier` whose `capacity_bytes` holds exactly the blocks of one store,
  filled once (not timed), then one `store` of as many new blocks (timed): every one evicts
  the oldest block and is written over its record, its index entry logged after it;
- raw overwrite: plain threads `pwrite` the same bytes over files of one block each, written
  once before (not timed): the disk's best case;
- raw new files: what a one-file-per-block cache does when full: per block, delete one of the
  files written before (not timed) and create and write a new one.
The tier goes first in even rounds, the raw writers in odd ones. Throughputs shown are medians
of the rounds; a ratio is the median of the rounds' ratios (common.paired_ratio).
Nothing here asserts: `bench/run_all.py` saves the numbers for docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from common import GB, add_size_arguments, block_count, in_turn, median_tree, paired_ratio, run
from fs_tier import memory_spec, primary_memory

import kvtier_async as kt
from kvtier_async.tiers.fs import FileSystemTier
from kvtier_async.tiers.fs.layout import ENTRY, record_bytes_for


async def run_tier(work: Path, block_nbytes: int, count: int, threads: int, view: memoryview) -> float:
    """Seconds for one store of `count` new blocks into a full tier of `count` blocks."""
    # Room for `count` records and their log entries: no more (FileSystemTier's own sizing rule).
    capacity = count * (record_bytes_for(block_nbytes) + 4 * ENTRY)
    spec = kt.OffloadingSpec(
        block_nbytes=block_nbytes, num_cpu_blocks=2 * count, namespace="bench", io_threads=threads
    )
    old = kt.block_hashes(range(count * 16), 16, namespace=f"old-{block_nbytes}")
    new = kt.block_hashes(range(count * 16), 16, namespace=f"new-{block_nbytes}")
    async with FileSystemTier(spec, view, root=str(work), capacity_bytes=capacity) as tier:
        if not all(await tier.store(old, list(range(count)))):
            raise RuntimeError("filling the tier failed")
        started = time.perf_counter()
        stored = await tier.store(new, list(range(count, 2 * count)))
        elapsed = time.perf_counter() - started
        if not all(stored) or tier.stats()["evictions"] != count:
            raise RuntimeError(f"the store into a full tier failed: {tier.stats()}")
    return elapsed


def run_raw(work: Path, block_nbytes: int, count: int, threads: int, view: memoryview) -> dict[str, float]:
    """Seconds for the two raw writers' steady states: overwrite in place, and new files."""
    stride = memory_spec(block_nbytes, count).block_stride
    work.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_DIRECT

    def slot(i: int) -> memoryview:
        return view[i * stride : (i + 1) * stride]

    def fill(worker: int) -> None:
        for i in range(worker, count, threads):
            for name in (f"o{i}", f"n{i}"):
                fd = os.open(work / name, os.O_CREAT | flags, 0o600)
                os.pwrite(fd, slot(i), 0)
                os.close(fd)

    def overwrite(worker: int) -> None:
        for i in range(worker, count, threads):
            fd = os.open(work / f"o{i}", flags)
            os.pwrite(fd, slot(count + i), 0)
            os.close(fd)

    def replace(worker: int) -> None:
        for i in range(worker, count, threads):
            os.unlink(work / f"n{i}")
            fd = os.open(work / f"m{i}", os.O_CREAT | flags, 0o600)
            os.pwrite(fd, slot(count + i), 0)
            os.close(fd)

    out = {}
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fill, range(threads)))
        for name, writer in (("overwrite_s", overwrite), ("new_files_s", replace)):
            started = time.perf_counter()
            list(pool.map(writer, range(threads)))
            out[name] = time.perf_counter() - started
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_size_arguments(parser, 0.5, "stored per case")
    parser.add_argument("--block-kib", type=int, nargs="+", default=[2048, 32768])
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--repeat", type=int, default=6, help="interleaved rounds per case (even); medians")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="kvtier-steady-", dir=args.dir))
    rows = []
    try:
        for kib in args.block_kib:
            block = kib * 1024
            count = block_count(args.gib, block, args.min_blocks)
            nbytes = count * block
            rounds = []
            for attempt in range(args.repeat):
                case = base / f"{kib}k-{attempt}"
                with primary_memory("anon", memory_spec(block, count)) as view:
                    tier_s, raw = await in_turn(
                        attempt,
                        partial(run_tier, case / "tier", block, count, args.threads, view),
                        partial(asyncio.to_thread, run_raw, case / "raw", block, count, args.threads, view),
                    )
                await asyncio.to_thread(shutil.rmtree, case, True)
                rounds.append(
                    {
                        "tier_store_gbps": nbytes / tier_s / GB,
                        "overwrite_gbps": nbytes / raw["overwrite_s"] / GB,
                        "new_files_gbps": nbytes / raw["new_files_s"] / GB,
                    }
                )
            medians = median_tree(rounds)
            row = {"block_kib": kib, "blocks": count, "threads": args.threads, "repeats": args.repeat}
            row.update(medians)
            row["overwrite_ratio"] = paired_ratio(rounds, rounds, "tier_store_gbps", "overwrite_gbps")
            row["new_files_ratio"] = paired_ratio(rounds, rounds, "tier_store_gbps", "new_files_gbps")
            row["rounds"] = rounds
            rows.append(row)
            print(
                f"{kib:>5} KiB x {count:>5} threads {args.threads}: full tier store "
                f"{medians['tier_store_gbps']:.2f} GB/s, raw overwrite {medians['overwrite_gbps']:.2f} "
                f"({row['overwrite_ratio']:.2f}x), raw new files {medians['new_files_gbps']:.2f} "
                f"({row['new_files_ratio']:.2f}x)",
                flush=True,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    run(main)
