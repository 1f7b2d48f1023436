"""Instruments the benchmarks share: request timing, percentiles and medians of interleaved
rounds, the event loop's lag (`LoopLag`), a frozen start-up heap, a cold page cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = [
    "GB",
    "LoopLag",
    "drop_page_cache",
    "freeze_startup_heap",
    "median_bounds",
    "median_tree",
    "percentile",
    "rates",
    "taking_turns",
    "timed_requests",
]

GB = 1e9


def taking_turns(sides: Sequence[T], round_: int) -> list[T]:
    """`sides` in the order they run in round `round_`: each goes first in turn, so that none
    always gets the fresher (or the more tired) machine."""
    start = round_ % len(sides)
    return [*sides[start:], *sides[:start]]


def median_tree(runs: list[Any]) -> Any:
    """Runs of the same nested shape, merged: numbers by median, flags by all(), text from the first."""
    first = runs[0]
    if isinstance(first, dict):
        return {key: median_tree([run[key] for run in runs]) for key in first}
    if isinstance(first, bool):
        return all(runs)
    if isinstance(first, (int, float)):
        return statistics.median(runs)
    return first


def median_bounds(values: Sequence[float], confidence: float = 0.9) -> tuple[float, float, float]:
    """Bounds on the median of what `values` sample, assuming only that they are independent draws
    (rounds of one run): the k-th smallest and the k-th largest value, and the chance that the
    true median lies between them, 1 - 2 P(Binomial(n, 1/2) < k). k is the largest that keeps that
    chance at `confidence` or more, and at least 1 (the extremes), whose chance, 1 - 2**(1 - n),
    falls below `confidence` with fewer than 5 rounds: the caller shows the chance it got.

    With 8 rounds: the 2nd smallest and the 2nd largest (93%); with 6: the extremes (97%)."""
    if not values:
        raise ValueError("median_bounds: no values")
    if not 0 < confidence < 1:
        raise ValueError(f"median_bounds: confidence must lie between 0 and 1, got {confidence}")
    ordered, n = sorted(values), len(values)

    def chance(k: int) -> float:  # that the median lies between the k-th smallest and k-th largest
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / (1 << n)

    k = 1
    while k + 1 <= (n + 1) // 2 and chance(k + 1) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k], chance(k)


def percentile(values: list[float], q: float) -> float:
    """The value at quantile `q` (0..1) of `values`; 0 for none."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def rates(nbytes: int, blocks: int, seconds: float, latencies: list[float]) -> dict[str, float]:
    return {
        "gbps": nbytes / seconds / GB,
        "blocks_per_s": blocks / seconds,
        "p50_ms": percentile(latencies, 0.50) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
        "seconds": seconds,
    }


async def timed_requests(
    calls: list[Callable[[], Awaitable[Any]]], limit: int | None = None
) -> tuple[float, list[float]]:
    """Run every call at once (at most `limit` at a time); total seconds and each call's latency."""
    gate = asyncio.Semaphore(limit) if limit else None
    latencies: list[float] = []

    async def one(call: Callable[[], Awaitable[Any]]) -> None:
        if gate is not None:
            await gate.acquire()
        try:
            started = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - started)
        finally:
            if gate is not None:
                gate.release()

    started = time.perf_counter()
    await asyncio.gather(*(one(call) for call in calls))
    return time.perf_counter() - started, latencies


def freeze_startup_heap() -> None:
    """Take what start-up left alive out of the garbage collector's way, as a serving process
    does (vLLM's engine core calls `gc.freeze()` after start-up; docs/production.md says why).

    With torch imported a process holds ~170,000 objects; a full collection walks them all,
    ~60-100 ms on a small VM with the GIL held, so whichever timed step allocates the object
    that triggers it stalls that long, and a benchmark would measure the collector instead of
    the I/O.
    """
    gc.collect()
    gc.freeze()


def drop_page_cache(directory: Path) -> None:
    """Ask the kernel to forget the cached pages of every file under `directory` (blocking)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class LoopLag:
    """A 1 ms ticker: how late each wake-up of the event loop comes.

    It also times the garbage collector's full (generation 2) collections in
    the same window: with torch imported one takes ~150 ms on a small VM, and
    it stops every thread that wants the GIL, the event loop included. And it
    reads the CPU time the hypervisor stole from this VM in the window (Linux,
    10 ms resolution): a stolen CPU stalls the loop whatever the code does.
    And, per tick, how long the loop's thread waited for a CPU while it was
    ready to run (Linux schedstat): on a small machine shared with a server
    process that is most of the lag, and no code of the loop's can shorten it;
    the rest of the lag is the loop busy with its own work.

    `paused()` leaves out the harness's own work between the phases it measures.
    """

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.lags: list[float] = []
        self.cpu_waits: list[float] = []  # per tick, the loop thread's wait for a CPU (Linux)
        self.woke: list[float] = []  # when each wake-up came, seconds into the window
        self.full_gc_pauses: list[float] = []
        self._gc_started = 0.0
        self._task: asyncio.Task[None] | None = None
        self._window = (0.0, 0.0)  # (wall clock, stolen CPU seconds) at the start
        self._paused = 0  # pauses under way
        self._pauses_begun = 0  # a tick that saw this change overlapped a pause
        self.seconds = 0.0  # the window's wall time, pauses included
        self.stolen = 0.0

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif not self._paused:
            self.full_gc_pauses.append(time.perf_counter() - self._gc_started)

    async def _tick(self) -> None:
        try:  # procfs: never waits on a disk. Kept open: a read is then one syscall.
            schedstat = open("/proc/thread-self/schedstat", "rb", buffering=0)  # noqa: SIM115, ASYNC230
        except OSError:
            schedstat = None
        try:
            while True:
                started, waited = time.perf_counter(), _cpu_waited(schedstat)
                pauses = self._pauses_begun
                await asyncio.sleep(self.period)
                if self._paused or self._pauses_begun != pauses:
                    continue
                now = time.perf_counter()
                self.lags.append(max(0.0, now - started - self.period))
                self.cpu_waits.append(_cpu_waited(schedstat) - waited)
                self.woke.append(now - self._window[0])
        finally:
            if schedstat is not None:
                schedstat.close()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Count no tick that overlaps this block, nor a full collection that ends in it: for a
        harness's own work between the phases it measures (zeroing memory, dropping the page
        cache), which is not the lag of what it measures."""
        self._paused += 1
        self._pauses_begun += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __enter__(self) -> LoopLag:
        gc.callbacks.append(self._on_gc)
        self._window = (time.perf_counter(), _stolen_seconds())
        self._task = asyncio.ensure_future(self._tick())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        gc.callbacks.remove(self._on_gc)
        self.seconds = time.perf_counter() - self._window[0]
        self.stolen = _stolen_seconds() - self._window[1]

    def timeline(self, bucket: float = 0.01) -> list[tuple[float, float]]:
        """(start of the bucket in seconds, worst lag in it in ms) per `bucket` seconds with a tick."""
        worst: dict[int, float] = {}
        for at, lag in zip(self.woke, self.lags):
            n = int(at / bucket)
            worst[n] = max(worst.get(n, 0.0), lag)
        return [(n * bucket, lag * 1e3) for n, lag in sorted(worst.items())]

    def summary(self) -> dict[str, float]:
        return {
            "p50_ms": percentile(self.lags, 0.50) * 1e3,
            "p99_ms": percentile(self.lags, 0.99) * 1e3,
            "max_ms": max(self.lags, default=0.0) * 1e3,
            "cpu_wait_p99_ms": percentile(self.cpu_waits, 0.99) * 1e3,
            # The lag less the tick's wait for a CPU: what the loop's own work cost.
            "busy_p99_ms": percentile([max(0.0, lag - w) for lag, w in zip(self.lags, self.cpu_waits)], 0.99)
            * 1e3,
            "ticks": float(len(self.lags)),
            "full_gcs": float(len(self.full_gc_pauses)),
            "full_gc_max_ms": max(self.full_gc_pauses, default=0.0) * 1e3,
            "seconds": self.seconds,
            "stolen_ms": self.stolen * 1e3,
        }


def _cpu_waited(schedstat: Any) -> float:
    """Seconds the thread whose /proc/thread-self/schedstat is open as `schedstat` has waited for a
    CPU so far (its second field: time runnable but not running, in ns); 0 where unknown."""
    if schedstat is None:
        return 0.0
    try:
        schedstat.seek(0)
        return int(schedstat.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _stolen_seconds() -> float:
    """CPU time the hypervisor has stolen from this machine, all CPUs together (0 if unknown)."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0
