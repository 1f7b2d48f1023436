"""Soak: many processes on one file-system tier root for minutes; not part of the test suite.

    python tests/soak_fs.py ROOT --seconds 150 --processes 6 --kill-every 2 --capacity-records 400

Each process is `tests/fs_process.py ROOT mix` (concurrent stores and loads of one shared key
pool, some cancelled as they start). Every `--kill-every` seconds one of them is SIGKILLed
and a new one started in its place; meanwhile `kvtier fs verify`, `gc` and `stat` run in a
loop, as an operator's cron would. At the end: `verify`, and a new process loads the whole
pool. Exits 1 if any load returned wrong bytes, a process failed on its own, a maintenance
command failed or `verify` found a corrupt block; prints what it counted either way.
tests/test_fs_processes.py runs the short, deterministic form of this in the suite.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
import time
from pathlib import Path

import fs_helpers as h
from fs_process import POOL, counts_in

from kvtier_async.tiers.fs.layout import ENTRY, record_bytes_for

HERE = Path(__file__).resolve().parent


async def command(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=HERE
    )
    out, _ = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode()


class Mixer:
    """One `fs_process.py mix` process and the last counts it printed."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.counts = {"hits": 0, "misses": 0, "wrong": 0}
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := (await self.proc.stdout.readline()).decode():
            self.counts = counts_in(line)

    async def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()
        await self.reader


async def main(args: argparse.Namespace) -> int:
    root = str(args.root)
    capacity = str(args.capacity_records * (record_bytes_for(h.BLOCK_NBYTES) + 4 * ENTRY))
    seeds = iter(range(1, 1 << 30))
    rng = random.Random(0)

    async def start() -> Mixer:
        mix = [str(HERE / "fs_process.py"), root, "mix", str(next(seeds)), "1000000000"]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *mix, "--capacity", capacity, stdout=asyncio.subprocess.PIPE, cwd=HERE
        )
        return Mixer(proc)

    end = time.monotonic() + args.seconds
    failures: list[str] = []
    maintenance_runs = 0

    async def maintenance() -> None:
        nonlocal maintenance_runs
        cli = [sys.executable, "-m", "kvtier_async.cli", "fs"]
        while time.monotonic() < end:
            for what in (["verify", root], ["gc", root, "--capacity", capacity], ["stat", root]):
                code, out = await command(*cli, *what)
                if code != 0:
                    failures.append(f"kvtier fs {what[0]} exited {code}: {out[-500:]}")
            maintenance_runs += 1

    running = [await start() for _ in range(args.processes)]
    finished: list[Mixer] = []
    maintaining = asyncio.ensure_future(maintenance())
    kills = 0
    while time.monotonic() + args.kill_every < end:
        await asyncio.sleep(args.kill_every)  # a schedule of faults, not synchronisation
        victim = rng.randrange(len(running))
        if running[victim].proc.returncode is not None:
            failures.append(f"a mixer exited {running[victim].proc.returncode} on its own")
        await running[victim].kill()
        finished.append(running[victim])
        running[victim] = await start()
        kills += 1
    await maintaining
    for mixer in running:
        if mixer.proc.returncode is not None:
            failures.append(f"a mixer exited {mixer.proc.returncode} on its own")
        await mixer.kill()
        finished.append(mixer)
    totals = {k: sum(m.counts[k] for m in finished) for k in ("hits", "misses", "wrong")}
    code, verified = await command(sys.executable, "-m", "kvtier_async.cli", "fs", "verify", root)
    if code != 0:
        failures.append(f"kvtier fs verify exited {code}: {verified[-500:]}")
    code, loaded = await command(sys.executable, str(HERE / "fs_process.py"), root, "load", "0", str(POOL))
    if code != 0 or " wrong 0" not in loaded:
        failures.append(f"the last load: {loaded[-500:]}")
    if totals["wrong"]:
        failures.append(f"{totals['wrong']} loads returned wrong bytes")
    print(
        f"{args.seconds:.0f} s, {args.processes} processes, {kills + len(running)} SIGKILLed, "
        f"{maintenance_runs} rounds of verify/gc/stat; loads: {totals}; "
        f"then {verified.strip().splitlines()[-1]}; a new process: {loaded.strip()}"
    )
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("root", type=Path)
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument("--kill-every", type=float, default=2.0)
    parser.add_argument(
        "--capacity-records", type=int, default=24, help="the namespace's capacity, in blocks"
    )
    sys.exit(asyncio.run(main(parser.parse_args())))
