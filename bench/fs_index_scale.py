"""Benchmark: the fs tier's index at scale: memory per block, open time, lookup and store rates,
and the garbage collector's pauses with the index full.

    python bench/fs_index_scale.py                      # 100,000 then 1,000,000 blocks of 4 KiB
    python bench/fs_index_scale.py --blocks 200000      # one size
    python bench/fs_index_scale.py --json out.json      # and the results as JSON
    python bench/fs_index_scale.py --against a1432f6    # that commit's tier first, at each size

For each size, in fresh processes on one new root (the index does not depend on the block
size: 4 KiB blocks let a million fit on a small disk):

- a writer stores N blocks (store rate; and the longest the event loop's thread computed
  without coming back to the loop meanwhile, `LoopHold` with the collector on: the index's
  growth, a batch's stores, collections), then, with them all held, looks every key up (lookup
  rate: the fastest of three passes), runs full collections (the longest `gc.callbacks` pause,
  in the collecting thread's CPU time, once a first collection has freed what the stores and
  lookups left) and reports what its memory grew by from before it
  opened the tier (RSS per block);
- while the writer still holds the root, a second process opens it and looks every key up: its
  RSS growth per block (what each further engine process on the host pays);
- once the writer has exited, a restarted process opens the root: the time from its first call
  to the return of its first lookup (one key).

The start-up heap is frozen (`gc.freeze()`) before the tier opens, as vLLM's engine core does, so
a full collection's pause is that of the objects made since: the index's, for the most part.

Each process's keys are made before its baseline RSS is read, so the keys a caller holds anyway
are not counted as the index's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import kvtier_async as kt
from kvtier_async.testing.loop_hold import LoopHold
from kvtier_async.tiers.fs import FileSystemTier

BATCH = 4096
REPO = Path(__file__).resolve().parent.parent
NAMESPACE = "index-scale"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class GcPauses:
    """The longest collection seen (`gc.callbacks`), per generation, in the CPU time of the
    thread that collects: what the collection costs, not how long this shared machine's
    scheduler kept the process waiting meanwhile."""

    def __init__(self) -> None:
        self.longest = [0.0, 0.0, 0.0]
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.thread_time()
        else:
            generation = info["generation"]
            self.longest[generation] = max(self.longest[generation], time.thread_time() - self._started)


def the_keys(blocks: int) -> list[bytes]:
    return kt.block_hashes(range(blocks * 16), 16, namespace=NAMESPACE)


async def lookups_per_s(tier: FileSystemTier, keys: list[bytes], passes: int = 3) -> float:
    """Every key looked up, in batches; the fastest of `passes` passes (this machine is shared)."""
    fastest = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        for start in range(0, len(keys), BATCH):
            part = keys[start : start + BATCH]
            found = await tier.lookup(part)
            assert found == len(part), found
        fastest = min(fastest, time.perf_counter() - started)
    return len(keys) / fastest


async def fill(root: Path, blocks: int, block_kib: int) -> dict[str, Any]:
    keys = the_keys(blocks)
    spec = kt.OffloadingSpec(block_nbytes=block_kib * 1024, num_cpu_blocks=BATCH, namespace=NAMESPACE)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    primary.view[:] = b"\x01" * len(primary.view)  # touched now: not counted as the index's
    gc.collect()
    gc.freeze()  # the start-up heap (torch and all) out of the collections, as vLLM's engine does
    pauses = GcPauses()
    before = rss_bytes()
    capacity = blocks * (block_kib * 1024 + 1024) * 2
    async with FileSystemTier(spec, primary.view, root=str(root), capacity_bytes=capacity) as tier:
        started = time.perf_counter()
        with LoopHold() as hold:
            gc.enable()  # held off by LoopHold; on here: its pauses hold the loop in serving too
            for start in range(0, blocks, BATCH):
                part = keys[start : start + BATCH]
                assert all(await tier.store(part, list(range(len(part)))))
        store_s = time.perf_counter() - started
        lookup_rate = await lookups_per_s(tier, keys)
        grown = rss_bytes() - before
        during_fill = max(pauses.longest)
        gc.collect()  # what the stores and lookups left freed first: not the index's pause
        pauses.longest = [0.0, 0.0, 0.0]
        for _ in range(3):
            gc.collect()
        out = {
            "blocks": blocks,
            "store_blocks_per_s": blocks / store_s,
            "lookup_blocks_per_s": lookup_rate,
            "rss_bytes_per_block": grown / blocks,
            "gc_full_pause_ms": pauses.longest[2] * 1e3,
            "gc_pause_during_fill_ms": during_fill * 1e3,
            "loop_hold_during_fill_ms": hold.longest_s * 1e3,
        }
        print(json.dumps(out), flush=True)
        sys.stdin.readline()  # the second process has measured: close
    return out


async def open_second(root: Path, blocks: int, block_kib: int) -> dict[str, Any]:
    keys = the_keys(blocks)
    spec = kt.OffloadingSpec(block_nbytes=block_kib * 1024, num_cpu_blocks=BATCH, namespace=NAMESPACE)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    primary.view[:] = b"\x01" * len(primary.view)
    gc.collect()
    before = rss_bytes()
    capacity = blocks * (block_kib * 1024 + 1024) * 2
    tier = FileSystemTier(spec, primary.view, root=str(root), capacity_bytes=capacity)
    started = time.perf_counter()
    found = await tier.lookup(keys[:1])  # opens the tier: its first call
    first_lookup_s = time.perf_counter() - started
    assert found == 1, found
    lookup_rate = await lookups_per_s(tier, keys)
    grown = rss_bytes() - before
    await tier.aclose()
    return {
        "open_first_lookup_s": first_lookup_s,
        "rss_bytes_per_block": grown / blocks,
        "lookup_blocks_per_s": lookup_rate,
    }


def child(role: str, root: Path, blocks: int, block_kib: int, code: Path | None) -> subprocess.Popen[str]:
    """This script in a new process, importing kvtier_async from `code` (None: as this one does)."""
    command = [sys.executable, __file__, "--role", role, "--root", str(root)]
    command += ["--blocks", str(blocks), "--block-kib", str(block_kib)]
    env = None if code is None else {**os.environ, "PYTHONPATH": str(code)}
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def one_size(
    blocks: int, block_kib: int, parent: Path | None, code: Path | None, label: str
) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="kvtier-index-scale-", dir=parent))
    try:
        writer = child("fill", root, blocks, block_kib, code)
        assert writer.stdin is not None and writer.stdout is not None
        wrote = json.loads(writer.stdout.readline())
        second = child("open", root, blocks, block_kib, code)
        seen = json.loads(second.communicate()[0])
        writer.stdin.write("\n")
        writer.stdin.flush()
        writer.wait()
        restarted = json.loads(child("open", root, blocks, block_kib, code).communicate()[0])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{label}: {blocks:,} blocks of {block_kib} KiB: "
        f"RSS/block {wrote['rss_bytes_per_block']:.0f} B (writer), "
        f"{seen['rss_bytes_per_block']:.0f} B (a second process); "
        f"open + first lookup (restarted) {restarted['open_first_lookup_s']:.2f} s; "
        f"lookups {wrote['lookup_blocks_per_s']:,.0f} blocks/s (writer), "
        f"{seen['lookup_blocks_per_s']:,.0f} (second); "
        f"stores {wrote['store_blocks_per_s']:,.0f} blocks/s; "
        f"longest gc pause: full collection {wrote['gc_full_pause_ms']:.1f} ms, "
        f"during the fill {wrote['gc_pause_during_fill_ms']:.1f} ms; "
        f"longest loop hold during the fill {wrote['loop_hold_during_fill_ms']:.0f} ms",
        flush=True,
    )
    return {"code": label, "block_kib": block_kib, "writer": wrote, "second": seen, "restarted": restarted}


def checkout(commit: str, into: Path) -> Path:
    """The kvtier_async package of `commit` of this repository, extracted under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "kvtier_async"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--block-kib", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None, help="where the roots are made (default: tmp)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--against", default=None, help="a commit of this repository to measure first, at each size"
    )
    parser.add_argument("--role", choices=["fill", "open"], help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role is None:
        with tempfile.TemporaryDirectory() as tmp:
            codes: list[tuple[Path | None, str]] = [(None, "this checkout")]
            if args.against:
                codes.insert(0, (checkout(args.against, Path(tmp)), f"commit {args.against}"))
            results = [
                one_size(blocks, args.block_kib, args.dir, code, label)
                for blocks in args.blocks
                for code, label in codes
            ]
        if args.json is not None:
            args.json.write_text(json.dumps(results, indent=1) + "\n")
        return
    (blocks,) = args.blocks
    work = fill if args.role == "fill" else open_second
    result = asyncio.run(work(args.root, blocks, args.block_kib))
    if args.role == "open":
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
