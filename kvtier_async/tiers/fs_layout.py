"""On-disk layout of the file-system tier: slab files of fixed-size records plus index logs.

    ROOT/kvtier-<namespace id hex>/            0700, one per namespace
        NAMESPACE                              the namespace's name (for `kvtier fs stat`)
        LOCK                                   flock()ed by the one process using the directory
        slab-<record bytes>-<n>.kvs            0600, preallocated: records of one size
        slab-<record bytes>-<n>.idx            0600, append-only log of what each record holds

A record is a block in the self-verifying format of `kvtier_async.block_format`
(4096-byte header, then the payload padded to a multiple of 4096), at offset
`i * record_bytes` of its slab. Packing many records into one preallocated
file avoids a file creation per block, which this class of disk cannot do
faster than a few thousand times a second.

A record becomes visible only after its bytes are written and then an index
entry naming it is appended to the slab's log; a reader always re-checks the
record's own header and checksum, so a torn write or a stale entry reads as a
miss, never as wrong bytes. Index entries are fixed-size and checksummed; a
torn last entry is ignored. Replaying the logs (the latest entry per record
wins) rebuilds the index without reading any payload, in write order, which
is the LRU order after a restart.
"""

from __future__ import annotations

import errno
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from ..block_format import HEADER_BYTES, namespace_id

__all__ = [
    "ENTRY",
    "Entry",
    "NamespaceDir",
    "decode_entries",
    "encode_entry",
    "namespace_dir_name",
    "record_bytes_for",
    "replay",
]

ALIGN = 4096
DIR_MODE = 0o700
FILE_MODE = 0o600
_ENTRY_FIELDS = struct.Struct("<IQIBB128sQ")  # magic, seq, record, flags, key_len, key, checksum
ENTRY = _ENTRY_FIELDS.size + 8  # fields + their XXH3-64
_ENTRY_MAGIC = 0x4B565449  # "KVTI"
FLAG_DELETED = 1
SLAB_RE = re.compile(r"^slab-(\d+)-(\d+)\.(kvs|idx)$")


def namespace_dir_name(namespace: str) -> str:
    return "kvtier-" + namespace_id(namespace).hex()


def record_bytes_for(block_nbytes: int) -> int:
    return HEADER_BYTES + -(-block_nbytes // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class Entry:
    seq: int
    record: int
    deleted: bool
    key: bytes
    checksum: int


def encode_entry(seq: int, record: int, key: bytes, checksum: int, *, deleted: bool = False) -> bytes:
    fields = _ENTRY_FIELDS.pack(
        _ENTRY_MAGIC, seq, record, FLAG_DELETED if deleted else 0, len(key), key, checksum
    )
    return fields + struct.pack("<Q", xxhash.xxh3_64_intdigest(fields))


def decode_entries(data: bytes) -> list[Entry]:
    """Entries of a log; a torn or corrupt entry (and anything after it) is ignored."""
    out = []
    for start in range(0, len(data) - ENTRY + 1, ENTRY):
        fields = data[start : start + _ENTRY_FIELDS.size]
        (check,) = struct.unpack_from("<Q", data, start + _ENTRY_FIELDS.size)
        if xxhash.xxh3_64_intdigest(fields) != check:
            break
        magic, seq, record, flags, key_len, key, checksum = _ENTRY_FIELDS.unpack(fields)
        if magic != _ENTRY_MAGIC or not 1 <= key_len <= 128:
            break
        out.append(Entry(seq, record, bool(flags & FLAG_DELETED), key[:key_len], checksum))
    return out


@dataclass(slots=True)
class NamespaceDir:
    """What replaying one namespace directory found, for one record size."""

    path: Path
    record_bytes: int
    #: slab number -> records its data file can hold (from its size)
    slabs: dict[int, int] = field(default_factory=dict)
    #: live records, oldest write first: (slab, record) -> (key, seq, checksum)
    live: dict[tuple[int, int], tuple[bytes, int, int]] = field(default_factory=dict)
    #: entries in each slab's log, live or not (to decide on compaction)
    log_entries: dict[int, int] = field(default_factory=dict)
    max_seq: int = 0
    removed_temporaries: int = 0


def slab_path(directory: Path, record_bytes: int, slab: int, kind: str) -> Path:
    return directory / f"slab-{record_bytes}-{slab:06d}.{kind}"


def replay(directory: Path, record_bytes: int) -> NamespaceDir:
    """Rebuild the index of one namespace directory from its logs; reads no payload.

    Removes temporary files left by a crash. Entries pointing past the end of
    their data file (truncated, or missing) are dropped.
    """
    found = NamespaceDir(directory, record_bytes)
    for entry in os.scandir(directory):
        if entry.name.endswith(".tmp"):
            os.unlink(entry.path)
            found.removed_temporaries += 1
            continue
        match = SLAB_RE.match(entry.name)
        if match and int(match[1]) == record_bytes and match[3] == "kvs":
            found.slabs[int(match[2])] = entry.stat().st_size // record_bytes
    latest: dict[tuple[int, int], Entry] = {}
    for slab in sorted(found.slabs):
        try:
            data = slab_path(directory, record_bytes, slab, "idx").read_bytes()
        except FileNotFoundError:
            continue
        entries = decode_entries(data)
        found.log_entries[slab] = len(entries)
        for e in entries:
            found.max_seq = max(found.max_seq, e.seq)
            if e.record >= found.slabs[slab]:
                continue  # the data file is shorter than this record: it is gone
            old = latest.get((slab, e.record))
            if old is None or e.seq > old.seq:
                latest[(slab, e.record)] = e
    # A key written twice (in two records) keeps its newest record.
    newest_of_key: dict[bytes, tuple[int, int]] = {}
    for where, e in sorted(latest.items(), key=lambda item: item[1].seq):
        previous = newest_of_key.pop(e.key, None)
        if previous is not None:
            del found.live[previous]
        if e.deleted:
            continue
        newest_of_key[e.key] = where
        found.live[where] = (e.key, e.seq, e.checksum)
    return found


def compact_log(path: Path, *, fsync: bool = False) -> int:
    """Rewrite a log with only the latest entry per record, dropping deletions; returns entries.

    Writes a temporary file and renames it over the log, so a crash leaves
    either log whole. The caller keeps other writers of this log out meanwhile.
    """
    latest: dict[int, Entry] = {}
    for e in decode_entries(path.read_bytes()):
        if e.record not in latest or e.seq > latest[e.record].seq:
            latest[e.record] = e
    keep = sorted((e for e in latest.values() if not e.deleted), key=lambda e: e.seq)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, FILE_MODE)
    try:
        os.write(fd, b"".join(encode_entry(e.seq, e.record, e.key, e.checksum) for e in keep))
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return len(keep)


def make_private_dir(path: Path) -> None:
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)


def is_out_of_space(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)
