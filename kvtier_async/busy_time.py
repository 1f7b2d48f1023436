"""`BusyTime`: how long a tier was busy storing and loading, and how long each call took.

A direction is busy while at least one call of it is in flight: throughput is bytes over
busy seconds, so that idle time between calls does not count, and overlapping calls count
once. Each call's latency goes into a histogram as well.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from .latency import LatencyHistogram

__all__ = ["BusyTime"]


class BusyTime:
    """Busy seconds and call latencies per direction ("store", "load")."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"store": 0.0, "load": 0.0}
        #: Latency of each call, whether or not metrics are exported.
        self.latency = {"store": LatencyHistogram(), "load": LatencyHistogram()}
        # Per direction: calls in flight, and when the current busy period began.
        self._running: dict[str, list[float]] = {"store": [0, 0.0], "load": [0, 0.0]}

    @contextmanager
    def call(self, direction: str) -> Iterator[None]:
        """One call of `direction`, timed."""
        running = self._running[direction]
        started = time.perf_counter()
        if running[0] == 0:
            running[1] = started
        running[0] += 1
        try:
            yield
        finally:
            now = time.perf_counter()
            self.latency[direction].observe(now - started)
            running[0] -= 1
            if running[0] == 0:
                self.seconds[direction] += now - running[1]
