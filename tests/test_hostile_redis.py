"""A hostile Redis server (or a man in the middle) against the redis-py path of the Redis tier
(a Cluster, TLS): a reply far longer than asked for costs no more than a block, and a Cluster
node the configuration does not name gets no connection, so never the password.

The servers here are fakes on loopback, real sockets speaking just enough RESP2: no real
server misbehaves on purpose. `test_redis_tier.py` shows the same paths against real ones."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import ssl
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from test_oversized_values import STATUS, peak_growth_of, reset_peak, resident

import kvtier_async as kt
import kvtier_async.tiers.redis_tier  # imported up front: a first import reads files
from kvtier_async.testing import make_key

BLOCK = 8 << 20
SENT = 256 << 20  # what the hostile server sends of its "4 GiB" before it waits
PASSWORD = "cluster-pa55-" + uuid.uuid4().hex

Answer = Callable[[list[bytes], asyncio.StreamWriter], Awaitable[None]]


async def read_command(reader: asyncio.StreamReader) -> list[bytes]:
    """One RESP2 command (an array of bulk strings) as redis-py sends it."""
    line = await reader.readline()
    if not line.startswith(b"*"):
        raise EOFError
    parts = []
    for _ in range(int(line[1:])):
        length = int((await reader.readline())[1:])
        parts.append((await reader.readexactly(length + 2))[:-2])
    return parts


class FakeServer:
    """A RESP2 server on `host` answering each command with `answer`; it records every
    connection and command."""

    def __init__(
        self,
        host: str,
        answer: Answer,
        tls: ssl.SSLContext | None = None,
        *,
        resp3: bool = False,
        port: int = 0,
    ) -> None:
        self.host, self.answer, self.tls, self.resp3 = host, answer, tls, resp3
        self.connections = 0
        self.commands: list[list[bytes]] = []
        self.port = port

    async def __aenter__(self) -> FakeServer:
        self._writers: set[asyncio.StreamWriter] = set()
        self._server = await asyncio.start_server(self._serve, self.host, self.port, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        for writer in self._writers:  # one still waiting to send must not keep the server open
            writer.transport.abort()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            while True:
                command = await read_command(reader)
                self.commands.append(command)
                if command[0].upper() == b"HELLO" and self.resp3:
                    writer.write(b"%1\r\n+proto\r\n:3\r\n")
                elif command[0].upper() == b"HELLO":  # a RESP2 server, as Redis before 6
                    writer.write(b"-ERR unknown command 'HELLO'\r\n")
                else:
                    await self.answer(command, writer)
                await writer.drain()
        except (EOFError, ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()


def make_tier(config: dict[str, Any]) -> Any:
    spec = kt.OffloadingSpec(block_nbytes=BLOCK, num_cpu_blocks=2, namespace="hostile")
    primary = kt.PrimaryTier(spec, pin_memory=False)
    return kt.SecondaryTierFactory.create_secondary_tier({"type": "redis", **config}, primary.view, spec)


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, as PEM files (blocking)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


async def tls_server(directory: Path, answer: Answer) -> tuple[FakeServer, str]:
    """A TLS `FakeServer` answering with `answer`, and a rediss:// URL for it that does not verify
    the certificate (a man in the middle, as far as the client can tell). Enter the server."""
    cert, key = await asyncio.to_thread(self_signed, directory)
    context = await asyncio.to_thread(server_context, cert, key)
    server = FakeServer("127.0.0.1", answer, context)
    return server, "rediss://127.0.0.1:{port}/0?ssl_cert_reqs=none&ssl_check_hostname=false"


async def stream(writer: asyncio.StreamWriter, head: bytes, body: bytes, times: int) -> None:
    """`head`, then `body` `times` times as the client takes it (the server's own buffer small),
    then wait: the rest never comes."""
    writer.write(head)
    for _ in range(times):
        writer.write(body)
        await writer.drain()
    await asyncio.Event().wait()


def answer_getrange_with(head: bytes, body: bytes = b"", times: int = 0) -> Answer:
    async def answer(command: list[bytes], writer: asyncio.StreamWriter) -> None:
        verb = command[0].upper()
        if verb == b"GETRANGE":
            await stream(writer, head, body, times)
        elif verb == b"CONFIG":
            writer.write(b"*0\r\n")
        else:
            writer.write(b"+OK\r\n")

    return answer


@pytest_asyncio.fixture
async def hostile_tls_server(tmp_path: Path) -> AsyncIterator[tuple[FakeServer, str]]:
    """A TLS server that answers GETRANGE with a bulk reply claiming 4 GiB, then sends SENT
    bytes of it as fast as the client takes them, and waits."""
    server, url = await tls_server(
        tmp_path, answer_getrange_with(b"$%d\r\n" % (4 << 30), bytes(1 << 20), SENT >> 20)
    )
    async with server:
        yield server, url.format(port=server.port)


def allow_tls_context_lookup(blockbuster: Any) -> None:
    # redis-py looks up its shared TLS context on the loop, by the CA files' signatures (a
    # stat each): not what these tests are about (the report of this change names it).
    blockbuster.functions["os.stat"].can_block_in("redis/utils.py", "get_shared_ssl_context")


@pytest.mark.asyncio
@pytest.mark.skipif(not STATUS.exists(), reason="measures memory through /proc/self")
async def test_a_4_gib_reply_to_getrange_over_tls_is_a_bounded_miss(
    hostile_tls_server: tuple[FakeServer, str], blockbuster: Any
) -> None:
    # Attack: a hostile server (or a man in the middle) answers a GETRANGE of a block with a
    # reply that claims 4 GiB and streams it: redis-py held all it got (1.5 GB in 5 s).
    server, url = hostile_tls_server
    allow_tls_context_lookup(blockbuster)
    tier = make_tier({"url": url, "timeout_s": 5.0})
    async with tier:
        growth = await peak_growth_of(tier.load([make_key(1)], [0]))
        stats = tier.stats()
    assert stats["load_misses"] == 1
    assert stats["errors"] >= 1  # a counted fault: the connection was dropped
    assert any(c[0].upper() == b"GETRANGE" for c in server.commands), server.commands
    assert growth < BLOCK + (64 << 20), (
        f"a hostile {SENT >> 20} MiB reply grew the peak by {growth >> 20} MiB"
    )


@pytest.mark.asyncio
@pytest.mark.skipif(not STATUS.exists(), reason="measures memory through /proc/self")
async def test_a_4_gib_reply_to_getrange_through_a_cluster_is_a_bounded_miss(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Attack: a Cluster node (itself every slot's owner, so allowed) answers a GETRANGE of a
    # block with a reply that claims 4 GiB and streams it, through redis-py's Cluster client.
    caplog.set_level(logging.DEBUG, logger="redis.asyncio.connection")
    stream_4_gib = answer_getrange_with(b"$%d\r\n" % (4 << 30), bytes(1 << 20), SENT >> 20)

    async def answer(command: list[bytes], writer: asyncio.StreamWriter) -> None:
        verb = b" ".join(command[:2]).upper()
        if verb == b"CLUSTER SLOTS":
            writer.write(cluster_slots("127.0.0.1", writer.get_extra_info("sockname")[1]))
        elif verb.startswith(b"COMMAND"):  # what redis-py's Cluster client finds keys by
            writer.write(b"*1\r\n*6\r\n$8\r\ngetrange\r\n:4\r\n*1\r\n+readonly\r\n:1\r\n:1\r\n:1\r\n")
        else:
            await stream_4_gib(command, writer)

    async with FakeServer("127.0.0.1", answer) as node:
        tier = make_tier({"url": f"redis://127.0.0.1:{node.port}/0", "cluster": True, "timeout_s": 5.0})
        async with tier:
            growth = await peak_growth_of(tier.load([make_key(1)], [0]))
            stats = tier.stats()
    assert stats["load_misses"] == 1
    assert stats["cluster_nodes_refused"] == 0  # refused for its size, not its address
    assert any(c[0].upper() == b"GETRANGE" for c in node.commands), node.commands
    # Refused as such, not by chance (redis-py's Cluster pipeline hands the dropped
    # connection's error back in place, which the tier reads as a miss: only its log tells).
    assert "longer than its command can return" in caplog.text
    assert growth < BLOCK + (64 << 20), (
        f"a hostile {SENT >> 20} MiB reply grew the peak by {growth >> 20} MiB"
    )


def virtual_peak() -> int:
    """The process's peak address space (VmPeak), bytes."""
    fields = dict(line.split(":", 1) for line in STATUS.read_text().splitlines())
    return int(fields["VmPeak"].split()[0]) << 10


HOSTILE_REPLIES = {
    # hiredis built a list of each header's count at once (8 bytes an element), nested: 3 GB
    "4-nested-arrays-of-1e8": (b"*100000000\r\n" * 4, b"", 0),
    "array-of-2^32-1": (b"*4294967295\r\n", b"", 0),
    # redis-py's Python parsers counted only bulk bodies: 16M empty arrays grew the process 510 MB
    "16M-empty-arrays": (b"*16777216\r\n", b"*0\r\n" * (1 << 18), 64),
    # ... and went back to a parser of their own after a failed HELLO: all 64 MiB returned
    "64-MiB-bulk": (b"$%d\r\n" % (64 << 20), bytes(1 << 20), 64),
}


@pytest.mark.asyncio
@pytest.mark.skipif(not STATUS.exists(), reason="measures memory through /proc/self")
@pytest.mark.parametrize("hiredis", [True, False], ids=["hiredis", "no-hiredis"])
@pytest.mark.parametrize("attack", list(HOSTILE_REPLIES))
async def test_a_hostile_reply_of_any_shape_is_refused_before_it_is_built(
    attack: str,
    hiredis: bool,
    tmp_path: Path,
    blockbuster: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Attack: a GETRANGE answered with aggregate headers (hiredis allocates what they announce),
    # tiny elements by the million, or a long bulk string, with or without hiredis installed.
    if not hiredis:  # as redis-py is without hiredis: its pure-Python RESP3 parser by default
        from redis._parsers import _AsyncRESP3Parser

        monkeypatch.setattr("redis.asyncio.connection.DefaultParser", _AsyncRESP3Parser)
    head, body, times = HOSTILE_REPLIES[attack]
    server, url = await tls_server(tmp_path, answer_getrange_with(head, body, times))
    allow_tls_context_lookup(blockbuster)
    caplog.set_level(logging.WARNING)
    async with server:
        tier = make_tier({"url": url.format(port=server.port), "timeout_s": 5.0})
        async with tier:
            virtual_before = await asyncio.to_thread(virtual_peak)
            growth = await peak_growth_of(tier.load([make_key(1)], [0]))
            virtual_growth = await asyncio.to_thread(virtual_peak) - virtual_before
            stats = tier.stats()
    assert stats["load_misses"] == 1 and stats["errors"] >= 1
    assert any(c[0].upper() == b"GETRANGE" for c in server.commands), server.commands
    assert "longer than its command can return" in caplog.text  # refused as such, not by chance
    assert growth < 32 << 20, f"the peak grew by {growth >> 20} MiB"
    assert virtual_growth < 1 << 30, f"the address space grew by {virtual_growth >> 20} MiB"


@pytest.mark.asyncio
@pytest.mark.skipif(not STATUS.exists(), reason="measures memory through /proc/self")
async def test_a_pipeline_of_existence_checks_answered_with_a_mib_each_is_bounded() -> None:
    # Attack: each of 100 EXISTS in one pipeline answered with a 1 MiB bulk string: every
    # reply was under the per-reply cap, and redis-py kept them all (+112 MiB per pipeline).
    async def answer(command: list[bytes], writer: asyncio.StreamWriter) -> None:
        verb = command[0].upper()
        if verb == b"EXISTS":
            writer.write(b"$%d\r\n" % (1 << 20))
            writer.write(bytes(1 << 20) + b"\r\n")
        elif verb == b"CONFIG":
            writer.write(b"*0\r\n")
        else:
            writer.write(b"+OK\r\n")

    async with FakeServer("127.0.0.1", answer) as server:
        # redis:// (blocks on the direct connections): existence checks go through redis-py
        tier = make_tier({"url": f"redis://127.0.0.1:{server.port}/0", "timeout_s": 5.0})
        async with tier:
            keys = [make_key(i) for i in range(100)]
            await asyncio.to_thread(reset_peak)
            before, _ = await asyncio.to_thread(resident)
            found = await tier.lookup_each(keys)
            growth = (await asyncio.to_thread(resident))[1] - before
            stats = tier.stats()
    assert found == [False] * 100
    assert stats["errors"] >= 1
    assert growth < 32 << 20, f"one pipeline's replies grew the peak by {growth >> 20} MiB"


@pytest.mark.asyncio
async def test_a_moving_push_sends_no_connection_and_no_password_elsewhere() -> None:
    # Attack: a server answers HELLO as RESP3 and an EXISTS with a MOVING push naming another
    # host: redis-py (maintenance notifications on by default) moved its connections there,
    # sending HELLO 3 AUTH default <password> first.
    async def answer(command: list[bytes], writer: asyncio.StreamWriter) -> None:
        verb = command[0].upper()
        if verb == b"EXISTS":
            target = b"127.0.0.2:%d" % writer.get_extra_info("sockname")[1]
            writer.write(b">4\r\n+MOVING\r\n:1\r\n:30\r\n+%s\r\n:0\r\n" % target)
        elif verb == b"CONFIG":
            writer.write(b"*0\r\n")
        else:
            writer.write(b"+OK\r\n")

    async with FakeServer("127.0.0.1", answer, resp3=True) as node:
        try:  # the host the push names, at the node's port (where redis-py goes)
            spy = await FakeServer("127.0.0.2", answer_as_spy, port=node.port).__aenter__()
        except OSError as exc:
            pytest.skip(f"cannot listen on 127.0.0.2: {exc}")
        try:
            tier = make_tier({"url": f"redis://:{PASSWORD}@127.0.0.1:{node.port}/0", "timeout_s": 2.0})
            async with tier:
                for i in range(8):  # what redis-py moves, it moves on a later call
                    await tier.lookup_each([make_key(i)])
        finally:
            await spy.__aexit__(None, None, None)
    assert spy.connections == 0
    assert not any(PASSWORD.encode() in part for c in spy.commands for part in c)
    assert not any(c[0].upper() == b"HELLO" for c in node.commands)  # RESP2: no HELLO to answer


def cluster_slots(host: str, port: int) -> bytes:
    """CLUSTER SLOTS: every slot served by `host:port`."""
    return b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$%d\r\n%s\r\n:%d\r\n" % (len(host), host.encode(), port)


async def answer_as_spy(command: list[bytes], writer: asyncio.StreamWriter) -> None:
    writer.write(b"-ERR a node that should never have been reached\r\n")


@pytest_asyncio.fixture
async def spy() -> AsyncIterator[FakeServer]:
    """A listener at another loopback address (127.0.0.2): a node the configuration never named."""
    try:
        async with FakeServer("127.0.0.2", answer_as_spy) as server:
            yield server
    except OSError as exc:
        pytest.skip(f"cannot listen on 127.0.0.2: {exc}")


@pytest_asyncio.fixture
async def announcing_node(spy: FakeServer) -> AsyncIterator[FakeServer]:
    """A cluster node on 127.0.0.1 whose CLUSTER SLOTS names the spy's address for every slot."""

    async def answer(command: list[bytes], writer: asyncio.StreamWriter) -> None:
        verb = b" ".join(command[:2]).upper()
        if verb == b"CLUSTER SLOTS":
            writer.write(cluster_slots("127.0.0.2", spy.port))
        elif verb.startswith(b"COMMAND"):
            writer.write(b"*0\r\n")
        else:
            writer.write(b"+OK\r\n")  # AUTH, CLIENT SETINFO

    async with FakeServer("127.0.0.1", answer) as server:
        yield server


@pytest.mark.asyncio
async def test_a_cluster_node_at_another_address_gets_no_connection_and_no_password(
    spy: FakeServer, announcing_node: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Attack: a node (or whoever answers at the URL) lists another address in CLUSTER SLOTS;
    # redis-py connected there and sent AUTH <password> first.
    caplog.set_level(logging.WARNING)
    tier = make_tier({"url": f"redis://:{PASSWORD}@127.0.0.1:{announcing_node.port}/0", "cluster": True})
    async with tier:
        assert await tier.store([make_key(1)], [0]) == [False]
        assert await tier.load([make_key(1)], [1]) == [False]
        stats = tier.stats()
    assert spy.connections == 0
    assert stats["cluster_nodes_refused"] >= 1
    warnings = [r.getMessage() for r in caplog.records if "not among the allowed nodes" in r.getMessage()]
    assert len(warnings) == 1 and f"127.0.0.2:{spy.port}" in warnings[0]
    assert PASSWORD not in caplog.text and PASSWORD not in repr(stats)
    # The node at the URL, which the configuration names, did get the password.
    assert [b"AUTH", PASSWORD.encode()] in announcing_node.commands


@pytest.mark.asyncio
async def test_nodes_the_configuration_lists_are_connected_to(
    spy: FakeServer, announcing_node: FakeServer
) -> None:
    # The other side of the allow-list: listed, the same address is reached (so the test above
    # shows the guard, not an unreachable address).
    tier = make_tier(
        {
            "url": f"redis://:{PASSWORD}@127.0.0.1:{announcing_node.port}/0",
            "cluster": True,
            "nodes": ["127.0.0.1", f"127.0.0.2:{spy.port}"],
        }
    )
    async with tier:
        await tier.store([make_key(1)], [0])
        assert tier.stats()["cluster_nodes_refused"] == 0
    assert spy.connections >= 1


@pytest.mark.parametrize("nodes", ["127.0.0.1", ["redis://h:1"], ["h:notaport"], [1]])
def test_malformed_nodes_are_refused(nodes: Any) -> None:
    with pytest.raises(kt.ConfigError, match="nodes"):
        make_tier({"url": "redis://127.0.0.1:7000/0", "cluster": True, "nodes": nodes})


def test_nodes_without_a_cluster_are_refused() -> None:
    with pytest.raises(kt.ConfigError, match="cluster=True"):
        make_tier({"url": "redis://127.0.0.1:7000/0", "nodes": ["127.0.0.1"]})


def test_a_node_whose_port_is_no_number_is_refused_not_an_error() -> None:
    # Attack: a hostile node names an address whose port is no number: the allow-list check
    # raised ValueError instead of refusing the connection (counted, warned about).
    from kvtier_async.tiers.redis_client import AllowedNodes

    allowed = AllowedNodes(["127.0.0.1:7000", "10.0.0.1"])
    assert ("127.0.0.1", "x") not in allowed
    assert ("127.0.0.1", 7000) in allowed and ("127.0.0.1", "7000") in allowed
    assert ("10.0.0.1", "x") in allowed  # a host listed without a port: any port


@pytest.mark.parametrize(
    "extra", [{"nodes": ["127.0.0.1"], "cluster": True}, {"password_env": "HOME"}], ids=["nodes", "password"]
)
def test_nodes_or_a_password_next_to_a_client_passed_in_are_refused(extra: dict[str, Any]) -> None:
    # Attack: a caller passes a redis-py client of its own with `nodes`, trusting the allow-list
    # to keep the password from other nodes: the client was used as it was, `nodes` ignored.
    from redis.asyncio import Redis

    client = Redis(host="127.0.0.1", port=1)  # never connected: the tier refuses to be made
    with pytest.raises(kt.ConfigError, match="not to a client passed in"):
        make_tier({"url": "redis://127.0.0.1:7000/0", "client": client, **extra})
