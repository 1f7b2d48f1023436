"""`FileSystemTier` (`"fs"`): local NVMe, shared by the processes of a host, crash-safe,
self-verifying, persistent across restarts.

Blocks live as bare records in slab files (see `fs_layout` for the format and
how processes share a directory). Writes and reads go straight between the
aligned primary slots and the files with O_DIRECT where the file system allows
it, one `pwritev`/`preadv` per run of neighbouring records, on the scheduler's
worker threads. The index is in memory, owned by the event-loop thread: the
slabs this process writes, plus what it has read of the other slabs' logs,
brought up to date when a lookup misses (at most every `refresh_interval_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import mmap
import os
import shutil
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..block_format import payload_checksum
from ..errors import ConfigError, KVTierError
from ..keys import check_keys
from ..spec import OffloadingSpec
from ..tier import SecondaryTierManager
from ..workers import wait_uncancellable
from .fs_layout import (
    ENTRY,
    FILE_MODE,
    Entry,
    allocate,
    append_to_log,
    encode_entry,
    is_out_of_space,
    latest_per_record,
    namespace_dir_name,
    prepare_directory,
    read_log,
    record_bytes_for,
    reserve_log_room,
    rewrite_log,
    slab_numbers,
    slab_path,
    try_flock,
)
from .fs_staging import STAGE_BYTES, Stager, address_of, pages_scattered

__all__ = ["DEFAULT_CAPACITY_BYTES", "DEFAULT_REFRESH_INTERVAL_S", "FileSystemTier"]

log = logging.getLogger(__name__)

#: Default `capacity_bytes`: 64 GiB, but never more than 80% of what the file
#: system can give us (free space plus what this namespace already holds).
DEFAULT_CAPACITY_BYTES = 64 << 30
#: Default `refresh_interval_s`: how stale this process's view of other processes' blocks may be.
DEFAULT_REFRESH_INTERVAL_S = 0.05
SLAB_TARGET_BYTES = 256 << 20  # records per slab file, at most
MIN_SLABS = 16  # a namespace has at least this many slabs (if it holds that many records)
_IOV_MAX = 1024
Record = tuple[int, int]  # (slab, record index)


@dataclass(slots=True)
class _OwnSlab:
    """A slab this process writes: it holds the flock on the data file."""

    records: int  # how many records it may hold
    data_fd: int
    log_fd: int
    log_entries: int
    end: int  # bytes of the data file written so far (its size)
    lock: threading.Lock = field(default_factory=threading.Lock)  # log appends and compaction
    removed: bool = False  # its files were unlinked under us (seen by a refresh)


@dataclass(slots=True)
class _OtherSlab:
    """A slab another process writes, or wrote: read only, its log followed."""

    data_fd: int
    log_inode: int = 0
    log_offset: int = 0
    records: set[int] = field(default_factory=set)  # those in our index
    newest: int = 0  # the newest entry's sequence number (wall-clock ns): the slab's age
    readers: int = 0  # reads in flight on data_fd
    gone: bool = False  # forgotten: data_fd closes when the last reader is done


@dataclass(slots=True)
class _LogNews:
    """What a refresh read of one other slab's log."""

    slab: int
    reset: bool  # read from the start (new slab, or a compacted log): forget what we had
    entries: list[Entry]
    inode: int
    offset: int
    data_fd: int | None  # opened for a slab seen for the first time


@dataclass(slots=True)
class _Claim:
    """A slab this process has just become the writer of, with its log as found."""

    slab: int
    state: _OwnSlab
    entries: list[Entry]
    disk_full: bool  # the disk had room for only part of it


def _retrieve_exception(task: asyncio.Future[None]) -> None:
    """Done-callback of a shared task: its exception is its awaiters' to handle, not an
    "exception was never retrieved" at exit when none was left."""
    if not task.cancelled():
        task.exception()


def _probe_direct_io(directory: Path) -> bool:
    """Whether this file system takes O_DIRECT writes and reads of aligned buffers."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = directory / f"direct-io-probe.{os.getpid()}.{threading.get_native_id()}.tmp"
    buffer = memoryview(mmap.mmap(-1, mmap.PAGESIZE))
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, FILE_MODE)
        try:
            os.pwrite(fd, buffer, 0)
            os.preadv(fd, [buffer], 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        path.unlink(missing_ok=True)


class FileSystemTier(SecondaryTierManager):
    """Blocks on a local file system under `root`, within `capacity_bytes`, least recently used
    evicted first; any number of processes may share a root.

    Args:
        root: directory for the cache (created 0700 if missing). Processes that open the same
            root and namespace share its blocks: each finds what any of them stored.
        capacity_bytes: bytes on disk this namespace may take, logs included, all processes
            together. Default `DEFAULT_CAPACITY_BYTES`, capped at 80% of the space available.
        direct_io: "auto" probes O_DIRECT once and falls back to buffered I/O
            where the file system refuses it; True requires it; False never uses it.
        fsync: False (it is a cache); True makes `store` return only once the
            data and the index entry are durable.
        staging: with O_DIRECT, whether reads and writes go through a per-thread huge-page
            buffer instead of straight between the primary memory and the disk. "auto"
            stages when the primary memory's pages are found scattered in physical memory
            (see `fs_staging`), where direct I/O runs far below the disk's speed.
        refresh_interval_s: a lookup that misses reads the other processes' new index
            entries if the last such read is older than this; `refresh()` reads them now.
    """

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str = "fs",
        *,
        root: str | os.PathLike[str],
        capacity_bytes: int | None = None,
        direct_io: bool | str = "auto",
        fsync: bool = False,
        staging: bool | str = "auto",
        refresh_interval_s: float = DEFAULT_REFRESH_INTERVAL_S,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        if not isinstance(root, (str, os.PathLike)) or not str(root):
            raise ConfigError(f"fs tier: root must be a directory path, got {root!r}")
        self.record_bytes = record_bytes_for(offloading_spec.block_nbytes)
        if capacity_bytes is not None and (
            isinstance(capacity_bytes, bool)
            or not isinstance(capacity_bytes, int)
            or capacity_bytes < self.record_bytes + ENTRY
        ):
            raise ConfigError(
                "fs tier: capacity_bytes must be an int of at least one record "
                f"({self.record_bytes + ENTRY} bytes), got {capacity_bytes!r}"
            )
        if direct_io not in ("auto", True, False):
            raise ConfigError(f'fs tier: direct_io must be "auto", True or False, got {direct_io!r}')
        if not isinstance(fsync, bool):
            raise ConfigError(f"fs tier: fsync must be a bool, got {fsync!r}")
        if staging not in ("auto", True, False):
            raise ConfigError(f'fs tier: staging must be "auto", True or False, got {staging!r}')
        if (
            isinstance(refresh_interval_s, bool)
            or not isinstance(refresh_interval_s, (int, float))
            or not 0 <= refresh_interval_s < float("inf")
        ):
            raise ConfigError(
                f"fs tier: refresh_interval_s must be a number of seconds >= 0, got {refresh_interval_s!r}"
            )
        self.root = Path(root)
        self.directory = self.root / namespace_dir_name(offloading_spec.namespace)
        self.requested_capacity = capacity_bytes
        self.capacity_bytes = 0  # resolved on open
        self.direct_io_requested = direct_io
        self.direct_io = False
        self.fsync = fsync
        self.staging_requested = staging
        self.staging = False  # resolved on open
        self._stager = Stager()
        self.refresh_interval_s = float(refresh_interval_s)
        self._primary_base = address_of(self.primary_kv_view)
        # The index; touched on the event-loop thread only.
        self._where: dict[bytes, Record] = {}  # key -> the record we read it from
        self._entry: dict[Record, tuple[bytes, int]] = {}  # record -> (key, payload checksum)
        self._lru: OrderedDict[Record, None] = OrderedDict()  # own, published, unread; oldest first
        self._readers: Counter[Record] = Counter()
        self._doomed: set[Record] = set()  # own, dropped while being read: freed at the last unpin
        self._holds: dict[bytes, list[Record]] = {}  # `hold`s not yet released: each pins its record
        self._free: list[Record] = []  # own records that hold nothing; popped from the end
        self._disk_live: set[Record] = set()  # own records whose last log entry names a block
        self._age: dict[Record, int] = {}  # own published records: when written (wall-clock ns)
        self._own: dict[int, _OwnSlab] = {}
        self._others: dict[int, _OtherSlab] = {}
        self._slab_records = 1
        self._max_slabs = 0
        self._claim_ahead_records = 0
        self._can_claim = True  # False until a refresh once no slab could be claimed
        self._may_create = True  # False once every slab number below the capacity exists
        self._disk_full = False
        self._claiming: asyncio.Future[None] | None = None
        self._refreshing: asyncio.Future[None] | None = None
        self._last_refresh = float("-inf")
        self._seq = 0
        self._seq_lock = threading.Lock()

    # -- opening and closing -------------------------------------------------------------------
    async def open_backend(self) -> None:
        await self.run_blocking(self._open_files)
        await self._refresh_now()

    def _open_files(self) -> None:
        """Worker thread: make or check the directory, probe O_DIRECT, make the staging buffers
        if staging, size the namespace."""
        prepare_directory(self.root, self.directory, self.offloading_spec.namespace)
        if self.direct_io_requested == "auto":
            self.direct_io = _probe_direct_io(self.directory)
        elif self.direct_io_requested:
            if not _probe_direct_io(self.directory):
                raise KVTierError(f"fs tier: O_DIRECT is not supported under {self.directory}")
            self.direct_io = True
        if self._primary_base % 4096:
            self.direct_io = False  # O_DIRECT needs aligned memory; a foreign view may not be
        if self.staging_requested == "auto":
            self.staging = self.direct_io and pages_scattered(self.primary_kv_view) is True
        else:
            self.staging = self.direct_io and bool(self.staging_requested)
        if self.staging:
            self._stager.reserve(self.scheduler.limits.io_threads)
        if self.requested_capacity is None:
            existing = 0
            for n in slab_numbers(self.directory, self.block_nbytes):
                with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                    existing += os.stat(slab_path(self.directory, self.block_nbytes, n, "kvs")).st_size
            usage = shutil.disk_usage(self.directory)
            self.capacity_bytes = min(DEFAULT_CAPACITY_BYTES, int(0.8 * (usage.free + existing)))
        else:
            self.capacity_bytes = self.requested_capacity
        # Room for each record and, at worst, four log entries about it before compaction.
        max_records = max(1, self.capacity_bytes // (self.record_bytes + 4 * ENTRY))
        # At least MIN_SLABS slabs where the capacity allows: each writing process needs one.
        self._slab_records = max(1, min(max_records // MIN_SLABS, SLAB_TARGET_BYTES // self.record_bytes))
        self._max_slabs = max(1, max_records // self._slab_records)
        # What the stores in flight may take at once: fewer free records left than this, and
        # the next slab is claimed in the background (never more than half a slab ahead).
        # Store lanes are the scheduler's (a cache's, when shared); batches are cut by our spec.
        in_flight = self.scheduler.limits.max_inflight_stores * self.offloading_spec.limits.batch_blocks
        self._claim_ahead_records = min(self._slab_records // 2, in_flight)

    def _data_flags(self) -> int:
        return os.O_DIRECT if self.direct_io else 0

    async def close_backend(self) -> None:
        # A claim or refresh whose callers were cancelled still runs: let it settle first, so
        # that what it opened is closed here.
        pending = [task for task in (self._claiming, self._refreshing) if task is not None]
        if pending:
            await asyncio.wait(pending)
        own, self._own = list(self._own.values()), {}
        others, self._others = list(self._others.values()), {}
        await self.run_blocking(self._close_files, own, others)
        await self.run_blocking(self._stager.release)

    @staticmethod
    def _close_files(own: list[_OwnSlab], others: list[_OtherSlab]) -> None:
        for state in own:
            os.close(state.data_fd)  # releases the flock: another process may take the slab
            os.close(state.log_fd)
        for other in others:
            if not other.gone:
                os.close(other.data_fd)

    # -- following the other processes ---------------------------------------------------------
    async def refresh(self) -> None:
        """Read the index entries other processes have written since the last refresh.

        A lookup that misses does this itself when the last refresh is older than
        `refresh_interval_s`; call it to see another process's new blocks now.
        """
        with self._operation():
            if await self._ensure_open():
                await self._refresh_now()

    async def _refresh_now(self) -> None:
        if self._refreshing is None:
            # Its own task: a caller cancelled meanwhile never leaves news (and open files) unapplied.
            self._refreshing = asyncio.ensure_future(self._refresh_task())
            self._refreshing.add_done_callback(_retrieve_exception)
        await asyncio.shield(self._refreshing)

    async def _refresh_task(self) -> None:
        try:
            known = {slab: (o.log_inode, o.log_offset) for slab, o in self._others.items()}
            news, gone, removed = await self.run_blocking(self._read_news, known, dict(self._own))
            newly_removed = [slab for slab in removed if not self._own[slab].removed]
            if newly_removed:
                for slab in newly_removed:
                    self._own[slab].removed = True
                log.warning(
                    "fs tier %r: the files of slabs %s, which this process writes, were removed "
                    "under it; it keeps using them until it exits (their space is freed then, and "
                    "other processes' new slabs of those numbers stay unseen here until then). "
                    "Clear a root in use with `kvtier fs gc`, not by removing files",
                    self.name,
                    newly_removed,
                )
            for slab in gone:
                self._forget_other(slab)
            for item in news:
                self._apply_news(item)
            self._last_refresh = time.monotonic()
            if self._disk_full and await self.run_blocking(self._room_for_a_slab):
                # A long-running server must not stay shrunk once the space comes back (an
                # operator's `kvtier fs gc`, another program's files removed).
                log.info("fs tier %r: the disk has room again; claiming slabs", self.name)
                self._disk_full = False
            self._can_claim = not self._disk_full  # a process may have exited, leaving its slabs
            self._may_create = len(self._own) + len(self._others) < self._max_slabs
        finally:
            # Cleared by the task itself, not by a done-callback that runs later: meanwhile a
            # caller would get the finished task back and not read the news it asked for.
            self._refreshing = None

    def _room_for_a_slab(self) -> bool:
        """Worker thread: whether the file system has room for a whole slab (not a sliver: a
        still nearly full disk is then not claimed from on every refresh)."""
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:
            return False
        return free >= self._slab_records * self._disk_bytes_per_record

    @property
    def _disk_bytes_per_record(self) -> int:
        """A record's room on a nearly full disk: the record, its log entries (reserved: four
        per record) and their share of the compacted copy of the log that replaces it."""
        return self.record_bytes + 6 * ENTRY

    def _read_news(
        self, known: dict[int, tuple[int, int]], own: dict[int, _OwnSlab]
    ) -> tuple[list[_LogNews], list[int], list[int]]:
        """Worker thread: the new entries of every slab another process writes or wrote; those of
        the others' slabs known before that are gone; those of our slabs whose files were removed."""
        try:
            present = set(slab_numbers(self.directory, self.block_nbytes))
        except FileNotFoundError:
            # The namespace directory was removed (a root cleared by hand): make it again, so
            # that this process, and the others, go on storing and sharing blocks there.
            log.warning("fs tier %r: %s was removed; making it again", self.name, self.directory)
            prepare_directory(self.root, self.directory, self.offloading_spec.namespace)
            present = set()
        gone = [slab for slab in known if slab not in present]
        removed = [slab for slab, state in own.items() if os.fstat(state.data_fd).st_nlink == 0]
        news: list[_LogNews] = []
        try:
            for slab in sorted(present.difference(own)):
                log_path = slab_path(self.directory, self.block_nbytes, slab, "idx")
                try:
                    st = os.stat(log_path)
                except FileNotFoundError:
                    continue  # its writer has not made the log yet
                inode, offset = known.get(slab, (0, 0))
                if st.st_ino == inode and st.st_size == offset:
                    continue
                reset = slab not in known or st.st_ino != inode or st.st_size < offset
                try:
                    entries, end, inode = read_log(log_path, 0 if reset else offset)
                    data_fd = None
                    if slab not in known:
                        data_path = slab_path(self.directory, self.block_nbytes, slab, "kvs")
                        data_fd = os.open(data_path, os.O_RDONLY | self._data_flags())
                except FileNotFoundError:
                    continue  # removed meanwhile (`kvtier fs gc`)
                news.append(_LogNews(slab, reset, entries, inode, end, data_fd))
        except BaseException:
            for item in news:
                if item.data_fd is not None:
                    os.close(item.data_fd)
            raise
        return news, gone, removed

    def _apply_news(self, news: _LogNews) -> None:
        if news.slab in self._own:  # we became its writer meanwhile: our view is the truth
            if news.data_fd is not None:
                os.close(news.data_fd)
            return
        other = self._others.get(news.slab)
        if other is None:
            if news.data_fd is None:
                return
            other = self._others[news.slab] = _OtherSlab(news.data_fd)
        elif news.data_fd is not None:
            os.close(news.data_fd)
        if news.reset:
            for record in list(other.records):
                self._unindex_other(news.slab, record)
        other.log_inode, other.log_offset = news.inode, news.offset
        other.newest = max([other.newest, *(e.seq for e in news.entries)])
        for e in news.entries:
            self._unindex_other(news.slab, e.record)
            if not e.deleted:
                where = (news.slab, e.record)
                self._entry[where] = (e.key, e.checksum)
                other.records.add(e.record)
                held = self._where.get(e.key)
                if held is None or held[0] not in self._own:
                    self._where[e.key] = where

    def _unindex_other(self, slab: int, record: int) -> None:
        where = (slab, record)
        entry = self._entry.pop(where, None)
        if entry is not None and self._where.get(entry[0]) == where:
            del self._where[entry[0]]
        other = self._others.get(slab)
        if other is not None:
            other.records.discard(record)

    def _forget_other(self, slab: int) -> None:
        other = self._others.get(slab)
        if other is None:
            return
        for record in list(other.records):
            self._unindex_other(slab, record)
        del self._others[slab]
        other.gone = True
        if other.readers == 0:
            os.close(other.data_fd)

    # -- room: claiming slabs, evicting ----------------------------------------------------------
    async def _take_record(self) -> tuple[Record, bool] | None:
        """A record to write into, and whether its last log entry names a block (then a deletion
        goes first); None when the namespace is full and nothing of ours may be evicted.

        Room comes from, in turn: our free records; a new slab below the capacity; a slab whose
        writer has exited, if its newest block is older than our oldest (so a restarted
        process, or several, take the old slabs over one at a time, as their blocks age out);
        our least recently used block.
        """
        while not self._free and self._may_claim():
            # Always a claim still running (see _claim_task), so this waits, and the loop runs.
            # A failed claim stops claiming until the next refresh: then we evict instead.
            await asyncio.shield(self._start_claim())
        if self._free:
            where = self._free.pop()
            if len(self._free) < self._claim_ahead_records and self._claiming is None and self._may_claim():
                # The next slab, ready before the stores in flight need it: claimed only once the
                # free records ran out, it took 16-93 ms under four writes, and every store waited.
                self._start_claim()
            return where, where in self._disk_live
        if self._lru:
            where, _ = self._lru.popitem(last=False)
            key, _ = self._entry.pop(where)
            del self._where[key]
            self._age.pop(where, None)
            self.counters["evictions"] += 1
            self.notify_removed([key])
            return where, where in self._disk_live
        return None

    def _may_claim(self) -> bool:
        return self._can_claim and (self._may_create or bool(self._adoptable()))

    def _start_claim(self) -> asyncio.Future[None]:
        """The claim in progress, started if there is none."""
        if self._claiming is None:
            self._claiming = asyncio.ensure_future(self._claim_task())  # which never raises
        return self._claiming

    def _adoptable(self) -> list[int]:
        """Other slabs, oldest first, whose blocks are all older than our oldest one."""
        oldest = self._age.get(next(iter(self._lru)), 0) if self._lru else None
        return sorted(
            (slab for slab, other in self._others.items() if oldest is None or other.newest < oldest),
            key=lambda slab: self._others[slab].newest,
        )

    async def _claim_task(self) -> None:
        """Claim a slab; never raises but for cancellation (a failure is logged and counted)."""
        try:
            create = self._may_create
            claim = await self.run_blocking(self._claim_slab, set(self._own), create, self._adoptable())
            if claim is None:
                self._may_create = False  # every number below the capacity is taken
                self._can_claim = False  # until the next refresh: a writer may exit meanwhile
                return
            if claim.disk_full:
                self.counters["out_of_space"] += 1
                self._disk_full = True
                self._can_claim = False
            if claim.state.records:
                self._take_claim(claim)
            else:  # not a record's room left on the disk
                await self.run_blocking(self._close_files, [claim.state], [])
        except BaseException as exc:
            self._can_claim = False  # until the next refresh: no retry storm on a failing disk
            if isinstance(exc, asyncio.CancelledError):
                raise
            self.counters["write_errors"] += 1
            self.fault_log.warning("claim", "fs tier %r: claiming a slab failed: %s", self.name, exc)
        finally:
            # Cleared by the task itself, not by a done-callback that runs later: meanwhile a
            # store that found no free record got the finished task back from _start_claim,
            # awaited it without yielding, and spun on it for ever (bench/fs_steady.py, 32 MiB
            # blocks, a full tier: one batch per block, more of them ready than a slab has records).
            self._claiming = None

    def _claim_slab(self, own: set[int], create: bool, adoptable: list[int]) -> _Claim | None:
        """Worker thread: become the writer of a new slab below the namespace's capacity, else of
        the first of `adoptable` whose writer has exited; None if neither is possible."""
        present = set(slab_numbers(self.directory, self.block_nbytes))
        for slab in range(self._max_slabs) if create else ():
            if slab in own or slab in present:
                continue
            path = slab_path(self.directory, self.block_nbytes, slab, "kvs")
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | self._data_flags(), FILE_MODE)
            except FileExistsError:
                continue
            if try_flock(fd):
                if self.fsync:
                    self._fsync_directory()
                return self._adopt(slab, fd)
            os.close(fd)  # another process took it as it was made
        for slab in adoptable:
            if slab in own or slab >= self._max_slabs:
                continue
            path = slab_path(self.directory, self.block_nbytes, slab, "kvs")
            try:
                fd = os.open(path, os.O_RDWR | self._data_flags())
            except FileNotFoundError:
                continue
            if try_flock(fd) and os.fstat(fd).st_nlink:  # not removed while we opened it
                return self._adopt(slab, fd)
            os.close(fd)
        return None

    def _adopt(self, slab: int, data_fd: int) -> _Claim:
        """Worker thread, the slab's flock held: open its log, drop a torn tail, size it to ours."""
        try:
            log_path = slab_path(self.directory, self.block_nbytes, slab, "idx")
            log_path.with_name(log_path.name + ".tmp").unlink(missing_ok=True)  # a compaction cut short
            log_fd = os.open(log_path, os.O_CREAT | os.O_RDWR | os.O_APPEND, FILE_MODE)
            try:
                entries, end, _ = read_log(log_path)
                if os.fstat(log_fd).st_size != end:
                    os.ftruncate(log_fd, end)  # a torn last entry would hide every later one
                size = os.fstat(data_fd).st_size
                if size > self._slab_records * self.record_bytes:  # made with a larger capacity
                    size = self._slab_records * self.record_bytes
                    os.ftruncate(data_fd, size)
                size, disk_full = self._allocate_slab(data_fd, size)
                records = size // self.record_bytes
                reserve_log_room(log_fd, end + 4 * records * ENTRY)
            except BaseException:
                os.close(log_fd)
                raise
        except BaseException:
            os.close(data_fd)
            raise
        state = _OwnSlab(records, data_fd, log_fd, len(entries), size)
        return _Claim(slab, state, entries, disk_full)

    def _allocate_slab(self, data_fd: int, size: int) -> tuple[int, bool]:
        """Allocate a slab's whole file now, before this process writes to it: (its size, whether
        the disk was full).

        Writes into allocated space run side by side under ext4's shared inode lock, where
        writes into holes or past the end take it exclusively, one at a time; and allocating
        later, in steps, waits each time for every direct I/O in flight on the file. A nearly
        full disk gets the records that fit. Where the file system cannot allocate ahead, the
        file grows as records are written.
        """
        rb = self.record_bytes
        want = self._slab_records * rb
        target = want
        while target > size:
            try:
                if not allocate(data_fd, size, target - size):
                    return want, False
                return target, target < want
            except OSError as exc:
                if not is_out_of_space(exc):
                    raise
            room = size + shutil.disk_usage(self.directory).free // self._disk_bytes_per_record * rb
            target = room if room < target else size + (target - size) // 2 // rb * rb
        return os.fstat(data_fd).st_size // self.record_bytes * self.record_bytes, size < want

    def _take_claim(self, claim: _Claim) -> None:
        slab, state = claim.slab, claim.state
        self._forget_other(slab)
        self._own[slab] = state
        live = [(r, e) for r, e in latest_per_record(claim.entries).items() if r < state.records]
        # What it held is older than anything we wrote: oldest first at the cold end of the LRU.
        for record, e in reversed(live):
            where = (slab, record)
            if e.deleted:
                continue
            self._disk_live.add(where)
            held = self._where.get(e.key)
            if held is not None and held[0] in self._own:
                continue  # we hold this key elsewhere: this record is room
            self._where[e.key] = where
            self._entry[where] = (e.key, e.checksum)
            self._age[where] = e.seq
            if not self._readers[where]:
                self._lru[where] = None
                self._lru.move_to_end(where, last=False)
        free = []
        for record in range(state.records - 1, -1, -1):  # popped from the end: record 0 first
            where = (slab, record)
            if where in self._entry:
                continue
            if self._readers[where]:
                self._doomed.add(where)  # read as another's record: room once that read ends
            else:
                free.append(where)
        # Behind what is left of the slab before (claimed ahead): that one fills first, in order.
        self._free[:0] = free

    def _next_seq(self) -> int:
        # Wall-clock nanoseconds, strictly increasing here: comparable across processes, so
        # that a restart orders every process's blocks by age.
        with self._seq_lock:
            self._seq = max(self._seq + 1, time.time_ns())
            return self._seq

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- the index (event-loop thread) ------------------------------------------------------------
    def _publish(self, key: bytes, where: Record, checksum: int) -> None:
        old = self._where.get(key)
        if old is not None and old[0] in self._own:  # stored twice concurrently: keep the newer
            self._drop(old)
        self._where[key] = where
        self._entry[where] = (key, checksum)
        self._lru[where] = None
        self._age[where] = time.time_ns()
        self._disk_live.add(where)

    def _drop(self, where: Record) -> None:
        """Forget one of our published records; free it now, or when its last reader is done."""
        entry = self._entry.pop(where, None)
        if entry is not None and self._where.get(entry[0]) == where:
            del self._where[entry[0]]
        self._lru.pop(where, None)
        self._age.pop(where, None)
        if self._readers[where]:
            self._doomed.add(where)
        else:
            self._free.append(where)

    def _slot_offset(self, block: memoryview) -> int:
        return address_of(block) - self._primary_base

    # -- hooks ---------------------------------------------------------------------------------
    async def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        # docstring inherited
        results = [False] * len(keys)
        jobs: list[tuple[int, bytes, Record, bool]] = []
        try:
            for i, key in enumerate(keys):
                where = self._where.get(key)
                if where is not None:
                    results[i] = True
                    if where in self._lru:
                        self._lru.move_to_end(where)
                    continue
                taken = await self._take_record()
                if taken is None:
                    self.counters["stores_without_room"] += 1
                    continue
                jobs.append((i, key, *taken))
            if not jobs:
                return results
            work = [(key, where, self._slot_offset(blocks[i]), deletion) for i, key, where, deletion in jobs]
            # The checksums are taken on the CPU threads while the I/O thread writes, so the
            # disk never waits for them; the I/O thread then logs the entries that carry them,
            # in the same job: one hand-off per batch, and the thread is free for the next one
            # without a round trip through the loop.
            summing = await self.scheduler.submit_cpu(self._checksums, [w[2] for w in work])
            try:
                status, full, checksums = await self.run_blocking(self._write_data, work, summing)
            finally:
                # Whatever happened, the primary slots are read to the end before we return.
                with contextlib.suppress(Exception):
                    await wait_uncancellable(asyncio.wrap_future(summing))
        except BaseException:
            # Cancelled (the thread, if any, has finished): these records are not published, and
            # what their log says now is unknown, so a deletion goes first when they are reused.
            for _, _, where, _ in jobs:
                self._disk_live.add(where)
                self._free.append(where)
            raise
        for slab, end in full.items():
            self._own[slab].end = max(self._own[slab].end, end)
        for (_, _, where, _), state in zip(jobs, status):
            if state == "ok":
                own = self._own[where[0]]
                own.end = max(own.end, (where[1] + 1) * self.record_bytes)
        for (i, key, where, deletion), state, checksum in zip(jobs, status, checksums):
            if deletion and state != "kept":
                self._disk_live.discard(where)  # the deletion was logged
            if state == "ok":
                self._publish(key, where, checksum)
                results[i] = True
                continue
            self.counters["write_errors"] += 1
            if state != "nospace":
                self._free.append(where)
            elif (where[1] + 1) * self.record_bytes <= self._own[where[0]].end:
                self._free.append(where)  # overwriting bytes the file has needs no new room
            if state == "kept":
                self._disk_live.add(where)
        if full:
            self._after_out_of_space()
        return results

    def _after_out_of_space(self) -> None:
        """The disk is full: claim nothing more until a refresh finds room for a slab again; new
        blocks evict our least recently used ones from the room our slabs already have."""
        self.counters["out_of_space"] += 1
        self._disk_full = True
        self._can_claim = False
        for state in self._own.values():
            state.records = max(1, min(state.records, state.end // self.record_bytes))
        self._free = [w for w in self._free if w[1] < self._own[w[0]].records]

    def _checksums(self, offsets: list[int]) -> list[int]:
        """CPU thread: the payload checksums of the primary slots at `offsets`."""
        view = self.primary_kv_view
        return [payload_checksum(view[offset : offset + self.block_nbytes]) for offset in offsets]

    def _write_data(
        self, jobs: list[tuple[bytes, Record, int, bool]], summing: Future[list[int]]
    ) -> tuple[list[str], dict[int, int], list[int]]:
        """I/O thread: log deletions of reused records, write the records' payloads, then, their
        checksums in from `summing`, log the records written.

        Returns per job "ok", or "error" / "nospace" / "kept" (not written, its old entry
        stands); the data file sizes of slabs where the disk was full; the checksums.
        """
        status = ["error"] * len(jobs)
        by_slab: dict[int, list[int]] = {}
        for n, (_, (slab, _), _, _) in enumerate(jobs):
            by_slab.setdefault(slab, []).append(n)
        todo: list[int] = []
        for slab, ns in by_slab.items():
            reused = [n for n in ns if jobs[n][3]]
            if reused:  # a deletion is of a record: the key it carries is only informative
                entries = b"".join(
                    encode_entry(self._next_seq(), jobs[n][1][1], jobs[n][0], 0, deleted=True) for n in reused
                )
                try:
                    self._log(slab, entries, len(reused))
                except OSError as exc:
                    for n in ns:
                        status[n] = "kept" if jobs[n][3] else ("nospace" if is_out_of_space(exc) else "error")
                    continue
            todo += ns
        full: dict[int, int] = {}
        written: list[int] = []
        for run in self._runs([jobs[n][1] for n in todo]):
            ns = [todo[k] for k in run]
            slab, first = jobs[ns[0]][1]
            state = self._own[slab]
            try:
                iov = self._iov([jobs[n][2] for n in ns])
                self._write_all(state.data_fd, iov, first * self.record_bytes)
                done = ns
            except OSError as exc:
                done = self._write_one_by_one(state, ns, jobs, status, exc)
                if any(status[n] == "nospace" for n in ns):
                    full[slab] = os.fstat(state.data_fd).st_size
            if done and self.fsync:
                os.fdatasync(state.data_fd)
            written += done
        checksums = summing.result()
        if written:
            self._log_written(jobs, written, checksums, status)
        return status, full, checksums

    def _log_written(
        self,
        jobs: list[tuple[bytes, Record, int, bool]],
        written: list[int],
        checksums: list[int],
        status: list[str],
    ) -> None:
        """I/O thread: log the records written, marking them "ok" in `status`.

        The entries go after the data: a record is visible only once complete.
        """
        by_slab: dict[int, list[int]] = {}
        for n in written:
            by_slab.setdefault(jobs[n][1][0], []).append(n)
        for slab, ns in by_slab.items():
            entries = b"".join(
                encode_entry(self._next_seq(), jobs[n][1][1], jobs[n][0], checksums[n]) for n in ns
            )
            try:
                self._log(slab, entries, len(ns))
                for n in ns:
                    status[n] = "ok"
            except OSError as exc:
                for n in ns:
                    status[n] = "nospace" if is_out_of_space(exc) else "error"

    def _write_one_by_one(
        self,
        state: _OwnSlab,
        ns: list[int],
        jobs: list[tuple[bytes, Record, int, bool]],
        status: list[str],
        first_error: OSError,
    ) -> list[int]:
        """A run failed: write its records one at a time, to keep those that fit on a full disk."""
        done = []
        for k, n in enumerate(ns):
            _, (_, record), offset, _ = jobs[n]
            try:
                self._write_all(state.data_fd, self._iov([offset]), record * self.record_bytes)
                done.append(n)
            except OSError as exc:
                code = "nospace" if is_out_of_space(exc) else "error"
                if code == "nospace":
                    for later in ns[k:]:
                        status[later] = "nospace"  # records are in file order: none after fits
                    break
                status[n] = code
                self.fault_log.warning("write", "fs tier %r: writing a record failed: %s", self.name, exc)
        if not done and not is_out_of_space(first_error):
            self.fault_log.warning(
                "write", "fs tier %r: writing %d records failed: %s", self.name, len(ns), first_error
            )
        return done

    def _log(self, slab: int, entries: bytes, count: int) -> None:
        """Append entries to one of our slabs' logs, compacting it when it grows long."""
        state = self._own[slab]
        with state.lock:
            try:
                self._append_log(state.log_fd, entries)
            except OSError as exc:
                if not is_out_of_space(exc):
                    raise
                self._compact_log(slab, state)  # the disk is full: make room, try once more
                self._append_log(state.log_fd, entries)
            if self.fsync:
                os.fsync(state.log_fd)
            state.log_entries += count
            if state.log_entries > 4 * state.records:
                try:
                    self._compact_log(slab, state)
                except OSError as exc:  # the entries are in: a long log only costs replay time
                    self.fault_log.warning(
                        "compact", "fs tier %r: compacting a log failed: %s", self.name, exc
                    )

    def _compact_log(self, slab: int, state: _OwnSlab) -> None:
        """Shrink a slab's log to its live entries (its lock held)."""
        path = slab_path(self.directory, self.block_nbytes, slab, "idx")
        try:
            ours = os.stat(path).st_ino == os.fstat(state.log_fd).st_ino
        except FileNotFoundError:
            ours = False
        if not ours:
            # Our log was removed under us, and the path may name another process's new slab
            # now: never touch it. Our unlinked log, long as it gets, serves us until we exit.
            return
        entries, fd = rewrite_log(path, fsync=self.fsync)
        os.close(state.log_fd)
        state.log_fd, state.log_entries = fd, entries
        reserve_log_room(state.log_fd, os.fstat(state.log_fd).st_size + 4 * state.records * ENTRY)

    @staticmethod
    def _append_log(log_fd: int, data: bytes) -> None:
        """Append whole entries or nothing: a torn tail would hide every later entry."""
        start = os.fstat(log_fd).st_size
        try:
            if os.write(log_fd, data) != len(data):
                raise OSError(errno.ENOSPC, "short write to the index log")
        except BaseException:
            os.ftruncate(log_fd, start)
            raise

    def _iov(self, offsets: list[int]) -> list[memoryview]:
        """The primary slots at `offsets` (whole records), neighbouring slots merged into one piece."""
        pieces: list[list[int]] = []
        for offset in offsets:
            if pieces and pieces[-1][1] == offset:
                pieces[-1][1] = offset + self.record_bytes
            else:
                pieces.append([offset, offset + self.record_bytes])
        return [self.primary_kv_view[start:end] for start, end in pieces]

    @staticmethod
    def _runs(wheres: list[Record]) -> list[list[int]]:
        """Indexes into `wheres`, grouped into runs of neighbouring records of one slab."""
        order = sorted(range(len(wheres)), key=lambda n: wheres[n])
        runs: list[list[int]] = []
        for n in order:
            slab, record = wheres[n]
            if runs and len(runs[-1]) < _IOV_MAX and wheres[runs[-1][-1]] == (slab, record - 1):
                runs[-1].append(n)
            else:
                runs.append([n])
        return runs

    def _write_all(self, fd: int, iov: list[memoryview], offset: int) -> None:
        total = sum(len(v) for v in iov)
        done = self._stager.pwritev(fd, iov, offset) if self.staging else os.pwritev(fd, iov, offset)
        if done != total:  # a full disk, part way: the caller retries record by record
            raise OSError(errno.ENOSPC, f"short write: {done} of {total} bytes")

    async def read_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        # docstring inherited
        await self._refresh_if_missing(keys)
        jobs: list[tuple[int, bytes, Record, _OwnSlab | _OtherSlab]] = []
        for i, key in enumerate(keys):
            where = self._where.get(key)
            if where is None:
                continue
            slab = self._own.get(where[0]) or self._others[where[0]]
            if isinstance(slab, _OtherSlab):
                slab.readers += 1
            self._readers[where] += 1  # never evicted or reused while read
            self._lru.pop(where, None)
            jobs.append((i, key, where, slab))
        results = [False] * len(keys)
        if not jobs:
            return results
        work = [
            (slab.data_fd, where, self._entry[where][1], self._slot_offset(blocks[i]))
            for i, _, where, slab in jobs
        ]
        try:
            got = await self.run_blocking(self._read_runs, work)
            outcome = await self.scheduler.run_cpu(self._verify_records, work, got)
        finally:
            for _, _, where, slab in jobs:
                self._unpin(where, slab)
        corrupt = []
        for (i, key, where, _), status in zip(jobs, outcome):
            if status == "ok":
                results[i] = True
                continue
            if status == "error" or self._entry.get(where, (None,))[0] != key:
                continue  # a fault, or forgotten meanwhile
            if where[0] in self._own:
                self._drop(where)
            else:
                self._unindex_other(*where)
            if status == "corrupt":
                self.counters["corrupt_blocks"] += 1
                corrupt.append((key, where))
            else:  # its writer rewrote it after we read the log: our entry was stale
                self.counters["stale_blocks"] += 1
            self.notify_removed([key])
        if corrupt:
            await self.run_blocking(self._log_deletions, corrupt)
        return results

    def _unpin(self, where: Record, slab: _OwnSlab | _OtherSlab) -> None:
        self._readers[where] -= 1
        if isinstance(slab, _OtherSlab):
            slab.readers -= 1
            if slab.gone and slab.readers == 0:
                os.close(slab.data_fd)
        if self._readers[where]:
            return
        del self._readers[where]
        if where in self._doomed:
            self._doomed.discard(where)
            self._free.append(where)
        elif where in self._entry and where[0] in self._own:
            self._lru[where] = None  # most recently used now

    def _read_runs(self, jobs: list[tuple[int, Record, int, int]]) -> list[int]:
        """Worker thread: read the records, one `preadv` per run of neighbours; per job, how many
        of its bytes arrived (-1: the read failed). Checking them is `_verify_records`' work, off
        this thread, which goes on to the next read meanwhile."""
        got = [-1] * len(jobs)
        for run in self._runs([where for _, where, _, _ in jobs]):
            fd, (_, first), _, _ = jobs[run[0]]
            try:
                iov, offset = self._iov([jobs[n][3] for n in run]), first * self.record_bytes
                done = self._stager.preadv(fd, iov, offset) if self.staging else os.preadv(fd, iov, offset)
            except OSError as exc:
                self.fault_log.warning(
                    "read", "fs tier %r: reading %d records failed: %s", self.name, len(run), exc
                )
                continue
            for k, n in enumerate(run):
                got[n] = max(0, min(self.record_bytes, done - k * self.record_bytes))
        return got

    def _verify_records(self, jobs: list[tuple[int, Record, int, int]], got: list[int]) -> list[str]:
        """Worker thread: check what arrived against the checksums in the index.

        "ok" / "corrupt" / "stale" (its writer is rewriting it) / "error" (not read) each.
        """
        status = ["error"] * len(jobs)
        for n, (_, where, checksum, offset) in enumerate(jobs):
            if got[n] < 0:
                continue
            payload = self.primary_kv_view[offset : offset + self.block_nbytes]
            if got[n] == self.record_bytes and payload_checksum(payload) == checksum:
                status[n] = "ok"
            elif where[0] in self._own:
                status[n] = "corrupt"  # we are its only writer
            else:
                status[n] = "corrupt" if self._log_still_names(where, checksum) else "stale"
        return status

    def _log_still_names(self, where: Record, checksum: int) -> bool:
        """Whether another writer's log still says `where` holds the block we failed to read: its
        writer logs a deletion before rewriting a record, so then the bytes are damaged."""
        try:
            entries, _, _ = read_log(slab_path(self.directory, self.block_nbytes, where[0], "idx"))
        except FileNotFoundError:
            return False
        latest = latest_per_record(entries).get(where[1])
        return latest is not None and not latest.deleted and latest.checksum == checksum

    def _log_deletions(self, dropped: list[tuple[bytes, Record]]) -> None:
        """Worker thread: deletions, so dropped records stay gone for every process and restart.

        Our slabs' logs take them directly, another writer's through `append_to_log`.
        """
        for key, (slab, record) in dropped:
            entry = encode_entry(self._next_seq(), record, key, 0, deleted=True)
            try:
                if slab in self._own:
                    self._log(slab, entry, 1)
                    continue
                append_to_log(slab_path(self.directory, self.block_nbytes, slab, "idx"), entry)
            except OSError as exc:
                self.fault_log.warning("delete", "fs tier %r: logging a deletion failed: %s", self.name, exc)

    def hold(self, keys: Sequence[bytes]) -> list[bool]:
        # docstring inherited. A hold pins the record as a read in flight does (never evicted or
        # reused until the last unpin); another process's record is its writer's to evict: False.
        check_keys(keys)
        if self._closed:
            return [False] * len(keys)
        held = []
        for key in keys:
            where = self._where.get(key)
            if where is None or where[0] not in self._own:
                held.append(False)
                continue
            self._readers[where] += 1
            self._lru.pop(where, None)
            self._holds.setdefault(key, []).append(where)
            held.append(True)
        return held

    def release(self, keys: Sequence[bytes]) -> None:
        # docstring inherited
        for key in keys:
            places = self._holds.get(key)
            if not places:
                continue
            where = places.pop()
            if not places:
                del self._holds[key]
            slab = self._own.get(where[0])
            if slab is not None:  # else closed meanwhile: nothing left to unpin
                self._unpin(where, slab)

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        # docstring inherited
        if not await self._ensure_open():
            return [False] * len(keys)
        await self._refresh_if_missing(keys)
        return [key in self._where for key in keys]

    async def _refresh_if_missing(self, keys: Sequence[bytes]) -> None:
        """Refresh when a key is unknown and the last refresh is older than the interval."""
        if time.monotonic() - self._last_refresh < self.refresh_interval_s:
            return
        if any(key not in self._where for key in keys):
            await self._refresh_now()

    async def delete(self, keys: Sequence[bytes]) -> int:
        # docstring inherited
        if not await self._ensure_open():
            return 0
        dropped = []
        for key in keys:
            where = self._where.get(key)
            if where is None:
                continue
            dropped.append((key, where))
            if where[0] in self._own:
                self._drop(where)
            else:
                self._unindex_other(*where)
        if dropped:
            self.notify_removed([key for key, _ in dropped])
            await self.run_blocking(self._log_deletions, dropped)
        return len(dropped)

    def backend_stats(self) -> dict[str, Any]:
        own = list(self._own.values())
        return {
            "root": str(self.root),
            "blocks": len(self._where),
            "own_blocks": len(self._lru) + sum(1 for w in self._readers if w[0] in self._own),
            "used_bytes": sum(s.end + s.log_entries * ENTRY for s in own),
            "capacity_bytes": self.capacity_bytes,
            "direct_io": self.direct_io,
            "staging": self.staging,
            "stage_buffer_bytes": self._stager.buffers * STAGE_BYTES,
            "fsync": self.fsync,
            "slabs": len(own),
            "shared_slabs": len(self._others),
            "evictions": self.counters["evictions"],
            "corrupt_blocks": self.counters["corrupt_blocks"],
            "stale_blocks": self.counters["stale_blocks"],
            "write_errors": self.counters["write_errors"],
            "stores_without_room": self.counters["stores_without_room"],
            "out_of_space": self.counters["out_of_space"],
            "disk_full": self._disk_full,
        }
