"""How many CPU threads a sealed fs tier should have: its throughput and the event loop's lag.

    python bench/secret_threads.py --threads 1 2 --block-mib 32 2 --repeat 16

The fs tier (in a temporary directory) without a secret at the default `copy_threads`,
then with a tier secret at each `--threads` count, in the same rounds, the order rotating
from round to round. Each round stores `--mib` MiB of random blocks and loads them back cold
(`kvtier bench`'s measurement of one tier); the table gives, per variant, the medians of its
store and load GB/s, of its ratio to the unsealed tier's in the same round, and of the event
loop's p99 lag (a 1 ms ticker) during the store and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

from common import print_variants, run, sealed_summary, variant_rounds

from kvtier_async.benchmark import measure_tier

SECRET_ENV = "KVTIER_SECRET_THREADS_BENCH"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="sealed copy_threads")
    parser.add_argument("--block-mib", type=int, nargs="+", default=[32, 2])
    parser.add_argument("--mib", type=int, default=256, help="MiB stored and loaded per variant and round")
    parser.add_argument("--repeat", type=int, default=16)
    parser.add_argument("--dir", type=Path, default=None, help="where the tiers' roots go (a temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    os.environ[SECRET_ENV] = os.urandom(32).hex()  # a fresh secret, never on the command line
    variants: list[tuple[str, int | None]] = [("unsealed", None)]
    variants += [(f"sealed, {n} thread{'s' if n > 1 else ''}", n) for n in args.threads]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-secret-threads-", dir=args.dir) as work:

        async def measure(block_mib: int, blocks: int, threads: int | None) -> dict[str, Any]:
            config: dict[str, Any] = {"type": "fs", "root": str(Path(work) / str(threads))}
            fields = {}
            if threads is not None:
                config["secret_env"] = SECRET_ENV
                fields["copy_threads"] = threads
            request_blocks = max(1, 16 // block_mib)  # one 16 MiB batch per request, as kvtier bench
            return await measure_tier(config, block_mib << 20, blocks, request_blocks, "t", **fields)

        for block_mib in args.block_mib:
            blocks = max(1, args.mib // block_mib)
            rounds = await variant_rounds(variants, args.repeat, partial(measure, block_mib, blocks))
            results[f"{block_mib} MiB"] = sealed_summary(rounds, "unsealed")
            print_variants(
                f"{blocks} x {block_mib} MiB blocks, {args.repeat} rounds", results[f"{block_mib} MiB"]
            )
    if args.json:
        args.json.write_text(json.dumps(results))


if __name__ == "__main__":
    run(main)
