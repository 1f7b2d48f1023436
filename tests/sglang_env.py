"""SGLang 0.5.23's real storage interface and host KV pools, built on a CPU machine.

SGLang is installed without its dependency list (tests/install.sh); its host-pool modules
import its model registry, where two configs import torchvision, which has no wheel for the
CPU torch. When no torchvision is importable, transformers is first told so (its answer is
cached), then `import_stubs` goes on `sys.path` for SGLang's own module-level imports.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

STUBS = Path(__file__).resolve().parent / "import_stubs"

if importlib.util.find_spec("torchvision") is None:
    from transformers.utils import import_utils

    assert import_utils.is_torchvision_available() is False  # cached from here on
    if str(STUBS) not in sys.path:
        sys.path.append(str(STUBS))

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

#: What a host pool built here may book. Outside such a scope SGLang refuses any pool while the
#: machine has less than its 10 GiB serving reserve free (`HICACHE_HOST_MEMORY_RESERVE_BYTES`),
#: which a shared test machine often has not: the pools here are the size the test asks for.
HOST_POOL_BUDGET = 1 << 40

__all__ = [
    "HiCacheFile",
    "HiCacheStorage",
    "HiCacheStorageConfig",
    "StorageBackendFactory",
    "backend_config",
    "mha_pool",
    "mla_pool",
    "page_bytes",
    "slots",
]


def mha_pool(
    layout: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    page_size: int = 16,
    heads: int = 2,
    head_dim: int = 128,
    layers: int = 4,
    tokens: int = 512,
) -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool (pin_memory off: no CUDA), over its device pool built on the CPU."""
    device = MHATokenToKVPool(
        size=tokens,
        page_size=page_size,
        dtype=dtype,
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    with host_memory_budget_scope(HOST_POOL_BUDGET):
        pool = MHATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            1.0,
            0,
            page_size,
            layout,
            pin_memory=False,
            device_capacity_tokens=device.size,
            start_layer=device.start_layer,
            end_layer=device.end_layer,
        )
    _randomize(pool)
    return pool


def mla_pool(layout: str, *, page_size: int = 64, layers: int = 4, tokens: int = 512) -> MLATokenToKVPoolHost:
    """SGLang's MLA host pool (DeepSeek's 512 + 64 dims), over its device pool built on the CPU."""
    device = MLATokenToKVPool(tokens, page_size, torch.bfloat16, 512, 64, layers, "cpu", False)
    with host_memory_budget_scope(HOST_POOL_BUDGET):
        pool = MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            1.0,
            0,
            page_size,
            layout,
            pin_memory=False,
            device_capacity_tokens=device.size,
            start_layer=device.start_layer,
            end_layer=device.end_layer,
            target_layer_num=layers,
        )
    _randomize(pool)
    return pool


def _randomize(pool: Any) -> None:
    raw = pool.kv_buffer.view(torch.uint8).reshape(-1)
    raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8))


def slots(pool: Any, pages: list[int]) -> torch.Tensor:
    """The host-pool token slots of host pages `pages`, as the controller passes them."""
    return torch.cat([torch.arange(p * pool.page_size, (p + 1) * pool.page_size) for p in pages]).to(
        torch.int64
    )


def page_bytes(pool: Any, page: int) -> bytes:
    """All bytes of one host page, run after run, as the pool describes them."""
    ptrs, sizes = pool.get_page_buffer_meta(slots(pool, [page]))
    raw = pool.kv_buffer.view(torch.uint8).reshape(-1)
    base = pool.kv_buffer.data_ptr()
    return b"".join(raw[p - base : p - base + n].numpy().tobytes() for p, n in zip(ptrs, sizes))


def backend_config(
    tier: dict[str, Any] | None,
    *,
    pool: Any,
    tp_rank: int = 0,
    tp_size: int = 1,
    model: str | None = "org/model-7b",
    extra: dict[str, Any] | None = None,
) -> HiCacheStorageConfig:
    """The storage config SGLang builds for `--hicache-storage-backend dynamic` with our JSON."""
    extra_config: dict[str, Any] = {
        "backend_name": "kvtier",
        "module_path": "kvtier_async.integrations.sglang",
        "class_name": "KVTierHiCacheStorage",
        "interface_v1": 1,
        **({"tier": tier} if tier is not None else {}),
        **(extra or {}),
    }
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        # SGLang: MLA KV, and DeepSeek V4's (a LogicalHostPool anchor), is one copy for every rank
        is_mla_model=isinstance(pool, (MLATokenToKVPoolHost, LogicalHostPool)),
        enable_storage_metrics=True,
        is_page_first_layout=pool.layout == "page_first",
        model_name=model,
        extra_config=extra_config,
    )
