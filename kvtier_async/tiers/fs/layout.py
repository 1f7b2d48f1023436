"""On-disk layout of the file-system tier (format 3): slab files of bare records plus index logs.

    ROOT/kvtier-<namespace id hex>/            0700, one per namespace, shared by processes
        FORMAT                                 "kvtier-fs 3 plain" or "kvtier-fs 3 sealed <hex>":
                                               the layout version and the records' kind
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

Format 2 is format 3 without the kind (`DirFormat`): still read and written, its sealed records
bound to their keys as they were written. Every file of a directory is reached through its
descriptor (`Folder`, `At`) and opened by `open_private_file`, so nothing planted or swapped in
it is followed.

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
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from ...errors import ConfigError, KVTierError, NamespaceInUseError

__all__ = [
    "ENTRY",
    "FORMAT_VERSION",
    "At",
    "DirFormat",
    "Entry",
    "Folder",
    "NamespaceDir",
    "compact_log",
    "decode_entries",
    "encode_entry",
    "namespace_dir_name",
    "open_namespace_dir",
    "open_private_file",
    "open_root",
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
FORMAT_VERSION = 3
#: What a FORMAT file of each version this kvtier_async reads says: format 2 (slabs and logs as
#: now, nothing recorded of its records' kind) and format 3 (the same files, and the kind: plain,
#: or sealed with the namespace's name sealed under the secret, for `kvtier fs verify`).
_FORMAT_RE = re.compile(r"kvtier-fs (2)\n|kvtier-fs (3) (plain|sealed [0-9a-f]{2,1024})\n")
_ENTRY_FIELDS = struct.Struct("<IQIBB128sQ")  # magic, seq, record, flags, key_len, key, checksum
ENTRY = _ENTRY_FIELDS.size + 8  # fields + their XXH3-64
_ENTRY_MAGIC = 0x4B565432  # "KVT2"
#: Flags for every open of a namespace directory's files: a symlink is never followed, a FIFO
#: planted under a file's name never hangs the open.
NO_FOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: What a sealed namespace's NAMESPACE file says: its name is not written in clear. Display
#: text only: whether records are sealed is the FORMAT file's field (`DirFormat`).
SEALED_NAMESPACE_LABEL = "(sealed: the name is known only with the secret)"
#: The key a sealed namespace's name is sealed under in its FORMAT file.
_NAME_KEY = b"kvtier-fs namespace name"
_LOG_READ_BYTES = (1 << 20) // ENTRY * ENTRY
#: A log is read no further than this (a slab's records, each logged a few times over, fit
#: many times; a sparse file planted to look huge is not read whole into memory).
MAX_LOG_BYTES = 256 << 20
FLAG_DELETED = 1
#: An index entry's sequence number is its write time cut to this grain (about a second), then
#: counted up by its writer: processes order slabs by age to that grain (adoption, `kvtier fs
#: gc`), and a log read without the secret tells no finer when each block was written.
SEQ_GRAIN_NS = 1 << 30
SLAB_RE = re.compile(r"^slab-(\d+)-(\d+)\.(kvs|idx)$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Folder:
    """A directory held open: every name in it is opened, listed, renamed and removed relative
    to this descriptor (openat), never through the directory's path again, so a directory
    swapped for a symlink after it was opened is never followed. `path` is for messages."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def open(cls, path: Path) -> Folder:
        """The directory at `path` (a symlink at its last component is refused: `OSError`)."""
        return cls(os.open(path, _DIR_FLAGS), path)

    def __truediv__(self, name: str) -> At:
        return At(self, name)

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def removed(self) -> bool:
        """Whether the directory was removed (rmdir'd) since it was opened."""
        return os.fstat(self.fd).st_nlink == 0

    def free_bytes(self) -> int:
        st = os.fstatvfs(self.fd)
        return st.f_bavail * st.f_frsize

    def fsync(self) -> None:
        os.fsync(self.fd)

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Serialise set-up and maintenance of this directory among processes (an open file of
        its own: a flock on `fd` would not exclude this process's other threads)."""
        fd = os.open(".", _DIR_FLAGS, dir_fd=self.fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for milliseconds: waiting is fine
            yield
        finally:
            os.close(fd)


@dataclass(frozen=True, slots=True)
class At:
    """A name in a `Folder`: what a `Path` is to the tier's files, resolved through the
    folder's descriptor."""

    folder: Folder
    name: str

    def __str__(self) -> str:
        return str(self.folder.path / self.name)

    def with_name(self, name: str) -> At:
        return At(self.folder, name)

    def open(self, flags: int = os.O_RDONLY, mode: int = FILE_MODE) -> int:
        """`open_private_file` of this name."""
        return open_private_file(self, flags, mode)

    def stat(self) -> os.stat_result:
        """The name's own status (a symlink's, not its target's)."""
        return os.stat(self.name, dir_fd=self.folder.fd, follow_symlinks=False)

    def exists(self) -> bool:
        try:
            self.stat()
        except FileNotFoundError:
            return False
        return True

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            os.unlink(self.name, dir_fd=self.folder.fd)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def replace(self, target: At) -> None:
        os.replace(self.name, target.name, src_dir_fd=self.folder.fd, dst_dir_fd=target.folder.fd)


@dataclass(frozen=True, slots=True)
class DirFormat:
    """What a namespace directory's FORMAT file says."""

    version: int  # 2 or 3
    #: "plain" or "sealed"; None in format 2, which did not record it (either may be there).
    kind: str | None = None
    #: Format 3, sealed: the namespace's name sealed under the secret (`open_namespace_name`).
    sealed_name: bytes = b""

    @classmethod
    def parse(cls, text: str) -> DirFormat | None:
        match = _FORMAT_RE.fullmatch(text)
        if match is None:
            return None
        if match[1]:
            return cls(2)
        kind, _, name = match[3].partition(" ")
        return cls(3, kind, bytes.fromhex(name) if len(name) % 2 == 0 else b"")

    @property
    def records_bound_to_names(self) -> bool:
        """Whether sealed records are bound to their index names (format 3), which `kvtier fs
        verify` can check with the secret alone, or to their keys (format 2), which it cannot."""
        return self.version >= 3


def format_text(kind: str, version: int = FORMAT_VERSION) -> str:
    """The FORMAT file of a new directory: `kind` "plain" or "sealed <hex sealed name>"
    (version 2, which records no kind: only to make again a directory of that format)."""
    return "kvtier-fs 2\n" if version == 2 else f"kvtier-fs {version} {kind}\n"


def seal_namespace_name(secret: bytes, namespace: str) -> str:
    """A sealed namespace's FORMAT kind: its name sealed under the secret (hex)."""
    from ...block_format import BlockSealer

    name = namespace.encode()
    sealer = BlockSealer(secret, "")
    value = bytearray(sealer.value_nbytes(len(name)))
    sealer.seal_into(memoryview(value), memoryview(name), _NAME_KEY)
    return "sealed " + value.hex()


def open_namespace_name(secret: bytes, sealed_name: bytes) -> str | None:
    """The namespace name a FORMAT file holds sealed; None unless it opens under `secret`."""
    from ...block_format import SEAL_OVERHEAD, BlockSealer

    if len(sealed_name) <= SEAL_OVERHEAD:
        return None
    name = bytearray(len(sealed_name) - SEAL_OVERHEAD)
    if not BlockSealer(secret, "").open_into(memoryview(name), memoryview(sealed_name), _NAME_KEY):
        return None
    return name.decode(errors="replace")


def coarse_time_ns() -> int:
    """The wall clock cut to `SEQ_GRAIN_NS`: what a sequence number starts from."""
    return time.time_ns() // SEQ_GRAIN_NS * SEQ_GRAIN_NS


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


def read_log(
    path: At, offset: int = 0, max_entries: int = MAX_LOG_BYTES // ENTRY
) -> tuple[list[Entry], int, int]:
    """(whole entries from `offset`, at most `max_entries`; the offset after the last of them;
    the log's inode).

    An entry being appended right now, or torn by a writer that died, stops the
    read; a later read from the returned offset picks up what follows.
    """
    fd = open_private_file(path)
    entries: list[Entry] = []
    try:
        inode = os.fstat(fd).st_ino
        position = offset
        end = offset + min(max_entries * ENTRY, MAX_LOG_BYTES)
        # Whole entries a read; the first entry that does not check out ends the log, so a
        # damaged or planted (sparse, huge) file costs one read, not its size in memory.
        while position < end and (chunk := os.pread(fd, min(_LOG_READ_BYTES, end - position), position)):
            got = decode_entries(chunk)
            entries += got
            position += len(got) * ENTRY
            if len(got) * ENTRY < len(chunk) or len(chunk) < _LOG_READ_BYTES:
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

    folder: Folder
    block_nbytes: int
    #: slab number -> records its data file holds bytes for (from its size)
    slabs: dict[int, int] = field(default_factory=dict)
    #: live records, oldest write first: (slab, record) -> (key, seq, checksum)
    live: dict[tuple[int, int], tuple[bytes, int, int]] = field(default_factory=dict)
    max_seq: int = 0


def slab_path(folder: Folder, block_nbytes: int, slab: int, kind: str) -> At:
    return folder / f"slab-{block_nbytes}-{slab:06d}.{kind}"


def slab_numbers(folder: Folder, block_nbytes: int) -> list[int]:
    """Slabs of this block size that have a data file."""
    numbers = []
    for name in folder.names():
        match = SLAB_RE.match(name)
        if match and int(match[1]) == block_nbytes and match[3] == "kvs":
            numbers.append(int(match[2]))
    return sorted(numbers)


def skip_linked_log(path: At, seen: set[int], inode: int | None = None) -> bool:
    """Whether the log at `path` (its inode, if known) is one already read under another slab's
    name (a hard link: planted, never made by a writer, so its entries are read once, not once
    per name); counts it as foreign. Adds its inode to `seen` otherwise."""
    if inode is None:
        try:
            inode = path.stat().st_ino
        except FileNotFoundError:
            return False  # the reader finds out
    if inode in seen:
        _skip_foreign(path, "a second name of a log already read (a hard link)")
        return True
    seen.add(inode)
    return False


def replay(folder: Folder, block_nbytes: int) -> NamespaceDir:
    """The index of one namespace directory, from its logs; reads no payload and changes nothing,
    so it is safe while processes use the directory."""
    found = NamespaceDir(folder, block_nbytes)
    record_bytes = record_bytes_for(block_nbytes)
    latest: list[tuple[int, int, Entry]] = []
    logs_seen: set[int] = set()
    for slab in slab_numbers(folder, block_nbytes):
        log_path = slab_path(folder, block_nbytes, slab, "idx")
        if skip_linked_log(log_path, logs_seen):
            continue
        try:
            fd = open_private_file(slab_path(folder, block_nbytes, slab, "kvs"))
            try:
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            entries, _, _ = read_log(log_path)
        except FileNotFoundError:
            continue  # removed meanwhile, a log not made yet, or not ours
        found.slabs[slab] = size // record_bytes
        for e in entries:
            found.max_seq = max(found.max_seq, e.seq)
        latest += [
            (slab, record, e)
            for record, e in latest_per_record(entries).items()
            if record < found.slabs[slab] and not e.deleted
        ]
    # Oldest first; a key found in two records (two processes stored it) keeps its newest.
    newest_of_key: dict[bytes, tuple[int, int]] = {}
    for slab, record, e in sorted(latest, key=lambda item: item[2].seq):
        previous = newest_of_key.pop(e.key, None)
        if previous is not None:
            del found.live[previous]
        newest_of_key[e.key] = (slab, record)
        found.live[(slab, record)] = (e.key, e.seq, e.checksum)
    return found


def compact_log(path: At, *, fsync: bool = False) -> int:
    """Rewrite a log with only the latest entry per record, dropping deletions; returns entries.

    Writes a temporary file and renames it over the log, so a crash leaves
    either log whole; readers following the log see a new inode and read it
    again from the start. The caller is the slab's one writer.
    """
    entries, fd = rewrite_log(path, fsync=fsync)
    os.close(fd)
    return entries


def rewrite_log(path: At, *, fsync: bool = False) -> tuple[int, int]:
    """`compact_log`, returning also a descriptor open for appending to the new log (the caller
    closes it): a writer keeps that one rather than open the path again, which by then may
    name nothing (a root removed by hand) or another file, and would leave it without a log."""
    entries, _, _ = read_log(path)
    keep = [e for e in latest_per_record(entries).values() if not e.deleted]
    tmp = path.with_name(path.name + ".tmp")
    data = b"".join(encode_entry(e.seq, e.record, e.key, e.checksum) for e in keep)
    tmp.unlink(missing_ok=True)  # a crashed compaction's, or a planted link: removed, never followed
    try:
        fd = tmp.open(os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_APPEND)
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, "short write of a compacted log")
            if fsync:
                os.fsync(fd)
            tmp.replace(path)
        except BaseException:
            os.close(fd)
            raise
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk: the old log stands
        raise
    return len(keep), fd


def append_to_log(path: At, data: bytes) -> None:
    """Append whole entries to a log another process may be writing: one O_APPEND write, which
    never interleaves with that writer's own appends."""
    fd = path.open(os.O_WRONLY | os.O_APPEND)
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


def slab_is_owned(folder: Folder, block_nbytes: int, slab: int) -> bool:
    """Whether a process holds this slab as its writer right now."""
    try:
        fd = slab_path(folder, block_nbytes, slab, "kvs").open()
    except FileNotFoundError:
        return False
    try:
        return not try_flock(fd)
    finally:
        os.close(fd)  # closing drops a lock we took


def _write_atomically(path: At, text: str) -> None:
    """Replace `path` with `text`, through a temporary file made anew (O_EXCL, O_NOFOLLOW): a
    symlink planted under the temporary name is never followed, written or truncated."""
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # ours, left by a crash (unlink removes a link, not its target)
    fd = tmp.open(os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


_foreign_lock = threading.Lock()
_foreign_skipped = 0
#: The names already skipped (counted and logged once each; forgotten past a bound).
_foreign_seen: set[str] = set()
_FOREIGN_SEEN_MAX = 4096


def foreign_files_skipped() -> int:
    """Files skipped as foreign (`ForeignFile`) by this process, every root and namespace together;
    a name skipped again and again (a planted slab, met on every refresh) counts once."""
    return _foreign_skipped


def _skip_foreign(path: At, what: str) -> ForeignFile:
    global _foreign_skipped
    name = str(path)
    with _foreign_lock:  # worker threads skip files at once
        first = name not in _foreign_seen
        if first:
            if len(_foreign_seen) >= _FOREIGN_SEEN_MAX:
                _foreign_seen.clear()
            _foreign_seen.add(name)
            _foreign_skipped += 1
    if first:
        log.warning("fs tier: skipped %r, %s", name, what)
    return ForeignFile(errno.ENOENT, f"{what}, skipped")


class ForeignFile(FileNotFoundError):
    """A name in a namespace directory that is not a regular file of ours (a symlink, a FIFO,
    another user's file, one others may write: planted). Read as absent, like a file removed
    meanwhile, so every reader skips it; counted and logged."""


#: What an open says of a name that is no file of ours: a symlink (ELOOP, with O_NOFOLLOW), a
#: FIFO or socket without a reader (ENXIO), a FIFO refusing O_DIRECT (EINVAL).
_FOREIGN_ERRNOS = frozenset({errno.ELOOP, errno.ENXIO, errno.EINVAL})


def open_private_file(path: At, flags: int = os.O_RDONLY, mode: int = FILE_MODE) -> int:
    """Open (or, with O_CREAT, make) a file of a namespace directory: relative to the directory's
    descriptor, without following a symlink or hanging on a FIFO. `FileNotFoundError` where it is
    absent, `ForeignFile` unless it is a regular file of this user that nobody else may write.
    Every file the tier and `kvtier fs` open goes through here."""
    try:
        fd = os.open(path.name, flags | NO_FOLLOW, mode, dir_fd=path.folder.fd)
    except OSError as exc:
        if exc.errno not in _FOREIGN_ERRNOS:
            raise
        raise _skip_foreign(path, f"not a file of ours ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
            raise _skip_foreign(path, "not a regular file of this user that only it may write")
    except BaseException:
        os.close(fd)
        raise
    return fd


def refuse_second_name(fd: int, path: At) -> None:
    """`ForeignFile` if the file open at `fd` has another name too (a hard link: our files never
    do), for a writer about to change it."""
    if os.fstat(fd).st_nlink > 1:
        raise _skip_foreign(path, "a file with a second name (a hard link)")


def read_small(path: At, limit: int = 4096) -> str | None:
    """A small text file of the directory (None: absent), read within `limit` bytes."""
    try:
        fd = open_private_file(path)
    except FileNotFoundError:
        return None
    try:
        return os.read(fd, limit).decode(errors="replace")
    finally:
        os.close(fd)


def open_root(root: Path, *, create: bool) -> Folder:
    """The root, held open: made (0700) if missing and `create`; refused (`ConfigError`) unless
    it is a directory of this user that nobody else may write, where others could plant or swap
    what we read. Checked through the descriptor we keep, so what is checked is what is used."""
    if create:
        # A file where the root or a folder above it should be: refused just below.
        with contextlib.suppress(FileExistsError, NotADirectoryError):
            make_private_dir(root)
    try:
        # The operator's path: a symlink to the root is the operator's choice.
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"fs tier: the root {root} is not a directory: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
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
    except BaseException:
        os.close(fd)
        raise
    return Folder(fd, root)


def open_namespace_dir(root: Folder, name: str, *, create: bool) -> Folder:
    """A namespace directory of `root`, held open (made 0700 if missing and `create`); a symlink
    or another user's is refused (`ConfigError`); ours is made 0700 through its descriptor."""
    path = root.path / name
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, DIR_MODE, dir_fd=root.fd)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=root.fd)
    except OSError as exc:
        raise ConfigError(f"fs tier: {path} is not a plain directory (a symlink?): {exc.strerror}") from None
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            raise ConfigError(f"fs tier: {path} belongs to another user")
        os.fchmod(fd, DIR_MODE)
    except BaseException:
        os.close(fd)
        raise
    return Folder(fd, path)


def prepare_directory(root: Path, name: str, namespace: str, new_format: str) -> tuple[Folder, DirFormat]:
    """Make (or check) a namespace directory, held open, and what its FORMAT says. A new one's
    FORMAT is `new_format` (`format_text`); a format-1 cache is removed when no process of that
    version holds it; a cache of another format, or of the other kind, is refused, never
    misread."""
    ours = DirFormat.parse(new_format)
    if ours is None:
        raise ValueError(f"prepare_directory: {new_format!r} is no format of ours")
    with open_root(root, create=True) as root_folder:
        folder = open_namespace_dir(root_folder, name, create=True)
    try:
        with folder.lock():
            format_file = folder / "FORMAT"
            text = read_small(format_file)
            if text is None:
                _remove_format_1(folder)
                text = new_format
                _write_atomically(format_file, text)
            found = DirFormat.parse(text)
            if found is None:
                raise KVTierError(
                    f"fs tier: {folder.path} holds a cache in another format ({text.strip()[:40]!r}; "
                    f"this kvtier_async reads formats 2 and {FORMAT_VERSION}): use another root, or "
                    "remove that directory if no other version uses it"
                )
            if found.kind not in (None, ours.kind):
                raise KVTierError(
                    f"fs tier: {folder.path} holds {found.kind} records, and this tier's are not: "
                    "use another root, or remove that directory"
                )
            if read_small(folder / "NAMESPACE") is None:
                _write_atomically(folder / "NAMESPACE", namespace + "\n")
    except BaseException:
        folder.close()
        raise
    return folder, found


def _remove_format_1(folder: Folder) -> None:
    """Drop a format-1 cache (headers before payloads, one LOCK-holding process): it is a cache, so
    it is rebuilt as blocks are stored. Refused while a format-1 process still holds it."""
    old = [folder / n for n in folder.names() if SLAB_RE.match(n) or n == "LOCK"]
    if not old:
        return
    lock = folder / "LOCK"
    try:
        fd = lock.open(os.O_RDWR)
    except FileNotFoundError:
        fd = -1
    if fd >= 0:
        try:
            if not try_flock(fd):
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "an unknown process"
                raise NamespaceInUseError(
                    f"fs tier: {folder.path} holds a format-1 cache in use by {holder} (an older "
                    "kvtier_async); stop it, or give this process another root"
                )
        finally:
            os.close(fd)
    for path in old:
        path.unlink(missing_ok=True)
    log.warning(
        "fs tier: removed a format-1 cache from %s (%d files); it refills as blocks are stored",
        folder.path,
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
