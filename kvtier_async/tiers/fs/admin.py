"""Maintenance of a file-system tier root: `kvtier fs stat | verify | gc`.

All three are safe while processes use the root. `stat` only reads logs.
`verify` checks every block against its log entry and, with `remove`, logs a
deletion for a corrupt one; a record its writer is rewriting right now is
recognised (its writer logs a deletion first) and skipped, not reported.
`gc` removes and compacts only slabs no process writes at the moment: a slab
with a live writer is left to it (its writer keeps it within capacity). It needs
no free space: on a full disk a log it cannot rewrite stays as it is.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ...block_format import payload_checksum, sealed_fingerprint
from ...errors import KVTierError
from .layout import (
    ENTRY,
    NO_FOLLOW,
    SEALED_NAMESPACE_LABEL,
    SLAB_RE,
    Entry,
    append_to_log,
    compact_log,
    encode_entry,
    is_out_of_space,
    latest_per_record,
    read_log,
    read_small,
    record_bytes_for,
    replay,
    slab_is_owned,
    slab_numbers,
    slab_path,
    try_flock,
)

__all__ = ["NamespaceReport", "gc_root", "printable", "stat_root", "verify_root"]


@dataclass(slots=True)
class NamespaceReport:
    directory: Path
    namespace: str
    block_nbytes: int
    blocks: int = 0
    slabs: int = 0
    slabs_in_use: int = 0  # with a live writer right now
    bytes_on_disk: int = 0
    checked: int = 0
    corrupt: list[bytes] = field(default_factory=list)
    removed_bytes: int = 0
    logs_not_compacted: int = 0  # by gc, for want of space


#: Slab files whose names claim larger blocks are not ours (a crafted name): skipped, never
#: read. One object in one S3 PUT is at most 5 GiB; no engine's block comes near.
MAX_BLOCK_NBYTES = 5 << 30


def printable(text: str) -> str:
    """`text` with every character a terminal could act on escaped (names read from a root are
    anyone's: an escape sequence in a NAMESPACE file must not reach the terminal)."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _namespace_dirs(root: Path) -> Iterator[tuple[Path, str, int]]:
    """(directory, namespace name, block size) for every namespace and block size under root.
    A namespace directory that is a symlink or another user's is skipped; the name is escaped."""
    if not root.is_dir():
        raise KVTierError(f"{printable(str(root))} is not a directory")
    for directory in sorted(root.glob("kvtier-*")):
        info = directory.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            continue
        name = read_small(directory / "NAMESPACE")
        name = "?" if name is None else printable(name.rstrip("\n"))
        sizes = sorted(
            {
                int(m[1])
                for p in directory.iterdir()
                if (m := SLAB_RE.match(p.name)) is not None and 0 < int(m[1]) <= MAX_BLOCK_NBYTES
            }
        )
        for block_nbytes in sizes:
            yield directory, name, block_nbytes


def _disk_bytes(directory: Path, block_nbytes: int) -> int:
    total = 0
    for path in directory.iterdir():
        m = SLAB_RE.match(path.name)
        if m is not None and int(m[1]) == block_nbytes:
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                total += path.stat().st_size
    return total


def _in_use(directory: Path, block_nbytes: int) -> int:
    return sum(slab_is_owned(directory, block_nbytes, s) for s in slab_numbers(directory, block_nbytes))


def stat_root(root: Path) -> list[NamespaceReport]:
    """Namespaces, blocks and bytes on disk under `root` (reads only the index logs)."""
    reports = []
    for directory, name, block_nbytes in _namespace_dirs(root):
        found = replay(directory, block_nbytes)
        reports.append(
            NamespaceReport(
                directory,
                name,
                block_nbytes,
                blocks=len(found.live),
                slabs=len(found.slabs),
                slabs_in_use=_in_use(directory, block_nbytes),
                bytes_on_disk=_disk_bytes(directory, block_nbytes),
            )
        )
    return reports


def verify_root(root: Path, *, remove: bool = False) -> list[NamespaceReport]:
    """Read every block and check it against its log entry; with `remove`, drop corrupt ones."""
    reports = []
    for directory, name, block_nbytes in _namespace_dirs(root):
        report = NamespaceReport(directory, name, block_nbytes)
        for slab in slab_numbers(directory, block_nbytes):
            report.slabs += 1
            report.slabs_in_use += slab_is_owned(directory, block_nbytes, slab)
            _verify_slab(directory, block_nbytes, slab, report, remove)
        report.bytes_on_disk = _disk_bytes(directory, block_nbytes)
        reports.append(report)
    return reports


def _verify_slab(
    directory: Path, block_nbytes: int, slab: int, report: NamespaceReport, remove: bool
) -> None:
    log_path = slab_path(directory, block_nbytes, slab, "idx")
    sealed = report.namespace == SEALED_NAMESPACE_LABEL  # its checksums are of sealed values
    try:
        entries, _, _ = read_log(log_path)
        data_fd = os.open(slab_path(directory, block_nbytes, slab, "kvs"), os.O_RDONLY | NO_FOLLOW)
    except FileNotFoundError:
        return  # removed meanwhile
    try:
        for record, entry in latest_per_record(entries).items():
            if entry.deleted:
                continue
            report.blocks += 1
            report.checked += 1
            if _matches(data_fd, block_nbytes, record, entry, sealed):
                continue
            # Its writer may be rewriting it: then the log no longer names this block.
            latest, _, _ = read_log(log_path)
            if latest_per_record(latest).get(record) != entry:
                continue
            if _matches(data_fd, block_nbytes, record, entry, sealed):
                continue
            report.corrupt.append(entry.key)
            if remove:
                append_to_log(log_path, encode_entry(entry.seq + 1, record, entry.key, 0, deleted=True))
    finally:
        os.close(data_fd)


def _matches(data_fd: int, block_nbytes: int, record: int, entry: Entry, sealed: bool) -> bool:
    offset = record * record_bytes_for(block_nbytes)
    if os.fstat(data_fd).st_size < offset + block_nbytes:  # never allocate for bytes not there
        return False
    data = os.pread(data_fd, block_nbytes, offset)
    checksum = sealed_fingerprint if sealed else payload_checksum
    return len(data) == block_nbytes and checksum(data) == entry.checksum


def gc_root(root: Path, capacity_bytes: int) -> list[NamespaceReport]:
    """Bring each namespace within `capacity_bytes` on disk, dropping its oldest slabs first.

    A slab's age is that of the newest block it holds. Slabs a live process
    writes are counted but neither removed nor rewritten; kept slabs without a
    writer have their logs compacted, where there is room to write the new log.
    """
    reports = []
    for directory, name, block_nbytes in _namespace_dirs(root):
        report = NamespaceReport(directory, name, block_nbytes)
        record_bytes = record_bytes_for(block_nbytes)
        before = _disk_bytes(directory, block_nbytes)
        found = replay(directory, block_nbytes)
        newest: dict[int, int] = dict.fromkeys(found.slabs, 0)
        live_in: dict[int, int] = dict.fromkeys(found.slabs, 0)
        for (slab, _), (_, seq, _) in found.live.items():
            newest[slab] = max(newest[slab], seq)
            live_in[slab] += 1
        used = 0
        not_compacted = []
        for slab in sorted(found.slabs, key=lambda s: newest[s], reverse=True):
            size = found.slabs[slab] * record_bytes + 4 * found.slabs[slab] * ENTRY
            fits = used + size <= capacity_bytes and live_in[slab] > 0
            kept = _collect_slab(directory, block_nbytes, slab, remove=not fits)
            if kept:
                used += size
                report.slabs += 1
                report.blocks += live_in[slab]
            report.slabs_in_use += kept == "in use"
            if kept == "not compacted":
                not_compacted.append(slab)
        # Kept slabs are the newest and come first: on a full disk the removals after them made room.
        report.logs_not_compacted = sum(
            _collect_slab(directory, block_nbytes, slab, remove=False) == "not compacted"
            for slab in not_compacted
        )
        report.bytes_on_disk = _disk_bytes(directory, block_nbytes)
        report.removed_bytes = max(0, before - report.bytes_on_disk)
        reports.append(report)
    return reports


def _collect_slab(directory: Path, block_nbytes: int, slab: int, *, remove: bool) -> str:
    """Remove a slab, or compact its log.

    "in use" (left alone), "kept", "not compacted" (kept; no room for a new log) or "" (removed).
    """
    data_path = slab_path(directory, block_nbytes, slab, "kvs")
    try:
        fd = os.open(data_path, os.O_RDWR | NO_FOLLOW)
    except FileNotFoundError:
        return ""
    try:
        if not try_flock(fd):
            return "in use"
        # Its writer's lock, held until we close: nobody takes the slab meanwhile.
        log_path = slab_path(directory, block_nbytes, slab, "idx")
        if remove:
            data_path.unlink(missing_ok=True)
            log_path.unlink(missing_ok=True)
            return ""
        if log_path.exists():
            try:
                compact_log(log_path)
            except OSError as exc:
                if not is_out_of_space(exc):
                    raise
                return "not compacted"  # the old log stands whole
        return "kept"
    finally:
        os.close(fd)
