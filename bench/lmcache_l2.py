"""Benchmark: `KVTierL2Adapter` (fs tier) against LMCache's own `fs` L2 adapter, with `lmcache bench l2`.

    python bench/lmcache_l2.py --rounds 6                     # 2 MiB and 32 MiB chunks
    python bench/lmcache_l2.py --size-kb 2048 --rounds 2

LMCache 0.5.6's own L2 benchmark (`lmcache bench l2`: a producer thread submits store, lookup
and load tasks to the adapter and waits on its event fds) runs each adapter in a process of
its own, on a new directory of the same disk, in rounds that alternate which goes first, with
the same arguments: 4096-byte aligned L1 buffers of random data, `--in-flight 2`, 32 keys a
submit (8 at 32 MiB), round-trip verification on. LMCache's adapter runs with `use_odirect` on,
as ours does by default: neither side's load is served from the page cache its store filled.
Ours runs at its defaults (checksums on, each chunk written from and read into the L1 buffer
that `lmcache bench l2` describes to adapters, as LMCache's server does). The
ratios are kvtier / LMCache, round by round; the table shows their medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

LMCACHE = str(Path(sys.executable).with_name("lmcache"))


def adapters(root: Path) -> dict[str, str]:
    return {
        "lmcache-fs": json.dumps({"type": "fs", "base_path": str(root / "lmcache"), "use_odirect": True}),
        "kvtier": json.dumps(
            {
                "type": "plugin",
                "module_path": "kvtier_async.integrations.lmcache",
                "class_name": "KVTierL2Adapter",
                "adapter_params": {"tier": {"type": "fs", "root": str(root / "kvtier")}},
            }
        ),
    }


def bench_l2(adapter: str, size_kb: int, keys: int, out: Path) -> dict[str, float]:
    command = [LMCACHE, "bench", "l2", "--l2-adapter", adapter, "--num-keys", str(keys)]
    command += ["--in-flight", "2", "--data-size-kb", str(size_kb), "--l1-align-bytes", "4096"]
    command += ["--rounds", "2", "--warmup-rounds", "1", "--no-skip-verify"]
    command += ["--format", "json", "--output", str(out), "-q"]
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1"}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = json.loads(out.read_text())["metrics"]
    ops = {op["operation"]: op for name, op in metrics.items() if name.startswith("op_")}
    for name in ("Store", "Load"):
        if ops[name]["total_success"] != ops[name]["total_keys"]:
            raise SystemExit(
                f"{adapter}: {name} missed {ops[name]['total_keys'] - ops[name]['total_success']} keys"
            )
    return {
        "store_gbps": ops["Store"]["throughput_avg_mbps"] / 1e3,
        "load_gbps": ops["Load"]["throughput_avg_mbps"] / 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-kb", type=int, nargs="+", default=[2048, 32768])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--dir", type=Path, default=None, help="where the files go (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    cases = []
    with tempfile.TemporaryDirectory(prefix="kvtier-lmcache-l2-", dir=args.dir) as work:
        for size_kb in args.size_kb:
            keys = 32 if size_kb <= 4096 else 8
            runs: dict[str, list[dict[str, float]]] = {"lmcache-fs": [], "kvtier": []}
            for r in range(args.rounds):
                order = ["kvtier", "lmcache-fs"] if r % 2 == 0 else ["lmcache-fs", "kvtier"]
                for side in order:
                    root = Path(work) / f"{side}-{r}"
                    runs[side].append(bench_l2(adapters(root)[side], size_kb, keys, Path(work) / "out.json"))
                    shutil.rmtree(root, ignore_errors=True)
            case: dict[str, Any] = {"size_kb": size_kb, "keys_per_submit": keys}
            for side, done in runs.items():
                case[side] = {k: statistics.median(d[k] for d in done) for k in ("store_gbps", "load_gbps")}
            for op in ("store", "load"):
                ratios = [
                    k[f"{op}_gbps"] / b[f"{op}_gbps"] for k, b in zip(runs["kvtier"], runs["lmcache-fs"])
                ]
                case[f"{op}_ratio"] = statistics.median(ratios)
                case[f"{op}_ratios"] = ratios
            cases.append(case)
            print(
                f"{size_kb} KiB chunks | store GB/s kvtier {case['kvtier']['store_gbps']:.2f} "
                f"LMCache fs {case['lmcache-fs']['store_gbps']:.2f} ({case['store_ratio']:.2f}x) | "
                f"load GB/s kvtier {case['kvtier']['load_gbps']:.2f} "
                f"LMCache fs {case['lmcache-fs']['load_gbps']:.2f} ({case['load_ratio']:.2f}x)",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps({"rounds": args.rounds, "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
