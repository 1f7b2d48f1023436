"""`RedisTier`: blocks in Redis or Valkey, standalone or Cluster, shared by every instance using it.

Each block is one string value, `<prefix>:<namespace id hex>:<key hex>`, in the
self-verifying block format (a 4096-byte header with checksums, then the
payload), so a value that was changed, truncated or written for another
namespace reads as a miss. Batches go out as pipelines (per node on a
Cluster); checksums are computed and checked on worker threads. Every server
call is bounded by `timeout_s`: a server that is down or slow makes stores
return False and loads miss, counted in stats, and the next call simply tries
again (redis-py reconnects), so the tier recovers when the server does.

The tier keeps no record of what the server holds: a restarted server that
lost everything is read as it is.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from ..block_format import HEADER_BYTES, decode_blocks, encode_blocks, namespace_id
from ..errors import ConfigError
from ..spec import OffloadingSpec
from ..tier import SecondaryTierManager

__all__ = ["RedisTier"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Redis refuses bulk strings longer than proto-max-bulk-len, 512 MiB unless configured.
DEFAULT_MAX_VALUE_BYTES = 512 << 20


def redact_url(url: str) -> str:
    """The URL without its password, for logs and stats."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***@" if parts.username else "***@"
    host = parts.hostname or ""
    netloc = user + (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _positive_number(name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"redis tier: {name} must be a number > 0, got {value!r}")


class RedisTier(SecondaryTierManager):
    """Blocks as values in Redis (`cluster=True`: a Redis Cluster), each under its own name.

    A `client` passed in (a `redis.asyncio.Redis` or `RedisCluster`) is used
    as it is and not closed by the tier; otherwise the tier makes one from
    `url` and owns it.
    """

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
        client: Any = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        if not isinstance(url, str) or urlsplit(url).scheme not in ("redis", "rediss", "unix"):
            raise ConfigError("redis tier: url must be a redis://, rediss:// or unix:// URL")
        if not isinstance(cluster, bool):
            raise ConfigError(f"redis tier: cluster must be True or False, got {cluster!r}")
        if cluster and urlsplit(url).scheme == "unix":
            raise ConfigError("redis tier: a Redis Cluster is reached over TCP, not a unix socket")
        if not isinstance(prefix, str) or not prefix:
            raise ConfigError(f"redis tier: prefix must be a non-empty str, got {prefix!r}")
        _positive_number("ttl_s", ttl_s, optional=True)
        _positive_number("timeout_s", timeout_s)
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise ConfigError(f"redis tier: max_connections must be an int >= 1, got {max_connections!r}")
        self.value_nbytes = HEADER_BYTES + self.block_nbytes
        if self.value_nbytes > DEFAULT_MAX_VALUE_BYTES:
            raise ConfigError(
                f"redis tier: a block is stored as a {self.value_nbytes}-byte value, larger than "
                f"Redis accepts ({DEFAULT_MAX_VALUE_BYTES} bytes, proto-max-bulk-len); use smaller blocks"
            )
        self.cluster = cluster
        self.timeout_s = float(timeout_s)
        self.where = redact_url(url)
        self._url = url
        self._ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._max_connections = max_connections
        self._client = client
        self._owns_client = client is None
        self._namespace = namespace_id(offloading_spec.namespace)
        self._name_prefix = f"{prefix}:{self._namespace.hex()}:".encode()

    def value_name(self, key: bytes) -> bytes:
        """The Redis key a block is stored under."""
        return self._name_prefix + key.hex().encode()

    # -- opening and closing -------------------------------------------------------------------
    async def open_backend(self) -> None:
        if self._client is None:
            # On a worker thread: redis-py reads its package metadata from disk when it
            # builds a client, and again for each connection unless told its version.
            self._client = await self.run_blocking(self._make_client)
        await self._bounded(self._check_value_limit())

    def _make_client(self) -> Any:
        options: dict[str, Any] = {
            "max_connections": self._max_connections,
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
        }
        version = importlib.metadata.version("redis")
        try:
            from redis.driver_info import DriverInfo  # redis-py 7.1+

            options["driver_info"] = DriverInfo(lib_version=version)
        except ImportError:
            options["lib_version"] = version
        if self.cluster:
            from redis.asyncio.cluster import RedisCluster

            return RedisCluster.from_url(self._url, **options)
        from redis.asyncio import Redis

        return Redis.from_url(self._url, **options)

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
        if self._owns_client and self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    # -- the hooks -----------------------------------------------------------------------------
    async def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        # docstring inherited
        values = await self.run_blocking(encode_blocks, list(keys), list(blocks), self._namespace)
        names = [self.value_name(key) for key in keys]

        async def send(pipe: Any) -> None:
            for name, value in zip(names, values):
                pipe.set(name, memoryview(value), px=self._ttl_ms)

        replies = await self._pipeline(send)
        return [reply is True for reply in replies]

    async def read_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        # docstring inherited
        names = [self.value_name(key) for key in keys]

        async def send(pipe: Any) -> None:
            for name in names:
                pipe.get(name)

        replies = await self._pipeline(send)
        values = [reply if isinstance(reply, bytes) else None for reply in replies]
        ok = await self.run_blocking(decode_blocks, list(keys), values, list(blocks), self._namespace)
        self.counters["corrupt_blocks"] += sum(
            1 for value, good in zip(values, ok) if value is not None and not good
        )
        return ok

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        # docstring inherited
        names = [self.value_name(key) for key in keys]

        async def send(pipe: Any) -> None:
            for name in names:
                pipe.exists(name)

        return [reply == 1 for reply in await self._pipeline(send)]

    async def delete(self, keys: Sequence[bytes]) -> int:
        # docstring inherited
        names = [self.value_name(key) for key in keys]

        async def send(pipe: Any) -> None:
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
            "corrupt_blocks": self.counters["corrupt_blocks"],
        }

    # -- internals -----------------------------------------------------------------------------
    async def _pipeline(self, send: Any) -> list[Any]:
        """One non-transactional pipeline (per node on a Cluster), bounded by `timeout_s`.

        A command that failed on its own comes back as its exception, in place.
        """
        if not await self._ensure_open():
            raise ConnectionError(f"redis tier {self.name!r}: the server at {self.where} is not reachable")

        async def run() -> list[Any]:
            async with self._client.pipeline(transaction=False) as pipe:
                await send(pipe)
                replies: list[Any] = await pipe.execute(raise_on_error=False)
                return replies

        return await self._bounded(run())

    async def _bounded(self, call: Awaitable[T]) -> T:
        return await asyncio.wait_for(call, self.timeout_s)
