"""MooncakeTier against a real `mooncake_master` on loopback (P2PHANDSHAKE metadata, TCP).

A Mooncake client takes 1-2.5 s to close: the tests' tiers share one the module keeps open
(`kept_client`), as tiers of one process with the same options do, and the contract kit runs on
one event loop here (every Mooncake call runs on a worker thread: the loop's kind does not
reach it).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mooncake_process
import pytest
import servers
from child_env import child_env
from prometheus_client import CollectorRegistry

import kvtier_async as kt
from kvtier_async.metrics import watch
from kvtier_async.testing import TierContractTests, make_key
from kvtier_async.tiers import mooncake_clients

TESTS = Path(__file__).parent
SPEC = mooncake_process.SPEC


#: Room for the contract kit's largest call (64 x 1 MiB blocks with their headers) and more:
#: with 64 MiB the master refused part of that call's writes (Mooncake error -200).
SEGMENT_BYTES = 128 << 20


def config(master: servers.MooncakeMaster | str, **kwargs: Any) -> dict[str, Any]:
    # Every test its own names in the shared pool; this process gives the pool 128 MiB.
    return {
        "type": "mooncake",
        "master": master if isinstance(master, str) else master.address,
        "segment_bytes": SEGMENT_BYTES,
        "prefix": f"test-{uuid.uuid4().hex[:12]}",
        **kwargs,
    }


@pytest.fixture(scope="module")
def kept_client(mooncake_master: servers.MooncakeMaster) -> Iterator[None]:
    """The client the tiers of `config(mooncake_master)` share, kept open for the module."""
    with mooncake_clients.held(
        mooncake_clients.ClientOptions(master=mooncake_master.address, segment_bytes=SEGMENT_BYTES)
    ):
        yield


@pytest.mark.one_loop
class TestMooncakeTier(TierContractTests):
    capacity_kwarg = None  # the master evicts by its own watermarks

    @pytest.fixture
    def tier_config(self, mooncake_master: servers.MooncakeMaster, kept_client: None) -> dict[str, Any]:
        return config(mooncake_master)


@pytest.mark.one_loop
class TestMooncakeTierSealed(TierContractTests):
    capacity_kwarg = None

    @pytest.fixture
    def tier_config(
        self, mooncake_master: servers.MooncakeMaster, kept_client: None, tier_secret_env: str
    ) -> dict[str, Any]:
        return config(mooncake_master, secret_env=tier_secret_env)


def make(tier_config: dict[str, Any]) -> tuple[kt.SecondaryTierManager, kt.PrimaryTier]:
    primary = kt.PrimaryTier(SPEC, pin_memory=False)
    return kt.SecondaryTierFactory.create_secondary_tier(tier_config, primary.view, SPEC), primary


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"master": "no-port"}, "HOST:PORT"),
        ({"master": "127.0.0.1:0"}, "HOST:PORT"),
        ({"segment_bytes": None}, "segment_bytes"),
        ({"segment_bytes": -1}, "segment_bytes"),
        ({"capacity_bytes": 1 << 30}, "capacity_bytes is not supported"),
        ({"protocol": "udp"}, "protocol"),
        ({"replicas": 0}, "replicas"),
        ({"metadata": "etcd://x:1"}, "metadata"),
        ({"master": "10.1.2.3:50051"}, "local_hostname"),
        ({"timeout_s": 0}, "timeout_s"),
    ],
)
def test_bad_config_is_a_config_error(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(kt.ConfigError, match=message):
        make({**config("127.0.0.1:50051"), **changes})


@pytest.mark.asyncio
@pytest.mark.one_loop
async def test_unreachable_master_is_a_counted_fault_naming_the_address() -> None:
    # Nobody listens there: Mooncake's own setup() would retry for ~90 s holding the GIL.
    address = f"127.0.0.1:{servers.free_port()}"
    tier, _ = make(config(address, timeout_s=2))
    async with tier:  # a fault that may pass: the tier starts degraded, the fault counted
        assert tier.stats()["errors"] == 1
        with pytest.raises(ConnectionError, match=f"master at {address} is not reachable"):
            await tier.open()
        assert await tier.load([make_key(0)], [0]) == [False]
        assert await tier.store([make_key(0)], [0]) == [False]
        assert tier.stats()["errors"] >= 1


def raw_client(master: servers.MooncakeMaster) -> Any:
    """A Mooncake client of its own, as another program would use (blocking: a thread's work)."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.address) == 0
    return client


@pytest.mark.asyncio
@pytest.mark.one_loop
async def test_a_value_overwritten_with_other_bytes_is_a_counted_miss_then_stored_again(
    mooncake_master: servers.MooncakeMaster, kept_client: None
) -> None:
    tier, primary = make(config(mooncake_master))
    async with tier:
        primary.slot_view(0)[:] = mooncake_process.block(0)
        assert await tier.store([make_key(0)], [0]) == [True]
        name = tier.value_name(make_key(0))  # type: ignore[attr-defined]
        client = await asyncio.to_thread(raw_client, mooncake_master)
        try:
            other = os.urandom(tier.value_nbytes)  # type: ignore[attr-defined]
            assert await asyncio.to_thread(client.remove, name, True) == 0
            assert await asyncio.to_thread(client.put, name, other) == 0
        finally:
            await asyncio.to_thread(client.close)
        registry = CollectorRegistry()
        watch(tier, registry)
        assert await tier.load([make_key(0)], [1]) == [False]
        stats = tier.stats()
        assert stats["corrupt_blocks"] == 1 and stats["bad_values_removed"] == 1
        labels = {"tier": tier.name, "type": "mooncake", "namespace": SPEC.namespace}
        assert registry.get_sample_value("kvtier_tier_corrupt_blocks_total", labels) == 1
        assert registry.get_sample_value("kvtier_tier_bad_values_removed_total", labels) == 1
        # Mooncake keeps the value a name holds: the tier removed the bad one, so this writes.
        assert await tier.store([make_key(0)], [0]) == [True]
        assert await tier.load([make_key(0)], [1]) == [True]
        assert bytes(primary.slot_view(1)) == mooncake_process.block(0)


@pytest.mark.asyncio
@pytest.mark.one_loop
async def test_a_value_of_another_length_is_a_counted_miss(
    mooncake_master: servers.MooncakeMaster, kept_client: None
) -> None:
    tier, _ = make(config(mooncake_master))
    async with tier:
        await tier.open()  # its segment is where the pool has room
        names = [tier.value_name(make_key(i)) for i in range(2)]  # type: ignore[attr-defined]
        client = await asyncio.to_thread(raw_client, mooncake_master)
        try:
            n = tier.value_nbytes  # type: ignore[attr-defined]
            assert await asyncio.to_thread(client.put, names[0], os.urandom(n - 4096)) == 0
            assert await asyncio.to_thread(client.put, names[1], os.urandom(n + 4096)) == 0
        finally:
            await asyncio.to_thread(client.close)
        assert await tier.load([make_key(0), make_key(1)], [0, 1]) == [False, False]
        stats = tier.stats()
        assert stats["load_misses"] == 2
        assert stats["corrupt_blocks"] + stats["read_failures"] == 2


@pytest.fixture
def own_master() -> Iterator[servers.MooncakeMaster]:
    """A master of the test's own: no segment but those the test makes."""
    with servers.running_mooncake_master() as master:
        yield master


@pytest.fixture
def storing_process(own_master: servers.MooncakeMaster, tier_secret_env: str) -> Iterator[Any]:
    """Another process that stored 8 sealed blocks through its own tier and keeps its segment,
    the only one in the pool."""
    mooncake_master = own_master
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    process = subprocess.Popen(
        [
            sys.executable,
            str(TESTS / "mooncake_process.py"),
            mooncake_master.address,
            prefix,
            "8",
            tier_secret_env,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=child_env(TESTS),
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().split() == ["stored", "8"]
        process.prefix = prefix  # type: ignore[attr-defined]
        yield process
    finally:
        process.kill()
        process.wait()


@pytest.mark.asyncio
@pytest.mark.one_loop
async def test_blocks_another_process_stored_load_byte_exact_and_go_when_it_exits(
    own_master: servers.MooncakeMaster, storing_process: Any, tier_secret_env: str
) -> None:
    mooncake_master = own_master
    keys = [make_key(i) for i in range(8)]
    # This process gives the pool nothing: what it reads lies in the other one's segment.
    tier, primary = make(
        config(mooncake_master, prefix=storing_process.prefix, secret_env=tier_secret_env, segment_bytes=0)
    )
    stranger, _ = make(config(mooncake_master, prefix=storing_process.prefix, segment_bytes=0))
    async with tier, stranger:
        assert await tier.lookup(keys) == 8
        assert await tier.load(keys, list(range(8))) == [True] * 8
        assert [bytes(primary.slot_view(i)) for i in range(8)] == [
            mooncake_process.block(i) for i in range(8)
        ]
        # Without the secret, the names are others: nothing is found.
        assert await stranger.lookup(keys) == 0
        assert await stranger.load(keys[:1], [0]) == [False]

        storing_process.kill()
        await asyncio.to_thread(storing_process.wait)
        # Its segment is gone with it: misses, at once, counted; nothing raised.
        assert await tier.load(keys, list(range(8))) == [False] * 8
        stats = tier.stats()
        assert stats["load_misses"] == 8 and stats["read_failures"] + stats["absent_blocks"] == 8


@pytest.mark.asyncio
@pytest.mark.one_loop
async def test_master_stopped_is_a_counted_fault_and_the_tier_comes_back_with_it() -> None:
    if servers.MOONCAKE_MISSING is not None:
        pytest.skip(servers.MOONCAKE_MISSING)
    master = servers.MooncakeMaster()
    await asyncio.to_thread(master.start)
    try:
        tier, primary = make(config(master))
        async with tier:
            primary.slot_view(0)[:] = mooncake_process.block(0)
            assert await tier.store([make_key(0)], [0]) == [True]
            await asyncio.to_thread(master.stop)
            # Each call waits out Mooncake's own RPC retries (~4 s), on a worker thread.
            assert await tier.load([make_key(0)], [1]) == [False]
            stats = tier.stats()
            assert stats["errors"] == 1 and stats["load_misses"] == 1

            # A master back on its port knows nothing (what it placed is gone); the client mounts
            # its segment again on its own, and the tier's next calls store and load again.
            await asyncio.to_thread(master.start)
            deadline = asyncio.get_running_loop().time() + 30
            while await tier.store([make_key(1)], [0]) != [True]:
                assert asyncio.get_running_loop().time() < deadline, tier.stats()
                await asyncio.sleep(0.2)  # Mooncake's own remount: nothing to wait on but the outcome
            got = await tier.load([make_key(0), make_key(1)], [1, 2])
            assert got == [False, True], tier.stats()
            assert bytes(primary.slot_view(2)) == mooncake_process.block(0)
    finally:
        await asyncio.to_thread(master.stop)


@pytest.mark.asyncio
@pytest.mark.one_loop
async def test_tiers_with_the_same_options_share_a_client_and_close_apart(
    mooncake_master: servers.MooncakeMaster, kept_client: None
) -> None:
    first, primary = make(config(mooncake_master))
    second, other = make(config(mooncake_master))
    async with second:
        async with first:
            primary.slot_view(0)[:] = mooncake_process.block(0)
            assert await first.store([make_key(0)], [0]) == [True]
            await second.open()
            assert second._client is first._client  # type: ignore[attr-defined]
        # The first closed (its memory unregistered): the second still moves blocks.
        other.slot_view(0)[:] = mooncake_process.block(1)
        assert await second.store([make_key(1)], [0]) == [True]
        assert await second.load([make_key(1)], [1]) == [True]
        assert bytes(other.slot_view(1)) == mooncake_process.block(1)


@pytest.mark.asyncio
@pytest.mark.one_loop
async def test_the_raw_baseline_of_kvtier_bench_moves_blocks_off_the_loop(
    mooncake_master: servers.MooncakeMaster,
) -> None:
    from kvtier_async.raw_baselines import baseline

    tier = {"type": "mooncake", "master": mooncake_master.address, "segment_bytes": 16 << 20}
    out = await baseline(tier, 64 << 10, 16, 4, Path("unused"))
    assert out["store"]["gbps"] > 0 and out["load"]["gbps"] > 0
