"""kvtier tiers as an LMCache L2 adapter: `KVTierL2Adapter` (LMCache 0.5.6, multiprocess server).

LMCache's multiprocess server keeps KV chunks in its L1 memory and hands slower
storage to L2 adapters. The `plugin` adapter type loads this one::

    --l2-adapter '{"type": "plugin", "module_path": "kvtier_async.integrations.lmcache",
                   "class_name": "KVTierL2Adapter",
                   "adapter_params": {"tier": {"type": "fs", "root": "/nvme/kv"}}}'

`"tier"` is a kvtier tier config, as the vLLM and SGLang integrations take it;
`"limits"` optionally sizes kvtier's scheduler, `"staging_mib"` the staging
memory per object size (below).

The contract. LMCache's store, prefetch and eviction controllers call from their
own threads; nothing here blocks them: a `submit_*` call checks its arguments,
numbers the task, hands it to a private event loop on a daemon thread
(`bridge.LoopThread`, as for vLLM and SGLang) and returns. When a task ends its
result is recorded first, then the task's event fd is signalled: a reader that
drains the fd's counter once for many completions finds every result it was told
about. `query_*` answer each task exactly once (None before it has ended).

Objects and memory. LMCache's objects vary in size; a kvtier tier moves
fixed-size blocks. The adapter keeps one tier per object size (`lmcache_objects`).
Where LMCache describes its L1 arena (`l1_memory_desc`: its server and `lmcache
bench l2` do) and the size is a multiple of 4096 bytes, that tier works on the
arena itself: objects are written from and read into their own bytes. Otherwise
the tier has a staging region of its own (`staging_mib`), and each object is
copied in or out of its staging slot on kvtier's worker threads.

Keys. An `ObjectKey` (chunk hash, model, KV rank, object group, cache salt)
becomes one kvtier key, a BLAKE2b digest of all five fields and of the weights
behind the model name (`model_identity.weights_identity`: a local model directory's
configuration and weight files, or a hub id's cached revision): two models, ranks,
groups, salts or weight revisions never share a block, and the tier's block format
checks each block against its key and checksum on every load. The weights are
looked at once per model name per adapter, on the engine's thread that first names
it (never on the loop); LMCache's own L1 keys by model name alone, so after
updating weights in place restart LMCache's server, as the engine.

Lookup and lock. A lookup answers which keys the tier holds and locks each hit
until `submit_unlock` gives it back: the tier `hold`s the block, so its own
eviction passes it over (the fs tier for blocks this process wrote, the memory
tier for all). Where the tier cannot promise that (a Redis server evicting under
`maxmemory`, a block another process's fs tier wrote and may evict), a locked
block may still go, and its load then misses, which LMCache's contract allows (a
load may fail; it checks the bitmap).

Capacity. Where the tier config declares `capacity_bytes`, the adapter reports it to LMCache
(`max_capacity_bytes`), and LMCache's usage (`get_usage`: its status page, its watermark
eviction and its per-`cache_salt` quota eviction) counts the bytes of the objects this
adapter stored: each counted once when the tier first holds it, and taken off when the tier
stops holding it, whether LMCache deleted it or the tier evicted it to stay within its
capacity (the tier's removal listeners say so). Both evictions then act: LMCache's when its
watermarks say, the tier's whenever a store needs room. Without a declared capacity the
adapter reports none (0), as LMCache's fs adapter does, and LMCache's eviction stays off: the
tier bounds and evicts itself. The capacity is per object size (each size class is a tier of
its own); LMCache stores objects of one size, so it is the adapter's.

This module imports LMCache; `import kvtier_async` does not.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.platform import create_event_notifier

from ..errors import ClosedError, ConfigError
from .bridge import LoopThread, engine_config, settle
from .lmcache_objects import InPlace, SizeClass, SizeClasses, arena_view, check_objects, object_view, parts
from .model_identity import weights_identity

__all__ = ["KVTierL2Adapter"]

log = logging.getLogger(__name__)

#: Default staging memory per object size, in MiB.
STAGING_MIB = 256
#: How long `close` lets tasks in flight finish before it cancels them.
CLOSE_GRACE_S = 10.0


def object_key(key: Any, weights: str | None = None) -> bytes:
    """The kvtier key of an LMCache `ObjectKey`: a digest of every field that names the object,
    and of `weights` (the model's `weights_identity`) where it is known."""
    fields = [
        bytes(key.chunk_hash),
        str(key.model_name).encode(),
        str(int(key.kv_rank)).encode(),
        str(int(getattr(key, "object_group_id", 0))).encode(),
        str(getattr(key, "cache_salt", "")).encode(),
    ]
    if weights is not None:  # without it, keys stay as they were: blocks stored then still load
        fields.append(weights.encode())
    digest = hashlib.blake2b(digest_size=32, person=b"kvtier-lmcache")
    for field in fields:
        digest.update(len(field).to_bytes(4, "big"))
        digest.update(field)
    return digest.digest()


class ObjectKeys:
    """`ObjectKey`s to kvtier keys, each model's weights looked at once. Engine threads call at
    once; the first to name a model reads its files (never the loop thread: see the callers)."""

    #: Model names remembered; past that the memory starts over (names come from engine configs).
    MAX_MODELS = 256

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._weights: dict[str, str | None] = {}

    def __call__(self, keys: list[Any]) -> list[bytes]:
        return [object_key(key, self._weights_of(str(key.model_name))) for key in keys]

    def _weights_of(self, model: str) -> str | None:
        with self._lock:
            if model in self._weights:
                return self._weights[model]
        weights = weights_identity(model)  # outside the lock: it reads files
        with self._lock:
            if len(self._weights) >= self.MAX_MODELS:
                self._weights.clear()
            return self._weights.setdefault(model, weights)


def _declared_capacity(tier_config: Mapping[str, Any]) -> int:
    """The tier config's `capacity_bytes` where it declares one (the tier checks its type), else 0."""
    capacity = tier_config.get("capacity_bytes")
    if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity > 0:
        return capacity
    return 0


def _layout_nbytes(desc: Any) -> int:
    """Bytes of an object laid out as `desc` (an LMCache `MemoryLayoutDesc`); 0 if unreadable."""
    try:
        return sum(
            int(torch.Size(shape).numel()) * dtype.itemsize for shape, dtype in zip(desc.shapes, desc.dtypes)
        )
    except (AttributeError, TypeError, ValueError):
        return 0


class KVTierL2Adapter(L2AdapterInterface):  # type: ignore[misc]  # LMCache has no type information
    """Any kvtier tier as LMCache's L2 (`--l2-adapter '{"type": "plugin", ...}'`)."""

    def __init__(self, adapter_params: Mapping[str, Any], l1_memory_desc: Any = None) -> None:
        params = dict(getattr(adapter_params, "adapter_params", adapter_params) or {})
        self.tier_config, self.limits = engine_config("kvtier LMCache adapter", "adapter_params", params)
        staging_mib = params.get("staging_mib", STAGING_MIB)
        if isinstance(staging_mib, bool) or not isinstance(staging_mib, int) or staging_mib < 1:
            raise ConfigError(
                f'kvtier LMCache adapter: "staging_mib" must be an int >= 1, got {staging_mib!r}'
            )
        super().__init__(max_capacity_bytes=_declared_capacity(self.tier_config))
        #: The objects LMCache's usage counts, by kvtier key: (its ObjectKey, bytes). Loop thread.
        self._counted: dict[bytes, tuple[Any, int]] = {}
        self._lock = threading.Lock()  # guards the task books below; LMCache's threads call at once
        self._next_task = 0
        self._stores_done: dict[L2TaskId, L2StoreResult] = {}
        self._lookups_done: dict[L2TaskId, Bitmap] = {}
        self._loads_done: dict[L2TaskId, Bitmap] = {}
        self._locks: Counter[bytes] = Counter()
        # Per locked key, per lock, the size class whose tier holds its block (None: it could not).
        # Touched on the loop thread only.
        self._held: dict[bytes, list[SizeClass | None]] = {}
        self._closed = False
        self._store_fd = create_event_notifier()
        self._lookup_fd = create_event_notifier()
        self._load_fd = create_event_notifier()
        arena = arena_view(l1_memory_desc)
        self._sizes = SizeClasses(  # loop thread only
            self.tier_config, self.limits, staging_mib << 20, arena, on_removed=self._on_tier_removed
        )
        self._names = ObjectKeys()  # called on LMCache's threads, so the loop never reads model files
        self._bridge = LoopThread("kvtier-lmcache")

    # -- event fds ----------------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return int(self._store_fd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_fd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_fd.fileno())

    # -- submitting ---------------------------------------------------------------------------------
    def _new_task(self) -> L2TaskId:
        with self._lock:
            if self._closed:
                raise ClosedError("kvtier LMCache adapter is closed")
            task_id = self._next_task
            self._next_task += 1
            return task_id

    def _start(self, work: Any) -> None:
        self._bridge.start(work)

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> L2TaskId:
        """Store `objects` under `keys` in the background; the result via `pop_completed_store_tasks`."""
        check_objects(keys, objects)
        wanted = self._names(keys)
        task_id = self._new_task()
        self._start(self._store(task_id, list(keys), wanted, list(objects)))
        return task_id

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores_done = self._stores_done, {}
        return done

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any = None) -> L2TaskId:
        """Which of `keys` the tier holds, each hit locked; the bitmap via `query_lookup_and_lock_result`.
        The groups' layouts name the object sizes to look in (a restarted adapter has opened none)."""
        sizes = {_layout_nbytes(desc) for desc in (group_layout_descs or {}).values()} - {0}
        wanted = self._names(keys)
        task_id = self._new_task()
        self._start(self._lookup(task_id, wanted, sorted(sizes)))
        return task_id

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._lookups_done.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        wanted = self._names(keys)
        with self._lock:
            unlocked = [key for key in wanted if self._locks[key]]
            for key in unlocked:
                if self._locks[key] > 1:
                    self._locks[key] -= 1
                else:
                    self._locks.pop(key, None)
        self._bridge.call_soon(self._release, unlocked)  # after the lookup that locked them

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> L2TaskId:
        """Load `keys` into `objects` (LMCache's buffers) in the background; the bitmap via
        `query_load_result`: a bit is set only where the object now holds the exact bytes."""
        check_objects(keys, objects)
        wanted = self._names(keys)
        task_id = self._new_task()
        self._start(self._load(task_id, list(keys), wanted, list(objects)))
        return task_id

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loads_done.pop(task_id, None)

    # -- the tasks, on the loop thread ----------------------------------------------------------------
    async def _store(
        self, task_id: L2TaskId, keys: list[Any], wanted: list[bytes], objects: list[Any]
    ) -> None:
        stored: list[int] = []  # newly stored: counted in LMCache's byte accounting once
        ok = False
        try:
            cut = parts(objects)
            # The parts run at once: one part's copies overlap the others' writes.
            work = [
                self._sizes.store(nbytes, [wanted[i] for i in part], [objects[i] for i in part])
                for nbytes, part in cut
            ]
            outcomes = await asyncio.gather(*work, return_exceptions=True)
            ok = True
            for (_, part), outcome in zip(cut, outcomes):
                if isinstance(outcome, BaseException):  # a task never raises into LMCache: it fails
                    ok = False
                    log.warning("kvtier LMCache adapter: store task %d failed: %r", task_id, outcome)
                    continue
                stored += [i for i, state in zip(part, outcome) if state == "new"]
                ok = ok and "failed" not in outcome
        except Exception as exc:
            log.warning("kvtier LMCache adapter: store task %d failed: %r", task_id, exc)
        finally:  # even when cancelled at close: every task gets its answer
            sizes = [object_view(objects[i]).nbytes for i in stored]
            with self._lock:
                self._stores_done[task_id] = L2StoreResult(ok, sum(sizes))
            if stored:
                for i, size in zip(stored, sizes):
                    self._counted[wanted[i]] = (keys[i], size)
                self._notify_keys_stored([keys[i] for i in stored], sizes)
            self._store_fd.notify()

    async def _lookup(self, task_id: L2TaskId, wanted: list[bytes], sizes: list[int]) -> None:
        bitmap = Bitmap(len(wanted))
        try:
            for nbytes in sizes:  # the groups' full-chunk sizes: opened here after a restart
                await self._sizes.get(nbytes)
            present = [False] * len(wanted)
            found_in: list[SizeClass | None] = [None] * len(wanted)
            # An object's size is not in its key: ask the tier of every size opened so far.
            for size_class in self._sizes.opened():
                todo = [i for i, hit in enumerate(present) if not hit]
                if not todo:
                    break
                found = await size_class.tier.lookup_each([wanted[i] for i in todo])
                for i, hit in zip(todo, found):
                    present[i] = hit
                    if hit:
                        found_in[i] = size_class
            for size_class in {id(c): c for c in found_in if c is not None}.values():
                mine = [i for i, c in enumerate(found_in) if c is size_class]
                for i, held in zip(mine, size_class.tier.hold([wanted[i] for i in mine])):
                    self._held.setdefault(wanted[i], []).append(size_class if held else None)
            with self._lock:
                for i, hit in enumerate(present):
                    if hit:
                        bitmap.set(i)
                        self._locks[wanted[i]] += 1
        except Exception as exc:
            log.warning("kvtier LMCache adapter: lookup task %d failed: %r", task_id, exc)
        finally:  # even when cancelled at close: every task gets its answer
            with self._lock:
                self._lookups_done[task_id] = bitmap
            self._lookup_fd.notify()

    def _release(self, keys: list[bytes]) -> None:
        """Loop thread: give back one lock of each key to the tier that held it."""
        for key in keys:
            holders = self._held.get(key)
            if not holders:
                continue
            size_class = holders.pop()
            if not holders:
                del self._held[key]
            if size_class is not None:
                size_class.tier.release([key])

    async def _load(
        self, task_id: L2TaskId, keys: list[Any], wanted: list[bytes], objects: list[Any]
    ) -> None:
        bitmap = Bitmap(len(keys))
        loaded: list[int] = []
        try:
            cut = parts(objects)
            outcomes = await asyncio.gather(
                *(
                    self._sizes.load(nbytes, [wanted[i] for i in part], [objects[i] for i in part])
                    for nbytes, part in cut
                ),
                return_exceptions=True,
            )
            for (_, part), outcome in zip(cut, outcomes):
                if isinstance(outcome, BaseException):  # its objects may be half-written: none counts
                    log.warning("kvtier LMCache adapter: load task %d failed in part: %r", task_id, outcome)
                    continue
                loaded += [i for i, done in zip(part, outcome) if done]
        except Exception as exc:
            log.warning("kvtier LMCache adapter: load task %d failed: %r", task_id, exc)
        finally:  # even when cancelled at close: every task gets its answer
            for i in loaded:
                bitmap.set(i)
            with self._lock:
                self._loads_done[task_id] = bitmap
            if loaded:
                self._notify_keys_accessed([keys[i] for i in loaded])
            self._load_fd.notify()

    # -- housekeeping ---------------------------------------------------------------------------------
    def delete(self, keys: list[Any]) -> None:
        """Delete `keys` from the tier (LMCache's eviction); waits until done. A no-op once closed."""
        with self._lock:
            if self._closed or not keys:
                return
        self._bridge.call(self._delete(self._names(keys)))

    async def _delete(self, wanted: list[bytes]) -> None:
        # The tiers tell `_on_tier_removed` of what they let go, which takes it off LMCache's usage.
        for size_class in self._sizes.opened():
            held = await size_class.tier.lookup_each(wanted)
            doomed = [key for key, h in zip(wanted, held) if h]
            if doomed:
                await size_class.tier.delete(doomed)
                self._on_tier_removed(doomed)  # where a tier does not tell its listeners

    def _on_tier_removed(self, removed: list[bytes]) -> None:
        """A tier stopped holding these keys (LMCache deleted them, or the tier evicted them):
        off LMCache's usage, those it counted (loop thread)."""
        gone = [self._counted.pop(key) for key in removed if key in self._counted]
        if gone:
            self._notify_keys_deleted([key for key, _ in gone], [size for _, size in gone])

    def report_status(self) -> dict[str, Any]:
        """LMCache's status page: health and the tiers' own figures, per object size."""
        with self._lock:
            closed, locked = self._closed, len(self._locks)
        tiers = {} if closed else self._bridge.call(self._stats())
        return {
            "is_healthy": not closed,
            "type": "KVTierL2Adapter",
            "tier": self.tier_config["type"],
            "locked_key_count": locked,
            "tiers_by_object_size": tiers,
        }

    async def _stats(self) -> dict[int, dict[str, Any]]:
        return {
            size_class.nbytes: {**size_class.tier.stats(), "in_place": isinstance(size_class, InPlace)}
            for size_class in self._sizes.opened()
        }

    def close(self) -> None:
        """Let tasks in flight finish (cancel them after `CLOSE_GRACE_S`), close the tiers, stop the
        thread, close the event fds. Afterwards nothing here holds a view of LMCache's memory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._bridge.finish(self._close())
        finally:
            for notifier in (self._store_fd, self._lookup_fd, self._load_fd):
                notifier.close()

    async def _close(self) -> None:
        if cancelled := await settle(self._bridge.started, CLOSE_GRACE_S):
            log.warning("kvtier LMCache adapter: cancelled %d tasks still running at close", cancelled)
        await self._sizes.close()
