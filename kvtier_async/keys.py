"""Block keys: chained content hashes of token blocks, and the checks every call makes on keys."""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from .errors import InvalidArgumentError

__all__ = [
    "MAX_KEY_BYTES",
    "block_hashes",
    "check_block_ids",
    "check_keys",
    "check_lengths",
]

#: Tiers accept any `bytes` key of 1..MAX_KEY_BYTES bytes.
MAX_KEY_BYTES = 128

_DIGEST_BYTES = 32
_SCHEME = b"kvtier-block-hash-v1"


def block_hashes(
    token_ids: Iterable[int] | Any, block_size: int = 16, *, namespace: str = "default"
) -> list[bytes]:
    """One 32-byte key per *full* block of `token_ids`, each chained over the one before.

    Key i commits to the namespace, the block size and every token of blocks
    0..i, so equal keys mean an equal prefix; a trailing partial block gets no
    key. BLAKE2b makes the keys the same in every process and on every machine
    (Python's `hash()` is salted per process). `token_ids` may be any iterable
    of ints, a `torch.Tensor` included.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(namespace, str) or not namespace:
        raise InvalidArgumentError(f"namespace must be a non-empty str, got {namespace!r}")
    if hasattr(token_ids, "tolist"):  # torch tensors: one conversion instead of per-item calls
        token_ids = token_ids.tolist()
    try:
        tokens = array.array("q", token_ids)
    except (TypeError, OverflowError) as exc:
        raise InvalidArgumentError(f"token_ids must be ints in the int64 range: {exc}") from exc
    if sys.byteorder == "big":  # hash the same bytes on every machine
        tokens.byteswap()
    raw = memoryview(tokens).cast("B")
    prev = hashlib.blake2b(
        _SCHEME + b"\0" + namespace.encode() + b"\0" + block_size.to_bytes(8, "little"),
        digest_size=_DIGEST_BYTES,
    ).digest()
    keys = []
    step = block_size * 8
    for start in range(0, (len(tokens) // block_size) * step, step):
        h = hashlib.blake2b(prev, digest_size=_DIGEST_BYTES)
        h.update(raw[start : start + step])
        prev = h.digest()
        keys.append(prev)
    return keys


def check_keys(keys: Sequence[bytes]) -> None:
    """Raise `InvalidArgumentError` unless `keys` is a sequence of distinct 1..128-byte `bytes`."""
    if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
        raise InvalidArgumentError(
            f"keys must be a sequence of bytes (e.g. a list), got {type(keys).__name__}"
        )
    # The common case checked in C (types and lengths of the whole batch at once); the loop below
    # only finds which key is bad, for the message.
    if keys and not (
        set(map(type, keys)) == {bytes} and min(map(len, keys)) >= 1 and max(map(len, keys)) <= MAX_KEY_BYTES
    ):
        for i, key in enumerate(keys):
            if type(key) is not bytes:
                raise InvalidArgumentError(f"keys[{i}] must be bytes, got {type(key).__name__}")
            if not 1 <= len(key) <= MAX_KEY_BYTES:
                raise InvalidArgumentError(f"keys[{i}] must be 1..{MAX_KEY_BYTES} bytes long, got {len(key)}")
    if len(set(keys)) != len(keys):
        raise InvalidArgumentError("keys must not repeat within one call")


def check_block_ids(block_ids: Sequence[int], num_blocks: int, *, what: str = "block_ids") -> list[int]:
    """Validate ids in [0, num_blocks), no repeats; returns them as a list of plain ints.

    Accepts a list, a tuple, a range or a 1-D integer tensor.
    """
    if hasattr(block_ids, "tolist"):
        if getattr(block_ids, "dim", lambda: 1)() != 1:
            raise InvalidArgumentError(f"{what} must be one-dimensional")
        if getattr(block_ids, "is_floating_point", lambda: False)():
            raise InvalidArgumentError(f"{what} must hold integers")
        block_ids = block_ids.tolist()
    if isinstance(block_ids, (bytes, str)) or not isinstance(block_ids, Sequence):
        raise InvalidArgumentError(f"{what} must be a sequence of ints, got {type(block_ids).__name__}")
    ids = list(block_ids)
    for i, block_id in enumerate(ids):
        if isinstance(block_id, bool) or not isinstance(block_id, int):
            raise InvalidArgumentError(f"{what}[{i}] must be an int, got {type(block_id).__name__}")
        if not 0 <= block_id < num_blocks:
            raise InvalidArgumentError(f"{what}[{i}]={block_id} is out of range [0, {num_blocks})")
    if len(set(ids)) != len(ids):
        raise InvalidArgumentError(f"{what} must not repeat within one call")
    return ids


def check_lengths(keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
    if len(keys) != len(block_ids):
        raise InvalidArgumentError(
            f"got {len(keys)} keys but {len(block_ids)} block ids; they pair one to one"
        )
