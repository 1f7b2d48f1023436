"""`KnownKeys`: the integrations' bounded memory of what their tier holds."""

from __future__ import annotations

from kvtier_async.integrations.known_keys import KnownKeys


def test_the_least_recently_used_key_is_forgotten_first() -> None:
    known: KnownKeys[bytes] = KnownKeys(3)
    known.add([b"a", b"b", b"c"])
    assert known.touch(b"a")  # now the most recently used
    known.add([b"d"])
    assert list(known) == [b"c", b"a", b"d"] and b"b" not in known
    assert not known.touch(b"b")


def test_forget_and_take_all() -> None:
    known: KnownKeys[bytes] = KnownKeys(10)
    known.add([b"a", b"b", b"c"])
    known.forget([b"b", b"missing"])
    assert known.take_all() == [b"a", b"c"] and len(known) == 0
