"""One process using a file-system tier root; tests/test_fs_processes.py runs several at once.

python fs_process.py ROOT store START COUNT [--capacity N] [--hold]
    stores keys START.. in batches of 4, printing "stored i j ..." per acknowledged batch;
    with --hold, prints "holding" and keeps the tier open until stdin closes
python fs_process.py ROOT load START COUNT
    loads those keys and prints "hits H misses M wrong W" (W: wrong bytes, never allowed)
python fs_process.py ROOT mix SEED ROUNDS [--capacity N]
    ROUNDS rounds of 8 concurrent stores and loads of batches drawn from one pool of 48 keys
    that every mixing process shares (a hot head of 8, as a shared prompt prefix), some
    cancelled as they start; prints "round r hits H misses M wrong W" after each, counting the
    loads so far (tests/soak_fs.py runs many at length)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys

import fs_helpers as h

import kvtier_async as kt
from kvtier_async.tiers.fs import FileSystemTier

POOL, HOT, TASKS, BATCH = 48, 8, 8, 6


def counts_in(line: str) -> dict[str, int]:
    """The counts a "hits H misses M wrong W" line (or its "round r ..." form) reports."""
    words = line.split()
    words = words[words.index("hits") :]
    return {words[i]: int(words[i + 1]) for i in range(0, len(words), 2)}


async def mix(tier: FileSystemTier, primary: kt.PrimaryTier, seed: int, rounds: int) -> None:
    rng = random.Random(seed)
    counts = {"hits": 0, "misses": 0, "wrong": 0}

    async def one(task: int) -> None:
        slots = list(range(task * BATCH, task * BATCH + rng.randint(1, BATCH)))
        first = rng.randrange(HOT) if rng.random() < 0.5 else rng.randrange(POOL - len(slots) + 1)
        keys = [h.key_for(i) for i in range(first, first + len(slots))]
        storing = rng.random() < 0.5
        for slot, key in zip(slots, keys):
            primary.slot_view(slot)[:] = h.payload_for(key) if storing else bytes(h.BLOCK_NBYTES)
        operation = asyncio.ensure_future(tier.store(keys, slots) if storing else tier.load(keys, slots))
        if rng.random() < 0.15:
            await asyncio.sleep(0)  # let it start, then cancel it
            operation.cancel()
        try:
            results = await operation
        except asyncio.CancelledError:
            return
        if not storing:
            for slot, key, ok in zip(slots, keys, results):
                right = bytes(primary.slot_view(slot)) == h.payload_for(key)
                counts["hits" if ok and right else "wrong" if ok else "misses"] += 1

    for r in range(rounds):
        await asyncio.gather(*(one(t) for t in range(TASKS)))
        print(f"round {r} " + " ".join(f"{k} {v}" for k, v in counts.items()), flush=True)


async def main(args: argparse.Namespace) -> None:
    kwargs: dict[str, int] = {} if args.capacity is None else {"capacity_bytes": args.capacity}
    if args.command == "mix":
        kwargs["num_cpu_blocks"] = TASKS * BATCH  # a slot range per concurrent task
    tier, primary = h.make_tier(args.root, refresh_interval_s=0, **kwargs)
    async with tier:
        await tier.open()
        if args.command == "mix":
            await mix(tier, primary, args.start, args.count)
            return
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
    parser.add_argument("command", choices=["store", "load", "mix"])
    parser.add_argument("start", type=int)  # mix: the seed
    parser.add_argument("count", type=int)  # mix: the rounds
    parser.add_argument("--capacity", type=int, default=None)
    parser.add_argument("--hold", action="store_true")
    asyncio.run(main(parser.parse_args()))
