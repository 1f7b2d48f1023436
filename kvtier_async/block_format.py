"""The self-verifying block format of the tiers that store a block as one value under a name
(Redis, object stores); the file-system tier keeps key and checksum in its index instead
(`tiers/fs/layout.py`).

A stored block is a 4096-byte header followed by the payload:

    offset  size  field
    0       8     magic b"KVTBLK\\x00\\x01"
    8       2     format version (1)
    10      2     key length (1..128)
    12      4     reserved (0)
    16      16    namespace id (BLAKE2b-128 of the namespace)
    32      8     payload length in bytes
    40      8     payload checksum (XXH3-64)
    48      128   key, zero-padded
    176     8     header checksum (XXH3-64 of bytes 0..175)
    184     ...   zero padding to 4096

The payload starts 4096 bytes in, page-aligned within the value. A block is good only if the header
checksum, magic, version, namespace, key and length all match what the reader
expects and the payload hashes to the stored checksum.

A tier may send a value as pieces (the header, then the payload straight from the primary
tier: `encode_header`) and read it back as pieces (ranges of it: `decode_pieces`); the bytes
stored are the same. Every copy and checksum here lets other threads run meanwhile
(`buffers`), so the event loop does not wait for a worker thread's MiB copy.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

import xxhash

from .buffers import copy_into, new_buffer
from .keys import MAX_KEY_BYTES

__all__ = [
    "HEADER_BYTES",
    "CorruptBlockError",
    "decode_block",
    "decode_blocks",
    "decode_pieces",
    "encode_block",
    "encode_blocks",
    "encode_header",
    "encode_headers",
    "namespace_id",
    "pack_header",
    "payload_checksum",
    "payload_hasher",
    "read_header",
    "verify_block",
    "verify_header",
]

HEADER_BYTES = 4096
MAGIC = b"KVTBLK\x00\x01"
VERSION = 1
_FIELDS = struct.Struct("<8sHHI16sQQ128s")
_CHECKED = _FIELDS.size  # 176
_CHECKSUM = struct.Struct("<Q")
_PADDING = bytes(HEADER_BYTES - _CHECKED - _CHECKSUM.size)


class CorruptBlockError(Exception):
    """A stored block failed verification (internal: tiers turn it into a counted miss)."""


def namespace_id(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=16).digest()


def payload_checksum(payload: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def payload_hasher() -> Any:
    """`payload_checksum` in steps: `update()` with the payload's consecutive pieces, then
    `intdigest()`; for a caller that must not spend the time of a whole payload at once."""
    return xxhash.xxh3_64()


def _header_bytes(*, namespace: bytes, key: bytes, payload_len: int, checksum: int) -> bytes:
    """The HEADER_BYTES of a header."""
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes")
    fields = _FIELDS.pack(MAGIC, VERSION, len(key), 0, namespace, payload_len, checksum, key)
    return fields + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(fields)) + _PADDING


def pack_header(into: memoryview, *, namespace: bytes, key: bytes, payload_len: int, checksum: int) -> None:
    """Write a header into `into` (at least HEADER_BYTES long)."""
    into[:HEADER_BYTES] = _header_bytes(
        namespace=namespace, key=key, payload_len=payload_len, checksum=checksum
    )


def read_header(header: memoryview | bytes) -> tuple[bytes, bytes, int, int]:
    """(namespace id, key, payload length, payload checksum) of a header, or CorruptBlockError."""
    if len(header) < _CHECKED + 8:
        raise CorruptBlockError("short header")
    fields = bytes(header[:_CHECKED])
    (stored,) = _CHECKSUM.unpack(header[_CHECKED : _CHECKED + 8])
    if xxhash.xxh3_64_intdigest(fields) != stored:
        raise CorruptBlockError("header checksum mismatch")
    magic, version, key_len, _, namespace, payload_len, checksum, key = _FIELDS.unpack(fields)
    if magic != MAGIC or version != VERSION or not 1 <= key_len <= MAX_KEY_BYTES:
        raise CorruptBlockError("bad magic, version or key length")
    return namespace, key[:key_len], payload_len, checksum


def verify_header(header: memoryview | bytes, *, namespace: bytes, key: bytes, payload_len: int) -> int:
    """Check a header against what the reader expects; returns the payload checksum."""
    got_namespace, got_key, got_len, checksum = read_header(header)
    if got_namespace != namespace or got_key != key or got_len != payload_len:
        raise CorruptBlockError("header names another namespace, key or length")
    return checksum


def encode_header(payload: memoryview, *, namespace: bytes, key: bytes) -> bytes:
    """The header of `payload` stored under `key`: the value is this, then the payload."""
    return _header_bytes(
        namespace=namespace, key=key, payload_len=len(payload), checksum=payload_checksum(payload)
    )


def encode_block(payload: memoryview, *, namespace: bytes, key: bytes) -> memoryview:
    """Header and payload as one value (a new buffer), for tiers that store a block under a name."""
    value = new_buffer(HEADER_BYTES + len(payload))
    copy_into(value[HEADER_BYTES:], payload)
    copy_into(value, encode_header(value[HEADER_BYTES:], namespace=namespace, key=key))  # of the copy
    return value


def decode_pieces(pieces: Sequence[Any], into: memoryview, *, namespace: bytes, key: bytes) -> bool:
    """Copy the payload of a stored value, given as consecutive pieces (bytes-like; None: a
    piece missing), into `into` if every check passes; False otherwise (then `into` may hold
    anything). The first piece holds at least the whole header."""
    if not pieces or any(piece is None for piece in pieces):
        return False
    views = [memoryview(piece).cast("B") for piece in pieces]
    if sum(view.nbytes for view in views) != HEADER_BYTES + len(into) or views[0].nbytes < HEADER_BYTES:
        return False
    at = 0
    for view in [views[0][HEADER_BYTES:], *views[1:]]:
        copy_into(into[at:], view)
        at += view.nbytes
    return verify_block(views[0][:HEADER_BYTES], into, namespace=namespace, key=key)


def verify_block(header: Any, block: memoryview, *, namespace: bytes, key: bytes) -> bool:
    """Whether a header read apart from its payload, and the payload read into `block`, are
    a good block stored under `key`."""
    try:
        checksum = verify_header(header, namespace=namespace, key=key, payload_len=len(block))
    except CorruptBlockError:
        return False
    return payload_checksum(block) == checksum


def decode_block(value: Any, into: memoryview, *, namespace: bytes, key: bytes) -> bool:
    """`decode_pieces` of a value stored whole (bytes-like, or None)."""
    return decode_pieces([value], into, namespace=namespace, key=key)


def encode_headers(keys: Sequence[bytes], blocks: Sequence[memoryview], namespace: bytes) -> list[bytes]:
    """`encode_header` for each block (blocking: a worker thread's work)."""
    return [encode_header(block, namespace=namespace, key=key) for key, block in zip(keys, blocks)]


def encode_blocks(keys: Sequence[bytes], blocks: Sequence[memoryview], namespace: bytes) -> list[memoryview]:
    """`encode_block` for each block (blocking: a worker thread's work)."""
    return [encode_block(block, namespace=namespace, key=key) for key, block in zip(keys, blocks)]


def decode_blocks(
    keys: Sequence[bytes], values: Sequence[Any], blocks: Sequence[memoryview], namespace: bytes
) -> list[bool]:
    """`decode_pieces` for each value, given whole or as a list of pieces, into its block
    (blocking: a worker thread's work)."""
    return [
        decode_pieces(value if isinstance(value, list) else [value], block, namespace=namespace, key=key)
        for key, value, block in zip(keys, values, blocks)
    ]
