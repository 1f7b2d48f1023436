"""Real servers for the tests, on loopback and free ports: Redis (standalone and Cluster), S3 (moto).

Each is a `redis-server` process in a temporary directory, stopped afterwards.
Tests that need one are skipped with a clear reason where `redis-server` is
not installed, except under KVTIER_REQUIRE_SERVERS=1 (`.ci/run` installs the
servers and sets it), where a missing one is an error: CI never skips them.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
if os.environ.get("KVTIER_REQUIRE_SERVERS") == "1" and (REDIS_SERVER is None or REDIS_CLI is None):
    raise RuntimeError("KVTIER_REQUIRE_SERVERS=1 but redis-server / redis-cli are not installed")
needs_redis = pytest.mark.skipif(
    REDIS_SERVER is None or REDIS_CLI is None,
    reason="redis-server is not installed (apt-get install redis-server)",
)


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


EPHEMERAL_LOW = _ephemeral_low()  # read at import: free_port is also called on a running loop


def free_port() -> int:
    """A free port whose cluster-bus port (+10000) is free too, both below the ephemeral range.

    Below it, because a test that kills a server and restarts it on the same port would
    otherwise race the clients reconnecting meanwhile: the kernel may give one of them that very
    port as its local port, and the server cannot bind it again.
    """
    rng = random.Random()
    high = max(10_001, EPHEMERAL_LOW - 10_001)
    while True:
        port = rng.randint(10_000, high)
        if _is_free(port) and _is_free(port + 10000):
            return port


def wait_until_up(port: int, deadline_s: float = 20.0) -> None:
    """Block until a server answers on `port` (start-up of a test fixture, not of the code under test)."""
    assert REDIS_CLI is not None
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        ping = subprocess.run([REDIS_CLI, "-p", str(port), "ping"], capture_output=True, text=True)
        if ping.stdout.strip() == "PONG":
            return
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not come up")


class RedisServer:
    """One redis-server process; `stop()` kills it, `start()` brings it back on the same port."""

    def __init__(self, directory: Path, port: int | None = None, *extra: str) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS_SERVER is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until_up(self.port)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


CLUSTER_NODE_OPTIONS = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")


class RedisCluster:
    """Three masters, no replicas, joined with `redis-cli --cluster create`."""

    def __init__(self, directory: Path) -> None:
        self.nodes = [
            RedisServer(
                directory / f"node{i}",
                None,
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            )
            for i in range(3)
        ]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> None:
        assert REDIS_CLI is not None
        for node in self.nodes:
            node.start()
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes), "--cluster-yes"],
            check=True,
            capture_output=True,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # wait until every node agrees the cluster is whole
            infos = [
                subprocess.run(
                    [REDIS_CLI, "-p", str(n.port), "cluster", "info"], capture_output=True, text=True
                ).stdout
                for n in self.nodes
            ]
            if all("cluster_state:ok" in info for info in infos):
                return
            time.sleep(0.05)
        raise RuntimeError("the Redis Cluster did not become ready")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


#: The bucket the shared `s3_server` fixture creates, and moto's test credentials.
S3_BUCKET = "kvtier-test"
S3_CREDENTIALS = {"access_key_id": "testing-key", "secret_access_key": "testing-secret-value"}


class S3Server:
    """moto in server mode: a real HTTP endpoint speaking the S3 wire protocol, in memory.

    `stop()` kills it (its buckets are gone with it); `start()` brings it back
    on the same port, empty, as a restarted server may be.
    """

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.endpoint, timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"moto server on port {self.port} did not come up")

    def create_bucket(self, name: str) -> None:
        import boto3  # comes with moto

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing-key",
            aws_secret_access_key="testing-secret-value",
        )
        client.create_bucket(Bucket=name)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


class Blackhole:
    """A TCP server that accepts connections and never answers: a server that is up but stuck."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> Blackhole:
        self.server = await asyncio.start_server(self._swallow, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _swallow(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.read(65536):
                pass
        finally:
            writer.close()

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
