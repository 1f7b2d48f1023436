"""`FileSystemTier` (`"fs"`): local NVMe, crash-safe, self-verifying, persistent across restarts.

Blocks live as fixed-size records in preallocated slab files (see `fs_layout`
for the format). Writes and reads go straight between the aligned primary
slots and the files with O_DIRECT where the file system allows it, one
`pwritev`/`preadv` per run of neighbouring records, on the scheduler's worker
threads. The index is in memory, owned by the event-loop thread, and rebuilt
from the slabs' logs on open.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import shutil
import socket
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..block_format import (
    HEADER_BYTES,
    CorruptBlockError,
    namespace_id,
    pack_header,
    payload_checksum,
    verify_header,
)
from ..errors import ConfigError, KVTierError, NamespaceInUseError
from ..spec import OffloadingSpec
from ..tier import SecondaryTierManager
from .fs_layout import (
    DIR_MODE,
    ENTRY,
    FILE_MODE,
    NamespaceDir,
    compact_log,
    encode_entry,
    is_out_of_space,
    make_private_dir,
    namespace_dir_name,
    record_bytes_for,
    replay,
    slab_path,
)

__all__ = ["DEFAULT_CAPACITY_BYTES", "FileSystemTier"]

log = logging.getLogger(__name__)

#: Default `capacity_bytes`: 64 GiB, but never more than 80% of what the file
#: system can give us (free space plus what this namespace already holds).
DEFAULT_CAPACITY_BYTES = 64 << 30
SLAB_TARGET_BYTES = 256 << 20  # records per slab file, at most
GROW_STEP_BYTES = 16 << 20  # a slab's file is preallocated this much at a time
_IOV_MAX = 1024
Record = tuple[int, int]  # (slab, record index)


@dataclass(slots=True)
class _Slab:
    records: int  # how many records it may hold
    allocated: int  # bytes of its data file reserved so far
    data_fd: int
    log_fd: int
    log_entries: int
    lock: threading.Lock


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _aligned_buffer(nbytes: int) -> memoryview:
    return memoryview(mmap.mmap(-1, max(nbytes, mmap.PAGESIZE)))


_scratch = threading.local()


def _header_scratch(count: int) -> memoryview:
    """This worker thread's aligned buffer for `count` record headers, kept between calls.

    A fresh mapping per batch cost an mmap and a munmap, each waiting for the
    process-wide mmap lock behind other threads' O_DIRECT page pinning.
    """
    nbytes = HEADER_BYTES * count
    buffer: memoryview | None = getattr(_scratch, "headers", None)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = _aligned_buffer(nbytes)
        _scratch.headers = buffer
    return buffer[:nbytes]


def _command_line() -> str:
    try:
        raw = Path("/proc/self/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:200]


def _probe_direct_io(directory: Path) -> bool:
    """Whether this file system takes O_DIRECT writes and reads of aligned buffers."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = directory / "direct-io-probe.tmp"
    buffer = _aligned_buffer(4096)
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
    evicted first.

    Args:
        root: directory for the cache (created 0700 if missing). Several
            namespaces may share a root; one process at a time uses each.
        capacity_bytes: bytes on disk this namespace may take, logs included.
            Default `DEFAULT_CAPACITY_BYTES`, capped at 80% of the space available.
        direct_io: "auto" probes O_DIRECT once and falls back to buffered I/O
            where the file system refuses it; True requires it; False never uses it.
        fsync: False (it is a cache); True makes `store` return only once the
            data and the index entry are durable.
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
        self.root = Path(root)
        self.directory = self.root / namespace_dir_name(offloading_spec.namespace)
        self.requested_capacity = capacity_bytes
        self.capacity_bytes = 0  # resolved on open
        self.direct_io_requested = direct_io
        self.direct_io = False
        self.fsync = fsync
        self._namespace = namespace_id(offloading_spec.namespace)
        self._stride = self.record_bytes - HEADER_BYTES
        self._primary_base = _address(self.primary_kv_view)
        # The index; touched on the event-loop thread only.
        self._where: dict[bytes, Record] = {}
        self._key_at: dict[Record, bytes] = {}
        self._lru: OrderedDict[Record, None] = OrderedDict()  # published, unread; oldest first
        self._readers: Counter[Record] = Counter()
        self._doomed: set[Record] = set()  # dropped while being read: freed at the last unpin
        self._free: list[Record] = []  # records that hold nothing; popped from the end
        self._slabs: dict[int, _Slab] = {}
        self._slab_records = 1
        self._max_slabs = 0
        self._seq = 0
        self._reserved_slabs: set[int] = set()  # allocated from, data file not made yet
        self._lock_fd: int | None = None
        self._slab_create_lock = threading.Lock()  # also guards _seq, bumped by worker threads

    # -- opening and closing -------------------------------------------------------------------
    async def open_backend(self) -> None:
        found, free = await self.run_blocking(self._open_files)
        # Plain dict and list building only: the per-record work happened on the thread.
        self._key_at = {where: key for where, (key, _, _) in found.live.items()}
        self._where = {key: where for where, key in self._key_at.items()}
        self._lru = OrderedDict.fromkeys(self._key_at)
        self._free = free
        self._seq = found.max_seq
        self.counters["removed_temporaries"] += found.removed_temporaries

    def _open_files(self) -> tuple[NamespaceDir, list[Record]]:
        """Worker thread: lock, probe, replay the logs, open the slabs; (index, free records)."""
        found = self._open_and_replay()
        free = [
            (slab, record)
            for slab in sorted(self._slabs, reverse=True)
            for record in range(self._slabs[slab].records - 1, -1, -1)
            if (slab, record) not in found.live
        ]
        return found, free

    def _open_and_replay(self) -> NamespaceDir:
        make_private_dir(self.root)
        make_private_dir(self.directory)
        os.chmod(self.directory, DIR_MODE)
        name_file = self.directory / "NAMESPACE"
        if not name_file.exists():
            tmp = self.directory / "NAMESPACE.tmp"
            fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, FILE_MODE)
            with os.fdopen(fd, "w") as f:
                f.write(self.offloading_spec.namespace + "\n")
            os.replace(tmp, name_file)
        self._lock_fd = self._lock_namespace()
        if self.direct_io_requested == "auto":
            self.direct_io = _probe_direct_io(self.directory)
        elif self.direct_io_requested:
            if not _probe_direct_io(self.directory):
                raise KVTierError(f"fs tier: O_DIRECT is not supported under {self.directory}")
            self.direct_io = True
        if self._primary_base % 4096:
            self.direct_io = False  # O_DIRECT needs aligned memory; a foreign view may not be
        found = replay(self.directory, self.record_bytes)
        existing = sum(n * self.record_bytes for n in found.slabs.values())
        if self.requested_capacity is None:
            usage = shutil.disk_usage(self.directory)
            self.capacity_bytes = min(DEFAULT_CAPACITY_BYTES, int(0.8 * (usage.free + existing)))
        else:
            self.capacity_bytes = self.requested_capacity
        # Room for each record and, at worst, four log entries about it before compaction.
        max_records = max(1, self.capacity_bytes // (self.record_bytes + 4 * ENTRY))
        self._slab_records = max(1, min(max_records, SLAB_TARGET_BYTES // self.record_bytes))
        self._max_slabs = max(1, max_records // self._slab_records)
        for slab, records in sorted(found.slabs.items()):
            if slab >= self._max_slabs or records > self._slab_records:
                # The capacity shrank since this slab was made: drop it and what it held.
                for where in [w for w in found.live if w[0] == slab]:
                    del found.live[where]
                slab_path(self.directory, self.record_bytes, slab, "kvs").unlink(missing_ok=True)
                slab_path(self.directory, self.record_bytes, slab, "idx").unlink(missing_ok=True)
                continue
            self._slabs[slab] = self._open_slab(slab, self._slab_records, found.log_entries.get(slab, 0))
        for slab, state in self._slabs.items():
            if state.log_entries > 2 * state.records:
                self._compact_log(slab)
        return found

    def _lock_namespace(self) -> int:
        """Take this namespace for this process (worker thread); the lock file names the holder.

        One process at a time uses a namespace: a second one gets an error naming the root and
        the process that holds it, never a tier that silently misses.
        """
        lock_fd = os.open(self.directory / "LOCK", os.O_CREAT | os.O_RDWR, FILE_MODE)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(lock_fd, 4096, 0).decode(errors="replace").strip() or "an unknown process"
            os.close(lock_fd)
            raise NamespaceInUseError(
                f"fs tier: root {str(self.root)!r} (namespace {self.offloading_spec.namespace!r}, "
                f"{self.directory.name}) is in use by {holder}; one process at a time uses a root's "
                "namespace: give each process its own root"
            ) from None
        os.ftruncate(lock_fd, 0)
        os.pwrite(
            lock_fd, f"process {os.getpid()} on {socket.gethostname()} ({_command_line()})\n".encode(), 0
        )
        return lock_fd

    def _data_flags(self) -> int:
        return os.O_RDWR | (os.O_DIRECT if self.direct_io else 0)

    def _open_slab(self, slab: int, records: int, log_entries: int) -> _Slab:
        data_path = slab_path(self.directory, self.record_bytes, slab, "kvs")
        data_fd = os.open(data_path, self._data_flags())
        allocated = os.fstat(data_fd).st_size
        log_fd = os.open(
            slab_path(self.directory, self.record_bytes, slab, "idx"),
            os.O_CREAT | os.O_WRONLY | os.O_APPEND,
            FILE_MODE,
        )
        return _Slab(records, allocated, data_fd, log_fd, log_entries, threading.Lock())

    def _create_slab(self, slab: int) -> _Slab:
        """Make an empty slab data file (worker thread); `_grow` gives it room as records fill."""
        path = slab_path(self.directory, self.record_bytes, slab, "kvs")
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, FILE_MODE))
        if self.fsync:
            self._fsync_directory()
        return self._open_slab(slab, self._slab_records, 0)

    def _grow(self, state: _Slab, end: int) -> None:
        """Preallocate a slab's file up to at least `end` bytes, in steps (worker thread).

        Space is reserved ahead of the writes that need it, so a full disk shows
        up here as ENOSPC, before any record is half written.
        """
        with state.lock:
            if end <= state.allocated:
                return
            limit = state.records * self.record_bytes
            step = max(self.record_bytes, GROW_STEP_BYTES // self.record_bytes * self.record_bytes)
            for target in (min(limit, max(end, state.allocated + step)), end):
                try:
                    os.posix_fallocate(state.data_fd, state.allocated, target - state.allocated)
                except OSError as exc:
                    if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                        os.ftruncate(state.data_fd, target)  # no fallocate here: a sparse file
                    elif is_out_of_space(exc) and target > end:
                        continue  # not room for a whole step: try just what is needed
                    else:
                        raise
                state.allocated = target
                return

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _compact_log(self, slab: int) -> None:
        """Shrink a slab's log to its live entries (its lock held, or while opening)."""
        state = self._slabs[slab]
        path = slab_path(self.directory, self.record_bytes, slab, "idx")
        state.log_entries = compact_log(path, fsync=self.fsync)
        os.close(state.log_fd)
        state.log_fd = os.open(path, os.O_WRONLY | os.O_APPEND)

    async def close_backend(self) -> None:
        await self.run_blocking(self._close_files)

    def _close_files(self) -> None:
        for state in self._slabs.values():
            os.close(state.data_fd)
            os.close(state.log_fd)
        self._slabs.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # -- the index (event-loop thread) ------------------------------------------------------------
    def _allocate(self) -> Record | None:
        if self._free:
            return self._free.pop()
        if len(self._slabs) + self._pending_slabs() < self._max_slabs:
            slab = self._next_slab_number()
            self._reserved_slabs.add(slab)
            self._free.extend((slab, r) for r in range(self._slab_records - 1, -1, -1))
            return self._free.pop()
        if self._lru:
            where, _ = self._lru.popitem(last=False)
            key = self._key_at.pop(where)
            del self._where[key]
            self.counters["evictions"] += 1
            self.notify_removed([key])
            return where
        return None

    def _pending_slabs(self) -> int:
        return len(self._reserved_slabs - set(self._slabs))

    def _next_slab_number(self) -> int:
        taken = set(self._slabs) | self._reserved_slabs
        return next(n for n in range(self._max_slabs) if n not in taken)

    def _publish(self, key: bytes, where: Record) -> None:
        old = self._where.get(key)
        if old is not None:  # stored twice concurrently: keep the newer record
            self._drop(old)
        self._where[key] = where
        self._key_at[where] = key
        self._lru[where] = None

    def _drop(self, where: Record) -> None:
        """Forget a published record; free it now, or when its last reader is done."""
        key = self._key_at.pop(where, None)
        if key is not None and self._where.get(key) == where:
            del self._where[key]
        self._lru.pop(where, None)
        if self._readers[where]:
            self._doomed.add(where)
        else:
            self._free.append(where)

    def _span(self, block: memoryview) -> memoryview:
        """The whole slot (stride bytes) that `block` starts: O_DIRECT moves whole pages."""
        offset = _address(block) - self._primary_base
        return self.primary_kv_view[offset : offset + self._stride]

    # -- hooks ---------------------------------------------------------------------------------
    async def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        # docstring inherited
        results = [False] * len(keys)
        jobs: list[tuple[int, bytes, Record]] = []
        for i, key in enumerate(keys):
            where = self._where.get(key)
            if where is not None:
                results[i] = True
                if where in self._lru:
                    self._lru.move_to_end(where)
                continue
            target = self._allocate()
            if target is None:
                self.counters["stores_without_room"] += 1
                continue
            jobs.append((i, key, target))
        if not jobs:
            return results
        spans = [self._span(blocks[i]) for i, _, _ in jobs]
        payloads = [blocks[i] for i, _, _ in jobs]
        try:
            outcome = await self.run_blocking(
                self._write_records, [(key, where) for _, key, where in jobs], payloads, spans
            )
        except BaseException:
            # Cancelled (the thread has finished): these records are not published. Reusing
            # them is safe: a newer log entry for a record always wins over an older one.
            self._free.extend(where for _, _, where in jobs)
            raise
        out_of_space = False
        for (i, key, where), status in zip(jobs, outcome):
            if status == "ok":
                self._publish(key, where)
                results[i] = True
            else:
                self._free.append(where)
                out_of_space |= status == "nospace"
                self.counters["write_errors"] += 1
        self._reserved_slabs -= set(self._slabs)
        if out_of_space:
            self._shrink_after_enospc()
        return results

    def _shrink_after_enospc(self) -> None:
        """The disk is full: stop growing. From now on new blocks evict the least recently
        used ones from the room already reserved, as at capacity."""
        self.counters["out_of_space"] += 1
        self._max_slabs = max(1, len(self._slabs))
        for state in list(self._slabs.values()):
            state.records = max(1, state.allocated // self.record_bytes)
        self._free = [w for w in self._free if w[0] in self._slabs and w[1] < self._slabs[w[0]].records]
        self._reserved_slabs = set()

    def _write_records(
        self, jobs: list[tuple[bytes, Record]], payloads: list[memoryview], spans: list[memoryview]
    ) -> list[str]:
        """Worker thread: write records, then log them. Returns "ok" / "nospace" / "error" each."""
        status = ["error"] * len(jobs)
        headers = _header_scratch(len(jobs))
        checksums = []
        for n, ((key, _), payload) in enumerate(zip(jobs, payloads)):
            checksum = payload_checksum(payload)
            checksums.append(checksum)
            pack_header(
                headers[n * HEADER_BYTES : (n + 1) * HEADER_BYTES],
                namespace=self._namespace,
                key=key,
                payload_len=self.block_nbytes,
                checksum=checksum,
            )
        written: list[int] = []
        for run in self._runs([where for _, where in jobs]):
            slab = run[0][1][0]
            try:
                state = self._ensure_slab(slab)
                self._grow(state, (run[-1][1][1] + 1) * self.record_bytes)
                iov: list[memoryview] = []
                for n, _ in run:
                    iov += [headers[n * HEADER_BYTES : (n + 1) * HEADER_BYTES], spans[n]]
                self._pwritev_all(state.data_fd, iov, run[0][1][1] * self.record_bytes)
                if self.fsync:
                    os.fdatasync(state.data_fd)
                written += [n for n, _ in run]
                for n, _ in run:
                    status[n] = "ok"
            except OSError as exc:
                code = "nospace" if is_out_of_space(exc) else "error"
                for n, _ in run:
                    status[n] = code
                if code == "error":
                    log.warning("fs tier %r: writing %d records failed: %s", self.name, len(run), exc)
        # The index entries go after the data: a record is visible only once complete.
        by_slab: dict[int, list[int]] = {}
        for n in written:
            by_slab.setdefault(jobs[n][1][0], []).append(n)
        for slab, ns in by_slab.items():
            state = self._slabs[slab]
            with state.lock:
                data = b"".join(
                    encode_entry(self._next_seq(), jobs[n][1][1], jobs[n][0], checksums[n]) for n in ns
                )
                try:
                    try:
                        self._append_log(state, data)
                    except OSError as exc:
                        if not is_out_of_space(exc):
                            raise
                        self._compact_log(slab)  # the disk is full: make room, try once more
                        self._append_log(state, data)
                    if self.fsync:
                        os.fsync(state.log_fd)
                    state.log_entries += len(ns)
                    if state.log_entries > 4 * state.records:
                        self._compact_log(slab)
                except OSError as exc:
                    code = "nospace" if is_out_of_space(exc) else "error"
                    for n in ns:
                        status[n] = code
        return status

    @staticmethod
    def _append_log(state: _Slab, data: bytes) -> None:
        """Append whole entries or nothing: a torn tail would hide every later entry."""
        start = os.fstat(state.log_fd).st_size
        try:
            if os.write(state.log_fd, data) != len(data):
                raise OSError(errno.ENOSPC, "short write to the index log")
        except BaseException:
            os.ftruncate(state.log_fd, start)
            raise

    def _next_seq(self) -> int:
        with self._slab_create_lock:
            self._seq += 1
            return self._seq

    def _ensure_slab(self, slab: int) -> _Slab:
        with self._slab_create_lock:
            state = self._slabs.get(slab)
            if state is None:
                state = self._slabs[slab] = self._create_slab(slab)
            return state

    @staticmethod
    def _runs(wheres: list[Record]) -> list[list[tuple[int, Record]]]:
        """Group job indexes into runs of neighbouring records of one slab (one syscall each)."""
        order = sorted(range(len(wheres)), key=lambda n: wheres[n])
        runs: list[list[tuple[int, Record]]] = []
        for n in order:
            where = wheres[n]
            if (
                runs
                and runs[-1][-1][1][0] == where[0]
                and runs[-1][-1][1][1] + 1 == where[1]
                and len(runs[-1]) < _IOV_MAX // 2
            ):
                runs[-1].append((n, where))
            else:
                runs.append([(n, where)])
        return runs

    @staticmethod
    def _pwritev_all(fd: int, iov: list[memoryview], offset: int) -> None:
        total = sum(len(v) for v in iov)
        done = os.pwritev(fd, iov, offset)
        if done != total:  # the space was reserved, so this is not a full disk: fail the run
            raise OSError(errno.EIO, f"short write: {done} of {total} bytes")

    async def read_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        # docstring inherited
        jobs: list[tuple[int, bytes, Record]] = []
        for i, key in enumerate(keys):
            where = self._where.get(key)
            if where is not None:
                self._readers[where] += 1  # never evicted or reused while read
                self._lru.pop(where, None)
                jobs.append((i, key, where))
        results = [False] * len(keys)
        if not jobs:
            return results
        spans = [self._span(blocks[i]) for i, _, _ in jobs]
        try:
            outcome = await self.run_blocking(
                self._read_records, [(key, where) for _, key, where in jobs], spans
            )
        finally:
            for _, _, where in jobs:
                self._readers[where] -= 1
                if self._readers[where] == 0:
                    del self._readers[where]
                    if where in self._doomed:
                        self._doomed.discard(where)
                        self._free.append(where)
                    elif where in self._key_at:
                        self._lru[where] = None  # most recently used now
        corrupt = []
        for (i, key, where), status in zip(jobs, outcome):
            if status == "ok":
                results[i] = True
            elif status == "corrupt":
                self.counters["corrupt_blocks"] += 1
                if self._key_at.get(where) == key:
                    corrupt.append((key, where))
                    self._drop(where)
        if corrupt:
            self.notify_removed([key for key, _ in corrupt])
            await self.run_blocking(self._log_deletions, corrupt)
        return results

    def _read_records(self, jobs: list[tuple[bytes, Record]], spans: list[memoryview]) -> list[str]:
        """Worker thread: read and verify records. "ok" / "corrupt" / "error" each."""
        status = ["error"] * len(jobs)
        headers = _header_scratch(len(jobs))
        for run in self._runs([where for _, where in jobs]):
            slab, first = run[0][1]
            state = self._slabs.get(slab)
            if state is None:
                for n, _ in run:
                    status[n] = "corrupt"
                continue
            iov: list[memoryview] = []
            for n, _ in run:
                iov += [headers[n * HEADER_BYTES : (n + 1) * HEADER_BYTES], spans[n]]
            try:
                got = os.preadv(state.data_fd, iov, first * self.record_bytes)
            except OSError as exc:
                log.warning("fs tier %r: reading %d records failed: %s", self.name, len(run), exc)
                continue
            for k, (n, _) in enumerate(run):
                if got < (k + 1) * self.record_bytes:
                    status[n] = "corrupt"  # the file is shorter than this record
                    continue
                key = jobs[n][0]
                try:
                    checksum = verify_header(
                        headers[n * HEADER_BYTES : (n + 1) * HEADER_BYTES],
                        namespace=self._namespace,
                        key=key,
                        payload_len=self.block_nbytes,
                    )
                    ok = payload_checksum(spans[n][: self.block_nbytes]) == checksum
                except CorruptBlockError:
                    ok = False
                status[n] = "ok" if ok else "corrupt"
        return status

    def _log_deletions(self, dropped: list[tuple[bytes, Record]]) -> None:
        """Worker thread: tombstones, so dropped records stay gone after a restart."""
        for key, (slab, record) in dropped:
            state = self._slabs.get(slab)
            if state is None:
                continue
            with state.lock:
                try:
                    self._append_log(state, encode_entry(self._next_seq(), record, key, 0, deleted=True))
                    state.log_entries += 1
                except OSError as exc:
                    log.warning("fs tier %r: logging a deletion failed: %s", self.name, exc)

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        # docstring inherited
        if not await self._ensure_open():
            return [False] * len(keys)
        return [key in self._where for key in keys]

    async def delete(self, keys: Sequence[bytes]) -> int:
        # docstring inherited
        if not await self._ensure_open():
            return 0
        dropped = []
        for key in keys:
            where = self._where.get(key)
            if where is not None:
                dropped.append((key, where))
                self._drop(where)
        if dropped:
            self.notify_removed([key for key, _ in dropped])
            await self.run_blocking(self._log_deletions, dropped)
        return len(dropped)

    def backend_stats(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "blocks": len(self._where),
            # list(): worker threads may add a slab meanwhile; copying is atomic under the GIL.
            "used_bytes": sum(s.allocated + s.log_entries * ENTRY for s in list(self._slabs.values())),
            "capacity_bytes": self.capacity_bytes,
            "direct_io": self.direct_io,
            "fsync": self.fsync,
            "slabs": len(self._slabs),
            "evictions": self.counters["evictions"],
            "corrupt_blocks": self.counters["corrupt_blocks"],
            "write_errors": self.counters["write_errors"],
            "stores_without_room": self.counters["stores_without_room"],
            "out_of_space": self.counters["out_of_space"],
        }
