"""`SlabFiles`: a namespace's slab files as this process finds them on disk (worker threads).

Opening the namespace (O_DIRECT probed, capacity sized into slabs), claiming a slab to
write (a new one below the capacity, or one whose writer has exited, its whole file
allocated at once), reading the other processes' new log entries, and closing. Every method
runs on a worker thread (`off_loop` hands one there) and returns what it found; `SlabIndex`
takes it in on the loop.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from ...errors import ConfigError, KVTierError
from .index import Claim, LogNews, OtherSlab, OwnSlab
from .layout import (
    ENTRY,
    FORMAT_VERSION,
    SEQ_GRAIN_NS,
    At,
    DirFormat,
    Entry,
    Folder,
    allocate,
    coarse_time_ns,
    format_text,
    is_out_of_space,
    prepare_directory,
    read_log,
    refuse_second_name,
    reserve_log_room,
    skip_linked_log,
    slab_numbers,
    slab_path,
    try_flock,
)

__all__ = ["DEFAULT_CAPACITY_BYTES", "SlabFiles", "close_fd", "probe_direct_io"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Default `capacity_bytes`: 64 GiB, but never more than 80% of what the file
#: system can give us (free space plus what this namespace already holds).
DEFAULT_CAPACITY_BYTES = 64 << 30
SLAB_TARGET_BYTES = 256 << 20  # records per slab file, at most
MIN_SLABS = 16  # a namespace has at least this many slabs (if it holds that many records)


def slab_geometry(record_bytes: int, capacity_bytes: int) -> tuple[int, int]:
    """(records per slab, slabs at most) of a namespace of `capacity_bytes` (the trace sweep
    sizes its model of the tier with this too)."""
    # Room for each record and, at worst, four log entries about it before compaction.
    max_records = max(1, capacity_bytes // (record_bytes + 4 * ENTRY))
    # At least MIN_SLABS slabs where the capacity allows: each writing process needs one.
    slab_records = max(1, min(max_records // MIN_SLABS, SLAB_TARGET_BYTES // record_bytes))
    return slab_records, max(1, max_records // slab_records)


def close_fd(fd: int | None) -> None:
    """Close a descriptor the index let go of (None: it let go of none)."""
    if fd is not None:
        os.close(fd)


def probe_direct_io(folder: Folder) -> OSError | None:
    """None where this file system takes O_DIRECT writes and reads of aligned buffers; else
    the error the probe met (EINVAL: the file system refuses O_DIRECT)."""
    if not hasattr(os, "O_DIRECT"):
        return OSError(errno.EINVAL, "this platform has no O_DIRECT")
    path = folder / f"direct-io-probe.{os.getpid()}.{threading.get_native_id()}.tmp"
    buffer = memoryview(mmap.mmap(-1, mmap.PAGESIZE))
    path.unlink(missing_ok=True)  # a crashed probe's (a planted link is removed, not followed)
    try:
        fd = path.open(os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_DIRECT)
        try:
            os.pwrite(fd, buffer, 0)
            os.preadv(fd, [buffer], 0)
        finally:
            os.close(fd)
        return None
    except OSError as error:
        return error
    finally:
        path.unlink(missing_ok=True)


class SlabFiles:
    """The slab files of one namespace under `root`, for blocks of `block_nbytes`.

    `open` settles `direct_io`, `capacity_bytes`, `slab_records` and `max_slabs`; the other
    methods use them.
    """

    def __init__(
        self,
        root: Path,
        namespace: str,
        directory: Path,
        block_nbytes: int,
        record_bytes: int,
        *,
        fsync: bool,
        kind: str = "plain",
    ) -> None:
        self.root = root
        self.namespace = namespace
        #: What a new directory's FORMAT records of its records: "plain", or "sealed <name>".
        self.kind = kind
        #: What the directory's FORMAT says (settled by `open`).
        self.format = DirFormat(FORMAT_VERSION)
        self.directory = directory  # its path, for messages: files are reached through `folder`
        #: The namespace directory, held open from `open` to `close`: every file is reached
        #: through it, so a directory swapped for a symlink meanwhile is never followed.
        self.folder: Folder | None = None
        #: Folders let go of (the directory was removed and made again): other threads may still
        #: be using them, so they close with the tier.
        self._retired: list[Folder] = []
        #: The highest sequence number read in any log: this process numbers its entries past it
        #: (`RecordIO.next_seq`), so that blocks written after another process's, within the
        #: clock's grain, still sort after them.
        self.seq_seen = 0
        self._seq_lock = threading.Lock()
        self.block_nbytes = block_nbytes
        self.record_bytes = record_bytes
        self.name = "fs"  # the tier's name, in log messages
        self.direct_io = False
        self.fsync = fsync  # data, logs and the directory made durable before a store returns
        self.capacity_bytes = 0
        self.slab_records = 1
        self.max_slabs = 0
        #: The worker threads' `run_blocking`, set when the tier opens (a scheduler's: a bound
        #: method of the tier here would be a reference cycle).
        self.run_blocking: Callable[..., Awaitable[Any]] | None = None

    def off_loop(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        """Run `fn(*args)`, one of these methods, on the worker threads (from the loop)."""
        if self.run_blocking is None:
            raise RuntimeError("fs tier: file work before the tier opened")
        return self.run_blocking(fn, *args)

    @property
    def dir(self) -> Folder:
        if self.folder is None:
            raise RuntimeError("fs tier: file work before the tier opened")
        return self.folder

    def path(self, slab: int, kind: str) -> At:
        """A slab's data ("kvs") or log ("idx") file."""
        return slab_path(self.dir, self.block_nbytes, slab, kind)

    def open(self, direct_io: bool | str, capacity_bytes: int | None) -> None:
        """Make or check the directory, probe O_DIRECT ("auto": where the file system takes
        it), size the namespace: `capacity_bytes` (None: the default, capped at 80% of the room
        the file system has) in slabs of at most `SLAB_TARGET_BYTES`."""
        self.folder, self.format = prepare_directory(
            self.root, self.directory.name, self.namespace, format_text(self.kind)
        )
        if direct_io == "auto":
            self.direct_io = probe_direct_io(self.folder) is None
        elif direct_io:
            refused = probe_direct_io(self.folder)
            if refused is not None and refused.errno == errno.EINVAL:
                # The file system refuses O_DIRECT: this configuration can never work.
                raise ConfigError(
                    f"fs tier: direct_io is True but the file system under {self.directory} "
                    'refuses O_DIRECT; use direct_io "auto" or False there'
                )
            if refused is not None:  # a full disk, an I/O error: it may pass
                raise KVTierError(f"fs tier: the O_DIRECT probe under {self.directory} failed: {refused}")
            self.direct_io = True
        if capacity_bytes is None:
            existing = 0
            for n in slab_numbers(self.folder, self.block_nbytes):
                with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                    existing += self.path(n, "kvs").stat().st_size
            free = self.folder.free_bytes()
            capacity_bytes = min(DEFAULT_CAPACITY_BYTES, int(0.8 * (free + existing)))
        self.capacity_bytes = capacity_bytes
        self.slab_records, self.max_slabs = slab_geometry(self.record_bytes, capacity_bytes)

    @property
    def data_flags(self) -> int:
        return os.O_DIRECT if self.direct_io else 0

    @staticmethod
    def close(own: list[OwnSlab], others: list[OtherSlab]) -> None:
        for state in own:
            os.close(state.data_fd)  # releases the flock: another process may take the slab
            os.close(state.log_fd)
        for other in others:
            if not other.gone:
                os.close(other.data_fd)

    def close_folder(self) -> None:
        """Let go of the namespace directory (the tier is closing)."""
        for folder in [*self._retired, *([self.folder] if self.folder is not None else [])]:
            folder.close()
        self._retired.clear()
        self.folder = None

    def saw(self, entries: list[Entry]) -> None:
        """Note the sequence numbers of entries read (any worker thread). One from more than a
        few minutes ahead of the clock is no writer's (the processes share the host's clock):
        ignored, so a planted entry cannot push this process's numbers to their end."""
        ahead = coarse_time_ns() + (SEQ_GRAIN_NS << 8)
        newest = max((e.seq for e in entries if e.seq <= ahead), default=0)
        with self._seq_lock:
            self.seq_seen = max(self.seq_seen, newest)

    # -- the disk's room -------------------------------------------------------------------------
    @property
    def disk_bytes_per_record(self) -> int:
        """A record's room on a nearly full disk: the record, its log entries (reserved: four
        per record) and their share of the compacted copy of the log that replaces it."""
        return self.record_bytes + 6 * ENTRY

    def room_for_a_slab(self) -> bool:
        """Whether the file system has room for a whole slab (not a sliver: a still nearly full
        disk is then not claimed from on every refresh)."""
        try:
            free = self.dir.free_bytes()
        except OSError:
            return False
        return free >= self.slab_records * self.disk_bytes_per_record

    # -- following the other processes -----------------------------------------------------------
    @property
    def entries_per_log(self) -> int:
        """Entries of one log read at a time: a writer compacts its log once it passes four
        entries a record, so a longer one is not a writer's; what follows waits for the next
        refresh (read from where this one stopped)."""
        return 8 * self.slab_records

    @property
    def entries_per_refresh(self) -> int:
        """Entries read by one refresh, every log together (four a record of the capacity): what
        an index of this capacity may take in memory, whatever the directory holds."""
        return 4 * self.max_slabs * self.slab_records

    def read_news(
        self, known: dict[int, tuple[int, int]], own: dict[int, OwnSlab]
    ) -> tuple[list[LogNews], list[int], list[int]]:
        """The new entries of every slab another process writes or wrote (`known`: each one's log
        inode and the offset read up to); those of the `known` slabs that are gone; those of our
        slabs whose files were removed."""
        if self.dir.removed():
            # The namespace directory was removed (a root cleared by hand): make it again, so
            # that this process, and the others, go on storing and sharing blocks there.
            log.warning("fs tier %r: %s was removed; making it again", self.name, self.directory)
            # Made anew in the format this process found: its sealed records stay bound as they were.
            new_format = format_text(self.kind, self.format.version)
            folder, _ = prepare_directory(self.root, self.directory.name, self.namespace, new_format)
            self._retired.append(self.dir)
            self.folder = folder
        present = {n for n in slab_numbers(self.dir, self.block_nbytes) if n < self.max_slabs}
        gone = [slab for slab in known if slab not in present]
        removed = [slab for slab, state in own.items() if os.fstat(state.data_fd).st_nlink == 0]
        news: list[LogNews] = []
        # Each log is read once, whatever names it has (a hard link under many slab numbers is
        # planted: never made by a writer); our own logs are not another's.
        logs_seen = {os.fstat(state.log_fd).st_ino for state in own.values()}
        budget = self.entries_per_refresh
        try:
            for slab in sorted(present.difference(own)):
                log_path = self.path(slab, "idx")
                if budget <= 0:
                    break  # the rest at the next refresh
                try:
                    st = log_path.stat()
                except FileNotFoundError:
                    continue  # its writer has not made the log yet
                if skip_linked_log(log_path, logs_seen, st.st_ino):
                    continue
                inode, offset = known.get(slab, (0, 0))
                if st.st_ino == inode and st.st_size == offset:
                    continue
                reset = slab not in known or st.st_ino != inode or st.st_size < offset
                data_fd = None
                try:
                    if reset:
                        # The data file first: a slab whose data is foreign (skipped, counted)
                        # costs no read of its log, on this refresh or any later one. Opened
                        # again for a slab we knew whose log is new: `kvtier fs gc` may have
                        # removed it and a writer made the number anew, and the new log's
                        # records are in the new data file, not in the one we hold.
                        data_fd = self.path(slab, "kvs").open(os.O_RDONLY | self.data_flags)
                    entries, end, inode = read_log(
                        log_path, 0 if reset else offset, min(budget, self.entries_per_log)
                    )
                    if inode != st.st_ino:
                        # Made anew again while we read: the data file opened may not be
                        # this log's. The next refresh reads both again.
                        raise FileNotFoundError(log_path)
                except BaseException as exc:
                    if data_fd is not None:
                        os.close(data_fd)
                    if isinstance(exc, FileNotFoundError):
                        continue  # removed meanwhile (`kvtier fs gc`), or not ours
                    raise
                budget -= len(entries)
                self.saw(entries)
                # Records past what a slab of this capacity holds are not read: misses, and no
                # index entries for a planted log to multiply.
                entries = [e for e in entries if e.record < self.slab_records]
                data_inode = os.fstat(data_fd).st_ino if data_fd is not None else 0
                news.append(LogNews(slab, reset, entries, inode, end, data_fd, data_inode))
        except BaseException:
            for item in news:
                if item.data_fd is not None:
                    os.close(item.data_fd)
            raise
        return news, gone, removed

    # -- claiming a slab -------------------------------------------------------------------------
    def claim(self, own: set[int], create: bool, adoptable: list[int]) -> Claim | None:
        """Become the writer of a new slab below the namespace's capacity, else of the first of
        `adoptable` whose writer has exited; None if neither is possible."""
        present = set(slab_numbers(self.dir, self.block_nbytes))
        for slab in range(self.max_slabs) if create else ():
            if slab in own or slab in present:
                continue
            try:
                fd = self.path(slab, "kvs").open(os.O_CREAT | os.O_EXCL | os.O_RDWR | self.data_flags)
            except FileExistsError:
                continue
            if try_flock(fd):
                if self.fsync:
                    self.fsync_directory()
                try:
                    return self._adopt(slab, fd)  # which closes fd if it raises
                except FileNotFoundError:
                    continue  # a log of that number planted before it (skipped, counted)
            os.close(fd)  # another process took it as it was made
        for slab in adoptable:
            if slab in own or slab >= self.max_slabs:
                continue
            try:
                fd = self.path(slab, "kvs").open(os.O_RDWR | self.data_flags)
            except FileNotFoundError:
                continue
            if try_flock(fd) and os.fstat(fd).st_nlink:  # not removed while we opened it
                try:
                    return self._adopt(slab, fd)  # which closes fd if it raises
                except FileNotFoundError:
                    continue  # its log is gone, or not a file of ours (skipped, counted)
            os.close(fd)
        return None

    def _adopt(self, slab: int, data_fd: int) -> Claim:
        """The slab's flock held: open its log, drop a torn tail, size it to ours."""
        try:
            log_path = self.path(slab, "idx")
            log_path.with_name(log_path.name + ".tmp").unlink(missing_ok=True)  # a compaction cut short
            log_fd = log_path.open(os.O_CREAT | os.O_RDWR | os.O_APPEND)
            try:
                refuse_second_name(log_fd, log_path)  # its writer would write another slab's log
                entries, end, _ = read_log(log_path, 0, self.entries_per_log + 1)
                if len(entries) > self.entries_per_log:
                    # Longer than a writer of this capacity makes (planted, or written under a
                    # larger capacity): its blocks are forgotten, never read whole into memory.
                    log.warning(
                        "fs tier %r: the log of slab %d is too long; starting it afresh", self.name, slab
                    )
                    entries, end = [], 0
                self.saw(entries)
                if os.fstat(log_fd).st_size != end:
                    os.ftruncate(log_fd, end)  # a torn last entry would hide every later one
                size = os.fstat(data_fd).st_size
                if size > self.slab_records * self.record_bytes:  # made with a larger capacity
                    size = self.slab_records * self.record_bytes
                    os.ftruncate(data_fd, size)
                size, disk_full = self._allocate(data_fd, size)
                records = size // self.record_bytes
                reserve_log_room(log_fd, end + 4 * records * ENTRY)
            except BaseException:
                os.close(log_fd)
                raise
        except BaseException:
            os.close(data_fd)
            raise
        state = OwnSlab(records, data_fd, log_fd, len(entries), size)
        return Claim(slab, state, entries, disk_full)

    def _allocate(self, data_fd: int, size: int) -> tuple[int, bool]:
        """Allocate a slab's whole file now, before this process writes to it: (its size, whether
        the disk was full).

        Writes into allocated space run side by side under ext4's shared inode lock, where
        writes into holes or past the end take it exclusively, one at a time; and allocating
        later, in steps, waits each time for every direct I/O in flight on the file. A nearly
        full disk gets the records that fit. Where the file system cannot allocate ahead, the
        file grows as records are written.
        """
        rb = self.record_bytes
        want = self.slab_records * rb
        target = want
        while target > size:
            try:
                if not allocate(data_fd, size, target - size):
                    return want, False
                return target, target < want
            except OSError as exc:
                if not is_out_of_space(exc):
                    raise
            room = size + self.dir.free_bytes() // self.disk_bytes_per_record * rb
            target = room if room < target else size + (target - size) // 2 // rb * rb
        return os.fstat(data_fd).st_size // self.record_bytes * self.record_bytes, size < want

    def fsync_directory(self) -> None:
        self.dir.fsync()
