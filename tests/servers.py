"""Real servers for the tests, on loopback and free ports: Redis (standalone and Cluster), S3 (moto),
a Mooncake Store master.

Each is a `redis-server` process in a temporary directory, stopped afterwards.
Tests that need one are skipped with a clear reason where `redis-server` is
not installed, except under KVTIER_REQUIRE_SERVERS=1 (`.ci/run` installs the
servers and sets it), where a missing one is an error: CI never skips them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes.util
import importlib.util
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
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


def _mooncake_missing() -> str | None:
    """Why the Mooncake tests cannot run here, or None."""
    if importlib.util.find_spec("mooncake") is None:
        return "the Mooncake client is not installed (pip install mooncake-transfer-engine-non-cuda)"
    if ctypes.util.find_library("ibverbs") is None:
        return "libibverbs is not installed (apt-get install libibverbs1), which the Mooncake client needs"
    if MOONCAKE_MASTER is None:
        return "mooncake_master is not installed (it comes with the Mooncake wheel)"
    return None


MOONCAKE_MASTER = shutil.which("mooncake_master") or shutil.which(
    "mooncake_master", path=str(Path(sys.executable).parent)
)
MOONCAKE_MISSING = _mooncake_missing()
if os.environ.get("KVTIER_REQUIRE_SERVERS") == "1" and MOONCAKE_MISSING is not None:
    raise RuntimeError(f"KVTIER_REQUIRE_SERVERS=1 but {MOONCAKE_MISSING}")
needs_mooncake = pytest.mark.skipif(MOONCAKE_MISSING is not None, reason=MOONCAKE_MISSING or "")


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


class RedisCluster:
    """Three masters joined with `redis-cli --cluster create`, each with `replicas` replicas.

    `extra` options go to every node (`--cluster-node-timeout 1000`: a dead master is failed
    over within seconds rather than the default 15)."""

    def __init__(self, directory: Path, replicas: int = 0, extra: tuple[str, ...] = ()) -> None:
        self.replicas = replicas
        self.nodes = [
            RedisServer(
                directory / f"node{i}",
                None,
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                *extra,
            )
            for i in range(3 * (1 + replicas))
        ]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> None:
        assert REDIS_CLI is not None
        for node in self.nodes:
            node.start()
        subprocess.run(
            [
                REDIS_CLI,
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
        )
        # Until every node agrees the cluster is whole, and every replica follows its master.
        self._wait_for(
            lambda: (
                all("cluster_state:ok" in self.cli(n, "cluster", "info") for n in self.nodes)
                and all(self.master_of(n) is not None for n in self.nodes if self.role(n) == "slave")
            ),
            "the Redis Cluster did not become ready",
        )

    def cli(self, node: RedisServer, *command: str) -> str:
        assert REDIS_CLI is not None
        done = subprocess.run([REDIS_CLI, "-p", str(node.port), *command], capture_output=True, text=True)
        return done.stdout

    def info(self, node: RedisServer) -> dict[str, str]:
        lines = self.cli(node, "info", "replication").splitlines()
        return dict(line.split(":", 1) for line in lines if ":" in line)

    def role(self, node: RedisServer) -> str:
        return self.info(node).get("role", "")

    def master_of(self, node: RedisServer) -> RedisServer | None:
        """The master a replica follows, once its link to it is up."""
        info = self.info(node)
        if info.get("master_link_status") != "up":
            return None
        return next((n for n in self.nodes if str(n.port) == info.get("master_port")), None)

    def masters(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.process is not None and self.role(n) == "master"]

    def replicas_of(self, master: RedisServer) -> list[RedisServer]:
        return [n for n in self.nodes if n.process is not None and self.master_of(n) is master]

    def wait_replicated(self) -> None:
        """Until every replica has every write its master has taken."""

        def caught_up(master: RedisServer) -> bool:
            info = self.info(master)
            offsets = [v for k, v in info.items() if k.startswith("slave") and "offset=" in v]
            target = info.get("master_repl_offset")
            return all(f"offset={target}," in v for v in offsets) and len(offsets) == self.replicas

        self._wait_for(lambda: all(caught_up(m) for m in self.masters()), "the replicas did not catch up")

    def wait_promoted(self, replica: RedisServer) -> None:
        """Until `replica` has taken over its dead master's slots and the cluster is whole again."""
        self._wait_for(
            lambda: (
                self.role(replica) == "master" and "cluster_state:ok" in self.cli(replica, "cluster", "info")
            ),
            "the replica did not take over",
        )

    @staticmethod
    def _wait_for(condition: Callable[[], bool], failure: str) -> None:
        # The servers' own start-up and failover, not the code under test: polled with a deadline.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(0.05)
        raise RuntimeError(failure)

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


def wait_for_port(port: int, what: str, deadline_s: float = 30.0) -> None:
    """Block until something accepts TCP connections on loopback `port` (a fixture's start-up)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"{what} on port {port} did not come up")


class MooncakeMaster:
    """One `mooncake_master` process on loopback: its RPC port (`address`, what a tier's
    "master" names) and its admin HTTP server (`admin_url`: /get_all_keys, /query_key...).
    Clients use P2PHANDSHAKE metadata. `stop()` kills it; `start()` brings it back on the
    same ports, empty."""

    def __init__(self, client_ttl_s: int = 10) -> None:
        self.port = free_port()
        self.admin_port = free_port()
        self.client_ttl_s = client_ttl_s
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self) -> None:
        assert MOONCAKE_MASTER is not None
        self.process = subprocess.Popen(
            [
                MOONCAKE_MASTER,
                f"--rpc_port={self.port}",
                "--rpc_address=127.0.0.1",
                f"--metrics_port={self.admin_port}",
                "--metrics_host=127.0.0.1",
                f"--client_ttl={self.client_ttl_s}",
                "--rpc_thread_num=2",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port, "mooncake_master")
        wait_for_port(self.admin_port, "mooncake_master's admin server")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


class ThrottlingProxy:
    """An HTTP proxy in front of an S3 server that answers `503 SlowDown`, as S3 does when a
    prefix is asked too fast: to the first attempt of each request (`throttle="first"`), to
    every one (`"all"`), or to none (`"none"`: a proxy that only watches). Each attempt it lets
    through is forwarded as it came; `requests` lists every attempt as (method, path and query)."""

    SLOW_DOWN = (
        b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
        b"<Message>Please reduce your request rate.</Message></Error>"
    )

    def __init__(self, upstream: str, throttle: str = "first") -> None:
        import http.server
        import threading
        import urllib.parse

        self.throttle = throttle
        self.throttled = 0
        self.forwarded = 0
        self.requests: list[tuple[str, str]] = []
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        target = urllib.parse.urlsplit(upstream)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _handle(self) -> None:
                import http.client

                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy._lock:
                    proxy.requests.append((self.command, self.path))
                    first = (self.command, self.path) not in proxy._seen
                    proxy._seen.add((self.command, self.path))
                    slow_down = proxy.throttle == "all" or (proxy.throttle == "first" and first)
                    if slow_down:
                        proxy.throttled += 1
                    else:
                        proxy.forwarded += 1
                if slow_down:
                    self.send_response(503, "Slow Down")
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(ThrottlingProxy.SLOW_DOWN)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(ThrottlingProxy.SLOW_DOWN)
                    return
                upstream = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    reply = upstream.getresponse()
                    data = reply.read()
                    self.send_response(reply.status, reply.reason)
                    for name, value in reply.getheaders():
                        if name.lower() not in ("connection", "transfer-encoding", "content-length"):
                            self.send_header(name, value)
                    length = reply.getheader("Content-Length") if self.command == "HEAD" else None
                    self.send_header("Content-Length", length or str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    upstream.close()

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _handle

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    async def __aenter__(self) -> ThrottlingProxy:
        await asyncio.to_thread(self._thread.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self._server.shutdown)  # waits for serve_forever to return
        await asyncio.to_thread(self._server.server_close)


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


@contextlib.contextmanager
def running_mooncake_master() -> Iterator[MooncakeMaster]:
    """A mooncake_master started on loopback, stopped after; skips the test where Mooncake is
    missing (an error under KVTIER_REQUIRE_SERVERS=1, at import)."""
    if MOONCAKE_MISSING is not None:
        pytest.skip(MOONCAKE_MISSING)
    master = MooncakeMaster()
    master.start()
    try:
        yield master
    finally:
        master.stop()
