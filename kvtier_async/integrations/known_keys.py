"""`KnownKeys`: the keys an integration knows its tier holds, so engines get answers at once.

An engine asks its storage plug-in about the same prefixes again and again, from its
own threads. Keys this process stored, loaded or found present are remembered here,
the least recently used forgotten first past `limit` (they are then asked about
again), and a key is forgotten when the tier reports it gone or a load misses it.
Not locked itself: each integration guards it with the lock that guards the rest of
its state.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from typing import Generic, TypeVar

__all__ = ["KnownKeys"]

K = TypeVar("K", bound=Hashable)


class KnownKeys(Generic[K]):
    """At most `limit` keys, in order of last use."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys: OrderedDict[K, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[K]:
        return iter(self._keys)

    def touch(self, key: K) -> bool:
        """Whether `key` is known; if so it becomes the most recently used."""
        if key not in self._keys:
            return False
        self._keys.move_to_end(key)
        return True

    def add(self, keys: Iterable[K]) -> None:
        """Remember `keys` as the most recently used; forget the oldest past `limit`."""
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def forget(self, keys: Iterable[K]) -> None:
        for key in keys:
            self._keys.pop(key, None)

    def take_all(self) -> list[K]:
        """Every key, oldest first; none is known afterwards."""
        keys = list(self._keys)
        self._keys.clear()
        return keys
