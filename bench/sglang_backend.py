"""Benchmark: kvtier's SGLang backend (fs tier) against SGLang's own `HiCacheFile` and raw O_DIRECT.

    python bench/sglang_backend.py --repeat 4                    # 2 and 8 MiB pages, both layouts
    python bench/sglang_backend.py --page-mib 2 --layouts page_first --repeat 2

SGLang's real MHA host pool (bf16, 8 heads of 128, 64 tokens a page; 8 layers for 2 MiB pages,
32 for 8 MiB) holds random bytes. Each round, in rotating order, three sides move the same
pages through the same directory's disk, 128 pages a call, from one thread as SGLang's backup
and prefetch-I/O threads do:

- kvtier: `KVTierHiCacheStorage` at its defaults (fs tier, checksums on) through the v1 calls
  SGLang's controller makes with `interface_v1`, `batch_set_v1` then, in a new backend (a
  restarted server) after the page cache is dropped, `batch_get_v1` into other host slots;
- HiCacheFile: SGLang's file backend through the generic calls it serves (`batch_set` of flat
  pages, made before the clock starts; `batch_get` into SGLang's dummy pages), its files'
  cached pages dropped before the get (its set lands in the page cache, it does not fsync);
- raw: each page's runs written to one file with O_DIRECT `pwritev`, read back with `preadv`,
  on as many threads as the fs tier's I/O threads: no checksum, no index, no crash safety.

Also the time of a warm `batch_exists` of 128 keys (median of 200 calls). Every byte loaded
by kvtier and raw is checked.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import torch
from sglang_env import HiCacheFile, backend_config, mha_pool, slots

from kvtier_async.integrations.sglang import KVTierHiCacheStorage
from kvtier_async.measure import drop_page_cache
from kvtier_async.spec import OffloadingSpec

GB = 1e9
BATCH = 128
GEOMETRY = {2: {"layers": 8}, 8: {"layers": 32}}  # 8 heads x 128 x bf16 x 64 tokens x K+V per layer


def page_views(pool: Any, page: int) -> list[memoryview]:
    raw = pool.kv_buffer.view(torch.uint8).reshape(-1)
    base = pool.kv_buffer.data_ptr()
    ptrs, sizes = pool.get_page_buffer_meta(slots(pool, [page]))
    return [raw[p - base : p - base + n].numpy().data for p, n in zip(ptrs, sizes)]


def names(pages: int, tag: str) -> list[str]:
    return [f"{tag}{i:062x}"[:64] for i in range(pages)]


def batches(pages: int) -> list[range]:
    return [range(s, min(s + BATCH, pages)) for s in range(0, pages, BATCH)]


def kvtier_round(pool: Any, pages: int, root: Path, tag: str) -> dict[str, float]:
    tier = {"type": "fs", "root": str(root)}
    keys = names(pages, tag)
    backend = KVTierHiCacheStorage(backend_config(tier, pool=pool), {})
    backend.register_mem_pool_host(pool)
    started = time.perf_counter()
    for part in batches(pages):
        assert all(backend.batch_set_v1(keys[part.start : part.stop], slots(pool, list(part))))
    set_s = time.perf_counter() - started
    exists = []
    for _ in range(200):
        t = time.perf_counter()
        assert backend.batch_exists(keys[:BATCH]) == min(BATCH, pages)
        exists.append(time.perf_counter() - t)
    backend.close()
    drop_page_cache(root)
    again = KVTierHiCacheStorage(backend_config(tier, pool=pool), {})
    again.register_mem_pool_host(pool)  # a restarted server: the index read before the clock
    started = time.perf_counter()
    for part in batches(pages):
        target = [pages + i for i in part]
        assert all(again.batch_get_v1(keys[part.start : part.stop], slots(pool, target)))
    get_s = time.perf_counter() - started
    exact = all(
        bytes(a) == bytes(b)
        for p in range(pages)
        for a, b in zip(page_views(pool, p), page_views(pool, pages + p))
    )
    again.clear()
    again.close()
    return {
        "set_s": set_s,
        "get_s": get_s,
        "exists_ms": statistics.median(exists) * 1e3,
        "exact": float(exact),
    }


def file_round(pool: Any, pages: int, root: Path, tag: str) -> dict[str, float]:
    config = backend_config(None, pool=pool, extra={"file_storage_path": str(root)})
    backend = HiCacheFile(config)
    backend.register_mem_pool_host(pool)
    keys = names(pages, tag)
    flat = [pool.get_data_page(p * pool.page_size) for p in range(pages)]
    started = time.perf_counter()
    for part in batches(pages):
        assert backend.batch_set(keys[part.start : part.stop], flat[part.start : part.stop])
    set_s = time.perf_counter() - started
    drop_page_cache(root)
    targets = [pool.get_dummy_flat_data_page() for _ in range(pages)]
    started = time.perf_counter()
    for part in batches(pages):
        got = backend.batch_get(keys[part.start : part.stop], targets[part.start : part.stop])
        assert all(page is not None for page in got)
    get_s = time.perf_counter() - started
    backend.clear()
    return {"set_s": set_s, "get_s": get_s}


def raw_round(pool: Any, pages: int, root: Path, threads: int) -> dict[str, float]:
    root.mkdir(parents=True, exist_ok=True)

    def write(p: int) -> None:
        fd = os.open(root / f"{p}.page", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            os.pwritev(fd, page_views(pool, p), 0)
        finally:
            os.close(fd)

    def read(p: int) -> None:
        fd = os.open(root / f"{p}.page", os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, page_views(pool, pages + p), 0)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as executor:
        started = time.perf_counter()
        for part in batches(pages):
            list(executor.map(write, part))
        set_s = time.perf_counter() - started
        drop_page_cache(root)
        started = time.perf_counter()
        for part in batches(pages):
            list(executor.map(read, part))
        get_s = time.perf_counter() - started
    shutil.rmtree(root)
    return {"set_s": set_s, "get_s": get_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--page-mib", type=int, nargs="+", default=[2, 8], choices=sorted(GEOMETRY))
    parser.add_argument("--layouts", nargs="+", default=["page_first", "layer_first"])
    parser.add_argument("--mib", type=int, default=512, help="MiB of pages per case and side")
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None, help="where the files go (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    threads = OffloadingSpec(block_nbytes=4096, num_cpu_blocks=1).limits.io_threads
    results = []
    with tempfile.TemporaryDirectory(prefix="kvtier-sglang-", dir=args.dir) as work:
        for page_mib in args.page_mib:
            for layout in args.layouts:
                page_nbytes = page_mib << 20
                pages = max(8, (args.mib << 20) // page_nbytes)
                pool = mha_pool(
                    layout, page_size=64, heads=8, head_dim=128, tokens=2 * pages * 64, **GEOMETRY[page_mib]
                )
                rounds: dict[str, list[dict[str, float]]] = {"kvtier": [], "file": [], "raw": []}
                for r in range(args.repeat):
                    sides = ["kvtier", "file", "raw"]
                    for side in sides[r % 3 :] + sides[: r % 3]:
                        root = Path(work) / f"{side}-{r}"
                        if side == "kvtier":
                            rounds[side].append(kvtier_round(pool, pages, root, f"k{r}"))
                        elif side == "file":
                            rounds[side].append(file_round(pool, pages, root, f"f{r}"))
                        else:
                            rounds[side].append(raw_round(pool, pages, root, threads))
                        shutil.rmtree(root, ignore_errors=True)
                nbytes = pages * page_nbytes
                case: dict[str, Any] = {
                    "page_mib": page_mib,
                    "layout": layout,
                    "pages": pages,
                    "threads": threads,
                }
                for side, done in rounds.items():
                    case[side] = {
                        "set_gbps": statistics.median(nbytes / d["set_s"] / GB for d in done),
                        "get_gbps": statistics.median(nbytes / d["get_s"] / GB for d in done),
                    }
                case["kvtier"]["exists_ms"] = statistics.median(d["exists_ms"] for d in rounds["kvtier"])
                case["kvtier"]["exact"] = all(d["exact"] for d in rounds["kvtier"])
                for op in ("set", "get"):  # round by round: each round's sides share the disk's state
                    for other in ("raw", "file"):
                        ratios = [
                            o[f"{op}_s"] / k[f"{op}_s"] for k, o in zip(rounds["kvtier"], rounds[other])
                        ]
                        case[f"{op}_vs_{other}"] = statistics.median(ratios)
                results.append(case)
                print_case(case)
                del pool
    if args.json:
        args.json.write_text(json.dumps({"repeat": args.repeat, "mib": args.mib, "cases": results}, indent=1))


def print_case(case: dict[str, Any]) -> None:
    k, f, r = case["kvtier"], case["file"], case["raw"]
    print(
        f"{case['page_mib']} MiB {case['layout']:<11} | set GB/s kvtier {k['set_gbps']:.2f} "
        f"file {f['set_gbps']:.2f} raw {r['set_gbps']:.2f} | get GB/s kvtier {k['get_gbps']:.2f} "
        f"file {f['get_gbps']:.2f} raw {r['get_gbps']:.2f} | kvtier/raw set {case['set_vs_raw']:.2f}x "
        f"get {case['get_vs_raw']:.2f}x | kvtier/file set {case['set_vs_file']:.2f}x "
        f"get {case['get_vs_file']:.2f}x | warm batch_exists(128) {k['exists_ms']:.3f} ms "
        f"| exact {k['exact']}",
        flush=True,
    )


if __name__ == "__main__":
    main()
