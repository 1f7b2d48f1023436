"""Every async test runs on the default asyncio loop and on uvloop, under a blocking-call detector."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import servers
from blockbuster import BlockBuster, blockbuster_ctx


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
    if sys.platform != "win32" and item.get_closest_marker("one_loop") is None:
        import uvloop

        factories["uvloop"] = uvloop.new_event_loop
    return factories


@pytest.fixture(autouse=True)
def blockbuster(request: pytest.FixtureRequest) -> Iterator[BlockBuster | None]:
    """Fail any async test whose code blocks the event-loop thread (file I/O, sleep, locks...)."""
    if request.node.get_closest_marker("asyncio") is None:
        yield None
        return
    with blockbuster_ctx(["kvtier_async", "tests"]) as detector:
        yield detector


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "slow: a longer end-to-end test")
    config.addinivalue_line("markers", "one_loop: other processes are the subject: the default loop only")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.RedisServer]:
    """A redis-server on loopback for one test module (tests name their keys apart)."""
    if servers.REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = servers.RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.RedisCluster]:
    """A three-master Redis Cluster on loopback for one test module."""
    if servers.REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    cluster = servers.RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def s3_server() -> Iterator[servers.S3Server]:
    """moto's S3 server on loopback for one test module, with `servers.S3_BUCKET` created."""
    server = servers.S3Server()
    server.start()
    server.create_bucket(servers.S3_BUCKET)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mooncake_master() -> Iterator[servers.MooncakeMaster]:
    """A mooncake_master on loopback for one test module (tests name their objects apart)."""
    with servers.running_mooncake_master() as master:
        yield master


@pytest.fixture
def tier_secret_env(monkeypatch: pytest.MonkeyPatch) -> str:
    """The name of an environment variable holding a fresh tier secret (for `secret_env`)."""
    from kvtier_async.secret import new_secret

    monkeypatch.setenv("KVTIER_TEST_SECRET", new_secret())
    return "KVTIER_TEST_SECRET"
