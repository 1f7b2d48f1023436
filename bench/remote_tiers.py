"""Benchmark: RedisTier and ObjectStoreTier against the raw clients, same bytes, same concurrency.

    python bench/remote_tiers.py                          # starts redis-server and moto locally
    python bench/remote_tiers.py --blocks 256 --block-kib 1024 --repeat 3
    python bench/remote_tiers.py --redis-url redis://host:6379/0 --s3-endpoint http://host:9000

In one run, per tier, medians of --repeat interleaved rounds:
- tier: `tier.store` of every block in one call, then `tier.load` of every block
  (the tier adds the 4 KiB header, checksums and verifies them, and runs batches
  of `batch_blocks` under the scheduler's lanes);
- raw: the same bytes through the plain client at the same concurrency:
  redis-py pipelines of `batch_blocks` SET / GET, `max_inflight_*` of them at
  once; obstore `put_async` / `get_async`, `batch_blocks * max_inflight_*` at once.
Reported: GB/s of payload and tier/raw. Without --redis-url / --s3-endpoint the
script starts a local redis-server and a moto S3 server (as the tests do), so
these numbers measure loopback and the servers' own speed, not a network.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from common import GB, median_of, run

import kvtier_async as kt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import servers

CREDENTIALS = {"access_key_id": "testing-key", "secret_access_key": "testing-secret-value"}


async def timed(work: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await work()
    return time.perf_counter() - started


async def bounded_gather(limit: int, calls: list[Callable[[], Awaitable[Any]]]) -> list[Any]:
    gate = asyncio.Semaphore(limit)

    async def one(call: Callable[[], Awaitable[Any]]) -> Any:
        async with gate:
            return await call()

    return await asyncio.gather(*(one(call) for call in calls))


async def redis_raw(
    url: str, names: list[bytes], payloads: list[bytes], batch: int, inflight: int
) -> dict[str, float]:
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(url, max_connections=64, driver_info=None)
    groups = [range(i, min(i + batch, len(names))) for i in range(0, len(names), batch)]

    async def put(group: range) -> None:
        async with client.pipeline(transaction=False) as pipe:
            for i in group:
                pipe.set(names[i], payloads[i])
            await pipe.execute()

    async def get(group: range) -> None:
        async with client.pipeline(transaction=False) as pipe:
            for i in group:
                pipe.get(names[i])
            assert all(value is not None for value in await pipe.execute())

    try:
        store_s = await timed(lambda: bounded_gather(inflight, [lambda g=g: put(g) for g in groups]))
        load_s = await timed(lambda: bounded_gather(inflight, [lambda g=g: get(g) for g in groups]))
    finally:
        await client.aclose()
    return {"store_s": store_s, "load_s": load_s}


async def s3_raw(
    endpoint: str, names: list[str], payloads: list[bytes], concurrency: int
) -> dict[str, float]:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        "kvtier-bench",
        endpoint=endpoint,
        region="us-east-1",
        client_options={"allow_http": True},
        **CREDENTIALS,
    )

    async def get(name: str) -> None:
        await (await obstore.get_async(store, name)).bytes_async()

    puts = [lambda n=n, p=p: obstore.put_async(store, n, p) for n, p in zip(names, payloads)]
    store_s = await timed(lambda: bounded_gather(concurrency, puts))
    load_s = await timed(lambda: bounded_gather(concurrency, [lambda n=n: get(n) for n in names]))
    return {"store_s": store_s, "load_s": load_s}


async def through_tier(
    config: dict[str, Any], spec: kt.OffloadingSpec, keys: list[bytes]
) -> dict[str, float]:
    primary = kt.PrimaryTier(spec)
    for slot in range(spec.num_cpu_blocks):
        primary.slot_view(slot)[:] = os.urandom(spec.block_nbytes)
    tier = kt.SecondaryTierFactory.create_secondary_tier(config, primary.view, spec)
    slots = list(range(len(keys)))
    async with tier:
        await tier.lookup(keys[:1])  # open outside the timing
        store_s = await timed(lambda: tier.store(keys, slots))
        load_s = await timed(lambda: tier.load(keys, slots))
        stats = tier.stats()
        assert stats["stored_blocks"] == len(keys) and stats["load_hits"] == len(keys), stats
    return {"store_s": store_s, "load_s": load_s}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--block-kib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument(
        "--s3-endpoint", default=None, help="an http(s) endpoint with a bucket 'kvtier-bench'"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    block = args.block_kib * 1024
    spec = kt.OffloadingSpec(block_nbytes=block, num_cpu_blocks=args.blocks, namespace="bench")
    limits = spec.limits
    started: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-remote-") as work:
        redis_url, endpoint = args.redis_url, args.s3_endpoint
        if redis_url is None:
            server = servers.RedisServer(Path(work) / "redis", None, "--maxmemory", "0")
            await asyncio.to_thread(server.start)
            started.append(server)
            redis_url = server.url
        if endpoint is None:
            s3 = servers.S3Server()
            await asyncio.to_thread(s3.start)
            await asyncio.to_thread(s3.create_bucket, "kvtier-bench")
            started.append(s3)
            endpoint = s3.endpoint
        try:
            rows: dict[str, list[dict[str, float]]] = {"redis": [], "s3": []}
            for r in range(args.repeat):
                keys = [f"r{r}-{i}".encode().ljust(32, b"k") for i in range(args.blocks)]
                payloads = [os.urandom(block) for _ in range(args.blocks)]
                tier = await through_tier(
                    {"type": "redis", "url": redis_url, "prefix": f"bench{r}"}, spec, keys
                )
                raw = await redis_raw(
                    redis_url,
                    [f"raw{r}:{i}".encode() for i in range(args.blocks)],
                    payloads,
                    limits.batch_blocks,
                    limits.max_inflight_stores,
                )
                rows["redis"].append(summary(tier, raw, args.blocks * block))
                s3_config = {
                    "type": "s3",
                    "bucket": "kvtier-bench",
                    "prefix": f"bench{r}",
                    "endpoint": endpoint,
                    "allow_http": True,
                    "timeout_s": 30.0,
                    **CREDENTIALS,
                }
                tier = await through_tier(s3_config, spec, keys)
                raw = await s3_raw(
                    endpoint,
                    [f"raw{r}/{i}" for i in range(args.blocks)],
                    payloads,
                    limits.batch_blocks * limits.max_inflight_stores,
                )
                rows["s3"].append(summary(tier, raw, args.blocks * block))
                for name in rows:
                    print(
                        f"round {r + 1} {name}: "
                        + ", ".join(f"{k} {v:.2f}" for k, v in rows[name][-1].items())
                    )
        finally:
            for server in started:
                await asyncio.to_thread(server.stop)
    result = {name: median_of(runs) for name, runs in rows.items()}
    for name, numbers in result.items():
        print(
            f"{name:<5} {args.blocks} x {args.block_kib} KiB: "
            f"store tier {numbers['tier_store_gbps']:.2f} GB/s vs raw {numbers['raw_store_gbps']:.2f} "
            f"({numbers['store_ratio']:.2f}x); load tier {numbers['tier_load_gbps']:.2f} vs raw "
            f"{numbers['raw_load_gbps']:.2f} ({numbers['load_ratio']:.2f}x)"
        )
    if args.json:
        args.json.write_text(json.dumps(result))


def summary(tier: dict[str, float], raw: dict[str, float], nbytes: int) -> dict[str, float]:
    out = {
        "tier_store_gbps": nbytes / tier["store_s"] / GB,
        "raw_store_gbps": nbytes / raw["store_s"] / GB,
        "tier_load_gbps": nbytes / tier["load_s"] / GB,
        "raw_load_gbps": nbytes / raw["load_s"] / GB,
    }
    out["store_ratio"] = out["tier_store_gbps"] / out["raw_store_gbps"]
    out["load_ratio"] = out["tier_load_gbps"] / out["raw_load_gbps"]
    return out


if __name__ == "__main__":
    run(main)
