"""What the redis-py client a `RedisTier` makes for itself (a Cluster, TLS) may read and reach.

- **Replies are bounded** (`bounded_parser`): redis-py's parser holds a reply whole in memory
  before handing it over, however long the server says it is, so a hostile or man-in-the-middle
  server answering a 1 MiB GETRANGE with 4 GiB would grow the process by as much. Past `limit`
  bytes received for one reply the parser raises, and redis-py drops the connection (as it does
  on any error while reading): the call fails, a counted fault, the load a miss. The direct
  connections (`redis_direct`) drop such a reply as they read it instead.
- **A Cluster's nodes are the configuration's** (`AllowedNodes`, `guarded_connection_class`):
  redis-py connects to whatever address `CLUSTER SLOTS` or a `MOVED` reply names, and sends
  the password there first. A connection to a node outside the allowed ones is refused before
  its socket is opened: no byte, and no password, reaches it. The tier counts each refusal and
  warns once per address.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

__all__ = ["AllowedNodes", "bounded_parser", "guarded_connection_class"]


def bounded_parser(limit: int) -> type:
    """redis-py's default asyncio parser, failing a reply once more than `limit` bytes of it
    (and of the replies after it, at most one socket read's worth) have arrived."""
    from redis._parsers import _AsyncHiredisParser
    from redis.asyncio.connection import DefaultParser
    from redis.exceptions import InvalidResponse

    hiredis = issubclass(DefaultParser, _AsyncHiredisParser)

    class BoundedReplies(DefaultParser):  # type: ignore[misc,valid-type]
        def __init__(self, socket_read_size: int) -> None:
            super().__init__(socket_read_size)
            self._received = 0  # bytes received since the last whole reply

        def _count(self, nbytes: int) -> None:
            self._received += nbytes
            if self._received > limit:
                raise InvalidResponse(f"a reply longer than {limit} bytes (none of ours is)")

        async def read_response(self, *args: Any, **kwargs: Any) -> Any:
            self._received = 0
            return await super().read_response(*args, **kwargs)

        if hiredis:  # hiredis holds what was fed to it until a reply is whole

            async def read_from_socket(self) -> Any:
                before = self._reader.len()
                result = await super().read_from_socket()
                self._count(self._reader.len() - before)
                return result

        else:  # the pure-Python parsers read a bulk reply's length at once

            async def _read(self, length: int) -> Any:
                self._count(length)
                return await super()._read(length)

    return BoundedReplies


class AllowedNodes:
    """The cluster nodes the tier may connect to: entries "host" (any port) or "host:port"
    ("[v6]:port"), matched by name and by the addresses a name resolves to (`resolve`, on a
    worker thread, when the client is made)."""

    def __init__(self, entries: Iterable[str]) -> None:
        self.entries: list[tuple[str, int | None]] = []
        for entry in entries:
            parts = urlsplit("//" + entry)
            try:
                port = parts.port
            except ValueError:
                port = -1
            if not parts.hostname or port == -1 or parts.path or parts.query or parts.username:
                raise ValueError(f"{entry!r} is not a host or host:port")
            self.entries.append((parts.hostname, port))
        self._allowed: set[tuple[str, int | None]] = set(self.entries)

    @classmethod
    def of_url(cls, url: str) -> AllowedNodes:
        """The default: the URL's host, at any port (a cluster's nodes on one host)."""
        host = urlsplit(url).hostname
        return cls([host if ":" not in host else f"[{host}]"] if host else [])

    def resolve(self) -> None:
        """Add the addresses each name resolves to (blocking: DNS)."""
        for host, port in self.entries:
            try:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError:
                continue  # not resolvable now: the name alone is allowed
            self._allowed.update((str(info[4][0]), port) for info in infos)

    def __contains__(self, address: tuple[str, int]) -> bool:
        host, port = address
        host = host.strip("[]").lower()
        return (host, None) in self._allowed or (host, int(port)) in self._allowed


def guarded_connection_class(
    base: type, allowed: AllowedNodes, refused: Callable[[str, int], None], parser: type
) -> type:
    """`base` (redis-py's `Connection` or `SSLConnection`) reading through `parser`, and
    refusing to open a socket to a node not in `allowed` (`refused(host, port)` is told first)."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    class GuardedConnection(base):  # type: ignore[misc]
        def __init__(self, **kwargs: Any) -> None:
            kwargs["parser_class"] = parser
            super().__init__(**kwargs)

        async def _connect(self) -> None:
            if (self.host, self.port) not in allowed:
                refused(self.host, self.port)
                raise RedisConnectionError(
                    f"cluster node {self.host}:{self.port} is not among the tier's allowed nodes"
                )
            await super()._connect()

    return GuardedConnection
