"""`FileSystemTier` (`"fs"`): local NVMe, shared by the processes of a host, crash-safe,
self-verifying, persistent across restarts.

Blocks live as bare records in slab files (`layout` has the format and how processes
share a directory). This module wires the tier contract to the package's rooms: the
index of what is where (`index.SlabIndex`, event-loop thread, no I/O), the slab files as
found on disk (`slab_files.SlabFiles`: opening, claiming, reading the other processes'
logs) and the records' reads and writes (`records.RecordIO`: one `pwritev`/`preadv` per run
of neighbouring records, a large record read in parts by several I/O threads, straight between
the aligned primary slots and the files with O_DIRECT where the file system allows it), both
on the scheduler's worker threads; where a store's next record comes from (`room.Room`).
The index holds the slabs this process writes, plus what it has read of the other slabs'
logs, brought up to date when a lookup misses (`following.Following`, at most every
`refresh_interval_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from ...block_format import BlockSealer, block_codec
from ...buffers import address_of as buffer_address
from ...errors import ConfigError
from ...keys import check_keys
from ...secret import load_tier_secret
from ...slot_pool import SlotPool, for_batches_in_flight
from ...spec import OffloadingSpec
from ...tier import SecondaryTierManager
from ...tier_resource import INLINE_CPU_BYTES
from ...workers import wait_uncancellable
from . import layout
from .following import Following
from .index import OtherSlab, OwnSlab, Record, SlabIndex
from .layout import ENTRY, SEALED_NAMESPACE_LABEL, namespace_dir_name, record_bytes_for, seal_namespace_name
from .records import ReadJob, ReadStatus, RecordIO, WriteJob
from .room import Room
from .slab_files import DEFAULT_CAPACITY_BYTES, SlabFiles, close_fd
from .staging import STAGE_BYTES, address_of, pages_scattered

__all__ = ["DEFAULT_CAPACITY_BYTES", "DEFAULT_REFRESH_INTERVAL_S", "FileSystemTier"]


#: Default `refresh_interval_s`: how stale this process's view of other processes' blocks may be.
DEFAULT_REFRESH_INTERVAL_S = 0.05

#: With a secret, the memory records are sealed and opened in at most (at least a batch).
SEALED_SLOTS_BYTES = 256 << 20


class FileSystemTier(SecondaryTierManager):
    """Blocks on a local file system under `root`, within `capacity_bytes`, least recently used
    evicted first; any number of processes may share a root.

    Args:
        root: directory for the cache (created 0700 if missing). Processes that open the same
            root and namespace share its blocks: each finds what any of them stored.
        capacity_bytes: bytes on disk this namespace may take, logs included, all processes
            together. Default `DEFAULT_CAPACITY_BYTES`, capped at 80% of the space available.
        direct_io: "auto" probes O_DIRECT once and falls back to buffered I/O
            where the file system refuses it; True requires it; False never uses it.
        fsync: False (it is a cache); True makes `store` return only once the
            data and the index entry are durable.
        staging: with O_DIRECT, whether reads and writes go through a per-thread huge-page
            buffer instead of straight between the primary memory and the disk. "auto"
            stages when the primary memory's pages are found scattered in physical memory
            (see `staging`), where direct I/O runs far below the disk's speed.
        refresh_interval_s: a lookup that misses reads the other processes' new index
            entries if the last such read is older than this; `refresh()` reads them now.
        secret_env, secret_file: where the tier secret is (`secret`): records are then sealed
            (AES-256-GCM) and the index and directory names keyed; see the security page.
    """

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str = "fs",
        *,
        root: str | os.PathLike[str],
        capacity_bytes: int | None = None,
        direct_io: bool | str = "auto",
        fsync: bool = False,
        staging: bool | str = "auto",
        refresh_interval_s: float = DEFAULT_REFRESH_INTERVAL_S,
        secret_env: str | None = None,
        secret_file: str | None = None,
        secret: object = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        if not isinstance(root, (str, os.PathLike)) or not str(root):
            raise ConfigError(f"fs tier: root must be a directory path, got {root!r}")
        tier_secret = load_tier_secret(
            tier_type, secret_env=secret_env, secret_file=secret_file, secret=secret
        )
        self.codec = block_codec(offloading_spec.namespace, tier_secret)
        #: What a record holds: the block's bytes, or with a secret its sealed value.
        self.stored_nbytes = (
            self.codec.value_nbytes(self.block_nbytes) if self.codec.sealed else self.block_nbytes
        )
        self.record_bytes = record_bytes_for(self.stored_nbytes)
        if capacity_bytes is not None and (
            isinstance(capacity_bytes, bool)
            or not isinstance(capacity_bytes, int)
            or capacity_bytes < self.record_bytes + ENTRY
        ):
            raise ConfigError(
                "fs tier: capacity_bytes must be an int of at least one record "
                f"({self.record_bytes + ENTRY} bytes), got {capacity_bytes!r}"
            )
        if direct_io not in ("auto", True, False):
            raise ConfigError(f'fs tier: direct_io must be "auto", True or False, got {direct_io!r}')
        if not isinstance(fsync, bool):
            raise ConfigError(f"fs tier: fsync must be a bool, got {fsync!r}")
        if staging not in ("auto", True, False):
            raise ConfigError(f'fs tier: staging must be "auto", True or False, got {staging!r}')
        if (
            isinstance(refresh_interval_s, bool)
            or not isinstance(refresh_interval_s, (int, float))
            or not 0 <= refresh_interval_s < float("inf")
        ):
            raise ConfigError(
                f"fs tier: refresh_interval_s must be a number of seconds >= 0, got {refresh_interval_s!r}"
            )
        self.root = Path(root)
        self.directory = self.root / namespace_dir_name(self.codec.namespace_tag)
        self.requested_capacity = capacity_bytes
        self.direct_io_requested = direct_io
        self.staging_requested = staging
        self.refresh_interval_s = float(refresh_interval_s)
        self.files = SlabFiles(
            self.root,
            SEALED_NAMESPACE_LABEL if self.codec.sealed else offloading_spec.namespace,
            self.directory,
            self.stored_nbytes,
            self.record_bytes,
            fsync=fsync,
            # Recorded in a new directory's FORMAT: `kvtier fs verify` learns from it whether
            # records are sealed and, with the secret, which namespace's keys open them.
            kind="plain"
            if tier_secret is None
            else seal_namespace_name(tier_secret, offloading_spec.namespace),
        )
        self.index = SlabIndex(self.record_bytes)  # touched on the event-loop thread only
        #: With a secret, records move through these slots (sealed there), not the primary's.
        self.sealed_slots: SlotPool | None = None
        records_view = self.primary_kv_view
        if self.codec.sealed:
            # No more records in flight than the primary memory has blocks: a tier over a few
            # page slots (SGLang's extra pools: 64 MiB) needs no 200 MiB of sealing slots. Calls
            # that move one primary block twice at once wait for a slot, as past the cap.
            primary_bytes = offloading_spec.num_cpu_blocks * -(-self.record_bytes // 4096) * 4096
            self.sealed_slots = for_batches_in_flight(
                offloading_spec.limits, self.record_bytes, min(SEALED_SLOTS_BYTES, primary_bytes)
            )
            records_view = self.sealed_slots.view
        self._records_base = buffer_address(records_view)
        #: With a secret: the keys behind the names this process stored or found, so that the
        #: tier tells its removal listeners of keys, not names.
        self._keys_of_names: dict[bytes, bytes] = {}
        self.records = RecordIO(
            self.files, records_view, self.index.own, self.fault_log, sealed=self.codec.sealed
        )
        self.index.clock = self.records.current_seq  # blocks' ages, in the logs' numbers
        self.room = Room(self.index, self.files, self.counters, self.fault_log)
        self.following = Following(self.index, self.files, self.room, self.refresh_interval_s)

    @property
    def capacity_bytes(self) -> int:
        """Bytes on disk this namespace may take, all processes together (0 until opened)."""
        return self.files.capacity_bytes

    @property
    def fsync(self) -> bool:
        """Whether `store` returns only once the data and the index entries are durable."""
        return self.files.fsync

    @property
    def direct_io(self) -> bool:
        """Whether records move with O_DIRECT (settled on open)."""
        return self.files.direct_io

    @property
    def staging(self) -> bool:
        """Whether O_DIRECT goes through the staging buffers (settled on open)."""
        return self.records.staging

    # -- opening and closing -------------------------------------------------------------------
    async def open_backend(self) -> None:
        self.files.name = self.name
        self.files.run_blocking = self.scheduler.run_blocking
        await self.run_blocking(self._open_files)
        await self.following.refresh()

    def _open_files(self) -> None:
        """Worker thread: open the namespace's files, make the staging buffers if staging, and
        size how far ahead of the stores in flight a slab is claimed."""
        self.files.open(self.direct_io_requested, self.requested_capacity)
        if self.sealed_slots is not None:
            self.sealed_slots.populate()
        if self._records_base % 4096:
            self.files.direct_io = False  # O_DIRECT needs aligned memory; a foreign view may not be
        if self.staging_requested == "auto":
            staging = self.direct_io and pages_scattered(self.records.view) is True
        else:
            staging = self.direct_io and bool(self.staging_requested)
        if staging:
            self.records.stager.reserve(self.scheduler.limits.io_threads)
        self.records.staging = staging
        # What the stores in flight may take at once: fewer free records left than this, and
        # the next slab is claimed in the background (never more than half a slab ahead).
        # Store lanes are the scheduler's (a cache's, when shared); batches are cut by our spec.
        in_flight = self.scheduler.limits.max_inflight_stores * self.offloading_spec.limits.batch_blocks
        self.room.claim_ahead_records = min(self.files.slab_records // 2, in_flight)

    async def close_backend(self) -> None:
        # A claim or refresh whose callers were cancelled still runs: let it settle first, so
        # that what it opened is closed here.
        pending = [task for task in (self.room.claiming, self.following.refreshing) if task is not None]
        if pending:
            await asyncio.wait(pending)
        own, others = list(self.index.own.values()), list(self.index.others.values())
        self.index.own.clear()
        self.index.others.clear()
        await self.run_blocking(SlabFiles.close, own, others)
        await self.run_blocking(self.files.close_folder)
        await self.run_blocking(self.records.stager.release)

    # -- the other processes' blocks ------------------------------------------------------------
    async def refresh(self) -> None:
        """Read the index entries other processes have written since the last refresh.

        A lookup that misses does this itself when the last refresh is older than
        `refresh_interval_s`; call it to see another process's new blocks now.
        """
        with self._operation():
            if await self._ensure_open():
                await self.following.refresh()

    def _slot_offset(self, block: memoryview) -> int:
        return address_of(block) - self._records_base

    # -- hooks ---------------------------------------------------------------------------------
    async def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        # docstring inherited
        if not isinstance(self.codec, BlockSealer):
            return await self._write_records(keys, blocks)
        sealer, results = self.codec, []
        pool = self._slots()
        for part in pool.parts(len(keys)):
            part_keys, part_blocks = keys[part], blocks[part]
            async with pool.borrowed(len(part_keys), self.record_bytes) as sealed:
                names = [sealer.name(key) for key in part_keys]
                await self.run_cpu(
                    len(part_keys) * self.stored_nbytes,
                    _seal,
                    sealer,
                    self._bound_to(names, part_keys),
                    part_blocks,
                    sealed,
                    self.stored_nbytes,
                )
                written = await self._write_records(names, sealed)
            self._remember(names, part_keys, written)
            results += written
        return results

    async def read_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        # docstring inherited
        if not isinstance(self.codec, BlockSealer):
            return (await self._read_records(keys, blocks))[0]
        sealer, results = self.codec, []
        pool = self._slots()
        for part in pool.parts(len(keys)):
            part_keys, part_blocks = keys[part], blocks[part]
            async with pool.borrowed(len(part_keys), self.record_bytes) as sealed:
                names = [sealer.name(key) for key in part_keys]
                opener = partial(
                    _open,
                    sealer,
                    self._bound_to(names, part_keys),
                    part_blocks,
                    sealed,
                    stored_nbytes=self.stored_nbytes,
                )
                found, opened = await self._read_records(names, sealed, opener)
            self.counters["unauthenticated_blocks"] += sum(f and not o for f, o in zip(found, opened))
            self._remember(names, part_keys, opened)
            results += opened
        return results

    def _bound_to(self, names: Sequence[bytes], keys: Sequence[bytes]) -> Sequence[bytes]:
        """What sealed records are bound to: their names (format 3, so that `kvtier fs verify`
        opens them with the secret alone; a name is a keyed hash of its key), or in a directory
        of format 2, as they were written then, their keys."""
        return names if self.files.format.records_bound_to_names else keys

    def _slots(self) -> SlotPool:
        if self.sealed_slots is None:
            raise RuntimeError("fs tier: sealed slots without a secret")
        return self.sealed_slots

    def _names(self, keys: Sequence[bytes]) -> list[bytes]:
        """The names `keys` are kept under in the index (themselves, or keyed with a secret)."""
        return [self.codec.name(key) for key in keys] if self.codec.sealed else list(keys)

    def _remember(self, names: Sequence[bytes], keys: Sequence[bytes], held: Sequence[bool]) -> None:
        """Note the keys behind held names, for the removal listeners (where there are any).
        Bounded: past twice the index's size, names the index no longer holds are forgotten
        (another process evicted them: its evictions reach no listener of ours)."""
        if not self.removal_listeners:
            return
        self._keys_of_names.update((name, key) for name, key, ok in zip(names, keys, held) if ok)
        if len(self._keys_of_names) > 2 * len(self.index) + 1024:
            find = self.index.find
            self._keys_of_names = {n: k for n, k in self._keys_of_names.items() if find(n) is not None}

    def _removed(self, names: list[bytes]) -> None:
        """Tell the listeners of the keys behind `names`, which this tier no longer holds."""
        if not self.codec.sealed:
            self.notify_removed(names)
            return
        keys = [self._keys_of_names.pop(name) for name in names if name in self._keys_of_names]
        self.notify_removed(keys)

    async def _write_records(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        """`write_blocks` of index keys (names) and blocks in the records' memory."""
        index = self.index
        results = [False] * len(keys)
        jobs: list[tuple[int, bytes, Record, bool]] = []
        try:
            for i, key in enumerate(keys):
                where = index.find(key)
                if where is not None:
                    results[i] = True
                    index.touch(where)
                    continue
                taken = await self.room.take_record()
                if taken is None:
                    self.counters["stores_without_room"] += 1
                    continue
                where, deletion, evicted = taken
                if evicted is not None:
                    self._removed([evicted])
                jobs.append((i, key, where, deletion))
            if not jobs:
                return results
            work: list[WriteJob] = [
                (key, where, self._slot_offset(blocks[i]), deletion) for i, key, where, deletion in jobs
            ]
            # The checksums are taken on the CPU threads while the I/O thread writes, so the
            # disk never waits for them; the I/O thread then logs the entries that carry them,
            # in the same job: one hand-off per batch, and the thread is free for the next one
            # without a round trip through the loop.
            summing = await self.scheduler.submit_cpu(self.records.checksums, [w[2] for w in work])
            try:
                status, full, checksums = await self.run_blocking(self.records.write, work, summing)
            finally:
                # Whatever happened, the primary slots are read to the end before we return.
                with contextlib.suppress(Exception):
                    await wait_uncancellable(asyncio.wrap_future(summing))
        except BaseException:
            # Cancelled (the thread, if any, has finished): these records are not published, and
            # what their log says now is unknown, so a deletion goes first when they are reused.
            index.abandon([where for _, _, where, _ in jobs])
            raise
        published = index.settle_writes([(k, w, d) for _, k, w, d in jobs], status, checksums, full)
        for (i, _, _, _), ok in zip(jobs, published):
            results[i] = ok
        self.counters["write_errors"] += published.count(False)
        if full:
            self.room.out_of_space()
        return results

    async def _read_records(
        self,
        keys: Sequence[bytes],
        blocks: Sequence[memoryview],
        then: Callable[[list[bool]], list[bool]] | None = None,
    ) -> tuple[list[bool], list[bool]]:
        """`read_blocks` of index keys (names) into blocks in the records' memory: per key, whether
        its record arrived whole and checked; and what `then` makes of that list (a sealed
        tier's opening), run in the check's job on a CPU thread, so a batch queues there once
        (a read of 1 MiB or less: on the loop after the check)."""
        await self.following.refresh_if_missing(keys)
        index = self.index
        jobs: list[tuple[int, bytes, Record, OwnSlab | OtherSlab]] = []
        for i, key in enumerate(keys):
            pinned = index.pin(key)  # never evicted or reused while read
            if pinned is not None:
                jobs.append((i, key, *pinned))
        if not jobs:
            nothing = [False] * len(keys)
            return nothing, nothing
        work: list[ReadJob] = [
            (slab.data_fd, where, index.checksum_of(where), self._slot_offset(blocks[i]))
            for i, _, where, slab in jobs
        ]
        try:
            pieces = self.records.read_pieces(work)
            done = await self.scheduler.run_blocking_each(self.records.read_piece, pieces)
            got = self.records.arrived(len(work), pieces, done)
            positions = [i for i, *_ in jobs]
            # A few small blocks are opened on the loop after their check instead: cheaper than on
            # the CPU thread (64 KiB blocks, 8 a call, 12 rounds: loads 0.62x the unsealed tier's
            # against 0.55x, 1.3 against 1.7 CPU s/GB).
            in_job = then if len(jobs) * self.stored_nbytes > INLINE_CPU_BYTES else None
            outcome, results, after = await self.scheduler.run_cpu(
                _checked, self.records, work, got, positions, len(keys), in_job
            )
        finally:
            for _, _, where, slab in jobs:
                close_fd(index.unpin(where, slab))
        corrupt = []
        for (_, key, where, _), status in zip(jobs, outcome):
            if status == "ok":
                continue
            if status == "error" or index.key_of(where) != key:
                continue  # a fault, or forgotten meanwhile
            index.forget(where)
            if status == "corrupt":
                self.counters["corrupt_blocks"] += 1
                corrupt.append((key, where))
            else:  # its writer rewrote it after we read the log: our entry was stale
                self.counters["stale_blocks"] += 1
            self._removed([key])
        if corrupt:
            await self.run_blocking(self.records.log_deletions, corrupt)
        if then is not None and after is None:
            after = then(results)
        return results, results if after is None else after

    def hold(self, keys: Sequence[bytes]) -> list[bool]:
        # docstring inherited. A hold pins the record as a read in flight does (never evicted or
        # reused until the last unpin); another process's record is its writer's to evict: False.
        check_keys(keys)
        if self._closed:
            return [False] * len(keys)
        return [self.index.hold(name) for name in self._names(keys)]

    def release(self, keys: Sequence[bytes]) -> None:
        # docstring inherited
        for name in self._names(keys):
            self.index.release(name)

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        # docstring inherited
        if not await self._ensure_open():
            return [False] * len(keys)
        names = self._names(keys)
        found = await self.following.holds_each(names)
        if self.codec.sealed:
            self._remember(names, keys, found)
        return found

    async def delete(self, keys: Sequence[bytes]) -> int:
        # docstring inherited
        if not await self._ensure_open():
            return 0
        dropped = []
        for name in self._names(keys):
            where = self.index.find(name)
            if where is None:
                continue
            dropped.append((name, where))
            self.index.forget(where)
        if dropped:
            self._removed([name for name, _ in dropped])
            await self.run_blocking(self.records.log_deletions, dropped)
        return len(dropped)

    def backend_stats(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "sealed": self.codec.sealed,
            "sealed_slot_bytes": 0 if self.sealed_slots is None else self.sealed_slots.nbytes,
            "unauthenticated_blocks": self.counters["unauthenticated_blocks"],
            # Symlinks, FIFOs and other users' files where ours belong, skipped (this process).
            "foreign_files_skipped": layout.foreign_files_skipped(),
            "blocks": len(self.index),
            "own_blocks": self.index.own_blocks(),
            "used_bytes": self.index.used_bytes(),
            "capacity_bytes": self.capacity_bytes,
            "direct_io": self.direct_io,
            "staging": self.staging,
            "stage_buffer_bytes": self.records.stager.buffers * STAGE_BYTES,
            "fsync": self.fsync,
            "slabs": len(self.index.own),
            "shared_slabs": len(self.index.others),
            "evictions": self.counters["evictions"],
            "corrupt_blocks": self.counters["corrupt_blocks"],
            "stale_blocks": self.counters["stale_blocks"],
            "write_errors": self.counters["write_errors"],
            "stores_without_room": self.counters["stores_without_room"],
            "out_of_space": self.counters["out_of_space"],
            "disk_full": self.room.disk_full,
        }


def _seal(
    sealer: BlockSealer,
    keys: Sequence[bytes],
    blocks: Sequence[memoryview],
    records: list[memoryview],
    stored_nbytes: int,
) -> None:
    """CPU thread: each block's sealed value into its record, the record's padding zeroed (it
    goes to disk too: it must hold nothing but zeros, not a record read here before)."""
    sealer.seal_many(keys, blocks, [record[:stored_nbytes] for record in records])
    for record in records:
        record[stored_nbytes:] = bytes(len(record) - stored_nbytes)


def _checked(
    records: RecordIO,
    work: list[ReadJob],
    got: list[int],
    positions: list[int],
    keys: int,
    then: Callable[[list[bool]], list[bool]] | None,
) -> tuple[list[ReadStatus], list[bool], list[bool] | None]:
    """CPU thread: what arrived checked (`RecordIO.verify`); per key of the `keys`, whether its
    record did (`positions`: each job's key); and, where there is a `then`, its answer to that."""
    status = records.verify(work, got)
    ok = [False] * keys
    for position, s in zip(positions, status):
        ok[position] = s == "ok"
    return status, ok, None if then is None else then(ok)


def _open(
    sealer: BlockSealer,
    keys: Sequence[bytes],
    blocks: Sequence[memoryview],
    records: list[memoryview],
    found: list[bool],
    stored_nbytes: int,
) -> list[bool]:
    """CPU thread: each found record opened into its block; False where it does not authenticate."""
    return [
        f and sealer.open_into(block, record[:stored_nbytes], key)
        for key, block, record, f in zip(keys, blocks, records, found)
    ]
