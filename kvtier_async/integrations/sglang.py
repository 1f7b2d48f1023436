"""kvtier tiers as SGLang's HiCache L3 storage backend: `KVTierHiCacheStorage` (SGLang 0.5.23).

SGLang's hierarchical cache keeps KV pages in GPU memory, a host memory pool and
a storage backend. SGLang loads this one through its `dynamic` backend path::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "kvtier", "module_path": "kvtier_async.integrations.sglang",
      "class_name": "KVTierHiCacheStorage", "interface_v1": 1,
      "tier": {"type": "fs", "root": "/nvme/kv"}}'

`"tier"` is a kvtier tier config, as the vLLM adapter takes it (fs, redis, s3,
memory, or an out-of-tree tier); `"limits"` optionally sizes kvtier's scheduler
(`io_threads`, ...).

How a page is stored. SGLang hands the backend its host pool after building it
(`register_mem_pool_host`); only then are the KV dtype, layout and page size
known, so the tier is opened there, and a configuration it cannot serve fails
SGLang's start-up with the reason. With `"interface_v1": 1` the cache
controller names pages by their host-pool token slots, and the pool's
`get_page_buffer_meta` says where a page's bytes lie: 2 runs (K and V) in the
page-first layout, 2 per layer in the layer-first one, 1 or 1 per layer for MLA.
Each run is one kvtier block, read and written in place in the pool (no staging
copy: the pool's buffer is the tier's primary memory), its key the page's key
and the run's number. A page counts as stored, present or loaded only when all
its runs are.

Keys. SGLang's page keys are content hashes that name neither the model, the
KV dtype, the layout nor the rank. The backend's kvtier namespace carries them:
the model name and a digest of the pool's geometry (kind, dtype, layout, page
size, layers, run size) and, for non-MLA models, the tensor-, pipeline- and
context-parallel rank and size. Pages of another model, dtype, layout or rank
are never found; MLA ranks share one copy, written by SGLang's writer rank only.

Threads. SGLang's controller calls the backend from its prefetch, prefetch I/O
and backup threads at once, synchronously. The tier runs on a private event
loop on a daemon thread (`bridge.LoopThread`, as for vLLM); each call waits for
its own result there. `batch_exists` answers from what this backend stored,
loaded or found (remembered until the tier reports a page gone) without
crossing threads, and asks the tier only about the rest.

The generic (non-v1) path moves flat page tensors: they are copied through a
staging region into a second tier object over the same storage, whose blocks
are whole flat pages in their own namespace.

This module imports SGLang; `import kvtier_async` does not.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from ..errors import ClosedError, ConfigError, InvalidArgumentError
from ..factory import SecondaryTierFactory
from ..primary import reserve_host_memory
from ..spec import OffloadingSpec
from ..tier import SecondaryTierManager as KVTier
from .bridge import LoopThread, engine_config
from .known_keys import KnownKeys
from .model_identity import weights_identity

__all__ = ["KNOWN_PAGES", "KVTierHiCacheStorage"]

log = logging.getLogger(__name__)

#: Pages this backend remembers the tier holds, to answer `batch_exists` without asking; the
#: least recently used are forgotten first (and then asked about again).
KNOWN_PAGES = 1 << 18
#: Bytes of the staging region of the generic (flat page) path, at most.
GENERIC_STAGING_BYTES = 256 << 20
_RUN = struct.Struct(">H")  # a run's number, after the page key


def _page_key(key: str) -> bytes:
    """The bytes of one SGLang page key: its 32-byte digest when it is 64 hex characters."""
    if not isinstance(key, str) or not key:
        raise InvalidArgumentError(f"SGLang page keys are non-empty str, got {key!r}")
    if len(key) == 64:
        try:
            return b"\x00" + bytes.fromhex(key)
        except ValueError:
            pass
    raw = key.encode()
    if len(raw) > 120:
        raise InvalidArgumentError(f"SGLang page key too long for kvtier ({len(raw)} bytes): {key[:40]}...")
    return b"\x01" + raw  # tagged, so no other key reads as a digest


class _PageRuns:
    """Where each host-pool page's bytes lie: `runs` equal runs of the pool's buffer, read from the
    pool's own `get_page_buffer_meta`, as row numbers of `run_nbytes` in the buffer."""

    def __init__(self, pool: Any) -> None:
        buffer = getattr(pool, "kv_buffer", None)
        if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ConfigError(
                f"kvtier SGLang backend: host pool {type(pool).__name__} has no contiguous CPU kv_buffer "
                "(this layout is not supported)"
            )
        self.pool = pool
        self.page_size = int(pool.page_size)
        self.base = buffer.data_ptr()
        self.nbytes = buffer.numel() * buffer.element_size()
        try:
            ptrs, sizes = pool.get_page_buffer_meta(torch.arange(self.page_size, dtype=torch.int64))
        except (NotImplementedError, ValueError, AssertionError) as exc:
            raise ConfigError(
                f"kvtier SGLang backend: host pool {type(pool).__name__} with layout "
                f"{getattr(pool, 'layout', '?')!r} does not describe its pages ({exc})"
            ) from exc
        if not ptrs or len(set(sizes)) != 1:
            raise ConfigError(
                f"kvtier SGLang backend: host pool layout {getattr(pool, 'layout', '?')!r} splits a page "
                f"into runs of different sizes {sorted(set(sizes))}; not supported"
            )
        self.runs = len(ptrs)
        self.run_nbytes = int(sizes[0])
        if self.run_nbytes % 4096 or self.base % 4096 or self.nbytes % self.run_nbytes:
            raise ConfigError(
                f"kvtier SGLang backend: a page's runs are {self.run_nbytes} bytes (page size x heads x "
                "head dim x dtype size, per layer or not); kvtier needs a multiple of 4096, at 4096-byte "
                "aligned offsets: raise --page-size"
            )
        # The buffer as bytes, the tier's primary memory: a run is one block, in place.
        self.view: memoryview = buffer.view(torch.uint8).reshape(-1).numpy().data

    def rows(self, pages: int, host_indices: torch.Tensor) -> list[int]:
        """The rows of `pages` pages named by `host_indices` (their token slots), page by page."""
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
            raise InvalidArgumentError("host_indices must be a 1-D tensor of host-pool token slots")
        if host_indices.numel() != pages * self.page_size:
            raise InvalidArgumentError(
                f"{pages} keys need {pages * self.page_size} host_indices (page size {self.page_size}), "
                f"got {host_indices.numel()}"
            )
        ptrs, _ = self.pool.get_page_buffer_meta(host_indices.to("cpu", torch.int64))
        rows = []
        for ptr in ptrs:
            offset = int(ptr) - self.base
            if offset % self.run_nbytes or not 0 <= offset < self.nbytes:
                raise InvalidArgumentError(
                    f"host_indices name a slot outside the host pool (offset {offset})"
                )
            rows.append(offset // self.run_nbytes)
        return rows


def _namespace(config: HiCacheStorageConfig, pool: Any, runs: _PageRuns, path: str) -> str:
    """The kvtier namespace: model name plus a digest of everything that decides a page's bytes."""
    fields: dict[str, Any] = {
        "path": path,
        "pool": type(pool).__name__,
        "kind": "mla" if config.is_mla_model else "mha",
        "dtype": str(pool.dtype),
        "layout": str(pool.layout),
        "page_size": runs.page_size,
        "layers": int(getattr(pool, "layer_num", 0)),
        "runs": runs.runs,
        "run_nbytes": runs.run_nbytes,
        "pp": [config.pp_rank, config.pp_size],
        "cp": [config.attn_cp_rank, config.attn_cp_size],
        "dcp": [config.dcp_rank, config.dcp_size],
        "format": getattr(pool, "storage_format_tag", None),
    }
    if not config.is_mla_model:  # MLA KV is the same on every TP rank: one shared copy
        fields["tp"] = [config.tp_rank, config.tp_size, config.dp_rank]
    weights = weights_identity(config.model_name or "")
    if weights is not None:  # other weights under the same name: another namespace
        fields["weights"] = weights
    digest = hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=12).hexdigest()
    model = (config.model_name or "unnamed-model")[:160]
    return f"sglang:{model}:{digest}"


class KVTierHiCacheStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang has no type information
    """Any kvtier tier as SGLang's HiCache L3 storage (`--hicache-storage-backend dynamic`)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.tier_config, self.limits = engine_config("kvtier SGLang backend", "extra_config", extra)
        self.storage_config = storage_config
        self._lock = threading.Lock()  # guards the fields below; controller threads call at once
        self._known: KnownKeys[bytes] = KnownKeys(KNOWN_PAGES)
        self._closed = False
        self._bridge: LoopThread | None = None
        self._tier: KVTier | None = None
        self._runs: _PageRuns | None = None
        self._generic: _GenericPath | None = None
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "get_gbps": [],
            "set_gbps": [],
        }

    # -- start-up ---------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands over its host pool: open the tier over it (raises, stopping start-up, if the
        pool's layout or the tier config cannot be served)."""
        super().register_mem_pool_host(mem_pool_host)
        with self._lock:
            if self._tier is not None:
                if self._runs is not None and self._runs.pool is mem_pool_host:
                    return  # registered again with the same pool
                raise ConfigError("kvtier SGLang backend: a second host pool; this backend serves one")
        runs = _PageRuns(mem_pool_host)
        spec = self._spec(
            runs.run_nbytes,
            runs.nbytes // runs.run_nbytes,
            _namespace(self.storage_config, mem_pool_host, runs, "v1"),
        )
        bridge = LoopThread("kvtier-sglang")
        try:
            tier = bridge.call(self._open(spec, runs.view))
        except BaseException:
            bridge.stop()
            raise
        with self._lock:
            self._bridge, self._tier, self._runs = bridge, tier, runs
        log.info(
            "kvtier SGLang backend: %s tier, namespace %s, %d runs of %d bytes per page",
            self.tier_config["type"],
            spec.namespace,
            runs.runs,
            runs.run_nbytes,
        )

    def _spec(self, block_nbytes: int, blocks: int, namespace: str) -> OffloadingSpec:
        return OffloadingSpec(
            block_nbytes=block_nbytes,
            num_cpu_blocks=blocks,
            block_size=int(getattr(self.mem_pool_host, "page_size", 1)),
            secondary_tiers=[self.tier_config],
            namespace=namespace,
            **self.limits,
        )

    async def _open(self, spec: OffloadingSpec, view: memoryview) -> KVTier:
        tier = SecondaryTierFactory.create_secondary_tier(self.tier_config, view, spec)
        try:
            await tier.open()
        except BaseException:
            await tier.aclose()
            raise
        tier.removal_listeners.append(self._on_removed)
        return tier

    def _ready(self) -> tuple[LoopThread, KVTier, _PageRuns]:
        with self._lock:
            if self._closed:
                raise ClosedError("kvtier SGLang backend is closed")
            if self._bridge is None or self._tier is None or self._runs is None:
                raise ConfigError("kvtier SGLang backend: called before SGLang registered its host pool")
            return self._bridge, self._tier, self._runs

    # -- the v1 path: pages in place in the host pool -----------------------------------------------
    def _v1_args(
        self, keys: list[str], host_indices: torch.Tensor
    ) -> tuple[LoopThread, KVTier, _PageRuns, list[bytes], list[int]]:
        """A v1 call checked before anything moves: the tier, the pages' keys and their runs' rows."""
        bridge, tier, runs = self._ready()
        return bridge, tier, runs, [_page_key(key) for key in keys], runs.rows(len(keys), host_indices)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store each page's runs from the host pool; True per page whose runs all were stored."""
        if not keys:
            return []
        bridge, tier, runs, pages, rows = self._v1_args(keys, host_indices)
        if not self.storage_config.is_storage_writer:
            return [True] * len(keys)  # an MLA replica: the writer rank stores the shared copy
        started = time.perf_counter()
        results = bridge.call(tier.store(self._run_keys(pages, runs.runs), rows))
        stored = self._per_page(results, runs.runs)
        self._record("backup_pgs", "set_gbps", sum(stored), runs, started)
        self._remember([page for page, ok in zip(pages, stored) if ok])
        return stored

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Load each page's runs into the host pool; True per page whose runs all arrived exact."""
        if not keys:
            return []
        bridge, tier, runs, pages, rows = self._v1_args(keys, host_indices)
        started = time.perf_counter()
        results = bridge.call(tier.load(self._run_keys(pages, runs.runs), rows))
        loaded = self._per_page(results, runs.runs)
        self._record("prefetch_pgs", "get_gbps", sum(loaded), runs, started)
        with self._lock:
            self._known.add(page for page, ok in zip(pages, loaded) if ok)
            self._known.forget(page for page, ok in zip(pages, loaded) if not ok)
        return loaded

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many pages, from the first, the tier holds whole."""
        if not keys:
            return 0
        bridge, tier, runs = self._ready()
        pages = [_page_key(key) for key in keys]
        with self._lock:
            first_unknown = next(
                (i for i, page in enumerate(pages) if not self._known.touch(page)), len(pages)
            )
        if first_unknown == len(pages):
            return len(pages)  # answered from memory: no thread crossing
        rest = pages[first_unknown:]
        present = bridge.call(tier.lookup_each(self._run_keys(rest, runs.runs), stop_at_miss=True))
        whole = self._per_page(present, runs.runs)
        found = next((i for i, ok in enumerate(whole) if not ok), len(whole))
        self._remember(rest[:found])
        return first_unknown + found

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    @staticmethod
    def _run_keys(pages: Sequence[bytes], runs: int) -> list[bytes]:
        return [page + _RUN.pack(run) for page in pages for run in range(runs)]

    @staticmethod
    def _per_page(results: Sequence[bool], runs: int) -> list[bool]:
        pages = -(-len(results) // runs)  # a lookup that stopped at a miss may end mid-page
        return [
            len(results) >= (i + 1) * runs and all(results[i * runs : (i + 1) * runs]) for i in range(pages)
        ]

    # -- what this backend knows the tier holds ------------------------------------------------------
    def _remember(self, pages: Sequence[bytes]) -> None:
        with self._lock:
            self._known.add(pages)

    def _on_removed(self, keys: list[bytes]) -> None:
        """The tier let go of runs (evicted, deleted, found corrupt): forget their pages (loop thread)."""
        with self._lock:
            self._known.forget(key[: -_RUN.size] for key in keys)

    # -- the generic path: flat page tensors ----------------------------------------------------------
    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat page tensors (the non-v1 controller path); True if every page was stored."""
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            raise InvalidArgumentError("batch_set needs one flat page tensor per key")
        if not self.storage_config.is_storage_writer:
            return True
        return all(self._generic_path().set([_page_key(k) for k in keys], list(values)))

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Load flat pages into `target_locations` (SGLang's dummy pages); each, or None if missing."""
        if not keys:
            return []
        if target_locations is None or len(target_locations) != len(keys):
            raise InvalidArgumentError("batch_get needs one flat page tensor per key to load into")
        targets = list(target_locations)
        loaded = self._generic_path().get([_page_key(k) for k in keys], targets)
        return [target if ok else None for target, ok in zip(targets, loaded)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        if target_location is None:
            target_location = self.mem_pool_host.get_dummy_flat_data_page()
        return self.batch_get([key], [target_location])[0]

    def _generic_path(self) -> _GenericPath:
        bridge, _, runs = self._ready()
        with self._lock:
            if self._generic is None:
                self._generic = _GenericPath(self, bridge, runs)
            return self._generic

    # -- SGLang's housekeeping -------------------------------------------------------------------------
    def clear(self) -> None:
        """Delete the pages this backend remembers (stored, loaded or found present). Pages of a
        shared tier it never met stay: one server's flush does not empty the fleet's cache."""
        bridge, tier, runs = self._ready()
        with self._lock:
            pages = self._known.take_all()
        if pages:
            bridge.call(tier.delete(self._run_keys(pages, runs.runs)))

    def get_stats(self) -> Any:
        """SGLang's `StorageMetrics` since the last call (with `--enable-metrics`), or None."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            taken = {name: values for name, values in self._metrics.items()}
            self._metrics = {name: [] for name in taken}
        if not any(taken.values()):
            return None
        return StorageMetrics(
            prefetch_pgs=[int(n) for n in taken["prefetch_pgs"]],
            backup_pgs=[int(n) for n in taken["backup_pgs"]],
            prefetch_bandwidth=taken["get_gbps"],
            backup_bandwidth=taken["set_gbps"],
        )

    def _record(self, pages_name: str, rate_name: str, pages: int, runs: _PageRuns, started: float) -> None:
        seconds = time.perf_counter() - started
        with self._lock:
            self._metrics[pages_name].append(pages)
            if pages and seconds > 0:
                self._metrics[rate_name].append(pages * runs.runs * runs.run_nbytes / seconds / 1e9)

    def tier_stats(self) -> dict[str, Any]:
        """The kvtier tier's own stats (counters, backend figures)."""
        bridge, tier, _ = self._ready()
        return bridge.call(_stats(tier))

    def close(self) -> None:
        """Close the tier(s) and stop the loop thread; idempotent. SGLang calls it on detach."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            bridge, tier, generic = self._bridge, self._tier, self._generic
        if bridge is None:
            return
        bridge.finish(_close_tiers([t for t in (generic.tier if generic else None, tier) if t is not None]))


async def _close_tiers(tiers: list[KVTier]) -> None:
    for tier in tiers:
        await tier.aclose()


async def _stats(tier: KVTier) -> dict[str, Any]:
    return tier.stats()


class _GenericPath:
    """Flat page tensors through a staging region and a second tier object, blocks of whole pages."""

    def __init__(self, backend: KVTierHiCacheStorage, bridge: LoopThread, runs: _PageRuns) -> None:
        page_nbytes = runs.runs * runs.run_nbytes
        self.page_nbytes = page_nbytes
        stride = -(-page_nbytes // 4096) * 4096
        self.slots = max(1, min(128, GENERIC_STAGING_BYTES // stride))
        self._memory = reserve_host_memory(self.slots * stride)
        pool = backend.mem_pool_host
        namespace = _namespace(backend.storage_config, pool, runs, "flat")
        spec = backend._spec(page_nbytes, self.slots, namespace)
        self.staging = torch.frombuffer(self._memory, dtype=torch.uint8).view(self.slots, stride)
        self.bridge = bridge
        self.tier = bridge.call(backend._open(spec, memoryview(self._memory).cast("B", (self.slots, stride))))
        self._lock = threading.Lock()  # one batch at a time through the staging slots

    def _flat(self, tensor: Any) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(f"flat pages are tensors, got {type(tensor).__name__}")
        flat = (tensor if tensor.is_contiguous() else tensor.contiguous()).reshape(-1).view(torch.uint8)
        if flat.numel() != self.page_nbytes:
            raise InvalidArgumentError(f"a flat page is {self.page_nbytes} bytes, got {flat.numel()}")
        return flat

    def set(self, keys: list[bytes], values: list[Any]) -> list[bool]:
        flats = [self._flat(value) for value in values]
        results: list[bool] = []
        with self._lock:
            for start in range(0, len(keys), self.slots):
                chunk = flats[start : start + self.slots]
                for slot, flat in enumerate(chunk):
                    self.staging[slot, : self.page_nbytes].copy_(flat)
                ids = list(range(len(chunk)))
                results += self.bridge.call(self.tier.store(keys[start : start + self.slots], ids))
        return results

    def get(self, keys: list[bytes], targets: list[Any]) -> list[bool]:
        flats = [self._flat(target) for target in targets]
        for target, flat in zip(targets, flats):
            if flat.data_ptr() != target.data_ptr():
                raise InvalidArgumentError("batch_get targets must be contiguous tensors")
        results: list[bool] = []
        with self._lock:
            for start in range(0, len(keys), self.slots):
                chunk = keys[start : start + self.slots]
                loaded = self.bridge.call(self.tier.load(chunk, list(range(len(chunk)))))
                for slot, ok in enumerate(loaded):
                    if ok:
                        flats[start + slot].copy_(self.staging[slot, : self.page_nbytes])
                results += loaded
        return results
