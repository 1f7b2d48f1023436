"""`kvtier bench` end to end at a tiny size: the table, valid JSON with the documented fields, a plot."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from kvtier_async.benchmark import format_table
from kvtier_async.cli import main
from kvtier_async.raw_baselines import baseline as raw_baseline

RATES = {"gbps", "blocks_per_s", "p50_ms", "p99_ms", "seconds"}


def test_bench_writes_json_and_a_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    tiers = json.dumps([{"type": "fs"}, {"type": "memory"}])
    argv = ["bench", "--tiers", tiers, "--block-kib", "64", "16", "--mib", "1", "--request-blocks", "4"]
    argv += ["--repeat", "2"]
    argv += ["--dir", str(tmp_path), "--json", str(out), "--plot", str(plot), "--no-progress"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "store GB/s" in table and "pipeline" in table and "event-loop lag" in table and "idle" in table
    result = json.loads(out.read_text())
    assert set(result) == {"config", "idle_loop_lag", "cases", "pipelines"}
    assert result["idle_loop_lag"]["ticks"] > 0
    assert result["config"]["block_kib"] == [64, 16] and result["config"]["request_blocks"] == 4
    assert result["config"]["repeat"] == 2
    assert [(c["tier"], c["block_kib"]) for c in result["cases"]] == [
        ("fs#0", 64),
        ("fs#0", 16),
        ("memory#1", 64),
        ("memory#1", 16),
    ]
    for case in result["cases"]:
        assert case["exact"] is True and case["load_hits"] == case["blocks"] == case["stored_blocks"]
        # The tier's own sides also say what CPU time this process spent per GB.
        assert set(case["store"]) == set(case["load"]) == RATES | {"cpu_s_per_gb"}
        assert case["store"]["cpu_s_per_gb"] > 0 and case["load"]["cpu_s_per_gb"] > 0
        assert set(case["baseline"]["store"]) == RATES
        if case["tier"].startswith("fs"):  # sealable: measured with a secret too, round by round
            sealed = case["with_secret"]
            assert sealed["exact"] is True and sealed["load"]["cpu_s_per_gb"] > 0
            for op in ("store", "load"):
                ratios = case[f"secret_{op}_ratios"]
                assert len(ratios) == 2 and case[f"secret_{op}_ratio"] == pytest.approx(sum(ratios) / 2)
            assert f"{case['tier']} {case['block_kib']} KiB sealed/unsealed: store" in table
        else:
            assert "with_secret" not in case and "secret_store_ratios" not in case
        lag = case["loop_lag"]
        assert {"p50_ms", "p99_ms", "max_ms", "full_gcs", "cpu_wait_p99_ms", "busy_p99_ms"} <= set(lag)
        # The lag splits into the wait for a CPU and the loop's own work: neither part exceeds it.
        assert 0 <= lag["busy_p99_ms"] <= lag["max_ms"] and lag["cpu_wait_p99_ms"] >= 0
        assert set(case["baseline"]) == {"what", "store", "load", "loop_lag"}
        assert "raw baseline: p99" in table and "waiting for a CPU" in table
        assert case["store_ratio"] == pytest.approx(case["store"]["gbps"] / case["baseline"]["store"]["gbps"])
        assert case["load_ratio"] > 0
    for pipe in result["pipelines"]:
        assert {"store_ratio", "load_ratio", "store_copy_s", "load_io_s", "store_pipeline_s"} <= set(pipe)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "the median of the rounds' ratios" in table
    # A record made before the rounds' ratios were kept says how its ratio was made, and no bounds.
    for case in result["cases"]:
        case.pop("secret_store_ratios", None)
        case.pop("secret_load_ratios", None)
    older = format_table(result)
    assert "the ratio of the two sides' medians" in older and "sealed/unsealed" not in older
    assert not any(tmp_path.glob("kvtier-bench-*")), "temporary files left behind"


def test_bench_leaves_nothing_in_an_fs_root_it_is_given(tmp_path: Path) -> None:
    """Each round's namespace (sealed and not, and the pipeline's) is removed once measured:
    deleting its blocks alone leaves their slab files behind in the user's root."""
    root = tmp_path / "root"
    (tmp_path / "work").mkdir()
    tiers = json.dumps([{"type": "fs", "root": str(root)}])
    argv = ["bench", "--tiers", tiers, "--block-kib", "64", "--mib", "1", "--repeat", "2"]
    argv += ["--dir", str(tmp_path / "work"), "--json", str(tmp_path / "bench.json"), "--no-progress"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert "with_secret" in result["cases"][0] and result["pipelines"]  # every kind of round ran
    assert root.is_dir() and not any(root.iterdir())
    assert not any((tmp_path / "work").iterdir())


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["fs", "memory"])
async def test_the_raw_baselines_leave_no_file_and_never_block_the_loop(kind: str, tmp_path: Path) -> None:
    """The fs baseline's file removed once measured (the rounds' files added up on the disk),
    and every baseline's threads joined off the event loop (the blocking-call detector watches)."""
    work = tmp_path / "raw"
    out = await raw_baseline({"type": kind}, 64 << 10, 16, 4, work)
    assert out["store"]["gbps"] > 0 and out["load"]["gbps"] > 0
    if kind == "fs":
        assert await asyncio.to_thread(os.listdir, work) == []


def test_bench_refuses_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--mib", "0", "--no-progress"]) == 2
    assert "sizes must be positive" in capsys.readouterr().err
