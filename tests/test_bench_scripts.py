"""The benchmark scripts still run (at a tiny size); their numbers are not checked here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_fs_tier_bench_runs(tmp_path: Path) -> None:
    out = tmp_path / "fs.json"
    subprocess.run(
        [
            sys.executable,
            str(BENCH / "fs_tier.py"),
            "--gib",
            "0.01",
            "--threads",
            "2",
            "--repeat",
            "1",
            "--aiofiles",
            "--dir",
            str(tmp_path),
            "--json",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    rows = json.loads(out.read_text())
    assert {row["block_kib"] for row in rows} == {2048, 64}
    assert all(row["tier"]["store_gbps"] > 0 and row["raw"]["load_gbps"] > 0 for row in rows)


def test_fs_open_bench_runs(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH / "fs_open.py"), "--blocks", "500", "--dir", str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "open (cold)" in result.stdout


def test_gpu_check_runs_on_the_cpu_fallback() -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py"), "--small"],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "byte-exact True" in result.stdout and "False" not in result.stdout
    assert "pipeline through the fs tier" in result.stdout


def test_pipeline_and_loop_lag_benches_run(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    subprocess.run(
        [
            sys.executable,
            str(BENCH / "pipeline.py"),
            "--gib",
            "0.02",
            "--repeat",
            "1",
            "--dir",
            str(tmp_path),
            "--json",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert json.loads(out.read_text())["store_ratio"] > 0
    lag = tmp_path / "lag.json"
    subprocess.run(
        [
            sys.executable,
            str(BENCH / "loop_lag.py"),
            "--gib",
            "0.02",
            "--dir",
            str(tmp_path),
            "--json",
            str(lag),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert set(json.loads(lag.read_text())) == {"idle", "store", "load"}
