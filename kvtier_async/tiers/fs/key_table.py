"""`KeyTable`: which record holds a key, in two flat arrays, with no Python object per key.

An open-addressing hash table with linear probing: each slot holds a record's id (a packed
`(slab, record)`, plus one; 0 is an empty slot) and the 64-bit hash of its key.
The table holds no keys: a slot whose hash matches is confirmed by comparing the whole key with
the one its record holds (`key_of`, the index's per-slab key columns), so two keys of one hash
find each their own record, never the other's. Garbage collections never walk it (its arrays
are two objects, whatever it holds), and it takes 16 bytes a slot, 25 to 70% of its slots used:
23 to 64 bytes an entry.

Growing re-places every entry with numpy (sorted by home slot, a running maximum), not one
by one in Python; it runs on the caller's thread (the event loop's) each time the table
doubles, and takes time in proportion to the entries: on this project's VM about 0.2 s for
730,000 and 0.2 to 0.7 s for 1.5 million, where a dict's resize took 0.05 and 0.12 s. A table
that holds a steady number of entries (a full cache, evicting) never grows again.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import xxhash

__all__ = ["KeyTable", "key_hash"]

_EMPTY = 0
_MIN_SLOTS = 1024
#: Used slots past this share, and the table grows.
_MAX_LOAD = 0.7


#: A key's 64-bit hash (XXH3): where its probe starts, and what a slot is checked by first. The
#: C function itself, not a wrapper: it is called once per key looked up.
key_hash: Callable[[bytes], int] = xxhash.xxh3_64_intdigest

#: Whether each record (an array of record ids) holds the key in the same row of a 2-D array of
#: keys of one length (a boolean array): `KeyTable.get_many`'s key check, for a batch.
SameKeys = Callable[
    ["np.ndarray[Any, np.dtype[np.int64]]", "np.ndarray[Any, np.dtype[np.uint8]]"],
    "np.ndarray[Any, np.dtype[np.bool_]]",
]
#: A batch's keys still probing when this few are left are looked up one by one (`get`), and
#: so is a batch of fewer than `_BATCH` (numpy's calls cost more than they save there).
_FEW = 8
_BATCH = 128


class KeyTable:
    """key -> record id (an int >= 0), confirming keys through `key_of(record id)` (a batch's
    through `same_keys`, which answers as `key_of` does, faster).

    `key_of` must give the key a record id was `put` under for as long as the table maps it:
    remove an entry before its record's key changes.
    """

    def __init__(
        self,
        key_of: Callable[[int], bytes | bytearray | None],
        hash_key: Callable[[bytes], int] | None = None,
        same_keys: SameKeys | None = None,
    ) -> None:
        self._key_of = key_of
        self._same_keys = same_keys or self._same_rows_one_by_one
        self._hash = key_hash if hash_key is None else hash_key
        self._live = 0
        self._ids, self._hashes = _slots(_MIN_SLOTS)
        self._mask = _MIN_SLOTS - 1

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        """Bytes the table's arrays take."""
        return self._ids.itemsize * len(self._ids) + self._hashes.itemsize * len(self._hashes)

    def get(self, key: bytes) -> int:
        """The record id `key` is held by; -1 if none."""
        h = self._hash(key)
        ids, hashes, mask, key_of = self._ids, self._hashes, self._mask, self._key_of
        i = h & mask
        while True:
            v = ids[i]
            if v == _EMPTY:
                return -1
            if hashes[i] == h and key_of(v - 1) == key:
                return v - 1
            i = (i + 1) & mask

    def get_many(self, keys: Sequence[bytes]) -> list[int]:
        """`get` of each of `keys` (-1: none), the probes of a batch together in numpy: each
        step compares every waiting key's hash with its slot's at once, and the keys of the
        slots whose hash matches (`same_keys`, where the keys are of one length, as an engine's
        are; `key_of` one by one otherwise). The few left after some steps go one by one."""
        n = len(keys)
        if not n or not self._live:
            return [-1] * n
        if n < _BATCH:
            return [self.get(key) for key in keys]
        wanted = np.fromiter(map(self._hash, keys), dtype=np.uint64, count=n)
        rows = None
        if len(set(map(len, keys))) == 1:
            rows = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(n, len(keys[0]))
        ids = np.frombuffer(self._ids, dtype=np.int64)
        hashes = np.frombuffer(self._hashes, dtype=np.uint64)
        mask = self._mask
        found = np.full(n, -1, dtype=np.int64)
        position = (wanted & np.uint64(mask)).astype(np.int64)
        waiting = np.arange(n)
        while len(waiting) > _FEW:
            at = position[waiting]
            values = ids[at]
            resolved = values == _EMPTY
            matched = np.flatnonzero((values > 0) & (hashes[at] == wanted[waiting]))
            if len(matched):
                record_ids = values[matched] - 1
                asked = waiting[matched]
                if rows is None:
                    same = self._same_keys_one_by_one(record_ids, [keys[i] for i in asked.tolist()])
                else:
                    same = self._same_keys(record_ids, rows[asked])
                found[asked[same]] = record_ids[same]
                resolved[matched[same]] = True
            waiting = waiting[~resolved]
            position[waiting] = (position[waiting] + 1) & mask
        result: list[int] = found.tolist()
        for i in waiting.tolist():
            result[i] = self.get(keys[i])
        return result

    def _same_keys_one_by_one(
        self, record_ids: np.ndarray[Any, np.dtype[np.int64]], keys: list[bytes]
    ) -> np.ndarray[Any, np.dtype[np.bool_]]:
        key_of = self._key_of
        same = [key_of(record_id) == key for record_id, key in zip(record_ids.tolist(), keys)]
        return np.array(same, dtype=bool)

    def _same_rows_one_by_one(
        self, record_ids: np.ndarray[Any, np.dtype[np.int64]], rows: np.ndarray[Any, np.dtype[np.uint8]]
    ) -> np.ndarray[Any, np.dtype[np.bool_]]:
        return self._same_keys_one_by_one(record_ids, [row.tobytes() for row in rows])

    def put(self, key: bytes, record_id: int, keep: Callable[[int], bool] | None = None) -> None:
        """Map `key` to `record_id`, in place of the record it was mapped to, if any (unless
        `keep` of that record says to keep it)."""
        h = self._hash(key)
        ids, hashes, mask, key_of = self._ids, self._hashes, self._mask, self._key_of
        i = h & mask
        while True:
            v = ids[i]
            if v == _EMPTY:
                break
            if hashes[i] == h and key_of(v - 1) == key:
                if keep is None or not keep(v - 1):
                    ids[i] = record_id + 1
                return
            i = (i + 1) & mask
        ids[i] = record_id + 1
        hashes[i] = h
        self._live += 1
        if self._live > _MAX_LOAD * len(ids):
            self._rebuild()

    def remove(self, key: bytes, record_id: int) -> bool:
        """Forget `key` if it is mapped to `record_id` (found by the id: the key need not be
        its record's any more); whether it was."""
        h = self._hash(key)
        ids, hashes, mask, target = self._ids, self._hashes, self._mask, record_id + 1
        i = h & mask
        while True:
            v = ids[i]
            if v == _EMPTY:
                return False
            if v == target and hashes[i] == h:
                self._empty(i)
                self._live -= 1
                return True
            i = (i + 1) & mask

    def _empty(self, i: int) -> None:
        """Empty slot `i`, moving back the entries after it that a probe would no longer reach
        (backward-shift deletion): no removed-slot markers pile up as blocks are evicted, so
        a table of a steady number of entries is never rebuilt."""
        ids, hashes, mask = self._ids, self._hashes, self._mask
        j = i
        while True:
            j = (j + 1) & mask
            v = ids[j]
            if v == _EMPTY:
                break
            home = hashes[j] & mask
            # The entry at j stays unless its home lies cyclically outside (i, j]: then the
            # hole at i would cut it off from its home, and it moves into the hole.
            if (home <= i or home > j) if i < j else (home <= i and home > j):
                ids[i], hashes[i] = v, hashes[j]
                i = j
        ids[i], hashes[i] = _EMPTY, 0

    def _rebuild(self) -> None:
        """Every entry placed anew, in a table at most half full, with no loop over entries in
        Python: taken in order of their home slots, each entry lands in its home slot or in the
        slot after the entry before it, whichever is later (a running maximum), which is where
        inserting them one by one in that order would put them. The few pushed past the last slot
        wrap around into the first empty slots from slot 0, in the same order. So every slot on
        an entry's way from its home slot to its own is taken, as linear probing needs."""
        size = _MIN_SLOTS
        while size < 2 * self._live:
            size *= 2
        old_ids = np.frombuffer(self._ids, dtype=np.int64)
        live = old_ids > 0
        mask = size - 1
        hashes = np.frombuffer(self._hashes, dtype=np.uint64)[live]
        home = (hashes & np.uint64(mask)).astype(np.int64)
        order = np.argsort(home, kind="stable")
        home, hashes, values = home[order], hashes[order], old_ids[live][order]
        step = np.arange(len(home), dtype=np.int64)
        position = np.maximum.accumulate(home - step) + step
        new_ids = np.zeros(size, dtype=np.int64)
        new_hashes = np.zeros(size, dtype=np.uint64)
        inside = position < size
        new_ids[position[inside]] = values[inside]
        new_hashes[position[inside]] = hashes[inside]
        wrapped = np.flatnonzero(~inside)
        if len(wrapped):
            to = np.flatnonzero(new_ids == _EMPTY)[: len(wrapped)]
            new_ids[to] = values[wrapped]
            new_hashes[to] = hashes[wrapped]
        self._ids, self._hashes = _slots(0)
        self._ids.frombytes(new_ids.data.cast("B"))
        self._hashes.frombytes(new_hashes.data.cast("B"))
        self._mask = mask


def _slots(n: int) -> tuple[array[int], array[int]]:
    ids, hashes = array("q"), array("Q")
    if n:
        ids.frombytes(bytes(8 * n))
        hashes.frombytes(bytes(8 * n))
    return ids, hashes
