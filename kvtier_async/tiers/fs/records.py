"""`RecordIO`: the worker threads' reading and writing of records and log entries.

A store's records go out in one `pwritev` per run of neighbouring records, straight from
the primary slots (or through a staging buffer, `staging`), after the deletion entries of
the records they reuse and before the entries that name them: a record is visible only
once complete. A load's records come in one `preadv` per run (a large record in parts of
about `READ_PIECE_BYTES`, spread over the I/O threads) and are checked against the checksums
of the index on a CPU thread. Nothing here touches the index: the methods take the records
to work on and return what happened to each.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

from ...block_format import payload_checksum, sealed_fingerprint
from ...fault_log import FaultLog
from .index import OwnSlab, Record
from .layout import (
    ALIGN,
    ENTRY,
    append_to_log,
    coarse_time_ns,
    encode_entry,
    is_out_of_space,
    latest_per_record,
    read_log,
    reserve_log_room,
    rewrite_log,
)
from .slab_files import SlabFiles
from .staging import Stager

__all__ = ["READ_PIECE_BYTES", "ReadJob", "ReadPiece", "RecordIO", "WriteJob", "WriteStatus"]

_IOV_MAX = 1024

#: A record to write: (key, record, offset of its primary slot, whether a deletion goes first).
WriteJob = tuple[bytes, Record, int, bool]
#: A record to read: (data file descriptor, record, payload checksum, offset of its primary slot).
ReadJob = tuple[int, Record, int, int]

#: A record of twice this size or more is read in parts of about this size, each its own job
#: for the I/O threads, queued in order: the threads then read one load's blocks together and
#: finish the loads in turn, rather than all those in flight at once at the end, so that what
#: follows a read (opening a sealed block) goes on for the first while the next are read. In an
#: experiment on 2 cores (12 interleaved rounds of `benchmark.measure_tier`, 256 MiB of 32 MiB
#: blocks), sealed cold loads went from 0.79x the unsealed tier's to 0.94x with 8 MiB parts
#: (4 MiB: 0.90x and more event-loop lag; 16 MiB: 0.87x). Runs of smaller records stay one
#: read: cut into 8 MiB pieces too, 2 MiB blocks loaded no faster (sealed 0.83x -> 0.86x) and
#: the loop's lag p99 grew by about 0.25 ms (more completions handed back to it).
READ_PIECE_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class ReadPiece:
    """One `preadv` of `fd` at `offset` into `iov`: whole records of `jobs` (indexes into the
    read's jobs), or (not `whole`) a part of the one job's record."""

    fd: int
    offset: int
    iov: list[memoryview]
    jobs: list[int]
    whole: bool


#: What became of a write: "ok", not written ("error", "nospace"), or not written with the
#: record's old log entry still standing ("kept").
WriteStatus = Literal["ok", "error", "nospace", "kept"]
#: What a read came to: "ok", "corrupt", "stale" (its writer is rewriting it), "error" (not read).
ReadStatus = Literal["ok", "corrupt", "stale", "error"]


class RecordIO:
    """Records of `files`' slabs to and from the primary memory `view`.

    `own` is the index's map of our slabs (read here, changed only on the loop, with the
    log of a slab changed under the slab's lock).
    """

    def __init__(
        self,
        files: SlabFiles,
        view: memoryview,
        own: dict[int, OwnSlab],
        fault_log: FaultLog,
        *,
        sealed: bool = False,
    ) -> None:
        self.files = files
        #: What an index entry's checksum is of: the payload, or a sealed value's fingerprint
        #: (its tag authenticates the rest when it is opened: one pass over the bytes, not two).
        self.checksum = sealed_fingerprint if sealed else payload_checksum
        self.view = view
        self.own = own
        self.fault_log = fault_log
        self.block_nbytes = files.block_nbytes
        self.record_bytes = files.record_bytes
        self.staging = False
        self.stager = Stager()
        self._zeros = bytes(self.record_bytes - self.block_nbytes)
        self._seq = 0
        self._seq_lock = threading.Lock()

    @property
    def _name(self) -> str:
        return self.files.name

    def next_seq(self) -> int:
        # The wall clock to about a second (`SEQ_GRAIN_NS`), no finer, so that a log does not
        # tell when each block was written; strictly increasing, and past every number read in
        # the logs: a restart orders every process's blocks by age, those of one second too.
        with self._seq_lock:
            self._seq = max(self._seq + 1, self.files.seq_seen + 1, coarse_time_ns())
            return self._seq

    def current_seq(self) -> int:
        """The sequence number of the entry logged last, or where the next one starts: how old
        a block published now is, comparable with other processes' entries."""
        with self._seq_lock:
            return max(self._seq, self.files.seq_seen, coarse_time_ns())

    # -- writing ---------------------------------------------------------------------------------
    def checksums(self, offsets: list[int]) -> list[int]:
        """CPU thread: the payload checksums of the primary slots at `offsets`."""
        view = self.view
        return [self.checksum(view[offset : offset + self.block_nbytes]) for offset in offsets]

    def write(
        self, jobs: list[WriteJob], summing: Future[list[int]]
    ) -> tuple[list[WriteStatus], dict[int, int], list[int]]:
        """I/O thread: log deletions of reused records, write the records' payloads, then, their
        checksums in from `summing`, log the records written.

        Returns each job's status; the data file sizes of slabs where the disk was full; the
        checksums.
        """
        status: list[WriteStatus] = ["error"] * len(jobs)
        by_slab: dict[int, list[int]] = {}
        for n, (_, (slab, _), _, _) in enumerate(jobs):
            by_slab.setdefault(slab, []).append(n)
        todo: list[int] = []
        for slab, ns in by_slab.items():
            reused = [n for n in ns if jobs[n][3]]
            if reused:  # a deletion is of a record: the key it carries is only informative
                entries = b"".join(
                    encode_entry(self.next_seq(), jobs[n][1][1], jobs[n][0], 0, deleted=True) for n in reused
                )
                try:
                    self.log(slab, entries, len(reused))
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
            state = self.own[slab]
            try:
                iov = self._iov([jobs[n][2] for n in ns])
                self._write_all(state.data_fd, iov, first * self.record_bytes)
                done = ns
            except OSError as exc:
                done = self._write_one_by_one(state, ns, jobs, status, exc)
                if any(status[n] == "nospace" for n in ns):
                    full[slab] = os.fstat(state.data_fd).st_size
            if done and self.files.fsync:
                os.fdatasync(state.data_fd)
            written += done
        checksums = summing.result()
        if written:
            self._log_written(jobs, written, checksums, status)
        return status, full, checksums

    def _log_written(
        self, jobs: list[WriteJob], written: list[int], checksums: list[int], status: list[WriteStatus]
    ) -> None:
        """Log the records written, marking them "ok" in `status`.

        The entries go after the data: a record is visible only once complete.
        """
        by_slab: dict[int, list[int]] = {}
        for n in written:
            by_slab.setdefault(jobs[n][1][0], []).append(n)
        for slab, ns in by_slab.items():
            entries = b"".join(
                encode_entry(self.next_seq(), jobs[n][1][1], jobs[n][0], checksums[n]) for n in ns
            )
            try:
                self.log(slab, entries, len(ns))
                for n in ns:
                    status[n] = "ok"
            except OSError as exc:
                for n in ns:
                    status[n] = "nospace" if is_out_of_space(exc) else "error"

    def _write_one_by_one(
        self,
        state: OwnSlab,
        ns: list[int],
        jobs: list[WriteJob],
        status: list[WriteStatus],
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
                if is_out_of_space(exc):
                    for later in ns[k:]:
                        status[later] = "nospace"  # records are in file order: none after fits
                    break
                status[n] = "error"
                self.fault_log.warning("write", "fs tier %r: writing a record failed: %s", self._name, exc)
        if not done and not is_out_of_space(first_error):
            self.fault_log.warning(
                "write", "fs tier %r: writing %d records failed: %s", self._name, len(ns), first_error
            )
        return done

    def _write_all(self, fd: int, iov: list[memoryview], offset: int) -> None:
        total = sum(len(v) for v in iov)
        done = self.stager.pwritev(fd, iov, offset) if self.staging else os.pwritev(fd, iov, offset)
        if done != total:  # a full disk, part way: the caller retries record by record
            raise OSError(errno.ENOSPC, f"short write: {done} of {total} bytes")

    # -- logs ------------------------------------------------------------------------------------
    def log(self, slab: int, entries: bytes, count: int) -> None:
        """Append entries to one of our slabs' logs, compacting it when it grows long."""
        state = self.own[slab]
        with state.lock:
            try:
                _append_log(state.log_fd, entries)
            except OSError as exc:
                if not is_out_of_space(exc):
                    raise
                self._compact_log(slab, state)  # the disk is full: make room, try once more
                _append_log(state.log_fd, entries)
            if self.files.fsync:
                os.fsync(state.log_fd)
            state.log_entries += count
            if state.log_entries > 4 * state.records:
                try:
                    self._compact_log(slab, state)
                except OSError as exc:  # the entries are in: a long log only costs replay time
                    self.fault_log.warning(
                        "compact", "fs tier %r: compacting a log failed: %s", self._name, exc
                    )

    def _compact_log(self, slab: int, state: OwnSlab) -> None:
        """Shrink a slab's log to its live entries (its lock held)."""
        path = self.files.path(slab, "idx")
        try:
            ours = path.stat().st_ino == os.fstat(state.log_fd).st_ino
        except FileNotFoundError:
            ours = False
        if not ours:
            # Our log was removed under us, and the path may name another process's new slab
            # now: never touch it. Our unlinked log, long as it gets, serves us until we exit.
            return
        entries, fd = rewrite_log(path, fsync=self.files.fsync)
        os.close(state.log_fd)
        state.log_fd, state.log_entries = fd, entries
        reserve_log_room(state.log_fd, os.fstat(state.log_fd).st_size + 4 * state.records * ENTRY)

    def log_deletions(self, dropped: list[tuple[bytes, Record]]) -> None:
        """Deletions, so dropped records stay gone for every process and restart.

        Our slabs' logs take them directly, another writer's through `append_to_log`.
        """
        for key, (slab, record) in dropped:
            entry = encode_entry(self.next_seq(), record, key, 0, deleted=True)
            try:
                if slab in self.own:
                    self.log(slab, entry, 1)
                    continue
                append_to_log(self.files.path(slab, "idx"), entry)
            except OSError as exc:
                self.fault_log.warning("delete", "fs tier %r: logging a deletion failed: %s", self._name, exc)

    # -- reading ---------------------------------------------------------------------------------
    def read_pieces(self, jobs: list[ReadJob]) -> list[ReadPiece]:
        """The reads that bring `jobs`' records in, each one `preadv` for `read_piece` on
        whichever I/O thread is free: one per run of neighbouring records, or, for records of
        two `READ_PIECE_BYTES` or more, one per part of about that size."""
        pieces: list[ReadPiece] = []
        size = self.record_bytes
        parts = size // READ_PIECE_BYTES
        for run in self._runs([where for _, where, _, _ in jobs]):
            if parts < 2:
                fd, (_, first), _, _ = jobs[run[0]]
                iov = self._iov([jobs[n][3] for n in run])
                pieces.append(ReadPiece(fd, first * size, iov, run, whole=True))
                continue
            step = -(-size // parts // ALIGN) * ALIGN  # parts O_DIRECT aligned, the last shorter
            for n in run:
                fd, (_, record), _, slot = jobs[n]
                for start in range(0, size, step):
                    view = self.view[slot + start : slot + min(start + step, size)]
                    pieces.append(ReadPiece(fd, record * size + start, [view], [n], whole=False))
        return pieces

    def read_piece(self, piece: ReadPiece) -> int:
        """I/O thread: one piece's `preadv`; the bytes that arrived, or -1 where the read failed.
        Checking them is `verify`'s work, off this thread, which goes on to the next read."""
        try:
            if self.staging:
                return self.stager.preadv(piece.fd, piece.iov, piece.offset)
            return os.preadv(piece.fd, piece.iov, piece.offset)
        except OSError as exc:
            self.fault_log.warning(
                "read", "fs tier %r: a read of %d record(s) failed: %s", self._name, len(piece.jobs), exc
            )
            return -1

    def arrived(self, njobs: int, pieces: list[ReadPiece], done: list[int]) -> list[int]:
        """Per job, how many of its record's bytes arrived (-1: a read of it failed), from what
        `read_piece` said of each piece."""
        got = [0] * njobs
        failed: set[int] = set()
        for piece, n_done in zip(pieces, done):
            if n_done < 0:
                failed.update(piece.jobs)
            elif piece.whole:
                for k, n in enumerate(piece.jobs):
                    got[n] += max(0, min(self.record_bytes, n_done - k * self.record_bytes))
            else:
                got[piece.jobs[0]] += n_done
        return [-1 if n in failed else g for n, g in enumerate(got)]

    def verify(self, jobs: list[ReadJob], got: list[int]) -> list[ReadStatus]:
        """CPU thread: check what arrived against the checksums in the index."""
        status: list[ReadStatus] = ["error"] * len(jobs)
        for n, (_, where, checksum, offset) in enumerate(jobs):
            if got[n] < 0:
                continue
            payload = self.view[offset : offset + self.block_nbytes]
            if got[n] == self.record_bytes and self.checksum(payload) == checksum:
                status[n] = "ok"
                # A record's padding came from the disk, unchecked: zeros in the slot, whatever
                # it held, so no tier is ever handed bytes that were not the block's.
                self.view[offset + self.block_nbytes : offset + self.record_bytes] = self._zeros
            elif where[0] in self.own:
                status[n] = "corrupt"  # we are its only writer
            else:
                status[n] = "corrupt" if self._log_still_names(where, checksum) else "stale"
        return status

    def _log_still_names(self, where: Record, checksum: int) -> bool:
        """Whether another writer's log still says `where` holds the block we failed to read: its
        writer logs a deletion before rewriting a record, so then the bytes are damaged."""
        try:
            entries, _, _ = read_log(self.files.path(where[0], "idx"))
        except FileNotFoundError:
            return False
        latest = latest_per_record(entries).get(where[1])
        return latest is not None and not latest.deleted and latest.checksum == checksum

    # -- runs of records -------------------------------------------------------------------------
    def _iov(self, offsets: list[int]) -> list[memoryview]:
        """The primary slots at `offsets` (whole records), neighbouring slots merged into one piece."""
        pieces: list[list[int]] = []
        for offset in offsets:
            if pieces and pieces[-1][1] == offset:
                pieces[-1][1] = offset + self.record_bytes
            else:
                pieces.append([offset, offset + self.record_bytes])
        return [self.view[start:end] for start, end in pieces]

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


def _append_log(log_fd: int, data: bytes) -> None:
    """Append whole entries or nothing: a torn tail would hide every later entry."""
    start = os.fstat(log_fd).st_size
    try:
        if os.write(log_fd, data) != len(data):
            raise OSError(errno.ENOSPC, "short write to the index log")
    except BaseException:
        os.ftruncate(log_fd, start)
        raise
