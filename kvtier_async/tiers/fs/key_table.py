"""`KeyTable`: which record holds a key, in one flat array, with no Python object per key.

An open-addressing hash table with linear probing: each slot holds a record's id (a packed
`(slab, record)`, plus one; 0 is an empty slot) and the 64-bit hash of its key.
The table holds no keys: a slot whose hash matches is confirmed by comparing the whole key with
the one its record holds (`key_of`, the index's per-slab key columns), so two keys of one hash
find each their own record, never the other's. Garbage collections never walk it (its array is
one object, whatever it holds), and it takes 16 bytes a slot, 35 to 70% of its slots used (fewer
after removals): 23 to 46 bytes an entry.

It grows without holding its caller (the event loop) for long: past 70% full, a table twice the
size takes the new entries, and each `put` after that moves about eight slots' worth of the old
table into it, a chunk of `_CHUNK` slots at a time (in numpy, a fraction of a millisecond), so
the old table is empty, and dropped, before the new one is half full (the pages of the
slots moved out are given back to the kernel as they go). Meanwhile a key is looked
for in the new table, then in the old. A chunk always ends at an empty slot, so what is left of
the old table is whole runs of slots, each still found by probing as before. Its arrays live in
an anonymous mapping (the kernel's zeroed pages, supplied when first written), so making a table
twice the size costs nothing at once either: its pages fault in as the entries arrive, a chunk's
worth at a time. A table that holds a steady number of entries (a full cache,
evicting) never grows again.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import xxhash

__all__ = ["KeyTable", "key_hash"]

_EMPTY = 0
_MIN_SLOTS = 1024
#: Used slots past this share, and the table grows.
_MAX_LOAD = 0.7
#: Slots of the old table moved into the new one at a time while it grows, and per `put` on
#: average: at eight a put, the old table (at most 70% full) is empty after an eighth of its
#: size in puts, the new one (twice its size) then at most (0.7 + 0.125) / 2 full. A chunk's
#: few hundred entries land at random in the new table, whose pages the kernel supplies (and
#: zeroes) as they are first written: a page fault each, about 3 microseconds here, so no more
#: than some hundreds at a time (a chunk of 4096 slots held the loop 12 ms at 262,144 slots,
#: 2,569 of its faults).
_CHUNK = 512
_SLOTS_PER_PUT = 8


#: A key's 64-bit hash (XXH3): where its probe starts, and what a slot is checked by first. The
#: C function itself, not a wrapper: it is called once per key looked up.
key_hash: Callable[[bytes], int] = xxhash.xxh3_64_intdigest

#: Whether each record (an array of record ids) holds the key in the same row of a 2-D array of
#: keys of one length (a boolean array): `KeyTable.get_many`'s key check, for a batch.
SameKeys = Callable[
    ["np.ndarray[Any, np.dtype[np.int64]]", "np.ndarray[Any, np.dtype[np.uint8]]"],
    "np.ndarray[Any, np.dtype[np.bool_]]",
]
#: A batch's keys still probing when this few are left are looked up one by one, and so is a
#: batch of fewer than `_BATCH` (numpy's calls cost more than they save there).
_FEW = 8
_BATCH = 128
#: Slots a batch's probes read at a time: at most 70% full, nearly every probe ends within them.
_WINDOW = 8
_OFFSETS = np.arange(_WINDOW, dtype=np.int64)


class _Slots:
    """One table's slots: each a record id (plus one; 0: empty) and the hash of its key, side by
    side, so that a probe reads one cache line, not one in each of two arrays (memory latency is
    most of a lookup's cost in a table of millions). Seen as two strided numpy arrays and as two
    strided memoryviews, which index as Python ints (a numpy array's scalars cost more to get and
    compare). They live in an anonymous mapping: zeroed pages the kernel supplies when first
    written, and gives back when a growing table's old slots are moved out (`release`)."""

    __slots__ = ("hash_at", "hashes", "id_at", "ids", "mapping", "mask")

    def __init__(self, size: int) -> None:
        self.mapping = mmap.mmap(-1, 16 * size)
        self.ids = np.frombuffer(self.mapping, dtype=np.int64)[0::2]
        self.hashes = np.frombuffer(self.mapping, dtype=np.uint64)[1::2]
        self.id_at = memoryview(self.mapping).cast("q")[0::2]
        self.hash_at = memoryview(self.mapping).cast("Q")[1::2]
        self.mask = size - 1

    def __len__(self) -> int:
        return self.mask + 1

    def release(self, start: int, end: int) -> None:
        """Give the kernel back the whole pages of slots `start` to `end` (not wrapping), which
        hold nothing (zeros: what the kernel gives if they are touched again)."""
        low = -(-16 * start // mmap.PAGESIZE) * mmap.PAGESIZE
        high = 16 * end // mmap.PAGESIZE * mmap.PAGESIZE
        if high > low:
            self.mapping.madvise(mmap.MADV_DONTNEED, low, high - low)


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
        self._table = _Slots(_MIN_SLOTS)
        #: While growing: the table being emptied into `_table`, its next slot to move (counted
        #: on past its end: taken modulo its size) and the slot it stops before.
        self._old: _Slots | None = None
        self._cursor = 0
        self._stop = 0
        self._owed = 0  # slots the puts since the last chunk owe

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        """Bytes the table's arrays take: while it grows, the new one's and the old one's slots
        not yet moved (those moved are given back to the kernel)."""
        return 16 * (len(self._table) + (0 if self._old is None else self._stop - self._cursor))

    @property
    def growing(self) -> bool:
        """Whether an old table is still being moved into the new one."""
        return self._old is not None

    # -- lookups ---------------------------------------------------------------------------------
    def get(self, key: bytes) -> int:
        """The record id `key` is held by; -1 if none."""
        h = self._hash(key)
        found = self._get_in(self._table, h, key)
        if found < 0 and self._old is not None:
            return self._get_in(self._old, h, key)
        return found

    def _get_in(self, table: _Slots, h: int, key: bytes) -> int:
        ids, hashes, mask, key_of = table.id_at, table.hash_at, table.mask, self._key_of
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
        step compares every waiting key's hash with its next slots' at once; then the keys of the
        slots whose hash matched are compared, all at once (`same_keys`, where the keys are of
        one length, as an engine's are; `key_of` one by one otherwise). The few keys left after
        some steps, and any whose hash matched another key's, go one by one."""
        n = len(keys)
        if not n or not self._live:
            return [-1] * n
        if n < _BATCH:
            return [self.get(key) for key in keys]
        wanted = np.fromiter(map(self._hash, keys), dtype=np.uint64, count=n)
        rows = None
        if len(set(map(len, keys))) == 1:
            rows = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(n, len(keys[0]))
        found = np.full(n, -1, dtype=np.int64)
        self._probe_many(self._table, keys, wanted, rows, np.arange(n), found)
        if self._old is not None:
            self._probe_many(self._old, keys, wanted, rows, np.flatnonzero(found < 0), found)
        result: list[int] = found.tolist()
        return result

    def _probe_many(
        self,
        table: _Slots,
        keys: Sequence[bytes],
        wanted: np.ndarray[Any, np.dtype[np.uint64]],
        rows: np.ndarray[Any, np.dtype[np.uint8]] | None,
        asked: np.ndarray[Any, np.dtype[np.int64]],
        found: np.ndarray[Any, np.dtype[np.int64]],
    ) -> None:
        """Set `found` at `asked` (positions in `keys`) to the record ids `table` holds them by."""
        ids, hashes, mask = table.ids, table.hashes, table.mask
        hashed = wanted[asked]
        position = (hashed & np.uint64(mask)).astype(np.int64)
        candidate = np.full(len(asked), -1, dtype=np.int64)
        waiting = np.arange(len(asked))
        while len(waiting) > _FEW:
            # `_WINDOW` slots from each key's position at once, and the first that ends its probe:
            # an empty slot, or one of its hash (its key is compared after).
            at = (position[waiting, None] + _OFFSETS) & mask
            values = ids[at]
            ends = (values == _EMPTY) | (hashes[at] == hashed[waiting, None])
            first = ends.argmax(axis=1)
            each = np.arange(len(waiting))
            ended = ends[each, first]
            value = values[each, first]
            matched = ended & (value != _EMPTY)
            candidate[waiting[matched]] = value[matched] - 1
            waiting = waiting[~ended]
            position[waiting] = (position[waiting] + _WINDOW) & mask
        one_by_one = waiting.tolist()
        checked = np.flatnonzero(candidate >= 0)
        if len(checked):
            record_ids = candidate[checked]
            if rows is None:
                same = self._same_keys_one_by_one(record_ids, [keys[i] for i in asked[checked].tolist()])
            else:
                same = self._same_keys(record_ids, rows[asked[checked]])
            found[asked[checked[same]]] = record_ids[same]
            one_by_one += checked[~same].tolist()  # another key of the same hash: probe on
        for i in one_by_one:
            at = int(asked[i])
            found[at] = self._get_in(table, int(wanted[at]), keys[at])

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

    # -- changes ---------------------------------------------------------------------------------
    def put(self, key: bytes, record_id: int, keep: Callable[[int], bool] | None = None) -> None:
        """Map `key` to `record_id`, in place of the record it was mapped to, if any (unless
        `keep` of that record says to keep it)."""
        h = self._hash(key)
        table, key_of = self._table, self._key_of
        ids, hashes, mask = table.id_at, table.hash_at, table.mask
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
        old = self._old
        if old is not None:
            j = self._slot_in(old, h, key)
            if j >= 0:  # mapped in the old table: moved to the new one, where slot i is free
                if keep is not None and keep(old.id_at[j] - 1):
                    return
                self._empty(old, j)
                self._live -= 1
        ids[i] = record_id + 1
        hashes[i] = h
        self._live += 1
        if old is not None:
            self._owed += _SLOTS_PER_PUT
            if self._owed >= _CHUNK:
                self._owed = 0
                self._move_chunk()
        elif self._live > _MAX_LOAD * len(table):
            self._grow()

    def _slot_in(self, table: _Slots, h: int, key: bytes) -> int:
        ids, hashes, mask, key_of = table.id_at, table.hash_at, table.mask, self._key_of
        i = h & mask
        while True:
            v = ids[i]
            if v == _EMPTY:
                return -1
            if hashes[i] == h and key_of(v - 1) == key:
                return i
            i = (i + 1) & mask

    def remove(self, key: bytes, record_id: int) -> bool:
        """Forget `key` if it is mapped to `record_id` (found by the id: the key need not be
        its record's any more); whether it was."""
        h = self._hash(key)
        for table in (self._table, self._old):
            if table is None:
                continue
            ids, hashes, mask, target = table.id_at, table.hash_at, table.mask, record_id + 1
            i = h & mask
            while True:
                v = ids[i]
                if v == _EMPTY:
                    break
                if v == target and hashes[i] == h:
                    self._empty(table, i)
                    self._live -= 1
                    return True
                i = (i + 1) & mask
        return False

    @staticmethod
    def _empty(table: _Slots, i: int) -> None:
        """Empty slot `i`, moving back the entries after it that a probe would no longer reach
        (backward-shift deletion): no removed-slot markers pile up as blocks are evicted, so
        a table of a steady number of entries is never rebuilt. The entries move within their
        run of used slots, never out of it: an old table being emptied stays whole runs."""
        ids, hashes, mask = table.id_at, table.hash_at, table.mask
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

    # -- growth ----------------------------------------------------------------------------------
    def reserve(self, entries: int) -> None:
        """Make room for `entries` in all at once, where that costs little next to the caller's
        own work: for a batch of at least an eighth as many new entries as the table holds (a
        log replayed by a restarted process), a table of the size they need now, its entries
        placed in numpy, instead of doublings moved chunk by chunk over the puts that follow
        (which cost more in all). Otherwise nothing: the puts grow the table as usual."""
        new = entries - self._live
        if new <= 0 or 8 * new < self._live:
            return
        size = len(self._table)
        while entries > _MAX_LOAD * size:
            size *= 2
        if size == len(self._table):
            return
        while self._old is not None:
            self._move_chunk()
        old = self._table
        used = old.ids != _EMPTY
        self._table = _Slots(size)
        _place(self._table, old.ids[used], old.hashes[used])

    def _grow(self) -> None:
        """A table twice the size takes the new entries; the old one is moved into it by the
        puts that follow (`_move_chunk`), starting from one of its empty slots."""
        while self._old is not None:  # never while the puts keep their pace; kept whole anyway
            self._move_chunk()
        old = self._table
        self._table = _Slots(2 * len(old))
        self._old = old
        start = 0
        while True:  # an empty slot: the table is at most 70% full, one is near the start
            empty = np.flatnonzero(old.ids[start : start + 64] == _EMPTY)
            if len(empty):
                break
            start += 64
        self._cursor = start + int(empty[0])
        self._stop = self._cursor + len(old)
        self._owed = 0

    def _move_chunk(self) -> None:
        """Move the next `_CHUNK` slots of the old table, and on to the end of their run of used
        slots, into the new one (in numpy); drop the old table once all of it is moved."""
        old = self._old
        if old is None:
            return
        start = self._cursor
        end = min(start + _CHUNK, self._stop)
        while end < self._stop and old.id_at[end & old.mask] != _EMPTY:
            end += 1
        slots = np.arange(start, end, dtype=np.int64) & old.mask
        values = old.ids[slots]
        used = values != _EMPTY
        _place(self._table, values[used], old.hashes[slots][used])
        old.ids[slots] = _EMPTY
        old.hashes[slots] = 0
        size = len(old)
        for low, high in ((start, min(end, size)), (max(start, size) - size, end - size)):
            if high > low:
                old.release(low, high)
        self._cursor = end
        if end >= self._stop:
            self._old = None


def _place(
    table: _Slots,
    values: np.ndarray[Any, np.dtype[np.int64]],
    hashes: np.ndarray[Any, np.dtype[np.uint64]],
) -> None:
    """Put entries of keys `table` does not hold into it, in numpy: each step, every entry still
    waiting takes its slot if that is empty (the first of those asking for one slot), or moves
    on to the next slot; so every slot between an entry's home and its own is used, as linear
    probing needs."""
    mask = table.mask
    position = (hashes & np.uint64(mask)).astype(np.int64)
    waiting = np.arange(len(values))
    while len(waiting):
        at = position[waiting]
        empty = np.flatnonzero(table.ids[at] == _EMPTY)
        _, first = np.unique(at[empty], return_index=True)
        placed = empty[first]
        table.ids[at[placed]] = values[waiting[placed]]
        table.hashes[at[placed]] = hashes[waiting[placed]]
        left = np.ones(len(waiting), dtype=bool)
        left[placed] = False
        waiting = waiting[left]
        position[waiting] = (position[waiting] + 1) & mask
