from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier_async.cli import main

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
