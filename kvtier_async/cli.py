"""The `kvtier` command."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .demo import DemoConfig, format_report, run_demo
from .errors import KVTierError

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
        "(default: a 2 GiB memory tier)",
    )
    demo.add_argument("--seed", type=int, default=defaults.seed)
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


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
    return 2  # pragma: no cover - argparse requires a command


if __name__ == "__main__":
    sys.exit(main())
