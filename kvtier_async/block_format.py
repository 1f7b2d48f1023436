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

With a tier secret (`secret`), a block is *sealed* instead (`BlockSealer`): AES-256-GCM from
`cryptography`, keyed names, nothing of the namespace or the key in clear:

    offset  size  field
    0       8     magic b"KVTSEAL1"
    8       16    writer salt: the block key is HKDF-SHA256(secret, salt, namespace)
    24      12    nonce: a counter below 2^32, unique per writer salt
    36      n     the payload, encrypted
    36+n    16    GCM tag over the payload and the associated data
                  (namespace tag, payload length, key)

Each tier instance draws a fresh random 128-bit writer salt when it is made and counts its
nonces from 0 under the key that salt derives, so a nonce never repeats under one key: by
construction, not by chance (two instances draw the same salt with probability ~2^-128 a
pair). A process made by `fork` draws a salt of its own before its first value, since its
copy of the parent's salt and count would repeat the parent's next nonces: a fork hook
(`os.register_at_fork`) drops the copy, and a pid check per value catches a fork that ran no
Python hook. (Not covered: one VM snapshot resumed twice; nothing in a process can see that.)
After 2^32 values under one salt (`SEALS_PER_SALT`: NIST SP 800-38D's bound on
invocations of one GCM key with random nonces, kept though ours are counters) it draws a
fresh salt, so no key ever seals more. Names are HMAC-SHA256 of the key under a key derived
from the secret and the namespace; the namespace's own tag is an HMAC of its name.
`block_codec` picks the plain or the sealed format for a tier; both answer the same calls
(`BlockCodec`).

A tier may send a value as pieces (the header, then the payload straight from the primary
tier: `encode_header`) and read it back as pieces (ranges of it: `decode_pieces`); the bytes
stored are the same. Every copy and checksum here lets other threads run meanwhile
(`buffers`), so the event loop does not wait for a worker thread's MiB copy.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import itertools
import os
import struct
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import xxhash

from .buffers import copy_into, new_buffer
from .keys import MAX_KEY_BYTES

__all__ = [
    "HEADER_BYTES",
    "SEAL_OVERHEAD",
    "BlockCodec",
    "BlockSealer",
    "CorruptBlockError",
    "PlainBlocks",
    "block_codec",
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
    "sealed_fingerprint",
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


# -- the two formats behind one interface ------------------------------------------------------


class BlockCodec(Protocol):
    """What a tier that stores blocks under names asks of its block format."""

    #: Whether blocks are sealed (encrypted, authenticated, names keyed).
    sealed: bool
    #: The 16 bytes that stand for the namespace in stored names.
    namespace_tag: bytes
    #: The counter a value that fails its checks is counted under.
    failure_counter: str

    def name(self, key: bytes) -> bytes:
        """The name a block stored under `key` is kept under (within the namespace)."""

    def value_nbytes(self, payload_nbytes: int) -> int:
        """Bytes of the stored value of a payload of `payload_nbytes`."""

    def encode_values(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[memoryview]:
        """Each block's stored value, a new buffer each (blocking: a worker thread's work)."""

    def decode_values(
        self, keys: Sequence[bytes], values: Sequence[Any], blocks: Sequence[memoryview]
    ) -> list[bool]:
        """Each value (whole, or a list of consecutive pieces; None: absent) into its block,
        True where it passed every check (blocking: a worker thread's work)."""


class PlainBlocks:
    """The format without a secret: checksummed, names in clear (anyone who can write to the
    store can write a block that passes; see the security page)."""

    sealed = False
    failure_counter = "corrupt_blocks"

    def __init__(self, namespace: str) -> None:
        self.namespace_tag = namespace_id(namespace)

    def name(self, key: bytes) -> bytes:
        return key

    def value_nbytes(self, payload_nbytes: int) -> int:
        return HEADER_BYTES + payload_nbytes

    def encode_values(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[memoryview]:
        return encode_blocks(keys, blocks, self.namespace_tag)

    def decode_values(
        self, keys: Sequence[bytes], values: Sequence[Any], blocks: Sequence[memoryview]
    ) -> list[bool]:
        return decode_blocks(keys, values, blocks, self.namespace_tag)


SEAL_MAGIC = b"KVTSEAL1"
_SALT_BYTES = 16
_NONCE_BYTES = 12
_TAG_BYTES = 16
_SEAL_HEADER = len(SEAL_MAGIC) + _SALT_BYTES + _NONCE_BYTES
#: Bytes a sealed value holds beyond its payload.
SEAL_OVERHEAD = _SEAL_HEADER + _TAG_BYTES
#: Values sealed under one writer salt (one derived key) before the writer draws a fresh salt:
#: NIST SP 800-38D's limit of 2^32 invocations of one GCM key with random nonces (ours are
#: counters; the bound is kept anyway, by construction).
SEALS_PER_SALT = 1 << 32
#: Block keys of other writers' salts kept derived (a reader meets a few writers at a time).
_READ_KEYS_KEPT = 256
#: Block names kept computed: a batch's keys, and those of the requests in flight, many times over.
_NAMES_KEPT = 8192
_HKDF_SALT_NAMES = b"kvtier_async names v1"


def _hkdf(secret: bytes, *, salt: bytes | None, info: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(secret)


class _Writer:
    """What one process seals under: its count of values sealed, its current salt and key, and
    the keys of the salts it read lately (with the lock over both). A child made by `fork`
    makes its own (`BlockSealer._here`): a copy of its parent's would repeat the parent's next
    nonces under the parent's salt, and a lock a parent's thread held at the fork stays held."""

    __slots__ = ("current", "lock", "pid", "read_keys", "seals")

    def __init__(self, salt: bytes, key: Any) -> None:
        self.pid = os.getpid()
        #: Every value sealed takes the next number (next() is atomic: none is handed out
        #: twice); number // seals_per_salt picks the writer salt, the rest is the nonce under it.
        self.seals = itertools.count()
        #: (which salt of this writer, the salt, its key): replaced whole, so read without a lock.
        self.current: tuple[int, bytes, Any] = (0, salt, key)
        self.read_keys: dict[bytes, Any] = {salt: key}
        self.lock = threading.Lock()


#: Every sealer alive, for the fork hook.
_SEALERS: weakref.WeakSet[BlockSealer] = weakref.WeakSet()


def _forget_writers() -> None:
    """In a child made by `os.fork` (before any of its code runs): every sealer drops its
    parent's writer, and makes its own at its next use. The pid check in `_here` covers a fork
    that runs no Python hook; this hook also covers a child given the pid of the (exited)
    process whose writer it copied."""
    for sealer in list(_SEALERS):
        sealer._process = None


os.register_at_fork(after_in_child=_forget_writers)


class BlockSealer:
    """Sealed blocks of one namespace under one secret (see the module's docstring).

    Thread-safe: tiers seal and open on worker threads.
    """

    sealed = True
    failure_counter = "unauthenticated_blocks"

    def __init__(self, secret: bytes, namespace: str, *, seals_per_salt: int = SEALS_PER_SALT) -> None:
        if not 1 <= seals_per_salt <= SEALS_PER_SALT:
            raise ValueError(f"BlockSealer: seals_per_salt must be 1..{SEALS_PER_SALT}")
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._aesgcm = AESGCM
        self._secret = secret
        self._namespace = namespace.encode()
        tag_key = _hkdf(secret, salt=_HKDF_SALT_NAMES, info=b"namespace tag")
        self.namespace_tag = hmac.new(tag_key, self._namespace, "sha256").digest()[:16]
        name_key = _hkdf(secret, salt=_HKDF_SALT_NAMES, info=b"block names\0" + self._namespace)
        self._name_hmac = hmac.new(name_key, digestmod="sha256")  # copied per name: keyed once
        # A key's name is asked for again and again (a lookup, then the load or the store, which
        # asks which keys are new first): the names of the most recent keys are kept. Thread-safe.
        self._names_kept = functools.lru_cache(maxsize=_NAMES_KEPT)(self._keyed_name)
        self._seals_per_salt = seals_per_salt
        #: This process's writer; None once a fork hook dropped the parent's in a child.
        self._process: _Writer | None = self._writer_of_this_process()
        _SEALERS.add(self)

    def __repr__(self) -> str:
        return f"BlockSealer(namespace_tag={self.namespace_tag.hex()})"

    def _block_key(self, salt: bytes) -> Any:
        return self._aesgcm(_hkdf(self._secret, salt=salt, info=b"block key\0" + self._namespace))

    def _writer_of_this_process(self) -> _Writer:
        """A writer of this process's own: a fresh salt, nonces from 0 under it."""
        salt = os.urandom(_SALT_BYTES)
        return _Writer(salt, self._block_key(salt))

    def _here(self) -> _Writer:
        """This process's writer: a process made by `fork` (whose copy of the parent's writer
        was dropped by `_forget_writers`, or holds the parent's pid where no fork hook ran)
        makes its own before its first value. Two threads of a new child that both make one
        each seal under a salt of their own: no (salt, nonce) pair is used twice either way."""
        process = self._process
        if process is None or process.pid != os.getpid():
            process = self._process = self._writer_of_this_process()
        return process

    def _write_key(self, process: _Writer, turn: int) -> tuple[bytes, Any]:
        """The salt and key of `process`'s `turn` (seal number // seals_per_salt)."""
        current = process.current
        if current[0] == turn:
            return current[1], current[2]
        salt = os.urandom(_SALT_BYTES)
        key = self._block_key(salt)
        with process.lock:
            if process.current[0] < turn:  # the first to reach this turn: the writer moves on
                process.current = (turn, salt, key)
                self._keep_read_key(process, salt, key)
            elif process.current[0] == turn:  # another thread moved it on meanwhile
                return process.current[1], process.current[2]
        # Either the writer's new salt, or (a thread that drew its number before the writer
        # moved on past its turn) a salt of this one value's own: a fresh salt either way, so
        # no (salt, nonce) pair is ever used twice.
        return salt, key

    def _read_key(self, salt: bytes) -> Any:
        process = self._here()
        with process.lock:
            key = process.read_keys.get(salt)
        if key is None:
            key = self._block_key(salt)
            with process.lock:
                self._keep_read_key(process, salt, key)
        return key

    @staticmethod
    def _keep_read_key(process: _Writer, salt: bytes, key: Any) -> None:
        """Keep `salt`'s key derived (under `process.lock`), forgetting the oldest other writer's."""
        if len(process.read_keys) >= _READ_KEYS_KEPT:
            own = process.current[1]
            oldest = next(k for k in process.read_keys if k != own)
            del process.read_keys[oldest]
        process.read_keys[salt] = key

    def _associated(self, key: bytes, payload_nbytes: int) -> bytes:
        return self.namespace_tag + payload_nbytes.to_bytes(8, "little") + key

    def name(self, key: bytes) -> bytes:
        return self._names_kept(key)

    def _keyed_name(self, key: bytes) -> bytes:
        mac = self._name_hmac.copy()
        mac.update(key)
        return mac.digest()

    def value_nbytes(self, payload_nbytes: int) -> int:
        return SEAL_OVERHEAD + payload_nbytes

    def seal_into(self, into: memoryview, payload: memoryview, key: bytes) -> None:
        """Write the sealed value of `payload` stored under `key` into `into` (exactly
        `value_nbytes(len(payload))` bytes). The GIL is released while it encrypts."""
        n = len(payload)
        if len(into) != SEAL_OVERHEAD + n:
            raise ValueError(f"seal_into: {len(into)} bytes are not the {SEAL_OVERHEAD + n} of the value")
        process = self._here()
        turn, count = divmod(next(process.seals), self._seals_per_salt)
        salt, write_key = self._write_key(process, turn)
        nonce = count.to_bytes(_NONCE_BYTES, "little")
        into[:_SEAL_HEADER] = SEAL_MAGIC + salt + nonce
        write_key.encrypt_into(nonce, payload, self._associated(key, n), into[_SEAL_HEADER:])

    def open_into(self, block: memoryview, value: memoryview, key: bytes) -> bool:
        """Whether `value` is the sealed block stored under `key`, with `block`'s length; then
        `block` holds its payload (otherwise `block` may hold anything)."""
        from cryptography.exceptions import InvalidTag

        n = len(block)
        if len(value) != SEAL_OVERHEAD + n or bytes(value[: len(SEAL_MAGIC)]) != SEAL_MAGIC:
            return False
        salt = bytes(value[len(SEAL_MAGIC) : len(SEAL_MAGIC) + _SALT_BYTES])
        nonce = bytes(value[len(SEAL_MAGIC) + _SALT_BYTES : _SEAL_HEADER])
        try:
            self._read_key(salt).decrypt_into(nonce, value[_SEAL_HEADER:], self._associated(key, n), block)
        except InvalidTag:
            return False
        return True

    def seal_many(
        self, keys: Sequence[bytes], blocks: Sequence[memoryview], into: Sequence[memoryview]
    ) -> None:
        """`seal_into` for each block, into its value (blocking: a worker thread's work)."""
        for key, block, value in zip(keys, blocks, into):
            self.seal_into(value, block, key)

    def encode_values(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[memoryview]:
        values = [new_buffer(SEAL_OVERHEAD + len(block)) for block in blocks]
        self.seal_many(keys, blocks, values)
        return values

    def decode_values(
        self, keys: Sequence[bytes], values: Sequence[Any], blocks: Sequence[memoryview]
    ) -> list[bool]:
        return [
            self._decode_one(key, value if isinstance(value, list) else [value], block)
            for key, value, block in zip(keys, values, blocks)
        ]

    def _decode_one(self, key: bytes, pieces: list[Any], block: memoryview) -> bool:
        if not pieces or any(piece is None for piece in pieces):
            return False
        views = [memoryview(piece).cast("B") for piece in pieces]
        if sum(view.nbytes for view in views) != SEAL_OVERHEAD + len(block):
            return False
        if len(views) == 1:
            return self.open_into(block, views[0], key)
        whole = new_buffer(SEAL_OVERHEAD + len(block))
        at = 0
        for view in views:
            copy_into(whole[at:], view)
            at += view.nbytes
        return self.open_into(block, whole, key)


def sealed_fingerprint(value: memoryview | bytes) -> int:
    """A checksum that tells sealed values apart without reading them whole: XXH3-64 of the
    header (magic, writer salt, nonce: unique per sealing) and the GCM tag (a function of every
    byte). It tells which sealed value a place holds; whether its bytes are whole and genuine
    is for the tag to say when the value is opened."""
    view = memoryview(value).cast("B")
    if view.nbytes < SEAL_OVERHEAD:
        return 0
    return xxhash.xxh3_64_intdigest(bytes(view[:_SEAL_HEADER]) + bytes(view[view.nbytes - _TAG_BYTES :]))


def block_codec(namespace: str, secret: bytes | None) -> PlainBlocks | BlockSealer:
    """The block format of a tier of `namespace`: sealed under `secret`, plain without one."""
    return PlainBlocks(namespace) if secret is None else BlockSealer(secret, namespace)
