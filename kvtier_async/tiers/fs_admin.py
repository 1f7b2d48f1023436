"""Offline maintenance of a file-system tier root: `kvtier fs stat | verify | gc`.

These run while no tier has the namespace open: each takes the namespace's
lock and refuses if a process holds it.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..block_format import HEADER_BYTES, CorruptBlockError, payload_checksum, read_header
from ..errors import KVTierError
from .fs_layout import (
    ENTRY,
    FILE_MODE,
    SLAB_RE,
    compact_log,
    encode_entry,
    replay,
    slab_path,
)

__all__ = ["NamespaceReport", "gc_root", "stat_root", "verify_root"]


@dataclass(slots=True)
class NamespaceReport:
    directory: Path
    namespace: str
    record_bytes: int
    blocks: int = 0
    slabs: int = 0
    bytes_on_disk: int = 0
    checked: int = 0
    corrupt: list[bytes] = field(default_factory=list)
    removed_bytes: int = 0


def _namespace_dirs(root: Path) -> Iterator[tuple[Path, str, int]]:
    """(directory, namespace name, record size) for every namespace and record size under root."""
    if not root.is_dir():
        raise KVTierError(f"{root} is not a directory")
    for directory in sorted(root.glob("kvtier-*")):
        if not directory.is_dir():
            continue
        name_file = directory / "NAMESPACE"
        name = name_file.read_text().rstrip("\n") if name_file.exists() else "?"
        sizes = sorted({int(m[1]) for p in directory.iterdir() if (m := SLAB_RE.match(p.name)) is not None})
        for record_bytes in sizes:
            yield directory, name, record_bytes


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    fd = os.open(directory / "LOCK", os.O_CREAT | os.O_RDWR, FILE_MODE)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise KVTierError(f"{directory} is in use by a running tier") from None
        yield
    finally:
        os.close(fd)


def _disk_bytes(directory: Path, record_bytes: int) -> int:
    total = 0
    for path in directory.iterdir():
        m = SLAB_RE.match(path.name)
        if m is not None and int(m[1]) == record_bytes:
            total += path.stat().st_size
    return total


def stat_root(root: Path) -> list[NamespaceReport]:
    """Namespaces, blocks and bytes on disk under `root` (reads only the index logs)."""
    reports = []
    for directory, name, record_bytes in _namespace_dirs(root):
        found = replay(directory, record_bytes)
        reports.append(
            NamespaceReport(
                directory,
                name,
                record_bytes,
                blocks=len(found.live),
                slabs=len(found.slabs),
                bytes_on_disk=_disk_bytes(directory, record_bytes),
            )
        )
    return reports


def verify_root(root: Path, *, remove: bool = False) -> list[NamespaceReport]:
    """Read every block and check its header and checksum; with `remove`, drop corrupt ones."""
    reports = []
    for directory, name, record_bytes in _namespace_dirs(root):
        report = NamespaceReport(directory, name, record_bytes)
        namespace = bytes.fromhex(directory.name.removeprefix("kvtier-"))
        with _locked(directory):
            found = replay(directory, record_bytes)
            report.blocks, report.slabs = len(found.live), len(found.slabs)
            seq = found.max_seq
            for (slab, record), (key, _, _) in found.live.items():
                report.checked += 1
                if not _record_is_good(directory, record_bytes, slab, record, namespace, key):
                    report.corrupt.append(key)
                    if remove:
                        seq += 1
                        path = slab_path(directory, record_bytes, slab, "idx")
                        with open(path, "ab") as log:
                            log.write(encode_entry(seq, record, key, 0, deleted=True))
        report.bytes_on_disk = _disk_bytes(directory, record_bytes)
        reports.append(report)
    return reports


def _record_is_good(
    directory: Path, record_bytes: int, slab: int, record: int, namespace: bytes, key: bytes
) -> bool:
    path = slab_path(directory, record_bytes, slab, "kvs")
    with open(path, "rb") as f:
        f.seek(record * record_bytes)
        data = f.read(record_bytes)
    try:
        got_namespace, got_key, payload_len, checksum = read_header(data[:HEADER_BYTES])
    except CorruptBlockError:
        return False
    if got_namespace != namespace or got_key != key:
        return False
    if payload_len > record_bytes - HEADER_BYTES or len(data) < HEADER_BYTES + payload_len:
        return False
    return payload_checksum(memoryview(data)[HEADER_BYTES : HEADER_BYTES + payload_len]) == checksum


def gc_root(root: Path, capacity_bytes: int) -> list[NamespaceReport]:
    """Bring each namespace within `capacity_bytes` on disk, dropping its oldest slabs first.

    A slab's age is that of the newest block it holds. Kept slabs are renumbered
    from 0 and their logs compacted, so a tier opened with this capacity keeps them.
    """
    reports = []
    for directory, name, record_bytes in _namespace_dirs(root):
        report = NamespaceReport(directory, name, record_bytes)
        with _locked(directory):
            found = replay(directory, record_bytes)
            newest: dict[int, int] = dict.fromkeys(found.slabs, 0)
            live_in: dict[int, int] = dict.fromkeys(found.slabs, 0)
            for (slab, _), (_, seq, _) in found.live.items():
                newest[slab] = max(newest[slab], seq)
                live_in[slab] += 1
            kept: list[int] = []
            used = 0
            for slab in sorted(found.slabs, key=lambda s: newest[s], reverse=True):
                size = found.slabs[slab] * record_bytes + 4 * found.slabs[slab] * ENTRY
                if used + size <= capacity_bytes and live_in[slab]:
                    kept.append(slab)
                    used += size
            before = _disk_bytes(directory, record_bytes)
            for slab in found.slabs:
                if slab not in kept:
                    for kind in ("kvs", "idx"):
                        slab_path(directory, record_bytes, slab, kind).unlink(missing_ok=True)
            for number, slab in enumerate(sorted(kept)):
                idx = slab_path(directory, record_bytes, slab, "idx")
                if idx.exists():
                    compact_log(idx)
                if number != slab:
                    for kind in ("kvs", "idx"):
                        os.replace(
                            slab_path(directory, record_bytes, slab, kind),
                            slab_path(directory, record_bytes, number, kind),
                        )
            after = _disk_bytes(directory, record_bytes)
        report.removed_bytes = before - after
        report.bytes_on_disk = after
        report.slabs = len(kept)
        report.blocks = sum(live_in[s] for s in kept)
        reports.append(report)
    return reports
