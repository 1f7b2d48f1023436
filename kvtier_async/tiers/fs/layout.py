"""On-disk layout of the file-system tier (format 2): slab files of bare records plus index logs.

    ROOT/kvtier-<namespace id hex>/            0700, one per namespace, shared by processes
        FORMAT                                 "kvtier-fs 2": the layout version
        NAMESPACE                              the namespace's name (for `kvtier fs stat`)
        slab-<block bytes>-<n>.kvs             0600: records of one block size, nothing else
        slab-<block bytes>-<n>.idx             0600: append-only log of what each record holds

A record is a block's payload padded to a multiple of 4096, at offset
`i * record_bytes` of its slab: records and primary slots are both page
aligned, so O_DIRECT moves a run of neighbouring records to or from
neighbouring slots in one piece. Packing records into a few files avoids a
file creation per block, which this class of disk cannot do faster than a
few thousand times a second.

What a record holds lives only in its slab's log: fixed-size, checksummed
entries (key, payload checksum, or a deletion), the last entry for a record
wins. A writer appends an entry only after the record's bytes are written,
and appends a deletion before it overwrites a record that held something, so
a reader never takes a record's bytes for more than the entry says, and a
reader always checks the payload against the entry's checksum: a torn write,
a stale entry or a record being rewritten reads as a miss, never as wrong
bytes. A torn last entry (a writer killed mid-append) ends the log.

Several processes share a namespace. Each slab has one writer at a time: the
process holding an exclusive `flock` on its data file (released by the kernel
when that process exits, however it exits). Anyone reads any slab, following
its log. Slab numbers run below the namespace's capacity in slabs, so the
capacity bound holds for every process together.

Format 1 (kvtier_async before this layout) put a 4096-byte header before
every payload and had one process lock the whole directory; `prepare_directory`
removes such a cache when no format-1 process holds it, and refuses otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import re
import stat
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from ...errors import ConfigError, KVTierError, NamespaceInUseError

__all__ = [
    "ENTRY",
    "FORMAT_VERSION",
    "Entry",
    "NamespaceDir",
    "compact_log",
    "decode_entries",
    "encode_entry",
    "namespace_dir_name",
    "prepare_directory",
    "read_log",
    "record_bytes_for",
    "replay",
    "rewrite_log",
]

log = logging.getLogger(__name__)

ALIGN = 4096
DIR_MODE = 0o700
FILE_MODE = 0o600
FORMAT_VERSION = 2
FORMAT_TEXT = f"kvtier-fs {FORMAT_VERSION}\n"
_ENTRY_FIELDS = struct.Struct("<IQIBB128sQ")  # magic, seq, record, flags, key_len, key, checksum
ENTRY = _ENTRY_FIELDS.size + 8  # fields + their XXH3-64
_ENTRY_MAGIC = 0x4B565432  # "KVT2"
#: Flags for every open of a namespace directory's files: a symlink is never followed, a FIFO
#: planted under a file's name never hangs the open.
NO_FOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: What a sealed namespace's NAMESPACE file says: its name is not written in clear, and its
#: index entries' checksums are of sealed values (`block_format.sealed_fingerprint`).
SEALED_NAMESPACE_LABEL = "(sealed: the name is known only with the secret)"
_LOG_READ_BYTES = (1 << 20) // ENTRY * ENTRY
#: A log is read no further than this (a slab's records, each logged a few times over, fit
#: many times; a sparse file planted to look huge is not read whole into memory).
MAX_LOG_BYTES = 256 << 20
FLAG_DELETED = 1
SLAB_RE = re.compile(r"^slab-(\d+)-(\d+)\.(kvs|idx)$")


def namespace_dir_name(namespace_tag: bytes) -> str:
    """The directory of a namespace, by its tag (`block_format.BlockCodec.namespace_tag`)."""
    return "kvtier-" + namespace_tag.hex()


def record_bytes_for(block_nbytes: int) -> int:
    return -(-block_nbytes // ALIGN) * ALIGN


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


def read_log(path: Path, offset: int = 0) -> tuple[list[Entry], int, int]:
    """(whole entries from `offset`, the offset after the last of them, the log's inode).

    An entry being appended right now, or torn by a writer that died, stops the
    read; a later read from the returned offset picks up what follows.
    """
    fd = open_private_file(path)
    entries: list[Entry] = []
    try:
        inode = os.fstat(fd).st_ino
        position = offset
        # Whole entries a read; the first entry that does not check out ends the log, so a
        # damaged or planted (sparse, huge) file costs one read, not its size in memory.
        while position < MAX_LOG_BYTES and (chunk := os.pread(fd, _LOG_READ_BYTES, position)):
            got = decode_entries(chunk)
            entries += got
            position += len(got) * ENTRY
            if len(got) * ENTRY < _LOG_READ_BYTES:
                break
    finally:
        os.close(fd)
    return entries, offset + len(entries) * ENTRY, inode


def latest_per_record(entries: list[Entry]) -> dict[int, Entry]:
    """The last entry for each record, in log order (a later entry always wins)."""
    latest: dict[int, Entry] = {}
    for e in entries:
        latest.pop(e.record, None)  # re-insert: the dict's order is the order of the last writes
        latest[e.record] = e
    return latest


@dataclass(slots=True)
class NamespaceDir:
    """What replaying one namespace directory found, for one block size."""

    path: Path
    block_nbytes: int
    #: slab number -> records its data file holds bytes for (from its size)
    slabs: dict[int, int] = field(default_factory=dict)
    #: live records, oldest write first: (slab, record) -> (key, seq, checksum)
    live: dict[tuple[int, int], tuple[bytes, int, int]] = field(default_factory=dict)
    max_seq: int = 0


def slab_path(directory: Path, block_nbytes: int, slab: int, kind: str) -> Path:
    return directory / f"slab-{block_nbytes}-{slab:06d}.{kind}"


def slab_numbers(directory: Path, block_nbytes: int) -> list[int]:
    """Slabs of this block size that have a data file."""
    numbers = []
    for name in os.listdir(directory):
        match = SLAB_RE.match(name)
        if match and int(match[1]) == block_nbytes and match[3] == "kvs":
            numbers.append(int(match[2]))
    return sorted(numbers)


def replay(directory: Path, block_nbytes: int) -> NamespaceDir:
    """The index of one namespace directory, from its logs; reads no payload and changes nothing,
    so it is safe while processes use the directory."""
    found = NamespaceDir(directory, block_nbytes)
    record_bytes = record_bytes_for(block_nbytes)
    latest: list[tuple[int, int, Entry]] = []
    for slab in slab_numbers(directory, block_nbytes):
        try:
            size = os.stat(slab_path(directory, block_nbytes, slab, "kvs")).st_size
            entries, _, _ = read_log(slab_path(directory, block_nbytes, slab, "idx"))
        except FileNotFoundError:
            continue  # removed meanwhile, or a log not made yet
        found.slabs[slab] = size // record_bytes
        for e in entries:
            found.max_seq = max(found.max_seq, e.seq)
        latest += [(slab, record, e) for record, e in latest_per_record(entries).items()]
    # Oldest first; a key found in two records (two processes stored it) keeps its newest.
    newest_of_key: dict[bytes, tuple[int, int]] = {}
    for slab, record, e in sorted(latest, key=lambda item: item[2].seq):
        if e.deleted or record >= found.slabs[slab]:
            continue
        previous = newest_of_key.pop(e.key, None)
        if previous is not None:
            del found.live[previous]
        newest_of_key[e.key] = (slab, record)
        found.live[(slab, record)] = (e.key, e.seq, e.checksum)
    return found


def compact_log(path: Path, *, fsync: bool = False) -> int:
    """Rewrite a log with only the latest entry per record, dropping deletions; returns entries.

    Writes a temporary file and renames it over the log, so a crash leaves
    either log whole; readers following the log see a new inode and read it
    again from the start. The caller is the slab's one writer.
    """
    entries, fd = rewrite_log(path, fsync=fsync)
    os.close(fd)
    return entries


def rewrite_log(path: Path, *, fsync: bool = False) -> tuple[int, int]:
    """`compact_log`, returning also a descriptor open for appending to the new log (the caller
    closes it): a writer keeps that one rather than open the path again, which by then may
    name nothing (a root removed by hand) or another file, and would leave it without a log."""
    entries, _, _ = read_log(path)
    keep = [e for e in latest_per_record(entries).values() if not e.deleted]
    tmp = path.with_name(path.name + ".tmp")
    data = b"".join(encode_entry(e.seq, e.record, e.key, e.checksum) for e in keep)
    tmp.unlink(missing_ok=True)  # a crashed compaction's, or a planted link: removed, never followed
    try:
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, FILE_MODE)
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, "short write of a compacted log")
            if fsync:
                os.fsync(fd)
            os.replace(tmp, path)
        except BaseException:
            os.close(fd)
            raise
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk: the old log stands
        raise
    return len(keep), fd


def append_to_log(path: Path, data: bytes) -> None:
    """Append whole entries to a log another process may be writing: one O_APPEND write, which
    never interleaves with that writer's own appends."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | NO_FOLLOW)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def try_flock(fd: int) -> bool:
    """Take an exclusive flock on `fd` without waiting; False if another open file holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def slab_is_owned(directory: Path, block_nbytes: int, slab: int) -> bool:
    """Whether a process holds this slab as its writer right now."""
    try:
        fd = os.open(slab_path(directory, block_nbytes, slab, "kvs"), os.O_RDONLY | NO_FOLLOW)
    except FileNotFoundError:
        return False
    try:
        return not try_flock(fd)
    finally:
        os.close(fd)  # closing drops a lock we took


@contextmanager
def directory_lock(directory: Path) -> Iterator[None]:
    """Serialise set-up and maintenance of one namespace directory among processes."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held for milliseconds: waiting is fine
        yield
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text`, through a temporary file made anew (O_EXCL, O_NOFOLLOW): a
    symlink planted under the temporary name is never followed, written or truncated."""
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # ours, left by a crash (unlink removes a link, not its target)
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


_foreign_lock = threading.Lock()
_foreign_skipped = 0


def foreign_files_skipped() -> int:
    """Files skipped as foreign (`ForeignFile`) by this process, every root and namespace together."""
    return _foreign_skipped


def _skip_foreign(path: Path, what: str) -> ForeignFile:
    global _foreign_skipped
    with _foreign_lock:  # worker threads skip files at once
        _foreign_skipped += 1
    log.warning("fs tier: skipped %r, %s", str(path), what)
    return ForeignFile(errno.ENOENT, f"{what}, skipped")


class ForeignFile(FileNotFoundError):
    """A name in a namespace directory that is not a regular file of ours (a symlink, a FIFO,
    another user's file: planted). Read as absent, like a file removed meanwhile, so every
    reader skips it; logged."""


def open_private_file(path: Path, flags: int = os.O_RDONLY) -> int:
    """Open a file of a namespace directory without following a symlink or hanging on a FIFO;
    `FileNotFoundError` where it is absent, `ForeignFile` unless it is a regular file of ours."""
    try:
        fd = os.open(path, flags | NO_FOLLOW)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise _skip_foreign(path, "a symlink where a file of ours belongs") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise _skip_foreign(path, "not a regular file of this user")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(path: Path, limit: int = 4096) -> str | None:
    """A small text file of the directory (None: absent), read within `limit` bytes."""
    try:
        fd = open_private_file(path)
    except FileNotFoundError:
        return None
    try:
        return os.read(fd, limit).decode(errors="replace")
    finally:
        os.close(fd)


def check_root(root: Path) -> None:
    """Make `root` (0700) if missing; refuse one another user owns or others may write to, where
    they could plant or swap what we read (`ConfigError`)."""
    make_private_dir(root)
    info = os.stat(root)  # the operator's path: a symlink to it is the operator's choice
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"fs tier: the root {root} is not a directory")
    if info.st_uid != os.geteuid():
        raise ConfigError(
            f"fs tier: the root {root} belongs to uid {info.st_uid}, not this user ({os.geteuid()}); "
            "another user could swap its files: use a directory of your own"
        )
    if info.st_mode & 0o022:
        raise ConfigError(
            f"fs tier: the root {root} may be written by group or others (mode "
            f"{stat.S_IMODE(info.st_mode):o}); chmod 700 it or use a private directory"
        )


def check_namespace_dir(directory: Path) -> None:
    """Make the namespace directory (0700) if missing; refuse a symlink or another user's, and
    make ours 0700 through a descriptor (never following a link)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, DIR_MODE)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(
            f"fs tier: {directory} is not a plain directory (a symlink?): {exc.strerror}"
        ) from None
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            raise ConfigError(f"fs tier: {directory} belongs to another user")
        os.fchmod(fd, DIR_MODE)
    finally:
        os.close(fd)


def prepare_directory(root: Path, directory: Path, namespace: str) -> None:
    """Make (or check) a namespace directory of this format; a format-1 cache is removed when no
    process of that version holds it, and any other format is refused, never misread."""
    check_root(root)
    check_namespace_dir(directory)
    with directory_lock(directory):
        format_file = directory / "FORMAT"
        text = read_small(format_file)
        if text is not None and text != FORMAT_TEXT:
            raise KVTierError(
                f"fs tier: {directory} holds a cache in another format ({text.strip()!r}; this "
                f"kvtier_async reads {FORMAT_TEXT.strip()!r}): use another root, or remove that "
                "directory if no other version uses it"
            )
        if text is None:
            _remove_format_1(directory)
            _write_atomically(format_file, FORMAT_TEXT)
        if read_small(directory / "NAMESPACE") is None:
            _write_atomically(directory / "NAMESPACE", namespace + "\n")


def _remove_format_1(directory: Path) -> None:
    """Drop a format-1 cache (headers before payloads, one LOCK-holding process): it is a cache, so
    it is rebuilt as blocks are stored. Refused while a format-1 process still holds it."""
    old = [p for p in directory.iterdir() if SLAB_RE.match(p.name) or p.name == "LOCK"]
    if not old:
        return
    lock = directory / "LOCK"
    if lock.exists():
        fd = os.open(lock, os.O_RDWR | NO_FOLLOW)
        try:
            if not try_flock(fd):
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "an unknown process"
                raise NamespaceInUseError(
                    f"fs tier: {directory} holds a format-1 cache in use by {holder} (an older "
                    "kvtier_async); stop it, or give this process another root"
                )
        finally:
            os.close(fd)
    for path in old:
        path.unlink(missing_ok=True)
    log.warning(
        "fs tier: removed a format-1 cache from %s (%d files); it refills as blocks are stored",
        directory,
        len(old),
    )


_libc = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None


def reserve_log_room(fd: int, nbytes: int) -> None:
    """Reserve disk blocks past the end of a log, so that appends find room on a full disk.

    fallocate(FALLOC_FL_KEEP_SIZE) keeps the file's size; where the file system
    cannot, appends take their chances.
    """
    if _libc is None:
        return
    keep_size = 1  # FALLOC_FL_KEEP_SIZE
    while nbytes >= ALIGN:  # a nearly full disk gets what room there is
        if _libc.fallocate(fd, keep_size, ctypes.c_long(0), ctypes.c_long(nbytes)) == 0:
            return
        err = ctypes.get_errno()
        if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return
        if err != errno.ENOSPC:
            raise OSError(err, os.strerror(err))
        nbytes //= 4


def allocate(fd: int, offset: int, length: int) -> bool:
    """fallocate(2) `length` bytes at `offset` (the file grows to cover them); False where the
    file system cannot (never glibc's emulation, which writes every block). Raises ENOSPC."""
    if _libc is None:
        return False
    if _libc.fallocate(fd, 0, ctypes.c_long(offset), ctypes.c_long(length)) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


def make_private_dir(path: Path) -> None:
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)


def is_out_of_space(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)
