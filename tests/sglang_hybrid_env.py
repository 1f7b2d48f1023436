"""SGLang 0.5.23's hybrid-model host pools and its `HybridCacheController`'s storage methods, on a CPU.

The pools are SGLang's own classes (Mamba state, DSA indexer, MHA / MLA KV for SWA and draft
pools), built over device pools on the CPU inside SGLang's `host_memory_budget_scope` (its
free-RAM reserve would refuse them on a small machine). `Controller` is SGLang's real
`HybridCacheController` with only the fields its storage methods read, so a backup, a hit
query and a prefetch run SGLang's own code (`_page_backup_with_stable_layout`,
`_storage_hit_query`, `_page_transfer_with_stable_layout`) against a backend: it decides which
pools go through v2, which through the KV path, and what keys and slots each call carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from queue import Queue
from types import SimpleNamespace
from typing import Any

import sglang_env  # noqa: F401  (SGLang's import stubs first)
import torch
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
    HybridCacheController,
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
from sglang.srt.mem_cache.memory_pool_host import (
    DeepSeekV4PagedHostPool,
    DeepSeekV4StateHostPool,
    LogicalHostPool,
)
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.qsa import QSAIndexerPoolHost
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel
from sglang_env import mha_pool, mla_pool

BUDGET = 1 << 30

__all__ = [
    "Controller",
    "Span",
    "chain",
    "dsa_pools",
    "dsv4_logical_pool",
    "dsv4_pool",
    "dsv4_state_pool",
    "flat_bytes",
    "mamba_pool",
    "mha_pool",
    "mla_pool",
    "qsa_pools",
    "randomize",
]


def randomize(tensors: Any) -> None:
    for tensor in tensors if isinstance(tensors, (list, tuple)) else [tensors]:
        raw = tensor.view(torch.uint8).reshape(-1)
        raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8))


def mamba_pool(
    layout: str = "page_first",
    *,
    layers: int = 3,
    slots: int = 16,
    temporal: tuple[int, ...] = (4, 16, 16),
    conv: tuple[int, ...] = (8, 3),
) -> MambaPoolHost:
    """SGLang's Mamba state host pool: an fp32 temporal (SSM) state of shape `temporal` and a bf16
    conv state of shape `conv` per layer (Qwen3-Next at TP 1: (32, 128, 128) and (12288, 3))."""
    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, *temporal, dtype=torch.float32),
        conv=(torch.zeros(layers, slots, *conv, dtype=torch.bfloat16),),
    )
    with host_memory_budget_scope(BUDGET):
        pool = MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, layout=layout)
    randomize(pool.kv_buffer)
    return pool


def dsa_pools(layout: str = "page_first", *, layers: int = 2, tokens: int = 1024) -> tuple[Any, Any]:
    """DeepSeek V3.2: SGLang's MLA host pool over its DSA device pool, and the DSA indexer host pool
    riding on the MLA pages (`make_dsa_indexer_pool_decl`, as the device pool declares it)."""
    with host_memory_budget_scope(BUDGET), get_parallel().override(attn_dcp_size=1):
        device = DSATokenToKVPool(tokens, 64, 512, torch.bfloat16, 64, layers, "cpu", 128, False, 576)
        kv = MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            1.0,
            0,
            64,
            layout,
            pin_memory=False,
            device_capacity_tokens=device.size,
            start_layer=device.start_layer,
            end_layer=device.end_layer,
            target_layer_num=layers,
        )
        indexer = DSAIndexerPoolHost(make_dsa_indexer_pool_decl(device), kv, pin_memory=False)
    randomize(kv.kv_buffer)
    randomize(indexer.index_k_with_scale_buffer)
    return kv, indexer


def dsv4_pool(
    layout: str = "page_first",
    *,
    layers: int = 3,
    pages: int = 32,
    page_size: int = 16,
    item_bytes: int = 584,
    name: PoolName = PoolName.DEEPSEEK_V4_C4,
) -> DeepSeekV4PagedHostPool:
    """SGLang's DeepSeek V4 paged host pool `name` (a compressed KV or indexer region):
    `item_bytes` per page and layer, `pages` host pages of `page_size` slots. Its device buffers
    give only the layer count."""
    device = [torch.zeros(pages, item_bytes, dtype=torch.uint8) for _ in range(layers)]
    with host_memory_budget_scope(BUDGET):
        pool = DeepSeekV4PagedHostPool(
            str(name),
            device,
            item_bytes,
            pages,
            page_size,
            layout=layout,
            pin_memory=False,
        )
    randomize(pool.kv_buffer)
    return pool


def dsv4_logical_pool(layout: str = "page_first", *, pages: int = 16, page_size: int = 64) -> LogicalHostPool:
    """DeepSeek V4's KV anchor as SGLang 0.5.23 builds it (`hybrid_pool_assembler`): a
    `LogicalHostPool` of `pages` pages, with page slots and no bytes; the compressed pools
    (`dsv4_pool`) have as many pages of the same `page_size`, addressed by its slots."""
    return LogicalHostPool(pages * page_size, page_size, layout=layout)


def dsv4_state_pool(
    layout: str = "page_first", *, pages: int = 16, page_size: int = 64, ring: int = 4, layers: int = 2
) -> DeepSeekV4StateHostPool:
    """SGLang's DeepSeek V4 compressor-state host pool (`deepseek_v4_c4_state`): per page, each
    layer's `ring` state slots (32 fp32 values each). Its device compressor pools are stand-ins of
    their state tensors (only their shapes are read); the host pool is SGLang's own."""
    device = [
        SimpleNamespace(
            kv_score_buffer=SimpleNamespace(kv_score=torch.zeros(pages * ring, 32, dtype=torch.float32)),
            ring_size=ring,
        )
        for _ in range(layers)
    ]
    with host_memory_budget_scope(BUDGET):
        pool = DeepSeekV4StateHostPool(
            str(PoolName.DEEPSEEK_V4_C4_STATE), device, pages, page_size, layout=layout, pin_memory=False
        )
    randomize(pool.kv_buffer)
    return pool


def qsa_pools(layout: str = "page_first", *, layers: int = 3, tokens: int = 2048) -> tuple[Any, Any]:
    """MHA KV with 64-token pages and SGLang's QSA indexer host pool over it (compressed keys of
    every 4 tokens, 128 bf16 dims a layer). Only the indexer's buffer shapes come from its device
    pool, so that is a stand-in of those buffers; the host pool is SGLang's own."""
    kv = mha_pool(layout, page_size=64, tokens=tokens)
    device = SimpleNamespace(
        qsa_compress_ratio=4,
        qsa_compressed_k_buffer_pool=[
            torch.zeros(tokens // 4 + 64, 128, dtype=torch.bfloat16) for _ in range(layers)
        ],
    )
    with host_memory_budget_scope(BUDGET):
        indexer = QSAIndexerPoolHost(device, kv)
    randomize(indexer.kv_buffer)
    return kv, indexer


def flat_bytes(pool: Any, slot: int) -> bytes:
    """One page of `pool` at host slot `slot`, as the pool's own flat page."""
    return bytes(pool.get_data_page(slot, flat=True).contiguous().view(torch.uint8).numpy().tobytes())


def chain(pages: int, page_size: int, seed: int = 0) -> tuple[list[int], list[str]]:
    """Token ids of `pages` pages and SGLang's storage keys for them (a hash chain)."""
    tokens = [seed * 1_000_003 + i for i in range(pages * page_size)]
    keys = get_storage_hash_str(tokens, None, page_size=page_size)
    assert isinstance(keys, list)
    return tokens, keys


def kv_slots(page_size: int, pages: range | list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages]).to(torch.int64)


@dataclass
class Span:
    """One backup: KV pages `pages` (of the chain), and the extra pools' pages with it."""

    pages: range
    #: KV-derived pools (indexer, draft): stored for every page of the span.
    derived: list[PoolName] = field(default_factory=list)
    #: Trailing pools: name -> (host slots of the state / window, number of trailing pages).
    trailing: dict[PoolName, tuple[torch.Tensor, int]] = field(default_factory=dict)


class Controller:
    """SGLang's `HybridCacheController`, holding only what its storage methods read."""

    def __init__(self, backend: Any, kv: Any, pools: dict[PoolName, Any], storage_config: Any) -> None:
        ctl = object.__new__(HybridCacheController)
        ctl.storage_backend = backend
        ctl.storage_config = storage_config
        ctl.page_size = kv.page_size
        ctl.storage_host_pool = kv
        ctl.storage_backend_type = "dynamic"
        ctl.mem_pool_host = SimpleNamespace(
            entry_map={name: SimpleNamespace(host_pool=pool) for name, pool in pools.items()}
        )
        ctl.prefetch_sync_queue = Queue()
        # SGLang's choice: slots (v1) for a dynamic backend with "interface_v1", flat pages otherwise.
        v1 = bool((storage_config.extra_config or {}).get("interface_v1", 0))
        ctl.page_get_func = ctl._page_get_zero_copy if v1 else ctl._generic_page_get
        ctl.page_set_func = ctl._page_set_zero_copy if v1 else ctl._generic_page_set
        self.ctl, self.kv, self.pools = ctl, kv, pools
        self.page_size = kv.page_size

    def backup(self, keys: list[str], span: Span, kv_host_pages: list[int] | None = None) -> int:
        """Back up a span of the chain `keys` (its KV from host pages `kv_host_pages`, default the
        span's own page numbers); the tokens SGLang counts as stored."""
        host_pages = kv_host_pages if kv_host_pages is not None else list(span.pages)
        transfers = [
            PoolTransfer(name=name, indices_from_pool=PoolName.KV, hit_policy=PoolHitPolicy.ALL_PAGES)
            for name in span.derived
        ]
        for name, (slots, window) in span.trailing.items():
            last = span.pages.stop
            transfers.append(
                PoolTransfer(
                    name=name,
                    host_indices=slots,
                    keys=keys[last - window : last],
                    hit_policy=PoolHitPolicy.TRAILING_PAGES,
                )
            )
        op = StorageOperation(
            kv_slots(self.page_size, host_pages),
            [],
            hash_value=keys[span.pages.start : span.pages.stop],
            prefix_keys=keys[: span.pages.start],
            pool_transfers=transfers or None,
        )
        self.ctl._page_backup_with_stable_layout(op)
        return int(op.completed_tokens)

    def hit_transfers(self, trailing: dict[PoolName, int], derived: list[PoolName]) -> list[PoolTransfer]:
        transfers = [
            PoolTransfer(name=name, keys=["placeholder"] * window, hit_policy=PoolHitPolicy.TRAILING_PAGES)
            for name, window in trailing.items()
        ]
        transfers += [
            PoolTransfer(name=name, indices_from_pool=PoolName.KV, hit_policy=PoolHitPolicy.ALL_PAGES)
            for name in derived
        ]
        return transfers

    def query(
        self,
        tokens: list[int],
        transfers: list[PoolTransfer],
        *,
        last_hash: str | None = None,
        prefix_keys: list[str] | None = None,
    ) -> tuple[int, list[int] | None, dict[Any, int]]:
        """SGLang's hit query: (hit tokens, restorable prefix pages, each pool's own verdict)."""
        op = PrefetchOperation(
            CacheRequestHandle("r", 0), tokens, last_hash, prefix_keys=prefix_keys, pool_transfers=transfers
        )
        _, hit_tokens = self.ctl._storage_hit_query(op)
        restorable = op.pool_storage_result.restorable_prefix_pages
        return hit_tokens, restorable, {str(k): v for k, v in op.query_pool_hit_pages.items()}

    def prefetch(
        self, keys: list[str], kv_host_pages: list[int], transfers: list[PoolTransfer]
    ) -> tuple[int, dict[str, int]]:
        """SGLang's prefetch I/O for `keys` into KV host pages `kv_host_pages` and the transfers'
        slots: (KV tokens loaded, each extra pool's pages loaded)."""
        op = PrefetchOperation(CacheRequestHandle("r", 0), [], None, prefix_keys=[], pool_transfers=transfers)
        op.hash_value = list(keys)
        op.host_indices = kv_slots(self.page_size, kv_host_pages)
        self.ctl._page_transfer_with_stable_layout(op)
        completed, pool_hits = 0, {}
        while not self.ctl.prefetch_sync_queue.empty():
            ack = self.ctl.prefetch_sync_queue.get()
            completed = ack.completed_tokens if ack.completed_tokens is not None else completed
            pool_hits.update({str(k): v for k, v in (ack.pool_hits or {}).items()})
        return completed, pool_hits
