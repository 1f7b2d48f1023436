"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvtier_async.benchmark import LoopLag, median_tree, percentile
from kvtier_async.benchmark import drop_page_cache as drop_cache

__all__ = ["GB", "LoopLag", "drop_cache", "freeze_startup_heap", "median_tree", "percentile", "run", "timed"]

GB = 1e9


async def timed(work: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await work()
    return time.perf_counter() - started


def freeze_startup_heap() -> None:
    """Take what start-up left alive out of the garbage collector's way, as a serving process
    does (vLLM's engine core calls `gc.freeze()` after start-up; docs/production.md says why).

    With torch imported a process holds ~170,000 objects; a full collection walks them all,
    ~60-100 ms here with the GIL held, so whichever timed step allocates the 70,000th object
    since the last one stalls that long. Unfrozen, that lands on one step of a round and not
    on the next, and the benchmarks would measure the collector instead of the I/O.
    """
    gc.collect()
    gc.freeze()


def run(main: Callable[[], Awaitable[None]]) -> None:
    """Run on uvloop where available, as a serving frontend would, with the start-up heap frozen."""
    freeze_startup_heap()
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())  # type: ignore[arg-type]
        return
    uvloop.run(main())  # type: ignore[arg-type]
