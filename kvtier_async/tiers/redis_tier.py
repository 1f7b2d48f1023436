"""`RedisTier`: blocks in Redis or Valkey, standalone or Cluster, shared by every instance using it.

Each block is one string value, `<prefix>:<namespace id hex>:<key hex>`, in the
self-verifying block format (a 4096-byte header with checksums, then the
payload), so a value that was changed, truncated or written for another
namespace reads as a miss. Batches go out as pipelines (per node on a
Cluster), through redis-py's asyncio client (on a client the tier makes, its replies bounded
and its connections held to the configured nodes by `redis_client`).

Where the time goes, and what we do about it (`bench/remote_tiers.py` measures it):

- At most `max_connections` pipelines are at the server at once (`ServerGate`); the rest wait
  their turn, loads first, within `timeout_s`. redis-py's pool raises the moment it runs out
  of connections instead of waiting, which a serving frontend's concurrency easily reaches.
- With a standalone server reached over TCP or a unix socket, blocks move through
  connections of our own (`redis_direct.DirectConnections`): a load is read by the kernel
  straight into the primary tier, where redis-py would copy each reply four times on the
  event loop, and a store sends the header and the block's own memory. Only the checksum is
  computed. With a secret, values are sealed and opened in a small pool of their own
  (`SEALED_POOL_BYTES`), so that a value is still in the CPU's cache when it is opened or sent.
- Elsewhere (a Cluster, TLS, a client passed in) redis-py carries the blocks: a stored value is
  assembled in a new buffer first, the GIL released (`buffers`), and a value over
  `READ_PIECE_BYTES` is read as ranges of it (GETRANGE, in one pipeline), since the parser
  builds each reply as one `bytes` object on the event loop, 2 ms or more for 8 MiB. On the
  clients the tier makes, a pipeline goes out and comes back a piece at a time, within the
  loop turns' budget (`redis_client`).
- Checksums and copies of more than 1 MiB a call run on worker threads (`run_cpu`).
- A store writes without asking first which keys the server holds, and the existence checks
  of concurrent lookups share pipelines (`Coalescer`).

Every server call is bounded by `timeout_s`, the wait for a place included: a server that is
down or slow makes stores return False and loads miss, counted in stats, and the next call
simply tries again (redis-py reconnects), so the tier recovers when the server does.

The tier keeps no record of what the server holds: a restarted server that lost everything,
or one whose `maxmemory` policy evicted a block, is read as it is (a miss).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import ipaddress
import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..block_format import (
    HEADER_BYTES,
    BlockSealer,
    CorruptBlockError,
    block_codec,
    encode_headers,
    payload_hasher,
    verify_header,
)
from ..coalesce import Coalescer
from ..errors import ConfigError
from ..redact import redact_url
from ..secret import load_private_value, load_tier_secret
from ..server_gate import ServerGate
from ..slot_pool import SlotPool, for_batches_in_flight
from ..spec import OffloadingSpec
from ..tier import SecondaryTierManager
from ..tier_resource import INLINE_CPU_BYTES
from .redis_client import AllowedNodes, client_options, guarded_connection_class
from .redis_direct import SOCKET_BUFFER_BYTES, DirectConnections

__all__ = ["RedisTier"]

log = logging.getLogger(__name__)

#: Redis refuses bulk strings longer than proto-max-bulk-len, 512 MiB unless configured.
DEFAULT_MAX_VALUE_BYTES = 512 << 20

#: Values longer than this are read as ranges of at most this many bytes (a 1 MiB block whole).
#: Raw redis-py pipelines on uvloop, 8 MiB values, 256 MiB read at 8 pipelines at once: loop
#: lag p99 1.7-2.2 ms read in 1 MiB ranges, 4.3-6.6 ms read whole, at the same throughput.
READ_PIECE_BYTES = HEADER_BYTES + (1 << 20)

#: With a secret (direct connections), sealed values are read into and built in a pool this
#: small, so that a value is opened, or sent, while it is still in the CPU's cache. With 256
#: MiB every value had left the cache by the time its batch had landed: on loopback and 2
#: cores, sealed loads of 1 MiB blocks ran at 0.84x the unsealed tier's speed; in the same
#: experiment 1.09x with the opening left out but 0.89x with a plain copy in its place, so the
#: memory traffic, not AES, was the cost. `bench/redis_sealed_pool.py` measures pool sizes.
SEALED_POOL_BYTES = 32 << 20

#: ...and room for this many values at least: values of several MiB have left the cache by
#: the time they have landed whatever the pool's size, and with fewer at once (4 of 8 MiB:
#: 0.82x) the server was kept waiting.
SEALED_POOL_VALUES = 16

#: Existence checks that share one pipeline at most (`Coalescer`): a reply of ~4 bytes each.
EXISTS_PER_PIPELINE = 1024


def _is_loopback(host: str | None) -> bool:
    if not host or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _positive_number(name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"redis tier: {name} must be a number > 0, got {value!r}")


class RedisTier(SecondaryTierManager):
    """Blocks as values in Redis (`cluster=True`: a Redis Cluster), each under its own name.

    A `client` passed in (a `redis.asyncio.Redis` or `RedisCluster`) is used as it is and not
    closed by the tier: an escape hatch outside the tier's reply bound and node allow-list,
    which apply only to the clients the tier makes (`nodes` and a password source next to one
    are refused). Otherwise the tier makes one from `url` and owns it. `max_connections` bounds
    the pipelines the tier has at the server at once (per node on a Cluster); a client passed
    in must allow that many. On a Cluster, the tier connects only to `nodes` ("host" or
    "host:port"; by default the URL's host), so the password goes nowhere else (`redis_client`).
    """

    # What an engine stores is mostly what its lookup has just missed: an EXISTS round trip
    # before each write mostly confirms an absence, and a SET of a held block writes the same
    # bytes again. `bench/remote_tiers.py`: stores 7-13% faster without it (64 KiB to 8 MiB).
    check_held_before_write = False

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str = "redis",
        *,
        url: str = "redis://localhost:6379/0",
        cluster: bool = False,
        prefix: str = "kvtier",
        ttl_s: float | None = None,
        timeout_s: float = 2.0,
        max_connections: int = 32,
        socket_buffer_bytes: int | None = SOCKET_BUFFER_BYTES,
        client: Any = None,
        password_env: str | None = None,
        password_file: str | None = None,
        secret_env: str | None = None,
        secret_file: str | None = None,
        secret: object = None,
        nodes: Sequence[str] | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        tier_secret = load_tier_secret(
            tier_type, secret_env=secret_env, secret_file=secret_file, secret=secret
        )
        if not isinstance(url, str):
            raise ConfigError("redis tier: url must be a redis://, rediss:// or unix:// URL")
        self.where = redact_url(url)
        try:  # urllib's messages quote the URL's parts: none of them reaches ours
            parts = urlsplit(url)
            parts.port  # noqa: B018 (read for its ValueError)
        except ValueError:
            raise ConfigError(f"redis tier: the url {self.where} is malformed") from None
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ConfigError("redis tier: url must be a redis://, rediss:// or unix:// URL")
        if "protocol" in parse_qs(parts.query):
            raise ConfigError(
                "redis tier: the url may not set protocol= (the tier speaks RESP2: redis_client)"
            )
        password = load_private_value(tier_type, "password", env=password_env, file=password_file)
        #: A password from password_env / password_file; it overrides one in the URL.
        self._password = None if password is None else password.decode()
        if not isinstance(cluster, bool):
            raise ConfigError(f"redis tier: cluster must be True or False, got {cluster!r}")
        if cluster and parts.scheme == "unix":
            raise ConfigError("redis tier: a Redis Cluster is reached over TCP, not a unix socket")
        if client is not None and (nodes is not None or password is not None):
            # A client passed in connects, authenticates and parses as it was made: an allow-list
            # or a password given next to it would do nothing, so it is refused, not ignored.
            raise ConfigError(
                "redis tier: nodes, password_env and password_file apply to the client the tier "
                "makes, not to a client passed in (configure that client itself)"
            )
        if nodes is not None and not cluster:
            raise ConfigError("redis tier: nodes (the cluster nodes allowed) is for cluster=True")
        if nodes is not None and (isinstance(nodes, str) or not all(isinstance(n, str) for n in nodes)):
            raise ConfigError('redis tier: nodes must be a list of "host" or "host:port" strings')
        try:
            #: The Cluster nodes the tier may connect to (and send the password to).
            self.allowed_nodes = AllowedNodes(nodes) if nodes is not None else AllowedNodes.of_url(url)
        except ValueError as exc:
            raise ConfigError(f"redis tier: nodes: {exc}") from None
        self._nodes_refused: set[tuple[str, int]] = set()
        #: A standalone server's connections go to the URL's host and port only.
        self._standalone_node = AllowedNodes.of_url(url, any_port=False)
        if not isinstance(prefix, str) or not prefix:
            raise ConfigError(f"redis tier: prefix must be a non-empty str, got {prefix!r}")
        _positive_number("ttl_s", ttl_s, optional=True)
        _positive_number("timeout_s", timeout_s)
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise ConfigError(f"redis tier: max_connections must be an int >= 1, got {max_connections!r}")
        if socket_buffer_bytes is not None and (
            isinstance(socket_buffer_bytes, bool)
            or not isinstance(socket_buffer_bytes, int)
            or socket_buffer_bytes < 4096
        ):
            raise ConfigError(
                f"redis tier: socket_buffer_bytes must be an int >= 4096 or None, got {socket_buffer_bytes!r}"
            )
        self._socket_buffer_bytes = socket_buffer_bytes
        self.codec = block_codec(offloading_spec.namespace, tier_secret)
        self.value_nbytes = self.codec.value_nbytes(self.block_nbytes)
        if self.value_nbytes > DEFAULT_MAX_VALUE_BYTES:
            raise ConfigError(
                f"redis tier: a block is stored as a {self.value_nbytes}-byte value, larger than "
                f"Redis accepts ({DEFAULT_MAX_VALUE_BYTES} bytes, proto-max-bulk-len); use smaller blocks"
            )
        self.cluster = cluster
        self.timeout_s = float(timeout_s)
        self._url = url
        if parts.scheme == "redis" and not _is_loopback(parts.hostname):
            log.warning(
                "redis tier: %s is reached in plain text (redis://); use rediss:// (TLS) "
                "off this machine, so that neither blocks nor the password cross the network in clear",
                self.where,
            )
        self._ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._max_connections = max_connections
        self._client = client
        self._owns_client = client is None
        self._direct: DirectConnections | None = None  # set up when the tier opens, where it applies
        #: With a secret, on the direct connections: where values are sealed and read.
        self._sealed_values: SlotPool | None = None
        self._namespace = self.codec.namespace_tag
        self._name_prefix = f"{prefix}:{self._namespace.hex()}:".encode()
        self.gate = ServerGate(f"{tier_type}/server", max_connections, self.timeout_s)
        #: The existence checks of concurrent lookups share pipelines.
        self._exists = Coalescer(self._exists_now, EXISTS_PER_PIPELINE)
        #: A value read back as ranges: (start, end inclusive) of each. The last one asks for a
        #: byte past our values' length, so a longer value (not one of ours) shows as one, and no
        #: reply is larger than a range whatever the server holds under the name.
        self._read_ranges = [
            (start, min(start + READ_PIECE_BYTES, self.value_nbytes + 1) - 1)
            for start in range(0, self.value_nbytes, READ_PIECE_BYTES)
        ]

    def value_name(self, key: bytes) -> bytes:
        """The Redis key a block is stored under (keyed with a secret)."""
        return self._name_prefix + self.codec.name(key).hex().encode()

    # -- opening and closing -------------------------------------------------------------------
    async def open_backend(self) -> None:
        if self._client is None:
            # On a worker thread: redis-py reads its package metadata from disk when it
            # builds a client, and again for each connection unless told its version.
            self._client = await self.run_blocking(self._make_client)
            if not self.cluster and urlsplit(self._url).scheme in ("redis", "unix"):
                from redis.asyncio.connection import parse_url

                options = parse_url(self._url)
                if self._password is not None:
                    options["password"] = self._password
                self._direct = DirectConnections(options, self.timeout_s, self._socket_buffer_bytes)
                if self.codec.sealed:  # where sealed values are built and read
                    self._sealed_values = for_batches_in_flight(
                        self.offloading_spec.limits,
                        self.value_nbytes,
                        SEALED_POOL_BYTES,
                        min_slots=SEALED_POOL_VALUES,
                    )
                    await self.run_blocking(self._sealed_values.populate)
        await self.gate.call(self._check_value_limit())

    def _make_client(self) -> Any:
        options: dict[str, Any] = {
            **client_options(),
            "max_connections": self._max_connections,
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
        }
        if self._password is not None:
            options["password"] = self._password
        version = importlib.metadata.version("redis")
        try:
            from redis.driver_info import DriverInfo  # redis-py 7.1+

            options["driver_info"] = DriverInfo(lib_version=version)
        except ImportError:
            options["lib_version"] = version
        if self.cluster:
            from redis.asyncio.cluster import RedisCluster

            self.allowed_nodes.resolve()
            cluster = RedisCluster.from_url(self._url, **options)
            # RedisCluster takes no connection class of ours: set it where it makes its nodes'
            # connections (its connection kwargs, shared with its nodes manager, and the
            # start-up node it already made).
            guarded = guarded_connection_class(
                cluster.connection_kwargs["connection_class"],
                self.allowed_nodes,
                self._node_refused,
                self._turn,
            )
            cluster.connection_kwargs["connection_class"] = guarded
            for node in cluster.nodes_manager.startup_nodes.values():
                node.connection_class = guarded
            return cluster
        from redis.asyncio import BlockingConnectionPool, Redis
        from redis.asyncio.connection import Connection, parse_url

        # Held to the URL's host and port: nothing redis-py is told may take it (or the
        # password) elsewhere.
        base = parse_url(self._url).get("connection_class", Connection)
        allowed = None if base.__name__ == "UnixDomainSocketConnection" else self._standalone_node
        guarded = guarded_connection_class(base, allowed, self._node_refused, self._turn)
        # The gate keeps us within max_connections; a blocking pool waits rather than raise
        # should anything else take a connection meanwhile.
        return Redis.from_pool(
            BlockingConnectionPool.from_url(
                self._url, timeout=self.timeout_s, connection_class=guarded, **options
            )
        )

    def _node_refused(self, host: str, port: int) -> None:
        """An address outside the allowed ones was to be connected to (loop thread): a node a
        Cluster's topology names, or anywhere but a standalone server's URL."""
        self.counters["cluster_nodes_refused"] += 1
        if (host, port) not in self._nodes_refused:
            self._nodes_refused.add((host, port))
            log.warning(
                "redis tier %r: redis-py was to connect to %s:%s, which is not among the allowed nodes; "
                "not connected to it (list the cluster's nodes in the tier's 'nodes' to allow them)",
                self.name,
                host,
                port,
            )

    async def _check_value_limit(self) -> None:
        """A server configured for smaller values than our blocks would refuse every store."""
        from redis.exceptions import ResponseError

        try:
            reply = await self._client.config_get("proto-max-bulk-len")
        except ResponseError:
            return  # CONFIG is disabled on many managed servers: rely on the default
        if self.cluster and reply and all(isinstance(v, dict) for v in reply.values()):
            reply = next(iter(reply.values()))  # one answer per node
        limit = int(reply.get("proto-max-bulk-len", DEFAULT_MAX_VALUE_BYTES)) if reply else None
        if limit is not None and limit < self.value_nbytes:
            raise ConfigError(
                f"redis tier: the server takes values of at most {limit} bytes "
                f"(proto-max-bulk-len); a block needs {self.value_nbytes}"
            )

    async def close_backend(self) -> None:
        if self._direct is not None:
            await self._direct.aclose()
        if self._owns_client and self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    # -- the hooks -----------------------------------------------------------------------------
    async def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        # docstring inherited
        names = [self.value_name(key) for key in keys]
        await self._ready()
        if self._direct is not None and not self.codec.sealed:  # the header, then the block's memory
            nbytes = len(keys) * self.block_nbytes
            headers = await self.run_cpu(nbytes, encode_headers, list(keys), list(blocks), self._namespace)
            values = [[header, block] for header, block in zip(headers, blocks)]
            replies = await self.gate.call(self._direct.set_from(names, values, self._ttl_ms))
            stored = [reply == "OK" for reply in replies]
        elif self._direct is not None:  # sealed: each value built whole in the pool, then sent
            replies = await self._write_sealed_direct(keys, blocks, names)
            stored = [reply == "OK" for reply in replies]
        else:  # redis-py sends a value as one buffer
            nbytes = len(keys) * self.value_nbytes
            joined = await self.run_cpu(nbytes, self.codec.encode_values, list(keys), list(blocks))

            def send(pipe: Any) -> None:
                for name, value in zip(names, joined):
                    pipe.set(name, value, px=self._ttl_ms)

            replies = await self._pipeline(send)
            stored = [reply is True for reply in replies]
        refused = [reply for reply in replies if isinstance(reply, Exception)]
        if refused:  # e.g. OOM under maxmemory-policy noeviction: the server answered, and said no
            self.counters["writes_refused"] += len(refused)
            self.fault_log.warning(
                ("refused", type(refused[0])),
                "tier %r: the server refused %d of %d writes: %s",
                self.name,
                len(refused),
                len(replies),
                str(refused[0]),
            )
        return stored

    async def read_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        # docstring inherited
        await self._ready()
        if self._direct is not None:
            return await self._read_direct(keys, blocks)
        names = [self.value_name(key) for key in keys]
        ranges = self._read_ranges

        def send(pipe: Any) -> None:
            for name in names:  # never a whole GET: the server may hold anything under the name
                for start, end in ranges:
                    pipe.getrange(name, start, end)

        replies = await self._pipeline(send)
        # Per block, its pieces; a block none of whose pieces came back is absent (not corrupt).
        values = [
            [r if isinstance(r, bytes) and r else None for r in replies[i : i + len(ranges)]]
            for i in range(0, len(replies), len(ranges))
        ]
        nbytes = len(keys) * self.value_nbytes
        ok = await self.run_cpu(nbytes, self.codec.decode_values, list(keys), values, list(blocks))
        self.counters[self.codec.failure_counter] += sum(
            1 for pieces, good in zip(values, ok) if not good and any(p is not None for p in pieces)
        )
        return ok

    async def _read_direct(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        """Each value's header into a buffer of its own, its payload straight into the block;
        sealed, each value into a buffer of its own, opened into the block."""
        names = [self.value_name(key) for key in keys]
        if self.codec.sealed:
            return await self._read_sealed_direct(keys, blocks, names)
        headers = [memoryview(bytearray(HEADER_BYTES)) for _ in keys]
        targets = [[header, block] for header, block in zip(headers, blocks)]
        replies = await self.gate.call(self._direct_connections().get_into(names, targets))
        # True: the value landed whole. False: a value of another length (not one of ours).
        # None: no such value. An error (a value of another type): not ours either, a miss.
        # Each good value's payload checksum is left: taken on the loop, a MiB at a time with a
        # yield after each (a worker thread lags the loop more: its wake-ups compete for the
        # CPUs). 10 rounds of 16 x 8 MiB, 2 x 3 runs: load lag p99 2.2-2.8 ms (the loop busy
        # 2.2-2.8) with a block's checksum at once, 1.6-2.1 ms (busy 1.2-1.5) a MiB at a time,
        # at the same throughput.
        ok = [False] * len(keys)
        unyielded = 0
        for i, reply in enumerate(replies):
            if reply is not True:
                continue
            try:
                expected = verify_header(
                    headers[i], namespace=self._namespace, key=keys[i], payload_len=self.block_nbytes
                )
            except CorruptBlockError:
                continue
            hasher = payload_hasher()
            for start in range(0, self.block_nbytes, INLINE_CPU_BYTES):
                piece = blocks[i][start : start + INLINE_CPU_BYTES]
                hasher.update(piece)
                unyielded += piece.nbytes
                if unyielded >= INLINE_CPU_BYTES:
                    unyielded = 0
                    await asyncio.sleep(0)
            ok[i] = hasher.intdigest() == expected
        self.counters["corrupt_blocks"] += sum(r is True and not g for r, g in zip(replies, ok))
        self.counters["corrupt_blocks"] += sum(r is False for r in replies)
        return ok

    async def _write_sealed_direct(
        self, keys: Sequence[bytes], blocks: Sequence[memoryview], names: list[bytes]
    ) -> list[Any]:
        """Seal each block into a pooled value and send it (direct connections, a secret)."""
        pool, replies = self._pool(), []
        for part in pool.parts(len(keys)):
            n = len(keys[part])
            async with pool.borrowed(n, self.value_nbytes) as values:
                nbytes = n * self.value_nbytes
                await self.run_cpu(nbytes, self._sealer().seal_many, keys[part], blocks[part], values)
                replies += await self.gate.call(
                    self._direct_connections().set_from(names[part], [[v] for v in values], self._ttl_ms)
                )
        return replies

    async def _read_sealed_direct(
        self, keys: Sequence[bytes], blocks: Sequence[memoryview], names: list[bytes]
    ) -> list[bool]:
        """Each value into a pooled buffer, then opened into its block (direct connections)."""
        pool, results = self._pool(), []
        for part in pool.parts(len(keys)):
            n = len(keys[part])
            async with pool.borrowed(n, self.value_nbytes) as values:
                replies = await self.gate.call(
                    self._direct_connections().get_into(names[part], [[v] for v in values])
                )
                landed = [v if r is True else None for r, v in zip(replies, values)]
                nbytes = sum(r is True for r in replies) * self.value_nbytes
                ok = await self.run_cpu(nbytes, self.codec.decode_values, keys[part], landed, blocks[part])
            self.counters[self.codec.failure_counter] += sum(
                (r is True and not g) or r is False for r, g in zip(replies, ok)
            )
            results += ok
        return results

    def _sealer(self) -> BlockSealer:
        if not isinstance(self.codec, BlockSealer):
            raise RuntimeError("redis tier: sealing without a secret")
        return self.codec

    def _pool(self) -> SlotPool:
        if self._sealed_values is None:
            raise RuntimeError("redis tier: sealed values without a pool")
        return self._sealed_values

    def _direct_connections(self) -> DirectConnections:
        if self._direct is None:
            raise RuntimeError("redis tier: direct connections are not set up")
        return self._direct

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        # docstring inherited
        return await self._exists([self.value_name(key) for key in keys])

    async def _exists_now(self, names: list[bytes]) -> list[bool]:
        def send(pipe: Any) -> None:
            for name in names:
                pipe.exists(name)

        return [reply == 1 for reply in await self._pipeline(send)]

    async def delete(self, keys: Sequence[bytes]) -> int:
        # docstring inherited
        names = [self.value_name(key) for key in keys]

        def send(pipe: Any) -> None:
            for name in names:
                pipe.delete(name)

        replies = await self._pipeline(send)
        removed = [key for key, reply in zip(keys, replies) if isinstance(reply, int) and reply > 0]
        self.notify_removed(removed)
        return len(removed)

    def backend_stats(self) -> dict[str, Any]:
        return {
            "url": self.where,
            "cluster": self.cluster,
            "sealed": self.codec.sealed,
            "corrupt_blocks": self.counters["corrupt_blocks"],
            "unauthenticated_blocks": self.counters["unauthenticated_blocks"],
            "sealed_pool_bytes": 0 if self._sealed_values is None else self._sealed_values.nbytes,
            "writes_refused": self.counters["writes_refused"],
            "cluster_nodes_refused": self.counters["cluster_nodes_refused"],
            "server_gate": self.gate.stats(),
            "existence_checks": {"calls": self._exists.calls, "pipelines": self._exists.requests},
        }

    # -- internals -----------------------------------------------------------------------------
    async def _ready(self) -> None:
        """Open first (hooks may be called directly); which connections a hook uses is known then."""
        if not await self._ensure_open():
            raise ConnectionError(f"redis tier {self.name!r}: the server at {self.where} is not reachable")

    async def _pipeline(self, send: Any) -> list[Any]:
        """One non-transactional pipeline (per node on a Cluster) through the gate, bounded by
        `timeout_s`, the wait included. A command that failed on its own (a value evicted
        meanwhile, an out-of-memory answer) comes back as its exception, in place.
        """
        await self._ready()

        async def run() -> list[Any]:
            async with self._client.pipeline(transaction=False) as pipe:
                send(pipe)
                replies: list[Any] = await pipe.execute(raise_on_error=False)
                return replies

        return await self.gate.call(run())
