from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier_async.cli import _size, main

TINY = [
    "demo",
    "--conversations",
    "4",
    "--turns",
    "3",
    "--concurrency",
    "3",
    "--layers",
    "2",
    "--kv-heads",
    "2",
    "--head-dim",
    "32",
    "--device-blocks",
    "40",
    "--num-cpu-blocks",
    "6",
    "--no-progress",
]


def test_demo_runs_and_verifies(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(TINY) == 0
    out = capsys.readouterr().out
    assert "0 mismatches" in out and "OK: every loaded byte matched" in out
    assert "promoted" in out  # the small primary tier forced promotions from the memory tier


def test_demo_fails_on_wrong_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiers = tmp_path / "tiers.json"
    tiers.write_text(json.dumps([{"type": "LyingTier", "module_path": "probe_tier"}]))
    assert main([*TINY, "--tiers", str(tiers)]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_demo_reports_bad_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY, "--tiers", '[{"type": "nope"}]']) == 2
    assert "unknown tier type 'nope'" in capsys.readouterr().err


def test_console_script_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier_async.cli", "demo", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout
    for option in ("--conversations", "--concurrency", "--tiers", "--num-cpu-blocks"):
        assert option in out


def _store_some(root: Path, count: int, namespace: str = "cli-tests") -> list[bytes]:
    import asyncio

    import fs_helpers as h

    async def go() -> list[bytes]:
        tier, primary = h.make_tier(str(root), namespace=namespace, num_cpu_blocks=16)
        keys = [h.key_for(i) for i in range(count)]
        async with tier:
            for start in range(0, count, 16):
                assert all(await h.store_keys(tier, primary, keys[start : start + 16]))
        return keys

    return asyncio.run(go())


def test_fs_stat_verify_and_gc(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import fs_helpers as h

    from kvtier_async.tiers.fs.layout import record_bytes_for

    _store_some(tmp_path, 40)
    _store_some(tmp_path, 5, namespace="other-model")
    assert main(["fs", "stat", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "cli-tests" in out and "other-model" in out and " 40 " in out

    assert main(["fs", "verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "cli-tests: 40 blocks checked, 0 corrupt" in out
    assert out.endswith("2 namespace/block-size groups, 45 blocks checked, 0 corrupt\n")
    slabs = [
        p
        for p in tmp_path.glob("kvtier-*/slab-*.kvs")
        if (p.parent / "NAMESPACE").read_text().strip() == "cli-tests"
    ]
    record = record_bytes_for(h.BLOCK_NBYTES)
    with open(slabs[0], "r+b") as f:
        f.seek(3 * record + 4096 + 7)
        f.write(b"\xff\xfe")
    assert main(["fs", "verify", str(tmp_path)]) == 1
    assert capsys.readouterr().out.endswith("45 blocks checked, 1 corrupt\n")
    assert main(["fs", "verify", str(tmp_path), "--remove"]) == 1
    assert main(["fs", "verify", str(tmp_path)]) == 0
    capsys.readouterr()

    before = sum(p.stat().st_size for p in tmp_path.rglob("slab-*"))
    assert main(["fs", "gc", str(tmp_path), "--capacity", "1K"]) == 0
    assert "removed" in capsys.readouterr().out
    after = sum(p.stat().st_size for p in tmp_path.rglob("slab-*"))
    assert after < before
    assert main(["fs", "stat", str(tmp_path)]) == 0
    assert "0.000 GiB in all" in capsys.readouterr().out  # 1 KiB holds no slab


def test_fs_commands_report_a_missing_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fs", "stat", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_fs_commands_say_when_a_root_holds_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An empty directory is a valid root (nothing stored yet), but silence would hide a
    # command pointed at the wrong directory: each command ends with what it found.
    assert main(["fs", "stat", str(tmp_path)]) == 0
    assert "0 namespace/block-size groups, 0.000 GiB in all" in capsys.readouterr().out
    assert main(["fs", "verify", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "0 namespace/block-size groups, 0 blocks checked, 0 corrupt\n"
    assert main(["fs", "gc", str(tmp_path), "--capacity", "1G"]) == 0
    assert capsys.readouterr().out == "0 namespace/block-size groups, removed 0.000 GiB in all\n"


@pytest.mark.parametrize(
    ("text", "value"),
    [("1024", 1024), ("8G", 8 << 30), ("500M", 500 << 20), ("1.5GiB", 3 << 29), ("4k", 4096)],
)
def test_sizes(text: str, value: int) -> None:
    assert _size(text) == value


def test_secret_new_prints_a_fresh_256_bit_secret(capsys: pytest.CaptureFixture[str]) -> None:
    printed = []
    for _ in range(2):
        assert main(["secret", "new"]) == 0
        printed.append(capsys.readouterr().out.strip())
    assert printed[0] != printed[1]
    assert all(len(bytes.fromhex(p)) == 32 for p in printed)


@pytest.mark.parametrize(
    "command", [["bench"], ["replay", "trace.jsonl"], ["replay", "trace.jsonl", "--sweep"]]
)
def test_plot_without_matplotlib_fails_before_any_work(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    plot = tmp_path / "out.png"
    assert main([*command, "--plot", str(plot), "--dir", str(tmp_path), "--no-progress"]) == 2
    assert f"kvtier {command[0]}: --plot needs matplotlib" in capsys.readouterr().err
    assert not plot.exists() and list(tmp_path.iterdir()) == []  # no trace read, no tier made
