"""Benchmark: LMCache 0.5.6's LocalDiskBackend, store and cold load, to set beside bench/fs_tier.py.

LMCache pins its own dependencies, so it runs from its own environment:

    python -m venv /tmp/lmvenv && /tmp/lmvenv/bin/pip install torch==2.13.0 lmcache==0.5.6
    /tmp/lmvenv/bin/python bench/lmcache_disk.py --block-mib 32 --blocks 32 --threads 4

Alternate it with `python bench/fs_tier.py --gib 1 --threads 4 --block-kib 32768 --memory anon
--repeat 1` (same bytes, threads and disk) and compare medians: `bench/run_all.py` does (its "peers" record).

Its best configuration here: O_DIRECT on (`use_odirect`, which needs page-aligned buffers, so
its allocator gets page-aligned huge-page memory, every page touched first as in a running
server), `disk_io_threads` = our `io_threads`. Each block is one file, written with one
`os.write` and read with one `readinto`; LMCache keeps no checksum. The store is timed until
every write has called back; the load is `batched_get_blocking` of every key in random order
into memory LMCache allocates, page cache dropped first. Random bytes; the loaded bytes are
compared with the stored ones. A new backend knows nothing of an earlier one's files, so there
is no restart sequence to measure.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import mmap
import os
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend


def drop_page_cache(directory: Path) -> None:
    # kvtier_async.benchmark.drop_page_cache, restated: this runs where kvtier_async is not installed.
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-mib", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    # The start-up heap frozen, as a serving process (vLLM's engine core) does and as our
    # benchmarks run (kvtier_async.benchmark.freeze_startup_heap).
    gc.collect()
    gc.freeze()
    block, count = args.block_mib << 20, args.blocks
    root = Path(tempfile.mkdtemp(prefix="lmcache-bench-", dir=args.dir))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        config = LMCacheEngineConfig.from_defaults(
            local_cpu=False,
            max_local_cpu_size=2 * block * count / 2**30 + 1,
            local_disk=str(root),
            max_local_disk_size=4 * block * count / 2**30,
            extra_config={"use_odirect": True, "disk_io_threads": args.threads},
        )
        memory = mmap.mmap(-1, 2 * block * count + (64 << 20))
        memory.madvise(mmap.MADV_HUGEPAGE)
        pool = torch.frombuffer(memory, dtype=torch.uint8)
        pool.fill_(1)
        cpu = LocalCPUBackend(config, memory_allocator=TensorMemoryAllocator(pool, align_bytes=4096))
        disk = LocalDiskBackend(config, loop, cpu)
        keys = [CacheEngineKey("bench", 1, 0, i, torch.bfloat16) for i in range(count)]
        objs = []
        for _ in keys:
            obj = cpu.allocate(torch.Size([block // 2]), torch.bfloat16, MemoryFormat.KV_2LTD)
            assert obj is not None and obj.tensor is not None
            obj.tensor.view(torch.uint8)[:] = torch.randint(0, 256, (block,), dtype=torch.uint8)
            objs.append(obj)
        written = threading.Semaphore(0)
        started = time.perf_counter()
        for key, obj in zip(keys, objs):
            disk.submit_put_task(key, obj, on_complete_callback=lambda _key: written.release())
        for _ in keys:
            if not written.acquire(timeout=120):
                raise SystemExit("a write never completed")
        store_s = time.perf_counter() - started
        drop_page_cache(root)
        order = list(range(count))
        random.Random(0).shuffle(order)
        started = time.perf_counter()
        got = disk.batched_get_blocking([keys[i] for i in order])
        load_s = time.perf_counter() - started
        exact = all(
            g is not None and torch.equal(g.tensor.view(torch.uint8), objs[i].tensor.view(torch.uint8))
            for g, i in zip(got, order)
        )
        print(
            f"lmcache {args.block_mib} MiB x {count} threads {args.threads}: "
            f"store {block * count / store_s / 1e9:.2f} GB/s load {block * count / load_s / 1e9:.2f} GB/s "
            f"exact {exact}",
            flush=True,
        )
        if args.json:
            result = {"block_mib": args.block_mib, "blocks": count, "threads": args.threads, "exact": exact}
            result.update(store_gbps=block * count / store_s / 1e9, load_gbps=block * count / load_s / 1e9)
            args.json.write_text(json.dumps(result))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    os._exit(0)  # LMCache's executor threads do not stop on their own


if __name__ == "__main__":
    main()
