"""The `kvtier` command."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .demo import DemoConfig, format_report, run_demo
from .errors import KVTierError
from .replay import MODEL_GEOMETRIES
from .secret import load_tier_secret, new_secret
from .trace import TOKENS_PER_BLOCK

T = TypeVar("T")


def _run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _tiers(value: str) -> list[dict[str, Any]]:
    """Tier configs as JSON text, or @PATH / PATH of a JSON file."""
    text = value
    path = Path(value[1:] if value.startswith("@") else value)
    if value.startswith("@") or (not value.lstrip().startswith("[") and path.is_file()):
        text = path.read_text()
    try:
        tiers = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON and not a JSON file: {exc}") from exc
    if isinstance(tiers, dict):
        tiers = [tiers]
    if not isinstance(tiers, list):
        raise argparse.ArgumentTypeError("tier configs must be a JSON list of objects")
    return tiers


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    defaults = DemoConfig()
    demo = commands.add_parser(
        "demo",
        help="simulate an async serving frontend over a tiered KV cache and verify every byte",
        description="Many concurrent multi-turn chats with a shared system prompt: each request "
        "loads its cached prefix, computes the rest, stores it back; every loaded byte is "
        "verified. CPU tensors stand in for GPU memory. Exits 1 on any mismatch.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument("--conversations", type=int, default=defaults.conversations)
    demo.add_argument("--turns", type=int, default=defaults.turns)
    demo.add_argument(
        "--concurrency", type=int, default=defaults.concurrency, help="requests in flight at once"
    )
    demo.add_argument("--layers", type=int, default=defaults.layers)
    demo.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    demo.add_argument("--head-dim", type=int, default=defaults.head_dim)
    demo.add_argument("--block-size", type=int, default=defaults.block_size, help="tokens per block")
    demo.add_argument(
        "--device-blocks", type=int, default=defaults.device_blocks, help="blocks of (stand-in) device memory"
    )
    demo.add_argument(
        "--num-cpu-blocks",
        type=int,
        default=defaults.num_cpu_blocks,
        help="primary (host) tier capacity in blocks",
    )
    demo.add_argument(
        "--tiers",
        type=_tiers,
        default=None,
        help="secondary tier configs: JSON text or a JSON file, e.g. "
        '\'[{"type": "memory", "capacity_bytes": 2147483648}]\' '
        "(default: a 2 GiB file-system tier in a temporary directory)",
    )
    demo.add_argument("--seed", type=int, default=defaults.seed)
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    bench = commands.add_parser(
        "bench",
        help="measure the configured tiers next to raw baselines from the same run",
        description="Per tier and block size: store and cold-load GB/s, blocks/s and call latency "
        "p50/p99, next to the same bytes moved by the plainest code for that backend in the same "
        "run; per tier: the pipeline overlap through a cache and the event-loop lag.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bench.add_argument(
        "--tiers",
        type=_tiers,
        default=None,
        help="tier configs, JSON text or a JSON file (default: a file-system tier in a temporary directory)",
    )
    bench.add_argument("--block-kib", type=int, nargs="+", default=[2048, 64], help="block sizes in KiB")
    bench.add_argument("--mib", type=int, default=256, help="MiB moved per tier and block size")
    bench.add_argument("--request-blocks", type=int, default=8, help="blocks per store / load call")
    bench.add_argument("--repeat", type=int, default=1, help="interleaved rounds per case; medians shown")
    bench.add_argument("--dir", type=Path, default=None, help="where temporary files go")
    bench.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    bench.add_argument(
        "--plot", type=Path, default=None, help="save a throughput chart (PNG; needs matplotlib)"
    )
    bench.add_argument(
        "--no-secret",
        action="store_true",
        help="skip the 'with a secret' column (fs, redis, s3 and mooncake tiers measured sealed as well)",
    )
    bench.add_argument("--no-progress", action="store_true")
    replay = commands.add_parser(
        "replay",
        help="replay a request trace (Mooncake's format) through the tiers: hit rates per tier",
        description="Each request looks up its block chain, loads the hit prefix and stores the blocks "
        "it computed, against real tiers; every loaded byte is checked. Reports prefix hit rates per "
        "tier and for the whole cache next to an unbounded cache's, bytes written and read, evictions, "
        "load latency and late arrivals. Ctrl-C stops early and still reports. Exits 1 on any wrong byte.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    replay.add_argument(
        "trace", type=Path, help="JSONL: timestamp (ms), input_length, output_length, hash_ids"
    )
    replay.add_argument(
        "--tiers",
        type=_tiers,
        default=None,
        help="secondary tier configs, JSON text or a JSON file "
        "(default: a file-system tier in a temporary directory)",
    )
    replay.add_argument("--primary-gib", type=float, default=1.0, help="primary (host) tier size")
    size = replay.add_mutually_exclusive_group()
    size.add_argument(
        "--block-bytes", type=_size, default=None, help="bytes per 512-token block (default 256K)"
    )
    size.add_argument(
        "--model-geometry",
        choices=sorted(MODEL_GEOMETRIES),
        default=None,
        help="block bytes of this model's KV for 512 tokens",
    )
    replay.add_argument(
        "--speed", type=_speed, default=None, help="X times the trace's real time, or max (default: max)"
    )
    replay.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    replay.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    replay.add_argument(
        "--settle",
        action="store_true",
        help="each request waits for its writes to reach every tier (as an engine's decode time lets "
        "them): at --concurrency 1 the replay then follows the sweep step for step",
    )
    replay.add_argument("--dir", type=Path, default=None, help="where the default fs tier's directory goes")
    replay.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    replay.add_argument(
        "--plot", type=Path, default=None, help="save the hit rate over time (PNG; needs matplotlib)"
    )
    replay.add_argument(
        "--sweep",
        nargs="?",
        const="",
        default=None,
        metavar="SIZES",
        help="no I/O: the hit rate and bytes written at each fs-tier capacity, through the primary and "
        "fs tiers' own eviction code; SIZES e.g. 1G,4G,16G (default: 1%% to 100%% of the trace's "
        "distinct blocks)",
    )
    replay.add_argument("--no-progress", action="store_true")
    secret = commands.add_parser("secret", help="tier secrets (see the security page)")
    secret_commands = secret.add_subparsers(dest="secret_command", required=True)
    secret_commands.add_parser(
        "new",
        help="print a fresh tier secret (256 bits); keep it in a 0600 file or an environment variable",
    )
    fs = commands.add_parser("fs", help="inspect and maintain a file-system tier root")
    fs_commands = fs.add_subparsers(dest="fs_command", required=True)
    stat = fs_commands.add_parser("stat", help="namespaces, blocks and bytes under ROOT")
    stat.add_argument("root", type=Path)
    verify = fs_commands.add_parser("verify", help="check every block's checksum; exit 1 if any is corrupt")
    verify.add_argument("root", type=Path)
    verify.add_argument("--remove", action="store_true", help="drop the corrupt blocks")
    secret_source = verify.add_mutually_exclusive_group()
    secret_source.add_argument(
        "--secret-env",
        metavar="NAME",
        help="the environment variable holding the tier secret: sealed blocks are then opened too",
    )
    secret_source.add_argument(
        "--secret-file", metavar="PATH", help="a file holding the tier secret (0600, yours)"
    )
    gc = fs_commands.add_parser(
        "gc", help="bring each namespace under ROOT within a capacity, oldest blocks first"
    )
    gc.add_argument("root", type=Path)
    gc.add_argument("--capacity", type=_size, required=True, help="bytes, e.g. 8G or 500M")
    return parser


def _size(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = value[-1] if value and value[-1] in units else ""
    try:
        number = float(value[: len(value) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    return int(number * units[unit])


def _speed(text: str) -> float | None:
    if text.strip().lower() == "max":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a speed (a number > 0, or max): {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"not a speed (a number > 0, or max): {text!r}")
    return value


def _plot_without_matplotlib(command: str, plot: Path | None) -> bool:
    """Whether a plot is asked for that cannot be drawn (said on stderr): checked before any work."""
    if plot is None:
        return False
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"{command}: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return True
    return False


def _show_and_save(
    args: argparse.Namespace,
    text: str,
    report: dict[str, Any],
    save_plot: Callable[[dict[str, Any], Path], None],
    *,
    json_indent: int,
) -> None:
    """A command's report: its text on stdout, then `--json` and `--plot` where asked for."""
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=json_indent))
    if args.plot is not None:
        save_plot(report, args.plot)


def _replay_command(args: argparse.Namespace) -> int:
    from .replay import ReplayConfig, run_replay
    from .replay_report import format_replay, save_replay_plot

    if _plot_without_matplotlib("kvtier replay", args.plot):
        return 2
    if args.model_geometry is not None:
        block_bytes = MODEL_GEOMETRIES[args.model_geometry] * TOKENS_PER_BLOCK
    else:
        block_bytes = args.block_bytes if args.block_bytes is not None else 256 << 10
    if args.sweep is not None:
        return _sweep_command(args, block_bytes)
    config = ReplayConfig(
        trace=args.trace,
        secondary_tiers=args.tiers,
        primary_bytes=int(args.primary_gib * (1 << 30)),
        block_bytes=block_bytes,
        speed=args.speed,
        concurrency=args.concurrency,
        limit=args.limit,
        directory=args.dir,
        progress=not args.no_progress,
        settle=args.settle,
    )
    try:
        report = _run(run_replay(config))
    except (KVTierError, ValueError, OSError) as exc:
        print(f"kvtier replay: {exc}", file=sys.stderr)
        return 2
    _show_and_save(args, format_replay(report), report, save_replay_plot, json_indent=1)
    return 0 if report["wrong_bytes"] == 0 else 1


def _sweep_command(args: argparse.Namespace, block_bytes: int) -> int:
    from .sweep import format_sweep, save_sweep_plot, sweep_report
    from .trace import read_trace

    try:
        capacities = [_size(part) for part in args.sweep.split(",")] if args.sweep.strip() else None
        if capacities is not None and not all(capacities):
            raise argparse.ArgumentTypeError("capacities must be > 0")
        requests = read_trace(args.trace, args.limit)
        report = sweep_report(requests, block_bytes, int(args.primary_gib * (1 << 30)), capacities)
    except (KVTierError, ValueError, OSError, argparse.ArgumentTypeError) as exc:
        print(f"kvtier replay --sweep: {exc}", file=sys.stderr)
        return 2
    _show_and_save(args, format_sweep(report), report, save_sweep_plot, json_indent=1)
    return 0


def _fs_command(args: argparse.Namespace) -> int:
    from .tiers.fs import admin as fs_admin

    gib = 1 << 30
    if args.fs_command == "stat":
        reports = fs_admin.stat_root(args.root)
        print(f"{'namespace':<32} {'block':>10} {'blocks':>9} {'slabs':>6} {'in use':>6} {'on disk':>12}")
        for r in reports:
            print(
                f"{r.namespace:<32} {r.block_nbytes:>10} {r.blocks:>9} {r.slabs:>6} {r.slabs_in_use:>6} "
                f"{r.bytes_on_disk / gib:>10.3f} GiB"
            )
        print(
            f"{len(reports)} namespace/block-size groups, "
            f"{sum(r.bytes_on_disk for r in reports) / gib:.3f} GiB in all"
        )
        return 0
    if args.fs_command == "verify":
        secret = load_tier_secret("fs", secret_env=args.secret_env, secret_file=args.secret_file)
        reports = fs_admin.verify_root(args.root, remove=args.remove, secret=secret)
        corrupt = sum(len(r.corrupt) for r in reports)
        for r in reports:
            print(
                f"{r.namespace}: {r.checked} blocks checked, {len(r.corrupt)} corrupt"
                + (" (removed)" if args.remove and r.corrupt else "")
                + (f"; {r.unchecked}" if r.unchecked else "")
            )
            for key in r.corrupt:
                print(f"  corrupt: {key.hex()}")
        # Always a last line: a root with nothing in it (or the wrong directory) says so.
        print(
            f"{len(reports)} namespace/block-size groups, "
            f"{sum(r.checked for r in reports)} blocks checked, {corrupt} corrupt"
        )
        return 1 if corrupt else 0
    reports = fs_admin.gc_root(args.root, args.capacity)
    for r in reports:
        print(
            f"{r.namespace}: removed {r.removed_bytes / gib:.3f} GiB, now "
            f"{r.bytes_on_disk / gib:.3f} GiB in {r.slabs} slabs, {r.blocks} blocks"
            + (f" ({r.slabs_in_use} slabs in use, left to their writers)" if r.slabs_in_use else "")
            + (f"; {r.logs_not_compacted} logs left uncompacted: no room" if r.logs_not_compacted else "")
        )
    print(
        f"{len(reports)} namespace/block-size groups, "
        f"removed {sum(r.removed_bytes for r in reports) / gib:.3f} GiB in all"
    )
    return 0


def _bench_command(args: argparse.Namespace) -> int:
    from .benchmark import BenchConfig, format_table, run_bench, save_plot

    if _plot_without_matplotlib("kvtier bench", args.plot):
        return 2
    config = BenchConfig(
        secondary_tiers=args.tiers,
        block_kib=args.block_kib,
        mib_per_case=args.mib,
        request_blocks=args.request_blocks,
        repeat=args.repeat,
        directory=args.dir,
        progress=not args.no_progress,
        with_secret=not args.no_secret,
    )
    try:
        result = _run(run_bench(config))
    except (KVTierError, ValueError, OSError) as exc:
        print(f"kvtier bench: {exc}", file=sys.stderr)
        return 2
    _show_and_save(args, format_table(result), result, save_plot, json_indent=2)
    return 0 if all(case["exact"] for case in result["cases"]) else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        config = DemoConfig(
            conversations=args.conversations,
            turns=args.turns,
            concurrency=args.concurrency,
            layers=args.layers,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            block_size=args.block_size,
            device_blocks=args.device_blocks,
            num_cpu_blocks=args.num_cpu_blocks,
            seed=args.seed,
            progress=not args.no_progress,
        )
        if args.tiers is not None:
            config.secondary_tiers = args.tiers
        try:
            report = _run(run_demo(config))
        except (KVTierError, ValueError) as exc:
            print(f"kvtier demo: {exc}", file=sys.stderr)
            return 2
        print(format_report(report, config))
        return 0 if report.mismatches == 0 else 1
    if args.command == "bench":
        return _bench_command(args)
    if args.command == "replay":
        return _replay_command(args)
    if args.command == "secret":  # the one subcommand: new
        print(new_secret())
        return 0
    try:
        return _fs_command(args)
    except (KVTierError, OSError) as exc:
        print(f"kvtier fs: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
