"""Benchmark: our fs tier against vLLM 0.33's own fs tier, both inside vLLM's tiering manager.

    python bench/vllm_tiers.py                     # 2 and 32 MiB chunks, 0.5 GiB (32 chunks at least)
    python bench/vllm_tiers.py --chunk-kib 2048 --rounds 6 --threads default 4 8

Both tiers are driven through vLLM's real `TieringOffloadingManager` (a real `/dev/shm` primary
region, vLLM's factory), as its scheduler drives them; only the GPU <-> CPU copy is left out.
Rows hold random bytes. For each tier, each round, on the same disk:
- store: `complete_store` of every chunk (the cascade to the secondary tier) until
  `drain_jobs` returns and the manager has collected every result;
- promote, same engine: `reset_cache`, page cache dropped, then the lookups (HIT_PENDING),
  the step end that submits the promotion, until every chunk is a HIT;
- promote, new engine: the manager shut down, a new one on the same directory, page cache
  dropped, then the same (here a chunk is RETRY first while the tier is asked about it).
Defaults are each tier's own (what a user who sets only the directory gets), unless
`--threads` sets both: our `io_threads` and lanes, vLLM's read and write threads (each of
its two pools that many). Throughputs shown are medians of the rounds; a ratio is the median
of the rounds' ours / vLLM's ratios (common.paired_ratio). Each round also records how
scattered in RAM the pages of each engine's primary region lay (the fraction of neighbouring
pages that are not neighbours in RAM; None where the kernel hides frame numbers): O_DIRECT
I/O straight into scattered pages runs at about half the disk's speed on a VM, and vLLM's
fs tier does that, while ours stages it (`kvtier_async.tiers.fs.staging`). Nothing here asserts.
"""

from __future__ import annotations

import argparse
import inspect
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from common import (
    GB,
    add_size_arguments,
    block_count,
    drop_cache,
    freeze_startup_heap,
    median_tree,
    paired_ratio,
)
from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm_engine import ADAPTER, Engine, chunk_keys, make_manager, random_rows

import kvtier_async as kt
from kvtier_async.tiers.fs.staging import scattered_fraction


def tier_configs(name: str, root: Path, threads: int | None) -> list[dict[str, Any]]:
    if name == "kvtier":
        tier: dict[str, Any] = {"type": "fs", "root": str(root)}
        limits = (
            {} if threads is None else {"limits": {"io_threads": threads, "max_inflight_stores": threads}}
        )
        return [{**ADAPTER, "tier": tier, **limits}]
    config: dict[str, Any] = {"type": "fs", "root_dir": str(root)}
    if threads is not None:
        config.update(n_read_threads=threads, n_write_threads=threads)
    return [config]


def promote(engine: Engine, keys: list[Any]) -> float:
    """Seconds from the first lookup until every chunk is a HIT in the primary tier."""
    ctx = engine.new_request()
    started = time.perf_counter()
    for _ in range(10):
        if engine.lookup(ctx, keys) == [LookupResult.HIT] * len(keys):
            break
        engine.settle()
    else:
        raise RuntimeError("the promotion did not finish in 10 steps")
    elapsed = time.perf_counter() - started
    engine.finish(ctx)
    return elapsed


def scattered(engine: Engine) -> float | None:
    """How scattered in RAM the pages of the engine's primary region lie (None: not visible)."""
    with engine._rows() as flat:
        return scattered_fraction(flat)


def one_round(
    name: str, work: Path, chunk_bytes: int, chunks: int, threads: int | None, seed: int
) -> dict[str, float | None]:
    root = work / name
    shutil.rmtree(root, ignore_errors=True)
    configs = tier_configs(name, root, threads)
    engine = Engine(make_manager(configs, chunk_bytes=chunk_bytes, chunks=chunks))
    scattered_same = scattered(engine)
    keys = chunk_keys(seed, chunks)
    payloads = random_rows(keys, engine.row_bytes, seed=seed)
    nbytes = chunks * engine.row_bytes
    ctx = engine.new_request()
    with engine.manager.lock:  # the GPU -> CPU copy, untimed
        out = engine.manager.prepare_store(keys, ctx)
        with engine._rows() as flat:
            for key, row in zip(out.keys_to_store, out.store_spec.chunk_ids.tolist()):
                flat[row * engine.row_bytes : (row + 1) * engine.row_bytes] = payloads[key]
    started = time.perf_counter()
    with engine.manager.lock:
        engine.manager.complete_store(out.keys_to_store, ctx)
    engine.settle()
    engine.step_end()  # the manager collects the results
    store_s = time.perf_counter() - started
    engine.finish(ctx)

    engine.reset_cache()
    drop_cache(root)
    same_s = promote(engine, keys)
    if engine.shutdown():
        raise RuntimeError("vLLM kept its primary region mapped")

    engine = Engine(make_manager(configs, chunk_bytes=chunk_bytes, chunks=chunks))
    scattered_new = scattered(engine)
    drop_cache(root)
    fresh_s = promote(engine, keys)
    ctx = engine.new_request()
    if engine.load(ctx, keys) != payloads:
        raise RuntimeError(f"{name}: the promoted bytes differ")
    engine.finish(ctx)
    engine.shutdown()
    return {
        "store_gbps": nbytes / store_s / GB,
        "promote_same_gbps": nbytes / same_s / GB,
        "promote_new_engine_gbps": nbytes / fresh_s / GB,
        "scattered_same": scattered_same,
        "scattered_new_engine": scattered_new,
    }


def default_threads() -> dict[str, str]:
    """Each tier's own I/O threads, when nothing sets them, as the docs name them."""
    ours = kt.OffloadingSpec(block_nbytes=1, num_cpu_blocks=1).limits.io_threads
    signature = inspect.signature(FileSystemTierManager.__init__).parameters
    reads, writes = (signature[name].default for name in ("n_read_threads", "n_write_threads"))
    return {"kvtier": f"{ours}", "vllm-fs": f"{reads} read + {writes} write"}


def one_case(work: Path, chunk_bytes: int, chunks: int, threads: int | None, rounds: int) -> dict[str, Any]:
    """Interleaved rounds of both tiers at one chunk size and thread count, and their medians."""
    results: dict[str, list[dict[str, float | None]]] = {"kvtier": [], "vllm-fs": []}
    for r in range(rounds):
        order = ["kvtier", "vllm-fs"] if r % 2 == 0 else ["vllm-fs", "kvtier"]
        for name in order:
            results[name].append(one_round(name, work, chunk_bytes, chunks, threads, seed=r))
    speeds = [k for k in results["kvtier"][0] if k.endswith("_gbps")]
    medians = {
        name: median_tree([{k: run[k] for k in speeds} for run in runs]) for name, runs in results.items()
    }
    ratios = {k: paired_ratio(results["kvtier"], results["vllm-fs"], k, k) for k in speeds}
    described = (
        default_threads()
        if threads is None
        else {"kvtier": f"{threads}", "vllm-fs": f"{threads} + {threads}"}
    )
    return {
        "chunk_bytes": chunk_bytes,
        "chunks": chunks,
        "threads": threads,
        "threads_described": described,
        "medians": medians,
        "ratios": ratios,
        "rounds": results,
    }


def thread_count(text: str) -> int | None:
    return None if text == "default" else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_size_arguments(parser, 0.5, "moved per run")
    parser.add_argument("--chunk-kib", type=int, nargs="+", default=[2048, 32768])
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds per case (even)")
    parser.add_argument(
        "--threads",
        type=thread_count,
        nargs="+",
        default=[None],
        help="both tiers' I/O threads, one case each; \"default\": each tier's own (the default)",
    )
    parser.add_argument("--dir", type=Path, default=None, help="where the tiers write (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    freeze_startup_heap()  # as vLLM's engine core does after start-up
    work = Path(tempfile.mkdtemp(prefix="kvtier-vllm-bench-", dir=args.dir))
    cases = []
    try:
        for kib in args.chunk_kib:
            chunk_bytes = kib * 1024
            chunks = block_count(args.gib, chunk_bytes, args.min_blocks)
            for threads in args.threads:
                case = one_case(work, chunk_bytes, chunks, threads, args.rounds)
                cases.append(case)
                print(
                    f"{chunks} chunks of {kib} KiB, {args.rounds} interleaved rounds, threads: "
                    f"kvtier {case['threads_described']['kvtier']}, "
                    f"vLLM {case['threads_described']['vllm-fs']}"
                )
                print(f"{'':24}{'kvtier fs':>12}{'vLLM fs':>12}{'ratio':>8}")
                for k, ratio in case["ratios"].items():
                    ours, theirs = case["medians"]["kvtier"][k], case["medians"]["vllm-fs"][k]
                    print(f"{k:24}{ours:>10.2f}GB{theirs:>10.2f}GB{ratio:>7.2f}x", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(cases))


if __name__ == "__main__":
    main()
