"""`SlabFiles`: a namespace's slab files as this process finds them on disk (worker threads).

Opening the namespace (O_DIRECT probed, capacity sized into slabs), claiming a slab to
write (a new one below the capacity, or one whose writer has exited, its whole file
allocated at once), reading the other processes' new log entries, and closing. Every method
runs on a worker thread (`off_loop` hands one there) and returns what it found; `SlabIndex`
takes it in on the loop.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from ...errors import KVTierError
from .index import Claim, LogNews, OtherSlab, OwnSlab
from .layout import (
    ENTRY,
    FILE_MODE,
    NO_FOLLOW,
    allocate,
    is_out_of_space,
    prepare_directory,
    read_log,
    reserve_log_room,
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


def probe_direct_io(directory: Path) -> bool:
    """Whether this file system takes O_DIRECT writes and reads of aligned buffers."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = directory / f"direct-io-probe.{os.getpid()}.{threading.get_native_id()}.tmp"
    buffer = memoryview(mmap.mmap(-1, mmap.PAGESIZE))
    path.unlink(missing_ok=True)  # a crashed probe's (a planted link is removed, not followed)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_DIRECT | NO_FOLLOW, FILE_MODE)
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
    ) -> None:
        self.root = root
        self.namespace = namespace
        self.directory = directory
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

    def path(self, slab: int, kind: str) -> Path:
        """A slab's data ("kvs") or log ("idx") file."""
        return slab_path(self.directory, self.block_nbytes, slab, kind)

    def open(self, direct_io: bool | str, capacity_bytes: int | None) -> None:
        """Make or check the directory, probe O_DIRECT ("auto": where the file system takes
        it), size the namespace: `capacity_bytes` (None: the default, capped at 80% of the room
        the file system has) in slabs of at most `SLAB_TARGET_BYTES`."""
        prepare_directory(self.root, self.directory, self.namespace)
        if direct_io == "auto":
            self.direct_io = probe_direct_io(self.directory)
        elif direct_io:
            if not probe_direct_io(self.directory):
                raise KVTierError(f"fs tier: O_DIRECT is not supported under {self.directory}")
            self.direct_io = True
        if capacity_bytes is None:
            existing = 0
            for n in slab_numbers(self.directory, self.block_nbytes):
                with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                    existing += os.stat(self.path(n, "kvs")).st_size
            usage = shutil.disk_usage(self.directory)
            capacity_bytes = min(DEFAULT_CAPACITY_BYTES, int(0.8 * (usage.free + existing)))
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
            free = shutil.disk_usage(self.directory).free
        except OSError:
            return False
        return free >= self.slab_records * self.disk_bytes_per_record

    # -- following the other processes -----------------------------------------------------------
    def read_news(
        self, known: dict[int, tuple[int, int]], own: dict[int, OwnSlab]
    ) -> tuple[list[LogNews], list[int], list[int]]:
        """The new entries of every slab another process writes or wrote (`known`: each one's log
        inode and the offset read up to); those of the `known` slabs that are gone; those of our
        slabs whose files were removed."""
        try:
            present = set(slab_numbers(self.directory, self.block_nbytes))
        except FileNotFoundError:
            # The namespace directory was removed (a root cleared by hand): make it again, so
            # that this process, and the others, go on storing and sharing blocks there.
            log.warning("fs tier %r: %s was removed; making it again", self.name, self.directory)
            prepare_directory(self.root, self.directory, self.namespace)
            present = set()
        gone = [slab for slab in known if slab not in present]
        removed = [slab for slab, state in own.items() if os.fstat(state.data_fd).st_nlink == 0]
        news: list[LogNews] = []
        try:
            for slab in sorted(present.difference(own)):
                log_path = self.path(slab, "idx")
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
                        data_fd = os.open(self.path(slab, "kvs"), os.O_RDONLY | self.data_flags | NO_FOLLOW)
                except FileNotFoundError:
                    continue  # removed meanwhile (`kvtier fs gc`)
                news.append(LogNews(slab, reset, entries, inode, end, data_fd))
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
        present = set(slab_numbers(self.directory, self.block_nbytes))
        for slab in range(self.max_slabs) if create else ():
            if slab in own or slab in present:
                continue
            try:
                fd = os.open(
                    self.path(slab, "kvs"),
                    os.O_CREAT | os.O_EXCL | os.O_RDWR | self.data_flags | NO_FOLLOW,
                    FILE_MODE,
                )
            except FileExistsError:
                continue
            if try_flock(fd):
                if self.fsync:
                    self.fsync_directory()
                return self._adopt(slab, fd)
            os.close(fd)  # another process took it as it was made
        for slab in adoptable:
            if slab in own or slab >= self.max_slabs:
                continue
            try:
                fd = os.open(self.path(slab, "kvs"), os.O_RDWR | self.data_flags | NO_FOLLOW)
            except FileNotFoundError:
                continue
            if try_flock(fd) and os.fstat(fd).st_nlink:  # not removed while we opened it
                return self._adopt(slab, fd)
            os.close(fd)
        return None

    def _adopt(self, slab: int, data_fd: int) -> Claim:
        """The slab's flock held: open its log, drop a torn tail, size it to ours."""
        try:
            log_path = self.path(slab, "idx")
            log_path.with_name(log_path.name + ".tmp").unlink(missing_ok=True)  # a compaction cut short
            log_fd = os.open(log_path, os.O_CREAT | os.O_RDWR | os.O_APPEND | NO_FOLLOW, FILE_MODE)
            try:
                entries, end, _ = read_log(log_path)
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
            room = size + shutil.disk_usage(self.directory).free // self.disk_bytes_per_record * rb
            target = room if room < target else size + (target - size) // 2 // rb * rb
        return os.fstat(data_fd).st_size // self.record_bytes * self.record_bytes, size < want

    def fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
