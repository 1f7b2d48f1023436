"""ObjectStoreTier against a real S3-protocol server (moto in server mode, over HTTP on loopback)."""

from __future__ import annotations

import asyncio
import logging
import mmap
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import obstore
import pytest
import remote_scenarios as scenarios
import servers
from obstore.store import S3Store

import kvtier_async as kt
import kvtier_async.tiers.object_store  # imported up front: a first import reads files
from kvtier_async.testing import TierContractTests, make_key

BUCKET = servers.S3_BUCKET
CREDENTIALS = servers.S3_CREDENTIALS


def config(endpoint: str, **kwargs: Any) -> dict[str, Any]:
    return {
        "type": "s3",
        "bucket": BUCKET,
        "prefix": f"test-{uuid.uuid4().hex[:12]}",  # every test its own names in the shared bucket
        "endpoint": endpoint,
        "allow_http": True,
        **CREDENTIALS,
        **kwargs,
    }


class TestObjectStoreTier(TierContractTests):
    capacity_kwarg = None  # the bucket's lifecycle rules decide

    @pytest.fixture
    def tier_config(self, s3_server: servers.S3Server) -> dict[str, Any]:
        return config(s3_server.endpoint)


class TestObjectStoreTierSealed(TierContractTests):
    capacity_kwarg = None

    @pytest.fixture
    def tier_config(self, s3_server: servers.S3Server, tier_secret_env: str) -> dict[str, Any]:
        return config(s3_server.endpoint, secret_env=tier_secret_env)


@pytest.mark.asyncio
@pytest.mark.parametrize("limit", [{}, {"max_requests": 4}], ids=["defaults", "four-requests"])
async def test_256_callers_at_once_fail_nothing_for_our_own_reasons(
    s3_server: servers.S3Server, caplog: pytest.LogCaptureFixture, limit: dict[str, int]
) -> None:
    # A request per block: with four at the server, nearly every one waits its turn at the gate.
    stats = await scenarios.many_callers_at_once(config(s3_server.endpoint, **limit), caplog, rounds=2)
    assert stats["server_gate"]["max_inflight_seen"] <= stats["server_gate"]["limit"]
    if limit:
        assert stats["server_gate"]["waited_s"] > 0  # the queue was exercised


@pytest.mark.asyncio
async def test_a_batch_begins_no_more_requests_than_the_gate_lets_through(
    s3_server: servers.S3Server,
) -> None:
    # 8 blocks in one batch, two requests at the server: a block is begun once one of the
    # batch's requests ends, so none of them ever waits at the gate (each would hold a task,
    # coroutines and a waiter meanwhile), and every one is still written and read back.
    tier, primary = scenarios.make_tier(config(s3_server.endpoint, max_requests=2))
    async with tier:
        keys = [make_key(i, b"bounded") for i in range(8)]
        payloads = scenarios.fill(primary, list(range(8)), seed=3)
        assert await tier.store(keys, list(range(8))) == [True] * 8
        assert await tier.lookup_each(keys) == [True] * 8
        assert await tier.load(keys, list(range(8, 16))) == [True] * 8
        gate = tier.stats()["server_gate"]
        await tier.delete(keys)
    assert [bytes(primary.slot_view(8 + i)) for i in range(8)] == payloads
    assert gate["max_inflight_seen"] == 2 and gate["waited_s"] == 0


@pytest.mark.asyncio
async def test_an_object_changed_out_of_band_is_a_counted_miss(s3_server: servers.S3Server) -> None:
    tier, primary = scenarios.make_tier(config(s3_server.endpoint))
    async with tier:
        keys = [make_key(i) for i in range(3)]
        scenarios.fill(primary, [0, 1, 2], seed=1)
        assert await tier.store(keys, [0, 1, 2]) == [True] * 3
        options = {"allow_http": True}
        raw = S3Store(
            BUCKET, endpoint=s3_server.endpoint, region="us-east-1", client_options=options, **CREDENTIALS
        )
        await obstore.put_async(raw, tier.object_name(keys[0]), b"garbage")
        value = bytearray(await (await obstore.get_async(raw, tier.object_name(keys[1]))).bytes_async())
        value[-1] ^= 0xFF  # one bit of the payload
        await obstore.put_async(raw, tier.object_name(keys[1]), bytes(value))
        assert await tier.load(keys, [3, 4, 5]) == [False, False, True]
        assert tier.stats()["corrupt_blocks"] == 2


def start_with_bucket(server: servers.S3Server) -> None:
    """Start (or restart: a moto server comes back empty) and make the bucket."""
    server.start()
    server.create_bucket(BUCKET)


@pytest.fixture
def own_server() -> Iterator[servers.S3Server]:
    """An S3 server of the test's own, with the bucket, which it may stop and start again."""
    server = servers.S3Server()
    start_with_bucket(server)
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.asyncio
async def test_server_killed_and_restarted_same_tier_object(own_server: servers.S3Server) -> None:
    await scenarios.killed_and_restarted(
        config(own_server.endpoint, timeout_s=0.5, max_retries=2),
        stop=lambda: asyncio.to_thread(own_server.stop),
        start=lambda: asyncio.to_thread(start_with_bucket, own_server),
    )


@pytest.mark.asyncio
async def test_the_primary_memory_is_free_after_the_server_died(own_server: servers.S3Server) -> None:
    await scenarios.the_primary_memory_is_free_after_the_server_died(
        config(own_server.endpoint, timeout_s=0.5, max_retries=2),
        stop=lambda: asyncio.to_thread(own_server.stop),
    )


@pytest.mark.asyncio
async def test_a_stuck_server_is_a_miss_not_a_hang() -> None:
    async with servers.Blackhole() as stuck:
        endpoint = f"http://127.0.0.1:{stuck.port}"
        await scenarios.unreachable_is_a_counted_miss(config(endpoint, timeout_s=0.3, max_retries=1))


@pytest.mark.asyncio
async def test_a_stuck_server_is_soon_not_called() -> None:
    async with servers.Blackhole() as stuck:
        endpoint = f"http://127.0.0.1:{stuck.port}"
        await scenarios.a_dead_server_is_soon_not_called(config(endpoint, timeout_s=0.3, max_retries=1))


@pytest.mark.asyncio
async def test_credentials_never_reach_logs_or_stats(caplog: pytest.LogCaptureFixture) -> None:
    endpoint = f"http://127.0.0.1:{servers.free_port()}"  # nothing listens there
    caplog.set_level(logging.DEBUG)
    secret = {"access_key_id": "AKIDSECRETID", "secret_access_key": "very-secret-key-material"}
    stats = await scenarios.unreachable_is_a_counted_miss(
        config(endpoint, timeout_s=0.3, max_retries=1, **secret)
    )
    assert "very-secret-key-material" not in caplog.text
    assert "very-secret-key-material" not in repr(stats)


@pytest.mark.asyncio
async def test_two_processes_share_blocks_through_the_bucket(
    s3_server: servers.S3Server, tmp_path: Path
) -> None:
    await scenarios.shared_between_processes(config(s3_server.endpoint), tmp_path)


def test_bad_config_is_refused_before_anything_starts() -> None:
    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=4)
    view = memoryview(bytearray(spec.primary_nbytes))
    for bad, message in [
        ({}, "bucket"),
        ({"bucket": BUCKET, "endpoint": "http://127.0.0.1:9"}, "allow_http"),
        ({"bucket": BUCKET, "access_key_id": "only-one"}, "both"),
        ({"bucket": BUCKET, "timeout_s": 0}, "timeout_s"),
        ({"bucket": BUCKET, "max_retries": -1}, "max_retries"),
        ({"bucket": BUCKET, "prefix": "/abs"}, "prefix"),
    ]:
        with pytest.raises((kt.ConfigError, TypeError), match=message):
            kt.SecondaryTierFactory.create_secondary_tier({"type": "s3", **bad}, view, spec)


def test_a_block_too_large_for_one_put_is_refused() -> None:
    spec = kt.OffloadingSpec(block_nbytes=5 << 30, num_cpu_blocks=1)
    with mmap.mmap(-1, spec.primary_nbytes) as memory:  # never touched: no memory is used
        view = memoryview(memory)
        with pytest.raises(kt.ConfigError, match="5 GiB"):
            kt.SecondaryTierFactory.create_secondary_tier({"type": "s3", "bucket": BUCKET}, view, spec)
        view.release()


@pytest.mark.asyncio
async def test_throttling_answers_are_retried_within_the_deadline(s3_server: servers.S3Server) -> None:
    # S3 answers 503 SlowDown when a prefix is asked too fast. Every request's first attempt
    # here gets one: obstore backs off and retries, every call succeeds, nothing is counted failed.
    async with servers.ThrottlingProxy(s3_server.endpoint) as proxy:
        tier, primary = scenarios.make_tier(config(proxy.endpoint))
        async with tier:
            keys = [make_key(i, b"slow") for i in range(8)]
            payloads = scenarios.fill(primary, list(range(8)), seed=5)
            assert await tier.store(keys, list(range(8))) == [True] * 8
            assert await tier.lookup(keys) == 8
            assert await tier.load(keys, list(range(8, 16))) == [True] * 8
            assert [bytes(primary.slot_view(s)) for s in range(8, 16)] == payloads
            stats = tier.stats()
    assert proxy.throttled >= 3 * 8  # HEAD, PUT and GET of each block, at least once each
    assert (stats["errors"], stats["request_failures"]) == (0, 0)


@pytest.mark.asyncio
async def test_a_block_past_the_multipart_threshold_is_one_put(s3_server: servers.S3Server) -> None:
    # obstore's default turns a value past 5 MiB into a multipart upload: four requests for an
    # 8 MiB block, and parts left behind in the bucket when one is cut short. A block is one PUT.
    spec = kt.OffloadingSpec(block_nbytes=6 << 20, num_cpu_blocks=2, namespace="one-put")
    primary = kt.PrimaryTier(spec, pin_memory=False)
    async with servers.ThrottlingProxy(s3_server.endpoint, throttle="none") as proxy:
        tier = kt.SecondaryTierFactory.create_secondary_tier(config(proxy.endpoint), primary.view, spec)
        async with tier:
            payload = random.Random(8).randbytes(spec.block_nbytes)
            primary.slot_view(0)[:] = payload
            key = make_key(0, b"big")
            assert await tier.store([key], [0]) == [True]
            writes = [(method, path) for method, path in proxy.requests if method in ("PUT", "POST")]
            assert await tier.load([key], [1]) == [True]
            assert bytes(primary.slot_view(1)) == payload
    assert writes == [("PUT", f"/{BUCKET}/{tier.object_name(key)}")]


@pytest.mark.asyncio
async def test_a_server_that_keeps_throttling_fails_the_call_within_its_deadline(
    s3_server: servers.S3Server,
) -> None:
    async with servers.ThrottlingProxy(s3_server.endpoint, throttle="all") as proxy:
        tier, primary = scenarios.make_tier(config(proxy.endpoint, timeout_s=0.5, max_retries=2))
        async with tier:
            scenarios.fill(primary, [0], seed=6)
            assert await tier.store([make_key(0, b"slow")], [0]) == [False]
            assert await tier.load([make_key(0, b"slow")], [1]) == [False]
            stats = tier.stats()
    # each request: first try, 2 retries
    assert proxy.forwarded == 0 and proxy.throttled >= 3 * 3
    # the start-up's bucket check (an opening that failed: the tier starts degraded), the store's
    # write and the load (two requests that failed): each failed, none hung
    assert stats["errors"] == 3 and stats["request_failures"] == 2
