"""Benchmark: FileSystemTier store / cold load against raw O_DIRECT I/O of the same bytes.

    python bench/fs_tier.py                      # 1 GiB (32 blocks at least), 2 MiB / 32 MiB / 64 KiB
    python bench/fs_tier.py --gib 0.25 --threads 4 8 --memory anon scattered --aiofiles

For each block size, thread count and kind of primary memory, in one run and on one disk, in
interleaved rounds (medians shown), the tier first in even rounds and the raw baseline first
in odd ones:
- tier: `tier.store` of every block in one call at default limits (only `io_threads` set),
  then, page cache dropped, `tier.load` of every block in random order into other slots
  ("same tier"); then the tier closed, a new one opened on the same root (what a restarted
  process does), page cache dropped, the same load again ("fresh tier"). Checksums are
  always verified;
- raw: plain threads doing O_DIRECT writes and reads of the same bytes from and into the
  same memory, in the same sequence: the store, then the load twice, page cache dropped
  before each, one task per block taken by whichever thread is free (as LMCache's disk
  backend does). For large blocks it runs that sequence twice, with one file per block
  (create, one `write` of the whole block, close; open, read, close: LMCache's way) and
  with distinct offsets of one preallocated file, and each figure is the faster of the two:
  the disk's best for new data here, whichever layout it favours that minute. For small
  blocks only the preallocated file, reads in random order (the device's IOPS limit).
  Each of the tier's loads is set against the raw load at the same point of the sequence:
  this virtual disk reads a region more slowly a few seconds after writing it than at once,
  and a "fresh tier" load compared with a first raw load would measure that, not the tier;
- aiofiles (with --aiofiles): one buffered file per block through aiofiles,
  the same concurrency, fsync-free: what many asyncio users would write.
The process's start-up heap is frozen, as a serving process's is (common.freeze_startup_heap).
Primary memory is "anon" (our PrimaryTier: anonymous, huge pages, populated), "shm" (a
/dev/shm file mapping in 4 KiB pages, as vLLM hands its tiers, faulted in in order, so its
pages mostly lie in order in RAM too) or "scattered" (the same, its pages faulted in turn with
another mapping's: no two neighbours in RAM, as on a host that has been up a while). Blocks
hold random bytes.
Throughputs shown are medians of the rounds; a ratio is the median of the rounds' tier / raw
ratios (common.paired_ratio), and --json saves every round. Nothing here asserts:
`bench/run_all.py` saves the numbers for docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from common import (
    GB,
    TIER_AGAINST_BASELINE,
    add_size_arguments,
    block_count,
    drop_cache,
    in_turn,
    median_tree,
    paired_ratio,
    run,
)

import kvtier_async as kt
from kvtier_async.tiers.fs import FileSystemTier

KINDS = ["anon", "shm", "scattered"]  # of primary memory


def rates(nbytes: int, store_s: float, load_s: float) -> dict[str, float]:
    return {
        "store_gbps": nbytes / store_s / GB,
        "load_gbps": nbytes / load_s / GB,
        "store_s": store_s,
        "load_s": load_s,
    }


def memory_spec(block_nbytes: int, count: int) -> kt.OffloadingSpec:
    """The primary region's shape: `count` slots to store from, `count` to load into."""
    return kt.OffloadingSpec(block_nbytes=block_nbytes, num_cpu_blocks=2 * count)


def shm_mapping(nbytes: int) -> mmap.mmap:
    path = f"/dev/shm/kvtier-bench-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.unlink(path)
    os.ftruncate(fd, nbytes)
    mapping = mmap.mmap(fd, nbytes)
    os.close(fd)
    return mapping


def scattered_shm_mapping(nbytes: int, every: int) -> mmap.mmap:
    """A `shm_mapping` faulted in page by page with another mapping's page after every
    `every`-th of its own, as a busy host's allocator hands pages out: at least that share of
    its neighbouring pages lie apart in RAM (1: no two neighbours are neighbours)."""
    mapping, other = shm_mapping(nbytes), shm_mapping(nbytes)
    for n, offset in enumerate(range(0, nbytes, mmap.PAGESIZE)):
        mapping[offset] = 1
        if n % every == every - 1:
            other[offset] = 1
    other.close()
    return mapping


def fill_random(buffer: torch.Tensor) -> None:
    """Random bytes into `buffer`, a quarter GiB at a time."""
    flat = buffer.view(-1)
    for start in range(0, flat.numel(), 1 << 28):
        part = flat[start : start + (1 << 28)]
        part[:] = torch.randint(0, 256, (part.numel(),), dtype=torch.uint8)


@contextmanager
def primary_memory(kind: str, spec: kt.OffloadingSpec) -> Iterator[memoryview]:
    """The primary region, filled with random bytes (so its pages exist, as in a running server)."""
    if kind == "anon":
        primary = kt.PrimaryTier(spec, pin_memory=False)
        buffer, view = primary.buffer, primary.view
    else:
        nbytes = spec.primary_nbytes
        mapping = scattered_shm_mapping(nbytes, 1) if kind == "scattered" else shm_mapping(nbytes)
        buffer, view = torch.frombuffer(mapping, dtype=torch.uint8), memoryview(mapping)
    fill_random(buffer)
    yield view
    del buffer


async def run_tier(
    work: Path, block_nbytes: int, count: int, threads: int, view: memoryview
) -> dict[str, float]:
    spec = kt.OffloadingSpec(
        block_nbytes=block_nbytes, num_cpu_blocks=2 * count, namespace="bench", io_threads=threads
    )
    keys = kt.block_hashes(range(count * 16), 16, namespace=f"bench-{block_nbytes}-{threads}")
    order = list(range(count))
    random.Random(0).shuffle(order)
    tier = FileSystemTier(spec, view, root=str(work))
    await tier.open()  # outside the timed part
    started = time.perf_counter()
    stored = await tier.store(keys, list(range(count)))
    store_s = time.perf_counter() - started
    assert all(stored), "store failed"
    loads = []
    for fresh in (False, True):
        if fresh:
            await tier.aclose()
            tier = FileSystemTier(spec, view, root=str(work))
            await tier.open()
        await asyncio.to_thread(drop_cache, work)
        started = time.perf_counter()
        loaded = await tier.load([keys[i] for i in order], [count + i for i in order])
        loads.append(time.perf_counter() - started)
        assert all(loaded), "load missed"
    await tier.aclose()
    out = rates(count * block_nbytes, store_s, loads[0])
    out["fresh_load_gbps"] = count * block_nbytes / loads[1] / GB
    return out


def run_raw_best(
    work: Path, block_nbytes: int, count: int, threads: int, view: memoryview
) -> dict[str, float]:
    """The raw baseline: for large blocks each figure the faster of a file per block and one
    preallocated file (each run through the whole sequence); for small blocks the latter."""
    layouts = ["files", "slab"] if block_nbytes >= (1 << 20) else ["slab"]
    runs = [run_raw(work / layout, block_nbytes, count, threads, view, layout) for layout in layouts]
    return {k: max(run[k] for run in runs) if k.endswith("_gbps") else runs[0][k] for k in runs[0]}


def run_raw(
    work: Path, block_nbytes: int, count: int, threads: int, view: memoryview, layout: str
) -> dict[str, float]:
    """Plain O_DIRECT writes and reads: one file per block ("files") or distinct offsets of one
    preallocated file ("slab")."""
    stride = memory_spec(block_nbytes, count).block_stride
    one_file_per_block = layout == "files"
    work.mkdir(parents=True, exist_ok=True)
    big = work / "raw.bin"
    if not one_file_per_block:
        fd = os.open(big, os.O_CREAT | os.O_RDWR, 0o600)
        os.posix_fallocate(fd, 0, count * stride)
        os.close(fd)
    shared_fd = None if one_file_per_block else os.open(big, os.O_RDWR | os.O_DIRECT)
    order = list(range(count))
    random.Random(0).shuffle(order)

    def write(i: int) -> None:
        slot = view[i * stride : (i + 1) * stride]
        if one_file_per_block:
            fd = os.open(work / f"b{i}", os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
            os.write(fd, slot)
            os.close(fd)
        else:
            os.pwrite(shared_fd, slot, i * stride)

    def read(i: int) -> None:
        slot = view[(count + i) * stride : (count + i + 1) * stride]
        if one_file_per_block:
            fd = os.open(work / f"b{i}", os.O_RDONLY | os.O_DIRECT)
            os.preadv(fd, [slot], 0)
            os.close(fd)
        else:
            os.preadv(shared_fd, [slot], i * stride)

    # One task per block, taken by whichever thread is free (LMCache's disk backend does the
    # same): a slow request then holds up one block, not a thread's whole share.
    with ThreadPoolExecutor(threads) as pool:
        started = time.perf_counter()
        list(pool.map(write, range(count)))
        store_s = time.perf_counter() - started
        loads = []
        for _ in range(2):  # as the tier's: the one that stored it, then a fresh one
            drop_cache(work)
            started = time.perf_counter()
            list(pool.map(read, order))
            loads.append(time.perf_counter() - started)
    if shared_fd is not None:
        os.close(shared_fd)
    out = rates(count * block_nbytes, store_s, loads[0])
    out["again_load_gbps"] = count * block_nbytes / loads[1] / GB
    return out


async def run_aiofiles(work: Path, block_nbytes: int, count: int, threads: int) -> dict[str, float]:
    import aiofiles

    await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)
    payload = os.urandom(block_nbytes)
    limit = asyncio.Semaphore(threads)

    async def write(i: int) -> None:
        async with limit, aiofiles.open(work / f"a{i}", "wb") as f:
            await f.write(payload)

    async def read(i: int) -> None:
        async with limit, aiofiles.open(work / f"a{i}", "rb") as f:
            await f.read()

    started = time.perf_counter()
    await asyncio.gather(*(write(i) for i in range(count)))
    store_s = time.perf_counter() - started
    await asyncio.to_thread(drop_cache, work)
    started = time.perf_counter()
    await asyncio.gather(*(read(i) for i in range(count)))
    load_s = time.perf_counter() - started
    return rates(count * block_nbytes, store_s, load_s)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_size_arguments(parser, 1.0, "moved per case")
    parser.add_argument("--block-kib", type=int, nargs="+", default=[2048, 32768, 64])
    parser.add_argument("--threads", type=int, nargs="+", default=[4])
    parser.add_argument("--memory", nargs="+", default=KINDS, choices=KINDS)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--aiofiles", action="store_true", help="also measure aiofiles")
    parser.add_argument("--repeat", type=int, default=4, help="interleaved rounds per case (even); medians")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.dir))
    rows = []
    try:
        for kib in args.block_kib:
            block = kib * 1024
            count = block_count(args.gib, block, args.min_blocks)
            for threads in args.threads:
                for memory in args.memory:
                    case = base / f"{kib}k-{threads}-{memory}"
                    tiers, raws, aios = [], [], []
                    for attempt in range(args.repeat):  # interleaved, so drifts hit both alike
                        # One region for both: where its pages lie in RAM changes their speed.
                        with primary_memory(memory, memory_spec(block, count)) as view:
                            ours, baseline = await in_turn(
                                attempt,
                                partial(run_tier, case / f"tier{attempt}", block, count, threads, view),
                                partial(
                                    asyncio.to_thread,
                                    run_raw_best,
                                    case / f"raw{attempt}",
                                    block,
                                    count,
                                    threads,
                                    view,
                                ),
                            )
                            tiers.append(ours)
                            raws.append(baseline)
                        if args.aiofiles:
                            aios.append(await run_aiofiles(case / f"aio{attempt}", block, count, threads))
                        await asyncio.to_thread(shutil.rmtree, case, True)
                    tier, raw = median_tree(tiers), median_tree(raws)
                    row = {
                        "block_kib": kib,
                        "blocks": count,
                        "threads": threads,
                        "memory": memory,
                        "repeats": args.repeat,
                        "tier": tier,
                        "raw": raw,
                        **{
                            ours.replace("_gbps", "_ratio"): paired_ratio(tiers, raws, ours, theirs)
                            for ours, theirs in TIER_AGAINST_BASELINE
                        },
                        "rounds": [{"tier": t, "raw": r} for t, r in zip(tiers, raws, strict=True)],
                    }
                    if aios:
                        row["aiofiles"] = median_tree(aios)
                    rows.append(row)
                    extra = ""
                    if "aiofiles" in row:
                        extra = (
                            f" | aiofiles store {row['aiofiles']['store_gbps']:.2f} "
                            f"load {row['aiofiles']['load_gbps']:.2f}"
                        )
                    print(
                        f"{kib:>5} KiB x {count:>6} threads {threads:>2} {memory:<4} "
                        f"store tier {tier['store_gbps']:.2f} GB/s raw {raw['store_gbps']:.2f} "
                        f"({row['store_ratio']:.2f}x)  load tier {tier['load_gbps']:.2f} "
                        f"fresh tier {tier['fresh_load_gbps']:.2f} raw {raw['load_gbps']:.2f} "
                        f"({raw['again_load_gbps']:.2f}) "
                        f"({row['load_ratio']:.2f}x / {row['fresh_load_ratio']:.2f}x){extra}",
                        flush=True,
                    )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    run(main)
