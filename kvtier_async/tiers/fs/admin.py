"""Maintenance of a file-system tier root: `kvtier fs stat | verify | gc`.

All three are safe while processes use the root, which they check as the tier
does, and open every file as the tier does. `stat` only reads logs.
`verify` checks every block against its log entry (with the tier secret, opens
every sealed one) and, with `remove`, logs a deletion for a corrupt one; a
record its writer is rewriting right now is recognised (its writer logs a
deletion first) and skipped, not reported.
`gc` removes and compacts only slabs no process writes at the moment: a slab
with a live writer is left to it (its writer keeps it within capacity). It needs
no free space: on a full disk a log it cannot rewrite stays as it is.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ...block_format import SEAL_OVERHEAD, BlockSealer, payload_checksum, sealed_fingerprint
from ...errors import ConfigError
from .layout import (
    ENTRY,
    SLAB_RE,
    DirFormat,
    Entry,
    Folder,
    append_to_log,
    compact_log,
    encode_entry,
    is_out_of_space,
    latest_per_record,
    namespace_dir_name,
    open_namespace_dir,
    open_namespace_name,
    open_root,
    read_log,
    read_small,
    record_bytes_for,
    replay,
    skip_linked_log,
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
    unchecked: str = ""  # by verify: what it could not check ("": nothing left unchecked)


#: Slab files whose names claim larger blocks are not ours (a crafted name): skipped, never
#: read. One object in one S3 PUT is at most 5 GiB; no engine's block comes near.
MAX_BLOCK_NBYTES = 5 << 30


def printable(text: str) -> str:
    """`text` with every character a terminal could act on escaped (names read from a root are
    anyone's: an escape sequence in a NAMESPACE file must not reach the terminal)."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _namespace_dirs(root: Path) -> Iterator[tuple[Folder, str, int]]:
    """(directory, namespace name, block size) for every namespace and block size under root,
    each directory held open while its sizes are worked on. ROOT is checked as the tier checks
    it (`ConfigError`: not a directory, another user's, writable by others); a namespace
    directory that is a symlink or another user's is skipped; the name is escaped."""
    try:
        root_folder = open_root(root, create=False)
    except ConfigError as exc:
        raise ConfigError(printable(str(exc))) from None
    with root_folder:
        for entry in sorted(n for n in root_folder.names() if n.startswith("kvtier-")):
            try:
                folder = open_namespace_dir(root_folder, entry, create=False)
            except (ConfigError, FileNotFoundError):
                continue
            with folder:
                name = read_small(folder / "NAMESPACE")
                name = "?" if name is None else printable(name.rstrip("\n"))
                sizes = sorted(
                    {
                        int(m[1])
                        for n in folder.names()
                        if (m := SLAB_RE.match(n)) is not None and 0 < int(m[1]) <= MAX_BLOCK_NBYTES
                    }
                )
                for block_nbytes in sizes:
                    yield folder, name, block_nbytes


def _disk_bytes(folder: Folder, block_nbytes: int) -> int:
    total = 0
    for name in folder.names():
        m = SLAB_RE.match(name)
        if m is not None and int(m[1]) == block_nbytes:
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                total += (folder / name).stat().st_size
    return total


def _in_use(folder: Folder, block_nbytes: int) -> int:
    return sum(slab_is_owned(folder, block_nbytes, s) for s in slab_numbers(folder, block_nbytes))


def stat_root(root: Path) -> list[NamespaceReport]:
    """Namespaces, blocks and bytes on disk under `root` (reads only the index logs)."""
    reports = []
    for folder, name, block_nbytes in _namespace_dirs(root):
        found = replay(folder, block_nbytes)
        reports.append(
            NamespaceReport(
                folder.path,
                name,
                block_nbytes,
                blocks=len(found.live),
                slabs=len(found.slabs),
                slabs_in_use=_in_use(folder, block_nbytes),
                bytes_on_disk=_disk_bytes(folder, block_nbytes),
            )
        )
    return reports


def verify_root(root: Path, *, remove: bool = False, secret: bytes | None = None) -> list[NamespaceReport]:
    """Read every block and check it against its log entry; with `remove`, drop corrupt ones.
    With the tier `secret`, every sealed block is opened too (one that does not authenticate is
    corrupt); without it, a sealed block's header and tag are checked, its payload is not (the
    report's `unchecked` says so)."""
    reports = []
    for folder, name, block_nbytes in _namespace_dirs(root):
        report = NamespaceReport(folder.path, name, block_nbytes)
        check = _record_check(folder, secret, report)
        logs_seen: set[int] = set()
        for slab in slab_numbers(folder, block_nbytes):
            if skip_linked_log(slab_path(folder, block_nbytes, slab, "idx"), logs_seen):
                continue
            report.slabs += 1
            report.slabs_in_use += slab_is_owned(folder, block_nbytes, slab)
            if check is not None:
                _verify_slab(folder, block_nbytes, slab, report, remove, check)
        report.bytes_on_disk = _disk_bytes(folder, block_nbytes)
        reports.append(report)
    return reports


#: Whether a record's bytes are the block its log entry names.
RecordCheck = Callable[[bytes, Entry], bool]


def _record_check(folder: Folder, secret: bytes | None, report: NamespaceReport) -> RecordCheck | None:
    """How this directory's records are checked, from the kind its FORMAT file records (never
    from the NAMESPACE file's text, which a plain namespace may share); None: not at all (a
    format this version does not know). Notes in `report.unchecked` what cannot be checked."""
    found = DirFormat.parse(read_small(folder / "FORMAT") or "")
    if found is None:
        report.unchecked = "not checked: a format this kvtier_async does not read"
        return None
    if found.kind is None:
        # Format 2 did not record whether its records are sealed: a record is good if it is
        # either, so no good block is ever reported (nor removed) for being of the other kind.
        report.unchecked = "sealed payloads not checked (format 2 records no kind)"
        return lambda data, e: e.checksum in (payload_checksum(data), sealed_fingerprint(data))
    if found.kind == "plain":
        return lambda data, e: payload_checksum(data) == e.checksum
    sealer = None if secret is None else _sealer_of(folder, secret, found.sealed_name)
    if sealer is None:
        report.unchecked = (
            "payloads not checked: give the tier secret (--secret-env / --secret-file)"
            if secret is None
            else "payloads not checked: the secret given is not this namespace's"
        )
        return lambda data, e: sealed_fingerprint(data) == e.checksum
    report.namespace = printable(sealer.namespace)
    opener = sealer.sealer

    def opens(data: bytes, e: Entry) -> bool:
        if sealed_fingerprint(data) != e.checksum:
            return False
        payload = bytearray(max(0, len(data) - SEAL_OVERHEAD))
        return opener.open_into(memoryview(payload), memoryview(data), e.key)

    return opens


@dataclass(frozen=True, slots=True)
class _NamespaceSealer:
    namespace: str
    sealer: BlockSealer


def _sealer_of(folder: Folder, secret: bytes, sealed_name: bytes) -> _NamespaceSealer | None:
    """The sealer of the namespace whose name the FORMAT file holds sealed, if `secret` opens it
    and it is this directory's namespace."""
    namespace = open_namespace_name(secret, sealed_name)
    if namespace is None:
        return None
    sealer = BlockSealer(secret, namespace)
    if namespace_dir_name(sealer.namespace_tag) != folder.path.name:
        return None
    return _NamespaceSealer(namespace, sealer)


def _verify_slab(
    folder: Folder, block_nbytes: int, slab: int, report: NamespaceReport, remove: bool, check: RecordCheck
) -> None:
    log_path = slab_path(folder, block_nbytes, slab, "idx")
    try:
        entries, _, _ = read_log(log_path)
        data_fd = slab_path(folder, block_nbytes, slab, "kvs").open()
    except FileNotFoundError:
        return  # removed meanwhile, or not ours
    try:
        for record, entry in latest_per_record(entries).items():
            if entry.deleted:
                continue
            report.blocks += 1
            report.checked += 1
            if _matches(data_fd, block_nbytes, record, entry, check):
                continue
            # Its writer may be rewriting it: then the log no longer names this block.
            latest, _, _ = read_log(log_path)
            if latest_per_record(latest).get(record) != entry:
                continue
            if _matches(data_fd, block_nbytes, record, entry, check):
                continue
            report.corrupt.append(entry.key)
            if remove:
                append_to_log(log_path, encode_entry(entry.seq + 1, record, entry.key, 0, deleted=True))
    finally:
        os.close(data_fd)


def _matches(data_fd: int, block_nbytes: int, record: int, entry: Entry, check: RecordCheck) -> bool:
    offset = record * record_bytes_for(block_nbytes)
    if os.fstat(data_fd).st_size < offset + block_nbytes:  # never allocate for bytes not there
        return False
    data = os.pread(data_fd, block_nbytes, offset)
    return len(data) == block_nbytes and check(data, entry)


def gc_root(root: Path, capacity_bytes: int) -> list[NamespaceReport]:
    """Bring each namespace within `capacity_bytes` on disk, dropping its oldest slabs first.

    A slab's age is that of the newest block it holds. Slabs a live process
    writes are counted but neither removed nor rewritten; kept slabs without a
    writer have their logs compacted, where there is room to write the new log.
    """
    reports = []
    for folder, name, block_nbytes in _namespace_dirs(root):
        report = NamespaceReport(folder.path, name, block_nbytes)
        record_bytes = record_bytes_for(block_nbytes)
        before = _disk_bytes(folder, block_nbytes)
        found = replay(folder, block_nbytes)
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
            kept = _collect_slab(folder, block_nbytes, slab, remove=not fits)
            if kept:
                used += size
                report.slabs += 1
                report.blocks += live_in[slab]
            report.slabs_in_use += kept == "in use"
            if kept == "not compacted":
                not_compacted.append(slab)
        # Kept slabs are the newest and come first: on a full disk the removals after them made room.
        report.logs_not_compacted = sum(
            _collect_slab(folder, block_nbytes, slab, remove=False) == "not compacted"
            for slab in not_compacted
        )
        report.bytes_on_disk = _disk_bytes(folder, block_nbytes)
        report.removed_bytes = max(0, before - report.bytes_on_disk)
        reports.append(report)
    return reports


def _collect_slab(folder: Folder, block_nbytes: int, slab: int, *, remove: bool) -> str:
    """Remove a slab, or compact its log.

    "in use" (left alone), "kept", "not compacted" (kept; no room for a new log) or "" (removed).
    """
    data_path = slab_path(folder, block_nbytes, slab, "kvs")
    try:
        fd = data_path.open(os.O_RDWR)
    except FileNotFoundError:
        return ""
    try:
        if not try_flock(fd):
            return "in use"
        # Its writer's lock, held until we close: nobody takes the slab meanwhile.
        log_path = slab_path(folder, block_nbytes, slab, "idx")
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
