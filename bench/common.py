"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvtier_async.benchmark import LoopLag, freeze_startup_heap, median_tree, percentile
from kvtier_async.benchmark import drop_page_cache as drop_cache

__all__ = ["GB", "LoopLag", "drop_cache", "freeze_startup_heap", "median_tree", "percentile", "run", "timed"]

GB = 1e9


async def timed(work: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await work()
    return time.perf_counter() - started


def run(main: Callable[[], Awaitable[None]]) -> None:
    """Run on uvloop where available, as a serving frontend would, with the start-up heap frozen."""
    freeze_startup_heap()
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())  # type: ignore[arg-type]
        return
    uvloop.run(main())  # type: ignore[arg-type]
