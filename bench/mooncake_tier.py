"""Benchmark: MooncakeTier (plain and sealed) next to the raw Mooncake client, in interleaved rounds.

    python bench/mooncake_tier.py --rounds 4                      # starts mooncake_master locally
    python bench/mooncake_tier.py --block-kib 1024 8192 --mib 64 --rounds 6
    python bench/mooncake_tier.py --block-kib 1024 --rounds 2 --scaling   # and how the raw client scales

Per block size and round: the tier stores a round's blocks from its primary tier and loads them
back (one `store` / `load` call each, as an engine's request would), and the raw Mooncake client
does `batch_put_from` / `batch_get_into` of the same number of blocks, of the same size, from
and into registered memory, in one call each; which goes first alternates. The sealed tier
runs the same way. The raw calls go through the tiers' own client (its memory registered
beside theirs): with a client of its own, the master placed each object in either client's
segment, and a get from a client's own segment (a memcpy) ran several times faster than one
from the other's (over loopback TCP), so the ratios measured where objects happened to land
(raw loads of 64 MiB took 28 to 290 ms from round to round). A ticker on the event loop
measures its lag while the tier works. Every round's objects are removed after it. A master
and the client on loopback, TCP: the numbers measure this machine's memory, not a network.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash
from common import run

import kvtier_async as kt
from kvtier_async.buffers import address_of
from kvtier_async.secret import new_secret
from kvtier_async.testing import make_key
from kvtier_async.tiers import mooncake_clients as clients

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import servers  # the test suite's server helpers: one way to start them

SEGMENT_BYTES = 1 << 30


async def lag_while(work: Any) -> tuple[float, float]:
    """(seconds `work` took, p99 of the event loop's lag meanwhile in ms)."""
    lags: list[float] = []
    done = False

    async def tick() -> None:
        while not done:
            started = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - started - 0.001)

    ticker = asyncio.ensure_future(tick())
    started = time.perf_counter()
    await work
    took = time.perf_counter() - started
    done = True
    await ticker
    lags.sort()
    return took, (lags[int(0.99 * (len(lags) - 1))] * 1000 if lags else 0.0)


class Raw:
    """The raw Mooncake client (the tiers' own, `shared`): registered memory, one batch call per
    direction."""

    def __init__(self, shared: clients.SharedClient, nbytes: int) -> None:
        from mooncake.store import ReplicateConfig

        self.shared, self.client = shared, shared.client
        self.memory = kt.PrimaryTier(
            kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=2 * nbytes // 4096), pin_memory=False
        )
        self.base = address_of(self.memory.view)
        shared.register(self.base, self.memory.view.nbytes)
        self.memory.view[nbytes:] = bytes(self.memory.view.nbytes - nbytes)  # faulted in, as the tier's are
        self.memory.view[:nbytes] = os.urandom(nbytes)
        self.config = ReplicateConfig()

    def put(self, names: list[str], size: int, at: int = 0) -> None:
        codes = self.client.batch_put_from(
            names, [at + self.base + i * size for i in range(len(names))], [size] * len(names), self.config
        )
        if any(codes):
            raise RuntimeError(f"raw put: {codes[:4]}")

    def get(self, names: list[str], size: int, at: int) -> None:
        codes = self.client.batch_get_into(
            names, [at + self.base + i * size for i in range(len(names))], [size] * len(names)
        )
        if any(code != size for code in codes):
            raise RuntimeError(f"raw get: {codes[:4]}")

    def remove(self, names: list[str]) -> None:
        self.client.batch_remove(names, True)

    def close(self) -> None:
        self.shared.unregister(self.base, self.memory.view.nbytes)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-kib", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--mib", type=int, default=64, help="MiB stored and loaded per round and variant")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--master", default=None, help="HOST:PORT of a running master (default: start one)")
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="then the raw client's puts and gets, and XXH3 of the same bytes, on 1, 2 and 4 threads at once",
    )
    args = parser.parse_args()
    master = None
    address = args.master
    if address is None:
        master = servers.MooncakeMaster()
        await asyncio.to_thread(master.start)
        address = master.address
    os.environ["KVTIER_BENCH_SECRET"] = new_secret()
    try:
        for kib in args.block_kib:
            await one_size(address, kib << 10, max(1, (args.mib << 20) // (kib << 10)), args.rounds)
        if args.scaling:
            await scaling(
                address, args.block_kib[0] << 10, max(4, (args.mib << 20) // (args.block_kib[0] << 10))
            )
    finally:
        if master is not None:
            await asyncio.to_thread(master.stop)


async def one_size(address: str, block_nbytes: int, count: int, rounds: int) -> None:
    spec = kt.OffloadingSpec(block_nbytes=block_nbytes, num_cpu_blocks=count, namespace="bench-mooncake")
    tiers = {}
    primaries = {}
    for variant, extra in (("tier", {}), ("sealed", {"secret_env": "KVTIER_BENCH_SECRET"})):
        primary = kt.PrimaryTier(spec, pin_memory=False)
        for i in range(count):
            primary.slot_view(i)[:] = os.urandom(block_nbytes)
        config = {"type": "mooncake", "master": address, "segment_bytes": SEGMENT_BYTES, **extra}
        tiers[variant] = kt.SecondaryTierFactory.create_secondary_tier(config, primary.view, spec)
        primaries[variant] = primary
        await tiers[variant].open()
    options = clients.ClientOptions(master=address, segment_bytes=SEGMENT_BYTES)
    shared = await asyncio.to_thread(clients.acquire, options)  # the tiers' client: they hold it
    raw = await asyncio.to_thread(Raw, shared, count * block_nbytes)
    rows: dict[str, dict[str, list[float]]] = {
        v: {"store": [], "load": [], "lag": []} for v in ("raw", *tiers)
    }
    nbytes = count * block_nbytes
    try:
        for r in range(rounds):
            order = ["raw", *tiers] if r % 2 else [*tiers, "raw"]
            for variant in order:
                tag = uuid.uuid4().bytes[:8]
                if variant == "raw":
                    names = [f"raw-{tag.hex()}-{i}" for i in range(count)]
                    started = time.perf_counter()
                    await asyncio.to_thread(raw.put, names, block_nbytes)
                    stored = time.perf_counter() - started
                    started = time.perf_counter()
                    await asyncio.to_thread(raw.get, names, block_nbytes, nbytes)
                    loaded = time.perf_counter() - started
                    await asyncio.to_thread(raw.remove, names)
                    rows[variant]["store"].append(nbytes / stored / 1e9)
                    rows[variant]["load"].append(nbytes / loaded / 1e9)
                    continue
                tier = tiers[variant]
                keys = [make_key(i, tag) for i in range(count)]
                stored, lag_store = await lag_while(tier.store(keys, list(range(count))))
                loaded, lag_load = await lag_while(tier.load(keys, list(reversed(range(count)))))
                if tier.stats()["load_misses"]:
                    raise RuntimeError(f"{variant}: misses {tier.stats()}")
                await tier.delete(keys)
                rows[variant]["store"].append(nbytes / stored / 1e9)
                rows[variant]["load"].append(nbytes / loaded / 1e9)
                rows[variant]["lag"].append(max(lag_store, lag_load))
    finally:
        await asyncio.to_thread(raw.close)
        await asyncio.to_thread(clients.release, options)
        for tier in tiers.values():
            await tier.aclose()
    print(
        f"{block_nbytes >> 10} KiB blocks, {count} per call, {rounds} rounds "
        "(median GB/s; ratio: median of per-round ratios)"
    )
    for variant, row in rows.items():
        base = "raw" if variant != "sealed" else "tier"
        ratios = {
            d: statistics.median(a / b for a, b in zip(row[d], rows[base][d])) for d in ("store", "load")
        }
        store, load = statistics.median(row["store"]), statistics.median(row["load"])
        line = f"  {variant:7} store {store:.2f} load {load:.2f}"
        if variant != "raw":
            line += f"  vs {base}: store {ratios['store']:.2f}x load {ratios['load']:.2f}x"
            line += f"  loop lag p99 (worst call) {max(row['lag']):.2f} ms"
        print(line, flush=True)


async def scaling(address: str, block_nbytes: int, count: int, rounds: int = 6) -> None:
    """How the raw client's puts and gets, and XXH3 reading the same bytes, scale with threads
    at once (the same blocks split between them): what bounds a tier that reads each block
    once more than the raw client does (its check)."""
    options = clients.ClientOptions(master=address, segment_bytes=SEGMENT_BYTES)
    shared = await asyncio.to_thread(clients.acquire, options)
    raw = await asyncio.to_thread(Raw, shared, count * block_nbytes)
    nbytes = count * block_nbytes
    speeds: dict[int, list[tuple[float, float, float]]] = {1: [], 2: [], 4: []}
    try:
        with ThreadPoolExecutor(4) as pool:
            for _ in range(rounds):
                for threads in speeds:
                    names = [f"scaling-{uuid.uuid4().hex[:8]}-{i}" for i in range(count)]
                    per = count // threads
                    starts = [k * per for k in range(threads)]

                    def put(start: int, names: list[str] = names, per: int = per) -> None:
                        raw.put(names[start : start + per], block_nbytes, start * block_nbytes)

                    def get(start: int, names: list[str] = names, per: int = per) -> None:
                        raw.get(names[start : start + per], block_nbytes, nbytes + start * block_nbytes)

                    def check(start: int, per: int = per) -> None:
                        view = raw.memory.view
                        for i in range(start, start + per):
                            xxhash.xxh3_64_intdigest(view[i * block_nbytes : (i + 1) * block_nbytes])

                    took = []
                    for step in (put, get, check):
                        started = time.perf_counter()
                        await _all(pool, step, starts)
                        took.append(per * threads * block_nbytes / (time.perf_counter() - started) / 1e9)
                    await asyncio.to_thread(raw.remove, names)
                    speeds[threads].append((took[0], took[1], took[2]))
    finally:
        await asyncio.to_thread(raw.close)
        await asyncio.to_thread(clients.release, options)
    print(f"raw client and XXH3, threads at once, {block_nbytes >> 10} KiB blocks, GB/s (median of {rounds})")
    for threads, row in speeds.items():
        put_gbps, get_gbps, check_gbps = (statistics.median(r[i] for r in row) for i in range(3))
        print(
            f"  {threads} threads: put {put_gbps:.2f}  get {get_gbps:.2f}  XXH3 {check_gbps:.2f}", flush=True
        )


async def _all(pool: ThreadPoolExecutor, step: Any, starts: list[int]) -> None:
    await asyncio.gather(*(asyncio.wrap_future(pool.submit(step, start)) for start in starts))


if __name__ == "__main__":
    run(main)
