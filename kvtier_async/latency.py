"""`LatencyHistogram`: operation latencies in fixed buckets, cheap enough to keep always.

Recording is one bisect and two additions, so tiers keep one per direction
whether or not anyone exports metrics; `kvtier_async.metrics` reads them at
scrape time.
"""

from __future__ import annotations

from bisect import bisect_left

__all__ = ["BUCKETS_S", "LatencyHistogram"]

#: Upper bounds in seconds; one more bucket catches everything slower.
BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LatencyHistogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS_S) + 1)
        self.sum_s = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(BUCKETS_S, seconds)] += 1
        self.sum_s += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, observations at or below it) per bucket, "+Inf" last: Prometheus's shape."""
        out, total = [], 0
        for bound, n in zip([*map(str, BUCKETS_S), "+Inf"], self.counts):
            total += n
            out.append((bound, total))
        return out
