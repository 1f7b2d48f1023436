"""`SlabIndex`: which record of which slab holds which block, as this process sees a namespace.

A synchronous state object, like `PrimaryTier`: no I/O, no awaits, touched on the event-loop
thread only. It keeps this process's own slabs (their free records, the published ones in
least-recently-used order, the ones pinned by reads and holds, the ones freed while read)
and what it has read of the other processes' logs (`SlabFiles.read_news`). Where a transition
means a file descriptor may be closed, it returns the descriptor: the tier closes it.

It holds no Python object per block, so that its memory is a few tens of bytes a block plus the
key's length, and garbage collections never walk it: a key is found through `KeyTable` (a hash
table in one flat array), and what each record holds (its key, payload checksum, age, place in
the least-recently-used order, state) lives in flat per-slab columns (`Columns`). Only what is
bounded by the operations in flight (pins, holds, records freed while read) is kept in sets and
dicts.
"""

from __future__ import annotations

import threading
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...keys import MAX_KEY_BYTES
from .key_table import KeyTable
from .layout import ENTRY, Entry, coarse_time_ns, latest_per_record

__all__ = ["Claim", "Columns", "LogNews", "OtherSlab", "OwnSlab", "Record", "SlabIndex"]

Record = tuple[int, int]  # (slab, record index)

_RECORD_BITS = 32  # a record's id: its slab number above these bits, its index in the slab below
_RECORD_MASK = (1 << _RECORD_BITS) - 1
_NONE = -1  # no record (an end of the least-recently-used list)
_IN_LRU = 1  # Columns.flags: published, unpinned, in the least-recently-used list
_DISK_LIVE = 2  # Columns.flags: the record's last log entry names a block


@dataclass(slots=True)
class OwnSlab:
    """A slab this process writes: it holds the flock on the data file."""

    records: int  # how many records it may hold
    data_fd: int
    log_fd: int
    log_entries: int
    end: int  # bytes of the data file written so far (its size)
    lock: threading.Lock = field(default_factory=threading.Lock)  # log appends and compaction
    removed: bool = False  # its files were unlinked under us (seen by a refresh)


@dataclass(slots=True)
class OtherSlab:
    """A slab another process writes, or wrote: read only, its log followed."""

    data_fd: int
    data_inode: int = 0  # the data file's, to tell a slab made anew under the same number
    log_inode: int = 0
    log_offset: int = 0
    newest: int = 0  # the newest entry's sequence number (`RecordIO.next_seq`): the slab's age
    readers: int = 0  # reads in flight on data_fd
    gone: bool = False  # forgotten: data_fd closes when the last reader is done


@dataclass(slots=True)
class LogNews:
    """What a refresh read of one other slab's log."""

    slab: int
    reset: bool  # read from the start (new slab, or a compacted log): forget what we had
    entries: list[Entry]
    inode: int
    offset: int
    data_fd: int | None  # opened where `reset`: a slab seen for the first time, or made anew
    data_inode: int = 0  # data_fd's


@dataclass(slots=True)
class Claim:
    """A slab this process has just become the writer of, with its log as found."""

    slab: int
    state: OwnSlab
    entries: list[Entry]
    disk_full: bool  # the disk had room for only part of it


class Columns:
    """What each record of one slab holds, in flat arrays indexed by record: the key (in a
    fixed-width arena, as wide as the longest key it has held, and its length: 0 for no entry), the
    payload checksum and, for our own slabs, the age, the neighbours in the least-recently-used
    list (record ids) and the state flags."""

    __slots__ = ("ages", "checksums", "flags", "keys", "lengths", "newer", "older", "width")

    def __init__(self, records: int, *, own: bool, width: int = 0) -> None:
        self.width = width
        self.keys = bytearray(records * width)
        self.lengths = bytearray(records)
        self.checksums = _zeros("Q", records)
        own_records = records if own else 0
        self.ages = _zeros("q", own_records)
        self.older = _zeros("q", own_records)
        self.newer = _zeros("q", own_records)
        self.flags = bytearray(own_records)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        arrays = (self.checksums, self.ages, self.older, self.newer)
        return len(self.keys) + len(self.lengths) + len(self.flags) + sum(8 * len(a) for a in arrays)

    def key(self, record: int) -> bytearray | None:
        n = self.lengths[record] if record < len(self.lengths) else 0
        if not n:
            return None
        start = record * self.width
        return self.keys[start : start + n]

    def set(self, record: int, key: bytes, checksum: int) -> None:
        if record >= len(self.lengths):
            self._grow(record + 1)  # another's slab: as many records as its log has named
        if len(key) > self.width:
            self._widen(len(key))
        start = record * self.width
        self.keys[start : start + len(key)] = key
        self.lengths[record] = len(key)
        self.checksums[record] = checksum

    def clear(self, record: int) -> None:
        if record < len(self.lengths):
            self.lengths[record] = 0

    def _grow(self, records: int) -> None:
        more = max(records, 2 * len(self.lengths)) - len(self.lengths)
        self.keys += bytes(more * self.width)
        self.lengths += bytes(more)
        self.checksums += _zeros("Q", more)

    def _widen(self, width: int) -> None:
        """A longer key than any before: every record's key moved to rows at least twice as wide
        (at most `MAX_KEY_BYTES`), so a slab's keys move at most a few times whatever lengths
        a log names, each move one numpy copy."""
        width = max(width, min(2 * self.width, MAX_KEY_BYTES))
        rows = np.zeros((len(self.lengths), width), dtype=np.uint8)
        if self.width:
            rows[:, : self.width] = np.frombuffer(self.keys, dtype=np.uint8).reshape(-1, self.width)
        self.keys = bytearray(rows.data.cast("B"))
        self.width = width


def _zeros(typecode: str, n: int) -> array[int]:
    out = array(typecode)
    out.frombytes(bytes(8 * n))
    return out


def _id(slab: int, record: int) -> int:
    return slab << _RECORD_BITS | record


def _where(record_id: int) -> Record:
    return record_id >> _RECORD_BITS, record_id & _RECORD_MASK


class SlabIndex:
    """The records of a namespace's slabs, ours and the other processes', and the keys in them.

    A key is found through `find` (`KeyTable`); a record's key and payload checksum through
    `key_of` and `checksum_of` (`Columns`). Our records move between: free (`free`, record ids
    popped from the end), published (the least-recently-used list, oldest first, unless
    pinned), pinned (`readers`: reads in flight and holds; never evicted or reused) and doomed
    (dropped while pinned: free at the last unpin). A record is "disk live" when its last log
    entry names a block, so that reusing it logs a deletion first.
    """

    def __init__(self, record_bytes: int) -> None:
        self.record_bytes = record_bytes
        self.columns: dict[int, Columns] = {}  # slab -> what its records hold
        self.table = KeyTable(self._key_at, same_keys=self._same_keys)  # key -> its record (id)
        self.readers: Counter[Record] = Counter()
        self.doomed: set[Record] = set()  # own, dropped while pinned: freed at the last unpin
        self.holds: dict[bytes, list[Record]] = {}  # `hold`s not yet released: each pins its record
        self.free = array("q")  # ids of own records that hold nothing; popped from the end
        self._oldest = _NONE  # the least-recently-used list's ends (record ids)
        self._newest = _NONE
        self._published = 0  # records in that list
        #: What a block published now is as old as, in the logs' sequence numbers (the tier's
        #: `RecordIO.current_seq`; the coarse clock where there are no logs).
        self.clock: Callable[[], int] = coarse_time_ns
        self.own: dict[int, OwnSlab] = {}
        self.others: dict[int, OtherSlab] = {}

    # -- what is where ---------------------------------------------------------------------------
    def __len__(self) -> int:
        """Keys indexed: blocks this process can read."""
        return len(self.table)

    def find(self, key: bytes) -> Record | None:
        """The record we read `key` from; None if no record we know of holds it."""
        found = self.table.get(key)
        return None if found < 0 else _where(found)

    def holds_each(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether some record we know of holds each of `keys` (`find` of a batch, faster)."""
        return [found >= 0 for found in self.table.get_many(keys)]

    def key_of(self, where: Record) -> bytes | None:
        """The key `where` holds, as far as we know; None if none."""
        columns = self.columns.get(where[0])
        key = None if columns is None else columns.key(where[1])
        return None if key is None else bytes(key)

    def checksum_of(self, where: Record) -> int:
        """The payload checksum of an indexed record."""
        return self.columns[where[0]].checksums[where[1]]

    def nbytes(self) -> int:
        """Bytes the index's arrays take (its sets and dicts of operations in flight aside)."""
        return self.table.nbytes + 8 * len(self.free) + sum(c.nbytes for c in self.columns.values())

    def own_blocks(self) -> int:
        """Blocks in our slabs: published, and pinned."""
        return self._published + sum(1 for w in self.readers if w[0] in self.own)

    def used_bytes(self) -> int:
        """Bytes our slabs take on disk: their data files and their logs."""
        return sum(s.end + s.log_entries * ENTRY for s in self.own.values())

    def _key_at(self, record_id: int) -> bytearray | None:
        columns = self.columns.get(record_id >> _RECORD_BITS)
        return None if columns is None else columns.key(record_id & _RECORD_MASK)

    def _same_keys(
        self, record_ids: np.ndarray[Any, np.dtype[np.int64]], rows: np.ndarray[Any, np.dtype[np.uint8]]
    ) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """Whether each record holds the key in its row of `rows` (keys of one length): `_key_at`
        for a batch (`KeyTable.get_many`), compared in numpy, slab by slab: the records sorted
        once, so each slab's are a slice, and its keys compared whole (as one opaque item each)
        where its rows are as wide as the keys (an engine's keys are all of one length)."""
        same = np.zeros(len(rows), dtype=bool)
        length = rows.shape[1]
        order = np.argsort(record_ids)
        ordered = record_ids[order]
        slabs = ordered >> _RECORD_BITS
        records = ordered & _RECORD_MASK
        ends = [*(np.flatnonzero(slabs[1:] != slabs[:-1]) + 1).tolist(), len(order)]
        asked = np.ascontiguousarray(rows).view(f"V{length}").ravel()
        start = 0
        for end in ends:
            slab, first = int(slabs[start]), start
            start = end
            columns = self.columns.get(slab)
            if columns is None or columns.width < length:
                continue
            at, held = order[first:end], records[first:end]
            records_held = len(columns.lengths)
            if held[-1] >= records_held:  # sorted: the last is the largest (never, in fact)
                inside = held < records_held
                at, held = at[inside], held[inside]
            lengths = np.frombuffer(columns.lengths, dtype=np.uint8)
            if columns.width == length:
                stored = np.frombuffer(columns.keys, dtype=f"V{length}")
                same[at] = (lengths[held] == length) & (stored[held] == asked[at])
            else:
                keys = np.frombuffer(columns.keys, dtype=np.uint8).reshape(records_held, columns.width)
                same[at] = (lengths[held] == length) & (keys[held, :length] == rows[at]).all(axis=1)
        return same

    def _index(self, where: Record, key: bytes, checksum: int) -> None:
        """`where` holds `key`, and `key` is found there."""
        self.columns[where[0]].set(where[1], key, checksum)
        self.table.put(key, _id(*where))

    def _unindex(self, where: Record) -> bytes | None:
        """`where` holds nothing we know of (its key, if it was found there, no longer is);
        returns the key it held."""
        columns = self.columns.get(where[0])
        key = None if columns is None else columns.key(where[1])
        if columns is None or key is None:
            return None
        held = bytes(key)
        self.table.remove(held, _id(*where))  # its probe starts where the key hashes to
        columns.clear(where[1])
        return held

    def _disk_live(self, where: Record) -> bool:
        return bool(self.columns[where[0]].flags[where[1]] & _DISK_LIVE)

    def _set_disk_live(self, where: Record, live: bool) -> None:
        flags = self.columns[where[0]].flags
        flags[where[1]] = flags[where[1]] | _DISK_LIVE if live else flags[where[1]] & ~_DISK_LIVE

    # -- the least-recently-used list of our published, unpinned records -------------------------
    def _in_lru(self, where: Record) -> bool:
        columns = self.columns.get(where[0])
        return columns is not None and where[0] in self.own and bool(columns.flags[where[1]] & _IN_LRU)

    def _lru_add(self, where: Record, *, newest: bool = True) -> None:
        """`where` at the newest end of the list (or the oldest), taken out first if in it."""
        self._lru_remove(where)
        columns, record, rid = self.columns[where[0]], where[1], _id(*where)
        columns.flags[record] |= _IN_LRU
        self._published += 1
        if newest:
            columns.older[record], columns.newer[record] = self._newest, _NONE
            if self._newest == _NONE:
                self._oldest = rid
            else:
                self._link(self._newest).newer[self._newest & _RECORD_MASK] = rid
            self._newest = rid
        else:
            columns.older[record], columns.newer[record] = _NONE, self._oldest
            if self._oldest == _NONE:
                self._newest = rid
            else:
                self._link(self._oldest).older[self._oldest & _RECORD_MASK] = rid
            self._oldest = rid

    def _lru_remove(self, where: Record) -> None:
        if not self._in_lru(where):
            return
        columns, record = self.columns[where[0]], where[1]
        columns.flags[record] &= ~_IN_LRU
        self._published -= 1
        older, newer = columns.older[record], columns.newer[record]
        if older == _NONE:
            self._oldest = newer
        else:
            self._link(older).newer[older & _RECORD_MASK] = newer
        if newer == _NONE:
            self._newest = older
        else:
            self._link(newer).older[newer & _RECORD_MASK] = older

    def _link(self, record_id: int) -> Columns:
        return self.columns[record_id >> _RECORD_BITS]

    # -- room ------------------------------------------------------------------------------------
    def take_free(self) -> tuple[Record, bool] | None:
        """One of our free records, and whether a deletion must be logged before it is written."""
        if not self.free:
            return None
        where = _where(self.free.pop())
        return where, self._disk_live(where)

    def evict_oldest(self) -> tuple[bytes, Record, bool] | None:
        """Our least recently used unpinned block, forgotten: (its key, its record, whether a
        deletion must be logged before the record is written again)."""
        if self._oldest == _NONE:
            return None
        where = _where(self._oldest)
        self._lru_remove(where)
        key = self._unindex(where)
        if key is None:  # a real check: `python -O` strips asserts, and a keyless eviction corrupts the log
            raise RuntimeError(f"fs index: record {where} was in the LRU list without a key")
        return key, where, self._disk_live(where)

    def adoptable(self) -> list[int]:
        """Other slabs, oldest first, whose blocks are all older than our oldest one."""
        oldest = None
        if self._oldest != _NONE:
            oldest = self._link(self._oldest).ages[self._oldest & _RECORD_MASK]
        return sorted(
            (slab for slab, other in self.others.items() if oldest is None or other.newest < oldest),
            key=lambda slab: self.others[slab].newest,
        )

    def take_claim(self, claim: Claim) -> int | None:
        """Make a claimed slab ours: what its log names is indexed as ours, the rest is free.

        Returns the descriptor of our view of it as another's slab, to close, if we had one.
        """
        slab, state = claim.slab, claim.state
        to_close = self.forget_other(slab)
        self.own[slab] = state
        columns = self.columns[slab] = Columns(state.records, own=True)
        live = [(r, e) for r, e in latest_per_record(claim.entries).items() if r < state.records]
        # What it held is older than anything we wrote: oldest first at the cold end of the LRU.
        for record, e in reversed(live):
            where = (slab, record)
            if e.deleted:
                continue
            columns.flags[record] |= _DISK_LIVE
            held = self.find(e.key)
            if held is not None and held[0] in self.own:
                continue  # we hold this key elsewhere: this record is room
            self._index(where, e.key, e.checksum)
            columns.ages[record] = e.seq
            if not self.readers[where]:
                self._lru_add(where, newest=False)
        # The records that hold nothing, found in numpy: a slab has tens of thousands, and a loop
        # over them held the event loop some 20 ms of CPU a claim.
        empty = np.frombuffer(columns.lengths, dtype=np.uint8) == 0
        for where in [w for w in self.readers if w[0] == slab and w[1] < len(empty)]:  # in flight
            if empty[where[1]]:
                empty[where[1]] = False
                self.doomed.add(where)  # read as another's record: room once that read ends
        free = array("q")
        # Popped from the end: record 0 first.
        free.frombytes((np.flatnonzero(empty)[::-1] | (slab << _RECORD_BITS)).astype(np.int64).tobytes())
        # Behind what is left of the slab before (claimed ahead): that one fills first, in order.
        self.free = free + self.free
        return to_close

    def shrink_to_disk(self) -> None:
        """The disk is full: our slabs hold only the records their files already have room for."""
        for state in self.own.values():
            state.records = max(1, min(state.records, state.end // self.record_bytes))
        self.free = array(
            "q", (r for r in self.free if r & _RECORD_MASK < self.own[r >> _RECORD_BITS].records)
        )

    # -- writes ----------------------------------------------------------------------------------
    def touch(self, where: Record) -> None:
        """A block stored again: most recently used."""
        if self._in_lru(where):
            self._lru_add(where)

    def abandon(self, wheres: list[Record]) -> None:
        """Records taken for writes that were cancelled: free again, and as their log now says
        who knows what, a deletion goes first when they are reused."""
        for where in wheres:
            self._set_disk_live(where, True)
            self.free.append(_id(*where))

    def settle_writes(
        self,
        writes: list[tuple[bytes, Record, bool]],
        status: Sequence[str],
        checksums: list[int],
        full: dict[int, int],
    ) -> list[bool]:
        """Account for the records `RecordIO.write` wrote, or did not; per write, whether
        its block is now published. `full` holds the file sizes of slabs the disk filled."""
        for slab, end in full.items():
            self.own[slab].end = max(self.own[slab].end, end)
        for (_, where, _), state in zip(writes, status):
            if state == "ok":
                own = self.own[where[0]]
                own.end = max(own.end, (where[1] + 1) * self.record_bytes)
        published = []
        for (key, where, deletion), state, checksum in zip(writes, status, checksums):
            if deletion and state != "kept":
                self._set_disk_live(where, False)  # the deletion was logged
            published.append(state == "ok")
            if state == "ok":
                self.publish(key, where, checksum)
                continue
            if state != "nospace":
                self.free.append(_id(*where))
            elif (where[1] + 1) * self.record_bytes <= self.own[where[0]].end:
                self.free.append(_id(*where))  # overwriting bytes the file has needs no new room
            if state == "kept":
                self._set_disk_live(where, True)
        return published

    def publish(self, key: bytes, where: Record, checksum: int) -> None:
        old = self.find(key)
        if old is not None and old[0] in self.own:  # stored twice concurrently: keep the newer
            self.drop(old)
        self._index(where, key, checksum)
        self._lru_add(where)
        self.columns[where[0]].ages[where[1]] = self.clock()
        self._set_disk_live(where, True)

    # -- forgetting ------------------------------------------------------------------------------
    def drop(self, where: Record) -> None:
        """Forget one of our published records; free it now, or when its last pin goes."""
        self._unindex(where)
        self._lru_remove(where)
        if self.readers[where]:
            self.doomed.add(where)
        else:
            self.free.append(_id(*where))

    def forget(self, where: Record) -> None:
        """Forget a record, ours or another's (deleted, found corrupt or stale)."""
        if where[0] in self.own:
            self.drop(where)
        else:
            self.unindex_other(*where)

    def unindex_other(self, slab: int, record: int) -> None:
        self._unindex((slab, record))

    def forget_other(self, slab: int) -> int | None:
        """Forget another's slab (its files are gone, or it became ours); returns its data
        descriptor if no read is using it, to close."""
        other = self.others.get(slab)
        if other is None:
            return None
        self._unindex_slab(slab)
        del self.columns[slab]
        del self.others[slab]
        other.gone = True
        return other.data_fd if other.readers == 0 else None

    def _unindex_slab(self, slab: int) -> None:
        for record, n in enumerate(self.columns[slab].lengths):
            if n:
                self._unindex((slab, record))

    # -- the other processes' news ---------------------------------------------------------------
    def apply_news(self, news: LogNews) -> int | None:
        """Index what a refresh read of another slab's log; returns a descriptor not needed."""
        if news.slab in self.own:  # we became its writer meanwhile: our view is the truth
            return news.data_fd
        other = self.others.get(news.slab)
        to_close = None
        if other is None:
            if news.data_fd is None:
                return None
            other = self.others[news.slab] = OtherSlab(news.data_fd, news.data_inode)
            self.columns[news.slab] = Columns(0, own=False)
        elif news.data_fd is not None and news.data_inode != other.data_inode:
            # Made anew under the same number (`kvtier fs gc`, then a new writer): its records
            # are read from the new data file from now on; reads in flight keep the old one,
            # closed at their last unpin.
            other.gone = True
            to_close = other.data_fd if other.readers == 0 else None
            other = self.others[news.slab] = OtherSlab(news.data_fd, news.data_inode)
        else:
            to_close = news.data_fd
        if news.reset:
            self._unindex_slab(news.slab)
        other.log_inode, other.log_offset = news.inode, news.offset
        other.newest = max([other.newest, *(e.seq for e in news.entries)])
        # A refresh after a restart indexes every block of the namespace here: one probe of the
        # table per entry, and the record's columns set before its key is found there.
        columns, put, first_id = self.columns[news.slab], self.table.put, _id(news.slab, 0)
        self.table.reserve(len(self.table) + len(news.entries))
        for e in news.entries:
            record = e.record
            if record < len(columns) and columns.lengths[record]:
                self._unindex((news.slab, record))
            if not e.deleted:
                columns.set(record, e.key, e.checksum)
                # Where we hold the key, it is found in ours; this record's entry is known.
                put(e.key, first_id | record, self._is_own)
        return to_close

    def _is_own(self, record_id: int) -> bool:
        return record_id >> _RECORD_BITS in self.own

    # -- pins: reads in flight and holds -----------------------------------------------------------
    def pin(self, key: bytes) -> tuple[Record, OwnSlab | OtherSlab] | None:
        """Pin the record holding `key` for a read (never evicted or reused until unpinned)."""
        where = self.find(key)
        if where is None:
            return None
        slab = self.own.get(where[0]) or self.others[where[0]]
        if isinstance(slab, OtherSlab):
            slab.readers += 1
        self.readers[where] += 1
        self._lru_remove(where)
        return where, slab

    def unpin(self, where: Record, slab: OwnSlab | OtherSlab) -> int | None:
        """Undo a pin; returns the data descriptor of a forgotten slab whose last read ended."""
        to_close = None
        self.readers[where] -= 1
        if isinstance(slab, OtherSlab):
            slab.readers -= 1
            if slab.gone and slab.readers == 0:
                to_close = slab.data_fd
        if self.readers[where]:
            return to_close
        del self.readers[where]
        if where in self.doomed:
            self.doomed.discard(where)
            self.free.append(_id(*where))
        elif where[0] in self.own and self.key_of(where) is not None:
            self._lru_add(where)  # most recently used now
        return to_close

    def hold(self, key: bytes) -> bool:
        """Pin our record of `key` until `release`; another process's record is its writer's to
        evict: False."""
        where = self.find(key)
        if where is None or where[0] not in self.own:
            return False
        self.readers[where] += 1
        self._lru_remove(where)
        self.holds.setdefault(key, []).append(where)
        return True

    def release(self, key: bytes) -> None:
        places = self.holds.get(key)
        if not places:
            return
        where = places.pop()
        if not places:
            del self.holds[key]
        slab = self.own.get(where[0])
        if slab is not None:  # else closed meanwhile: nothing left to unpin
            self.unpin(where, slab)
