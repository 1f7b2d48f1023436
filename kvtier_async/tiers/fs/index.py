"""`SlabIndex`: which record of which slab holds which block, as this process sees a namespace.

A synchronous state object, like `PrimaryTier`: no I/O, no awaits, touched on the event-loop
thread only. It keeps this process's own slabs (their free records, the published ones in
least-recently-used order, the ones pinned by reads and holds, the ones freed while read)
and what it has read of the other processes' logs (`SlabFiles.read_news`). Where a transition
means a file descriptor may be closed, it returns the descriptor: the tier closes it.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .layout import ENTRY, Entry, coarse_time_ns, latest_per_record

__all__ = ["Claim", "LogNews", "OtherSlab", "OwnSlab", "Record", "SlabIndex"]

Record = tuple[int, int]  # (slab, record index)


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
    log_inode: int = 0
    log_offset: int = 0
    records: set[int] = field(default_factory=set)  # those in our index
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
    data_fd: int | None  # opened for a slab seen for the first time


@dataclass(slots=True)
class Claim:
    """A slab this process has just become the writer of, with its log as found."""

    slab: int
    state: OwnSlab
    entries: list[Entry]
    disk_full: bool  # the disk had room for only part of it


class SlabIndex:
    """The records of a namespace's slabs, ours and the other processes', and the keys in them.

    A key is found through `where`; a record's key and payload checksum through `entry`. Our
    records move between: free (`free`, popped from the end), published (`lru`, oldest first,
    unless pinned), pinned (`readers`: reads in flight and holds; never evicted or reused) and
    doomed (dropped while pinned: free at the last unpin). `disk_live` marks our records whose
    last log entry names a block, so that reusing one logs a deletion first.
    """

    def __init__(self, record_bytes: int) -> None:
        self.record_bytes = record_bytes
        self.where: dict[bytes, Record] = {}  # key -> the record we read it from
        self.entry: dict[Record, tuple[bytes, int]] = {}  # record -> (key, payload checksum)
        self.lru: OrderedDict[Record, None] = OrderedDict()  # own, published, unpinned; oldest first
        self.readers: Counter[Record] = Counter()
        self.doomed: set[Record] = set()  # own, dropped while pinned: freed at the last unpin
        self.holds: dict[bytes, list[Record]] = {}  # `hold`s not yet released: each pins its record
        self.free: list[Record] = []  # own records that hold nothing; popped from the end
        self.disk_live: set[Record] = set()  # own records whose last log entry names a block
        self.age: dict[Record, int] = {}  # own published records: when written (`clock`)
        #: What a block published now is as old as, in the logs' sequence numbers (the tier's
        #: `RecordIO.current_seq`; the coarse clock where there are no logs).
        self.clock: Callable[[], int] = coarse_time_ns
        self.own: dict[int, OwnSlab] = {}
        self.others: dict[int, OtherSlab] = {}

    # -- what is where ---------------------------------------------------------------------------
    def own_blocks(self) -> int:
        """Blocks in our slabs: published, and pinned."""
        return len(self.lru) + sum(1 for w in self.readers if w[0] in self.own)

    def used_bytes(self) -> int:
        """Bytes our slabs take on disk: their data files and their logs."""
        return sum(s.end + s.log_entries * ENTRY for s in self.own.values())

    # -- room ------------------------------------------------------------------------------------
    def take_free(self) -> tuple[Record, bool] | None:
        """One of our free records, and whether a deletion must be logged before it is written."""
        if not self.free:
            return None
        where = self.free.pop()
        return where, where in self.disk_live

    def evict_oldest(self) -> tuple[bytes, Record, bool] | None:
        """Our least recently used unpinned block, forgotten: (its key, its record, whether a
        deletion must be logged before the record is written again)."""
        if not self.lru:
            return None
        where, _ = self.lru.popitem(last=False)
        key, _ = self.entry.pop(where)
        del self.where[key]
        self.age.pop(where, None)
        return key, where, where in self.disk_live

    def adoptable(self) -> list[int]:
        """Other slabs, oldest first, whose blocks are all older than our oldest one."""
        oldest = self.age.get(next(iter(self.lru)), 0) if self.lru else None
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
        live = [(r, e) for r, e in latest_per_record(claim.entries).items() if r < state.records]
        # What it held is older than anything we wrote: oldest first at the cold end of the LRU.
        for record, e in reversed(live):
            where = (slab, record)
            if e.deleted:
                continue
            self.disk_live.add(where)
            held = self.where.get(e.key)
            if held is not None and held[0] in self.own:
                continue  # we hold this key elsewhere: this record is room
            self.where[e.key] = where
            self.entry[where] = (e.key, e.checksum)
            self.age[where] = e.seq
            if not self.readers[where]:
                self.lru[where] = None
                self.lru.move_to_end(where, last=False)
        free = []
        for record in range(state.records - 1, -1, -1):  # popped from the end: record 0 first
            where = (slab, record)
            if where in self.entry:
                continue
            if self.readers[where]:
                self.doomed.add(where)  # read as another's record: room once that read ends
            else:
                free.append(where)
        # Behind what is left of the slab before (claimed ahead): that one fills first, in order.
        self.free[:0] = free
        return to_close

    def shrink_to_disk(self) -> None:
        """The disk is full: our slabs hold only the records their files already have room for."""
        for state in self.own.values():
            state.records = max(1, min(state.records, state.end // self.record_bytes))
        self.free = [w for w in self.free if w[1] < self.own[w[0]].records]

    # -- writes ----------------------------------------------------------------------------------
    def touch(self, where: Record) -> None:
        """A block stored again: most recently used."""
        if where in self.lru:
            self.lru.move_to_end(where)

    def abandon(self, wheres: list[Record]) -> None:
        """Records taken for writes that were cancelled: free again, and as their log now says
        who knows what, a deletion goes first when they are reused."""
        for where in wheres:
            self.disk_live.add(where)
            self.free.append(where)

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
                self.disk_live.discard(where)  # the deletion was logged
            published.append(state == "ok")
            if state == "ok":
                self.publish(key, where, checksum)
                continue
            if state != "nospace":
                self.free.append(where)
            elif (where[1] + 1) * self.record_bytes <= self.own[where[0]].end:
                self.free.append(where)  # overwriting bytes the file has needs no new room
            if state == "kept":
                self.disk_live.add(where)
        return published

    def publish(self, key: bytes, where: Record, checksum: int) -> None:
        old = self.where.get(key)
        if old is not None and old[0] in self.own:  # stored twice concurrently: keep the newer
            self.drop(old)
        self.where[key] = where
        self.entry[where] = (key, checksum)
        self.lru[where] = None
        self.age[where] = self.clock()
        self.disk_live.add(where)

    # -- forgetting ------------------------------------------------------------------------------
    def drop(self, where: Record) -> None:
        """Forget one of our published records; free it now, or when its last pin goes."""
        entry = self.entry.pop(where, None)
        if entry is not None and self.where.get(entry[0]) == where:
            del self.where[entry[0]]
        self.lru.pop(where, None)
        self.age.pop(where, None)
        if self.readers[where]:
            self.doomed.add(where)
        else:
            self.free.append(where)

    def forget(self, where: Record) -> None:
        """Forget a record, ours or another's (deleted, found corrupt or stale)."""
        if where[0] in self.own:
            self.drop(where)
        else:
            self.unindex_other(*where)

    def unindex_other(self, slab: int, record: int) -> None:
        where = (slab, record)
        entry = self.entry.pop(where, None)
        if entry is not None and self.where.get(entry[0]) == where:
            del self.where[entry[0]]
        other = self.others.get(slab)
        if other is not None:
            other.records.discard(record)

    def forget_other(self, slab: int) -> int | None:
        """Forget another's slab (its files are gone, or it became ours); returns its data
        descriptor if no read is using it, to close."""
        other = self.others.get(slab)
        if other is None:
            return None
        for record in list(other.records):
            self.unindex_other(slab, record)
        del self.others[slab]
        other.gone = True
        return other.data_fd if other.readers == 0 else None

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
            other = self.others[news.slab] = OtherSlab(news.data_fd)
        else:
            to_close = news.data_fd
        if news.reset:
            for record in list(other.records):
                self.unindex_other(news.slab, record)
        other.log_inode, other.log_offset = news.inode, news.offset
        other.newest = max([other.newest, *(e.seq for e in news.entries)])
        for e in news.entries:
            self.unindex_other(news.slab, e.record)
            if not e.deleted:
                where = (news.slab, e.record)
                self.entry[where] = (e.key, e.checksum)
                other.records.add(e.record)
                held = self.where.get(e.key)
                if held is None or held[0] not in self.own:
                    self.where[e.key] = where
        return to_close

    # -- pins: reads in flight and holds -----------------------------------------------------------
    def pin(self, key: bytes) -> tuple[Record, OwnSlab | OtherSlab] | None:
        """Pin the record holding `key` for a read (never evicted or reused until unpinned)."""
        where = self.where.get(key)
        if where is None:
            return None
        slab = self.own.get(where[0]) or self.others[where[0]]
        if isinstance(slab, OtherSlab):
            slab.readers += 1
        self.readers[where] += 1
        self.lru.pop(where, None)
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
            self.free.append(where)
        elif where in self.entry and where[0] in self.own:
            self.lru[where] = None  # most recently used now
        return to_close

    def hold(self, key: bytes) -> bool:
        """Pin our record of `key` until `release`; another process's record is its writer's to
        evict: False."""
        where = self.where.get(key)
        if where is None or where[0] not in self.own:
            return False
        self.readers[where] += 1
        self.lru.pop(where, None)
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
