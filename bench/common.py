"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kvtier_async.benchmark import secret_ratios
from kvtier_async.measure import (
    LoopLag,
    freeze_startup_heap,
    median_bounds,
    median_tree,
    percentile,
    taking_turns,
)
from kvtier_async.measure import drop_page_cache as drop_cache

__all__ = [
    "GB",
    "MIN_BLOCKS",
    "TIER_AGAINST_BASELINE",
    "LoopLag",
    "add_size_arguments",
    "block_count",
    "drop_cache",
    "freeze_startup_heap",
    "in_turn",
    "median_bounds",
    "median_tree",
    "paired_ratio",
    "percentile",
    "print_variants",
    "round_ratios",
    "run",
    "sealed_summary",
    "timed",
    "variant_rounds",
]

GB = 1e9
#: The fewest blocks a disk benchmark moves per round: with 16 blocks of 32 MiB (0.5 GiB) and 8
#: threads, each thread would move two, and one slow request would decide the round.
MIN_BLOCKS = 32
#: Which of the tier's throughputs is set against which of a baseline's (raw I/O, LMCache): a
#: load from a new tier against the baseline's second load, made at the same point of the sequence.
TIER_AGAINST_BASELINE = (
    ("store_gbps", "store_gbps"),
    ("load_gbps", "load_gbps"),
    ("fresh_load_gbps", "again_load_gbps"),
)
A = TypeVar("A")
B = TypeVar("B")
V = TypeVar("V")


def add_size_arguments(parser: argparse.ArgumentParser, gib: float, moved: str) -> None:
    """`--gib` (how many GiB `moved`, by default `gib`) and `--min-blocks`, read by `block_count`."""
    parser.add_argument("--gib", type=float, default=gib, help=f"bytes {moved}, in GiB (see --min-blocks)")
    parser.add_argument(
        "--min-blocks",
        type=int,
        default=MIN_BLOCKS,
        help=f"blocks per round, at least (default {MIN_BLOCKS})",
    )


def block_count(gib: float, block_nbytes: int, min_blocks: int = MIN_BLOCKS) -> int:
    """How many blocks of `block_nbytes` a round moves: `gib` GiB of them, and at least `min_blocks`."""
    return max(min_blocks, int(gib * (1 << 30)) // block_nbytes)


def paired_ratio(
    ours: list[dict[str, Any]], baseline: list[dict[str, Any]], key: str, base_key: str
) -> float:
    """The median over rounds of ours[key] / baseline[base_key], round by round.

    Both sides of a round run back to back from the same memory, so what changes between rounds
    (where that memory's pages lie, the disk's drift) cancels within a round's ratio; a ratio
    of the two sides' medians could set one round's memory against another's."""
    return statistics.median(round_ratios(ours, baseline, key, base_key))


def round_ratios(
    ours: list[dict[str, Any]], baseline: list[dict[str, Any]], key: str, base_key: str
) -> list[float]:
    """Each round's ours[key] / baseline[base_key]."""
    return [a[key] / b[base_key] for a, b in zip(ours, baseline, strict=True)]


async def variant_rounds(
    variants: list[tuple[str, V]], repeat: int, measure: Callable[[V], Awaitable[dict[str, Any]]]
) -> dict[str, list[dict[str, Any]]]:
    """Per variant name, its `measure` results (`measure_tier`'s) in `repeat` rounds, every
    variant once a round, each going first in turn; exits if a variant loaded wrong bytes."""
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in variants}
    for r in range(repeat):
        for name, value in taking_turns(variants, r):
            out = await measure(value)
            if not out["exact"]:
                sys.exit(f"{name}: the blocks loaded were not the blocks stored")
            rounds[name].append(out)
    return rounds


def sealed_summary(rounds: dict[str, list[dict[str, Any]]], unsealed: str) -> dict[str, dict[str, float]]:
    """Per variant of a tier (`measure_tier` results, round by round): the medians of its GB/s,
    of each round's ratio to the `unsealed` variant's in the same round, and of loop-lag p99."""
    out = {}
    for name, runs in rounds.items():
        medians, ratios = median_tree(runs), secret_ratios(runs, rounds[unsealed])
        row = {"lag_p99_ms": medians["loop_lag"]["p99_ms"]}
        for side in ("store", "load"):
            row[f"{side}_gbps"] = medians[side]["gbps"]
            row[f"{side}_ratio"] = ratios[f"secret_{side}_ratio"]
        out[name] = row
    return out


def print_variants(title: str, summary: dict[str, dict[str, float]]) -> None:
    """`sealed_summary`'s rows, a line each, under `title`."""
    print(f"{title}:")
    width = max(map(len, summary))
    for name, row in summary.items():
        print(
            f"  {name:{width}} store {row['store_gbps']:.2f} GB/s {row['store_ratio']:.2f}x"
            f"  load {row['load_gbps']:.2f} GB/s {row['load_ratio']:.2f}x"
            f"  loop lag p99 {row['lag_p99_ms']:.2f} ms",
            flush=True,
        )


async def timed(work: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await work()
    return time.perf_counter() - started


async def in_turn(
    attempt: int, ours: Callable[[], Awaitable[A]], baseline: Callable[[], Awaitable[B]]
) -> tuple[A, B]:
    """Both results; ours runs first in even attempts, the baseline in odd ones, so that neither
    always gets the fresher disk (the first timed write after a round's set-up is the slower).
    Run an even number of attempts: with an odd one, one side goes first once more."""
    if attempt % 2:
        second = await baseline()
        return await ours(), second
    first = await ours()
    return first, await baseline()


def run(main: Callable[[], Awaitable[None]]) -> None:
    """Run on uvloop where available, as a serving frontend would, with the start-up heap frozen.
    SIGTERM cancels `main`, so that its `finally` blocks stop the servers it started (they would
    outlive it otherwise), then the process exits with 143 as one killed by SIGTERM would."""
    freeze_startup_heap()
    try:
        import uvloop
    except ImportError:
        runner: Callable[[Any], Any] = asyncio.run
    else:
        runner = uvloop.run
    terminated: list[bool] = []
    try:
        runner(_cancelled_by_sigterm(main, terminated))
    except asyncio.CancelledError:
        if not terminated:
            raise
        sys.exit(128 + signal.SIGTERM)


async def _cancelled_by_sigterm(main: Callable[[], Awaitable[None]], terminated: list[bool]) -> None:
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None  # a coroutine run by asyncio.run runs in a task

    def terminate() -> None:
        terminated.append(True)
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, terminate)
    try:
        await main()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
