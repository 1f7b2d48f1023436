"""Benchmark: the fs tier's staged O_DIRECT against direct I/O, by how scattered the memory is.

    python bench/fs_staging.py                                   # what the performance page shows
    python bench/fs_staging.py --between 0 1 --block-mib 2 --repeat 4

What `staging.SCATTERED_ABOVE` is set from. The primary region is a `/dev/shm` mapping, as
vLLM hands its tiers, faulted in page by page with a page of another mapping faulted after
every `--between`-th of its own (0: none), so that that share of its neighbouring pages at
least lie apart in RAM; what the host's free memory adds to it varies from run to run, so
the fraction measured (`scattered_fraction`, what the tier decides by) is printed beside
each result. Per round, one tier with `staging=True` and one with `staging=False` store the
same random blocks and load them back with the page cache dropped, taking turns to go
first; the ratio is direct / staged, round by round, its median shown (below 1: staging pays).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from common import GB, add_size_arguments, block_count, drop_cache, in_turn, paired_ratio, run
from fs_tier import fill_random, scattered_shm_mapping, shm_mapping

import kvtier_async as kt
from kvtier_async.tiers.fs import FileSystemTier
from kvtier_async.tiers.fs.staging import scattered_fraction


async def store_and_load(
    work: Path, spec: kt.OffloadingSpec, view: memoryview, count: int, staging: bool, seed: int
) -> dict[str, float]:
    keys = kt.block_hashes(range(count * 16), 16, namespace=f"staging-{seed}-{staging}")
    order = list(range(count))
    random.Random(seed).shuffle(order)
    async with FileSystemTier(spec, view, root=str(work), staging=staging) as tier:
        await tier.open()
        started = time.perf_counter()
        if not all(await tier.store(keys, list(range(count)))):
            raise SystemExit("store failed")
        store_s = time.perf_counter() - started
        await asyncio.to_thread(drop_cache, work)
        started = time.perf_counter()
        if not all(await tier.load([keys[i] for i in order], [count + i for i in order])):
            raise SystemExit("load missed")
        load_s = time.perf_counter() - started
    shutil.rmtree(work)
    nbytes = count * spec.block_nbytes
    return {"store_gbps": nbytes / store_s / GB, "load_gbps": nbytes / load_s / GB}


async def compare(
    work: Path, spec: kt.OffloadingSpec, view: memoryview, count: int, rounds: int
) -> list[dict[str, float]]:
    """Each round's figures of both tiers; the two take turns to go first."""
    out = []
    for r in range(rounds):
        staged, direct = await in_turn(
            r,
            partial(store_and_load, work / f"staged-{r}", spec, view, count, True, r),
            partial(store_and_load, work / f"direct-{r}", spec, view, count, False, r),
        )
        sides = {"staged": staged, "direct": direct}
        out.append({f"{side}_{k}": v for side, got in sides.items() for k, v in got.items()})
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--between", type=int, nargs="+", default=[0, 5, 3, 2, 1])
    parser.add_argument("--block-mib", type=int, nargs="+", default=[2, 32])
    parser.add_argument("--threads", type=int, default=4, help="the tier's io_threads")
    parser.add_argument("--repeat", type=int, default=6, help="rounds")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    add_size_arguments(parser, 1.0, "stored and loaded per tier and round")
    args = parser.parse_args()
    results = []
    print("block | a page between every | neighbours apart | staged store / load GB/s | direct / staged")
    for block_mib in args.block_mib:
        count = block_count(args.gib, block_mib << 20, args.min_blocks)
        spec = kt.OffloadingSpec(
            block_nbytes=block_mib << 20,
            num_cpu_blocks=2 * count,
            namespace="staging",
            io_threads=args.threads,
        )
        for between in args.between:
            nbytes = spec.primary_nbytes
            mapping = scattered_shm_mapping(nbytes, between) if between else shm_mapping(nbytes)
            fill_random(torch.frombuffer(mapping, dtype=torch.uint8))
            view = memoryview(mapping)
            fraction = scattered_fraction(view)
            with tempfile.TemporaryDirectory(prefix="kvtier-staging-", dir=args.dir) as work:
                rounds = await compare(Path(work), spec, view, count, args.repeat)
            view.release()
            mapping.close()
            results.append(
                {
                    "block_kib": block_mib << 10,
                    "threads": args.threads,
                    "between": between,
                    "apart": fraction,
                    "rounds": rounds,
                }
                | {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
            )
            ratio = {
                op: paired_ratio(rounds, rounds, f"direct_{op}", f"staged_{op}")
                for op in ("store_gbps", "load_gbps")
            }
            apart = "unknown" if fraction is None else f"{fraction:.2f}"
            print(
                f"{block_mib:>3} MiB | {between or '-':>4} | {apart:>7} | "
                f"{results[-1]['staged_store_gbps']:.2f} / {results[-1]['staged_load_gbps']:.2f} | "
                f"store {ratio['store_gbps']:.2f}x load {ratio['load_gbps']:.2f}x",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    run(main)
