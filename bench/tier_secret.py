"""What a tier secret costs: each persistent tier with and without one, in the same rounds.

    python bench/tier_secret.py --repeat 8 --json /tmp/tier_secret.json
    python bench/tier_secret.py --tiers redis --repeat 16   # one tier's ratio, in less time

`kvtier bench` on the fs tier (2 and 32 MiB blocks, in a temporary directory) and on the
Redis and S3 tiers (1 MiB blocks; a local redis-server and moto's S3 server, started here as
the tests start them). Each round measures the tier, its raw baseline and the same tier with
a tier secret (AES-256-GCM sealing and keyed names), taking turns at going first; the
"secret st/ld" column is the sealed tier's throughput as a ratio to the unsealed one's.
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

from kvtier_async.benchmark import BenchConfig, format_table, run_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import servers  # the test suite's server helpers: one way to start them

BUCKET = "kvtier-bench"
TIERS = ("fs", "redis", "s3")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB moved per tier and block size")
    parser.add_argument("--repeat", type=int, default=8)
    parser.add_argument("--tiers", nargs="+", choices=TIERS, default=list(TIERS), help="which tiers (all)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-secret-") as work:
        redis = servers.RedisServer(Path(work) / "redis")
        s3 = servers.S3Server()
        try:
            await asyncio.to_thread(redis.start)
            await asyncio.to_thread(s3.start)
            await asyncio.to_thread(s3.create_bucket, BUCKET)
            s3_tier = {
                "type": "s3",
                "bucket": BUCKET,
                "endpoint": s3.endpoint,
                "allow_http": True,
                "timeout_s": 30.0,
                **servers.S3_CREDENTIALS,
            }
            remote = [t for t in ({"type": "redis", "url": redis.url}, s3_tier) if t["type"] in args.tiers]
            for name, tiers, block_kib in (
                ("fs", [{"type": "fs"}] if "fs" in args.tiers else [], [2048, 32768]),
                ("remote", remote, [1024]),
            ):
                if not tiers:
                    continue
                config = BenchConfig(
                    secondary_tiers=tiers,
                    block_kib=block_kib,
                    mib_per_case=args.mib,
                    repeat=args.repeat,
                    directory=Path(work),
                    progress=False,
                )
                results[name] = await run_bench(config)
                print(format_table(results[name]), flush=True)
        finally:
            await asyncio.to_thread(redis.stop)
            await asyncio.to_thread(s3.stop)
    if args.json:
        args.json.write_text(json.dumps(results))


if __name__ == "__main__":
    run(main)
