"""Benchmark: what exporting Prometheus metrics costs on the hot path.

    python bench/metrics_overhead.py            # 20,000 small store + load calls, 3 interleaved rounds

The same memory-tier calls (one 4 KiB block each, one at a time, so per-call
overhead is all there is) with the tier unwatched, and watched by
`kvtier_async.metrics` with the registry scraped every second meanwhile (a
Prometheus server scrapes every 15 to 60 s). Reports calls per second and
how long one scrape takes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from common import median_tree, run
from prometheus_client import CollectorRegistry, generate_latest

import kvtier_async as kt
from kvtier_async.metrics import watch
from kvtier_async.testing import make_key


async def one_round(calls: int, watched: bool) -> dict[str, float]:
    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=64, namespace="metrics-bench")
    primary = kt.PrimaryTier(spec, pin_memory=False)
    tier = kt.SecondaryTierFactory.create_secondary_tier({"type": "memory"}, primary.view, spec)
    registry = CollectorRegistry()
    scrape_times: list[float] = []

    async def scraper() -> None:
        while True:
            await asyncio.sleep(1.0)
            started = time.perf_counter()
            generate_latest(registry)
            scrape_times.append(time.perf_counter() - started)

    async with tier:
        scraping = None
        if watched:
            watch(tier, registry)
            scraping = asyncio.ensure_future(scraper())
        started = time.perf_counter()
        for i in range(calls):
            await tier.store([make_key(i)], [i % 64])
            await tier.load([make_key(i)], [(i + 1) % 64])
        elapsed = time.perf_counter() - started
        if scraping is not None:
            scraping.cancel()
    scrape_ms = 1e3 * sum(scrape_times) / len(scrape_times) if scrape_times else 0.0
    return {"calls_per_s": 2 * calls / elapsed, "scrapes": float(len(scrape_times)), "scrape_ms": scrape_ms}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    plain, watched = [], []
    for _ in range(args.repeat):  # interleaved, so drifts hit both alike
        plain.append(await one_round(args.calls, watched=False))
        watched.append(await one_round(args.calls, watched=True))
    result = {"plain": median_tree(plain), "watched": median_tree(watched)}
    plain_rate, watched_ = result["plain"]["calls_per_s"], result["watched"]
    ratio = watched_["calls_per_s"] / plain_rate
    print(
        f"memory tier, one block per call: {plain_rate:.0f} calls/s unwatched, "
        f"{watched_['calls_per_s']:.0f} watched and scraped every second "
        f"({watched_['scrapes']:.0f} scrapes of {watched_['scrape_ms']:.2f} ms): {ratio:.3f}x"
    )
    if args.json:
        args.json.write_text(json.dumps({**result, "ratio": ratio}))


if __name__ == "__main__":
    run(main)
