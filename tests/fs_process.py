"""One process using a file-system tier root; tests/test_fs_processes.py runs several at once.

python fs_process.py ROOT store START COUNT [--capacity N] [--hold]
    stores keys START.. in batches of 4, printing "stored i j ..." per acknowledged batch;
    with --hold, prints "holding" and keeps the tier open until stdin closes
python fs_process.py ROOT load START COUNT
    loads those keys and prints "hits H misses M wrong W" (W: wrong bytes, never allowed)
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import fs_helpers as h


async def main(args: argparse.Namespace) -> None:
    kwargs = {} if args.capacity is None else {"capacity_bytes": args.capacity}
    tier, primary = h.make_tier(args.root, refresh_interval_s=0, **kwargs)
    async with tier:
        await tier.open()
        if args.command == "store":
            for first in range(args.start, args.start + args.count, 4):
                keys = [h.key_for(i) for i in range(first, first + 4)]
                results = await h.store_keys(tier, primary, keys)
                done = " ".join(str(i) for i, ok in zip(range(first, first + 4), results) if ok)
                print(f"stored {done}", flush=True)
            if args.hold:
                print("holding", flush=True)
                await asyncio.to_thread(sys.stdin.read)
            return
        hits = misses = wrong = 0
        for first in range(args.start, args.start + args.count, 16):
            keys = [h.key_for(i) for i in range(first, min(first + 16, args.start + args.count))]
            for ok in await h.load_and_check(tier, primary, keys):
                hits += ok is True
                misses += ok is False
                wrong += ok is None
        print(f"hits {hits} misses {misses} wrong {wrong}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("command", choices=["store", "load"])
    parser.add_argument("start", type=int)
    parser.add_argument("count", type=int)
    parser.add_argument("--capacity", type=int, default=None)
    parser.add_argument("--hold", action="store_true")
    asyncio.run(main(parser.parse_args()))
