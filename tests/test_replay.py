"""`kvtier replay` and its sweep: traces with a known answer through real tiers (memory, fs),
the sweep's predictions against what the replay measured, and hostile traces."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier_async.cli import main
from kvtier_async.errors import InvalidArgumentError
from kvtier_async.replay import ReplayConfig, run_replay
from kvtier_async.sweep import simulate, sweep_report, unbounded_hits
from kvtier_async.trace import Request, TraceError, read_trace

BLOCK = 64 << 10


def write_trace(path: Path, requests: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return path


def request(ms: float, ids: list[int], last_tokens: int = 512) -> dict[str, Any]:
    return {
        "timestamp": ms,
        "input_length": 512 * (len(ids) - 1) + last_tokens,
        "output_length": 8,
        "hash_ids": ids,
    }


#: Known reuse: 11 blocks asked, 5 leading blocks an earlier request had (3 + 2).
KNOWN = [
    request(0, [1, 2, 3], last_tokens=100),
    request(10, [1, 2, 3, 4]),
    request(20, [1, 2, 5], last_tokens=7),
    request(30, [9]),
]


def generated(n: int, seed: int) -> list[dict[str, Any]]:
    """Multi-turn conversations over shared system prompts: chains that grow and share heads."""
    rng = random.Random(seed)
    next_id, prompts, chats = 1000, [[i * 10 + j for j in range(4)] for i in range(3)], []
    out = []
    for t in range(n):
        if chats and rng.random() < 0.6:
            chat = rng.choice(chats)
        else:
            chat = list(rng.choice(prompts))
            chats.append(chat)
        chat.extend(range(next_id, next_id + rng.randint(1, 4)))
        next_id += 4
        out.append(request(t * 5, list(chat)))
    return out


def test_the_trace_reader_and_the_unbounded_answer(tmp_path: Path) -> None:
    requests = read_trace(write_trace(tmp_path / "t.jsonl", KNOWN))
    assert [r.line for r in requests] == [1, 2, 3, 4]
    assert requests[0].block_tokens(2) == 100 and requests[1].block_tokens(3) == 512
    assert unbounded_hits(requests) == (5, 3 * 512 + 2 * 512)
    assert read_trace(tmp_path / "t.jsonl", limit=2) == requests[:2]
    assert Request(1, 0, 600, 0, (1, 2, 3)).block_tokens(2) == 0  # ids past the length count nothing


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}', "input_length"),
        ('{"timestamp": 0, "input_length": 5, "hash_ids": [1]}', "missing field 'output_length'"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1.5]}', "hash_ids"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "timestamp"),
        ("[1, 2]", "JSON object"),
        ('{"timestamp": 0, "input_length": 900, "output_length": 1, "hash_ids": [4, 4]}', "repeat"),
    ],
)
def test_a_malformed_trace_fails_with_its_line_before_anything_runs(
    tmp_path: Path, line: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(json.dumps(KNOWN[0]) + "\n\n" + line + "\n" + json.dumps(KNOWN[1]) + "\n")
    with pytest.raises(TraceError, match=rf"bad\.jsonl:3: .*{message}"):
        read_trace(trace)
    root = tmp_path / "kv"
    tiers = json.dumps([{"type": "fs", "root": str(root)}])
    assert main(["replay", str(trace), "--tiers", tiers, "--no-progress"]) == 2
    assert "bad.jsonl:3" in capsys.readouterr().err
    assert not root.exists()  # no tier was opened


def test_empty_or_missing_traces_and_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no requests"):
        read_trace(write_trace(tmp_path / "empty.jsonl", []))
    with pytest.raises(TraceError, match="cannot open"):
        read_trace(tmp_path / "nope.jsonl")
    with pytest.raises(InvalidArgumentError, match="multiple of 4096"):
        ReplayConfig(trace=tmp_path / "t.jsonl", block_bytes=5000).check()
    with pytest.raises(InvalidArgumentError, match="concurrency"):
        ReplayConfig(trace=tmp_path / "t.jsonl", concurrency=0).check()


@pytest.mark.asyncio
@pytest.mark.parametrize("concurrency", [1, 3])
async def test_a_known_trace_through_a_memory_tier_gets_exactly_the_known_hits(
    tmp_path: Path, concurrency: int
) -> None:
    trace = await asyncio.to_thread(write_trace, tmp_path / "t.jsonl", KNOWN)
    config = ReplayConfig(
        trace=trace,
        secondary_tiers=[{"type": "memory"}],
        primary_bytes=64 * BLOCK,
        block_bytes=BLOCK,
        concurrency=concurrency,
        progress=False,
    )
    report = await run_replay(config)
    assert report["wrong_bytes"] == 0 and report["requests"] == 4 and report["blocks"] == 11
    if concurrency == 1:  # at 3, a request may look up blocks another is still computing
        assert report["hit_rate"] == pytest.approx(5 / 11)
        # Hit tokens: 3 + 2 whole blocks (block 3 of request 1 is short, but request 2's is whole).
        assert report["token_hit_rate"] == pytest.approx(5 * 512 / (1124 + 2048 + 1031 + 512))
        tiers = report["tiers"]
        assert tiers["primary"]["hit_rate"] == pytest.approx(5 / 11)  # all of it in the primary tier
        assert tiers["primary"]["token_hit_rate"] == pytest.approx(report["token_hit_rate"])
        assert tiers["memory"]["token_hit_rate"] == 0
        assert (
            tiers["memory"]["hit_rate"] == 0 and tiers["memory"]["bytes_written"] == 6 * BLOCK
        )  # ids 1, 2, 3, 4, 5, 9
    assert report["unbounded_hit_rate"] == pytest.approx(5 / 11)
    assert report["predicted_hit_rate"] is None  # the sweep models the primary and fs tiers only


@pytest.mark.asyncio
async def test_a_known_trace_through_fs_and_a_small_primary_tier_matches_the_sweep_per_tier(
    tmp_path: Path,
) -> None:
    """Two requests for one 6-block chain through a primary tier of 4 blocks: the second finds all
    6 (4 in the primary tier, 2 in the fs tier), and loads them through the primary tier's 4
    slots, which the sweep follows step for step (exactly which tier served each block depends on
    the cache's chunks: it says the same as the replay)."""
    trace = await asyncio.to_thread(write_trace, tmp_path / "t.jsonl", [request(0, [1, 2, 3, 4, 5, 6])] * 2)
    requests = await asyncio.to_thread(read_trace, trace)
    config = ReplayConfig(
        trace=trace,
        secondary_tiers=[{"type": "fs", "root": str(tmp_path / "kv")}],
        primary_bytes=4 * BLOCK,
        block_bytes=BLOCK,
        concurrency=1,
        progress=False,
        settle=True,
    )
    report = await run_replay(config)
    fs_capacity = 64 << 30  # the default, where the disk has room: no fs eviction either way
    predicted = await asyncio.to_thread(simulate, requests, BLOCK, 4 * BLOCK, fs_capacity)
    tiers = report["tiers"]
    assert report["wrong_bytes"] == 0 and report["hit_rate"] == pytest.approx(6 / 12)
    assert report["tiers"]["fs"]["found_rate"] == pytest.approx(2 / 12)  # the lookup: 4 + 2
    assert tiers["primary"]["hit_rate"] + tiers["fs"]["hit_rate"] == pytest.approx(6 / 12)
    # Tokens by the tier holding each block at the lookup: 4 in the primary tier, 2 in fs.
    assert tiers["primary"]["token_hit_rate"] == pytest.approx(4 / 12)
    assert tiers["fs"]["token_hit_rate"] == pytest.approx(2 / 12)
    assert tiers["primary"]["hit_rate"] == pytest.approx(predicted["primary_hit_rate"])
    assert tiers["fs"]["hit_rate"] == pytest.approx(predicted["fs_hit_rate"])
    assert tiers["primary"]["evictions"] == predicted["primary_evictions"]
    assert tiers["fs"]["bytes_written"] == predicted["fs_bytes_written"] == 6 * BLOCK


@pytest.mark.asyncio
async def test_replay_through_fs_measures_what_the_sweep_predicts(tmp_path: Path) -> None:
    """Conversations through a small primary tier and a small fs tier, both evicting: at
    concurrency 1 the replay's hits are the sweep's within half a point (the order in which the
    fs tier's concurrent I/O batches finish moves its LRU a little), the primary tier's exactly."""
    trace = await asyncio.to_thread(write_trace, tmp_path / "t.jsonl", generated(120, seed=7))
    requests = await asyncio.to_thread(read_trace, trace)
    capacity = 150 * (BLOCK + 4096)  # about 150 records: far fewer than the trace's distinct blocks
    config = ReplayConfig(
        trace=trace,
        secondary_tiers=[{"type": "fs", "root": str(tmp_path / "kv"), "capacity_bytes": capacity}],
        primary_bytes=48 * BLOCK,
        block_bytes=BLOCK,
        concurrency=1,
        progress=False,
        settle=True,
    )
    report = await run_replay(config)
    predicted = await asyncio.to_thread(simulate, requests, BLOCK, 48 * BLOCK, capacity)
    blocks = report["blocks"]
    assert report["wrong_bytes"] == 0
    assert report["predicted_hit_rate"] == pytest.approx(predicted["hit_rate"])
    assert abs(report["hit_rate"] - predicted["hit_rate"]) <= 0.005
    tiers = report["tiers"]
    assert round(tiers["primary"]["hit_rate"] * blocks) == round(predicted["primary_hit_rate"] * blocks)
    assert tiers["primary"]["evictions"] == predicted["primary_evictions"] > 0
    assert tiers["fs"]["hit_rate"] > 0.1 and tiers["fs"]["evictions"] > 0 and predicted["fs_evictions"] > 0
    assert report["hit_rate"] < report["unbounded_hit_rate"]  # the capacities cost hits


def test_the_sweep_and_the_replay_command_write_their_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "t.jsonl", generated(60, seed=3))
    out = tmp_path / "sweep.json"
    assert (
        main(
            [
                "replay",
                str(trace),
                "--block-bytes",
                "64K",
                "--primary-gib",
                "0.001",
                "--sweep",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    rates = [p["hit_rate"] for p in report["points"]]
    assert rates == sorted(rates) and rates[-1] <= report["unbounded_hit_rate"] + 1e-9
    assert "80% of the unbounded hit rate" in capsys.readouterr().out
    geometry = tmp_path / "qwen.json"
    assert (
        main(
            ["replay", str(trace), "--model-geometry", "qwen2.5-7b", "--sweep", "8G", "--json", str(geometry)]
        )
        == 0
    )
    assert json.loads(geometry.read_text())["block_bytes"] == 28 * 4 * 128 * 2 * 2 * 512  # 28 MiB per block
    assert main(["replay", str(trace), "--sweep", "1G,nonsense"]) == 2
    assert (
        sweep_report(read_trace(trace), BLOCK, 16 * BLOCK, [1 << 20])["points"][0]["fs_capacity_bytes"]
        == 1 << 20
    )

    replayed = tmp_path / "replay.json"
    tiers = json.dumps([{"type": "fs", "root": str(tmp_path / "kv")}])
    argv = ["replay", str(trace), "--tiers", tiers, "--block-bytes", "64K", "--primary-gib", "0.01"]
    assert main([*argv, "--speed", "1000", "--limit", "30", "--no-progress", "--json", str(replayed)]) == 0
    result = json.loads(replayed.read_text())
    assert result["requests"] == 30 and result["wrong_bytes"] == 0
    assert result["arrivals"]["speed"] == 1000 and result["arrivals"]["late_requests"] >= 0
    assert {"hit_rate", "token_hit_rate", "unbounded_hit_rate", "wrong_bytes", "tiers"} <= result.keys()
    assert {"hit_rate", "bytes_written", "bytes_read", "evictions", "load_latency_ms"} <= result["tiers"][
        "fs"
    ].keys()
    assert "prefix hit rate" in capsys.readouterr().out


def test_ctrl_c_stops_the_replay_cleanly_and_it_still_reports(tmp_path: Path) -> None:
    """SIGINT while the replay waits for a request's arrival an hour away: the requests in flight
    finish, the report comes (stopped early), and the temporary fs tier is removed."""
    trace = write_trace(
        tmp_path / "t.jsonl", [request(0, [1, 2]), request(0, [1, 2, 3]), request(3_600_000, [1])]
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    command = [
        sys.executable,
        "-m",
        "kvtier_async.cli",
        "replay",
        str(trace),
        "--speed",
        "1",
        "--block-bytes",
        "64K",
    ]
    command += ["--primary-gib", "0.01", "--concurrency", "1", "--json", str(tmp_path / "r.json")]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as process:
        assert process.stderr is not None
        seen = b""
        while b"2/3" not in seen:  # the progress bar: two requests done, the third an hour away
            chunk = process.stderr.read1(4096)  # type: ignore[attr-defined]
            assert chunk, seen.decode(errors="replace")
            seen += chunk
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=120)
    assert process.returncode == 0, out
    assert b"2 of 3 requests (stopped early)" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["interrupted"] and report["requests"] == 2 and report["hit_rate"] == pytest.approx(2 / 5)
    assert not list(tmp_path.glob("kvtier-replay-*"))  # the default tier's directory is gone
