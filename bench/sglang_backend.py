"""Benchmark: kvtier's SGLang backend (fs tier) against SGLang's own `HiCacheFile` and raw O_DIRECT.

    python bench/sglang_backend.py --repeat 4                    # every case below
    python bench/sglang_backend.py --cases 2mib-page_first small-runs --repeat 2

SGLang's real MHA host pool (bf16) holds random bytes. The cases:

- `2mib-*`, `8mib-*`: 8 KV heads of 128, 64 tokens a page, 8 layers (2 MiB pages) or 32
  (8 MiB), in both layouts, through the v1 calls SGLang's controller makes with
  `interface_v1` (runs of 128 KiB per layer, or K and V of the whole page in the page-first
  layout, moved in place in the host pool);
- `small-runs`: SGLang's default page size 1, layer-first, a 7B-class GQA geometry (28
  layers, 4 KV heads of 128: Qwen2.5-7B): runs of 1 KiB, each 56 KiB page packed into one
  block through page slots, v1 calls;
- `generic`: 2 MiB layer-first pages through the generic calls SGLang makes without
  `interface_v1` (`batch_set` of flat pages, `batch_get` into SGLang's dummy pages).

Each round, in rotating order, three sides move the same pages through the same directory's
disk, 128 pages a call, from one thread as SGLang's backup and prefetch-I/O threads do:

- kvtier: `KVTierHiCacheStorage` at its defaults (fs tier, checksums on), the set, then, in a
  new backend (a restarted server) after the page cache is dropped, the get into other host
  slots (or dummy pages);
- HiCacheFile: SGLang's file backend through the generic calls it serves (`batch_set` of flat
  pages, made before the clock starts; `batch_get` into SGLang's dummy pages), its files'
  cached pages dropped before the get (its set lands in the page cache, it does not fsync);
- raw: each page's runs written to one file with O_DIRECT `pwritev`, read back with `preadv`,
  on as many threads as the fs tier's I/O threads: no checksum, no index, no crash safety.
  Only where runs are 4096-byte multiples (O_DIRECT refuses smaller ones).

Hybrid cases (SGLang's v2 interface, `HybridCacheController`'s calls, in its order): one backup
per radix node of 16 KV pages (the node's extra pool pages through `batch_set_v2`, then the KV
pages), one prefetch per node (the KV pages, then `batch_get_v2`):

- `hybrid-mamba`: Qwen3.5 / Qwen3-Next class: KV of 12 full-attention layers (2 KV heads of
  256, 64-token pages: 1.5 MiB), and one Mamba state per node (8 linear-attention layers of a
  (32, 128, 128) fp32 SSM state and a (12288, 3) bf16 conv state: 16.6 MiB);
- `hybrid-dsa`: DeepSeek V3.2 class: MLA KV of 16 layers (64-token pages, 1.1 MiB) and its DSA
  indexer page (132 KiB) for every KV page.

kvtier moves KV through the v1 calls and the extra pools through v2; `HiCacheFile` its KV
through the generic calls (flat pages) and the extra pools through its own v2; raw writes each
page's runs (where the pools' `get_page_buffer_meta` puts them) with O_DIRECT, one file a page,
a node's pages on as many threads as the fs tier's I/O threads, node after node, and reads them
back so. kvtier's set waits for the disk (O_DIRECT), `HiCacheFile`'s for a copy into the page
cache (its disk write comes later, outside the clock): raw / file says which of the two the
disk allows to be faster in those rounds.

Flat pages for both generic sides are made before the clock starts. Also the time of a warm
`batch_exists` of 128 keys (median of 200 calls). Every byte loaded by kvtier is checked (raw's
reads are not).
"""

from __future__ import annotations

import argparse
import ctypes
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
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang_env import HiCacheFile, backend_config, mha_pool, slots
from sglang_hybrid_env import dsa_pools, flat_bytes, mamba_pool

from kvtier_async.integrations.sglang import KVTierHiCacheStorage
from kvtier_async.measure import drop_page_cache, taking_turns
from kvtier_async.spec import OffloadingSpec

GB = 1e9
BATCH = 128
BIG = {"page_size": 64, "heads": 8, "head_dim": 128}  # x bf16 x K+V: 128 KiB runs per layer
CASES: dict[str, dict[str, Any]] = {
    **{
        f"{mib}mib-{layout}": {"pool": {**BIG, "layers": layers}, "layout": layout, "path": "v1"}
        for mib, layers in ((2, 8), (8, 32))
        for layout in ("page_first", "layer_first")
    },
    "small-runs": {
        "pool": {"page_size": 1, "heads": 4, "head_dim": 128, "layers": 28},
        "layout": "layer_first",
        "path": "v1",
    },
    "generic": {"pool": {**BIG, "layers": 8}, "layout": "layer_first", "path": "generic"},
    "hybrid-mamba": {"hybrid": "mamba", "layout": "page_first", "path": "v1 + v2"},
    "hybrid-dsa": {"hybrid": "dsa", "layout": "page_first", "path": "v1 + v2"},
}
NODE_PAGES = 16  # KV pages per radix node: one backup, one Mamba state


def page_views(pool: Any, page: int) -> list[memoryview]:
    raw = pool.kv_buffer.view(torch.uint8).reshape(-1)
    base = pool.kv_buffer.data_ptr()
    ptrs, sizes = pool.get_page_buffer_meta(slots(pool, [page]))
    return [raw[p - base : p - base + n].numpy().data for p, n in zip(ptrs, sizes)]


def names(pages: int, tag: str) -> list[str]:
    return [f"{tag}{i:062x}"[:64] for i in range(pages)]


def batches(pages: int) -> list[range]:
    return [range(s, min(s + BATCH, pages)) for s in range(0, pages, BATCH)]


def kvtier_round(pool: Any, pages: int, root: Path, tag: str, path: str) -> dict[str, float]:
    tier = {"type": "fs", "root": str(root)}
    keys = names(pages, tag)
    config = backend_config(tier, pool=pool, extra={"interface_v1": int(path == "v1")})
    flat = [pool.get_data_page(p * pool.page_size).clone() for p in range(pages)] if path != "v1" else []
    backend = KVTierHiCacheStorage(config, {})
    backend.register_mem_pool_host(pool)
    started = time.perf_counter()
    for part in batches(pages):
        if path == "v1":
            assert all(backend.batch_set_v1(keys[part.start : part.stop], slots(pool, list(part))))
        else:
            assert backend.batch_set(keys[part.start : part.stop], flat[part.start : part.stop])
    set_s = time.perf_counter() - started
    exists = []
    for _ in range(200):
        t = time.perf_counter()
        assert backend.batch_exists(keys[:BATCH]) == min(BATCH, pages)
        exists.append(time.perf_counter() - t)
    backend.close()
    drop_page_cache(root)
    again = KVTierHiCacheStorage(config, {})
    again.register_mem_pool_host(pool)  # a restarted server: the index read before the clock
    targets = [pool.get_dummy_flat_data_page() for _ in range(pages)] if path != "v1" else []
    started = time.perf_counter()
    for part in batches(pages):
        if path == "v1":
            target = [pages + i for i in part]
            assert all(again.batch_get_v1(keys[part.start : part.stop], slots(pool, target)))
        else:
            got = again.batch_get(keys[part.start : part.stop], targets[part.start : part.stop])
            assert all(page is not None for page in got)
    get_s = time.perf_counter() - started
    if path == "v1":
        exact = all(
            bytes(a) == bytes(b)
            for p in range(pages)
            for a, b in zip(page_views(pool, p), page_views(pool, pages + p))
        )
    else:
        exact = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(flat, targets))
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


def hybrid_pools(kind: str, nodes: int) -> tuple[Any, PoolName, Any]:
    """The KV host pool and the extra pool of a hybrid case, room for `nodes` nodes twice."""
    tokens = 2 * nodes * NODE_PAGES * 64
    if kind == "mamba":
        kv = mha_pool("page_first", page_size=64, heads=2, head_dim=256, layers=12, tokens=tokens)
        state = mamba_pool(layers=8, slots=2 * nodes, temporal=(32, 128, 128), conv=(12288, 3))
        return kv, PoolName.MAMBA, state
    kv, indexer = dsa_pools("page_first", layers=16, tokens=tokens)
    return kv, PoolName.INDEXER, indexer


def hybrid_transfer(name: PoolName, node: int, keys: list[str], dest: int) -> PoolTransfer:
    """Node `node`'s extra pool pages, at host node `dest` (a Mamba slot, or the node's KV slots)."""
    node_keys = keys[node * NODE_PAGES : (node + 1) * NODE_PAGES]
    if name == PoolName.MAMBA:
        return PoolTransfer(
            name=name,
            host_indices=torch.tensor([dest]),
            keys=node_keys[-1:],
            hit_policy=PoolHitPolicy.TRAILING_PAGES,
        )
    host = torch.arange(dest * NODE_PAGES * 64, (dest + 1) * NODE_PAGES * 64)
    return PoolTransfer(name=name, host_indices=host, keys=node_keys, hit_policy=PoolHitPolicy.ALL_PAGES)


def hybrid_backend(side: str, kv: Any, name: PoolName, extra: Any, root: Path) -> Any:
    if side == "kvtier":
        backend: Any = KVTierHiCacheStorage(backend_config({"type": "fs", "root": str(root)}, pool=kv), {})
    else:
        backend = HiCacheFile(backend_config(None, pool=kv, extra={"file_storage_path": str(root)}))
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(extra, name)
    return backend


def hybrid_round(
    side: str, pools: tuple[Any, PoolName, Any], nodes: int, root: Path, tag: str
) -> dict[str, float]:
    """Back up `nodes` nodes, then (a restarted backend, cold page cache) prefetch them into the
    other half of the pools; kvtier's loads are checked byte by byte."""
    kv, name, extra = pools
    keys = names(nodes * NODE_PAGES, tag)
    node_pages = [range(n * NODE_PAGES, (n + 1) * NODE_PAGES) for n in range(nodes)]
    flat = [kv.get_data_page(p * 64).clone() for p in range(nodes * NODE_PAGES)] if side == "file" else []
    backend = hybrid_backend(side, kv, name, extra, root)
    started = time.perf_counter()
    for n, pages in enumerate(node_pages):
        part = keys[pages.start : pages.stop]
        # SGLang's order (`_page_backup_with_stable_layout`): the extra pools, then the KV pages.
        assert all(backend.batch_set_v2([hybrid_transfer(name, n, keys, n)])[name])
        if side == "kvtier":
            assert all(backend.batch_set_v1(part, slots(kv, list(pages))))
        else:
            assert backend.batch_set(part, flat[pages.start : pages.stop])
    set_s = time.perf_counter() - started
    if side == "kvtier":
        backend.close()
        backend = hybrid_backend(side, kv, name, extra, root)  # a restarted server
    drop_page_cache(root)
    targets = [kv.get_dummy_flat_data_page() for _ in range(NODE_PAGES)] if side == "file" else []
    started = time.perf_counter()
    for n, pages in enumerate(node_pages):
        part = keys[pages.start : pages.stop]
        if side == "kvtier":
            assert all(backend.batch_get_v1(part, slots(kv, [nodes * NODE_PAGES + p for p in pages])))
        else:
            assert all(page is not None for page in backend.batch_get(part, targets))
        assert all(backend.batch_get_v2([hybrid_transfer(name, n, keys, nodes + n)])[name])
    get_s = time.perf_counter() - started
    exact = 1.0
    if side == "kvtier":
        pages_of = (
            (lambda n: [n])
            if name == PoolName.MAMBA
            else (lambda n: [p * 64 for p in range(n * NODE_PAGES, (n + 1) * NODE_PAGES)])
        )
        exact = float(
            all(
                flat_bytes(kv, p * 64) == flat_bytes(kv, (nodes * NODE_PAGES + p) * 64)
                for p in range(nodes * NODE_PAGES)
            )
            and all(
                flat_bytes(extra, a) == flat_bytes(extra, b)
                for n in range(nodes)
                for a, b in zip(pages_of(n), pages_of(nodes + n))
            )
        )
        backend.clear()
        backend.close()
    else:
        backend.clear()
    return {"set_s": set_s, "get_s": get_s, "exact": exact}


def hybrid_runs(pools: tuple[Any, PoolName, Any], node: int, dest: int) -> list[list[memoryview]]:
    """Node `node`'s pages as runs of the host pools (its KV pages, then its extra pool pages,
    where the pool's own `get_page_buffer_meta` puts them), at host node `dest`: what raw
    O_DIRECT writes and reads, one file a page."""
    kv, name, extra = pools
    kv_pages = [page_views(kv, dest * NODE_PAGES + p) for p in range(NODE_PAGES)]
    starts = [dest] if name == PoolName.MAMBA else [(dest * NODE_PAGES + p) * 64 for p in range(NODE_PAGES)]
    extra_pages = []
    for start in starts:
        ptrs, sizes = extra.get_page_buffer_meta(torch.arange(start, start + extra.page_size))
        extra_pages.append(
            [memoryview((ctypes.c_char * n).from_address(p)).cast("B") for p, n in zip(ptrs, sizes)]
        )
    return kv_pages + extra_pages


def hybrid_raw_round(
    pools: tuple[Any, PoolName, Any], nodes: int, root: Path, threads: int
) -> dict[str, float]:
    """Each node's pages (KV, then extra pool) written with O_DIRECT `pwritev`, one file a page,
    on `threads` threads, node after node; read back into the other half of the pools the same
    way after the page cache is dropped: the disk's speed for these bytes, with nothing else."""
    root.mkdir(parents=True, exist_ok=True)

    def write(item: tuple[int, list[memoryview]]) -> None:
        fd = os.open(root / f"{item[0]}.page", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            os.pwritev(fd, item[1], 0)
        finally:
            os.close(fd)

    def read(item: tuple[int, list[memoryview]]) -> None:
        fd = os.open(root / f"{item[0]}.page", os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, item[1], 0)
        finally:
            os.close(fd)

    per_node = NODE_PAGES + (1 if pools[1] == PoolName.MAMBA else NODE_PAGES)
    with ThreadPoolExecutor(threads) as executor:
        started = time.perf_counter()
        for n in range(nodes):
            list(executor.map(write, enumerate(hybrid_runs(pools, n, n), n * per_node)))
        set_s = time.perf_counter() - started
        drop_page_cache(root)
        started = time.perf_counter()
        for n in range(nodes):
            list(executor.map(read, enumerate(hybrid_runs(pools, n, nodes + n), n * per_node)))
        get_s = time.perf_counter() - started
    shutil.rmtree(root)
    return {"set_s": set_s, "get_s": get_s}


def hybrid_case(name: str, args: argparse.Namespace, work: str) -> dict[str, Any]:
    case_config = CASES[name]
    probe = hybrid_pools(case_config["hybrid"], 1)
    kv, pool_name, extra = probe
    kv_page = kv.get_data_page(0).numel() * kv.get_data_page(0).element_size()
    extra_page = extra.get_dummy_flat_data_page().numel() * extra.get_dummy_flat_data_page().element_size()
    extra_per_node = extra_page * (1 if pool_name == PoolName.MAMBA else NODE_PAGES)
    node_nbytes = NODE_PAGES * kv_page + extra_per_node
    del probe, kv, extra
    nodes = max(2, (args.mib << 20) // node_nbytes)
    pools = hybrid_pools(case_config["hybrid"], nodes)
    sides = ["kvtier", "file", "raw"]
    threads = OffloadingSpec(block_nbytes=4096, num_cpu_blocks=1).limits.io_threads
    rounds: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for r in range(args.repeat):
        for side in taking_turns(sides, r):
            root = Path(work) / f"{name}-{side}-{r}"
            if side == "raw":
                rounds[side].append(hybrid_raw_round(pools, nodes, root, threads))
            else:
                rounds[side].append(hybrid_round(side, pools, nodes, root, f"{side[0]}{r}"))
            shutil.rmtree(root, ignore_errors=True)
    nbytes = nodes * node_nbytes
    case: dict[str, Any] = {
        "case": name,
        "page_kib": kv_page >> 10,
        "extra_page_kib": extra_page >> 10,
        "extra_pool": str(pool_name),
        "run_bytes": 0,
        "layout": case_config["layout"],
        "path": case_config["path"],
        "pages": nodes * NODE_PAGES,
        "nodes": nodes,
    }
    for side, done in rounds.items():
        case[side] = {
            "set_gbps": statistics.median(nbytes / d["set_s"] / GB for d in done),
            "get_gbps": statistics.median(nbytes / d["get_s"] / GB for d in done),
        }
    case["kvtier"]["exact"] = all(d["exact"] for d in rounds["kvtier"])
    for op in ("set", "get"):  # round by round: each round's sides share the disk's state
        for other in sides[1:]:
            ratios = [o[f"{op}_s"] / k[f"{op}_s"] for k, o in zip(rounds["kvtier"], rounds[other])]
            case[f"{op}_vs_{other}"] = statistics.median(ratios)
        # the disk against the page cache: where raw O_DIRECT is slower than HiCacheFile's copy
        ratios = [f[f"{op}_s"] / w[f"{op}_s"] for w, f in zip(rounds["raw"], rounds["file"])]
        case[f"raw_{op}_vs_file"] = statistics.median(ratios)
    return case


def print_hybrid_case(case: dict[str, Any]) -> None:
    k, f, r = case["kvtier"], case["file"], case["raw"]
    print(
        f"{case['case']:<17} {case['nodes']} nodes of {NODE_PAGES} x {case['page_kib']} KiB KV pages + "
        f"{case['extra_pool']} pages of {case['extra_page_kib']} KiB | set GB/s kvtier {k['set_gbps']:.2f} "
        f"file {f['set_gbps']:.2f} raw {r['set_gbps']:.2f} | get GB/s kvtier {k['get_gbps']:.2f} file "
        f"{f['get_gbps']:.2f} raw {r['get_gbps']:.2f} | kvtier/file set {case['set_vs_file']:.2f}x get "
        f"{case['get_vs_file']:.2f}x | kvtier/raw set {case['set_vs_raw']:.2f}x get "
        f"{case['get_vs_raw']:.2f}x | raw/file set {case['raw_set_vs_file']:.2f}x | exact {k['exact']}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--mib", type=int, default=512, help="MiB of pages per case and side")
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None, help="where the files go (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    threads = OffloadingSpec(block_nbytes=4096, num_cpu_blocks=1).limits.io_threads
    results = []
    with tempfile.TemporaryDirectory(prefix="kvtier-sglang-", dir=args.dir) as work:
        for name in args.cases:
            case_config = CASES[name]
            if "hybrid" in case_config:
                results.append(hybrid_case(name, args, work))
                print_hybrid_case(results[-1])
                continue
            geometry = case_config["pool"]
            probe = mha_pool(case_config["layout"], tokens=2 * geometry["page_size"], **geometry)
            _, sizes = probe.get_page_buffer_meta(slots(probe, [0]))
            run_nbytes, page_nbytes = sizes[0], sum(sizes)
            del probe
            pages = max(8, (args.mib << 20) // page_nbytes)
            pool = mha_pool(case_config["layout"], tokens=2 * pages * geometry["page_size"], **geometry)
            sides = ["kvtier", "file"] + (["raw"] if run_nbytes % 4096 == 0 else [])
            rounds: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
            for r in range(args.repeat):
                for side in taking_turns(sides, r):
                    root = Path(work) / f"{side}-{r}"
                    if side == "kvtier":
                        rounds[side].append(kvtier_round(pool, pages, root, f"k{r}", case_config["path"]))
                    elif side == "file":
                        rounds[side].append(file_round(pool, pages, root, f"f{r}"))
                    else:
                        rounds[side].append(raw_round(pool, pages, root, threads))
                    shutil.rmtree(root, ignore_errors=True)
            nbytes = pages * page_nbytes
            case: dict[str, Any] = {
                "case": name,
                "page_kib": page_nbytes >> 10,
                "run_bytes": run_nbytes,
                "layout": case_config["layout"],
                "path": case_config["path"],
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
                for other in sides[1:]:
                    ratios = [o[f"{op}_s"] / k[f"{op}_s"] for k, o in zip(rounds["kvtier"], rounds[other])]
                    case[f"{op}_vs_{other}"] = statistics.median(ratios)
            results.append(case)
            print_case(case)
            del pool
    if args.json:
        args.json.write_text(json.dumps({"repeat": args.repeat, "mib": args.mib, "cases": results}, indent=1))


def print_case(case: dict[str, Any]) -> None:
    k, f, r = case["kvtier"], case["file"], case.get("raw")
    raw = f" raw {r['set_gbps']:.2f}" if r else ""
    raw_get = f" raw {r['get_gbps']:.2f}" if r else ""
    vs_raw = f" | kvtier/raw set {case['set_vs_raw']:.2f}x get {case['get_vs_raw']:.2f}x" if r else ""
    print(
        f"{case['case']:<17} {case['page_kib']} KiB pages, runs of {case['run_bytes']} B, {case['path']} "
        f"| set GB/s kvtier {k['set_gbps']:.2f} file {f['set_gbps']:.2f}{raw} | get GB/s kvtier "
        f"{k['get_gbps']:.2f} file {f['get_gbps']:.2f}{raw_get}{vs_raw} | kvtier/file set "
        f"{case['set_vs_file']:.2f}x get {case['get_vs_file']:.2f}x | warm batch_exists(128) "
        f"{k['exists_ms']:.3f} ms | exact {k['exact']}",
        flush=True,
    )


if __name__ == "__main__":
    main()
