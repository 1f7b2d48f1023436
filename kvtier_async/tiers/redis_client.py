"""What the redis-py client a `RedisTier` makes for itself (a Cluster, TLS) may read and reach.

- **Replies are bounded by what was asked** (`BoundedRESP2Parser`, `reply_allowance`): every
  command a connection sends adds what its reply can legitimately hold (a GETRANGE its range,
  an EXISTS or a SET a few bytes, COMMAND `MAX_COMMAND_REPLY_BYTES`, anything else
  `MAX_OTHER_REPLY_BYTES`); every line, bulk
  body and aggregate element read is charged against the sum for the replies outstanding,
  each line and element at `ITEM_COST` bytes at least (a Python object each). A bulk or
  aggregate header asking for more than is left fails before anything is read or built, as
  does nesting deeper than `MAX_DEPTH`. On failure redis-py drops the connection (as on any
  error while reading): the call fails, a counted fault, the load a miss. One pure-Python
  RESP2 parser reads every reply, on every connection the client makes: hiredis builds what a
  header announces (an array of 2^32 elements: 32 GiB of address space) before a byte of it
  has arrived, so it is not used here.
- **The protocol is pinned** (`client_options`): RESP2, with maintenance notifications off, so
  that redis-py neither swaps the parser (it does on a failed HELLO) nor follows a RESP3
  MOVING push to another host, where it would send the password first. A connection keeps
  our parser whatever redis-py asks for (`set_parser`).
- **Nodes are the configuration's** (`AllowedNodes`, `guarded_connection_class`): redis-py
  connects to whatever address `CLUSTER SLOTS` or a `MOVED` reply names, and sends the
  password there first. A connection to an address outside the allowed ones is refused before
  its socket is opened: no byte, and no password, reaches it. The tier counts each refusal and
  warns once per address. A standalone server's connections are held to the URL's host and
  port.
- **Long values move a piece at a time** (`guarded_connection_class`): a pipeline is written
  piece by piece as the connection drains, not joined by `writelines`, a long reply read a
  socket read at a time, and a long aggregate built an element at a time (COMMAND's, which a
  Cluster client reads on its first call); each piece within the turn's budget the tier's calls
  share (`TurnBudget`), since a Cluster's pipelines all wake in one turn of the loop.

The direct connections (`redis_direct`) read their replies by their own means.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

from redis._parsers import _AsyncRESP2Parser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse

from ..turn_budget import TurnBudget

__all__ = [
    "MAX_OTHER_REPLY_BYTES",
    "AllowedNodes",
    "BoundedRESP2Parser",
    "ReplyAllowance",
    "client_options",
    "guarded_connection_class",
    "reply_allowance",
]

#: A reply to a command other than those below (CLUSTER SLOTS of a large cluster, CONFIG GET)
#: holds at most this much, items at `ITEM_COST` each.
MAX_OTHER_REPLY_BYTES = 4 << 20

#: COMMAND (a Cluster client asks once, for the key positions of every command): 0.8 MiB as
#: charged from Redis 7.0's 240 commands; servers with modules have more.
MAX_COMMAND_REPLY_BYTES = 16 << 20

#: An integer, a status or an error: what EXISTS, DEL, SET and the handshake's commands answer.
SMALL_REPLY_BYTES = 1024
SMALL_REPLY_COMMANDS = frozenset(
    {b"EXISTS", b"DEL", b"UNLINK", b"SET", b"AUTH", b"SELECT", b"PING", b"READONLY", b"ASKING", b"CLIENT"}
)

#: What one line or aggregate element is charged at least: about what it costs as a Python object.
ITEM_COST = 64

#: A line (a header, a status, an error) is at most this long.
MAX_LINE_BYTES = 64 << 10

#: Aggregates nest this deep at most (CLUSTER SLOTS: 4, COMMAND's key specs: 8).
MAX_DEPTH = 16


def reply_allowance(args: tuple[Any, ...]) -> int:
    """The most a reply to the command `args` (as redis-py packs it) can hold, in charged bytes."""
    verb = args[0] if args else b""
    verb = (verb.encode() if isinstance(verb, str) else bytes(verb)).split(b" ", 1)[0].upper()
    if verb == b"GETRANGE" and len(args) == 4:
        try:
            start, end = int(args[2]), int(args[3])
        except (TypeError, ValueError):
            return MAX_OTHER_REPLY_BYTES
        if 0 <= start <= end:
            return end - start + 1 + SMALL_REPLY_BYTES
    if verb in SMALL_REPLY_COMMANDS:
        return SMALL_REPLY_BYTES
    if verb == b"COMMAND":
        return MAX_COMMAND_REPLY_BYTES
    return MAX_OTHER_REPLY_BYTES


class ReplyAllowance:
    """What the replies outstanding on one connection may still hold."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.outstanding = 0  # replies expected
        self.left = 0  # charged bytes they may still hold

    def expect(self, args: tuple[Any, ...]) -> None:
        self.outstanding += 1
        self.left += reply_allowance(args)

    def check(self, nbytes: int) -> None:
        """Raise unless `nbytes` more would fit."""
        if nbytes > self.left:
            raise InvalidResponse("a reply longer than its command can return (not a server we trust)")

    def charge(self, nbytes: int) -> None:
        self.check(nbytes)
        self.left -= nbytes

    def replied(self) -> None:
        self.outstanding -= 1
        if self.outstanding <= 0:  # what the replies did not use is not carried over
            self.reset()


class BoundedRESP2Parser(_AsyncRESP2Parser):
    """A RESP2 parser charging what it reads to its connection's `ReplyAllowance` before it
    reads or builds it. It reads the socket a buffer at a time and parses from that buffer
    (redis-py's Python parser awaits the stream once per line: twice as slow for small
    replies), and a long bulk string's rest as it arrives."""

    def __init__(self, socket_read_size: int) -> None:
        super().__init__(socket_read_size)
        self.allowance = ReplyAllowance()  # the connection's, from on_connect
        self.turn = TurnBudget()  # the connection's, shared by the client's: from on_connect
        self._data = b""  # read from the socket, not yet parsed from `_at` on
        self._at = 0

    def on_connect(self, connection: Any) -> None:
        super().on_connect(connection)  # type: ignore[no-untyped-call]
        self.allowance = connection.reply_allowance
        self.turn = connection.turn_budget
        self._data, self._at = b"", 0

    def on_disconnect(self) -> None:
        super().on_disconnect()  # type: ignore[no-untyped-call]
        self.allowance.reset()  # no reply outstanding comes on a new connection
        self._data, self._at = b"", 0

    async def can_read(self) -> bool:
        if self._connected and self._at < len(self._data):
            return True
        return bool(await super().can_read())

    async def read_response(self, disable_decoding: bool = False, **_: Any) -> Any:
        # A reply cut short (a timeout, an error) leaves the buffer mid-reply: redis-py drops
        # the connection then, and on_disconnect empties it.
        if not self._connected or self._stream is None or self.encoder is None:
            raise RedisConnectionError("the connection is closed")
        response = await self._reply(disable_decoding, 0)
        self.allowance.replied()
        return response

    def _socket(self) -> asyncio.StreamReader:
        if self._stream is None:
            raise RedisConnectionError("the connection is closed")
        return self._stream

    async def _more(self) -> None:
        """Read what the socket has (a buffer's worth at most) after what is left unparsed."""
        data = await self._socket().read(self._read_size)
        if not data:
            raise RedisConnectionError("the server closed the connection")
        self._data = self._data[self._at :] + data
        self._at = 0

    async def _line(self) -> bytes:
        while True:
            end = self._data.find(b"\r\n", self._at)
            if end >= 0:
                line = self._data[self._at : end]
                self._at = end + 2
                self.allowance.charge(len(line) + 2 + ITEM_COST)
                return line
            if len(self._data) - self._at > MAX_LINE_BYTES:
                raise InvalidResponse(f"a reply line longer than {MAX_LINE_BYTES} bytes")
            await self._more()

    async def _exactly(self, n: int) -> bytes:
        have = len(self._data) - self._at
        if have >= n:
            data = self._data[self._at : self._at + n]
            self._at += n
            return data
        # The rest as it arrives, not with readexactly: asyncio's stream stops reading the
        # socket while it holds more than 128 KiB, and resumes each time it is waited on again.
        # A read's worth at a time, and the value's join, within the turn's budget: the client's
        # connections are all woken in one turn of the loop as their data comes (a Cluster's 12
        # pipelines of 1 MiB values: each copying what it holds, 5-25 ms of the loop's CPU).
        parts, need = [self._data[self._at :]], n - have
        self._data, self._at = b"", 0
        while need > 0:
            await self.turn.enter()
            part = await self._socket().read(min(need, self._read_size))
            if not part:
                raise RedisConnectionError("the server closed the connection")
            parts.append(part)
            need -= len(part)
        await self.turn.enter()  # the copy below: a read wakes every connection in one turn
        return b"".join(parts)

    async def _reply(self, disable_decoding: bool, depth: int) -> Any:
        raw = await self._line()
        byte, rest = raw[:1], raw[1:]
        response: Any
        if byte == b"-":
            error = self.parse_error(rest.decode("utf-8", errors="replace"))  # type: ignore[no-untyped-call]
            if isinstance(error, RedisConnectionError):
                raise error
            return error  # a ResponseError: in place, for the pipeline's caller
        if byte == b"+":
            response = rest
        elif byte == b":":
            return _number(rest, raw, allow_negative=True)
        elif byte == b"$":
            length = _number(rest, raw)
            if length < 0:
                return None
            self.allowance.charge(length + 2)
            response = await self._exactly(length)
            if await self._exactly(2) != b"\r\n":
                raise InvalidResponse("Protocol Error: a bulk string of another length than announced")
        elif byte == b"*":
            count = _number(rest, raw)
            if count < 0:
                return None
            if depth >= MAX_DEPTH:
                raise InvalidResponse(f"a reply nested deeper than {MAX_DEPTH}")
            self.allowance.check(count * ITEM_COST)  # before a list of `count` is built
            items = []
            for _ in range(count):
                # Within the turn's budget: a long aggregate is in the buffer already, and
                # would be built in one turn of the loop (COMMAND's 11,000 elements, which a
                # Cluster client reads on its first call: 12-18 ms of the loop's CPU).
                await self.turn.enter()
                items.append(await self._reply(disable_decoding, depth + 1))
            return items
        else:
            raise InvalidResponse(f"Protocol Error: {raw[:64]!r}")
        if disable_decoding is False and self.encoder is not None:
            response = self.encoder.decode(response)  # type: ignore[no-untyped-call]
        return response


def _number(text: bytes, raw: bytes, *, allow_negative: bool = False) -> int:
    """A header's or an integer reply's number (at most 20 digits: the line is charged already)."""
    try:
        value = int(text) if len(text) <= 20 else None
    except ValueError:
        value = None
    if value is None or (value < -1 and not allow_negative):
        raise InvalidResponse(f"Protocol Error: {raw[:64]!r}")
    return value


def client_options() -> dict[str, Any]:
    """What every redis-py client the tier makes is given: RESP2 and no maintenance
    notifications (see the module's docstring)."""
    from redis.maint_notifications import MaintNotificationsConfig

    return {"protocol": 2, "maint_notifications_config": MaintNotificationsConfig(enabled=False)}


class AllowedNodes:
    """The nodes the tier may connect to: entries "host" (any port) or "host:port"
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
    def of_url(cls, url: str, *, any_port: bool = True) -> AllowedNodes:
        """The URL's host: at any port (a Cluster's default: its nodes on one host), or at the
        URL's port only (a standalone server)."""
        parts = urlsplit(url)
        host = parts.hostname
        if not host:
            return cls([])
        entry = host if ":" not in host else f"[{host}]"
        return cls([entry if any_port else f"{entry}:{parts.port or 6379}"])

    def resolve(self) -> None:
        """Add the addresses each name resolves to (blocking: DNS)."""
        for host, port in self.entries:
            try:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError:
                continue  # not resolvable now: the name alone is allowed
            self._allowed.update((str(info[4][0]), port) for info in infos)

    def __contains__(self, address: tuple[str, Any]) -> bool:
        host, port = address
        host = str(host).strip("[]").lower()
        if (host, None) in self._allowed:
            return True
        try:
            return (host, int(port)) in self._allowed
        except (TypeError, ValueError):
            return False  # a port that is no number: not a node of ours


def guarded_connection_class(
    base: type, allowed: AllowedNodes | None, refused: Callable[[str, int], None], turn: TurnBudget
) -> type:
    """`base` (redis-py's `Connection`, `SSLConnection` or `UnixDomainSocketConnection`)
    reading every reply through `BoundedRESP2Parser`, and, unless `allowed` is None (a unix
    socket), refusing to open a socket to an address not in `allowed` (`refused(host, port)`
    is told first). Its connections write and read long values a piece at a time, within the
    turns of the loop that `turn` (the tier's) shares out."""

    class GuardedConnection(base):  # type: ignore[misc]
        def __init__(self, **kwargs: Any) -> None:
            self.reply_allowance = ReplyAllowance()
            self.turn_budget = turn
            kwargs["parser_class"] = BoundedRESP2Parser
            super().__init__(**kwargs)

        def set_parser(self, parser_class: type) -> None:
            # redis-py swaps parsers on a protocol change (a failed HELLO): ours stays.
            super().set_parser(BoundedRESP2Parser)

        def pack_command(self, *args: Any) -> Any:
            # Every command sent is packed here (pipelines too): its reply's allowance.
            self.reply_allowance.expect(args)
            return super().pack_command(*args)

        async def _send_packed_command(self, command: Iterable[bytes]) -> None:
            # Piece by piece (a value is a piece of its own: `pack_commands`), each once the
            # transport has sent what it held. Not redis-py's `writelines`: asyncio's own loop
            # before Python 3.12 joins a whole pipeline into one bytes on the loop, then copies
            # what the socket does not take into its buffer (a node's share of 64 x 1 MiB:
            # 8-16 ms of the loop's CPU in one turn). And within the turn's budget: a Cluster's
            # pipelines all drain in one turn, each then writing its next MiB.
            writer = self._writer
            if writer is None or writer.transport.is_closing():
                raise RedisConnectionError("Connection closed by the server before write")
            try:
                for piece in command:
                    await turn.enter()
                    writer.write(piece)
                    await writer.drain()
            except (TypeError, AttributeError) as exc:
                # As redis-py: Python 3.12 to 3.13.9 and 3.14.0 can leak these from a transport
                # whose connection was lost while writing (CPython gh-136234).
                if writer.transport.is_closing():
                    raise RedisConnectionError("Connection closed by the server while writing") from exc
                raise

        async def _connect(self) -> None:
            try:
                if allowed is not None and (self.host, self.port) not in allowed:
                    refused(self.host, self.port)
                    raise RedisConnectionError(
                        f"node {self.host}:{self.port} is not among the tier's allowed nodes"
                    )
                await super()._connect()
            except BaseException:
                # Commands packed for this socket were never sent: no reply of theirs comes.
                self.reply_allowance.reset()
                raise

    return GuardedConnection
