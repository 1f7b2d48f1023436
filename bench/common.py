"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import asyncio
import gc
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

GB = 1e9


def drop_cache(directory: Path) -> None:
    """Ask the kernel to forget the cached pages of every file under `directory`."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def timed(work: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await work()
    return time.perf_counter() - started


class LoopLag:
    """A 1 ms ticker: records how late each wake-up of the event loop comes.

    It also times the garbage collector's full (generation 2) collections in
    the same window: with torch imported one takes ~150 ms on these machines,
    and it stops every thread that wants the GIL, the event loop included.
    """

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.lags: list[float] = []
        self.full_gc_pauses: list[float] = []
        self._gc_started = 0.0
        self._task: asyncio.Task[None] | None = None

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.full_gc_pauses.append(time.perf_counter() - self._gc_started)

    async def _tick(self) -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(self.period)
            self.lags.append(max(0.0, time.perf_counter() - started - self.period))

    def __enter__(self) -> LoopLag:
        gc.callbacks.append(self._on_gc)
        self._task = asyncio.ensure_future(self._tick())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        gc.callbacks.remove(self._on_gc)

    def summary(self) -> dict[str, float]:
        lags = self.lags or [0.0]
        return {
            "p50_ms": percentile(lags, 0.50) * 1e3,
            "p99_ms": percentile(lags, 0.99) * 1e3,
            "max_ms": max(lags) * 1e3,
            "ticks": float(len(self.lags)),
            "full_gcs": float(len(self.full_gc_pauses)),
            "full_gc_max_ms": max(self.full_gc_pauses, default=0.0) * 1e3,
        }


def run(main: Callable[[], Awaitable[None]]) -> None:
    """Run on uvloop where available, as a serving frontend would."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())  # type: ignore[arg-type]
        return
    uvloop.run(main())  # type: ignore[arg-type]
