"""ObjectStoreTier against a real S3-protocol server (moto in server mode, over HTTP on loopback)."""

from __future__ import annotations

import asyncio
import logging
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import obstore
import pytest
import servers
import torch
from obstore.store import S3Store

import kvtier_async as kt
import kvtier_async.tiers.object_store  # imported up front: a first import reads files
from kvtier_async.testing import TierContractTests, make_key

CREDENTIALS = {"access_key_id": "testing-key", "secret_access_key": "testing-secret-value"}


@pytest.fixture(scope="module")
def s3_server() -> Iterator[servers.S3Server]:
    server = servers.S3Server()
    server.start()
    server.create_bucket("kvtier-test")
    yield server
    server.stop()


def config(server: servers.S3Server, **kwargs: Any) -> dict[str, Any]:
    return {
        "type": "s3",
        "bucket": "kvtier-test",
        "prefix": f"test-{uuid.uuid4().hex[:12]}",  # every test its own names in the shared bucket
        "endpoint": server.endpoint,
        "allow_http": True,
        **CREDENTIALS,
        **kwargs,
    }


class TestObjectStoreTier(TierContractTests):
    capacity_kwarg = None  # the bucket's lifecycle rules decide

    @pytest.fixture
    def tier_config(self, s3_server: servers.S3Server) -> dict[str, Any]:
        return config(s3_server)


def make_tier(tier_config: dict[str, Any]) -> tuple[Any, kt.PrimaryTier]:
    spec = kt.OffloadingSpec(block_nbytes=8192 + 100, num_cpu_blocks=16, namespace="s3-tests")
    primary = kt.PrimaryTier(spec, pin_memory=False)
    return kt.SecondaryTierFactory.create_secondary_tier(tier_config, primary.view, spec), primary


def fill(primary: kt.PrimaryTier, slots: list[int], seed: int) -> list[bytes]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for slot in slots:
        data = bytes(torch.randint(0, 256, (primary.block_nbytes,), generator=g, dtype=torch.uint8).tolist())
        primary.slot_view(slot)[:] = data
        out.append(data)
    return out


@pytest.mark.asyncio
async def test_an_object_changed_out_of_band_is_a_counted_miss(s3_server: servers.S3Server) -> None:
    tier, primary = make_tier(config(s3_server))
    async with tier:
        keys = [make_key(i) for i in range(3)]
        fill(primary, [0, 1, 2], seed=1)
        assert await tier.store(keys, [0, 1, 2]) == [True] * 3
        raw = S3Store(
            "kvtier-test",
            endpoint=s3_server.endpoint,
            region="us-east-1",
            client_options={"allow_http": True},
            **CREDENTIALS,
        )
        await obstore.put_async(raw, tier.object_name(keys[0]), b"garbage")
        value = bytearray(await (await obstore.get_async(raw, tier.object_name(keys[1]))).bytes_async())
        value[-1] ^= 0xFF  # one bit of the payload
        await obstore.put_async(raw, tier.object_name(keys[1]), bytes(value))
        assert await tier.load(keys, [3, 4, 5]) == [False, False, True]
        assert tier.stats()["corrupt_blocks"] == 2


@pytest.mark.asyncio
async def test_server_killed_and_restarted_same_tier_object() -> None:
    server = servers.S3Server()
    await asyncio.to_thread(server.start)
    await asyncio.to_thread(server.create_bucket, "kvtier-test")
    try:
        tier, primary = make_tier(config(server, timeout_s=0.5, max_retries=2))
        async with tier:
            keys = [make_key(i, b"k") for i in range(8)]
            payloads = fill(primary, list(range(8)), seed=2)
            assert await tier.store(keys, list(range(8))) == [True] * 8

            async def traffic(n: int) -> None:  # a stream of stores and loads, none may raise
                for i in range(n):
                    await tier.store([make_key(100 + i, b"s")], [i % 8])
                    await tier.load(keys[:2], [8, 9])

            stream = asyncio.ensure_future(traffic(10))
            await asyncio.sleep(0)
            await asyncio.to_thread(server.stop)  # mid-stream
            await asyncio.wait_for(stream, 120)  # a hang guard only; every call is bounded by timeout_s
            assert await tier.store([make_key(999)], [0]) == [False]
            assert await tier.load(keys, list(range(8, 16))) == [False] * 8
            assert tier.stats()["errors"] > 0
            # The same port, and empty: a restarted server may have lost everything.
            await asyncio.to_thread(server.start)
            await asyncio.to_thread(server.create_bucket, "kvtier-test")
            assert await tier.load(keys[:1], [8]) == [False]
            assert await tier.store(keys, list(range(8))) == [True] * 8
            assert await tier.load(keys, list(range(8, 16))) == [True] * 8
            assert [bytes(primary.slot_view(s)) for s in range(8, 16)] == payloads
    finally:
        await asyncio.to_thread(server.stop)


@pytest.mark.asyncio
async def test_credentials_never_reach_logs_or_stats(caplog: pytest.LogCaptureFixture) -> None:
    endpoint = f"http://127.0.0.1:{servers.free_port()}"  # nothing listens there
    tier_config = {
        "type": "s3",
        "bucket": "kvtier-test",
        "endpoint": endpoint,
        "allow_http": True,
        "access_key_id": "AKIDSECRETID",
        "secret_access_key": "very-secret-key-material",
        "timeout_s": 0.3,
        "max_retries": 1,
    }
    tier, _ = make_tier(tier_config)
    caplog.set_level(logging.DEBUG)
    async with tier:
        assert await tier.store([make_key(0)], [0]) == [False]
        assert await tier.load([make_key(0)], [1]) == [False]
        stats = tier.stats()
    assert stats["errors"] > 0
    for secret in ("very-secret-key-material",):
        assert secret not in caplog.text
        assert secret not in repr(stats)


def test_bad_config_is_refused_before_anything_starts() -> None:
    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=4)
    view = memoryview(bytearray(spec.primary_nbytes))
    for bad, message in [
        ({}, "bucket"),
        ({"bucket": "kvtier-test", "endpoint": "http://127.0.0.1:9"}, "allow_http"),
        ({"bucket": "kvtier-test", "access_key_id": "only-one"}, "both"),
        ({"bucket": "kvtier-test", "timeout_s": 0}, "timeout_s"),
        ({"bucket": "kvtier-test", "max_retries": -1}, "max_retries"),
        ({"bucket": "kvtier-test", "prefix": "/abs"}, "prefix"),
    ]:
        with pytest.raises((kt.ConfigError, TypeError), match=message):
            kt.SecondaryTierFactory.create_secondary_tier({"type": "s3", **bad}, view, spec)


SHARER = textwrap.dedent(
    """
    import asyncio, sys, torch
    import kvtier_async as kt

    async def main(endpoint, prefix):
        device = torch.arange(32 * 1024, dtype=torch.int32).reshape(32, 1024) * 5 + 1
        tier = {"type": "s3", "bucket": "kvtier-test", "prefix": prefix, "endpoint": endpoint,
                "allow_http": True, "access_key_id": "testing-key",
                "secret_access_key": "testing-secret-value"}
        spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=16, namespace="shared",
                                 secondary_tiers=[tier])
        keys = kt.block_hashes(range(16 * 12), 16, namespace="shared")
        async with kt.TieredKVCache(spec, device) as cache:
            assert await cache.store(keys, list(range(12))) == 12
            await cache.flush()
            assert cache.stats()["tiers"]["s3"]["stored_blocks"] == 12

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


@pytest.mark.asyncio
async def test_two_processes_share_blocks_through_the_bucket(
    s3_server: servers.S3Server, tmp_path: Path
) -> None:
    tier_config = config(s3_server)
    script = tmp_path / "sharer.py"
    await asyncio.to_thread(script.write_text, SHARER)
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(script), s3_server.endpoint, tier_config["prefix"]
    )
    assert await process.wait() == 0
    expected = torch.arange(32 * 1024, dtype=torch.int32).reshape(32, 1024) * 5 + 1
    device = torch.zeros((32, 1024), dtype=torch.int32)
    spec = kt.OffloadingSpec(
        block_nbytes=4096, num_cpu_blocks=16, namespace="shared", secondary_tiers=[tier_config]
    )
    keys = kt.block_hashes(range(16 * 12), 16, namespace="shared")
    async with kt.TieredKVCache(spec, device) as cache:
        assert await cache.lookup(keys) == 12
        assert await cache.load(keys, list(range(20, 32))) == 12
    assert torch.equal(device[20:32], expected[:12])


@pytest.mark.asyncio
async def test_a_stuck_server_is_a_miss_not_a_hang() -> None:
    async with servers.Blackhole() as stuck:
        endpoint = f"http://127.0.0.1:{stuck.port}"
        tier_config = {"type": "s3", "bucket": "kvtier-test", "endpoint": endpoint, "allow_http": True}
        tier, primary = make_tier({**tier_config, **CREDENTIALS, "timeout_s": 0.3, "max_retries": 1})
        async with tier:
            fill(primary, [0], seed=5)
            assert await tier.store([make_key(0)], [0]) == [False]
            assert await tier.load([make_key(0)], [1]) == [False]
            assert tier.stats()["errors"] >= 2
