"""A configuration that can never work fails the start-up (a cache's `async with`, a bare tier's
`async with` or `start()`) with its `ConfigError`; a fault that may pass (a server down) starts
degraded and recovers, as on first use. Against a real file system, Redis server (standalone and
Cluster), S3 server and Mooncake master."""

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


def bare_tier(config: dict[str, Any], block_nbytes: int = BLOCK) -> tuple[Any, kt.PrimaryTier]:
    """A tier made by the factory, as an engine integration or a user makes one on its own."""
    spec = kt.OffloadingSpec(
        block_nbytes=block_nbytes, num_cpu_blocks=4, namespace="start-up", secondary_tiers=[config]
    )
    primary = kt.PrimaryTier(spec, pin_memory=False)
    return kt.SecondaryTierFactory.create_secondary_tier(config, primary.view, spec), primary


async def plant(tmp_path: Path, how: str) -> tuple[Path, str]:
    """An fs root left as a misconfiguration or another local user would leave it; the
    message the start-up must fail with."""
    root = tmp_path / "root"
    if how == "a file":
        await asyncio.to_thread(root.write_bytes, b"")
        return root, "is not a directory"
    await asyncio.to_thread(root.mkdir, mode=0o700)
    if how == "open to others":
        await asyncio.to_thread(os.chmod, root, 0o777)
        return root, "written by group or others"
    if how == "another user's":
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        await asyncio.to_thread(os.chown, root, 65534, 65534)
        return root, "belongs to uid 65534"
    assert how == "a symlinked namespace", how
    tier, _ = bare_tier({"type": "fs", "root": str(root)})
    await tier.aclose()
    elsewhere = tmp_path / "elsewhere"
    await asyncio.to_thread(elsewhere.mkdir, mode=0o755)
    await asyncio.to_thread(tier.directory.symlink_to, elsewhere)
    return root, "not a plain directory"


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["open to others", "another user's", "a file", "a symlinked namespace"])
async def test_a_bare_fs_tier_over_a_planted_root_fails_at_async_with(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Misconfiguration / attack: the root is one the tier can never safely use. A tier used on
    # its own (no cache around it) used to start, log "opening failed" and store nothing.
    root, message = await plant(tmp_path, how)
    tier, _ = bare_tier({"type": "fs", "root": str(root)})
    with pytest.raises(kt.ConfigError, match=message):
        async with tier:
            pytest.fail("the tier started over a root it can never use")
    assert tier.closed  # closed by the failed start: nothing left for the caller to close
    assert tier.stats()["errors"] == 0  # not a fault that may pass: nothing to retry
    assert "opening failed" not in caplog.text
    if how == "a symlinked namespace":
        assert await asyncio.to_thread(os.listdir, tmp_path / "elsewhere") == []


@pytest.mark.asyncio
async def test_start_raises_the_config_error_again_while_the_tier_is_open(tmp_path: Path) -> None:
    # `start()` on a tier not yet open raises each time: the root is checked again, not remembered.
    root, message = await plant(tmp_path, "open to others")
    tier, _ = bare_tier({"type": "fs", "root": str(root)})
    try:
        for _ in range(2):
            with pytest.raises(kt.ConfigError, match=message):
                await tier.start()
        await asyncio.to_thread(os.chmod, root, 0o700)  # the operator fixes it
        await tier.start()
        assert await tier.store([make_key(1)], [0]) == [True]
    finally:
        await tier.aclose()


def small_values() -> tuple[str, ...]:
    """redis-server options: values of at most 1 MiB (its smallest `proto-max-bulk-len`)."""
    if servers.REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    return ("--proto-max-bulk-len", "1mb")


@pytest.mark.asyncio
@pytest.mark.parametrize("cluster", [False, True], ids=["standalone", "cluster"])
async def test_a_bare_redis_tier_whose_servers_take_smaller_values_fails_at_async_with(
    tmp_path: Path, cluster: bool
) -> None:
    # Misconfiguration: the server (or a Cluster's nodes) refuses values the size of a block:
    # every store would fail.
    if cluster:
        server: servers.RedisServer | servers.RedisCluster = servers.RedisCluster(
            tmp_path / "cluster", extra=small_values()
        )
    else:
        server = servers.RedisServer(tmp_path / "redis", None, *small_values())
    await asyncio.to_thread(server.start)
    try:
        config = {"type": "redis", "url": server.url, **({"cluster": True} if cluster else {})}
        tier, _ = bare_tier(config, block_nbytes=2 << 20)
        with pytest.raises(kt.ConfigError, match="proto-max-bulk-len"):
            async with tier:
                pytest.fail("the tier started against servers that refuse its blocks")
        assert tier.closed and tier.stats()["errors"] == 0
    finally:
        await asyncio.to_thread(server.stop)


@pytest.mark.asyncio
async def test_a_bare_s3_tier_over_a_bucket_that_does_not_exist_fails_at_async_with(
    s3_server: servers.S3Server,
) -> None:
    # Misconfiguration: a bucket name with a typo, a tier made on its own.
    tier, _ = bare_tier(
        {
            "type": "s3",
            "bucket": "no-such-bucket-here",
            "endpoint": s3_server.endpoint,
            "allow_http": True,
            **servers.S3_CREDENTIALS,
        }
    )
    with pytest.raises(kt.ConfigError, match="'no-such-bucket-here' does not exist") as raised:
        async with tier:
            pytest.fail("the tier started with a bucket that does not exist")
    assert servers.S3_CREDENTIALS["secret_access_key"] not in str(raised.value)
    assert tier.closed and tier.stats()["errors"] == 0


@pytest.mark.parametrize(
    ("tier", "match"),
    [
        ({"type": "memory", "capacity_bytes": 100}, "at least one block"),
        ({"type": "mooncake", "master": "no-port"}, "HOST:PORT"),
        ({"type": "fs", "root": "/nonexistent/kv", "secret_env": "KVTIER_NO_SUCH_VARIABLE"}, "is not set"),
        ({"type": "redis", "url": "redis://h:notaport/0"}, "malformed"),
        ({"type": "s3", "bucket": "b", "secret_file": "/proc/self/environ"}, "secret_file"),
    ],
)
def test_a_bare_tier_misconfigured_in_what_it_is_given_fails_when_made(
    tier: dict[str, Any], match: str
) -> None:
    # Misconfiguration the tier can tell without any I/O: raised when it is made, before `async
    # with` (the memory and Mooncake tiers have nothing else that can never work).
    with pytest.raises(kt.ConfigError, match=match):
        bare_tier(tier)


@pytest.mark.asyncio
async def test_a_bare_redis_tier_whose_server_is_down_at_async_with_degrades_then_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A fault that may pass: the server is down when the tier starts. `async with` does not
    # raise; the opening is counted and logged, and the tier works once the server is up.
    if servers.REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    caplog.set_level(logging.WARNING)
    server = servers.RedisServer(tmp_path / "redis")  # not started yet
    tier, primary = bare_tier({"type": "redis", "url": server.url, "timeout_s": 0.5})
    async with tier:
        assert tier.stats()["errors"] == 1
        assert "opening failed" in caplog.text
        await asyncio.to_thread(server.start)
        try:
            tier.fault_breaker.streak = 10**9  # the test does not wait out a cool-down
            primary.slot_view(0)[:] = bytes(range(256)) * (BLOCK // 256)
            assert await tier.store([make_key(2)], [0]) == [True]
            assert await tier.load([make_key(2)], [1]) == [True]
            assert bytes(primary.slot_view(1)) == bytes(primary.slot_view(0))
        finally:
            await asyncio.to_thread(server.stop)


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
