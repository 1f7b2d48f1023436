"""SGLang's extra host pools (hybrid models) as kvtier blocks: `ExtraPools`, `pool_namespace`.

A hybrid model's HiCache keeps, next to its KV pages, pages of other host pools that SGLang
registers through `register_mem_host_pool_v2`: Mamba / linear-attention state (one state slot
a page), sliding-window KV (SWA), DSA / QSA indexer keys, draft-model pools. Each has its own
geometry: its own page size in tokens, bytes per page, dtype and layout.

One storage design for every pool, the one packed KV pages use (`sglang_pages`): a pool's page
is one block of its own size (its bytes in the pool's flat-page order, zero-padded to 4096), or,
past `EXTRA_BLOCK_BYTES` (a Mamba state: tens of MiB), equal blocks of at most that size, each
written as soon as it is copied; copied through page slots of that pool, in a namespace of its
own (`pool_namespace`: model, pool name, pool class, dtypes, layout, page geometry, how a page
is cut into blocks, and the ranks whose pages differ). So a model's KV and its state are never
confused, nor two models' pools, nor two ranks' state.

A page's bytes are whatever the pool's own `get_data_page(index, flat=True)` gives and its
`set_from_flat_data_page` takes back: the pages SGLang's `HiCacheFile` stores, for every layout
the pool serves. A pool whose layout has no flat pages fails at registration with a
`ConfigError` naming the pool and its layout. Mamba and DSA indexer pools in the page-first
layouts are copied run by run between their buffers and the page slots (`PoolRuns`: the same
bytes, without the flat page SGLang would build first). Pages are not moved in place (the pool
as the tier's primary memory): SGLang 0.5.23's controller never calls the v1 (zero-copy) calls
for these pools, only `batch_set_v2` / `batch_get_v2`; a Mamba pool is several buffers of
different strides (a tier each), its zero-copy description refuses the side states a pool may
carry, a DSA indexer page is rarely a multiple of 4096 bytes, and where a pool's pages lie
scattered in physical memory the fs tier copies them through its staging buffers anyway.

Ranks. SGLang keeps Mamba state per tensor-parallel rank even where the model's MLA KV is one
copy shared by all ranks (HiCacheFile's file names say the same): the Mamba pool's namespace
always carries the TP rank. So does an MHA pool beside MLA KV (an MHA draft model: each rank
holds its share of the heads, so its pages differ per rank; SGLang's controller writes them on
TP rank 0 only, so the other ranks find none rather than rank 0's heads). Every other pool
follows the KV pages (per rank, except MLA).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from ..errors import ConfigError, InvalidArgumentError
from ..spec import OffloadingSpec
from ..tier import SecondaryTierManager as KVTier
from .bridge import LoopThread
from .known_keys import KnownKeys
from .model_identity import weights_identity
from .sglang_pages import BlockLayout, PageSlots, StagedPages

__all__ = ["EXTRA_BLOCK_BYTES", "EXTRA_POOL_SLOT_BYTES", "KNOWN_POOL_PAGES", "ExtraPools", "pool_namespace"]

log = logging.getLogger(__name__)

#: Bytes of page slots per extra pool, at most (at least two pages: a Mamba state can be tens of MiB).
EXTRA_POOL_SLOT_BYTES = 64 << 20
#: A larger page is stored as several blocks of at most this size, each written as soon as it is
#: copied into its slot: the copy of the next overlaps the write of this one, and a page's blocks
#: are written side by side on the tier's I/O threads instead of one write of the whole page. On
#: this project's 2-core VM, a 16.6 MiB Mamba state copied and written in 4 MiB pieces reached
#: 0.99 GB/s against 0.79 GB/s copied whole, then written (8 rounds of 6 states, O_DIRECT).
EXTRA_BLOCK_BYTES = 4 << 20
#: Pages per extra pool this backend remembers the tier holds (see `KnownKeys`).
KNOWN_POOL_PAGES = 1 << 16
#: Host pools whose described runs (`get_page_buffer_meta`), in order, are exactly their flat page,
#: in these layouts (read from SGLang 0.5.23: a Mamba state's temporal then conv rows, a DSA
#: indexer's page row; tests check it byte for byte). Their pages are copied run by run between
#: the pool and the page slots, skipping the flat page SGLang would build first (a Mamba state's
#: `torch.cat` of tens of MiB). Every other pool moves as its flat pages: the same bytes.
RUN_COPY_POOLS = {
    "MambaPoolHost": ("page_first", "page_first_direct"),
    "DSAIndexerPoolHost": ("page_first", "page_first_direct"),
}
#: Pools whose pages differ per tensor-parallel rank even for an MLA model, and that SGLang
#: backs up from every rank (`HybridCacheController.should_backup`): every other pool beside MLA
#: KV is backed up by the writer rank alone, so it is stored once, for every rank to find.
PER_RANK_POOLS = frozenset({PoolName.MAMBA})
#: Attributes of a host pool that decide its pages' bytes, where the pool has them.
GEOMETRY_ATTRIBUTES = (
    "dtype",
    "temporal_dtype",
    "conv_dtype",
    "indexer_dtype",
    "page_size",
    "layer_num",
    "num_mamba_layers",
    "head_num",
    "head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "temporal_state_shape",
    "conv_state_shapes",
    "size_per_token",
)


def pool_namespace(config: HiCacheStorageConfig, fields: dict[str, Any], *, per_rank: bool) -> str:
    """A kvtier namespace: the model's name, then a digest of `fields` (everything that decides a
    page's bytes and how they are stored), the parallel ranks that see other bytes, and the
    weights behind the model's name."""
    fields = {
        **fields,
        "pp": [config.pp_rank, config.pp_size],
        "cp": [config.attn_cp_rank, config.attn_cp_size],
        "dcp": [config.dcp_rank, config.dcp_size],
    }
    if per_rank:
        fields["tp"] = [config.tp_rank, config.tp_size, config.dp_rank]
    weights = weights_identity(config.model_name or "")
    if weights is not None:  # other weights under the same name: another namespace
        fields["weights"] = weights
    digest = hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=12).hexdigest()
    model = (config.model_name or "unnamed-model")[:160]
    return f"sglang:{model}:{digest}"


class FlatPages:
    """One pool's pages as SGLang's flat pages: `page_nbytes` bytes, viewed as `dtype` when
    handed back to the pool (one run: the page slots' `PageShape`)."""

    def __init__(self, page_nbytes: int, dtype: torch.dtype, page_size: int) -> None:
        self.page_nbytes, self.dtype, self.page_size = page_nbytes, dtype, page_size
        self.runs, self.run_nbytes = 1, page_nbytes

    @classmethod
    def of(cls, name: str, pool: Any) -> FlatPages:
        """Read from the pool itself: its dummy page and its first page must agree in size."""
        layout = getattr(pool, "layout", "?")
        try:
            dummy = pool.get_dummy_flat_data_page()
            first = pool.get_data_page(0, flat=True)
        except (NotImplementedError, ValueError, AssertionError, AttributeError, TypeError) as exc:
            raise ConfigError(
                f"kvtier SGLang backend: host pool '{name}' ({type(pool).__name__}, layout {layout!r}) "
                f"has no flat pages ({exc}); use a layout the pool serves flat pages in "
                "(layer_first, page_first or page_first_direct)"
            ) from exc
        sizes = {t.numel() * t.element_size() if isinstance(t, torch.Tensor) else -1 for t in (dummy, first)}
        if len(sizes) != 1 or -1 in sizes or 0 in sizes or dummy.device.type != "cpu":
            raise ConfigError(
                f"kvtier SGLang backend: host pool '{name}' ({type(pool).__name__}, layout {layout!r}) "
                f"describes its pages inconsistently (flat page sizes {sorted(sizes)}); not supported"
            )
        return cls(
            page_nbytes=sizes.pop(), dtype=dummy.dtype, page_size=int(getattr(pool, "page_size", 1) or 1)
        )

    def geometry(self, name: str, pool: Any) -> dict[str, Any]:
        """The namespace fields of this pool: what decides its pages' bytes."""
        fields: dict[str, Any] = {
            "pool_name": str(name),
            "pool": type(pool).__name__,
            "layout": str(getattr(pool, "layout", None)),
            "page_nbytes": self.page_nbytes,
            "flat_dtype": str(self.dtype),
            "format": getattr(pool, "storage_format_tag", None),
        }
        for attribute in GEOMETRY_ATTRIBUTES:
            value = getattr(pool, attribute, None)
            if value is not None:
                fields[attribute] = repr(value) if not isinstance(value, (int, str)) else value
        return fields


class PoolRuns:
    """Where a `RUN_COPY_POOLS` pool's pages lie: runs of its own CPU buffers, as byte arrays."""

    def __init__(self, pool: Any, page_size: int) -> None:
        self.pool, self.page_size = pool, page_size
        buffers = []
        for buffer in pool.get_hybrid_pool_buffer():
            if (
                not isinstance(buffer, torch.Tensor)
                or buffer.device.type != "cpu"
                or not buffer.is_contiguous()
            ):
                raise ValueError("a host buffer that is not a contiguous CPU tensor")
            if buffer.numel():
                buffers.append((buffer.data_ptr(), buffer.view(torch.uint8).reshape(-1).numpy()))
        buffers.sort(key=lambda item: item[0])
        self.bases = [base for base, _ in buffers]
        self.arrays = [array for _, array in buffers]

    @classmethod
    def of(cls, pool: Any, pages: FlatPages) -> PoolRuns | None:
        """The pool's runs, if it is one of `RUN_COPY_POOLS` and describes its first page as
        runs of its buffers adding up to its flat page; None otherwise."""
        if getattr(pool, "layout", None) not in RUN_COPY_POOLS.get(type(pool).__name__, ()):
            return None
        try:
            runs = cls(pool, pages.page_size)
            (first,) = runs.runs_of([0])
        except (NotImplementedError, ValueError, AssertionError, AttributeError, TypeError):
            return None  # e.g. a Mamba pool with side states: its flat pages carry them
        return runs if sum(n for _, _, n in first) == pages.page_nbytes else None

    def runs_of(self, starts: Sequence[int]) -> list[list[tuple[np.ndarray, int, int]]]:
        """Per page (its first host slot), its runs: (buffer bytes, offset, length), in order."""
        indices = torch.cat([torch.arange(s, s + self.page_size, dtype=torch.int64) for s in starts])
        ptrs, sizes = self.pool.get_page_buffer_meta(indices)
        if not starts or len(ptrs) % len(starts) or len(ptrs) != len(sizes):
            raise InvalidArgumentError("the host pool describes its pages as uneven runs")
        per_page, runs = len(ptrs) // len(starts), []
        for ptr, size in zip(ptrs, sizes):
            at = bisect.bisect_right(self.bases, int(ptr)) - 1
            offset = int(ptr) - self.bases[at] if at >= 0 else -1
            if at < 0 or not 0 <= offset <= self.arrays[at].size - int(size):
                raise InvalidArgumentError("host indices name a slot outside the host pool")
            runs.append((self.arrays[at], offset, int(size)))
        return [runs[i * per_page : (i + 1) * per_page] for i in range(len(starts))]


class _Pool:
    """One registered extra pool: its host pool, its flat pages, and its tier over page slots."""

    def __init__(self, name: str, pool: Any, pages: FlatPages, staged: StagedPages, shared: bool) -> None:
        self.name, self.pool, self.pages, self.staged = name, pool, pages, staged
        #: Where its pages lie as runs (copied run by run), or None (moved as flat pages).
        self.runs = PoolRuns.of(pool, pages)
        #: One copy for all TP ranks (MLA's non-Mamba pools): only SGLang's writer rank stores it.
        self.shared = shared
        self.layout = staged.slots.layout
        #: Pages stored, loaded or found present; guarded by `ExtraPools._lock`.
        self.known: KnownKeys[bytes] = KnownKeys(KNOWN_POOL_PAGES)

    def slots_of(self, keys: int, host_indices: Any) -> list[int] | None:
        """Each page's first host slot, as SGLang's `HiCacheFile` takes them; None where the
        indices do not cover `keys` pages (SGLang then expects every entry to fail)."""
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
            return None
        if host_indices.numel() != keys * self.pages.page_size:
            return None
        return [int(i) for i in host_indices[:: self.pages.page_size].tolist()]


class ExtraPools:
    """The extra host pools of one SGLang backend, each its own tier (namespace) over page slots.

    `open_tier(spec, view)` opens a tier (on the backend's loop); `writer` says whether this
    rank stores pools shared by all TP ranks."""

    def __init__(
        self,
        config: HiCacheStorageConfig,
        bridge: LoopThread,
        open_tier: Callable[[OffloadingSpec, memoryview], KVTier],
        spec_of: Callable[[int, int, int, str], OffloadingSpec],
    ) -> None:
        self.config, self.bridge = config, bridge
        self._open_tier, self._spec_of = open_tier, spec_of
        self._pools: dict[str, _Pool] = {}
        self._lock = threading.Lock()

    def register(self, name: str, pool: Any) -> str | None:
        """Open the tier of pool `name` (again with the same pool: nothing); its namespace, or None
        if it was registered already. Raises `ConfigError` for a pool that cannot be served."""
        with self._lock:
            known = self._pools.get(name)
        if known is not None:
            if known.pool is pool:
                return None
            raise ConfigError(f"kvtier SGLang backend: host pool '{name}' registered twice, with two pools")
        pages = FlatPages.of(name, pool)
        per_rank = name in PER_RANK_POOLS or not self.config.is_mla_model
        if not per_rank and isinstance(pool, MHATokenToKVPoolHost) and self.config.tp_size > 1:
            # An MHA draft model beside MLA KV: its heads are split across ranks, but SGLang backs
            # its pages up from the writer rank only (rank-specific copies on Mooncake alone), and
            # asks every rank for them: a copy per rank would never be written, and no rank would
            # hit at all. As with HiCacheFile, the other ranks load the writer's draft heads.
            log.warning(
                "kvtier SGLang backend: host pool '%s' holds %d of a draft model's heads per rank "
                "beside MLA KV, but SGLang backs it up from one rank only: ranks other than that one "
                "load its heads (the draft's acceptance may drop; the target's output is unchanged)",
                name,
                getattr(pool, "head_num", 0),
            )
        layout = BlockLayout.packed_page(pages.page_nbytes, EXTRA_BLOCK_BYTES)
        fields = pages.geometry(name, pool)
        if layout.blocks_per_page > 1:  # never read as a page stored whole, nor the reverse
            fields["blocks"] = [layout.blocks_per_page, layout.block_nbytes]
        namespace = pool_namespace(self.config, fields, per_rank=per_rank)
        slots = PageSlots(pages, layout, EXTRA_POOL_SLOT_BYTES)
        spec = self._spec_of(
            layout.block_nbytes, slots.slots * layout.blocks_per_page, pages.page_size, namespace
        )
        tier = self._open_tier(spec, slots.view)
        entry = _Pool(name, pool, pages, StagedPages(tier, slots, self.bridge), shared=not per_rank)
        tier.removal_listeners.append(lambda keys: self._forget(entry, keys))
        with self._lock:
            if name in self._pools:  # registered meanwhile by another thread
                racer = self._pools[name]
            else:
                self._pools[name], racer = entry, entry
        if racer is not entry:
            self.bridge.call(tier.aclose())
            if racer.pool is not pool:
                raise ConfigError(
                    f"kvtier SGLang backend: host pool '{name}' registered twice, with two pools"
                )
            return None
        return namespace

    def tiers(self) -> list[KVTier]:
        with self._lock:
            return [entry.staged.tier for entry in self._pools.values()]

    def _entry(self, name: str) -> _Pool | None:
        with self._lock:
            return self._pools.get(name)

    def present(self, name: str, pages: Sequence[bytes]) -> list[bool]:
        """Per page, whether pool `name` holds it whole (a pool never registered holds nothing).
        Pages this backend knows of are answered from memory; the tier is asked about the rest."""
        entry = self._entry(name)
        if entry is None or not pages:
            return [False] * len(pages)
        with self._lock:
            answer = [entry.known.touch(page) for page in pages]
        unknown = [page for page, known in zip(pages, answer) if not known]
        if unknown:
            found = entry.layout.per_page(
                self.bridge.call(
                    entry.staged.tier.lookup_each(entry.layout.keys(unknown), stop_at_miss=False)
                )
            )
            self._settle(entry, unknown, found)
            found_of = dict(zip(unknown, found))
            answer = [known or found_of[page] for page, known in zip(pages, answer)]
        return answer

    def store(self, name: str, pages: list[bytes], host_indices: Any) -> list[bool]:
        """Store pool `name`'s pages from their host slots; True per page stored."""
        entry = self._require(name)
        if not pages:
            return []
        starts = entry.slots_of(len(pages), host_indices)
        if starts is None:
            log.error("kvtier SGLang backend: %s: host indices do not cover %d pages", name, len(pages))
            return [False] * len(pages)
        if entry.shared and not self.config.is_storage_writer:
            return [True] * len(pages)  # an MLA replica: the writer rank stores the shared copy
        pool, runs = entry.pool, entry.runs.runs_of(starts) if entry.runs is not None else None
        block_nbytes = entry.layout.block_nbytes
        flat: list[Any] = [None, None]  # [page i, its flat bytes]: the pool's flat page, made once

        def fill_block(i: int, j: int, piece: torch.Tensor) -> None:
            lo = j * block_nbytes
            if runs is not None:
                _gather(runs[i], piece.numpy(), lo)
                return
            if flat[0] != i:
                page = pool.get_data_page(starts[i], flat=True)
                flat[:] = [i, page.contiguous().view(torch.uint8).reshape(-1)]
            piece.copy_(flat[1][lo : lo + piece.numel()])

        def settle(part: list[bytes], ok: list[bool]) -> None:
            self._settle(entry, part, ok)

        if entry.layout.blocks_per_page == 1:  # small pages: the call's pages stored together
            return entry.staged.store(pages, lambda i, page: fill_block(i, 0, page.view(-1)), settle)
        return entry.staged.store_blocks(pages, fill_block, settle)

    def load(self, name: str, pages: list[bytes], host_indices: Any) -> list[bool]:
        """Load pool `name`'s pages into their host slots; True per page that arrived whole."""
        entry = self._require(name)
        if not pages:
            return []
        starts = entry.slots_of(len(pages), host_indices)
        if starts is None:
            log.error("kvtier SGLang backend: %s: host indices do not cover %d pages", name, len(pages))
            return [False] * len(pages)
        pool, dtype = entry.pool, entry.pages.dtype
        runs = entry.runs.runs_of(starts) if entry.runs is not None else None

        def drain(i: int, page: torch.Tensor) -> None:
            if runs is not None:
                _scatter(page.view(-1).numpy(), runs[i])
                return
            pool.set_from_flat_data_page(starts[i], page.view(-1).view(dtype))

        return entry.staged.load(pages, drain, lambda part, ok: self._settle(entry, part, ok))

    def clear(self) -> None:
        """Delete the pages of every pool this backend remembers (as `clear` does for KV)."""
        with self._lock:
            taken = [(entry, entry.known.take_all()) for entry in self._pools.values()]
        for entry, pages in taken:
            if pages:
                self.bridge.call(entry.staged.tier.delete(entry.layout.keys(pages)))

    def _settle(self, entry: _Pool, pages: Sequence[bytes], found: Sequence[bool]) -> None:
        """Remember the pages found (stored, loaded) whole; forget the others. On the tier's loop
        for stores and loads (`StagedPages`), so never after a removal the tier reported since."""
        with self._lock:
            entry.known.add(page for page, ok in zip(pages, found) if ok)
            entry.known.forget(page for page, ok in zip(pages, found) if not ok)

    def _forget(self, entry: _Pool, keys: list[bytes]) -> None:
        """The pool's tier let go of blocks (evicted, deleted, found corrupt): loop thread."""
        with self._lock:
            entry.known.forget(BlockLayout.page_of(key) for key in keys)

    def _require(self, name: str) -> _Pool:
        entry = self._entry(name)
        if entry is None:
            raise InvalidArgumentError(
                f"kvtier SGLang backend: no host pool '{name}' registered (register_mem_host_pool_v2)"
            )
        return entry


def _gather(runs: list[tuple[np.ndarray, int, int]], piece: np.ndarray, start: int = 0) -> None:
    """Bytes [start, start + len(piece)) of the page the runs make, in order, into `piece`."""
    end, at = start + piece.size, 0  # `at`: where the run begins in the page
    for array, offset, size in runs:
        lo, hi = max(start, at), min(end, at + size)
        if lo < hi:
            piece[lo - start : hi - start] = array[offset + lo - at : offset + hi - at]
        at += size
        if at >= end:
            break


def _scatter(page: np.ndarray, runs: list[tuple[np.ndarray, int, int]]) -> None:
    at = 0
    for array, offset, size in runs:
        array[offset : offset + size] = page[at : at + size]
        at += size
