"""Benchmark: RedisTier and ObjectStoreTier next to the raw clients, through `kvtier bench`'s measurements.

    python bench/remote_tiers.py --repeat 3                  # starts redis-server and moto locally
    python bench/remote_tiers.py --tiers s3 --block-kib 8192 --repeat 10
    python bench/remote_tiers.py --redis-url redis://host:6379/0 --s3-endpoint http://host:9000

What `kvtier bench --tiers '[{"type": "redis", ...}, {"type": "s3", ...}]'` would
measure (each tier against redis-py pipelines / plain obstore PUT and GET of the
same bytes at the same concurrency, in the same run), with the servers started
here when no URL is given: a local redis-server and moto's S3 server, as the tests
start them. Those numbers measure loopback and the servers' own speed, not a network.
After the table, every round's event-loop lag (p99 / max) during the tier's store and load,
beside the raw client's in the same round, and whether the tier's max is within the goal
(at most 10 ms or 1.5x the raw client's max, whichever is more).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import run

from kvtier_async.benchmark import BenchConfig, format_lag_rounds, format_table, run_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import servers  # the test suite's server helpers: one way to start them

BUCKET = "kvtier-bench"
CREDENTIALS = {"access_key_id": "testing-key", "secret_access_key": "testing-secret-value"}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-kib", type=int, nargs="+", default=[1024])
    parser.add_argument("--mib", type=int, default=128, help="MiB moved per tier and block size")
    parser.add_argument("--request-blocks", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--tiers", nargs="+", choices=["redis", "s3"], default=["redis", "s3"])
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--s3-endpoint", default=None, help=f"http(s) endpoint with a bucket {BUCKET!r}")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    started: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-remote-") as work:
        try:
            redis_url, endpoint = args.redis_url, args.s3_endpoint
            if redis_url is None and "redis" in args.tiers:
                redis = servers.RedisServer(Path(work) / "redis")
                await asyncio.to_thread(redis.start)
                started.append(redis)
                redis_url = redis.url
            if endpoint is None and "s3" in args.tiers:
                s3 = servers.S3Server()
                await asyncio.to_thread(s3.start)
                started.append(s3)
                await asyncio.to_thread(s3.create_bucket, BUCKET)
                endpoint = s3.endpoint
            tiers = []
            if "redis" in args.tiers:
                tiers.append({"type": "redis", "url": redis_url})
            if "s3" in args.tiers:
                s3_tier = {
                    "type": "s3",
                    "bucket": BUCKET,
                    "endpoint": endpoint,
                    "allow_http": True,
                    "timeout_s": 30.0,
                }
                tiers.append(s3_tier | CREDENTIALS)
            config = BenchConfig(
                secondary_tiers=tiers,
                block_kib=args.block_kib,
                mib_per_case=args.mib,
                request_blocks=args.request_blocks,
                repeat=args.repeat,
                directory=Path(work),
                progress=False,
            )
            result = await run_bench(config)
        finally:
            for server in started:
                await asyncio.to_thread(server.stop)
    print(format_table(result))
    print()
    print(format_lag_rounds(result))
    if args.json:
        args.json.write_text(json.dumps(result))


if __name__ == "__main__":
    run(main)
