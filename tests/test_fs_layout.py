"""Logic of the on-disk index: entry encoding, torn tails, replay rules. No tier involved."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier_async.block_format import (
    HEADER_BYTES,
    CorruptBlockError,
    namespace_id,
    pack_header,
    verify_header,
)
from kvtier_async.tiers.fs import layout
from kvtier_async.tiers.fs.layout import (
    ENTRY,
    Folder,
    NamespaceDir,
    compact_log,
    decode_entries,
    encode_entry,
    slab_path,
)

RECORD = 8192


def write_slab(directory: Path, slab: int, records: int, entries: list[bytes]) -> None:
    (directory / f"slab-{RECORD}-{slab:06d}.kvs").write_bytes(bytes(records * RECORD))
    (directory / f"slab-{RECORD}-{slab:06d}.idx").write_bytes(b"".join(entries))


def replay(directory: Path, block_nbytes: int) -> NamespaceDir:
    with Folder.open(directory) as folder:
        return layout.replay(folder, block_nbytes)


def compact(directory: Path, slab: int) -> int:
    with Folder.open(directory) as folder:
        return compact_log(slab_path(folder, RECORD, slab, "idx"))


def test_entries_round_trip_and_a_torn_tail_is_ignored() -> None:
    data = encode_entry(1, 0, b"a", 11) + encode_entry(2, 1, b"b" * 128, 22, deleted=True)
    entries = decode_entries(data + encode_entry(3, 2, b"c", 33)[: ENTRY - 5])
    assert [(e.seq, e.record, e.key, e.checksum, e.deleted) for e in entries] == [
        (1, 0, b"a", 11, False),
        (2, 1, b"b" * 128, 22, True),
    ]
    flipped = bytearray(data)
    flipped[10] ^= 1
    assert decode_entries(bytes(flipped)) == []  # a corrupt entry ends the log


def test_replay_newest_entry_per_record_wins(tmp_path: Path) -> None:
    write_slab(
        tmp_path,
        0,
        4,
        [
            encode_entry(1, 0, b"old", 1),
            encode_entry(2, 1, b"x", 2),
            encode_entry(3, 0, b"new", 3),  # record 0 was reused
            encode_entry(4, 1, b"x", 0, deleted=True),  # and x deleted
            encode_entry(5, 9, b"beyond", 5),  # past the end of a 4-record slab
            encode_entry(6, 2, b"new", 6),  # a key stored again elsewhere: newest record wins
        ],
    )
    found = replay(tmp_path, RECORD)
    assert found.live == {(0, 2): (b"new", 6, 6)}
    assert found.max_seq == 6


def test_replay_changes_nothing_and_ignores_other_block_sizes(tmp_path: Path) -> None:
    write_slab(tmp_path, 0, 2, [encode_entry(1, 0, b"k", 1)])
    (tmp_path / "slab-8192-000000.idx.tmp").write_bytes(b"a compaction in progress")
    (tmp_path / f"slab-{4096 * 3}-000000.kvs").write_bytes(bytes(3 * 4096))
    before = sorted((p.name, p.stat().st_size) for p in tmp_path.iterdir())
    found = replay(tmp_path, RECORD)
    assert list(found.slabs) == [0]
    assert sorted((p.name, p.stat().st_size) for p in tmp_path.iterdir()) == before


def test_the_last_entry_in_the_log_wins_whatever_its_sequence_number(tmp_path: Path) -> None:
    # Another process's deletion (verify, delete) may carry a lower number than the writer's.
    write_slab(tmp_path, 0, 2, [encode_entry(9, 0, b"a", 1), encode_entry(3, 0, b"a", 0, deleted=True)])
    assert replay(tmp_path, RECORD).live == {}
    write_slab(tmp_path, 0, 2, [encode_entry(9, 0, b"a", 0, deleted=True), encode_entry(3, 0, b"b", 2)])
    assert replay(tmp_path, RECORD).live == {(0, 0): (b"b", 3, 2)}
    assert compact(tmp_path, 0) == 1
    assert replay(tmp_path, RECORD).live == {(0, 0): (b"b", 3, 2)}


def test_compaction_keeps_only_live_entries(tmp_path: Path) -> None:
    write_slab(
        tmp_path,
        0,
        4,
        [
            encode_entry(1, 0, b"a", 1),
            encode_entry(2, 0, b"b", 2),
            encode_entry(3, 1, b"c", 3),
            encode_entry(4, 1, b"c", 0, deleted=True),
        ],
    )
    before = replay(tmp_path, RECORD).live
    assert compact(tmp_path, 0) == 1
    assert replay(tmp_path, RECORD).live == before


def test_header_checks() -> None:
    header = memoryview(bytearray(HEADER_BYTES))
    ns = namespace_id("n")
    pack_header(header, namespace=ns, key=b"key", payload_len=100, checksum=42)
    assert verify_header(header, namespace=ns, key=b"key", payload_len=100) == 42
    for kwargs in ({"namespace": namespace_id("other")}, {"key": b"kez"}, {"payload_len": 99}):
        with pytest.raises(CorruptBlockError):
            verify_header(header, **{"namespace": ns, "key": b"key", "payload_len": 100, **kwargs})
    header[50] ^= 1
    with pytest.raises(CorruptBlockError, match="header checksum"):
        verify_header(header, namespace=ns, key=b"key", payload_len=100)
