"""Benchmark: does the cache overlap device <-> host copies with file-system tier I/O?

    python bench/pipeline.py                  # 1 GiB of 2 MiB blocks, 32 layers
    python bench/pipeline.py --gib 0.05       # a quick look

Measured in one run; medians and bests of --repeat rounds:
- store: copy-only (`TieredKVCache.store` with no secondary tier: device -> primary),
  write-only (`FileSystemTier.store` of the same blocks already in the primary tier),
  and the pipeline (`TieredKVCache.store` + `flush` with the fs tier);
- load: copy-only (primary hits -> device), read-only (cold `FileSystemTier.load`
  into the primary tier), and the pipeline (cold `TieredKVCache.load`: tier reads
  promoted into the primary tier while earlier chunks travel to the device).
The ratio is pipeline / max(copy-only, I/O-only); 1.0 is perfect overlap, the
sum of the two would be no overlap at all. CPU tensors stand in for GPU memory.

Also measured, last in each round, as a reference the target does not use:
"side by side", the copy-only and I/O-only work started together with no
dependency between them. Here the copies are CPU memcpy competing with the disk
reads and writes for the same 2 cores and memory, so even that takes longer than
the slower of the two alone; `vs side by side` is how much the pipeline's
ordering adds on top.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import torch
from common import drop_cache, median_tree, run, timed

import kvtier_async as kt
from kvtier_async.tiers.fs import FileSystemTier

LAYERS = 32


def make_layers(blocks: int, block_nbytes: int, device: str = "cpu") -> list[torch.Tensor]:
    width = block_nbytes // LAYERS
    return [torch.randint(0, 256, (blocks, width), dtype=torch.uint8, device=device) for _ in range(LAYERS)]


async def one_round(work: Path, block_nbytes: int, blocks: int, device: str = "cpu") -> dict[str, float]:
    layers = make_layers(blocks, block_nbytes, device)
    original = [layer.clone() for layer in layers]
    ids = list(range(blocks))
    keys = kt.block_hashes(range(blocks * 16), 16, namespace="pipeline")
    primary_blocks = max(8, blocks // 2)  # the store proceeds in chunks through a smaller primary
    capacity = 4 * blocks * block_nbytes + (64 << 20)
    out: dict[str, float] = {}

    def spec(tiers: list[dict[str, object]], num_cpu_blocks: int) -> kt.OffloadingSpec:
        return kt.OffloadingSpec(
            block_nbytes=block_nbytes,
            num_cpu_blocks=num_cpu_blocks,
            secondary_tiers=tiers,
            namespace="pipeline",
        )

    # Store, copy-only: device -> primary tier, nothing behind it.
    async with kt.TieredKVCache(spec([], blocks), layers) as cache:
        out["store_copy_s"] = await timed(lambda: cache.store(keys, ids))
        # Load, copy-only: every block is a primary hit.
        for layer in layers:
            layer.zero_()
        out["load_copy_s"] = await timed(lambda: cache.load(keys, ids))
        # Store, write-only: the same blocks, already in the primary tier, to the fs tier.
        slots: list[int] = [cache.primary.lookup(key) for key in keys]  # type: ignore[misc]
        async with FileSystemTier(
            cache.spec, cache.primary.view, root=str(work / "write-only"), capacity_bytes=capacity
        ) as tier:
            await tier.lookup(keys[:1])  # open it outside the timing
            out["store_io_s"] = await timed(lambda: tier.store(keys, slots))
            await asyncio.to_thread(drop_cache, work / "write-only")
            out["load_io_s"] = await timed(lambda: tier.load(keys, slots))
    # The pipeline: store through a primary tier half the size, to the fs tier.
    for layer, data in zip(layers, original):
        layer.copy_(data)
    fs = [{"type": "fs", "root": str(work / "pipeline"), "capacity_bytes": capacity}]
    async with kt.TieredKVCache(spec(fs, primary_blocks), layers) as cache:
        await cache.lookup(keys[:1])

        async def store() -> None:
            assert await cache.store(keys, ids) == blocks
            await cache.flush()

        out["store_pipeline_s"] = await timed(store)
    await asyncio.to_thread(drop_cache, work / "pipeline")
    for layer in layers:
        layer.zero_()
    async with kt.TieredKVCache(spec(fs, primary_blocks), layers) as cache:  # cold: empty primary
        await cache.lookup(keys[:1])

        async def load() -> None:
            assert await cache.load(keys, ids) == blocks

        out["load_pipeline_s"] = await timed(load)
    assert all(torch.equal(a, b) for a, b in zip(layers, original)), "wrong bytes"
    # Side by side, last (so the pipeline follows the same writes as before): the two jobs at
    # once, unordered, into a fresh tier. The copies move bytes the tier is writing or reading
    # meanwhile; harmless, as nothing is checked after this.
    async with kt.TieredKVCache(spec([], blocks), layers) as cache:
        assert await cache.store(keys, ids) == blocks
        slots = [cache.primary.lookup(key) for key in keys]  # type: ignore[misc]
        engine = cache.copy_engine
        async with FileSystemTier(
            cache.spec, cache.primary.view, root=str(work / "side-by-side"), capacity_bytes=capacity
        ) as tier:
            await tier.lookup(keys[:1])
            out["store_both_s"] = await timed(
                lambda: asyncio.gather(tier.store(keys, slots), engine.to_host(ids, slots))
            )
            await asyncio.to_thread(drop_cache, work / "side-by-side")
            out["load_both_s"] = await timed(
                lambda: asyncio.gather(tier.load(keys, slots), engine.to_device(slots, ids))
            )
    add_ratios(out)
    return out


def add_ratios(numbers: dict[str, float]) -> None:
    """The pipeline against the slower of copy-only and I/O-only, and against side by side."""
    for direction in ("store", "load"):
        pipeline = numbers[f"{direction}_pipeline_s"]
        numbers[f"{direction}_ratio"] = pipeline / max(
            numbers[f"{direction}_copy_s"], numbers[f"{direction}_io_s"]
        )
        numbers[f"{direction}_vs_both"] = pipeline / numbers[f"{direction}_both_s"]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--block-kib", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    block = args.block_kib * 1024
    blocks = max(8, int(args.gib * (1 << 30)) // block)
    rounds = []
    for attempt in range(args.repeat):
        work = Path(tempfile.mkdtemp(prefix="kvtier-pipeline-", dir=args.dir))
        try:
            rounds.append(await one_round(work, block, blocks))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f"round {attempt + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in rounds[-1].items()), flush=True)
    result = median_tree(rounds)
    # Best of the rounds too: this VM's disk runs at two speeds (a 512 MiB O_DIRECT read takes
    # 0.5 s or 2 s, whoever reads), and noise only ever adds time, so each stage's fastest
    # round is the closest to its own cost.
    best = {key: min(r[key] for r in rounds) for key in rounds[0]}
    add_ratios(best)
    gib = blocks * block / (1 << 30)
    for label, numbers in (("median", result), ("best", best)):
        for direction, io in (("store", "write"), ("load", "read")):
            pipeline, copy, only, both = (
                numbers[f"{direction}_{stage}_s"] for stage in ("pipeline", "copy", "io", "both")
            )
            print(
                f"{label:<6} {direction} {gib:.2f} GiB of {args.block_kib} KiB blocks: pipeline "
                f"{pipeline:.3f} s, copy-only {copy:.3f} s, {io}-only {only:.3f} s -> "
                f"{numbers[f'{direction}_ratio']:.2f}x the slower one (target <= 1.15); "
                f"side by side {both:.3f} s -> {numbers[f'{direction}_vs_both']:.2f}x"
            )
    if args.json:
        summary = {"blocks": blocks, "block_kib": args.block_kib, "median": result, "best": best}
        args.json.write_text(json.dumps({**summary, "rounds": rounds}))


if __name__ == "__main__":
    run(main)
