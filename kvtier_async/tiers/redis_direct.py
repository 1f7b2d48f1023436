"""`DirectConnections`: blocks between the primary tier and a Redis server with no copy on the loop.

redis-py hands every reply over as a `bytes` object built on the event loop: a loaded byte is
copied from the socket into uvloop's read buffer, into asyncio's stream buffer, into hiredis'
buffer, into that `bytes` object, and then by the tier into the primary slot. A stored value
must be one buffer (the header joined to the block), and each command of a pipeline costs its
Python bookkeeping. On a small machine the event loop, busy with all that, is what limits the
tier. These connections speak just enough RESP2 to pipeline GETs and SETs (and AUTH / SELECT
when they connect):

- a GET's payload is read by the kernel straight into the block (an `asyncio.BufferedProtocol`
  hands the transport the block's own memory); the value's header lands in a small buffer of
  its own, and the tier checks it and the block's checksum afterwards, as always;
- a SET goes out as the header and the block's own memory, written as they are: piece by
  piece, each once the transport has sent what it held (`pause_writing` / `resume_writing`).
  Not `writelines`: on asyncio's own loop before Python 3.12 that joins a whole pipeline into
  one `bytes` on the loop, then copies what the socket does not take at once into the
  transport's buffer (16 blocks of 1 MiB: 35-55 ms of the loop's time in one turn); piece by
  piece, the loop copies at most about a piece a turn.

`RedisTier` uses them for a standalone server reached over TCP or a unix socket, with a
client of its own; on a Cluster, over TLS and with a client passed in it goes through
redis-py. A connection whose pipeline failed, timed out or was cancelled is aborted, never
reused: where its stream stands is unknown, nothing may be read into a slot once its call
returned, and nothing of a block may stay queued to be sent (or referenced) after it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from collections.abc import Sequence
from typing import Any

__all__ = ["DirectConnections", "ReplyProtocol", "ServerError"]

#: Bytes of reply lines (and of payload that arrives with them) read at once.
LINE_BUFFER = 64 << 10

#: The socket's send buffer (SO_SNDBUF) by default; its receive buffer (SO_RCVBUF) is twice it.
#: The event loop copies a store's bytes into the kernel itself, and a load's out of it, as much
#: as the buffer holds in one call; Linux lets the buffers grow to 4 and 6 MiB, calls that hold
#: the loop for milliseconds. 128 MiB in 5 rounds, a run each: loop lag p99 during stores
#: 0.9-1.1 ms with 256 KiB, 1.0-3.5 ms without; during loads of 8 MiB blocks 1.9 ms with 512 KiB,
#: 2.8-4.0 ms without, loads 4% slower at 1 MiB (still 1.5x raw redis-py). The kernel keeps twice
#: a buffer's size in flight, so one connection moves at most about 1 MiB per round trip:
#: plenty within a data centre, too little across a slow link.
SOCKET_BUFFER_BYTES = 256 << 10


class ServerError(Exception):
    """The server answered a command with an error (the reply's text)."""


class _Expected:
    """One reply the connection waits for, and where a bulk reply of `nbytes` bytes goes."""

    __slots__ = ("future", "nbytes", "targets")

    def __init__(self, future: asyncio.Future[Any], targets: Sequence[memoryview] | None) -> None:
        self.future = future
        self.targets = [t.cast("B") for t in targets] if targets is not None else []
        self.nbytes = sum(t.nbytes for t in self.targets) if targets is not None else -1


class ReplyProtocol(asyncio.BufferedProtocol):
    """One connection's replies, in order. A bulk reply of the expected length is read into its
    targets (the future's result: True); one of another length is read and dropped (False); a
    null reply is None; `+` and `:` replies are their value; `-` replies are `ServerError`."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._line = bytearray(LINE_BUFFER)
        self._view = memoryview(self._line)
        self._start = 0  # first byte of `_line` not yet parsed
        self._end = 0  # end of the bytes read into `_line`
        self._expected: collections.deque[_Expected] = collections.deque()
        self._reading: _Expected | None = None  # whose payload is being read
        self._targets: list[memoryview] = []  # what is left of its targets
        self._discard = 0  # payload bytes still to drop (a length that was not expected)
        self._crlf = 0  # bytes of the CRLF after a payload still to skip
        self._writable: asyncio.Future[None] | None = None  # set while the transport is full

    # -- what the connection's user calls ------------------------------------------------------
    def expect(self, targets: Sequence[memoryview] | None = None) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._expected.append(_Expected(future, targets))
        return future

    async def write(self, pieces: Sequence[Any]) -> None:
        """Write `pieces` (buffers) in order, each once the transport has room for it."""
        assert self.transport is not None  # connected
        for piece in pieces:
            if self._writable is not None:
                await asyncio.shield(self._writable)
            self.transport.write(piece)

    def abort(self, error: BaseException | None = None) -> None:
        """Drop the connection and every target: nothing is written into them from now on."""
        if self.transport is not None:
            self.transport.abort()
        self._fail(error or ConnectionError("the connection was aborted"))

    # -- asyncio.BufferedProtocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream's (uvloop's is no subclass)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._targets:
            return self._targets[0]  # the block's own memory
        if self._discard:
            return self._view[: min(self._discard, LINE_BUFFER)]
        if self._end == LINE_BUFFER:  # a partial line at the end: move it to the front
            self._line[: self._end - self._start] = self._line[self._start : self._end]
            self._end -= self._start
            self._start = 0
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._targets:
            self._advance_targets(nbytes)
        elif self._discard:
            self._discard -= nbytes
            if not self._discard:
                self._payload_done(False)
        else:
            self._end += nbytes
            self._parse()

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    def eof_received(self) -> bool:
        self._fail(ConnectionError("the server closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        # Not the transport's own error: its traceback holds the frame that read into a block,
        # and the block's view with it, for as long as anyone keeps the error.
        self._fail(ConnectionError(f"the connection was lost: {exc}" if exc else "the connection was closed"))

    # -- parsing -------------------------------------------------------------------------------
    def _parse(self) -> None:
        try:
            while not self._targets and not self._discard:
                if self._crlf:
                    if self._end - self._start < self._crlf:
                        return
                    if self._line[self._start : self._start + self._crlf] != b"\r\n"[2 - self._crlf :]:
                        raise ConnectionError("malformed reply: no CRLF after a bulk string")
                    self._start += self._crlf
                    self._crlf = 0
                eol = self._line.find(b"\r\n", self._start, self._end)
                if eol < 0:
                    if self._start == 0 and self._end == LINE_BUFFER:
                        raise ConnectionError("malformed reply: a line longer than the buffer")
                    return
                line = bytes(self._line[self._start : eol])
                self._start = eol + 2
                self._reply(line)
        except (ConnectionError, ValueError, IndexError) as exc:
            self.abort(ConnectionError(f"redis reply could not be read: {exc}"))
            return
        if self._start == self._end:
            self._start = self._end = 0

    def _reply(self, line: bytes) -> None:
        if not self._expected:
            raise ConnectionError("a reply nobody asked for")
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            length = int(rest)
            if length < 0:
                self._settle(None)
                return
            expected = self._expected[0]
            self._reading = expected
            if length == expected.nbytes:
                self._targets = [t for t in expected.targets if t.nbytes]
            else:
                self._discard = length
            self._take_buffered()
        elif kind == b"+":
            self._settle(rest.decode())
        elif kind == b":":
            self._settle(int(rest))
        elif kind == b"-":
            self._settle(ServerError(rest.decode(errors="replace")))
        else:
            raise ConnectionError(f"a reply of a kind these connections do not read: {line[:20]!r}")

    def _take_buffered(self) -> None:
        """Payload bytes that arrived with the reply's line: copy (or drop) them from the line."""
        available = self._end - self._start
        if self._targets:
            while self._targets and available:
                target = self._targets[0]
                n = min(target.nbytes, available)
                target[:n] = self._view[self._start : self._start + n]
                self._start += n
                available -= n
                self._advance_targets(n, parse=False)
            if not self._targets and self._reading is not None:
                self._payload_done(True, parse=False)
        else:
            n = min(self._discard, available)
            self._start += n
            self._discard -= n
            if not self._discard:
                self._payload_done(False, parse=False)
        if self._targets or self._discard:
            self._start = self._end = 0  # the rest comes straight into the target, or is dropped

    def _advance_targets(self, nbytes: int, *, parse: bool = True) -> None:
        self._targets[0] = self._targets[0][nbytes:]
        if not self._targets[0].nbytes:
            self._targets.pop(0)
            if not self._targets and parse:
                self._payload_done(True)

    def _payload_done(self, landed: bool, *, parse: bool = True) -> None:
        self._reading = None
        self._crlf = 2
        self._settle(landed)
        if parse:
            self._parse()

    def _settle(self, value: Any) -> None:
        future = self._expected.popleft().future
        if future.done():
            return
        if isinstance(value, BaseException):
            _set_exception(future, value)
        else:
            future.set_result(value)

    def _fail(self, error: BaseException) -> None:
        self._targets = []
        self._reading = None
        self._discard = 0
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            _set_exception(writable, error)  # a write waiting for room: the connection is gone
        while self._expected:
            future = self._expected.popleft().future
            if not future.done():
                _set_exception(future, error)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    future.set_exception(error)
    future.exception()  # a caller that was cancelled meanwhile never awaits it: no warning then


def _command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class DirectConnections:
    """Connections to one standalone Redis server for pipelines of GETs into given buffers and
    SETs from given buffers.

    At most as many are open as callers use at once (the tier's `ServerGate` bounds that);
    each goes back to the pool after a pipeline that went through, and is aborted otherwise.
    """

    def __init__(
        self,
        url_options: Any,
        connect_timeout_s: float,
        socket_buffer_bytes: int | None = SOCKET_BUFFER_BYTES,
    ) -> None:
        self._socket_buffer_bytes = socket_buffer_bytes
        self._options = url_options
        self._connect_timeout_s = connect_timeout_s
        self._idle: list[ReplyProtocol] = []
        self._open: set[ReplyProtocol] = set()

    async def get_into(self, names: Sequence[bytes], targets: Sequence[Sequence[memoryview]]) -> list[Any]:
        """GET each name into its targets, in one pipeline: True where the value landed there
        whole (its length was the targets' total), False where it had another length, None
        where the server holds no such name, a `ServerError` where it answered with an error."""
        commands = [_command(b"GET", name) for name in names]
        return await self._pipeline(commands, list(targets))

    async def set_from(
        self, names: Sequence[bytes], values: Sequence[Sequence[Any]], ttl_ms: int | None
    ) -> list[Any]:
        """SET each name to its value, given as buffers sent back to back, in one pipeline:
        "OK" where it was stored, a `ServerError` where the server refused it (a full server)."""
        pieces: list[Any] = []
        expiry = [] if ttl_ms is None else [b"$2\r\nPX\r\n", b"$%d\r\n%d\r\n" % (len(str(ttl_ms)), ttl_ms)]
        for name, value in zip(names, values):
            nbytes = sum(memoryview(piece).nbytes for piece in value)
            pieces.append(
                b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 + len(expiry), len(name), name, nbytes)
            )
            pieces.extend(value)
            pieces.append(b"\r\n")
            pieces.extend(expiry)
        return await self._pipeline(pieces, [None] * len(names))

    async def _pipeline(self, pieces: list[Any], targets: list[Sequence[memoryview] | None]) -> list[Any]:
        """Send `pieces` (the commands, back to back) and await a reply per target."""
        connection = await self._connection()
        try:
            replies = [connection.expect(t) for t in targets]
            await connection.write(pieces)
            results: list[Any] = []
            for reply in replies:
                try:
                    results.append(await reply)
                except ServerError as exc:
                    results.append(exc)
        except BaseException:
            connection.abort()
            self._open.discard(connection)
            raise
        self._idle.append(connection)
        return results

    async def aclose(self) -> None:
        for connection in list(self._open):
            connection.abort()
        self._open.clear()
        self._idle.clear()

    async def _connection(self) -> ReplyProtocol:
        while self._idle:
            connection = self._idle.pop()
            if connection.transport is not None and not connection.transport.is_closing():
                return connection
            self._open.discard(connection)
        loop = asyncio.get_running_loop()
        options = self._options
        if "path" in options:
            connecting = loop.create_unix_connection(ReplyProtocol, options["path"])
        else:
            connecting = loop.create_connection(
                ReplyProtocol, options.get("host", "localhost"), options.get("port", 6379)
            )
        transport, connection = await asyncio.wait_for(connecting, self._connect_timeout_s)
        self._open.add(connection)
        if self._socket_buffer_bytes is not None:  # None: the kernel's own sizing
            with contextlib.suppress(OSError, AttributeError):  # a socket that cannot: its default
                sock = transport.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._socket_buffer_bytes)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2 * self._socket_buffer_bytes)
        try:
            hello = []
            if options.get("password") is not None:
                user = options.get("username")
                auth = (b"AUTH", user.encode()) if user else (b"AUTH",)
                hello.append(_command(*auth, str(options["password"]).encode()))
            if options.get("db"):
                hello.append(_command(b"SELECT", str(int(options["db"])).encode()))
            replies = [connection.expect() for _ in hello]
            if hello:
                assert connection.transport is not None
                connection.transport.write(b"".join(hello))
            for reply in replies:
                await reply  # a ServerError (wrong password, no such db) fails the connection
        except BaseException:
            connection.abort()
            self._open.discard(connection)
            raise
        return connection
