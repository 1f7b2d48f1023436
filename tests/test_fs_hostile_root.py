"""The fs tier's root as another local user could leave it: each case is an attack, on a real
file system, and the tier either refuses the root with a clear error or skips what was planted."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any

import fs_helpers as h
import pytest

import kvtier_async as kt
import kvtier_async.tiers.fs
from kvtier_async.cli import main
from kvtier_async.testing import make_key
from kvtier_async.tiers.fs.layout import ENTRY, record_bytes_for

BLOCK = 4096
NAMESPACE = "hostile-root"


def make_tier(root: Path) -> tuple[kvtier_async.tiers.fs.FileSystemTier, kt.PrimaryTier]:
    spec = kt.OffloadingSpec(block_nbytes=BLOCK, num_cpu_blocks=8, namespace=NAMESPACE)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    return kvtier_async.tiers.fs.FileSystemTier(spec, primary.view, root=root), primary


@pytest.mark.asyncio
async def test_root_open_to_others_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    await asyncio.to_thread(root.mkdir, mode=0o700)
    await asyncio.to_thread(os.chmod, root, 0o777)
    tier, _ = make_tier(root)
    with pytest.raises(kt.ConfigError, match="written by group or others"):
        await tier.open()
    await tier.aclose()


@pytest.mark.asyncio
async def test_root_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    root = tmp_path / "root"
    await asyncio.to_thread(root.mkdir, mode=0o700)
    await asyncio.to_thread(os.chown, root, 65534, 65534)
    tier, _ = make_tier(root)
    with pytest.raises(kt.ConfigError, match="belongs to uid 65534"):
        await tier.open()
    await tier.aclose()


@pytest.mark.asyncio
async def test_symlinked_namespace_directory_is_refused_and_untouched(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    await asyncio.to_thread(root.mkdir, mode=0o700)
    await asyncio.to_thread(elsewhere.mkdir, mode=0o755)
    tier, _ = make_tier(root)
    await asyncio.to_thread(tier.directory.symlink_to, elsewhere)
    with pytest.raises(kt.ConfigError, match="not a plain directory"):
        await tier.open()
    await tier.aclose()
    assert await asyncio.to_thread(os.listdir, elsewhere) == []
    assert (await asyncio.to_thread(os.stat, elsewhere)).st_mode & 0o777 == 0o755


@pytest.mark.asyncio
async def test_gc_never_follows_a_planted_tmp_symlink(tmp_path: Path) -> None:
    root, victim = tmp_path / "root", tmp_path / "victim"
    await asyncio.to_thread(victim.write_bytes, b"precious")
    tier, _ = make_tier(root)
    keys = [make_key(i) for i in range(4)]
    async with tier:
        assert await tier.store(keys, list(range(4))) == [True] * 4
        await tier.delete(keys[:2])  # leaves deletions for gc to compact away
    [log] = await asyncio.to_thread(lambda: list(tier.directory.glob("slab-*.idx")))
    await asyncio.to_thread(log.with_name(log.name + ".tmp").symlink_to, victim)
    assert await asyncio.to_thread(main, ["fs", "gc", str(root), "--capacity", "1G"]) == 0
    assert await asyncio.to_thread(victim.read_bytes) == b"precious"


@pytest.mark.asyncio
async def test_a_fifo_named_like_an_index_hangs_nothing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    tier, _ = make_tier(root)
    keys = [make_key(i) for i in range(2)]
    async with tier:
        assert await tier.store(keys, [0, 1]) == [True, True]
        [data] = await asyncio.to_thread(lambda: list(tier.directory.glob("slab-*.kvs")))
        planted = data.with_name(data.name.replace("000000", "000007"))
        await asyncio.to_thread(os.mkfifo, planted.with_suffix(".idx"), 0o600)
        await asyncio.to_thread(planted.write_bytes, b"")
        skipped = tier.stats()["foreign_files_skipped"]
        await tier.refresh()
        assert await tier.lookup([make_key(9)]) == 0  # a miss reads the other slabs' logs
        assert tier.stats()["foreign_files_skipped"] > skipped
        assert await tier.load(keys, [2, 3]) == [True, True]
    again, _ = make_tier(root)  # a restart replays every log
    async with again:
        assert await again.lookup(keys) == 2


def stored_root(tmp_path: Path) -> tuple[Path, Path]:
    """A root with one namespace holding two blocks (made on a loop of its own)."""
    root = tmp_path / "root"

    async def store() -> Path:
        tier, _ = make_tier(root)
        async with tier:
            assert await tier.store([make_key(0), make_key(1)], [0, 1]) == [True, True]
        return tier.directory

    return root, asyncio.run(store())


def test_sparse_huge_index_is_not_read_whole(tmp_path: Path) -> None:
    import tracemalloc

    from kvtier_async.tiers.fs.layout import Folder, read_log

    root, directory = stored_root(tmp_path)
    [log] = directory.glob("slab-*.idx")
    with open(log, "r+b") as f:
        f.truncate(8 << 30)  # 8 GiB of holes after the real entries
    tracemalloc.start()
    try:
        with Folder.open(directory) as folder:
            entries, _, _ = read_log(folder / log.name)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(entries) == 2
    assert peak < 8 << 20
    assert main(["fs", "stat", str(root)]) == 0


def test_fs_verify_reads_a_log_with_a_second_name_once(tmp_path: Path) -> None:
    # The attack: a slab's log hard-linked as another slab's (next to a copy of its data), so
    # that `kvtier fs verify` reads and checks the same entries twice.
    from kvtier_async.tiers.fs.admin import verify_root

    root, directory = stored_root(tmp_path)
    [real] = directory.glob("slab-*-000000.kvs")
    data = real.with_name(real.name.replace("000000", "000001"))
    shutil.copyfile(real, data)
    data.chmod(0o600)
    os.link(real.with_suffix(".idx"), data.with_suffix(".idx"))
    [report] = verify_root(root)
    assert (report.checked, report.slabs, report.corrupt) == (2, 1, [])


def test_crafted_names_and_namespace_text_are_harmless(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvtier_async.tiers.fs.layout import encode_entry

    root, directory = stored_root(tmp_path)
    huge = directory / f"slab-{1 << 60}-000000"
    huge.with_suffix(".kvs").write_bytes(b"")
    huge.with_suffix(".idx").write_bytes(encode_entry(1, 0, b"k" * 32, 0))
    (directory / "NAMESPACE").write_text("evil\x1b]0;owned\x07\x1b[2J\n")
    for command in ("stat", "verify"):
        assert main(["fs", command, str(root)]) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\x07" not in out
        assert "evil\\x1b]0;owned\\x07" in out


def test_fs_verify_checks_a_sealed_namespace(
    tmp_path: Path, tier_secret_env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    spec = kt.OffloadingSpec(block_nbytes=BLOCK, num_cpu_blocks=8, namespace=NAMESPACE)
    primary = kt.PrimaryTier(spec, pin_memory=False)

    async def store() -> None:
        config = {"type": "fs", "root": str(root), "secret_env": tier_secret_env}
        async with kt.SecondaryTierFactory.create_secondary_tier(config, primary.view, spec) as tier:
            assert await tier.store([make_key(0), make_key(1)], [0, 1]) == [True, True]

    asyncio.run(store())
    assert main(["fs", "verify", str(root)]) == 0
    out = capsys.readouterr().out
    assert "2 blocks checked, 0 corrupt" in out and NAMESPACE not in out


def copy_slab(directory: Path, to: int) -> tuple[Path, Path]:
    """Slab 0's log copied under slab number `to` (its data file left for the caller to plant)."""
    [log] = directory.glob("slab-*-000000.idx")
    data, log_copy = (
        log.with_name(log.name.replace("000000", f"{to:06d}")).with_suffix(s) for s in (".kvs", ".idx")
    )
    shutil.copyfile(log, log_copy)
    return data, log_copy


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "plant", ["symlink", "fifo", "writable by others", "another user's", "another user's 0600"]
)
async def test_a_planted_slab_data_file_is_skipped_counted_and_the_tier_opens(
    tmp_path: Path, plant: str
) -> None:
    # The attack: a slab's data file is a symlink, a FIFO, a file others may write (0666) or
    # another user's file (0600: only the owner check stands between it and the tier).
    root = str(tmp_path / "root")
    tier, primary = h.make_tier(root)
    keys = [h.key_for(i) for i in range(4)]
    async with tier:
        assert await h.store_keys(tier, primary, keys) == [True] * 4
    [real] = await asyncio.to_thread(lambda: list(tier.directory.glob("slab-*-000000.kvs")))
    data, _ = await asyncio.to_thread(copy_slab, tier.directory, 5)
    if plant == "symlink":
        await asyncio.to_thread(data.symlink_to, real)
    elif plant == "fifo":
        await asyncio.to_thread(os.mkfifo, data, 0o600)
    else:
        if plant.startswith("another user's") and os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        await asyncio.to_thread(shutil.copyfile, real, data)
        await asyncio.to_thread(os.chmod, data, 0o600 if plant.endswith("0600") else 0o666)
        if plant.startswith("another user's"):
            await asyncio.to_thread(os.chown, data, 65534, 65534)
    skipped = kvtier_async.tiers.fs.layout.foreign_files_skipped()
    again, primary = h.make_tier(root)  # a restart reads every slab's log and opens its data
    async with again:
        assert await h.load_and_check(again, primary, keys) == [True] * 4
        assert again.stats()["shared_slabs"] == 1  # slab 0 only: the planted one is not used
        assert again.stats()["foreign_files_skipped"] == skipped + 1
    assert await asyncio.to_thread(main, ["fs", "verify", root]) == 0
    assert await asyncio.to_thread(main, ["fs", "stat", root]) == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("plant", ["symlink", "writable by others", "another user's"])
async def test_a_planted_index_log_is_skipped_counted_and_the_tier_opens(tmp_path: Path, plant: str) -> None:
    # The attack: where a slab's index log belongs, a symlink to another slab's log, a log others
    # may write (0666) or another user's log (0600), next to a good data file.
    if plant == "another user's" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    root = str(tmp_path / "root")
    tier, primary = h.make_tier(root)
    keys = [h.key_for(i) for i in range(4)]
    async with tier:
        assert await h.store_keys(tier, primary, keys) == [True] * 4
    [real] = await asyncio.to_thread(lambda: list(tier.directory.glob("slab-*-000000.kvs")))
    data, log_copy = await asyncio.to_thread(copy_slab, tier.directory, 5)
    await asyncio.to_thread(shutil.copyfile, real, data)
    await asyncio.to_thread(os.chmod, data, 0o600)
    if plant == "symlink":
        await asyncio.to_thread(log_copy.unlink)
        await asyncio.to_thread(log_copy.symlink_to, real.with_suffix(".idx"))
    elif plant == "writable by others":
        await asyncio.to_thread(os.chmod, log_copy, 0o666)
    else:
        await asyncio.to_thread(os.chmod, log_copy, 0o600)
        await asyncio.to_thread(os.chown, log_copy, 65534, 65534)
    skipped = kvtier_async.tiers.fs.layout.foreign_files_skipped()
    again, primary = h.make_tier(root)  # a restart reads every slab's log and opens its data
    async with again:
        assert await h.load_and_check(again, primary, keys) == [True] * 4
        assert again.stats()["shared_slabs"] == 1  # slab 0 only: the planted log is not read
        assert again.stats()["foreign_files_skipped"] == skipped + 1
        new_keys = [h.key_for(i) for i in range(4, 8)]  # and the tier goes on storing
        assert await h.store_keys(again, primary, new_keys) == [True] * 4
        assert await h.load_and_check(again, primary, new_keys) == [True] * 4


@pytest.mark.asyncio
async def test_a_slab_with_foreign_data_costs_no_read_of_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The attack: slabs whose data file is a symlink next to a valid log, planted under many
    # numbers: each refresh read every such log before finding the data foreign, outside the
    # refresh's entry budget (its entries never charged).
    from kvtier_async.tiers.fs import slab_files

    root = str(tmp_path / "root")
    tier, primary = h.make_tier(root)
    keys = [h.key_for(i) for i in range(4)]
    async with tier:
        assert await h.store_keys(tier, primary, keys) == [True] * 4
    [real] = await asyncio.to_thread(lambda: list(tier.directory.glob("slab-*-000000.kvs")))
    for slab in range(1, 7):
        data, _ = await asyncio.to_thread(copy_slab, tier.directory, slab)
        await asyncio.to_thread(data.symlink_to, real)
    logs_read: list[str] = []
    real_read_log = slab_files.read_log

    def counting_read_log(path: Any, *args: Any) -> Any:
        logs_read.append(str(path))
        return real_read_log(path, *args)

    monkeypatch.setattr(slab_files, "read_log", counting_read_log)
    skipped = kvtier_async.tiers.fs.layout.foreign_files_skipped()
    again, primary = h.make_tier(root)
    async with again:
        await again.refresh()  # and once more: the planted slabs are still not known
        assert await h.load_and_check(again, primary, keys) == [True] * 4
        assert again.stats()["shared_slabs"] == 1
        assert again.stats()["foreign_files_skipped"] >= skipped + 6
    assert not [p for p in logs_read if "-000000.idx" not in p], logs_read


@pytest.mark.asyncio
async def test_a_namespace_directory_swapped_after_open_is_never_followed(tmp_path: Path) -> None:
    # The attack: once the tier is open, its namespace directory is moved away and a symlink to
    # another directory put in its place; the tier goes on storing and claims new slabs.
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    await asyncio.to_thread(elsewhere.mkdir, mode=0o700)
    capacity = 64 * (record_bytes_for(h.BLOCK_NBYTES) + 4 * ENTRY)  # 16 slabs of 4 records
    tier, primary = h.make_tier(str(root), capacity_bytes=capacity)
    async with tier:
        assert await h.store_in_fours(tier, primary, 0, 4) == [True] * 4
        await asyncio.to_thread(tier.directory.rename, root / "moved")
        await asyncio.to_thread(tier.directory.symlink_to, elsewhere)
        assert await h.store_in_fours(tier, primary, 4, 32) == [True] * 28
        assert tier.stats()["slabs"] > 1
        assert await h.load_and_check(tier, primary, [h.key_for(i) for i in range(24, 32)]) == [True] * 8
    assert await asyncio.to_thread(os.listdir, elsewhere) == []


@pytest.mark.parametrize("command", [["stat"], ["verify"], ["gc", "--capacity", "1G"]])
def test_fs_commands_check_root_as_the_tier_does(
    tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # The attack: a root others may write to (0777), handed to `kvtier fs`.
    root, _ = stored_root(tmp_path)
    root.chmod(0o777)
    assert main(["fs", command[0], str(root), *command[1:]]) == 2
    assert "may be written by group or others" in capsys.readouterr().err


def plant_log_bomb(directory: Path, block_nbytes: int, links: range) -> None:
    """One valid 8 MiB index log (entries naming records 0-3 over and over), hard-linked as the
    log of every slab number in `links`, each with an empty data file."""
    from kvtier_async.tiers.fs.layout import encode_entry

    entries = (8 << 20) // ENTRY
    bomb = directory / f"slab-{block_nbytes}-{links[0]:06d}.idx"
    bomb.write_bytes(
        b"".join(encode_entry(1 + n, n % 4, n.to_bytes(32, "little"), n) for n in range(entries))
    )
    for slab in links:
        data = directory / f"slab-{block_nbytes}-{slab:06d}.kvs"
        data.write_bytes(b"")
        if slab != links[0]:
            os.link(bomb, data.with_suffix(".idx"))


@pytest.mark.asyncio
async def test_a_hard_linked_index_log_bomb_is_read_once_within_the_capacity(tmp_path: Path) -> None:
    # The attack: one valid 8 MiB index log hard-linked under 40 slab numbers, most beyond what
    # the namespace's capacity allows, to multiply what a restart reads into memory.
    import tracemalloc

    root = str(tmp_path / "root")
    capacity = 64 * (record_bytes_for(h.BLOCK_NBYTES) + 4 * ENTRY)  # 16 slabs of 4 records
    tier, primary = h.make_tier(root, capacity_bytes=capacity)
    keys = [h.key_for(i) for i in range(4)]
    async with tier:
        assert await h.store_keys(tier, primary, keys) == [True] * 4
    await asyncio.to_thread(plant_log_bomb, tier.directory, tier.files.block_nbytes, range(1, 41))
    skipped = kvtier_async.tiers.fs.layout.foreign_files_skipped()
    again, primary = h.make_tier(root, capacity_bytes=capacity)
    tracemalloc.start()
    try:
        async with again:
            peak = tracemalloc.get_traced_memory()[1]
            assert await h.load_and_check(again, primary, keys) == [True] * 4
            # Slabs 2-15 are the bomb's second names below the capacity's 16 slabs: read once.
            assert again.stats()["foreign_files_skipped"] == skipped + 14
    finally:
        tracemalloc.stop()
    # The refresh's budget of entries (~0.1 MiB here), not one whole log (~12 MiB of entries
    # once read, so a tier reading the log whole fails this), let alone forty.
    assert peak < 4 << 20, f"opening allocated up to {peak >> 10} KiB"


def plant_logs(directory: Path, block_nbytes: int, slabs: range, entries: int) -> None:
    """A log of its own (no shared inode) of `entries` valid entries for each slab number in
    `slabs`, each with an empty data file of ours."""
    from kvtier_async.tiers.fs.layout import encode_entry

    for slab in slabs:
        data = directory / f"slab-{block_nbytes}-{slab:06d}.kvs"
        data.write_bytes(b"")
        data.chmod(0o600)
        log_bytes = b"".join(
            encode_entry(1 + n, n % 4, (slab * entries + n).to_bytes(32, "little"), n) for n in range(entries)
        )
        data.with_suffix(".idx").write_bytes(log_bytes)
        data.with_suffix(".idx").chmod(0o600)


@pytest.mark.asyncio
async def test_one_refresh_reads_no_more_entries_than_its_budget_across_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The attack: valid logs planted under every slab number the capacity allows, each within
    # the per-log bound, together far beyond what an index of this capacity holds.
    from kvtier_async.tiers.fs import slab_files

    root = str(tmp_path / "root")
    capacity = 64 * (record_bytes_for(h.BLOCK_NBYTES) + 4 * ENTRY)  # 16 slabs of 4 records
    tier, primary = h.make_tier(root, capacity_bytes=capacity)
    keys = [h.key_for(i) for i in range(4)]
    async with tier:
        assert await h.store_keys(tier, primary, keys) == [True] * 4
    await asyncio.to_thread(plant_logs, tier.directory, tier.files.block_nbytes, range(1, 16), 100)
    entries_read: list[int] = []
    real_read_log = slab_files.read_log

    def counting_read_log(path: Any, *args: Any) -> Any:
        entries, end, inode = real_read_log(path, *args)
        entries_read.append(len(entries))
        return entries, end, inode

    monkeypatch.setattr(slab_files, "read_log", counting_read_log)
    again, primary = h.make_tier(root, capacity_bytes=capacity)
    async with again:  # opening is one refresh
        budget = again.files.entries_per_refresh
        assert 15 * again.files.entries_per_log > budget  # the logs together exceed it
        assert 0 < sum(entries_read) <= budget
        assert max(entries_read) <= again.files.entries_per_log  # 8 a record of a slab, a log
        assert await h.load_and_check(again, primary, keys) == [True] * 4
        entries_read.clear()
        await again.refresh()  # the next refresh reads on, within the budget again
        assert 0 < sum(entries_read) <= budget
        assert await h.load_and_check(again, primary, keys) == [True] * 4


def sealed_root(tmp_path: Path, secret_env: str, *, format_2: bool = False) -> tuple[Path, Path]:
    """A root with one sealed namespace holding two blocks; `format_2`: its directory made as
    kvtier_async before format 3 made it (a FORMAT that records no kind)."""
    root = tmp_path / "root"

    async def store() -> Path:
        tier, primary = h.make_tier(str(root), secret_env=secret_env)
        if format_2:
            tier.directory.mkdir(parents=True, mode=0o700)
            (tier.directory / "FORMAT").write_text("kvtier-fs 2\n")
        async with tier:
            assert await h.store_keys(tier, primary, [h.key_for(0), h.key_for(1)]) == [True, True]
        again, primary = h.make_tier(str(root), secret_env=secret_env)
        async with again:
            assert await h.load_and_check(again, primary, [h.key_for(0), h.key_for(1)]) == [True, True]
        return tier.directory

    return root, asyncio.run(store())


def flip_a_payload_byte(directory: Path) -> None:
    """One byte flipped inside the first live record's ciphertext (not its header, not its tag)."""
    from kvtier_async.tiers.fs.layout import Folder, latest_per_record, read_log

    [data] = directory.glob("slab-*.kvs")
    with Folder.open(directory) as folder:
        entries, _, _ = read_log(folder / data.with_suffix(".idx").name)
    record = min(r for r, e in latest_per_record(entries).items() if not e.deleted)
    with open(data, "r+b") as f:
        f.seek(record * record_bytes_for(int(data.name.split("-")[1])) + 36 + 1000)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))


def test_fs_verify_opens_sealed_records_with_the_secret(
    tmp_path: Path, tier_secret_env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The attack: one ciphertext byte of a sealed block flipped, where neither the record's
    # header nor its tag (all that verify checked) changes.
    root, directory = sealed_root(tmp_path, tier_secret_env)
    flip_a_payload_byte(directory)
    assert main(["fs", "verify", str(root)]) == 0
    assert "payloads not checked: give the tier secret" in capsys.readouterr().out
    assert main(["fs", "verify", str(root), "--secret-env", tier_secret_env]) == 1
    out = capsys.readouterr().out
    assert "2 blocks checked, 1 corrupt" in out and "not checked" not in out
    assert "fs-tests: 2 blocks checked" in out  # with the secret, the namespace's own name
    assert main(["fs", "verify", str(root), "--secret-env", tier_secret_env, "--remove"]) == 1
    assert main(["fs", "verify", str(root), "--secret-env", tier_secret_env]) == 0
    assert "1 blocks checked, 0 corrupt" in capsys.readouterr().out


def test_fs_verify_with_another_secret_checks_no_payload(
    tmp_path: Path, tier_secret_env: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = sealed_root(tmp_path, tier_secret_env)
    from kvtier_async.secret import new_secret

    monkeypatch.setenv("OTHER_SECRET", new_secret())
    assert main(["fs", "verify", str(root), "--secret-env", "OTHER_SECRET"]) == 0
    assert "the secret given is not this namespace's" in capsys.readouterr().out


def test_a_plain_namespace_named_like_the_sealed_label_is_not_misread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The attack: a plain namespace named exactly like the label a sealed namespace's NAMESPACE
    # file carries, so that verify took its blocks for sealed ones: all "corrupt", and removed.
    from kvtier_async.tiers.fs.layout import SEALED_NAMESPACE_LABEL

    root = tmp_path / "root"

    async def store() -> None:
        tier, primary = h.make_tier(str(root), namespace=SEALED_NAMESPACE_LABEL)
        async with tier:
            assert await h.store_keys(tier, primary, [h.key_for(0), h.key_for(1)]) == [True, True]

    asyncio.run(store())
    assert main(["fs", "verify", str(root), "--remove"]) == 0
    assert "2 blocks checked, 0 corrupt" in capsys.readouterr().out


def test_a_format_2_sealed_root_still_loads_and_verify_flags_no_good_block(
    tmp_path: Path, tier_secret_env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root, directory = sealed_root(tmp_path, tier_secret_env, format_2=True)
    assert (directory / "FORMAT").read_text() == "kvtier-fs 2\n"  # left as it was
    assert main(["fs", "verify", str(root), "--secret-env", tier_secret_env, "--remove"]) == 0
    out = capsys.readouterr().out
    assert "2 blocks checked, 0 corrupt" in out and "sealed payloads not checked (format 2" in out


def test_index_entries_tell_the_write_time_to_the_second_only(tmp_path: Path) -> None:
    # The attack: reading a root's index logs (no secret needed) for when each block was
    # written, to the nanosecond: the timing of another tenant's requests.
    from kvtier_async.tiers.fs.layout import SEQ_GRAIN_NS, Folder, read_log

    _, directory = stored_root(tmp_path)
    [log] = directory.glob("slab-*.idx")
    with Folder.open(directory) as folder:
        entries, _, _ = read_log(folder / log.name)
    assert len(entries) == 2
    # A whole grain (about a second) of wall clock, then a count: nothing finer of the clock.
    assert all(e.seq % SEQ_GRAIN_NS < len(entries) for e in entries)


@pytest.mark.asyncio
async def test_an_entry_numbered_far_ahead_does_not_stop_the_writers(tmp_path: Path) -> None:
    # The attack: a planted log entry whose sequence number is the largest there is, so that a
    # process numbering its entries past what it read would have no number left to write.
    from kvtier_async.tiers.fs.layout import encode_entry

    root = str(tmp_path / "root")
    tier, primary = h.make_tier(root)
    async with tier:
        assert await h.store_keys(tier, primary, [h.key_for(0)]) == [True]
    planted = tier.directory / f"slab-{tier.files.block_nbytes}-000003"
    await asyncio.to_thread(planted.with_suffix(".kvs").write_bytes, b"")
    await asyncio.to_thread(planted.with_suffix(".idx").write_bytes, encode_entry(2**64 - 1, 0, b"k" * 32, 0))
    again, primary = h.make_tier(root)
    async with again:
        keys = [h.key_for(i) for i in range(1, 5)]
        assert await h.store_keys(again, primary, keys) == [True] * 4
        assert await h.load_and_check(again, primary, keys) == [True] * 4
        assert again.stats()["write_errors"] == 0


@pytest.mark.asyncio
async def test_a_slab_with_an_overlong_log_is_adopted_without_reading_it_whole(tmp_path: Path) -> None:
    # The attack: a slab within the capacity, with no writer, whose log (one name) holds 32 MiB
    # of valid entries: the process that takes the slab over would read it all into memory.
    import tracemalloc

    from kvtier_async.tiers.fs.layout import encode_entry

    root = str(tmp_path / "root")
    capacity = 64 * (record_bytes_for(h.BLOCK_NBYTES) + 4 * ENTRY)  # 16 slabs of 4 records
    tier, primary = h.make_tier(root, capacity_bytes=capacity)
    async with tier:  # makes the directory; its own slab is then taken by the planted ones
        await tier.open()

    def plant() -> None:
        stem = tier.directory / f"slab-{tier.files.block_nbytes}-"
        for slab in range(16):  # every number the capacity allows: only adoption is left
            (tier.directory / f"{stem.name}{slab:06d}.kvs").write_bytes(b"")
        long_log = b"".join(
            encode_entry(1 + n, n % 4, n.to_bytes(32, "little"), n) for n in range((32 << 20) // ENTRY)
        )
        (tier.directory / f"{stem.name}000000.idx").write_bytes(long_log)

    await asyncio.to_thread(plant)
    again, primary = h.make_tier(root, capacity_bytes=capacity)
    async with again:
        tracemalloc.start()
        try:
            assert await h.store_keys(again, primary, [h.key_for(0)]) == [True]  # adopts a slab
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert await h.load_and_check(again, primary, [h.key_for(0)]) == [True]
    assert peak < 16 << 20


@pytest.mark.asyncio
async def test_a_slab_whose_log_has_a_second_name_is_not_taken_over(tmp_path: Path) -> None:
    # The attack: a slab's log hard-linked to a file elsewhere in the directory, so that the
    # process taking the slab over would write (and truncate) that other file.
    from kvtier_async.tiers.fs.layout import encode_entry

    root = str(tmp_path / "root")
    capacity = 64 * (record_bytes_for(h.BLOCK_NBYTES) + 4 * ENTRY)  # 16 slabs of 4 records
    tier, primary = h.make_tier(root, capacity_bytes=capacity)
    async with tier:
        await tier.open()
    victim = tier.directory / "victim"
    stem = f"slab-{tier.files.block_nbytes}-"

    def plant() -> None:
        for slab in range(16):  # every number the capacity allows: only adoption is left
            (tier.directory / f"{stem}{slab:06d}.kvs").write_bytes(b"")
        victim.write_bytes(encode_entry(1, 0, b"v" * 32, 7))
        os.link(victim, tier.directory / f"{stem}000000.idx")

    await asyncio.to_thread(plant)
    before = await asyncio.to_thread(victim.read_bytes)
    skipped = kvtier_async.tiers.fs.layout.foreign_files_skipped()
    again, primary = h.make_tier(root, capacity_bytes=capacity)
    async with again:
        assert await h.store_keys(again, primary, [h.key_for(0)]) == [False]  # no slab to take
        assert again.stats()["foreign_files_skipped"] == skipped + 1
    assert await asyncio.to_thread(victim.read_bytes) == before
