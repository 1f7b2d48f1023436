"""RedisTier against real redis-server processes: standalone and a three-master Cluster."""

from __future__ import annotations

import asyncio
import logging
import mmap
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
import servers
import torch

import kvtier_async as kt
import kvtier_async.tiers.redis_tier  # imported up front: a first import reads files
from kvtier_async.testing import TierContractTests, make_key

pytestmark = servers.needs_redis


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.RedisServer]:
    server = servers.RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.RedisCluster]:
    cluster = servers.RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    cluster.start()
    yield cluster
    cluster.stop()


def raw_client(url: str) -> redis.asyncio.Redis:
    """A plain client, as another program would use; no driver info, so no metadata read on the loop."""
    return redis.asyncio.Redis.from_url(url, driver_info=None)


def fresh_prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"  # every test its own names on the shared server


class TestRedisTier(TierContractTests):
    capacity_kwarg = None  # the server's maxmemory policy decides

    @pytest.fixture
    def tier_config(self, redis_server: servers.RedisServer) -> dict[str, Any]:
        return {"type": "redis", "url": redis_server.url, "prefix": fresh_prefix()}


class TestRedisClusterTier(TierContractTests):
    capacity_kwarg = None

    @pytest.fixture
    def tier_config(self, redis_cluster: servers.RedisCluster) -> dict[str, Any]:
        return {"type": "redis", "url": redis_cluster.url, "cluster": True, "prefix": fresh_prefix()}


def make_tier(url: str, spec: kt.OffloadingSpec | None = None, **kwargs: Any) -> tuple[Any, kt.PrimaryTier]:
    spec = spec or kt.OffloadingSpec(block_nbytes=8192 + 100, num_cpu_blocks=16, namespace="redis-tests")
    primary = kt.PrimaryTier(spec, pin_memory=False)
    config = {"type": "redis", "url": url, "prefix": fresh_prefix(), **kwargs}
    return kt.SecondaryTierFactory.create_secondary_tier(config, primary.view, spec), primary


def fill(primary: kt.PrimaryTier, slots: list[int], seed: int) -> list[bytes]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for slot in slots:
        data = bytes(torch.randint(0, 256, (primary.block_nbytes,), generator=g, dtype=torch.uint8).tolist())
        primary.slot_view(slot)[:] = data
        out.append(data)
    return out


@pytest.mark.asyncio
async def test_a_value_changed_out_of_band_is_a_counted_miss(redis_server: servers.RedisServer) -> None:
    tier, primary = make_tier(redis_server.url)
    async with tier:
        keys = [make_key(i) for i in range(3)]
        fill(primary, [0, 1, 2], seed=1)
        assert await tier.store(keys, [0, 1, 2]) == [True] * 3
        raw = raw_client(redis_server.url)
        try:
            await raw.set(tier.value_name(keys[0]), b"garbage")
            value = await raw.get(tier.value_name(keys[1]))
            flipped = bytearray(value)
            flipped[-1] ^= 0xFF  # one bit of the payload
            await raw.set(tier.value_name(keys[1]), bytes(flipped))
        finally:
            await raw.aclose()
        assert await tier.load(keys, [3, 4, 5]) == [False, False, True]
        assert tier.stats()["corrupt_blocks"] == 2


@pytest.mark.asyncio
async def test_server_killed_and_restarted_same_tier_object(tmp_path: Path) -> None:
    server = servers.RedisServer(tmp_path / "redis")
    await asyncio.to_thread(server.start)
    try:
        tier, primary = make_tier(server.url, timeout_s=0.5)
        async with tier:
            keys = [make_key(i, b"k") for i in range(8)]
            payloads = fill(primary, list(range(8)), seed=2)
            assert await tier.store(keys, list(range(8))) == [True] * 8

            async def traffic(n: int) -> None:  # a stream of stores and loads, none may raise
                for i in range(n):
                    await tier.store([make_key(100 + i, b"s")], [i % 8])
                    await tier.load(keys[:2], [8, 9])

            stream = asyncio.ensure_future(traffic(200))
            await asyncio.sleep(0)
            await asyncio.to_thread(server.stop)  # mid-stream
            await asyncio.wait_for(stream, 60)  # a hang guard only; every call is bounded by timeout_s
            assert await tier.store([make_key(999)], [0]) == [False]
            assert await tier.load(keys, list(range(8, 16))) == [False] * 8
            assert tier.stats()["errors"] > 0
            # The same port, and empty: a restarted server may have lost everything.
            await asyncio.to_thread(server.start)
            assert await tier.load(keys[:1], [8]) == [False]
            assert await tier.store(keys, list(range(8))) == [True] * 8
            assert await tier.load(keys, list(range(8, 16))) == [True] * 8
            assert [bytes(primary.slot_view(s)) for s in range(8, 16)] == payloads
    finally:
        await asyncio.to_thread(server.stop)


@pytest.mark.asyncio
async def test_a_server_that_is_down_from_the_start_is_a_miss_then_recovers(tmp_path: Path) -> None:
    server = servers.RedisServer(tmp_path / "redis")  # not started yet
    tier, primary = make_tier(server.url, timeout_s=0.5)
    async with tier:
        fill(primary, [0], seed=3)
        assert await tier.store([make_key(0)], [0]) == [False]
        assert await tier.load([make_key(0)], [1]) == [False]
        assert await tier.lookup([make_key(0)]) == 0
        await asyncio.to_thread(server.start)
        try:
            assert await tier.store([make_key(0)], [0]) == [True]
            assert await tier.load([make_key(0)], [1]) == [True]
        finally:
            await asyncio.to_thread(server.stop)


@pytest.mark.asyncio
async def test_credentials_never_reach_logs_or_stats(caplog: pytest.LogCaptureFixture) -> None:
    url = f"redis://kvuser:s3cret-pa55@127.0.0.1:{servers.free_port()}/0"  # nothing listens there
    tier, _ = make_tier(url, timeout_s=0.3)
    caplog.set_level(logging.DEBUG)
    async with tier:
        assert await tier.store([make_key(0)], [0]) == [False]
        assert await tier.load([make_key(0)], [1]) == [False]
        stats = tier.stats()
    assert "s3cret-pa55" not in caplog.text
    assert "s3cret-pa55" not in repr(stats)
    assert stats["url"] == f"redis://kvuser:***@127.0.0.1:{url.rsplit(':', 1)[1]}"


@pytest.mark.asyncio
async def test_a_client_passed_in_is_not_closed(redis_server: servers.RedisServer) -> None:
    client = raw_client(redis_server.url)
    try:
        tier, primary = make_tier("redis://unused:1/0", client=client)
        async with tier:
            fill(primary, [0], seed=4)
            assert await tier.store([make_key(0)], [0]) == [True]
        assert await client.ping()  # still usable by its owner
    finally:
        await client.aclose()


def test_bad_config_is_refused_before_anything_starts() -> None:
    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=4)
    view = memoryview(bytearray(spec.primary_nbytes))
    for bad, message in [
        ({"url": "http://x"}, "redis://"),
        ({"cluster": "yes"}, "cluster"),
        ({"url": "unix:///tmp/r.sock", "cluster": True}, "unix socket"),
        ({"ttl_s": 0}, "ttl_s"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"max_connections": 0}, "max_connections"),
        ({"prefix": ""}, "prefix"),
    ]:
        with pytest.raises(kt.ConfigError, match=message):
            kt.SecondaryTierFactory.create_secondary_tier({"type": "redis", **bad}, view, spec)


def test_a_block_larger_than_redis_accepts_is_refused_at_construction() -> None:
    spec = kt.OffloadingSpec(block_nbytes=512 << 20, num_cpu_blocks=1)
    buffer = mmap.mmap(-1, spec.primary_nbytes)  # untouched pages cost nothing
    try:
        with pytest.raises(kt.ConfigError, match="larger than Redis accepts"):
            kt.SecondaryTierFactory.create_secondary_tier({"type": "redis"}, memoryview(buffer), spec)
    finally:
        buffer.close()


SHARER = textwrap.dedent(
    """
    import asyncio, sys, torch
    import kvtier_async as kt

    async def main(url, prefix):
        device = torch.arange(32 * 1024, dtype=torch.int32).reshape(32, 1024) * 7 + 3
        spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=16, namespace="shared",
                                 secondary_tiers=[{"type": "redis", "url": url, "prefix": prefix}])
        keys = kt.block_hashes(range(16 * 12), 16, namespace="shared")
        async with kt.TieredKVCache(spec, device) as cache:
            assert await cache.store(keys, list(range(12))) == 12
            await cache.flush()
            assert cache.stats()["tiers"]["redis"]["stored_blocks"] == 12

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


@pytest.mark.asyncio
async def test_two_processes_share_blocks_through_the_server(
    redis_server: servers.RedisServer, tmp_path: Path
) -> None:
    prefix = fresh_prefix()
    script = tmp_path / "sharer.py"
    await asyncio.to_thread(script.write_text, SHARER)
    process = await asyncio.create_subprocess_exec(sys.executable, str(script), redis_server.url, prefix)
    assert await process.wait() == 0
    expected = torch.arange(32 * 1024, dtype=torch.int32).reshape(32, 1024) * 7 + 3
    device = torch.zeros((32, 1024), dtype=torch.int32)
    spec = kt.OffloadingSpec(
        block_nbytes=4096,
        num_cpu_blocks=16,
        namespace="shared",
        secondary_tiers=[{"type": "redis", "url": redis_server.url, "prefix": prefix}],
    )
    keys = kt.block_hashes(range(16 * 12), 16, namespace="shared")
    async with kt.TieredKVCache(spec, device) as cache:
        assert await cache.lookup(keys) == 12
        assert await cache.load(keys, list(range(20, 32))) == 12
    assert torch.equal(device[20:32], expected[:12])
    # Another namespace sees none of it.
    other = kt.block_hashes(range(16 * 12), 16, namespace="other")
    spec_other = kt.OffloadingSpec(
        block_nbytes=4096,
        num_cpu_blocks=16,
        namespace="other",
        secondary_tiers=[{"type": "redis", "url": redis_server.url, "prefix": prefix}],
    )
    async with kt.TieredKVCache(spec_other, device) as cache:
        assert await cache.lookup(other) == 0


@pytest.mark.asyncio
async def test_a_stuck_server_is_a_miss_not_a_hang() -> None:
    async with servers.Blackhole() as stuck:
        tier, primary = make_tier(f"redis://127.0.0.1:{stuck.port}/0", timeout_s=0.3)
        async with tier:
            fill(primary, [0], seed=5)
            assert await tier.store([make_key(0)], [0]) == [False]
            assert await tier.load([make_key(0)], [1]) == [False]
            assert tier.stats()["errors"] >= 2


@pytest.mark.asyncio
async def test_a_unix_socket_url(tmp_path: Path) -> None:
    socket_path = tmp_path / "redis.sock"
    server = servers.RedisServer(tmp_path / "redis", None, "--unixsocket", str(socket_path))
    await asyncio.to_thread(server.start)
    try:
        tier, primary = make_tier(f"unix://{socket_path}")
        async with tier:
            payloads = fill(primary, [0, 1], seed=6)
            assert await tier.store([make_key(0), make_key(1)], [0, 1]) == [True, True]
            assert await tier.load([make_key(0), make_key(1)], [2, 3]) == [True, True]
            assert [bytes(primary.slot_view(s)) for s in (2, 3)] == payloads
    finally:
        await asyncio.to_thread(server.stop)
