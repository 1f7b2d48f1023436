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
SGLang's start-up with the reason. The pool's `get_page_buffer_meta` says where a
page's bytes lie, as equal runs; `sglang_pages` turns that into one storage
layout for the geometry, whichever path stores a page: each run a block (runs of
4096-byte multiples, moved in place in the host pool by the v1 path), or the
page one packed block (smaller runs, copied through page slots). A page counts as
stored, present or loaded only when all its blocks are.

Two paths. With `"interface_v1": 1` SGLang's controller names pages by their
host-pool slots (`batch_set_v1` / `batch_get_v1`); without it (SGLang's default
for a dynamic backend) it hands over flat page tensors (`batch_set` /
`batch_get`). Both store the same blocks under the same names in one namespace:
a page stored by either path is found by `batch_exists` and loaded by either.
Flat pages are copied through page slots, reordered into runs (`flat_order`).

Hybrid models (SGLang's v2 interface). A hybrid model's other host pools (Mamba state, SWA
windows, DSA indexers, draft pools) arrive through `register_mem_host_pool_v2`, at start-up
or later; each is stored as blocks of its own geometry in a namespace of its own
(`sglang_pools`). KV pages still move through the v1 or generic path; `batch_set_v2` /
`batch_get_v2` move the extra pools, and `batch_exists_v2` answers for KV and the extra pools
together, per hit policy, as SGLang's `HiCacheFile` does (`sglang_hits`).

DeepSeek V4. SGLang anchors its KV on a `LogicalHostPool`, which holds no bytes (its pages are
empty; the model's data lies in compressed pools that move through the v2 calls). Each KV page
of such a pool is stored as one anchor block (`sglang_pages.ANCHOR`), in a namespace of its own
that names it an anchor of a logical pool: the KV calls store, find and load anchors (a load
checks the anchor's content and writes nothing: the pool has no memory), so the hit query
answers the KV prefix as HiCacheFile's zero-byte files do, and the compressed pools are extra
pools like any other.

Keys. SGLang's page keys are content hashes that name neither the model, the
KV dtype, the layout nor the rank. The backend's kvtier namespace carries them:
the model name (and the weights behind it) and a digest of the pool's geometry
(kind, dtype, layout, page size, layers, run size, packing) and, for non-MLA
models, the tensor-, pipeline- and context-parallel rank and size. Pages of
another model, dtype, layout or rank are never found; MLA ranks share one copy,
written by SGLang's writer rank only.

Threads. SGLang's controller calls the backend from its prefetch, prefetch I/O
and backup threads at once, synchronously. The tier runs on a private event
loop on a daemon thread (`bridge.LoopThread`, as for vLLM); each call waits for
its own result there, and page copies run on the calling thread (never the
loop). `batch_exists` answers from what this backend stored, loaded or found
(remembered until the tier reports a page gone) without crossing threads, and
asks the tier only about the rest.

This module imports SGLang; `import kvtier_async` does not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool

from ..errors import ClosedError, ConfigError, InvalidArgumentError
from ..spec import OffloadingSpec
from ..tier import SecondaryTierManager as KVTier
from .bridge import LoopThread, engine_config, start_tier
from .known_keys import KnownKeys
from .sglang_hits import hit_answer
from .sglang_pages import (
    ALIGNMENT,
    ANCHOR,
    AnchorShape,
    BlockLayout,
    PageRuns,
    PageSlots,
    StagedPages,
    flat_order,
)
from .sglang_pools import ExtraPools, pool_namespace

__all__ = ["KNOWN_PAGES", "KVTierHiCacheStorage"]

log = logging.getLogger(__name__)

#: Pages this backend remembers the tier holds, to answer `batch_exists` without asking; the
#: least recently used are forgotten first (and then asked about again).
KNOWN_PAGES = 1 << 18
#: Bytes of the page slots that pages are copied through (flat pages; packed layouts), at most.
PAGE_SLOT_BYTES = 256 << 20
#: Page slots that a logical pool's anchors are copied through (64 of 4096 bytes).
ANCHOR_SLOT_BYTES = 64 * ALIGNMENT


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


def _pool_name(name: Any) -> PoolName:
    """SGLang's pool name (a `PoolName`, or its value); raises `InvalidArgumentError`."""
    try:
        return PoolName(name)
    except ValueError:
        raise InvalidArgumentError(f"unknown SGLang host pool name {name!r}") from None


def _namespace(config: HiCacheStorageConfig, pool: Any, runs: PageRuns, layout: BlockLayout) -> str:
    """The KV pages' kvtier namespace (`pool_namespace`): everything that decides a page's bytes
    and how they are stored."""
    fields: dict[str, Any] = {
        # Both SGLang paths store into this one namespace. "v1" is kept from when only that path
        # did, so pages stored then are still found.
        "path": "v1",
        "pool": type(pool).__name__,
        "kind": "mla" if config.is_mla_model else "mha",
        "dtype": str(pool.dtype),
        "layout": str(pool.layout),
        "page_size": runs.page_size,
        "layers": int(getattr(pool, "layer_num", 0)),
        "runs": runs.runs,
        "run_nbytes": runs.run_nbytes,
        "format": getattr(pool, "storage_format_tag", None),
    }
    if layout.packed:  # a page as one padded block: never mistaken for a run
        fields["packed_block_nbytes"] = layout.block_nbytes
    # MLA KV is the same on every TP rank: one shared copy.
    return pool_namespace(config, fields, per_rank=not config.is_mla_model)


def _anchor_namespace(config: HiCacheStorageConfig, pool: Any) -> str:
    """The kvtier namespace of a logical KV pool's page anchors: named anchors of a logical pool,
    so they are never read as KV pages (nor KV pages as anchors)."""
    fields = {
        "pool": type(pool).__name__,
        "kind": "logical-pool-anchor",
        "page_size": int(pool.page_size),
        "anchor_nbytes": ANCHOR.numel(),
    }
    return pool_namespace(config, fields, per_rank=not config.is_mla_model)


def _check_slots(pages: int, host_indices: Any, page_size: int) -> None:
    """Raises `InvalidArgumentError` unless `host_indices` names `pages` pages' token slots."""
    if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
        raise InvalidArgumentError("host_indices must be a 1-D tensor of host-pool token slots")
    if host_indices.numel() != pages * page_size:
        raise InvalidArgumentError(
            f"{pages} keys need {pages * page_size} host_indices (page size {page_size}), "
            f"got {host_indices.numel()}"
        )


def _fill_anchor(i: int, page: torch.Tensor) -> None:
    page.view(-1).copy_(ANCHOR)


class KVTierHiCacheStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang has no type information
    """Any kvtier tier as SGLang's HiCache L3 storage (`--hicache-storage-backend dynamic`)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.tier_config, self.limits = engine_config("kvtier SGLang backend", "extra_config", extra)
        self.storage_config = storage_config
        #: SGLang's controller takes the v1 path with this set, the generic (flat page) path without.
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        self._lock = threading.Lock()  # guards the fields below; controller threads call at once
        self._opening = threading.Lock()  # one tier opened at a time, outside `_lock`
        self._known: KnownKeys[bytes] = KnownKeys(KNOWN_PAGES)
        self._closed = False
        self._bridge: LoopThread | None = None
        self._runs: PageRuns | None = None  # None for a logical KV pool (no bytes)
        self._kv_pool: Any = None  # the KV host pool SGLang registered first
        self._anchor: StagedPages | None = None  # a logical KV pool's page anchors
        self._layout: BlockLayout | None = None
        self._namespace = ""
        #: The tier `batch_exists`, `clear` and `tier_stats` ask: the one the controller's path uses.
        self._main: KVTier | None = None
        self._in_place: KVTier | None = None  # over the host pool (runs moved in place)
        self._staged: StagedPages | None = None  # over page slots (copied pages)
        self._flat_order: torch.Tensor | None = None
        self._pools: ExtraPools | None = None  # a hybrid model's other host pools (v2 interface)
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
            if self._bridge is not None:
                if self._kv_pool is mem_pool_host:
                    return  # registered again with the same pool
                raise ConfigError("kvtier SGLang backend: a second host pool; this backend serves one")
        if isinstance(mem_pool_host, LogicalHostPool):
            self._register_anchor(mem_pool_host)
            return
        runs = PageRuns(mem_pool_host)
        layout = BlockLayout.of(runs)
        order = None if self.interface_v1 else flat_order(runs)  # the generic path needs it: fail now
        bridge = LoopThread("kvtier-sglang")
        with self._lock:
            self._bridge, self._runs, self._layout, self._flat_order = bridge, runs, layout, order
            self._kv_pool = mem_pool_host
            self._namespace = _namespace(self.storage_config, mem_pool_host, runs, layout)
        try:
            main: KVTier = (
                self._in_place_tier()
                if self.interface_v1 and not layout.packed
                else self._staged_pages().tier
            )
        except BaseException:
            self._abandon(bridge)
            raise
        with self._lock:
            self._main = main
            self._pools = ExtraPools(self.storage_config, bridge, self._open_extra, self._extra_spec)
        log.info(
            "kvtier SGLang backend: %s tier, namespace %s, %s path, %d runs of %d bytes per page, %s",
            self.tier_config["type"],
            self._namespace,
            "v1" if self.interface_v1 else "generic (flat pages)",
            runs.runs,
            runs.run_nbytes,
            "each page one packed block" if layout.packed else "each run one block",
        )
        if layout.packed:
            log.warning(
                "kvtier SGLang backend: a page's runs are %d bytes, not a multiple of 4096: each page is "
                "copied through page slots and stored as one block; --page-size %d (or a multiple) moves "
                "runs in place, which is faster",
                runs.run_nbytes,
                runs.in_place_page_size(),
            )
        if not self.interface_v1:
            log.warning(
                'kvtier SGLang backend: no "interface_v1": 1 in the extra config, so SGLang hands over '
                "flat page copies; with it, pages move in place in the host pool, which is faster"
            )

    def _abandon(self, bridge: LoopThread) -> None:
        """A registration that failed: the backend closed, its loop thread stopped."""
        with self._lock:
            self._closed, self._bridge = True, None
        bridge.stop()

    def _register_anchor(self, pool: Any) -> None:
        """A logical KV pool (DeepSeek V4): its pages stored as anchors, in page slots of our own."""
        bridge, layout = LoopThread("kvtier-sglang"), BlockLayout(1, ALIGNMENT, packed=True)
        with self._lock:
            self._bridge, self._layout, self._kv_pool = bridge, layout, pool
            self._namespace = _anchor_namespace(self.storage_config, pool)
        try:
            slots = PageSlots(AnchorShape(), layout, ANCHOR_SLOT_BYTES)
            tier = bridge.call(self._open(self._spec(layout.block_nbytes, slots.slots), slots.view))
        except BaseException:
            self._abandon(bridge)
            raise
        with self._lock:
            self._anchor, self._main = StagedPages(tier, slots, bridge), tier
            self._pools = ExtraPools(self.storage_config, bridge, self._open_extra, self._extra_spec)
        log.info(
            "kvtier SGLang backend: %s tier, namespace %s; the KV pool is logical (%s: no bytes), "
            "each of its pages stored as a %d-byte anchor, the data in the pools registered through v2",
            self.tier_config["type"],
            self._namespace,
            type(pool).__name__,
            ANCHOR.numel(),
        )

    def _spec(self, block_nbytes: int, blocks: int) -> OffloadingSpec:
        return OffloadingSpec(
            block_nbytes=block_nbytes,
            num_cpu_blocks=blocks,
            block_size=int(getattr(self.mem_pool_host, "page_size", 1)),
            secondary_tiers=[self.tier_config],
            namespace=self._namespace,
            **self.limits,
        )

    def _extra_spec(self, block_nbytes: int, blocks: int, page_size: int, namespace: str) -> OffloadingSpec:
        return OffloadingSpec(
            block_nbytes=block_nbytes,
            num_cpu_blocks=blocks,
            block_size=page_size,
            secondary_tiers=[self.tier_config],
            namespace=namespace,
            **self.limits,
        )

    async def _open(self, spec: OffloadingSpec, view: memoryview, *, kv: bool = True) -> KVTier:
        tier = await start_tier(self.tier_config, view, spec)
        if kv:  # what the KV pages' tier lets go of is forgotten by `batch_exists`
            tier.removal_listeners.append(self._on_removed)
        return tier

    def _open_extra(self, spec: OffloadingSpec, view: memoryview) -> KVTier:
        bridge, _ = self._started()
        return bridge.call(self._open(spec, view, kv=False))

    def _in_place_tier(self) -> KVTier:
        """The tier over the host pool itself (in-place layout), opened on first use."""
        bridge, runs, layout = self._ready()
        with self._opening:
            if self._in_place is None:
                spec = self._spec(layout.block_nbytes, runs.nbytes // layout.block_nbytes)
                tier = bridge.call(self._open(spec, runs.view))
                with self._lock:
                    self._in_place = tier
            return self._in_place

    def _staged_pages(self) -> StagedPages:
        """The tier over page slots, opened on first use."""
        bridge, runs, layout = self._ready()
        with self._opening:
            if self._staged is None:
                slots = PageSlots(runs, layout, PAGE_SLOT_BYTES)
                spec = self._spec(layout.block_nbytes, slots.slots * layout.blocks_per_page)
                tier = bridge.call(self._open(spec, slots.view))
                with self._lock:
                    self._staged = StagedPages(tier, slots, bridge)
            return self._staged

    def _started(self) -> tuple[LoopThread, BlockLayout]:
        with self._lock:
            if self._closed:
                raise ClosedError("kvtier SGLang backend is closed")
            if self._bridge is None or self._layout is None:
                raise ConfigError("kvtier SGLang backend: called before SGLang registered its host pool")
            return self._bridge, self._layout

    def _ready(self) -> tuple[LoopThread, PageRuns, BlockLayout]:
        """The KV pool's runs (callers of a logical pool's anchors never come here)."""
        bridge, layout = self._started()
        with self._lock:
            runs = self._runs
        if runs is None:
            raise ConfigError("kvtier SGLang backend: the KV host pool is logical and has no pages to move")
        return bridge, runs, layout

    def _anchors(self) -> StagedPages | None:
        """A logical KV pool's page anchors, or None where the KV pool holds bytes."""
        self._started()
        with self._lock:
            return self._anchor

    def _store_anchors(self, anchor: StagedPages, keys: list[str]) -> list[bool]:
        pages = [_page_key(key) for key in keys]
        if not self.storage_config.is_storage_writer:
            return [True] * len(keys)  # an MLA replica: the writer rank stores the shared copy
        started = time.perf_counter()
        stored = anchor.store(pages, _fill_anchor, self._settle_known)
        self._record("backup_pgs", "set_gbps", sum(stored), 0, started)
        return stored

    def _load_anchors(self, anchor: StagedPages, keys: list[str]) -> list[bool]:
        """Per page, whether its anchor arrived whole and is an anchor (nothing is written: a
        logical pool has no memory)."""
        pages, wrong = [_page_key(key) for key in keys], set()
        started = time.perf_counter()

        def check(i: int, page: torch.Tensor) -> None:
            if not torch.equal(page.view(-1), ANCHOR):
                wrong.add(i)

        loaded = anchor.load(pages, check, self._settle_known)
        if wrong:  # never stored as an anchor here: not a hit
            log.error("kvtier SGLang backend: %d page anchors hold other bytes; not loaded", len(wrong))
            loaded = [ok and i not in wrong for i, ok in enumerate(loaded)]
            self._settle_known([pages[i] for i in sorted(wrong)], [False] * len(wrong))
        self._record("prefetch_pgs", "get_gbps", sum(loaded), 0, started)
        return loaded

    def _main_tier(self) -> tuple[LoopThread, KVTier, BlockLayout]:
        bridge, layout = self._started()
        with self._lock:
            if self._main is None:
                raise ConfigError("kvtier SGLang backend: called before SGLang registered its host pool")
            return bridge, self._main, layout

    # -- the v1 path: pages named by their host-pool slots --------------------------------------------
    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store each page from the host pool; True per page whose blocks all were stored."""
        if not keys:
            return []
        anchor = self._anchors()
        if anchor is not None:  # a logical pool: the pages' anchors
            _check_slots(len(keys), host_indices, int(self.mem_pool_host.page_size))
            return self._store_anchors(anchor, keys)
        bridge, runs, layout = self._ready()
        pages, rows = [_page_key(key) for key in keys], runs.rows(len(keys), host_indices)
        if not self.storage_config.is_storage_writer:
            return [True] * len(keys)  # an MLA replica: the writer rank stores the shared copy
        started = time.perf_counter()
        if layout.packed:
            table = torch.tensor(rows, dtype=torch.int64).view(len(keys), runs.runs)

            def gather(i: int, page: torch.Tensor) -> None:
                torch.index_select(runs.rows_tensor, 0, table[i], out=page)

            stored = self._staged_pages().store(pages, gather, self._settle_known)
        else:
            moved = self._in_place_tier().store(layout.keys(pages), rows)
            stored = bridge.call(self._settled(pages, moved, layout))
        self._record("backup_pgs", "set_gbps", sum(stored), runs.page_nbytes, started)
        return stored

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Load each page into the host pool; True per page whose blocks all arrived exact."""
        if not keys:
            return []
        anchor = self._anchors()
        if anchor is not None:  # a logical pool: the pages' anchors, nothing to write
            _check_slots(len(keys), host_indices, int(self.mem_pool_host.page_size))
            return self._load_anchors(anchor, keys)
        bridge, runs, layout = self._ready()
        pages, rows = [_page_key(key) for key in keys], runs.rows(len(keys), host_indices)
        started = time.perf_counter()
        if layout.packed:
            table = torch.tensor(rows, dtype=torch.int64).view(len(keys), runs.runs)

            rows_of = table.numpy()

            def scatter(i: int, page: torch.Tensor) -> None:
                runs.rows_array[rows_of[i]] = page.numpy()

            loaded = self._staged_pages().load(pages, scatter, self._settle_known)
        else:
            moved = self._in_place_tier().load(layout.keys(pages), rows)
            loaded = bridge.call(self._settled(pages, moved, layout))
        self._record("prefetch_pgs", "get_gbps", sum(loaded), runs.page_nbytes, started)
        return loaded

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many pages, from the first, the tier holds whole."""
        if not keys:
            return 0
        bridge, tier, layout = self._main_tier()
        pages = [_page_key(key) for key in keys]
        with self._lock:
            first_unknown = next(
                (i for i, page in enumerate(pages) if not self._known.touch(page)), len(pages)
            )
        if first_unknown == len(pages):
            return len(pages)  # answered from memory: no thread crossing
        rest = pages[first_unknown:]
        whole = bridge.call(
            self._settled(rest, tier.lookup_each(layout.keys(rest), stop_at_miss=True), layout)
        )
        return first_unknown + next((i for i, ok in enumerate(whole) if not ok), len(whole))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- the v2 interface: a hybrid model's other host pools -------------------------------------------
    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang hands over one more host pool (Mamba state, SWA, indexer, draft: at start-up, or
        later for draft pools): open its tier now, so a pool that cannot be served fails start-up
        (and is not registered)."""
        name = _pool_name(host_pool_name)
        with self._lock:
            kv_pool = self._kv_pool
        if name == PoolName.KV:
            if host_pool is not kv_pool:
                raise ConfigError(
                    "kvtier SGLang backend: the v2 KV pool is not the host pool SGLang registered first"
                )
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return  # its pages are the KV pages: the v1 / generic path's
        pools = self._extra_pools()
        with self._opening:
            namespace = pools.register(name, host_pool)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if namespace is not None:
            log.info(
                "kvtier SGLang backend: host pool %s (%s), namespace %s",
                name,
                type(host_pool).__name__,
                namespace,
            )

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable prefix, KV and extra pools together, as SGLang's `HiCacheFile` answers it:
        the KV pages' leading run, cut where an `ALL_PAGES` pool has a gap and to the prefix
        lengths whose trailing pages a `TRAILING_PAGES` pool holds (`restorable_prefix_pages`).
        A `BLOCK_GROUPS` pool reports the pages its leading whole groups cover and gates nothing."""
        kv_pages = self.batch_exists(keys, extra_info) if keys else 0
        pages = [_page_key(key) for key in keys[:kv_pages]]
        pools = self._extra_pools()

        def present(name: Any) -> list[bool]:
            if _pool_name(name) == PoolName.KV:  # the KV pages themselves: the leading run found
                return [True] * kv_pages
            return pools.present(_pool_name(name), pages)

        return hit_answer(kv_pages, pool_transfers or [], present)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Store each transfer's pages from its pool's host slots; per pool, True per page stored."""
        return self._batch_v2(transfers, extra_info, store=True)

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Load each transfer's pages into its pool's host slots; per pool, True per page loaded
        whole (an absent page fails that entry only)."""
        return self._batch_v2(transfers, extra_info, store=False)

    def _batch_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None, *, store: bool
    ) -> dict[str, list[bool]]:
        pools = self._extra_pools()
        kv_page_size = int(self.mem_pool_host.page_size)
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            name = _pool_name(transfer.name)
            keys = list(transfer.keys or [])
            if name == PoolName.KV:  # the KV pages themselves, named by KV host slots
                indices = transfer.host_indices
                if keys and not (
                    isinstance(indices, torch.Tensor) and indices.numel() == len(keys) * kv_page_size
                ):  # every entry fails, as HiCacheFile's and the extra pools' do (SGLang relies on it)
                    log.error("kvtier SGLang backend: kv: host indices do not cover %d pages", len(keys))
                    results[transfer.name] = [False] * len(keys)
                    continue
                move = self.batch_set_v1 if store else self.batch_get_v1
                results[transfer.name] = move(keys, indices, extra_info) if keys else []
                continue
            pages = [_page_key(key) for key in keys]
            move_pool = pools.store if store else pools.load
            results[transfer.name] = move_pool(name, pages, transfer.host_indices)
        return results

    def _extra_pools(self) -> ExtraPools:
        self._started()
        with self._lock:
            if self._pools is None:
                raise ConfigError("kvtier SGLang backend: called before SGLang registered its host pool")
            return self._pools

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
        anchor = self._anchors()
        if anchor is not None:  # a logical pool: its flat pages are empty, the pages' anchors stored
            for value in values:
                self._empty_page(value)
            return all(self._store_anchors(anchor, keys))
        _, runs, _ = self._ready()
        pages = [_page_key(key) for key in keys]
        flats = [self._flat_page(value, runs) for value in values]
        if not self.storage_config.is_storage_writer:
            return True
        order = self._generic_order()
        runs_from = None if order is None else torch.argsort(order)  # run r is flat piece runs_from[r]
        started = time.perf_counter()

        def fill(i: int, page: torch.Tensor) -> None:
            if runs_from is None:
                page.copy_(flats[i])
            else:
                torch.index_select(flats[i], 0, runs_from, out=page)

        stored = self._staged_pages().store(pages, fill, self._settle_known)
        self._record("backup_pgs", "set_gbps", sum(stored), runs.page_nbytes, started)
        return all(stored)

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Load flat pages into `target_locations` (SGLang's dummy pages); each, or None if missing."""
        if not keys:
            return []
        if target_locations is None or len(target_locations) != len(keys):
            raise InvalidArgumentError("batch_get needs one flat page tensor per key to load into")
        anchor = self._anchors()
        if anchor is not None:  # a logical pool: each found page is its (empty) flat page
            targets = list(target_locations)
            for target in targets:
                self._empty_page(target)
            loaded = self._load_anchors(anchor, keys)
            return [target if ok else None for target, ok in zip(targets, loaded)]
        _, runs, _ = self._ready()
        pages = [_page_key(key) for key in keys]
        targets = list(target_locations)
        flats = [self._flat_page(target, runs) for target in targets]
        for target, flat in zip(targets, flats):
            if flat.data_ptr() != target.data_ptr():
                raise InvalidArgumentError("batch_get targets must be contiguous tensors")
        order = self._generic_order()
        started = time.perf_counter()

        def drain(i: int, page: torch.Tensor) -> None:
            if order is None:
                flats[i].copy_(page)
            else:  # flat piece j is run order[j]
                torch.index_select(page, 0, order, out=flats[i])

        loaded = self._staged_pages().load(pages, drain, self._settle_known)
        self._record("prefetch_pgs", "get_gbps", sum(loaded), runs.page_nbytes, started)
        return [target if ok else None for target, ok in zip(targets, loaded)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        if target_location is None:
            target_location = self.mem_pool_host.get_dummy_flat_data_page()
        return self.batch_get([key], [target_location])[0]

    @staticmethod
    def _flat_page(tensor: Any, runs: PageRuns) -> torch.Tensor:
        """A flat page's bytes as (runs, run_nbytes); raises `InvalidArgumentError`."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            raise InvalidArgumentError(f"flat pages are CPU tensors, got {type(tensor).__name__}")
        flat = (tensor if tensor.is_contiguous() else tensor.contiguous()).reshape(-1).view(torch.uint8)
        if flat.numel() != runs.page_nbytes:
            raise InvalidArgumentError(f"a flat page is {runs.page_nbytes} bytes, got {flat.numel()}")
        return flat.view(runs.runs, runs.run_nbytes)

    @staticmethod
    def _empty_page(tensor: Any) -> None:
        """Raises `InvalidArgumentError` unless `tensor` is a logical pool's flat page: no bytes."""
        if not isinstance(tensor, torch.Tensor) or tensor.numel():
            raise InvalidArgumentError(
                "a logical KV pool's flat pages hold no bytes (torch.empty(0)), got "
                f"{tensor.numel() if isinstance(tensor, torch.Tensor) else type(tensor).__name__}"
            )

    def _generic_order(self) -> torch.Tensor | None:
        _, runs, _ = self._ready()
        with self._lock:
            if self._flat_order is not None or not self.interface_v1:
                return self._flat_order  # learned at registration on the generic path
        order = flat_order(runs)  # a v1 backend asked for a flat page: learned now, once
        with self._lock:
            self._flat_order = order
        return order

    # -- what this backend knows the tier holds ------------------------------------------------------
    async def _settled(
        self, pages: list[bytes], moved: Awaitable[list[bool]], layout: BlockLayout
    ) -> list[bool]:
        """Per page, whether `moved` (the tier's store, load or lookup of its blocks) found it whole,
        remembered or forgotten on the loop before any removal the tier reports afterwards (a
        page remembered on the calling thread could be one evicted in between)."""
        whole = layout.per_page(await moved)
        self._settle_known(pages, whole)
        return whole

    def _settle_known(self, pages: Sequence[bytes], loaded: Sequence[bool]) -> None:
        """Remember the pages stored, loaded or found whole; forget the others (their order)."""
        with self._lock:
            self._known.add(page for page, ok in zip(pages, loaded) if ok)
            self._known.forget(page for page, ok in zip(pages, loaded) if not ok)

    def _on_removed(self, keys: list[bytes]) -> None:
        """The tier let go of blocks (evicted, deleted, found corrupt): forget their pages (loop thread)."""
        with self._lock:
            self._known.forget(BlockLayout.page_of(key) for key in keys)

    # -- SGLang's housekeeping -------------------------------------------------------------------------
    def clear(self) -> None:
        """Delete the pages this backend remembers (stored, loaded or found present), KV and extra
        pools. Pages of a shared tier it never met stay: one server's flush does not empty the
        fleet's cache."""
        bridge, tier, layout = self._main_tier()
        with self._lock:
            pages = self._known.take_all()
        if pages:
            bridge.call(tier.delete(layout.keys(pages)))
        self._extra_pools().clear()

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

    def _record(self, pages_name: str, rate_name: str, pages: int, page_nbytes: int, started: float) -> None:
        seconds = time.perf_counter() - started
        with self._lock:
            self._metrics[pages_name].append(pages)
            if pages and page_nbytes and seconds > 0:
                self._metrics[rate_name].append(pages * page_nbytes / seconds / 1e9)

    def tier_stats(self) -> dict[str, Any]:
        """The kvtier tier's own stats (counters, backend figures): the tier the controller's path uses."""
        bridge, tier, _ = self._main_tier()
        return bridge.call(_stats(tier))

    def close(self) -> None:
        """Close the tier(s) and stop the loop thread; idempotent. SGLang calls it on detach."""
        with self._opening, self._lock:  # a tier being opened now is closed too
            if self._bridge is None:  # closed already, or never started
                self._closed = True
                return
            self._closed = True
            bridge, self._bridge = self._bridge, None
            tiers = [
                t
                for t in (
                    self._staged.tier if self._staged else None,
                    self._in_place,
                    self._anchor.tier if self._anchor else None,
                )
                if t is not None
            ]
            tiers += self._pools.tiers() if self._pools is not None else []
        if bridge is not None:
            bridge.finish(_close_tiers(tiers))


async def _close_tiers(tiers: list[KVTier]) -> None:
    for tier in tiers:
        await tier.aclose()


async def _stats(tier: KVTier) -> dict[str, Any]:
    return tier.stats()
