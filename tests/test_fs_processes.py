"""Several real processes on one file-system tier root: sharing, capacity, a SIGKILL, maintenance.

Each process is `tests/fs_process.py`; they synchronise through their output lines only.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import fs_helpers as h
import pytest
from fs_process import POOL, counts_in

from kvtier_async.tiers.fs.layout import ENTRY, record_bytes_for

HERE = Path(__file__).resolve().parent
RECORD = record_bytes_for(h.BLOCK_NBYTES)
pytestmark = pytest.mark.one_loop


async def start(root: Path, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(HERE / "fs_process.py"),
        str(root),
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=HERE,
    )


async def acknowledged_until(proc: asyncio.subprocess.Process, stop: str | None = None) -> list[int]:
    """The keys a storing process acknowledged, reading its lines until `stop` or its end."""
    assert proc.stdout is not None
    keys: list[int] = []
    while line := (await proc.stdout.readline()).decode():
        if line.startswith("stored"):
            keys += [int(i) for i in line.split()[1:]]
        if stop is not None and line.strip() == stop:
            break
    return keys


async def load(root: Path, first: int, count: int) -> dict[str, int]:
    proc = await start(root, "load", str(first), str(count))
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    return counts_in(out.decode())


async def kvtier_fs(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvtier_async.cli", "fs", *args, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode()


def slab_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.glob("kvtier-*/slab-*.kvs"))


@pytest.mark.asyncio
async def test_writers_and_readers_share_one_root(tmp_path: Path) -> None:
    writers = [await start(tmp_path, "store", str(100 * n), "40", "--hold") for n in range(3)]
    stored = [await acknowledged_until(w, "holding") for w in writers]
    assert stored == [list(range(100 * n, 100 * n + 40)) for n in range(3)]
    # While the writers keep the root open, every other process finds every block.
    for result in await asyncio.gather(*(load(tmp_path, 100 * n, 40) for n in range(3))):
        assert result == {"hits": 40, "misses": 0, "wrong": 0}
    for w in writers:
        assert w.stdin is not None
        w.stdin.close()
        assert await w.wait() == 0
    slabs = await asyncio.to_thread(lambda: list(tmp_path.glob("kvtier-*/slab-*.kvs")))
    assert len(slabs) == 3  # one slab per writer


@pytest.mark.asyncio
async def test_the_capacity_bounds_the_namespace_for_every_process_together(tmp_path: Path) -> None:
    capacity = 48 * (RECORD + 4 * ENTRY)  # 48 records: three writers of 40 blocks each evict
    writers = [
        await start(tmp_path, "store", str(100 * n), "40", "--capacity", str(capacity)) for n in range(3)
    ]
    stored = await asyncio.gather(*(acknowledged_until(w) for w in writers))
    assert [await w.wait() for w in writers] == [0, 0, 0]
    # Sixteen slabs of 3 records: whoever holds one stores all 40, evicting its own oldest.
    assert max(map(len, stored)) == 40
    assert await asyncio.to_thread(slab_bytes, tmp_path) <= 48 * RECORD
    results = await asyncio.gather(*(load(tmp_path, 100 * n, 40) for n in range(3)))
    assert sum(r["wrong"] for r in results) == 0
    assert 0 < sum(r["hits"] for r in results) <= 48


@pytest.mark.asyncio
@pytest.mark.parametrize("batches", [2, 9])
async def test_a_writer_killed_mid_store_leaves_nothing_the_others_misread(
    tmp_path: Path, batches: int
) -> None:
    steady = await start(tmp_path, "store", "0", "40", "--hold")
    victim = await start(tmp_path, "store", "1000", "100000")
    assert victim.stdout is not None
    acknowledged: list[int] = []
    while len(acknowledged) < 4 * batches:
        line = (await victim.stdout.readline()).decode()
        assert line.startswith("stored"), "the writer stopped early"
        acknowledged += [int(i) for i in line.split()[1:]]
    victim.send_signal(signal.SIGKILL)  # in its next store: it stores without pause
    await victim.wait()
    assert await acknowledged_until(steady, "holding") == list(range(40))
    top = max(acknowledged) + 8
    result = await load(tmp_path, 1000, top - 1000)
    assert result["wrong"] == 0
    assert result["hits"] >= len(acknowledged)  # nothing acknowledged was lost
    assert await load(tmp_path, 0, 40) == {"hits": 40, "misses": 0, "wrong": 0}
    code, out = await kvtier_fs("verify", str(tmp_path))  # while `steady` still runs
    assert (code, "0 corrupt" in out) == (0, True), out
    # The dead writer's slab is free to take: a new writer stores into it, within the capacity.
    newcomer = await start(tmp_path, "store", "5000", "8")
    assert await acknowledged_until(newcomer) == list(range(5000, 5008))
    assert steady.stdin is not None
    steady.stdin.close()
    assert await steady.wait() == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("capacity_records", [None, 24])
async def test_processes_sharing_one_key_set_never_see_wrong_bytes(
    tmp_path: Path, capacity_records: int | None
) -> None:
    # Data-parallel engines offload the same prompt prefixes: every process stores and loads
    # one pool of keys at once, some requests cancelled, one process SIGKILLed mid-run, and
    # (with a capacity of half the pool) each evicting while the others read. With the
    # capacity, records are rewritten under other processes' reads: without the checksum
    # check on read this case returns wrong bytes (4 runs of 4 failed with it taken out).
    capacity = (
        [] if capacity_records is None else ["--capacity", str(capacity_records * (RECORD + 4 * ENTRY))]
    )
    mixers = [await start(tmp_path, "mix", str(seed), "24", *capacity) for seed in range(3)]
    victim = await start(tmp_path, "mix", "99", "1000", *capacity)
    assert victim.stdout is not None
    for _ in range(2):
        assert (await victim.stdout.readline()).startswith(b"round"), "the victim stopped early"
    victim.send_signal(signal.SIGKILL)
    await victim.wait()
    counts = []
    for mixer in mixers:
        out, _ = await mixer.communicate()
        assert mixer.returncode == 0  # nothing raised
        counts.append(counts_in(out.decode().splitlines()[-1]))
    assert [c["wrong"] for c in counts] == [0, 0, 0]
    assert sum(c["hits"] for c in counts) > 0
    code, out = await kvtier_fs("verify", str(tmp_path))
    assert (code, "0 corrupt" in out) == (0, True), out
    after = await load(tmp_path, 0, POOL)
    assert after["wrong"] == 0 and after["hits"] > 0


@pytest.mark.asyncio
async def test_stat_verify_and_gc_work_while_a_process_writes(tmp_path: Path) -> None:
    holder = await start(tmp_path, "store", "0", "20", "--hold")
    assert await acknowledged_until(holder, "holding") == list(range(20))
    finished = await start(tmp_path, "store", "100", "20")
    assert await acknowledged_until(finished) == list(range(100, 120))
    await finished.wait()
    code, out = await kvtier_fs("stat", str(tmp_path))
    assert code == 0 and " 40 " in out and "1 namespace" in out, out
    code, out = await kvtier_fs("verify", str(tmp_path))
    assert code == 0 and "40 blocks checked, 0 corrupt" in out, out
    code, out = await kvtier_fs("gc", str(tmp_path), "--capacity", "1K")
    assert code == 0 and "1 slabs in use" in out, out  # the live writer's slab is left to it
    assert await load(tmp_path, 0, 20) == {"hits": 20, "misses": 0, "wrong": 0}
    assert (await load(tmp_path, 100, 20))["hits"] == 0  # the finished writer's slab was removed
    assert holder.stdin is not None
    holder.stdin.close()
    assert await holder.wait() == 0


@pytest.mark.asyncio
async def test_the_soak_script_runs_and_finds_nothing_wrong(tmp_path: Path) -> None:
    # tests/soak_fs.py is the long form of the sharing test above; a short run keeps it working.
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(HERE / "soak_fs.py"),
        str(tmp_path),
        "--seconds",
        "4",
        "--processes",
        "2",
        "--kill-every",
        "1",
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0, out.decode()
    assert "'wrong': 0" in out.decode() and "SIGKILLed" in out.decode()
