"""Rerun the benchmarks the documentation shows and render its performance page.

    python bench/run_all.py                                   # every record, then the page
    python bench/run_all.py --only fs_tier loop_lag           # some records, then the page
    python bench/run_all.py --lmcache-python /tmp/lmvenv/bin/python
    python bench/run_all.py --render-only                     # the page from the saved records

Each benchmark runs as its own process, as a user would run it, and writes its results to
`docs/perf/<record>.json` together with the exact command and a description of this machine,
so every figure on the page says where it came from. LMCache pins its own dependencies, so its
record needs an environment with LMCache 0.5.6 and this package installed (`--lmcache-python`;
the module docstring of `bench/lmcache_disk.py` says how); without one that record keeps its last run.
Run nothing else on the machine meanwhile: every record shares the disk.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RECORDS = REPO / "docs" / "perf"
PY = "python"  # how a command is shown: the interpreter of the environment it ran in


def machine() -> dict[str, Any]:
    """What the numbers depend on: CPU, memory, kernel, the disk under the temp dir, versions."""
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kib = int(f.readline().split()[1])
    work = Path(tempfile.gettempdir()).resolve()
    fs, device = "unknown", "unknown"
    best = ""
    with open("/proc/mounts") as f:
        for line in f:
            dev, mount, kind = line.split()[:3]
            if str(work).startswith(mount) and len(mount) > len(best):
                best, fs, device = mount, kind, dev
    torch_version = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(),
        "disk": f"{device} ({fs}) under {work}",
        "python": platform.python_version(),
        "torch": torch_version,
    }


def run_json(command: list[str], python: str = sys.executable) -> Any:
    """Run a benchmark that writes its results to `--json PATH`; return them."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        argv = [python if part == PY else part for part in command] + ["--json", str(out)]
        if argv[0] == "kvtier":  # the console script of the environment running this
            argv[0] = str(Path(sys.executable).with_name("kvtier"))
        print("+", shlex.join(command), flush=True)
        subprocess.run(argv, cwd=REPO, check=True)
        return json.loads(out.read_text())


def fs_tier(args: argparse.Namespace) -> tuple[str, Any]:
    command = [PY, "bench/fs_tier.py", "--gib", "0.5", "--threads", "4", "8", "--aiofiles", "--repeat", "8"]
    return shlex.join(command), run_json(command)


def fs_steady(args: argparse.Namespace) -> tuple[str, Any]:
    command = [PY, "bench/fs_steady.py", "--gib", "0.5", "--repeat", "6"]
    return shlex.join(command), run_json(command)


def fs_staging(args: argparse.Namespace) -> tuple[str, Any]:
    command = [PY, "bench/fs_staging.py", "--repeat", "6"]
    return shlex.join(command), run_json(command)


def peers(args: argparse.Namespace) -> tuple[str, Any]:
    """Our fs tier and LMCache's disk backend, in one process, taking turns to go first."""
    command = [
        PY,
        "bench/lmcache_disk.py",
        "--block-mib",
        "32",
        "2",
        "--gib",
        "1",
        "--memory",
        "anon",
        "shm",
        "--rounds",
        str(args.rounds),
    ]
    return shlex.join(command), run_json(command, args.lmcache_python)


def vllm_tiers(args: argparse.Namespace) -> tuple[str, Any]:
    command = [PY, "bench/vllm_tiers.py", "--rounds", "12", "--threads", "default", "4", "8"]
    return shlex.join(command), run_json(command)


def loop_lag(args: argparse.Namespace) -> tuple[str, Any]:
    command = [PY, "bench/loop_lag.py", "--gib", "1"]
    return shlex.join(command), run_json(command)


def kvtier_bench(args: argparse.Namespace) -> tuple[str, Any]:
    tiers = json.dumps([{"type": "fs"}, {"type": "memory"}])
    command = ["kvtier", "bench", "--tiers", tiers, "--repeat", "3", "--no-progress"]
    return shlex.join(command), run_json(command)


def tier_secret(args: argparse.Namespace) -> tuple[str, Any]:
    command = [PY, "bench/tier_secret.py", "--repeat", "24"]
    return shlex.join(command), run_json(command)


def redis_sealed_pool(args: argparse.Namespace) -> tuple[str, Any]:
    command = [PY, "bench/redis_sealed_pool.py", "--repeat", "10"]
    return shlex.join(command), run_json(command)


def secret_threads(args: argparse.Namespace) -> tuple[str, Any]:
    command = [PY, "bench/secret_threads.py", "--repeat", "16"]
    return shlex.join(command), run_json(command)


def remote_tiers(args: argparse.Namespace) -> tuple[str, Any]:
    command = [PY, "bench/remote_tiers.py", "--block-kib", "64", "1024", "8192", "--repeat", "8"]
    return shlex.join(command), run_json(command)


def sglang_backend(args: argparse.Namespace) -> tuple[str, Any]:
    command = [PY, "bench/sglang_backend.py", "--repeat", "4"]
    return shlex.join(command), run_json(command)


def lmcache_l2(args: argparse.Namespace) -> tuple[str, Any]:
    command = [PY, "bench/lmcache_l2.py", "--rounds", "6"]
    return shlex.join(command), run_json(command)


def replay(args: argparse.Namespace) -> tuple[str, Any]:
    command = [PY, "bench/replay_trace.py"]
    return shlex.join(command), run_json(command)


def fs_index_scale(args: argparse.Namespace) -> tuple[str, Any]:
    command = [PY, "bench/fs_index_scale.py", "--against", "a1432f6"]  # main before issue 66
    return shlex.join(command), run_json(command)


def eviction_policies(args: argparse.Namespace) -> tuple[str, Any]:
    command = [PY, "bench/eviction_policies.py"]
    return shlex.join(command), run_json(command)


RECORDERS: dict[str, Callable[[argparse.Namespace], tuple[str, Any]]] = {
    "fs_tier": fs_tier,
    "fs_steady": fs_steady,
    "fs_staging": fs_staging,
    "fs_index_scale": fs_index_scale,
    "peers": peers,
    "vllm_tiers": vllm_tiers,
    "loop_lag": loop_lag,
    "kvtier_bench": kvtier_bench,
    "remote_tiers": remote_tiers,
    "sglang_backend": sglang_backend,
    "lmcache_l2": lmcache_l2,
    "tier_secret": tier_secret,
    "secret_threads": secret_threads,
    "redis_sealed_pool": redis_sealed_pool,
    "replay": replay,
    "eviction_policies": eviction_policies,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", choices=sorted(RECORDERS), default=None)
    parser.add_argument(
        "--lmcache-python", default=None, help="a Python with LMCache 0.5.6 and kvtier_async installed"
    )
    parser.add_argument("--rounds", type=int, default=16, help="rounds against LMCache, each first in turn")
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args()
    names = [] if args.render_only else (args.only or list(RECORDERS))
    if "peers" in names and args.lmcache_python is None:
        print("run_all: no --lmcache-python: the peers record keeps its last run", file=sys.stderr)
        names.remove("peers")
    about = machine()
    for name in names:
        started = datetime.datetime.now(datetime.timezone.utc)
        command, results = RECORDERS[name](args)
        record = {
            "command": command,
            "machine": about,
            "date": started.strftime("%Y-%m-%d"),
            "commit": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
            ).stdout.strip(),
            "results": results,
        }
        RECORDS.mkdir(parents=True, exist_ok=True)
        (RECORDS / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    subprocess.run([sys.executable, str(BENCH / "render_docs.py")], cwd=REPO, check=True)


if __name__ == "__main__":
    main()
