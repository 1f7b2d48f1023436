"""The fs tier's index at scale: no Python object per block, a few tens of bytes a block plus the
key, keys confirmed in full (a hash collision is a miss, never another key's bytes)."""

from __future__ import annotations

import gc
import random
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import fs_helpers as h
import pytest

from kvtier_async.tiers.fs import key_table
from kvtier_async.tiers.fs.index import Claim, LogNews, OwnSlab, SlabIndex
from kvtier_async.tiers.fs.key_table import KeyTable
from kvtier_async.tiers.fs.layout import Entry

SLAB_RECORDS = 4096
KEY_BYTES = 32


def claim_slab(index: SlabIndex, slab: int) -> None:
    state = OwnSlab(records=SLAB_RECORDS, data_fd=-1, log_fd=-1, log_entries=0, end=0)
    index.take_claim(Claim(slab, state, [], disk_full=False))


def fill(index: SlabIndex, keys: list[bytes]) -> None:
    """Publish `keys` as the tier does: a free record each, a slab claimed when none is left."""
    for key in keys:
        taken = index.take_free()
        if taken is None:
            claim_slab(index, len(index.own))
            taken = index.take_free()
            assert taken is not None
        index.publish(key, taken[0], len(key))


def test_200k_blocks_take_a_few_tens_of_bytes_each_and_no_python_object() -> None:
    keys = [h.key_for(i) for i in range(200_000)]
    index = SlabIndex(4096)
    fill(index, keys[:8192])
    gc.collect()
    objects, blocks = len(gc.get_objects()), sys.getallocatedblocks()
    fill(index, keys[8192:])
    gc.collect()
    assert len(index) == len(keys) and all(index.find(key) is not None for key in keys[::997])
    # Neither what the garbage collector walks nor Python's small allocations of any kind (bytes
    # and ints too) grow with the blocks held: a few hundred (the slabs' state and columns).
    assert len(gc.get_objects()) - objects < 1000
    assert sys.getallocatedblocks() - blocks < 1000
    # The arrays, then: the key (32 bytes), its checksum, age and neighbours in the LRU, flags
    # (34 bytes), and hash table slots of 16 bytes, 35 to 70% of them used (at most 46 bytes an
    # entry), plus, while the table grows, the old table's slots not yet moved (at most 23).
    assert index.nbytes() / len(keys) <= KEY_BYTES + 34 + 46 + 23
    assert (
        index.holds_each([*keys[:5000], *[h.key_for(i, b"absent") for i in range(5000)]])
        == [True] * 5000 + [False] * 5000
    )


def test_the_lru_evicts_in_the_order_blocks_were_last_used() -> None:
    index = SlabIndex(4096)
    keys = [h.key_for(i) for i in range(SLAB_RECORDS)]
    fill(index, keys)
    pinned = index.pin(keys[0])  # read: newest when the read ends
    assert pinned is not None
    index.unpin(*pinned)
    stored_again = index.find(keys[1])
    assert stored_again is not None
    index.touch(stored_again)  # newest
    assert index.hold(keys[2])  # never evicted while held
    order = [index.evict_oldest() for _ in range(SLAB_RECORDS - 1)]
    assert index.evict_oldest() is None  # only the held one is left
    assert [e[0] for e in order if e is not None] == [*keys[3:], keys[0], keys[1]]
    index.release(keys[2])
    evicted = index.evict_oldest()
    assert evicted is not None and evicted[0] == keys[2]
    assert len(index) == 0


def test_two_keys_of_one_hash_each_find_their_own_record() -> None:
    index = SlabIndex(4096)
    index.table = KeyTable(index._key_at, hash_key=lambda key: 7, same_keys=index._same_keys)  # all collide
    keys = [h.key_for(i) for i in range(200)]
    fill(index, keys[:150])
    assert [index.find(key) for key in keys[150:]] == [None] * 50  # same hash, another key: a miss
    assert index.holds_each(keys) == [True] * 150 + [False] * 50  # the batch's way: the same
    assert [index.key_of(index.find(key) or (0, 0)) for key in keys[:150]] == keys[:150]
    for key in keys[:150:2]:
        index.drop(index.find(key) or (0, 0))
    expected = [i % 2 == 1 for i in range(150)] + [False] * 50
    assert [index.find(key) is not None for key in keys] == expected
    assert index.holds_each(keys) == expected


def test_keys_of_every_length_share_a_slab() -> None:
    index = SlabIndex(4096)
    keys = [bytes([i]) * n for i, n in enumerate([1, 8, 32, 33, 100, 128, 5])]
    fill(index, keys)
    assert [index.key_of(index.find(key) or (0, 0)) for key in keys] == keys
    assert index.find(b"\x04" * 99) is None


#: Hashes that collide: 1500 keys over 256+ hashes; or over 3 hashes whose home is one of the
#: table's last slots at every size, so that runs wrap around past the last slot into the first.
HASHES: dict[str, Callable[[bytes], int]] = {
    "few": lambda key: key[0] + 7 * key[1],
    "wrapping": lambda key: (1 << 64) - 1 - key[0] % 3,
}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("hashes", sorted(HASHES))
def test_the_table_answers_as_a_dict_through_growth_and_removals(seed: int, hashes: str) -> None:
    rng = random.Random(seed)
    held: dict[int, bytes] = {}  # record id -> its key
    table = KeyTable(held.get, hash_key=HASHES[hashes])
    model: dict[bytes, int] = {}
    for step in range(8_000):
        key = rng.randrange(1500).to_bytes(4, "little")
        if rng.random() < 0.6:  # stored: the key's record is this step's
            held[step] = key
            table.put(key, step)
            if key in model:
                del held[model[key]]
            model[key] = step
        elif key in model:
            assert table.remove(key, model[key])
            del held[model.pop(key)]
        if step % 1000 == 0:
            assert all(table.get(k) == v for k, v in model.items())
    assert len(table) == len(model)
    assert all(table.get(k) == v for k, v in model.items())
    assert table.get(b"none") == -1
    absent = [i.to_bytes(4, "little") for i in range(1500, 1600)]
    assert table.get_many([*model, *absent]) == [*model.values()] + [-1] * len(absent)


@pytest.mark.asyncio
async def test_a_hash_collision_through_the_tier_is_a_miss_never_the_other_keys_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(key_table, "key_hash", lambda key: 12345)  # every key collides
    tier, primary = h.make_tier(str(tmp_path))
    stored, other = [h.key_for(i) for i in range(4)], h.key_for(99)
    async with tier:
        assert all(await h.store_keys(tier, primary, stored))
        assert await tier.lookup([other]) == 0
        assert await h.load_and_check(tier, primary, [other, *stored]) == [False, True, True, True, True]
    second, primary = h.make_tier(str(tmp_path))  # a restart, following the logs
    async with second:
        assert await h.load_and_check(second, primary, [*stored, other]) == [True, True, True, True, False]


def test_a_table_of_a_steady_number_of_entries_never_grows() -> None:
    held: dict[int, bytes] = {}
    table = KeyTable(held.get)
    keys = [h.key_for(i) for i in range(20_000)]
    for i, key in enumerate(keys[:600]):  # under 70% of the first 1024 slots
        held[i] = key
        table.put(key, i)
    for i in range(600, len(keys)):  # a full cache: each store evicts the oldest
        table.remove(keys[i - 600], i - 600)
        del held[i - 600]
        held[i] = keys[i]
        table.put(keys[i], i)
    assert table.nbytes == 1024 * 16 and len(table) == 600
    assert [table.get(key) for key in keys[-600:]] == list(range(len(keys) - 600, len(keys)))
    assert all(table.get(key) == -1 for key in keys[:-600])


#: Hashes for the growth tests: the real one, and one that every two keys share (keys that
#: differ in their last byte only), so probes and moves meet other keys of the same hash.
GROWTH_HASHES: dict[str, Callable[[bytes], int]] = {
    "xxh3": key_table.key_hash,
    "pairs": lambda key: key_table.key_hash(key[:-1]),
}


@pytest.mark.parametrize("hashes", sorted(GROWTH_HASHES))
def test_the_table_answers_as_a_dict_while_it_grows_chunk_by_chunk(hashes: str) -> None:
    """Through several growths of many chunks each, with stores, replacements and removals in
    between, every lookup (one by one and batched) answers as a dict, whether the key's entry
    is still in the old table or already moved."""
    rng = random.Random(5)
    held: dict[int, bytes] = {}
    table = KeyTable(held.get, hash_key=GROWTH_HASHES[hashes])
    model: dict[bytes, int] = {}
    checked_while_growing = 0
    for step in range(60_000):
        key = rng.randrange(40_000).to_bytes(4, "little") + bytes([rng.randrange(2)])
        if rng.random() < 0.8:
            held[step] = key
            table.put(key, step, keep=(lambda record: record % 7 == 0) if step % 5 == 0 else None)
            if key in model and (step % 5 or model[key] % 7):
                del held[model[key]]
                model[key] = step
            elif key in model:
                del held[step]  # kept the record it was mapped to
            else:
                model[key] = step
        elif key in model:
            assert table.remove(key, model[key])
            assert not table.remove(key, model[key])
            del held[model.pop(key)]
        if step % 2000 == 0 and table.growing:
            checked_while_growing += 1
            asked = [*model, b"none"]
            assert table.get_many(asked) == [*model.values(), -1]
            assert all(table.get(k) == v for k, v in model.items())
    assert checked_while_growing >= 3
    assert len(table) == len(model)
    assert table.get_many([*model]) == [*model.values()]


@pytest.mark.parametrize("hashes", list(GROWTH_HASHES))
def test_a_table_reserved_for_a_replayed_log_answers_as_a_dict(hashes: str) -> None:
    """A restarted process replays whole logs: `reserve` sizes the table for each log's entries
    at once (while it grows too), and the table still answers as a dict; a batch small next to
    what the table holds reserves nothing (the puts grow it chunk by chunk)."""
    held: dict[int, bytes] = {}
    table = KeyTable(held.get, hash_key=GROWTH_HASHES[hashes])
    table.reserve(5000)
    assert len(table._table) == 8192 and not table.growing
    model: dict[bytes, int] = {}
    for record in range(30_000):
        if record in (5000, 12_000, 20_000):  # the next log, replayed at once
            table.reserve(len(table) + 5000)
        key = (record % 25_000).to_bytes(4, "little")  # the last 5000 replace earlier ones
        held[record] = key
        table.put(key, record)
        if key in model:
            del held[model[key]]
        model[key] = record
    assert len(table) == len(model) == 25_000
    assert table.get_many([*model, b"none"]) == [*model.values(), -1]
    size = len(table._table)
    table.reserve(len(table) + 100)  # small next to 25,000: nothing now
    assert len(table._table) == size


def test_a_growing_table_never_works_in_proportion_to_its_size_at_once() -> None:
    """Puts of 256 keys at a time (a store's batch, a turn of the loop), to 300,032 keys: none
    allocates more than 1 MiB at its peak, the growths included (each moves a chunk of the old
    table, and the new one's pages come from the kernel as they are written). Counted in
    allocations (`tracemalloc`), not time: re-placing every entry at once, as the table grew
    before, allocated 25 MiB at its peak at 262,144 slots, and held the loop some
    50 ms of CPU (`LoopHold`) on this project's VM."""
    keys = [h.key_for(i) for i in range(300_032)]
    table = KeyTable(keys.__getitem__)  # record i holds key i: nothing allocated per key
    grew, peaks = 0, []
    tracemalloc.start()
    try:
        for start in range(0, len(keys), 256):
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            for i in range(start, start + 256):
                table.put(keys[i], i)
            peaks.append(tracemalloc.get_traced_memory()[1] - before)
            grew += table.growing
    finally:
        tracemalloc.stop()
    assert grew > 10 and not table.growing  # it grew, over many batches, and is done
    assert max(peaks) <= 1 << 20, max(peaks)
    assert table.get_many(keys[::97]) == list(range(0, len(keys), 97))


def test_a_claimed_slab_s_record_read_as_another_s_is_room_only_once_the_read_ends() -> None:
    """Claiming a slab another process wrote: its records that hold nothing are free, in order,
    except one still being read from our view of it as another's slab, which is room only once
    that read ends (never written while read)."""
    index = SlabIndex(4096)
    key = h.key_for(1)
    news = LogNews(slab=3, reset=True, entries=[Entry(1, 5, False, key, 9)], inode=1, offset=0, data_fd=-1)
    index.apply_news(news)
    pinned = index.pin(key)
    assert pinned is not None and pinned[0] == (3, 5)
    state = OwnSlab(records=SLAB_RECORDS, data_fd=-1, log_fd=-1, log_entries=0, end=0)
    index.take_claim(Claim(3, state, [Entry(2, 5, True, key, 0)], disk_full=False))  # deleted since
    taken = [index.take_free() for _ in range(SLAB_RECORDS - 1)]
    assert [t[0] for t in taken if t is not None] == [(3, r) for r in range(SLAB_RECORDS) if r != 5]
    assert index.take_free() is None
    index.unpin(*pinned)
    again = index.take_free()
    assert again is not None and again[0] == (3, 5)
