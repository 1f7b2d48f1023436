"""A value far larger than a block under a tier's own name (another program's, or an attacker's)
is a counted miss, and reading it costs no more memory than a block: against a real Redis
server (both of the tier's read paths) and a real S3 server."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Any

import obstore
import pytest
import redis.asyncio
import servers
from obstore.store import S3Store

import kvtier_async as kt
import kvtier_async.tiers.object_store
import kvtier_async.tiers.redis_tier  # imported up front: a first import reads files
from kvtier_async.testing import make_key

BLOCK = 8 << 20
HUGE = 64 << 20
STATUS = Path("/proc/self/status")

pytestmark = pytest.mark.skipif(not STATUS.exists(), reason="measures memory through /proc/self")


def reset_peak() -> None:
    """Make the peak resident size (VmHWM) the current one (Linux, /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def resident() -> tuple[int, int]:
    """(current, peak) resident bytes of this process."""
    fields = dict(line.split(":", 1) for line in STATUS.read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10


async def peak_growth_of(load: Any) -> int:
    """How far the process's resident size peaked above where it was, while `load` ran."""
    await asyncio.to_thread(reset_peak)
    before, _ = await asyncio.to_thread(resident)
    await load
    _, peak = await asyncio.to_thread(resident)
    return peak - before


@pytest.fixture
def spec() -> kt.OffloadingSpec:
    return kt.OffloadingSpec(block_nbytes=BLOCK, num_cpu_blocks=2, namespace="oversized")


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["direct", "redis-py"])
async def test_redis_value_of_64_mib_is_a_bounded_miss(
    path: str, redis_server: servers.RedisServer, spec: kt.OffloadingSpec
) -> None:
    primary = kt.PrimaryTier(spec, pin_memory=False)
    raw = redis.asyncio.Redis.from_url(redis_server.url, driver_info=None)
    config: dict[str, Any] = {"type": "redis", "url": redis_server.url, "prefix": uuid.uuid4().hex}
    if path == "redis-py":
        config["client"] = redis.asyncio.Redis.from_url(redis_server.url, driver_info=None)
    key = make_key(1)
    async with kt.SecondaryTierFactory.create_secondary_tier(config, primary.view, spec) as tier:
        await tier.open()
        await raw.set(tier.value_name(key), os.urandom(1 << 20) * (HUGE >> 20))
        growth = await peak_growth_of(tier.load([key], [0]))
        assert tier.stats()["load_misses"] == 1
        assert tier.stats()["corrupt_blocks"] == 1
    await raw.aclose()
    if path == "redis-py":
        await config["client"].aclose()
    assert growth <= BLOCK + (4 << 20), f"reading a foreign {HUGE >> 20} MiB value grew the peak by {growth}"


@pytest.mark.asyncio
async def test_s3_object_of_64_mib_is_a_bounded_miss(
    s3_server: servers.S3Server, spec: kt.OffloadingSpec
) -> None:
    primary = kt.PrimaryTier(spec, pin_memory=False)
    prefix = f"oversized-{uuid.uuid4().hex[:12]}"
    config = {
        "type": "s3",
        "bucket": servers.S3_BUCKET,
        "prefix": prefix,
        "endpoint": s3_server.endpoint,
        "allow_http": True,
        **servers.S3_CREDENTIALS,
    }
    raw = S3Store(
        servers.S3_BUCKET,
        config={**servers.S3_CREDENTIALS, "endpoint": s3_server.endpoint, "region": "us-east-1"},
        client_options={"allow_http": True},
    )
    key = make_key(1)
    async with kt.SecondaryTierFactory.create_secondary_tier(config, primary.view, spec) as tier:
        await obstore.put_async(raw, tier.object_name(key), os.urandom(1 << 20) * (HUGE >> 20))
        await tier.open()
        growth = await peak_growth_of(tier.load([key], [0]))
        assert tier.stats()["load_misses"] == 1
        assert tier.stats()["corrupt_blocks"] == 1
    assert growth <= BLOCK + (4 << 20), f"reading a foreign {HUGE >> 20} MiB object grew the peak by {growth}"
