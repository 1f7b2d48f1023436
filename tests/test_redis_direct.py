"""`ReplyProtocol`'s reading of RESP2 replies, fed in every way a socket may cut them.

The real server's side (pipelines of GETs against `redis-server`, faults, cancellation) runs
in tests/test_redis_tier.py, where the standalone tier reads through these connections.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from kvtier_async.tiers.redis_direct import LINE_BUFFER, ReplyProtocol, ServerError


class FakeTransport:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted


def feed(protocol: ReplyProtocol, data: bytes, rng: random.Random) -> None:
    """Hand `data` to the protocol as a socket would: into the buffer it asks for, in pieces."""
    at = 0
    while at < len(data):
        buffer = protocol.get_buffer(-1)
        assert len(buffer) > 0
        n = min(len(buffer), len(data) - at, rng.choice([1, 2, 3, 7, 100, 4096, 70_000, 1 << 20]))
        buffer[:n] = data[at : at + n]
        at += n
        protocol.buffer_updated(n)


def bulk(payload: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(payload), payload)


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(40))
async def test_replies_land_where_they_should_however_the_bytes_are_cut(seed: int) -> None:
    rng = random.Random(seed)
    protocol = ReplyProtocol()
    protocol.connection_made(FakeTransport())  # type: ignore[arg-type]
    big = os.urandom(3 * LINE_BUFFER + 17)  # longer than the line buffer: read into the target
    small = os.urandom(100)
    header_a, block_a = bytearray(16), bytearray(len(big) - 16)
    header_b, block_b = bytearray(4), bytearray(len(small) - 4)
    wrong = bytearray(10)
    expected: list[tuple[Any, Any]] = [
        (protocol.expect(), "OK"),
        (protocol.expect([memoryview(header_a), memoryview(block_a)]), True),
        (protocol.expect([memoryview(wrong)]), None),
        (protocol.expect([memoryview(wrong)]), False),  # 12 bytes where 10 were expected: dropped
        (protocol.expect([memoryview(header_b), memoryview(block_b)]), True),
        (protocol.expect(), ServerError),
        (protocol.expect(), 5),
        (protocol.expect([memoryview(wrong)]), False),  # longer than the line buffer, dropped
    ]
    stream = (
        b"+OK\r\n"
        + bulk(big)
        + b"$-1\r\n"
        + bulk(b"x" * 12)
        + bulk(small)
        + b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
        + b":5\r\n"
        + bulk(os.urandom(2 * LINE_BUFFER))
    )
    feed(protocol, stream, rng)
    for future, want in expected:
        assert future.done()
        if want is ServerError:
            assert isinstance(future.exception(), ServerError)
            assert "WRONGTYPE" in str(future.exception())
        else:
            assert future.result() == want
    assert bytes(header_a) + bytes(block_a) == big
    assert bytes(header_b) + bytes(block_b) == small
    assert wrong == bytearray(10)  # a reply of another length never touches the target


@pytest.mark.asyncio
async def test_a_malformed_reply_aborts_the_connection_and_fails_every_waiter() -> None:
    protocol = ReplyProtocol()
    transport = FakeTransport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    target = bytearray(8)
    waiting = [protocol.expect([memoryview(target)]), protocol.expect()]
    feed(protocol, b"$8\r\n12345678XX", random.Random(0))  # no CRLF after the payload
    assert transport.aborted
    assert waiting[0].result() is True  # it landed before the stream went wrong (checked later)
    assert isinstance(waiting[1].exception(), ConnectionError)


@pytest.mark.asyncio
async def test_a_lost_connection_fails_the_waiters_and_lets_go_of_their_targets() -> None:
    protocol = ReplyProtocol()
    protocol.connection_made(FakeTransport())  # type: ignore[arg-type]
    target = bytearray(LINE_BUFFER * 2)
    waiting = protocol.expect([memoryview(target)])
    feed(protocol, b"$%d\r\n" % len(target) + b"a" * 1000, random.Random(1))
    assert protocol.get_buffer(-1).obj is target  # reading straight into the block
    protocol.connection_lost(None)
    assert isinstance(waiting.exception(), ConnectionError)
    assert protocol.get_buffer(-1).obj is not target  # no view of it is left
