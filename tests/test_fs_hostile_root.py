"""The fs tier's root as another local user could leave it: each case is an attack, on a real
file system, and the tier either refuses the root with a clear error or skips what was planted."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

import kvtier_async as kt
import kvtier_async.tiers.fs
from kvtier_async.cli import main
from kvtier_async.testing import make_key

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

    from kvtier_async.tiers.fs.layout import read_log

    root, directory = stored_root(tmp_path)
    [log] = directory.glob("slab-*.idx")
    with open(log, "r+b") as f:
        f.truncate(8 << 30)  # 8 GiB of holes after the real entries
    tracemalloc.start()
    try:
        entries, _, _ = read_log(log)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(entries) == 2
    assert peak < 8 << 20
    assert main(["fs", "stat", str(root)]) == 0


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
