"""Keys for the contract tests."""

from __future__ import annotations

__all__ = ["make_key"]


def make_key(i: int, tag: bytes = b"") -> bytes:
    """A distinct 32-byte key per (i, tag)."""
    return (tag + i.to_bytes(8, "little")).ljust(32, b"k")
