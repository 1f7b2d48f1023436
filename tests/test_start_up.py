"""A configuration that can never work fails the start-up (a cache's `async with`, a bare tier's
`start()`) with its `ConfigError`; a fault that may pass (a server down) starts degraded and
recovers, as on first use. Against a real file system, Redis server and S3 server."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import servers
import torch

import kvtier_async as kt
import kvtier_async.tiers.fs
import kvtier_async.tiers.object_store
import kvtier_async.tiers.redis_tier  # imported up front: a first import reads files
from kvtier_async.testing import make_key

BLOCK = 2 * 4096


def make_spec(tier: dict[str, Any]) -> kt.OffloadingSpec:
    return kt.OffloadingSpec(
        block_nbytes=BLOCK, num_cpu_blocks=4, namespace="start-up", secondary_tiers=[tier]
    )


def layers() -> list[torch.Tensor]:
    return [torch.zeros(4, BLOCK, dtype=torch.uint8)]


async def open_to_others(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    await asyncio.to_thread(root.mkdir, mode=0o700)
    await asyncio.to_thread(os.chmod, root, 0o777)
    return root


@pytest.mark.asyncio
async def test_a_cache_over_a_root_others_may_write_fails_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Attack/misconfiguration: an fs root of mode 0777 (anyone may swap our files); the cache
    # used to start, log "opening failed" and never store a byte.
    root = await open_to_others(tmp_path)
    cache = kt.TieredKVCache(make_spec({"type": "fs", "root": str(root)}), layers(), pin_memory=False)
    with pytest.raises(kt.ConfigError, match="written by group or others"):
        async with cache:
            pytest.fail("the cache started over a root others may write")
    assert all(tier.closed for tier in cache.tiers)
    assert "opening failed" not in caplog.text


@pytest.mark.asyncio
async def test_a_bare_tier_over_a_root_others_may_write_fails_at_start(tmp_path: Path) -> None:
    # Misconfiguration: the same root, a tier made by the factory and started on its own.
    root = await open_to_others(tmp_path)
    spec = make_spec({"type": "memory"})
    primary = kt.PrimaryTier(spec, pin_memory=False)
    tier = kt.SecondaryTierFactory.create_secondary_tier(
        {"type": "fs", "root": str(root)}, primary.view, spec
    )
    async with tier:
        with pytest.raises(kt.ConfigError, match="written by group or others"):
            await tier.start()
        assert tier.stats()["errors"] == 0  # not a fault that may pass: nothing to retry


@pytest.mark.asyncio
async def test_a_bucket_that_does_not_exist_fails_at_start(s3_server: servers.S3Server) -> None:
    # Misconfiguration: a bucket name with a typo; every store would fail for ever.
    tier = {
        "type": "s3",
        "bucket": "no-such-bucket-here",
        "endpoint": s3_server.endpoint,
        "allow_http": True,
        **servers.S3_CREDENTIALS,
    }
    cache = kt.TieredKVCache(make_spec(tier), layers(), pin_memory=False)
    with pytest.raises(kt.ConfigError, match="'no-such-bucket-here' does not exist") as raised:
        async with cache:
            pytest.fail("the cache started with a bucket that does not exist")
    assert servers.S3_CREDENTIALS["secret_access_key"] not in str(raised.value)


@pytest.mark.asyncio
async def test_a_404_that_is_not_no_such_bucket_starts_degraded() -> None:
    # Availability: a proxy in front of S3 answers 404 while its backend starts: only S3's own
    # NoSuchBucket means the bucket does not exist (obstore reports a LIST's 404 as a generic
    # error; a NotFoundError from any other call was taken for a missing bucket too).
    async def not_found(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                writer.write(
                    b"HTTP/1.1 404 Not Found\r\ncontent-type: text/plain\r\ncontent-length: 18\r\n\r\n"
                )
                writer.write(b"404 page not found")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    proxy = await asyncio.start_server(not_found, "127.0.0.1", 0)
    async with proxy:
        port = proxy.sockets[0].getsockname()[1]
        tier = {
            "type": "s3",
            "bucket": servers.S3_BUCKET,
            "endpoint": f"http://127.0.0.1:{port}",
            "allow_http": True,
            "max_retries": 0,
            **servers.S3_CREDENTIALS,
        }
        async with kt.TieredKVCache(make_spec(tier), layers(), pin_memory=False) as cache:
            assert cache.tiers[0].stats()["errors"] == 1  # the opening failed, counted: it will retry


@pytest.mark.asyncio
async def test_an_existing_bucket_starts(s3_server: servers.S3Server) -> None:
    tier = {
        "type": "s3",
        "bucket": servers.S3_BUCKET,
        "prefix": "start-up",
        "endpoint": s3_server.endpoint,
        "allow_http": True,
        **servers.S3_CREDENTIALS,
    }
    async with kt.TieredKVCache(make_spec(tier), layers(), pin_memory=False) as cache:
        assert await cache.store([make_key(1)], [0]) == 1
        await cache.flush()
        assert cache.tiers[0].stats()["errors"] == 0


@pytest.mark.asyncio
async def test_a_redis_server_down_at_start_degrades_then_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A fault that may pass: the server is down when the engine starts. The cache starts (the
    # tier's opening counted and logged), and the tier works once the server is up.
    caplog.set_level(logging.WARNING)
    server = servers.RedisServer(tmp_path / "redis")  # not started yet
    tier = {"type": "redis", "url": server.url, "timeout_s": 0.5}
    async with kt.TieredKVCache(make_spec(tier), layers(), pin_memory=False) as cache:
        redis_tier = cache.tiers[0]
        assert redis_tier.stats()["errors"] == 1
        assert "opening failed" in caplog.text
        await asyncio.to_thread(server.start)
        try:
            redis_tier.fault_breaker.streak = 10**9  # the test does not wait out a cool-down
            assert await redis_tier.store([make_key(2)], [0]) == [True]
            assert await redis_tier.load([make_key(2)], [1]) == [True]
        finally:
            await asyncio.to_thread(server.stop)


@pytest.mark.parametrize(
    ("tier", "match"),
    [
        ({"type": "redis", "url": "redis://h:notaport/0"}, "malformed"),
        ({"type": "redis", "url": "http://h/0"}, "redis://"),
        ({"type": "fs", "root": "/tmp/x", "secret_env": "KVTIER_NO_SUCH_VARIABLE"}, "is not set"),
        ({"type": "s3", "bucket": "b", "secret_file": "/nonexistent/secret"}, "cannot open"),
        (
            {"type": "s3", "bucket": "b", "endpoint": "https://AKIA:SECRETPW@127.0.0.1:9"},
            "carries credentials",
        ),
        ({"type": "redis", "url": "rediss://h:6380/0?protocol=3"}, "protocol="),
    ],
)
def test_malformed_urls_and_bad_secret_sources_fail_before_start(tier: dict[str, Any], match: str) -> None:
    # Misconfiguration caught even earlier: when the cache is made, before any I/O.
    with pytest.raises(kt.ConfigError, match=match):
        kt.TieredKVCache(make_spec(tier), layers(), pin_memory=False)
