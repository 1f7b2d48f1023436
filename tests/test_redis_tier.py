"""RedisTier against real redis-server processes: standalone and a three-master Cluster."""

from __future__ import annotations

import asyncio
import logging
import mmap
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
import remote_scenarios as scenarios
import servers

import kvtier_async as kt
import kvtier_async.tiers.redis_tier  # imported up front: a first import reads files
from kvtier_async.testing import TierContractTests, make_key

pytestmark = servers.needs_redis


def config(url: str, **kwargs: Any) -> dict[str, Any]:
    # Every test its own names on the shared server.
    return {"type": "redis", "url": url, "prefix": f"test-{uuid.uuid4().hex[:12]}", **kwargs}


def raw_client(url: str) -> redis.asyncio.Redis:
    """A plain client, as another program would use; no driver info, so no metadata read on the loop."""
    return redis.asyncio.Redis.from_url(url, driver_info=None)


class TestRedisTier(TierContractTests):
    capacity_kwarg = None  # the server's maxmemory policy decides

    @pytest.fixture
    def tier_config(self, redis_server: servers.RedisServer) -> dict[str, Any]:
        return config(redis_server.url)


class TestRedisTierSealed(TierContractTests):
    capacity_kwarg = None

    @pytest.fixture
    def tier_config(self, redis_server: servers.RedisServer, tier_secret_env: str) -> dict[str, Any]:
        return config(redis_server.url, secret_env=tier_secret_env)


class TestRedisClusterTierSealed(TierContractTests):
    capacity_kwarg = None
    max_loop_hold_s = 0.020  # as the unsealed Cluster class below, for the same reasons

    @pytest.fixture
    def tier_config(self, redis_cluster: servers.RedisCluster, tier_secret_env: str) -> dict[str, Any]:
        return config(redis_cluster.url, cluster=True, secret_env=tier_secret_env)


class TestRedisClusterTier(TierContractTests):
    capacity_kwarg = None
    # redis-py carries a Cluster's blocks: what the sockets bring copied on the loop by asyncio's
    # streams, each value joined there into the bytes redis-py returns, in memory the kernel
    # supplies (page faults) on the loop's CPU time. A 64 x 1 MiB load held it 4-11 ms at a
    # stretch on 2 busy cores (10.9 ms with 706 page faults, once in 17 runs of the 4 tests).
    max_loop_hold_s = 0.020

    @pytest.fixture
    def tier_config(self, redis_cluster: servers.RedisCluster) -> dict[str, Any]:
        return config(redis_cluster.url, cluster=True)


@pytest.mark.asyncio
@pytest.mark.parametrize("limit", [{}, {"max_connections": 2}], ids=["defaults", "two-connections"])
async def test_256_callers_at_once_fail_nothing_for_our_own_reasons(
    redis_server: servers.RedisServer, caplog: pytest.LogCaptureFixture, limit: dict[str, int]
) -> None:
    # With two connections nearly every pipeline waits its turn at the gate: a wait, not a fault.
    stats = await scenarios.many_callers_at_once(config(redis_server.url, **limit), caplog)
    assert stats["server_gate"]["max_inflight_seen"] <= stats["server_gate"]["limit"]
    if limit:
        assert stats["server_gate"]["waited_s"] > 0  # the queue was exercised


@pytest.mark.asyncio
async def test_256_callers_at_once_on_a_cluster_fail_nothing_for_our_own_reasons(
    redis_cluster: servers.RedisCluster, caplog: pytest.LogCaptureFixture
) -> None:
    await scenarios.many_callers_at_once(config(redis_cluster.url, cluster=True, max_connections=2), caplog)


@pytest.mark.asyncio
async def test_a_long_reply_is_built_over_many_turns_of_the_loop(redis_server: servers.RedisServer) -> None:
    # COMMAND's reply (Redis 7: 240 commands, 11,000 elements), which a Cluster client reads on
    # its first call, lies whole in the socket's buffer: built in one turn it held the loop's
    # thread 12-18 ms. Here every turn's budget is spent by the turn's first step, so a parser
    # that builds within the budget yields between elements.
    from redis.asyncio.connection import Connection, ConnectionPool

    from kvtier_async.tiers.redis_client import AllowedNodes, client_options, guarded_connection_class
    from kvtier_async.turn_budget import TurnBudget

    allowed = AllowedNodes.of_url(redis_server.url, any_port=False)
    guarded = guarded_connection_class(Connection, allowed, lambda host, port: None, TurnBudget(seconds=0.0))
    options = {**client_options(), "driver_info": None}  # no package metadata read on the loop
    pool = ConnectionPool.from_url(redis_server.url, connection_class=guarded, **options)
    client = redis.asyncio.Redis.from_pool(pool)
    await client.ping()  # connected and greeted: what follows is the reply's parse
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.create_task(count_turns())
    try:
        commands = await client.execute_command("COMMAND")
    finally:
        counter.cancel()
        await client.aclose()
    assert len(commands) > 100
    assert turns > len(commands)  # built in one turn, or a few socket reads: a handful


@pytest.mark.asyncio
async def test_a_value_changed_out_of_band_is_a_counted_miss(redis_server: servers.RedisServer) -> None:
    tier, primary = scenarios.make_tier(config(redis_server.url))
    async with tier:
        keys = [make_key(i) for i in range(3)]
        scenarios.fill(primary, [0, 1, 2], seed=1)
        assert await tier.store(keys, [0, 1, 2]) == [True] * 3
        raw = raw_client(redis_server.url)
        try:
            await raw.set(tier.value_name(keys[0]), b"garbage")
            value = bytearray(await raw.get(tier.value_name(keys[1])))
            value[-1] ^= 0xFF  # one bit of the payload
            await raw.set(tier.value_name(keys[1]), bytes(value))
        finally:
            await raw.aclose()
        assert await tier.load(keys, [3, 4, 5]) == [False, False, True]
        assert tier.stats()["corrupt_blocks"] == 2


@pytest.mark.asyncio
async def test_a_changed_byte_anywhere_in_a_large_block_is_a_counted_miss(
    redis_server: servers.RedisServer,
) -> None:
    # A block past a MiB is checked a MiB at a time: a byte changed in its first piece or in its
    # last, short one is caught the same.
    spec = kt.OffloadingSpec(block_nbytes=(5 << 19) + 100, num_cpu_blocks=6, namespace="large-blocks")
    primary = kt.PrimaryTier(spec, pin_memory=False)
    tier = kt.SecondaryTierFactory.create_secondary_tier(config(redis_server.url), primary.view, spec)
    async with tier:
        keys = [make_key(i, b"large") for i in range(3)]
        payloads = [random.Random(i).randbytes(spec.block_nbytes) for i in range(3)]
        for slot, payload in enumerate(payloads):
            primary.slot_view(slot)[:] = payload
        assert await tier.store(keys, [0, 1, 2]) == [True] * 3
        raw = raw_client(redis_server.url)
        try:
            for key, at in [(keys[0], 4096 + 10), (keys[1], -1)]:  # the header is 4096 bytes
                value = bytearray(await raw.get(tier.value_name(key)))
                value[at] ^= 0x01
                await raw.set(tier.value_name(key), bytes(value))
        finally:
            await raw.aclose()
        assert await tier.load(keys, [3, 4, 5]) == [False, False, True]
        assert bytes(primary.slot_view(5)) == payloads[2]
        assert tier.stats()["corrupt_blocks"] == 2


@pytest.mark.asyncio
async def test_a_sealed_call_larger_than_its_pool_goes_through_in_parts(
    redis_server: servers.RedisServer, tier_secret_env: str
) -> None:
    # Sealed values pass through a pool of a few MiB (SEALED_POOL_BYTES): a call of more
    # blocks than it holds is sealed and sent, then read and opened, a part at a time, each
    # block at its own key's place.
    calls = 600
    spec = kt.OffloadingSpec(
        block_nbytes=8192,
        num_cpu_blocks=2 * calls,
        namespace="pool-parts",
        max_inflight_loads=1,
        max_inflight_stores=1,
    )
    primary = kt.PrimaryTier(spec, pin_memory=False)
    tier = kt.SecondaryTierFactory.create_secondary_tier(
        config(redis_server.url, secret_env=tier_secret_env), primary.view, spec
    )
    async with tier:
        keys = [make_key(i, b"parts") for i in range(calls)]
        payloads = [random.Random(i).randbytes(spec.block_nbytes) for i in range(calls)]
        for slot, payload in enumerate(payloads):
            primary.slot_view(slot)[:] = payload
        stored = await tier.write_blocks(keys[:-1], [primary.slot_view(s) for s in range(calls - 1)])
        assert stored == [True] * (calls - 1)
        slot_bytes = -(-tier.value_nbytes // 4096) * 4096  # a value's page-aligned slot
        assert tier.stats()["sealed_pool_bytes"] < calls * slot_bytes  # so: in parts
        into = [primary.slot_view(calls + s) for s in range(calls)]
        assert await tier.read_blocks(keys, into) == [True] * (calls - 1) + [False]  # the last: never stored
        assert [bytes(block) for block in into[:-1]] == payloads[:-1]
        assert tier.stats()["unauthenticated_blocks"] == 0


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[servers.RedisServer]:
    """A Redis server of the test's own, which it may stop and start again."""
    server = servers.RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.asyncio
async def test_server_killed_and_restarted_same_tier_object(own_server: servers.RedisServer) -> None:
    await scenarios.killed_and_restarted(
        config(own_server.url, timeout_s=0.5),
        stop=lambda: asyncio.to_thread(own_server.stop),
        start=lambda: asyncio.to_thread(own_server.start),
    )


@pytest.mark.asyncio
async def test_the_primary_memory_is_free_after_the_server_died(own_server: servers.RedisServer) -> None:
    await scenarios.the_primary_memory_is_free_after_the_server_died(
        config(own_server.url, timeout_s=0.5), stop=lambda: asyncio.to_thread(own_server.stop)
    )


@pytest.mark.asyncio
async def test_a_server_that_is_down_from_the_start_is_a_miss_then_recovers(tmp_path: Path) -> None:
    server = servers.RedisServer(tmp_path / "redis")  # not started yet
    tier, primary = scenarios.make_tier(config(server.url, timeout_s=0.5))
    async with tier:
        scenarios.fill(primary, [0], seed=3)
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
async def test_a_stuck_server_is_a_miss_not_a_hang() -> None:
    async with servers.Blackhole() as stuck:
        await scenarios.unreachable_is_a_counted_miss(
            config(f"redis://127.0.0.1:{stuck.port}/0", timeout_s=0.3)
        )


@pytest.mark.asyncio
async def test_a_stuck_server_is_soon_not_called() -> None:
    async with servers.Blackhole() as stuck:
        await scenarios.a_dead_server_is_soon_not_called(
            config(f"redis://127.0.0.1:{stuck.port}/0", timeout_s=0.3)
        )


@pytest.mark.asyncio
async def test_credentials_never_reach_logs_or_stats(caplog: pytest.LogCaptureFixture) -> None:
    port = servers.free_port()  # nothing listens there
    caplog.set_level(logging.DEBUG)
    stats = await scenarios.unreachable_is_a_counted_miss(
        config(f"redis://kvuser:s3cret-pa55@127.0.0.1:{port}/0", timeout_s=0.3)
    )
    assert "s3cret-pa55" not in caplog.text
    assert "s3cret-pa55" not in repr(stats)
    assert stats["url"] == f"redis://kvuser:***@127.0.0.1:{port}/0"


@pytest.mark.asyncio
async def test_a_server_down_is_counted_every_time_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    # Every call fails while the server is down: a traceback each time flooded the log (12 MB
    # in 3 s). Each kind of fault is logged once a minute; the counters count every one. (The
    # fault breaker, which would stop calling the server after a few, is held closed here.)
    caplog.set_level(logging.WARNING)
    tier, _primary = scenarios.make_tier(config(f"redis://127.0.0.1:{servers.free_port()}/0", timeout_s=0.3))
    tier.fault_breaker.streak = 10**9
    async with tier:
        for n in range(100):
            assert await tier.store([make_key(n)], [0]) == [False]
            assert await tier.load([make_key(n)], [1]) == [False]
            assert await tier.lookup([make_key(n)]) == 0
        stats = tier.stats()
    assert stats["errors"] >= 300
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(logged) <= 4, logged  # one per kind: opening, or each hook that failed


@pytest.mark.asyncio
@pytest.mark.parametrize("socket_buffer_bytes", [None, 64 << 10])
async def test_blocks_round_trip_at_any_send_buffer(
    redis_server: servers.RedisServer, socket_buffer_bytes: int | None
) -> None:
    tier, primary = scenarios.make_tier(config(redis_server.url, socket_buffer_bytes=socket_buffer_bytes))
    async with tier:
        keys = [make_key(i, b"sndbuf") for i in range(8)]
        payloads = scenarios.fill(primary, list(range(8)), seed=8)
        assert await tier.store(keys, list(range(8))) == [True] * 8
        assert await tier.load(keys, list(range(8, 16))) == [True] * 8
        assert [bytes(primary.slot_view(s)) for s in range(8, 16)] == payloads


@pytest.mark.asyncio
async def test_a_unix_socket_url(tmp_path: Path) -> None:
    socket_path = tmp_path / "redis.sock"
    server = servers.RedisServer(tmp_path / "redis", None, "--unixsocket", str(socket_path))
    await asyncio.to_thread(server.start)
    try:
        tier, primary = scenarios.make_tier(config(f"unix://{socket_path}"))
        async with tier:
            payloads = scenarios.fill(primary, [0, 1], seed=6)
            assert await tier.store([make_key(0), make_key(1)], [0, 1]) == [True, True]
            assert await tier.load([make_key(0), make_key(1)], [2, 3]) == [True, True]
            assert [bytes(primary.slot_view(s)) for s in (2, 3)] == payloads
    finally:
        await asyncio.to_thread(server.stop)


@pytest.mark.asyncio
async def test_a_client_passed_in_is_not_closed(redis_server: servers.RedisServer) -> None:
    client = raw_client(redis_server.url)
    try:
        tier, primary = scenarios.make_tier(config("redis://unused:1/0", client=client))
        async with tier:
            scenarios.fill(primary, [0], seed=4)
            assert await tier.store([make_key(0)], [0]) == [True]
        assert await client.ping()  # still usable by its owner
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_two_processes_share_blocks_through_the_server(
    redis_server: servers.RedisServer, tmp_path: Path
) -> None:
    await scenarios.shared_between_processes(config(redis_server.url), tmp_path)


@pytest.mark.asyncio
async def test_two_processes_share_blocks_through_a_cluster(
    redis_cluster: servers.RedisCluster, tmp_path: Path
) -> None:
    await scenarios.shared_between_processes(config(redis_cluster.url, cluster=True), tmp_path)


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
        ({"socket_buffer_bytes": 100}, "socket_buffer_bytes"),
        ({"socket_buffer_bytes": "big"}, "socket_buffer_bytes"),
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


async def store_in_batches(tier: Any, primary: kt.PrimaryTier, keys: list[bytes]) -> dict[bytes, bytes]:
    """Store `keys` 8 at a time (each batch must be stored); returns each key's bytes."""
    payloads: dict[bytes, bytes] = {}
    for start in range(0, len(keys), 8):
        batch = keys[start : start + 8]
        payloads.update(zip(batch, scenarios.fill(primary, list(range(8)), seed=start)))
        assert await tier.store(batch, list(range(8))) == [True] * 8
    return payloads


async def load_exact(
    tier: Any, primary: kt.PrimaryTier, keys: list[bytes], payloads: dict[bytes, bytes]
) -> int:
    """Load `keys` 8 at a time; every block that hits must hold exactly its bytes. Returns the hits."""
    hits = 0
    for start in range(0, len(keys), 8):
        loaded = await tier.load(keys[start : start + 8], list(range(8, 16)))
        for slot, key, ok in zip(range(8, 16), keys[start : start + 8], loaded):
            if ok:
                hits += 1
                assert bytes(primary.slot_view(slot)) == payloads[key]
    return hits


@pytest.mark.asyncio
async def test_blocks_evicted_under_maxmemory_are_counted_misses(tmp_path: Path) -> None:
    # A fleet's Redis runs with a memory bound and an eviction policy: evicted blocks are misses,
    # never errors, never wrong bytes; the tier keeps storing and loading what the server holds.
    server = servers.RedisServer(
        tmp_path / "redis", None, "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru"
    )
    await asyncio.to_thread(server.start)
    try:
        tier, primary = scenarios.make_tier(config(server.url))
        async with tier:
            keys = [make_key(i, b"evict") for i in range(512)]  # ~4 MiB of blocks: twice what fits
            payloads = await store_in_batches(tier, primary, keys)
            hits = await load_exact(tier, primary, keys, payloads)
            stats = tier.stats()
        assert 0 < hits < len(keys)
        assert (stats["load_hits"], stats["load_misses"]) == (hits, len(keys) - hits)
        assert (stats["errors"], stats["corrupt_blocks"], stats["writes_refused"]) == (0, 0, 0)
    finally:
        await asyncio.to_thread(server.stop)


@pytest.mark.asyncio
async def test_writes_a_full_server_refuses_fail_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # maxmemory-policy noeviction: once full, the server answers every write with an OOM error.
    # Those stores return False (counted, logged once), loads of what it holds still hit, and the
    # server is not taken for dead: it answers.
    server = servers.RedisServer(
        tmp_path / "redis", None, "--maxmemory", "2mb", "--maxmemory-policy", "noeviction"
    )
    await asyncio.to_thread(server.start)
    caplog.set_level(logging.WARNING)
    try:
        tier, primary = scenarios.make_tier(config(server.url))
        async with tier:
            keys = [make_key(i, b"full") for i in range(512)]
            stored: list[bool] = []
            for start in range(0, len(keys), 8):
                scenarios.fill(primary, list(range(8)), seed=start)
                stored += await tier.store(keys[start : start + 8], list(range(8)))
            held = [key for key, ok in zip(keys, stored) if ok]
            assert 0 < len(held) < len(keys)
            assert await tier.lookup(held[:8]) == 8
            assert await tier.load(held[:8], list(range(8, 16))) == [True] * 8
            stats = tier.stats()
        assert stats["writes_refused"] == len(keys) - len(held)
        assert (stats["errors"], stats["fault_breaker"]) == (0, "closed")
        refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(refusals) == 1 and "maxmemory" in refusals[0]
    finally:
        await asyncio.to_thread(server.stop)


@pytest.mark.one_loop
@pytest.mark.asyncio
async def test_a_cluster_master_killed_fails_over_to_its_replica(tmp_path: Path) -> None:
    # Three masters with a replica each. A master is killed mid-run: calls touching its slots fail
    # at once (nothing wrong returned), and once its replica has taken over, every block written
    # before (and replicated) loads again through the same tier object, and new stores succeed.
    cluster = servers.RedisCluster(tmp_path / "cluster", replicas=1, extra=("--cluster-node-timeout", "1000"))
    await asyncio.to_thread(cluster.start)
    try:
        tier, primary = scenarios.make_tier(config(cluster.url, cluster=True, timeout_s=0.5))
        clock = scenarios.Clock()
        tier.fault_breaker.clock = clock  # the test skips the breaker's cool-downs
        async with tier:
            keys = [make_key(i, b"failover") for i in range(64)]
            payloads = await store_in_batches(tier, primary, keys)
            await asyncio.to_thread(cluster.wait_replicated)
            victim = (await asyncio.to_thread(cluster.masters))[0]
            (replica,) = await asyncio.to_thread(cluster.replicas_of, victim)
            await asyncio.to_thread(victim.stop)
            # the dead master's blocks cannot be read now
            assert await load_exact(tier, primary, keys, payloads) < len(keys)
            await asyncio.to_thread(cluster.wait_promoted, replica)
            for _attempt in range(50):  # the client finds the new topology within a few calls
                clock.now += 60.0
                if await load_exact(tier, primary, keys, payloads) == len(keys):
                    break
            else:
                pytest.fail(f"blocks still missing after the failover: {tier.stats()}")
            new = [make_key(i, b"after-failover") for i in range(8)]
            scenarios.fill(primary, list(range(8)), seed=99)
            assert await tier.store(new, list(range(8))) == [True] * 8
            assert await tier.lookup(new) == 8
    finally:
        await asyncio.to_thread(cluster.stop)
