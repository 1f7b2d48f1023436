"""Replay of a request trace: the sweep of fs capacities, and the replay at two of them.

    python bench/replay_trace.py --json /tmp/replay.json
    python bench/replay_trace.py --trace my_trace.jsonl --fractions 0.1 0.5

What `kvtier replay` does, at its defaults (256 KiB blocks, a 1 GiB primary tier, an fs tier
in a temporary directory, 16 requests in flight, as fast as they go): first `--sweep` at the
default capacities (no I/O), then the replay through a real fs tier of each chosen capacity
(fractions of the trace's distinct blocks), at the default concurrency and at concurrency 1,
each next to the sweep's prediction for its capacities. Default trace: the Mooncake FAST'25
synthetic trace kept beside this repository (`../shared/traces/`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

from common import run

from kvtier_async.replay import ReplayConfig, run_replay
from kvtier_async.replay_report import format_replay
from kvtier_async.sweep import capacity_for_fraction, format_sweep, sweep_report
from kvtier_async.trace import read_trace

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "synthetic_trace.jsonl"
BLOCK = 256 << 10
PRIMARY = 1 << 30


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.2, 0.7])
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    requests = await asyncio.to_thread(read_trace, args.trace)
    sweep = await asyncio.to_thread(sweep_report, requests, BLOCK, PRIMARY)
    print(format_sweep(sweep), flush=True)
    replays: list[dict[str, Any]] = []
    for fraction in args.fractions:
        capacity = capacity_for_fraction(requests, BLOCK, fraction)
        for concurrency in (16, 1):
            with tempfile.TemporaryDirectory(prefix="kvtier-replay-", dir=args.dir) as root:
                config = ReplayConfig(
                    trace=args.trace,
                    secondary_tiers=[{"type": "fs", "root": root, "capacity_bytes": capacity}],
                    primary_bytes=PRIMARY,
                    block_bytes=BLOCK,
                    concurrency=concurrency,
                    progress=False,
                )
                report = await run_replay(config)
            print(f"\nfs capacity {fraction:.0%} of distinct blocks, concurrency {concurrency}:")
            print(format_replay(report), flush=True)
            report.pop("timeline")  # per request: too long for a record
            report["trace"] = args.trace.name
            report["config"]["tiers"] = [{"type": "fs", "capacity_bytes": capacity}]
            replays.append({"fraction": fraction, "fs_capacity_bytes": capacity, **report})
    if args.json:
        args.json.write_text(json.dumps({"trace": args.trace.name, "sweep": sweep, "replays": replays}))


if __name__ == "__main__":
    run(main)
