from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import fs_helpers as h
import pytest

import kvtier_async as kt
import kvtier_async.tiers.fs
import kvtier_async.tiers.fs.admin
from kvtier_async.buffers import address_of as buffer_address
from kvtier_async.spec import OffloadingSpec
from kvtier_async.testing import TierContractTests
from kvtier_async.tiers.fs import records
from kvtier_async.tiers.fs.layout import ENTRY, record_bytes_for


class FsContract(TierContractTests):
    def capacity_bytes_for(self, blocks: int, spec: OffloadingSpec) -> int:
        return blocks * (record_bytes_for(spec.block_nbytes) + 4 * ENTRY)


class TestFileSystemTierDirect(FsContract):
    @pytest.fixture
    def tier_config(self, tmp_path: Path) -> dict[str, Any]:
        return {"type": "fs", "root": str(tmp_path / "cache"), "direct_io": True}


class TestFileSystemTierSealed(FsContract):
    """With a tier secret: records sealed through their own slots, names keyed."""

    @pytest.fixture
    def tier_config(self, tmp_path: Path, tier_secret_env: str) -> dict[str, Any]:
        root = str(tmp_path / "cache")
        return {"type": "fs", "root": root, "direct_io": True, "secret_env": tier_secret_env}


class TestFileSystemTierStaged(FsContract):
    @pytest.fixture
    def tier_config(self, tmp_path: Path) -> dict[str, Any]:
        return {"type": "fs", "root": str(tmp_path / "cache"), "direct_io": True, "staging": True}


class TestFileSystemTierBuffered(FsContract):
    @pytest.fixture
    def tier_config(self, tmp_path: Path) -> dict[str, Any]:
        return {"type": "fs", "root": str(tmp_path / "cache"), "direct_io": False}


class TestFileSystemTierOnTmpfs(FsContract):
    @pytest.fixture
    def tier_config(self) -> Iterator[dict[str, Any]]:
        if not Path("/dev/shm").is_dir():
            pytest.skip("no tmpfs at /dev/shm")
        path = Path(tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm"))
        try:
            yield {"type": "fs", "root": str(path), "direct_io": "auto"}
        finally:
            shutil.rmtree(path, ignore_errors=True)


# -- file-system specific behaviour ----------------------------------------------------------------
HERE = Path(__file__).parent


#: Read piece sizes the read path is tested with: the default (a run of these small records in
#: one read), and records read in halves and in quarters.
READ_PIECES = [records.READ_PIECE_BYTES, record_bytes_for(h.BLOCK_NBYTES) // 2, 4096]
READ_PIECE_IDS = ["default", "halves", "quarters"]


def slab_files(root: Path, kind: str = "kvs") -> list[Path]:
    return sorted(root.glob(f"kvtier-*/slab-*.{kind}"))


def files(root: Path, pattern: str = "*") -> list[Path]:
    """Tests look at the disk through this, on a worker thread: it blocks."""
    return sorted(root.rglob(pattern))


def damage_slab(root: Path, damage: str, victim: int, size: int = record_bytes_for(h.BLOCK_NBYTES)) -> None:
    """Damage record `victim` (of `size` bytes: a sealed tier's are longer) of the one slab."""
    [slab] = slab_files(root)
    if damage == "delete":
        slab.unlink()
        return
    with open(slab, "r+b") as f:
        if damage in ("flip-payload", "flip-header"):
            at = victim * size + (4096 + 1000 if damage == "flip-payload" else 60)
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0x81]))
        elif damage == "zero":
            f.seek(victim * size)
            f.write(bytes(size))
        elif damage == "truncate":
            f.truncate(victim * size + 4096 + 10)


def run_writer(root: Path, start: int, count: int) -> list[int]:
    out = subprocess.run(
        [sys.executable, str(HERE / "fs_helpers.py"), str(root), str(start), str(count)],
        capture_output=True,
        text=True,
        check=True,
        cwd=HERE,
    ).stdout
    return [int(i) for line in out.split() for i in [line]]


@pytest.mark.asyncio
async def test_blocks_survive_a_restart_in_another_process(tmp_path: Path) -> None:
    acknowledged = await asyncio.to_thread(run_writer, tmp_path, 0, 20)
    assert acknowledged == list(range(20))
    tier, primary = h.make_tier(str(tmp_path))
    async with tier:
        keys = [h.key_for(i) for i in range(20)]
        assert await h.load_and_check(tier, primary, keys) == [True] * 20
        assert tier.stats()["corrupt_blocks"] == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_sigkill_at_a_random_moment_loses_nothing_acknowledged(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(HERE / "fs_helpers.py"),
        str(tmp_path),
        "0",
        "100000",
        stdout=asyncio.subprocess.PIPE,
        cwd=HERE,
    )
    assert proc.stdout is not None
    acknowledged: list[int] = []
    wanted = rng.randint(3, 40)  # batches to see acknowledged before the kill
    while len(acknowledged) < wanted * 4:
        line = await proc.stdout.readline()
        assert line, "the writer stopped early"
        acknowledged += [int(i) for i in line.split()]
    for _ in range(rng.randint(0, 50)):
        await asyncio.sleep(0)  # let the writer get somewhere into the next batch
    proc.send_signal(signal.SIGKILL)
    await proc.wait()
    tier, primary = h.make_tier(str(tmp_path))
    async with tier:
        assert not await asyncio.to_thread(files, tmp_path, "*.tmp"), "temporary files survived"
        top = max(acknowledged) + 8
        keys = [h.key_for(i) for i in range(top)]
        results: list[bool | None] = []
        for start in range(0, top, 16):
            results += await h.load_and_check(tier, primary, keys[start : start + 16])
        assert None not in results, "wrong bytes after a crash"
        assert all(results[i] for i in acknowledged), "an acknowledged block was lost"


@pytest.mark.asyncio
@pytest.mark.parametrize("damage", ["flip-payload", "flip-header", "zero", "truncate", "delete"])
@pytest.mark.parametrize("staging", [False, True])
@pytest.mark.parametrize("piece", READ_PIECES, ids=READ_PIECE_IDS)
async def test_damaged_blocks_are_counted_misses(
    tmp_path: Path, damage: str, staging: bool, piece: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(records, "READ_PIECE_BYTES", piece)
    tier, primary = h.make_tier(str(tmp_path), staging=staging)
    keys = [h.key_for(i) for i in range(8)]
    async with tier:
        assert await h.store_keys(tier, primary, keys) == [True] * 8
    victim = 5  # record 5 holds key 5: a fresh slab fills from record 0 in order
    await asyncio.to_thread(damage_slab, tmp_path, damage, victim)
    tier, primary = h.make_tier(str(tmp_path), staging=staging)
    async with tier:
        results = await h.load_and_check(tier, primary, keys)
        assert None not in results
        assert tier.stats()["staging"] is staging
        if damage == "delete":
            assert results == [False] * 8
        elif damage == "truncate":
            assert results == [True] * 5 + [False] * 3
        else:
            assert results == [True] * 5 + [False] + [True] * 2
            assert tier.stats()["corrupt_blocks"] == 1
            assert await tier.contains([keys[victim]]) == [False]  # dropped
    tier, primary = h.make_tier(str(tmp_path), staging=staging)
    async with tier:  # and still gone after another restart
        assert (await tier.contains([keys[victim]])) == [False]


@pytest.mark.asyncio
@pytest.mark.parametrize("opened", ["in-the-check-job", "on-the-loop"])
async def test_a_sealed_batch_of_hits_misses_and_forgeries_opens_each_into_its_own_slot(
    tmp_path: Path, tier_secret_env: str, opened: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sealed load opens a batch in its check's job (a few small blocks: on the loop after
    it): every answer and every block must land at its own key's place, whatever lies before
    it in the batch."""
    inline = 1 << 40 if opened == "on-the-loop" else 0
    monkeypatch.setattr(kvtier_async.tiers.fs.tier, "INLINE_CPU_BYTES", inline)
    tier, primary = h.make_tier(str(tmp_path), secret_env=tier_secret_env)
    keys = [h.key_for(i) for i in range(6)]
    stored = [keys[1], keys[2], keys[4]]  # records 0, 1, 2 of the slab, in this order
    async with tier:
        assert await h.store_keys(tier, primary, stored) == [True] * 3
    # A flipped byte in keys[2]'s sealed payload (record 1): it no longer authenticates.
    await asyncio.to_thread(damage_slab, tmp_path, "flip-payload", 1, tier.record_bytes)
    tier, primary = h.make_tier(str(tmp_path), secret_env=tier_secret_env)
    async with tier:
        assert await h.load_and_check(tier, primary, keys) == [False, True, False, False, True, False]
        assert tier.stats()["unauthenticated_blocks"] == 1
        for slot in (0, 2, 3, 5):  # a miss leaves its slot as it was (zeroed by load_and_check)
            assert not primary.buffer[slot].any()


@pytest.mark.asyncio
async def test_a_sealed_tier_reserves_no_more_sealing_slots_than_its_primary_has_blocks(
    tmp_path: Path, tier_secret_env: str
) -> None:
    """Four 4 MiB primary blocks: four sealing slots (not one per block of every lane, 192 MiB),
    and every block still stored and loaded through them, two calls at once included."""
    spec = OffloadingSpec(block_nbytes=4 << 20, num_cpu_blocks=4, namespace="fs-sealed-slots")
    primary = kt.PrimaryTier(spec, pin_memory=False)
    tier = kt.SecondaryTierFactory.create_secondary_tier(
        {"type": "fs", "root": str(tmp_path), "secret_env": tier_secret_env}, primary.view, spec
    )
    keys = [h.key_for(i) for i in range(4)]
    async with tier:
        assert tier.stats()["sealed_slot_bytes"] <= 4 * (tier.record_bytes + 4096)
        for slot in range(4):
            primary.slot_view(slot)[:] = bytes([slot + 1]) * spec.block_nbytes
        stored = await asyncio.gather(tier.store(keys[:2], [0, 1]), tier.store(keys[2:], [2, 3]))
        assert stored == [[True, True], [True, True]]
        for slot in range(4):
            primary.slot_view(slot)[:] = bytes(spec.block_nbytes)
        assert await tier.load(keys[::-1], [0, 1, 2, 3]) == [True] * 4
        assert [bytes(primary.slot_view(slot)[:1]) for slot in range(4)] == [
            b"\x04",
            b"\x03",
            b"\x02",
            b"\x01",
        ]


@pytest.mark.asyncio
async def test_hostile_keys_stay_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    tier, primary = h.make_tier(str(root))
    keys = [b"../x", b"/etc/passwd", b"..", b"a\x00b", b"\\..\\y", b"x" * 128]
    async with tier:
        assert await h.store_keys(tier, primary, keys) == [True] * len(keys)
        assert await h.load_and_check(tier, primary, keys) == [True] * len(keys)
    assert [p.name for p in await asyncio.to_thread(files, tmp_path, "*") if p.parent == tmp_path] == ["root"]
    names = {p.name for p in await asyncio.to_thread(files, root)}
    assert all(n.startswith(("kvtier-", "slab-")) or n in ("NAMESPACE", "FORMAT") for n in names)


@pytest.mark.asyncio
async def test_namespaces_never_see_each_other(tmp_path: Path) -> None:
    a, primary_a = h.make_tier(str(tmp_path), namespace="model-a")
    b, _primary_b = h.make_tier(str(tmp_path), namespace="model-b")
    keys = [h.key_for(i) for i in range(4)]
    async with a, b:
        await h.store_keys(a, primary_a, keys)
        assert await b.contains(keys) == [False] * 4
        assert await b.load(keys, [0, 1, 2, 3]) == [False] * 4
        assert await b.lookup(keys) == 0


@pytest.mark.asyncio
async def test_files_are_owner_only(tmp_path: Path) -> None:
    tier, primary = h.make_tier(str(tmp_path / "c"))
    async with tier:
        await h.store_keys(tier, primary, [h.key_for(0)])

    def modes() -> list[tuple[Path, int, bool]]:
        return [(p, stat.S_IMODE(p.stat().st_mode), p.is_dir()) for p in files(tmp_path / "c")]

    found = await asyncio.to_thread(modes)
    assert found
    for path, mode, is_dir in found:
        assert mode == (0o700 if is_dir else 0o600), (path, oct(mode))


@pytest.mark.asyncio
async def test_capacity_bounds_the_bytes_on_disk_and_evicts_oldest(tmp_path: Path) -> None:
    from kvtier_async.tiers.fs.layout import ENTRY, record_bytes_for

    capacity = 20 * (record_bytes_for(h.BLOCK_NBYTES) + 4 * ENTRY)
    tier, primary = h.make_tier(str(tmp_path), capacity_bytes=capacity)
    async with tier:
        for start in range(0, 200, 8):
            keys = [h.key_for(i) for i in range(start, start + 8)]
            assert await h.store_keys(tier, primary, keys) == [True] * 8
        on_disk = await asyncio.to_thread(lambda: sum(p.stat().st_size for p in files(tmp_path, "slab-*")))
        assert on_disk <= capacity
        present = await tier.contains([h.key_for(i) for i in range(200)])
        assert present[-8:] == [True] * 8 and not any(present[:100])
        assert tier.stats()["evictions"] > 0
    # After a restart the same blocks are there, in the same LRU order.
    tier, primary = h.make_tier(str(tmp_path), capacity_bytes=capacity)
    async with tier:
        assert await tier.contains([h.key_for(i) for i in range(200)]) == present
        newest = [i for i, p in enumerate(present) if p]
        await h.store_keys(tier, primary, [h.key_for(1000 + i) for i in range(4)])
        after = await tier.contains([h.key_for(i) for i in newest])
        assert after == [False] * 4 + [True] * (len(newest) - 4)  # the oldest went first


@pytest.mark.asyncio
async def test_the_next_slab_is_claimed_before_the_stores_need_it(tmp_path: Path) -> None:
    from kvtier_async.tiers.fs.layout import ENTRY, record_bytes_for

    # 16 slabs of 8 records: past half a slab, the next one is claimed in the background, so a
    # store never waits for a slab's fallocate behind the writes in flight.
    capacity = 16 * 8 * (record_bytes_for(h.BLOCK_NBYTES) + 4 * ENTRY)
    tier, primary = h.make_tier(str(tmp_path), capacity_bytes=capacity)
    keys = [h.key_for(i) for i in range(8)]
    async with tier:
        assert await h.store_keys(tier, primary, keys[:4]) == [True] * 4
        assert tier.stats()["slabs"] == 1  # half of it is still free
        assert await h.store_keys(tier, primary, keys[:5]) == [True] * 5
        assert await h.store_keys(tier, primary, keys) == [True] * 8
    slabs = await asyncio.to_thread(slab_files, tmp_path)
    assert len(slabs) == 2  # closing waited for the claim
    # The first slab filled before the second was written to: record 7 holds key 7.
    first_slab = await asyncio.to_thread(slabs[0].read_bytes)
    record = record_bytes_for(h.BLOCK_NBYTES)
    assert first_slab[7 * record : 7 * record + h.BLOCK_NBYTES] == h.payload_for(keys[7])
    tier, primary = h.make_tier(str(tmp_path), capacity_bytes=capacity)
    async with tier:
        assert await h.load_and_check(tier, primary, keys) == [True] * 8


@pytest.mark.asyncio
async def test_a_claim_that_has_finished_is_never_handed_out(tmp_path: Path) -> None:
    # A store that finds no free record awaits the claim in progress. One handed a claim that
    # had just finished, its done-callbacks not yet run, awaited it without yielding and spun
    # for ever with the loop blocked (bench/fs_steady.py did: a full tier, a batch per block).
    tier, primary = h.make_tier(str(tmp_path))
    handed_out: list[bool] = []
    async with tier:
        take_claim = tier.room.take_claim

        def and_then_ask_again(claim: Any) -> None:
            tier.room.take_claim = take_claim  # type: ignore[method-assign]
            take_claim(claim)
            # Runs once the claim's task has ended, before its done-callbacks: where a store
            # that found the new slab's records all taken by others would ask for a claim.
            asyncio.get_running_loop().call_soon(lambda: handed_out.append(tier.room.start_claim().done()))

        tier.room.take_claim = and_then_ask_again  # type: ignore[method-assign]
        assert await h.store_keys(tier, primary, [h.key_for(0)]) == [True]
        while tier.room.claiming is not None:  # the claim asked for, if any, settles before closing
            await asyncio.shield(tier.room.claiming)
    assert handed_out == [False]


@pytest.mark.asyncio
async def test_fsync_mode_round_trips(tmp_path: Path) -> None:
    tier, primary = h.make_tier(str(tmp_path), fsync=True)
    keys = [h.key_for(i) for i in range(6)]
    async with tier:
        assert await h.store_keys(tier, primary, keys) == [True] * 6
        assert await h.load_and_check(tier, primary, keys) == [True] * 6


@pytest.mark.asyncio
async def test_two_tiers_on_one_root_share_their_blocks(tmp_path: Path) -> None:
    # Two tiers in one process hold separate open files, so they share a root as two processes do
    # (tests/test_fs_processes.py runs real processes).
    first, primary = h.make_tier(str(tmp_path), refresh_interval_s=0)
    second, primary2 = h.make_tier(str(tmp_path), refresh_interval_s=0)
    async with first, second:
        assert await h.store_keys(first, primary, [h.key_for(0)]) == [True]
        assert await h.store_keys(second, primary2, [h.key_for(1)]) == [True]
        assert await h.load_and_check(second, primary2, [h.key_for(0)]) == [True]
        assert await h.load_and_check(first, primary, [h.key_for(1)]) == [True]
        assert first.stats()["slabs"] == second.stats()["slabs"] == 1  # one writer per slab
        assert await second.delete([h.key_for(0)]) == 1
        third, _ = h.make_tier(str(tmp_path), refresh_interval_s=0)
        async with third:  # the deletion is in the writer's log: nobody else finds it any more
            assert await third.contains([h.key_for(0), h.key_for(1)]) == [False, True]


@pytest.mark.asyncio
async def test_a_slab_made_anew_after_gc_is_read_from_its_new_file(tmp_path: Path) -> None:
    """A reader holds another writer's slab open; `kvtier fs gc` removes that slab once its
    writer exits, and a new writer makes the same slab number again. The reader's refresh
    reads the new log, so it must read the new data file too: with the old one it found other
    bytes where the new log named the block, called it corrupt, and logged a deletion of the
    new writer's good block, for every process."""
    old_key, new_key = h.key_for(1), h.key_for(2)
    writer, primary = h.make_tier(str(tmp_path))
    async with writer:
        assert await h.store_keys(writer, primary, [old_key]) == [True]
    reader, reader_primary = h.make_tier(str(tmp_path), refresh_interval_s=0)
    async with reader:
        assert await h.load_and_check(reader, reader_primary, [old_key]) == [True]  # holds the slab
        (report,) = await asyncio.to_thread(kvtier_async.tiers.fs.admin.gc_root, tmp_path, 0)
        assert report.removed_bytes > 0 and report.slabs_in_use == 0
        new_writer, new_primary = h.make_tier(str(tmp_path))
        async with new_writer:
            assert await h.store_keys(new_writer, new_primary, [new_key]) == [True]
            assert new_writer.stats()["slabs"] == 1  # the same number again
            assert await h.load_and_check(reader, reader_primary, [new_key, old_key]) == [True, False]
            assert reader.stats()["corrupt_blocks"] == 0
            third, third_primary = h.make_tier(str(tmp_path))
            async with third:
                assert await h.load_and_check(third, third_primary, [new_key]) == [True]


def test_bad_config(tmp_path: Path) -> None:
    for kwargs, message in (
        ({"direct_io": "yes"}, "direct_io"),
        ({"capacity_bytes": 10}, "capacity_bytes"),
        ({"fsync": 1}, "fsync"),
        ({"staging": "yes"}, "staging"),
        ({"root": ""}, "root"),
        ({"refresh_interval_s": -1}, "refresh_interval_s"),
    ):
        with pytest.raises(kt.ConfigError, match=message):
            h.make_tier(**{"root": str(tmp_path), **kwargs})  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def small_tmpfs(where: Path, size: str) -> AsyncIterator[Path]:
    await asyncio.to_thread(where.mkdir)
    mounted = await asyncio.to_thread(
        subprocess.run,
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
    )
    if os.geteuid() != 0 or mounted.returncode:
        pytest.skip("mounting a small tmpfs is not permitted here")
    try:
        yield where
    finally:
        await asyncio.to_thread(subprocess.run, ["umount", str(where)], check=False)


@pytest.mark.asyncio
@pytest.mark.parametrize("capacity", [None, 64 << 20])
async def test_one_store_that_does_not_fit_whole_stores_what_fits(
    tmp_path: Path, capacity: int | None
) -> None:
    # 24 blocks of 256 KiB in one call on a 3 MiB file system: by default the capacity (80% of
    # the space) bounds it; with a capacity far beyond the disk, the disk does.
    async with small_tmpfs(tmp_path / "small", "3m") as mount:
        spec = kt.OffloadingSpec(block_nbytes=256 << 10, num_cpu_blocks=24, namespace="full")
        primary = kt.PrimaryTier(spec, pin_memory=False)
        keys = [h.key_for(i) for i in range(24)]
        payloads = [h.payload_for(k, spec.block_nbytes) for k in keys]
        for slot, payload in enumerate(payloads):
            primary.slot_view(slot)[:] = payload
        tier = kvtier_async.tiers.fs.FileSystemTier(spec, primary.view, root=mount, capacity_bytes=capacity)
        async with tier:
            stored = await tier.store(keys, list(range(24)))
            assert 8 <= sum(stored) < 24, stored
            primary.buffer.zero_()
            loaded = await tier.load(keys, list(range(24)))
            assert loaded == stored
            assert all(bytes(primary.slot_view(i)) == payloads[i] for i in range(24) if loaded[i])
            # It keeps serving: new blocks take the room of the oldest.
            fresh = [h.key_for(100 + i) for i in range(4)]
            for slot, key in enumerate(fresh):
                primary.slot_view(slot)[:] = h.payload_for(key, spec.block_nbytes)
            assert await tier.store(fresh, [0, 1, 2, 3]) == [True] * 4
            primary.buffer.zero_()
            assert await tier.load(fresh, [4, 5, 6, 7]) == [True] * 4
            assert bytes(primary.slot_view(5)) == h.payload_for(fresh[1], spec.block_nbytes)


@pytest.mark.asyncio
async def test_disk_full_fails_only_what_did_not_fit(tmp_path: Path) -> None:
    async with small_tmpfs(tmp_path / "small", "2m") as mount:
        # Ask for far more than the 2 MiB mount holds: the disk fills before the capacity.
        tier, primary = h.make_tier(str(mount), capacity_bytes=64 << 20)
        async with tier:
            stored: list[bytes] = []
            for start in range(0, 400, 8):
                keys = [h.key_for(i) for i in range(start, start + 8)]
                results = await h.store_keys(tier, primary, keys)
                stored += [k for k, ok in zip(keys, results) if ok]
            stats = tier.stats()
            assert stats["out_of_space"] >= 1
            assert not await asyncio.to_thread(files, mount, "*.tmp")
            # It keeps serving: recent stores land, and what it holds reads back exact.
            recent = [h.key_for(5000 + i) for i in range(4)]
            assert await h.store_keys(tier, primary, recent) == [True] * 4
            held = [k for k in stored if (await tier.contains([k]))[0]]
            assert held
            for start in range(0, len(held), 16):
                got = await h.load_and_check(tier, primary, held[start : start + 16])
                assert got == [True] * len(got)


def fill(mount: Path, leave: int = 0) -> None:
    """Take every byte left on the file system at `mount` but `leave`, in the file "filler"."""
    filler = mount / "filler"
    with contextlib.suppress(OSError), open(filler, "wb", buffering=0) as f:
        while True:
            f.write(bytes(4096))  # until ENOSPC
    if leave:
        os.truncate(filler, max(0, filler.stat().st_size - leave))


@pytest.mark.asyncio
async def test_a_tier_grows_again_once_a_full_disk_has_room(tmp_path: Path) -> None:
    # A server that met a full disk must not stay shrunk for the rest of its life once an
    # operator (or `kvtier fs gc`) frees space: with nothing but stores, it claims slabs again.
    async with small_tmpfs(tmp_path / "small", "4m") as mount:
        await asyncio.to_thread(fill, mount, leave=100_000)
        tier, primary = h.make_tier(str(mount), capacity_bytes=2 << 20, refresh_interval_s=0)
        async with tier:
            batches = [[h.key_for(b * 8 + i) for i in range(8)] for b in range(40)]
            for keys in batches[:20]:
                await h.store_keys(tier, primary, keys)
            full = tier.stats()
            assert full["disk_full"] and full["out_of_space"] >= 1
            assert full["own_blocks"] < 16  # the 100 kB left hold a handful
            await asyncio.to_thread(os.unlink, mount / "filler")
            for keys in batches[20:]:
                await h.store_keys(tier, primary, keys)
            grown = tier.stats()
            assert not grown["disk_full"]
            assert grown["own_blocks"] > 6 * full["own_blocks"]  # ~120 records in 2 MiB
            newest = [k for keys in batches[30:] for k in keys]
            assert await h.load_and_check(tier, primary, newest[:32]) == [True] * 32


@pytest.mark.asyncio
async def test_gc_frees_a_full_disk(tmp_path: Path) -> None:
    # `kvtier fs gc` is how an operator clears a full disk, so it must not need free space:
    # rewriting a kept slab's log cannot, until removing the old slabs has made room.
    async with small_tmpfs(tmp_path / "small", "1m") as mount:
        capacity = 64 * (record_bytes_for(h.BLOCK_NBYTES) + 4 * ENTRY)  # slabs of 4 records
        keys = [h.key_for(i) for i in range(24)]
        for start in range(0, 24, 4):  # one tier after another: no slab keeps a writer
            tier, primary = h.make_tier(str(mount), capacity_bytes=capacity)
            async with tier:
                assert await h.store_keys(tier, primary, keys[start : start + 4]) == [True] * 4
        await asyncio.to_thread(fill, mount)
        keep = 8 * (record_bytes_for(h.BLOCK_NBYTES) + 4 * ENTRY)
        (report,) = await asyncio.to_thread(kvtier_async.tiers.fs.admin.gc_root, mount, keep)
        assert report.removed_bytes > 0 and report.blocks == 8
        assert report.logs_not_compacted == 0  # compacted once the removals made room
        assert not await asyncio.to_thread(files, mount, "*.tmp")
        await asyncio.to_thread(os.unlink, mount / "filler")
        tier, primary = h.make_tier(str(mount), capacity_bytes=capacity)
        async with tier:
            assert await h.load_and_check(tier, primary, keys[16:]) == [True] * 8  # the newest


@pytest.mark.asyncio
async def test_a_root_removed_under_a_running_tier_is_made_again(tmp_path: Path) -> None:
    # An operator clears a root by hand while a server runs: the tier goes on without an
    # exception, makes the namespace directory again for every process, serves what it holds
    # from its own (now unlinked) files, and never writes into a new process's slab that took
    # the number of one of its removed ones (its log compaction works by path).
    root = tmp_path / "root"
    capacity = 64 * (record_bytes_for(h.BLOCK_NBYTES) + 4 * ENTRY)  # slabs of 4 records
    a, primary_a = h.make_tier(str(root), capacity_bytes=capacity, refresh_interval_s=0)
    shared = [h.key_for(100 + i) for i in range(4)]
    async with a:
        early = [h.key_for(i) for i in range(2)]
        assert await h.store_keys(a, primary_a, early) == [True, True]
        await asyncio.to_thread(shutil.rmtree, root)
        await a.refresh()
        assert await asyncio.to_thread((a.directory / "FORMAT").exists)
        assert await h.load_and_check(a, primary_a, early) == [True, True]
        b, primary_b = h.make_tier(str(root), capacity_bytes=capacity)
        async with b:
            assert await h.store_keys(b, primary_b, shared) == [True] * 4  # a new slab 0
            for n in range(12):  # a rewrites a record of its slab 0 until that log is compacted
                key = h.key_for(200 + n)
                assert await h.store_keys(a, primary_a, [key]) == [True]
                assert await a.delete([key]) == 1
            assert await h.load_and_check(b, primary_b, shared) == [True] * 4
    reports = await asyncio.to_thread(kvtier_async.tiers.fs.admin.verify_root, root)
    assert not [k for r in reports for k in r.corrupt] and sum(r.blocks for r in reports) >= 4
    c, primary_c = h.make_tier(str(root), capacity_bytes=capacity)
    async with c:
        assert await h.load_and_check(c, primary_c, shared) == [True] * 4


@pytest.mark.asyncio
async def test_a_log_removed_as_it_is_compacted_leaves_the_writer_a_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An rm landing between compaction's rename and the writer reopening the log by path left
    # the writer holding a closed descriptor (EBADF at close, or appends to whatever file got
    # that number next). The writer now keeps the descriptor of the file it renamed in place.
    capacity = 64 * (record_bytes_for(h.BLOCK_NBYTES) + 4 * ENTRY)  # slabs of 4 records
    tier, primary = h.make_tier(str(tmp_path), capacity_bytes=capacity)
    renamed = threading.Event()
    real_replace = os.replace

    def replace_then_remove(src: Any, dst: Any, **dir_fds: Any) -> None:
        real_replace(src, dst, **dir_fds)
        if str(dst).endswith(".idx"):
            os.unlink(dst, dir_fd=dir_fds.get("dst_dir_fd"))  # the operator's rm, just then
            renamed.set()

    monkeypatch.setattr(kvtier_async.tiers.fs.layout.os, "replace", replace_then_remove)
    async with tier:
        for n in range(12):  # one record rewritten until its slab's log is compacted
            key = h.key_for(n)
            assert await h.store_keys(tier, primary, [key]) == [True]
            assert await tier.delete([key]) == 1
        assert renamed.is_set()
        assert await h.store_keys(tier, primary, [h.key_for(100)]) == [True]
        assert await h.load_and_check(tier, primary, [h.key_for(100)]) == [True]
        assert tier.stats()["write_errors"] == 0


@contextlib.asynccontextmanager
async def ext4_turning_read_only(where: Path) -> AsyncIterator[tuple[Path, Path]]:
    """A small ext4 file system mounted with errors=remount-ro, and the sysfs file that makes
    the kernel take it read-only as on a disk error."""
    image = where / "ext4.img"
    await asyncio.to_thread(image.write_bytes, b"")
    await asyncio.to_thread(os.truncate, image, 64 << 20)
    mount = where / "ext4"
    await asyncio.to_thread(mount.mkdir)
    made = await asyncio.to_thread(subprocess.run, ["mkfs.ext4", "-q", str(image)], capture_output=True)
    mounted = await asyncio.to_thread(
        subprocess.run,
        ["mount", "-o", "loop,errors=remount-ro", str(image), str(mount)],
        capture_output=True,
    )
    if os.geteuid() != 0 or made.returncode or mounted.returncode:
        pytest.skip("mounting an ext4 image is not permitted here")
    try:
        source = await asyncio.to_thread(
            subprocess.run, ["findmnt", "-n", "-o", "SOURCE", str(mount)], capture_output=True, text=True
        )
        yield mount, Path("/sys/fs/ext4") / Path(source.stdout.strip()).name / "trigger_fs_error"
    finally:
        await asyncio.to_thread(subprocess.run, ["umount", str(mount)], check=False)


@pytest.mark.asyncio
async def test_a_file_system_turned_read_only_keeps_loads_and_logs_little(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # ext4 goes read-only on a disk error (errors=remount-ro). Every store fails from then on:
    # counted each time, logged once per kind, and what the tier holds still loads exact.
    caplog.set_level(logging.WARNING)
    async with ext4_turning_read_only(tmp_path) as (mount, trigger):
        tier, primary = h.make_tier(str(mount), capacity_bytes=64 * 16384)
        async with tier:
            held = [h.key_for(i) for i in range(8)]
            assert await h.store_keys(tier, primary, held) == [True] * 8
            await asyncio.to_thread(trigger.write_text, "kvtier test\n")
            for n in range(100):
                assert await h.store_keys(tier, primary, [h.key_for(1000 + n)]) == [False]
            assert await h.load_and_check(tier, primary, held) == [True] * 8
            stats = tier.stats()
    assert stats["write_errors"] >= 100
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(logged) <= 4, logged


@pytest.mark.parametrize("piece", READ_PIECES, ids=READ_PIECE_IDS)
def test_read_pieces_cover_every_record_once(
    tmp_path: Path, piece: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(records, "READ_PIECE_BYTES", piece)
    tier, _ = h.make_tier(str(tmp_path))
    size = tier.record_bytes
    # Records 0-2 and 7 of slab 1 (fd 11), record 3 of slab 2 (fd 12); slots out of order.
    jobs = [(11, (1, 1), 0, 5 * size), (11, (1, 0), 0, 0), (12, (2, 3), 0, size), (11, (1, 2), 0, 6 * size)]
    jobs.append((11, (1, 7), 0, 2 * size))
    pieces = tier.records.read_pieces(jobs)
    expected = {"default": 3, "halves": 2 * len(jobs), "quarters": 4 * len(jobs)}
    assert len(pieces) == expected[READ_PIECE_IDS[READ_PIECES.index(piece)]]
    assert all(p.whole for p in pieces) == (size < 2 * piece)
    base = buffer_address(tier.records.view)
    # Per job: (start, end) in its record, and where in memory that span lands (from its slot).
    spans: dict[int, list[tuple[int, int, int]]] = {n: [] for n in range(len(jobs))}
    for p in pieces:
        at = p.offset
        for view in p.iov:
            memory = buffer_address(view) - base
            for n in p.jobs:
                fd, (_, record), _, slot = jobs[n]
                start, end = max(at, record * size), min(at + len(view), (record + 1) * size)
                if start < end:
                    assert p.fd == fd
                    spans[n].append((start - record * size, end - record * size, memory + start - at - slot))
            at += len(view)
    for covered in spans.values():
        covered.sort()
        assert [c[0] for c in covered] == [0] + [c[1] for c in covered[:-1]], "a gap or an overlap"
        assert covered[-1][1] == size
        assert all(start == into for start, _, into in covered), "bytes land outside their slot"

    # What arrived, per job: the whole record, part of it, or nothing known (-1).
    done = [sum(len(v) for v in p.iov) for p in pieces]
    assert tier.records.arrived(len(jobs), pieces, done) == [size] * len(jobs)
    last = pieces[-1].jobs[-1]
    got = tier.records.arrived(len(jobs), pieces, [*done[:-1], done[-1] - 100])
    assert got[last] == size - 100 and got.count(size) == len(jobs) - 1
    got = tier.records.arrived(len(jobs), pieces, [*done[:-1], -1])
    assert [n for n, g in enumerate(got) if g == -1] == pieces[-1].jobs


@pytest.mark.asyncio
@pytest.mark.parametrize("piece", READ_PIECES, ids=READ_PIECE_IDS)
async def test_a_failed_read_misses_only_the_blocks_it_held(
    tmp_path: Path, piece: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(records, "READ_PIECE_BYTES", piece)
    tier, primary = h.make_tier(str(tmp_path))
    keys = [h.key_for(i) for i in range(8)]
    original = tier.records.read_piece
    victim = 5 * tier.record_bytes + tier.record_bytes // 2  # a file byte of record 5 (key 5)

    def failing(p: records.ReadPiece) -> int:
        if p.offset <= victim < p.offset + sum(len(v) for v in p.iov):
            return -1  # as read_piece says of an EIO
        return original(p)

    async with tier:
        assert await h.store_keys(tier, primary, keys) == [True] * 8
        tier.records.read_piece = failing  # type: ignore[method-assign]
        results = await h.load_and_check(tier, primary, keys)
        in_failed_piece = {n for n in range(8) if results[n] is False}
        assert 5 in in_failed_piece and None not in results
        if piece < tier.record_bytes:  # a part of record 5 alone failed
            assert in_failed_piece == {5}
        assert tier.stats()["corrupt_blocks"] == 0  # a fault, not damage: the blocks stay
        tier.records.read_piece = original  # type: ignore[method-assign]
        assert await h.load_and_check(tier, primary, keys) == [True] * 8


@pytest.mark.asyncio
async def test_a_block_being_read_is_never_evicted_under_the_reader(tmp_path: Path) -> None:
    capacity = 8 * (record_bytes_for(h.BLOCK_NBYTES) + 4 * ENTRY)
    tier, primary = h.make_tier(str(tmp_path), capacity_bytes=capacity)
    started, release = threading.Event(), threading.Event()
    original = tier.records.read_piece

    def gated_read(*args: Any) -> int:
        started.set()
        release.wait(timeout=60)
        return original(*args)

    async with tier:
        victim = h.key_for(0)
        await h.store_keys(tier, primary, [victim])
        tier.records.read_piece = gated_read  # type: ignore[method-assign]
        reading = asyncio.ensure_future(tier.load([victim], [20]))
        await asyncio.to_thread(started.wait, 60)
        tier.records.read_piece = original  # type: ignore[method-assign]
        # Fill the tier several times over: every other block gets evicted meanwhile.
        await h.store_in_fours(tier, primary, 1, 41)
        assert tier.stats()["evictions"] > 8
        release.set()
        assert await reading == [True]
        assert bytes(primary.slot_view(20)) == h.payload_for(victim)


@pytest.mark.asyncio
async def test_a_held_block_is_never_evicted_until_released(tmp_path: Path) -> None:
    capacity = 8 * (record_bytes_for(h.BLOCK_NBYTES) + 4 * ENTRY)
    tier, primary = h.make_tier(str(tmp_path), capacity_bytes=capacity)
    async with tier:
        victim = h.key_for(0)
        await h.store_keys(tier, primary, [victim])
        assert tier.hold([victim, h.key_for(999)]) == [True, False]  # the second is not held
        assert tier.hold([victim]) == [True]  # holds count
        await h.store_in_fours(tier, primary, 1, 41)  # the tier filled several times over
        assert tier.stats()["evictions"] > 8
        assert await h.load_and_check(tier, primary, [victim]) == [True]
        tier.release([victim])
        await h.store_keys(tier, primary, [h.key_for(i) for i in range(40, 52)])
        assert await tier.contains([victim]) == [True]  # one hold left
        tier.release([victim])
        tier.release([victim])  # one release too many: harmless
        await h.store_in_fours(tier, primary, 52, 80)
        assert await tier.contains([victim]) == [False]  # released: evicted like any other


@pytest.mark.asyncio
async def test_a_held_block_is_still_deleted_when_asked(tmp_path: Path) -> None:
    capacity = 8 * (record_bytes_for(h.BLOCK_NBYTES) + 4 * ENTRY)
    tier, primary = h.make_tier(str(tmp_path), capacity_bytes=capacity)
    async with tier:
        victim = h.key_for(0)
        await h.store_keys(tier, primary, [victim])
        assert tier.hold([victim]) == [True]
        assert await tier.delete([victim]) == 1
        assert await tier.contains([victim]) == [False]
        tier.release([victim])  # its record is room again
        assert await h.store_in_fours(tier, primary, 1, 41) == [True] * 40


@pytest.mark.asyncio
async def test_auto_falls_back_to_buffered_io_where_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No file system here refuses O_DIRECT (tmpfs takes it since Linux 6.6): the probe's
    # answer is the one it gives on one that does.
    refusal = OSError(errno.EINVAL, "Invalid argument")
    monkeypatch.setattr(kvtier_async.tiers.fs.slab_files, "probe_direct_io", lambda directory: refusal)
    tier, primary = h.make_tier(str(tmp_path / "auto"), direct_io="auto")
    keys = [h.key_for(i) for i in range(4)]
    async with tier:
        assert await h.store_keys(tier, primary, keys) == [True] * 4
        assert tier.direct_io is False
        assert await h.load_and_check(tier, primary, keys) == [True] * 4
    # O_DIRECT demanded where the file system refuses it: that can never work, the start fails.
    strict, _ = h.make_tier(str(tmp_path / "strict"), direct_io=True)
    with pytest.raises(kt.ConfigError, match="refuses O_DIRECT"):
        async with strict:
            pass
    assert strict.closed


@pytest.mark.asyncio
async def test_a_failed_o_direct_probe_that_may_pass_degrades(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(kvtier_async.tiers.fs.slab_files, "probe_direct_io", lambda directory: full)
    strict, primary = h.make_tier(str(tmp_path / "strict"), direct_io=True)
    keys = [h.key_for(i) for i in range(4)]
    # A full disk may pass: a counted fault at start and on each call that tries to open again.
    async with strict:
        assert strict.stats()["errors"] == 1
        assert await h.store_keys(strict, primary, keys) == [False] * 4
        assert strict.stats()["errors"] == 2
    monkeypatch.setattr(kvtier_async.tiers.fs.slab_files, "probe_direct_io", lambda directory: None)
    again, primary = h.make_tier(str(tmp_path / "strict"), direct_io=True)
    async with again:
        assert await h.store_keys(again, primary, keys) == [True] * 4
        assert again.direct_io is True


@pytest.mark.asyncio
async def test_cancelled_stores_leak_no_room(tmp_path: Path) -> None:
    capacity = 8 * (record_bytes_for(h.BLOCK_NBYTES) + 4 * ENTRY)
    tier, primary = h.make_tier(str(tmp_path), capacity_bytes=capacity)
    async with tier:
        for attempt in range(12):
            keys = [h.key_for(100 * attempt + i) for i in range(4)]
            task = asyncio.ensure_future(h.store_keys(tier, primary, keys))
            for _ in range(attempt % 4):
                await asyncio.sleep(0)  # scheduling points, not time
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        # Every one of the 8 records is usable again: 8 fresh blocks all fit at once.
        fresh = [h.key_for(5000 + i) for i in range(8)]
        assert await h.store_keys(tier, primary, fresh) == [True] * 8
        assert await tier.contains(fresh) == [True] * 8
        assert await h.load_and_check(tier, primary, fresh) == [True] * 8


def format_1_directory(root: Path) -> Path:
    """A namespace directory as kvtier_async wrote it before format 2 (header before each payload)."""
    from kvtier_async.block_format import namespace_id
    from kvtier_async.tiers.fs.layout import namespace_dir_name

    directory = root / namespace_dir_name(namespace_id("fs-tests"))
    directory.mkdir(parents=True)
    (directory / "NAMESPACE").write_text("fs-tests\n")
    (directory / "LOCK").write_text("process 1 on old-host (python old.py)\n")
    record = 4096 + record_bytes_for(h.BLOCK_NBYTES)
    (directory / f"slab-{record}-000000.kvs").write_bytes(bytes(4 * record))
    (directory / f"slab-{record}-000000.idx").write_bytes(bytes(4 * ENTRY))
    return directory


@pytest.mark.asyncio
async def test_a_format_1_cache_is_rebuilt_and_never_read(tmp_path: Path) -> None:
    directory = await asyncio.to_thread(format_1_directory, tmp_path)
    tier, primary = h.make_tier(str(tmp_path))
    async with tier:
        await tier.open()
        assert await tier.contains([h.key_for(0)]) == [False]
        assert await h.store_keys(tier, primary, [h.key_for(0)]) == [True]
    names = sorted(p.name for p in await asyncio.to_thread(files, directory))
    assert names == [
        "FORMAT",
        "NAMESPACE",
        f"slab-{h.BLOCK_NBYTES}-000000.idx",
        f"slab-{h.BLOCK_NBYTES}-000000.kvs",
    ]
    assert (await asyncio.to_thread((directory / "FORMAT").read_text)) == "kvtier-fs 3 plain\n"


@pytest.mark.asyncio
async def test_a_format_1_cache_in_use_by_an_old_process_is_refused_naming_it(tmp_path: Path) -> None:
    import fcntl

    directory = await asyncio.to_thread(format_1_directory, tmp_path)
    lock = await asyncio.to_thread(os.open, directory / "LOCK", os.O_RDWR)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a format-1 tier holds while open
        tier, _ = h.make_tier(str(tmp_path))
        async with tier:
            with pytest.raises(
                kt.NamespaceInUseError, match=r"format-1 cache in use by process 1 on old-host"
            ):
                await tier.open()
        assert len(await asyncio.to_thread(files, directory)) == 4  # untouched
    finally:
        os.close(lock)


@pytest.mark.asyncio
async def test_a_cache_in_a_newer_format_is_refused_and_left_alone(tmp_path: Path) -> None:
    tier, primary = h.make_tier(str(tmp_path))
    async with tier:
        assert await h.store_keys(tier, primary, [h.key_for(0)]) == [True]
    [directory] = await asyncio.to_thread(files, tmp_path, "kvtier-*")
    await asyncio.to_thread((directory / "FORMAT").write_text, "kvtier-fs 4\n")

    def listing() -> list[tuple[str, int]]:
        return sorted((p.name, p.stat().st_size) for p in directory.iterdir())

    before = await asyncio.to_thread(listing)
    tier, _ = h.make_tier(str(tmp_path))
    async with tier:
        with pytest.raises(kt.KVTierError, match=r"another format \('kvtier-fs 4'.*reads formats 2 and 3"):
            await tier.open()
    assert (
        await asyncio.to_thread(lambda: sorted((p.name, p.stat().st_size) for p in directory.iterdir()))
        == before
    )


@pytest.mark.asyncio
async def test_a_records_padding_reaches_the_primary_tier_as_zeros(tmp_path: Path) -> None:
    """Bytes past a block's end on disk are unchecked: whatever they hold (a damaged or planted
    record), the slot's padding is zeros, so no tier is ever handed them with the block."""
    assert h.BLOCK_NBYTES % 4096  # a record has padding
    tier, primary = h.make_tier(str(tmp_path), direct_io=False)
    keys = [b"padded-%d" % i for i in range(4)]
    async with tier:
        assert await h.store_keys(tier, primary, keys) == [True] * 4
        directory = tier.directory
    [data] = await asyncio.to_thread(lambda: list(directory.glob("slab-*.kvs")))
    record = -(-h.BLOCK_NBYTES // 4096) * 4096

    def dirty_padding() -> None:
        with open(data, "r+b") as f:
            for n in range(4):
                f.seek(n * record + h.BLOCK_NBYTES)
                f.write(b"\xee" * (record - h.BLOCK_NBYTES))

    await asyncio.to_thread(dirty_padding)
    again, fresh = h.make_tier(str(tmp_path), direct_io=False)
    fresh.buffer.fill_(0x5A)  # the slots' padding held something before the load
    async with again:
        assert await again.load(keys, [4, 5, 6, 7]) == [True] * 4
    for slot in (4, 5, 6, 7):
        assert not fresh.buffer[slot, h.BLOCK_NBYTES :].any()


@pytest.mark.asyncio
@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
async def test_removal_listeners_hear_of_keys_not_names(
    sealed: bool, tmp_path: Path, tier_secret_env: str
) -> None:
    """With a secret the index holds keyed names; evictions still reach listeners as keys."""
    extra = {"secret_env": tier_secret_env} if sealed else {}
    record = -(-h.BLOCK_NBYTES // 4096) * 4096 + (4096 if sealed else 0)
    tier, primary = h.make_tier(str(tmp_path), capacity_bytes=4 * (record + 4 * 256), **extra)
    removed: list[bytes] = []
    tier.removal_listeners.append(removed.extend)
    keys = [b"listened-%d" % i for i in range(12)]
    async with tier:
        for key in keys:  # one at a time: each store may evict the oldest
            assert await h.store_keys(tier, primary, [key]) == [True]
        assert removed and set(removed) <= set(keys)
        assert await tier.contains(removed) == [False] * len(removed)
