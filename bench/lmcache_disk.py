"""Benchmark: our fs tier against LMCache 0.5.6's LocalDiskBackend, store and cold load.

LMCache pins its own dependencies, so this runs from an environment that has both:

    python -m venv /tmp/lmvenv && /tmp/lmvenv/bin/pip install torch==2.13.0 lmcache==0.5.6 -e .
    /tmp/lmvenv/bin/python bench/lmcache_disk.py --block-mib 32 2 --gib 1 --rounds 8

`bench/run_all.py --lmcache-python /tmp/lmvenv/bin/python` runs it for its "peers" record.

Two harnesses (`--harness`), each in rounds where the two sides take turns to go first, and
every round's ratio pairs the two on the same minute of the same disk:
- "one-process": both sides in this process, each over the same memory in every round.
- "processes": as a user runs each product, every side of every round in a new process of
  its own (this script again, with `--side`), with memory it makes itself: LMCache's
  allocator over its own memory, our tier over `--memory`. Each side times only its store
  and loads, not its start-up.

- LMCache, in its best configuration here: O_DIRECT on (`use_odirect`, which needs page-aligned
  buffers, so its allocator gets page-aligned huge-page memory, every page touched first as in
  a running server), `disk_io_threads` = our `io_threads`. Each block is one file, written with
  one `os.write` and read with one `readinto`; LMCache keeps no checksum. The store is timed
  until every write has called back; the load is `batched_get_blocking` of every key in random
  order into memory LMCache allocates, twice. A new backend knows nothing of an earlier one's
  files, so it has no restart figure: our fresh load is set against its second load, made at
  the same point of the sequence (this virtual disk reads a region more slowly a few seconds
  after writing it than at once, and a fresh load set against a first one would measure that).
- Ours: `bench/fs_tier.py`'s run of the tier, at its defaults but `io_threads`, checksums on,
  from and into its "anon" memory (`PrimaryTier`: anonymous, huge pages, populated) and, in
  rounds of their own, its "shm" memory (a `/dev/shm` mapping, as vLLM hands its tiers): `store`
  of every block in one call, then `load` of every block in random order into other slots;
  then the tier closed, a new one opened on the same root (a restarted process) and the same
  load ("fresh").

Each side gets a new directory every round; the page cache is dropped before every load;
blocks hold random bytes. LMCache's loads are compared with what was stored; ours are checked
by the tier against their checksums, and the last one compared byte for byte too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import random
import shutil
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from common import GB, add_size_arguments, block_count, drop_cache, in_turn, run
from fs_tier import KINDS, memory_spec, primary_memory, run_tier
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

HARNESSES = ["one-process", "processes"]


class LMCacheSide:
    """LMCache's CPU allocator over page-aligned huge-page memory, and the blocks it stores."""

    def __init__(self, block: int, count: int, threads: int, loop: asyncio.AbstractEventLoop) -> None:
        self.block, self.count, self.threads, self.loop = block, count, threads, loop
        self.config = self._config(None)
        self.memory = mmap.mmap(-1, 2 * block * count + (64 << 20))
        self.memory.madvise(mmap.MADV_HUGEPAGE)
        pool = torch.frombuffer(self.memory, dtype=torch.uint8)
        pool.fill_(1)
        self.cpu = LocalCPUBackend(
            self.config, memory_allocator=TensorMemoryAllocator(pool, align_bytes=4096)
        )
        self.keys = [CacheEngineKey("bench", 1, 0, i, torch.bfloat16) for i in range(count)]
        self.objs: list[MemoryObj] = []
        for _ in self.keys:
            obj = self.cpu.allocate(torch.Size([block // 2]), torch.bfloat16, MemoryFormat.KV_2LTD)
            if obj is None or obj.tensor is None:
                raise SystemExit("LMCache's allocator is out of memory")
            obj.tensor.view(torch.uint8)[:] = torch.randint(0, 256, (block,), dtype=torch.uint8)
            self.objs.append(obj)

    def _config(self, root: Path | None) -> LMCacheEngineConfig:
        return LMCacheEngineConfig.from_defaults(
            local_cpu=False,
            max_local_cpu_size=2 * self.block * self.count / 2**30 + 1,
            local_disk=str(root) if root else None,
            max_local_disk_size=4 * self.block * self.count / 2**30,
            extra_config={"use_odirect": True, "disk_io_threads": self.threads},
        )

    def run(self, root: Path) -> dict[str, Any]:
        """Worker thread: store every block into a new backend at `root`, then load them back."""
        root.mkdir()
        disk = LocalDiskBackend(self._config(root), self.loop, self.cpu)
        try:
            written = threading.Semaphore(0)
            started = time.perf_counter()
            for key, obj in zip(self.keys, self.objs):
                disk.submit_put_task(key, obj, on_complete_callback=lambda _key: written.release())
            for _ in self.keys:
                if not written.acquire(timeout=120):
                    raise SystemExit("an LMCache write never completed")
            store_s = time.perf_counter() - started
            order = list(range(self.count))
            random.Random(0).shuffle(order)
            loads, exact = [], True
            for _ in range(2):  # at the points of the sequence where ours loads
                drop_cache(root)
                started = time.perf_counter()
                got = disk.batched_get_blocking([self.keys[i] for i in order])
                loads.append(time.perf_counter() - started)
                exact = exact and all(
                    g is not None
                    and torch.equal(g.tensor.view(torch.uint8), self.objs[i].tensor.view(torch.uint8))
                    for g, i in zip(got, order)
                )
                for g in got:
                    if g is not None:
                        g.ref_count_down()  # back to the allocator
        finally:
            disk.close()
        nbytes = self.block * self.count
        return {
            "store_gbps": nbytes / store_s / GB,
            "load_gbps": nbytes / loads[0] / GB,
            "again_load_gbps": nbytes / loads[1] / GB,
            "exact": exact,
        }


async def one_side(args: argparse.Namespace) -> dict[str, Any]:
    """`--side`: one side's store and loads in this process, over memory of its own."""
    block = args.block_mib[0] << 20
    if args.side == "lmcache":
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        return await asyncio.to_thread(LMCacheSide(block, args.count, args.threads, loop).run, args.root)
    with primary_memory(args.memory[0], memory_spec(block, args.count)) as view:
        slots = torch.frombuffer(view, dtype=torch.uint8).view(2, args.count, -1)[:, :, :block]
        slots[1].zero_()
        out = await run_tier(args.root, block, args.count, args.threads, view)
        out["exact"] = bool(torch.equal(slots[0], slots[1]))
        del slots
    return out


async def in_processes(
    args: argparse.Namespace, mib: int, count: int, memory: str, r: int, base: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Round `r` with each side in a new process: (ours, theirs)."""

    async def side(name: str) -> dict[str, Any]:
        out = base / f"{name}.json"
        command = [
            sys.executable,
            __file__,
            "--side",
            name,
            "--root",
            str(base / f"{name}-{mib}-{r}"),
            "--block-mib",
            str(mib),
            "--count",
            str(count),
            "--threads",
            str(args.threads),
            "--memory",
            memory,
            "--json",
            str(out),
        ]
        process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.DEVNULL)
        if await process.wait():
            raise SystemExit(f"round {r}: the {name} process failed")
        result: dict[str, Any] = json.loads(out.read_text())
        await asyncio.to_thread(shutil.rmtree, base / f"{name}-{mib}-{r}", True)
        return result

    return await in_turn(r, partial(side, "kvtier"), partial(side, "lmcache"))


async def in_one_process(
    args: argparse.Namespace,
    lmcache: LMCacheSide,
    view: memoryview,
    mib: int,
    count: int,
    r: int,
    base: Path,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Round `r` with both sides in this process: (ours, theirs)."""
    block = mib << 20
    slots = torch.frombuffer(view, dtype=torch.uint8).view(2, count, -1)[:, :, :block]
    slots[1].zero_()
    ours_root, theirs_root = base / f"kvtier-{mib}-{r}", base / f"lmcache-{mib}-{r}"
    ours, theirs = await in_turn(
        r,
        partial(run_tier, ours_root, block, count, args.threads, view),
        partial(asyncio.to_thread, lmcache.run, theirs_root),
    )
    ours["exact"] = bool(torch.equal(slots[0], slots[1]))
    for root in (ours_root, theirs_root):
        await asyncio.to_thread(shutil.rmtree, root, True)
    return ours, theirs


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-mib", type=int, nargs="+", default=[32, 2])
    add_size_arguments(parser, 1.0, "stored per side and round")
    parser.add_argument("--threads", type=int, default=4, help="LMCache's disk_io_threads, our io_threads")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per block size and memory")
    parser.add_argument(
        "--memory",
        nargs="+",
        default=["anon", "shm"],
        choices=KINDS,
        help="our primary memory (fs_tier.py's)",
    )
    parser.add_argument(
        "--harness",
        nargs="+",
        default=HARNESSES,
        choices=HARNESSES,
        help="both sides in one process, or each side of each round in a process of its own",
    )
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    # A side run alone, by the "processes" harness.
    parser.add_argument("--side", choices=["kvtier", "lmcache"], help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        result = await one_side(args)
        if args.json:
            args.json.write_text(json.dumps(result))
        return
    base = Path(tempfile.mkdtemp(prefix="peers-bench-", dir=args.dir))
    lm_loop = asyncio.new_event_loop()  # LMCache's backends want a loop of their own to post to
    threading.Thread(target=lm_loop.run_forever, daemon=True).start()
    rounds: list[dict[str, Any]] = []
    try:
        for mib in args.block_mib:
            block = mib << 20
            count = block_count(args.gib, block, args.min_blocks)
            lmcache = None
            if "one-process" in args.harness:
                lmcache = LMCacheSide(block, count, args.threads, lm_loop)
            for memory in args.memory:
                with primary_memory(memory, memory_spec(block, count)) as view:
                    for harness in args.harness:
                        for r in range(args.rounds):
                            if lmcache is not None and harness == "one-process":
                                ours, theirs = await in_one_process(args, lmcache, view, mib, count, r, base)
                            else:
                                ours, theirs = await in_processes(args, mib, count, memory, r, base)
                            if not (ours["exact"] and theirs["exact"]):
                                raise SystemExit(f"round {r}: a load did not return the stored bytes")
                            rounds.append(
                                {
                                    "block_mib": mib,
                                    "memory": memory,
                                    "harness": harness,
                                    "round": r,
                                    "kvtier": ours,
                                    "lmcache": theirs,
                                }
                            )
                            print(
                                f"{mib} MiB x {count} threads {args.threads} {memory} {harness} round {r}: "
                                f"store kvtier {ours['store_gbps']:.2f} lmcache {theirs['store_gbps']:.2f} "
                                f"GB/s, load kvtier {ours['load_gbps']:.2f} "
                                f"(fresh {ours['fresh_load_gbps']:.2f}) lmcache {theirs['load_gbps']:.2f} "
                                f"(again {theirs['again_load_gbps']:.2f}) GB/s",
                                flush=True,
                            )
            del lmcache
        if args.json:
            args.json.write_text(json.dumps(rounds))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    run(main)
