"""The benchmark scripts still run (at a tiny size); their numbers are not checked here."""

from __future__ import annotations

import asyncio
import json
import os
import site
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import servers
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
#: The disk scripts' size for a smoke run: megabytes, not the records' 32-block minimum, and two
#: rounds so that a ratio is a median of more than one.
TWO_TINY_ROUNDS = ("--gib", "0.01", "--min-blocks", "1", "--threads", "2", "--repeat", "2")


def bench(script: str, *args: str | Path) -> str:
    """Run bench/SCRIPT with ARGS; its standard output."""
    return subprocess.run(
        [sys.executable, str(BENCH / script), *map(str, args)],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    ).stdout


def bench_records(script: str, tmp_path: Path, *args: str) -> Any:
    """Run a benchmark writing to `tmp_path` and return what it saved with `--json`."""
    out = tmp_path / "out.json"
    bench(script, *args, "--dir", tmp_path, "--json", out)
    return json.loads(out.read_text())


def test_fs_tier_bench_runs(tmp_path: Path) -> None:
    rows = bench_records("fs_tier.py", tmp_path, *TWO_TINY_ROUNDS, "--aiofiles")
    assert {(row["block_kib"], row["memory"]) for row in rows} == {
        (kib, memory) for kib in (2048, 32768, 64) for memory in ("anon", "shm", "scattered")
    }
    assert all(row["tier"]["fresh_load_gbps"] > 0 and row["raw"]["again_load_gbps"] > 0 for row in rows)
    for row in rows:  # a ratio is the median of the rounds' own ratios, and the rounds are kept
        rounds = row["rounds"]
        assert len(rounds) == 2
        paired = [r["tier"]["fresh_load_gbps"] / r["raw"]["again_load_gbps"] for r in rounds]
        assert row["fresh_load_ratio"] == pytest.approx(statistics.median(paired))


def test_fs_steady_bench_runs(tmp_path: Path) -> None:
    rows = bench_records("fs_steady.py", tmp_path, *TWO_TINY_ROUNDS)  # it fails if the tier was not full
    assert [row["block_kib"] for row in rows] == [2048, 32768]
    assert all(row["tier_store_gbps"] > 0 and row["new_files_gbps"] > 0 for row in rows)
    for row in rows:
        paired = [r["tier_store_gbps"] / r["overwrite_gbps"] for r in row["rounds"]]
        assert len(paired) == 2 and row["overwrite_ratio"] == pytest.approx(statistics.median(paired))


def test_fs_staging_bench_runs(tmp_path: Path) -> None:
    args = ("--block-mib", "2", "--between", "0", "1")
    rows = bench_records("fs_staging.py", tmp_path, *TWO_TINY_ROUNDS, *args)
    assert [row["between"] for row in rows] == [0, 1]
    for row in rows:
        assert len(row["rounds"]) == 2
        assert row["direct_load_gbps"] == pytest.approx(
            statistics.median(r["direct_load_gbps"] for r in row["rounds"])
        )
    if rows[1]["apart"] is not None:  # frame numbers visible: a page between every one of ours
        assert rows[1]["apart"] > 0.9


def test_fs_open_bench_runs(tmp_path: Path) -> None:
    assert "open (cold)" in bench("fs_open.py", "--blocks", "500", "--dir", tmp_path)


def test_fs_index_scale_bench_runs(tmp_path: Path) -> None:
    (row,) = bench_records("fs_index_scale.py", tmp_path, "--blocks", "3000")
    assert row["writer"]["blocks"] == 3000 and row["writer"]["lookup_blocks_per_s"] > 0
    assert row["restarted"]["open_first_lookup_s"] > 0 and "rss_bytes_per_block" in row["second"]


def test_gpu_check_runs_on_the_cpu_fallback() -> None:
    """The GPU acceptance script on a machine without CUDA: the checks CPU tensors can stand in
    for pass (round trips of four layouts through the primary and a cold fs tier, padding on
    disk zeros), the CUDA-only ones say they were skipped, and throughput, whose goal is a
    GPU's, is measured without a PASS. Run as from a clone where the package is not installed:
    `-S` skips the site-packages' `.pth` files (the editable install of kvtier_async), and only
    the dependencies are on the path."""
    out = subprocess.run(
        [sys.executable, "-S", str(BENCH / "gpu_check.py"), "--small"],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(site.getsitepackages())},
    ).stdout
    assert "PASS round trips" in out and "INFO throughput" in out and "(CPU tensors: not asserted)" in out
    assert out.count("SKIP") == 6 and "FAIL" not in out and "PASS throughput" not in out


def test_gpu_checks_sync_probe_notes_host_waits_made_on_the_loops_thread_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Check 4's probe for what sync-debug mode cannot see (`cudaEventSynchronize`): an event's,
    a stream's or the device's synchronize on the loop's thread is noted; the same on a worker
    thread (where the copy engine's waiters wait) is not; the originals come back after."""
    gpu_check = import_bench("gpu_check")
    waited: list[str] = []
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: waited.append("event"))
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda self: waited.append("stream"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append("device"))
    originals = (torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize, torch.cuda.synchronize)

    async def calls() -> list[str]:
        with gpu_check.syncs_on_this_thread() as seen:
            await asyncio.to_thread(torch.cuda.Event.synchronize, object())  # a waiter: fine
            torch.cuda.Event.synchronize(object())
            torch.cuda.Stream.synchronize(object())
            torch.cuda.synchronize()
        return seen

    assert asyncio.run(calls()) == ["Event.synchronize", "Stream.synchronize", "cuda.synchronize"]
    assert waited == ["event", "event", "stream", "device"]
    assert (torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize, torch.cuda.synchronize) == originals


def test_gpu_checks_overlap_figure_cannot_exceed_the_shorter_side() -> None:
    """Concurrent tier writes count once: two writes at the same time as one copy are that
    copy's time at once, not twice it (the first figure summed every pair, up to 200% here)."""
    gpu_check = import_bench("gpu_check")
    copying, writing, both = gpu_check.overlap([(0.0, 1.0)], [(0.0, 1.0), (0.0, 1.0), (0.5, 2.0)])
    assert (copying, writing, both) == (1.0, 2.0, 1.0)
    assert gpu_check.overlap([(0.0, 1.0), (3.0, 4.0)], [(0.5, 3.5)]) == (2.0, 3.0, 1.0)
    assert gpu_check.overlap([(0.0, 1.0)], [(1.0, 2.0)])[2] == 0.0


def test_pipeline_and_loop_lag_benches_run(tmp_path: Path) -> None:
    result = bench_records("pipeline.py", tmp_path, "--gib", "0.02", "--repeat", "1")
    assert result["median"]["store_ratio"] > 0 and result["best"]["load_ratio"] > 0
    assert len(result["rounds"]) == 1
    lags = bench_records("loop_lag.py", tmp_path, "--gib", "0.02")
    assert set(lags) == {"idle", "store", "load", "timeline"}
    assert lags["store"]["stolen_ms"] >= 0 and lags["load"]["seconds"] > 0
    store_timeline = lags["timeline"]["store"]
    assert store_timeline and all(0 <= at <= lags["store"]["seconds"] for at, _ in store_timeline)
    assert max(lag for _, lag in store_timeline) == pytest.approx(lags["store"]["max_ms"])
    # With a tier secret: the script itself checks that every block stored was loaded.
    sealed = bench_records("loop_lag.py", tmp_path, "--gib", "0.02", "--secret")
    assert sealed["load"]["ticks"] > 0


def test_secret_threads_bench_runs(tmp_path: Path) -> None:
    args = ("--threads", "1", "2", "--block-mib", "2", "--mib", "4", "--repeat", "2")
    results = bench_records("secret_threads.py", tmp_path, *args)
    variants = results["2 MiB"]
    assert list(variants) == ["unsealed", "sealed, 1 thread", "sealed, 2 threads"]
    assert variants["unsealed"]["store_ratio"] == variants["unsealed"]["load_ratio"] == 1.0
    assert all(row["load_gbps"] > 0 and row["lag_p99_ms"] >= 0 for row in variants.values())


@servers.needs_redis
def test_redis_sealed_pool_bench_runs(tmp_path: Path) -> None:
    out = tmp_path / "pool.json"
    args = ("--pool-mib", "1", "32", "--block-kib", "64", "--mib", "1", "--repeat", "2", "--json", out)
    bench("redis_sealed_pool.py", *args)
    variants = json.loads(out.read_text())["64 KiB"]
    assert list(variants) == ["unsealed", "sealed, pool cap 1 MiB", "sealed, pool cap 32 MiB"]
    assert variants["unsealed"]["store_ratio"] == variants["unsealed"]["load_ratio"] == 1.0
    assert all(row["load_gbps"] > 0 and row["lag_p99_ms"] >= 0 for row in variants.values())


@servers.needs_redis
def test_tier_secret_bench_runs_for_one_tier(tmp_path: Path) -> None:
    out = tmp_path / "secret.json"
    bench("tier_secret.py", "--tiers", "redis", "--mib", "8", "--repeat", "1", "--json", out)
    results = json.loads(out.read_text())
    assert list(results) == ["remote"]  # no fs cases, and no S3 one beside the Redis tier's
    [case] = results["remote"]["cases"]
    assert case["type"] == "redis" and case["exact"] and case["with_secret"]["store"]["gbps"] > 0


def test_contention_bench_runs(tmp_path: Path) -> None:
    args = ("--block-kib", "64", "--store-batches", "2", "--loads", "4")
    summary = bench_records("contention.py", tmp_path, *args)
    assert summary["scheduler"]["load_p50_ms"] > 0 and summary["gather"]["dropped_blocks"] == 0


@servers.needs_redis
def test_remote_tiers_bench_runs(tmp_path: Path) -> None:
    out = tmp_path / "remote.json"
    table = bench(
        "remote_tiers.py", "--block-kib", "64", "--mib", "1", "--request-blocks", "4", "--json", out
    )
    cases = {case["type"]: case for case in json.loads(out.read_text())["cases"]}
    assert cases["redis"]["exact"] and cases["s3"]["exact"]
    assert cases["redis"]["baseline"]["load"]["gbps"] > 0 and cases["s3"]["store_ratio"] > 0
    # Each round's loop lag, the tier's beside the raw client's, in the record and the output.
    [lags] = cases["s3"]["loop_lag_rounds"]
    assert lags["tier"]["max_ms"] >= lags["tier"]["p99_ms"] and lags["raw"]["ticks"] > 0
    assert "event-loop lag per round" in table and "s3#1          64 KiB     0 |" in table


def test_sglang_backend_bench_runs(tmp_path: Path) -> None:
    out = tmp_path / "sglang.json"
    chosen = ["2mib-page_first", "small-runs", "generic"]
    args = ("--cases", *chosen, "--mib", "16", "--repeat", "2", "--dir", tmp_path, "--json", out)
    table = bench("sglang_backend.py", *args)
    assert "warm batch_exists(128)" in table
    cases = json.loads(out.read_text())["cases"]
    assert [(c["case"], c["path"], c["run_bytes"]) for c in cases] == [
        ("2mib-page_first", "v1", 1 << 20),  # K or V of a whole page
        ("small-runs", "v1", 1024),
        ("generic", "generic", 128 << 10),
    ]
    assert all(c["kvtier"]["exact"] for c in cases)
    assert "raw" not in cases[1] and cases[0]["set_vs_raw"] > 0  # O_DIRECT refuses 1 KiB runs


def test_sglang_backend_bench_hybrid_row_runs(tmp_path: Path) -> None:
    out = tmp_path / "hybrid.json"
    bench(
        "sglang_backend.py",
        "--cases",
        "hybrid-dsa",
        "--mib",
        "8",
        "--repeat",
        "2",
        "--dir",
        tmp_path,
        "--json",
        out,
    )
    (case,) = json.loads(out.read_text())["cases"]
    assert (case["case"], case["extra_pool"], case["nodes"]) == ("hybrid-dsa", "indexer", 2)
    assert case["kvtier"]["exact"] and case["set_vs_file"] > 0 and case["get_vs_file"] > 0
    assert case["set_vs_raw"] > 0 and case["raw"]["get_gbps"] > 0  # the disk's own speed, same rounds


def test_replay_trace_bench_runs(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [  # a shared head, four second blocks, a tail of its own each
        {"timestamp": 10 * i, "input_length": 3 * 512, "output_length": 1, "hash_ids": [0, 1 + i % 4, 99 + i]}
        for i in range(30)
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "replay.json"
    table = bench("replay_trace.py", "--trace", trace, "--fractions", "0.5", "--dir", tmp_path, "--json", out)
    assert "80% of the unbounded hit rate" in table
    record = json.loads(out.read_text())
    assert [(r["fraction"], r["config"]["concurrency"]) for r in record["replays"]] == [(0.5, 16), (0.5, 1)]
    assert all(r["wrong_bytes"] == 0 and r["predicted_hit_rate"] is not None for r in record["replays"])
    assert record["sweep"]["points"] and "timeline" not in record["replays"][0]


def test_eviction_policies_bench_runs(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": i, "input_length": 3 * 512, "output_length": 1, "hash_ids": [0, 1 + i % 7, 99 + i]}
        for i in range(200)
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "policies.json"
    table = bench("eviction_policies.py", "--trace", trace, "--generated", "300", "--json", out)
    assert "chain-pos" in table
    traces = json.loads(out.read_text())["traces"]
    assert set(traces) == {"t", "conversations", "documents", "one-off"}
    for trace_result in traces.values():
        rates = trace_result["hit_rates"]
        assert set(rates) >= {"lru", "arc", "admit-freq", "chain-pos"}
        # The model's LRU and the tiers' own code (the sweep) agree within 2 points on traces this
        # small: the fs tier holds whole slabs, so a capacity of a few dozen records rounds down.
        sweep = rates["lru (the sweep: the tiers' code)"]
        assert all(abs(a - b) <= 0.02 for a, b in zip(rates["lru"], sweep))


def test_lmcache_l2_bench_runs(tmp_path: Path) -> None:
    out = tmp_path / "lmcache.json"
    table = bench("lmcache_l2.py", "--size-kb", "256", "--rounds", "2", "--dir", tmp_path, "--json", out)
    assert "256 KiB chunks" in table
    [case] = json.loads(out.read_text())["cases"]
    assert case["kvtier"]["store_gbps"] > 0 and case["lmcache-fs"]["load_gbps"] > 0


def test_metrics_overhead_bench_runs(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    bench("metrics_overhead.py", "--calls", "50", "--repeat", "1", "--json", out)
    assert json.loads(out.read_text())["ratio"] > 0


def test_vllm_tiers_bench_runs(tmp_path: Path) -> None:
    path = tmp_path / "v.json"
    bench(
        "vllm_tiers.py",
        "--gib",
        "0.002",
        "--min-blocks",
        "1",
        "--chunk-kib",
        "256",
        "512",
        "--threads",
        "default",
        "2",
        "--rounds",
        "2",
        "--dir",
        tmp_path,
        "--json",
        path,
    )
    cases = json.loads(path.read_text())
    assert [(case["chunk_bytes"], case["threads"]) for case in cases] == [
        (256 << 10, None),
        (256 << 10, 2),
        (512 << 10, None),
        (512 << 10, 2),
    ]
    for case in cases:
        assert set(case["ratios"]) == {"store_gbps", "promote_same_gbps", "promote_new_engine_gbps"}
        assert all(len(rounds) == 2 for rounds in case["rounds"].values())
    assert cases[0]["threads_described"]["vllm-fs"] == "16 read + 16 write"


def import_bench(name: str) -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("n", range(1, 13))
def test_median_bounds_hold_the_median_with_the_chance_they_say(n: int) -> None:
    common = import_bench("common")
    values = [(7 * i) % 13 / 10 for i in range(n)]  # distinct, out of order
    low, high, chance = common.median_bounds(values)
    ordered = sorted(values)
    k = ordered.index(low) + 1
    assert high == ordered[n - k] and low <= statistics.median(values) <= high
    # The true median lies below the k-th smallest when fewer than k of the n rounds fall below
    # it, each falling below with chance 1/2: count the sign patterns where that happens.
    outside = sum(1 for signs in range(2**n) if bin(signs).count("1") < k)
    assert chance == pytest.approx(1 - 2 * outside / 2**n)
    if n >= 5:
        assert chance >= 0.9  # the default confidence, reachable from 5 rounds on
        # and no tighter pair of rounds would still reach it
        tighter = sum(1 for signs in range(2**n) if bin(signs).count("1") < k + 1)
        assert k + 1 > (n + 1) // 2 or 1 - 2 * tighter / 2**n < 0.9
    else:
        assert (low, high) == (ordered[0], ordered[-1])


def test_median_bounds_of_the_records_round_counts() -> None:
    common = import_bench("common")
    sixteen = common.median_bounds(list(range(16, 0, -1)))
    assert sixteen == (5, 12, pytest.approx(1 - 2 * (1 + 16 + 120 + 560 + 1820) / 2**16))
    assert common.median_bounds(list(range(12, 0, -1))) == (3, 10, pytest.approx(1 - 2 * 79 / 2**12))
    assert common.median_bounds([5, 1, 8, 3, 2, 7, 6, 4]) == (2, 7, 1 - 2 * 9 / 256)  # 8 rounds
    assert common.median_bounds([5, 1, 3, 2, 6, 4]) == (1, 6, 1 - 2 / 64)  # 6 rounds


def test_median_bounds_refuse_what_has_no_median() -> None:
    common = import_bench("common")
    with pytest.raises(ValueError, match="no values"):
        common.median_bounds([])
    with pytest.raises(ValueError, match="confidence"):
        common.median_bounds([1.0, 2.0], confidence=1.0)


def test_run_all_describes_the_machine() -> None:
    run_all = import_bench("run_all")
    about = run_all.machine()
    assert about["cpus"] >= 1 and about["memory_gib"] > 0 and about["torch"]
    recorders = {"fs_tier", "fs_steady", "peers", "vllm_tiers", "loop_lag", "kvtier_bench", "remote_tiers"}
    recorders |= {"sglang_backend", "lmcache_l2", "fs_staging", "tier_secret", "replay"}
    recorders |= {"eviction_policies", "secret_threads", "redis_sealed_pool", "fs_index_scale"}
    assert set(run_all.RECORDERS) == recorders


@servers.needs_mooncake
def test_mooncake_tier_bench_runs() -> None:
    out = bench("mooncake_tier.py", "--block-kib", "64", "--mib", "1", "--rounds", "2", "--scaling")
    assert "tier    store" in out and "sealed  store" in out and "4 threads: put" in out
