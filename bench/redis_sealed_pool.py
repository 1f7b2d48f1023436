"""How large the sealed Redis tier's pool should be: its throughput at each pool size.

    python bench/redis_sealed_pool.py --pool-mib 32 64 256 --block-kib 1024 8192 --repeat 10

The Redis tier (a local redis-server, started as the tests start them) without a secret,
then with a tier secret and each `--pool-mib` as its `SEALED_POOL_BYTES`, the pool's cap (it
still holds at least `SEALED_POOL_VALUES` values), in the same rounds, the order rotating from
round to round. Each round stores `--mib` MiB of random blocks and loads them back
(`kvtier bench`'s measurement of one tier, requests of 8 blocks); the table gives, per
variant, the medians of its store and load GB/s, of its ratio to the unsealed tier's in the
same round, and of the event loop's p99 lag (a 1 ms ticker) during the store and the load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

from common import print_variants, run, sealed_summary, variant_rounds

import kvtier_async.tiers.redis_tier as redis_tier
from kvtier_async.benchmark import measure_tier

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import servers  # the test suite's server helpers: one way to start them

SECRET_ENV = "KVTIER_REDIS_POOL_BENCH"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool-mib", type=int, nargs="+", default=[32, 64, 256])
    parser.add_argument("--block-kib", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--mib", type=int, default=256, help="MiB stored and loaded per variant and round")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    os.environ[SECRET_ENV] = os.urandom(32).hex()  # a fresh secret, never on the command line
    variants: list[tuple[str, int | None]] = [("unsealed", None)]
    variants += [(f"sealed, pool cap {mib} MiB", mib) for mib in args.pool_mib]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-redis-pool-") as work:
        redis = servers.RedisServer(Path(work) / "redis")
        await asyncio.to_thread(redis.start)

        async def measure(kib: int, blocks: int, pool_mib: int | None) -> dict[str, Any]:
            config: dict[str, Any] = {"type": "redis", "url": redis.url}
            if pool_mib is not None:
                config["secret_env"] = SECRET_ENV
                # Read when the tier opens, inside measure_tier: this variant's pool.
                redis_tier.SEALED_POOL_BYTES = pool_mib << 20
            return await measure_tier(config, kib << 10, blocks, 8, "pool")

        try:
            for kib in args.block_kib:
                blocks = max(8, (args.mib << 10) // kib)
                rounds = await variant_rounds(variants, args.repeat, partial(measure, kib, blocks))
                results[f"{kib} KiB"] = sealed_summary(rounds, "unsealed")
                print_variants(f"{blocks} x {kib} KiB blocks, {args.repeat} rounds", results[f"{kib} KiB"])
        finally:
            await asyncio.to_thread(redis.stop)
    if args.json:
        args.json.write_text(json.dumps(results))


if __name__ == "__main__":
    run(main)
