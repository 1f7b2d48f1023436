"""Benchmark: our fs tier against vLLM 0.33's own fs tier, both inside vLLM's tiering manager.

    python bench/vllm_tiers.py                     # 2 MiB chunks, 512 MiB, 3 interleaved rounds
    python bench/vllm_tiers.py --mib 1024 --rounds 5 --threads 8

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
`--threads` sets both: our `io_threads` and lanes, vLLM's read and write threads.
Ratios are ours / vLLM's throughput, medians of the rounds. Each round also records how
scattered in RAM the pages of each engine's primary region lay (the fraction of neighbouring
pages that are not neighbours in RAM; None where the kernel hides frame numbers): O_DIRECT
I/O straight into scattered pages runs at about half the disk's speed on a VM, and vLLM's
fs tier does that, while ours stages it (`kvtier_async.tiers.fs_staging`). Nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from common import GB, drop_cache, freeze_startup_heap
from vllm.v1.kv_offload.base import LookupResult
from vllm_engine import ADAPTER, Engine, chunk_keys, make_manager, random_rows

from kvtier_async.tiers.fs_staging import scattered_fraction


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=512, help="bytes moved per run, in MiB")
    parser.add_argument("--chunk-kib", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="both tiers' I/O threads (default: each's own)"
    )
    parser.add_argument("--dir", type=Path, default=None, help="where the tiers write (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    freeze_startup_heap()  # as vLLM's engine core does after start-up
    chunk_bytes = args.chunk_kib * 1024
    chunks = max(1, args.mib * 1024 * 1024 // chunk_bytes)
    work = Path(tempfile.mkdtemp(prefix="kvtier-vllm-bench-", dir=args.dir))
    results: dict[str, list[dict[str, float | None]]] = {"kvtier": [], "vllm-fs": []}
    try:
        for r in range(args.rounds):
            order = ["kvtier", "vllm-fs"] if r % 2 == 0 else ["vllm-fs", "kvtier"]
            for name in order:
                results[name].append(one_round(name, work, chunk_bytes, chunks, args.threads, seed=r))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {
        name: {
            k: statistics.median(float(run[k] or 0) for run in runs) for k in runs[0] if k.endswith("_gbps")
        }
        for name, runs in results.items()
    }
    ratios = {k: medians["kvtier"][k] / medians["vllm-fs"][k] for k in medians["kvtier"]}
    if args.json:
        summary = {"chunks": chunks, "chunk_bytes": chunk_bytes, "medians": medians, "ratios": ratios}
        args.json.write_text(json.dumps({**summary, "rounds": results}))
    threads = args.threads or "each tier's default"
    print(f"{chunks} chunks of {args.chunk_kib} KiB, {args.rounds} interleaved rounds, threads: {threads}")
    print(f"{'':24}{'kvtier fs':>12}{'vLLM fs':>12}{'ratio':>8}")
    for k in ratios:
        print(f"{k:24}{medians['kvtier'][k]:>10.2f}GB{medians['vllm-fs'][k]:>10.2f}GB{ratios[k]:>7.2f}x")


if __name__ == "__main__":
    main()
