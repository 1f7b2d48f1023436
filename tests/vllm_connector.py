"""vLLM 0.33's real scheduler-side offloading connector over a hybrid model, for the adapter tests.

`HybridEngine` builds vLLM's `OffloadingConnectorScheduler` from a real `VllmConfig` (no model:
the connector reads only its cache, parallel and speculative config), a real `KVCacheConfig` of
a hybrid model's groups (`kv_cache_groups`: full attention, a sliding window of 16-token blocks,
a sliding window of 32-token blocks; `linear_attention_groups`: full attention and a Mamba-state
group, as vLLM builds linear attention) and a real `TieringOffloadingManager`
(from vLLM's spec factory, as in
`vllm_engine`). Requests are vLLM `Request`s hashed by vLLM's own block
hasher; the connector decides which chunks of which group are looked up, loaded and stored.
What stands in for the rest of vLLM:

- the KV cache manager: each group's block table is fresh block ids, except that a windowed
  (sliding-window or Mamba) group's blocks before the window a load needs are the null block
  (id 0), as vLLM frees them;
- the scheduler's Mamba "align" hand-off: a state group's state at the prompt's last whole chunk;
- the GPU and the worker's copies: a block's bytes live in `gpu[group][block_id]`, one row each
  (blocks_per_chunk is 1); a store copies them into the primary rows the job names, a load back;
- the model: the bytes a chunk of a group should hold are a function of the chunk's key and the
  group's layer names, so a row found under another layout is wrong bytes, not a silent pass.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from vllm.config import CacheConfig, DeviceConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_sliding_window_size_in_chunks
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import KVConnectorBlockState, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.config import OffloadingGroupConfig
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus
from vllm_engine import Engine, offloading_config

TOKENS_PER_HASH = 16
# One layer's block: 16 tokens x 2 KV heads x 16 dims (or 32 tokens x 8 dims) x K and V x bf16.
PAGE_BYTES = 2048
LAYERS_PER_GROUP = 2

#: gpt-oss / Gemma-like: full attention, a 48-token window, and a 64-token window kept in 32-token
#: blocks. The names are the model's layers, interleaved as such models interleave them.
LAYOUT = (("layers.0", "layers.3"), ("layers.1", "layers.4"), ("layers.2", "layers.5"))


#: Qwen3-Next / Qwen3.5-like: full attention every fourth layer, gated delta net (a Mamba state
#: in vLLM) in the others.
LINEAR_LAYOUT = (
    ("layers.3", "layers.7"),
    ("layers.0", "layers.1", "layers.2", "layers.4", "layers.5", "layers.6"),
)


def linear_attention_groups(layer_names: Sequence[Sequence[str]] = LINEAR_LAYOUT) -> list[KVCacheGroupSpec]:
    """vLLM's KV-cache groups of a full-attention + linear-attention model with prefix caching on:
    the linear layers' state is a `MambaSpec` in "align" mode, its page padded to the KV page."""
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    state = MambaSpec(
        block_size=16,
        shapes=((4, 64), (2, 16, 16)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=PAGE_BYTES * 2,
        mamba_cache_mode="align",
    )
    return [
        KVCacheGroupSpec(list(names), spec) for names, spec in zip(layer_names, (full, state), strict=True)
    ]


def kv_cache_groups(layer_names: Sequence[Sequence[str]] = LAYOUT) -> list[KVCacheGroupSpec]:
    """vLLM's KV-cache groups of the hybrid model, each group's layers named by `layer_names`."""
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16, sliding_window=48
    )
    wide = SlidingWindowSpec(
        block_size=32, num_kv_heads=2, head_size=8, dtype=torch.bfloat16, sliding_window=64
    )
    return [
        KVCacheGroupSpec(list(names), spec)
        for names, spec in zip(layer_names, (full, window, wide), strict=True)
    ]


def hybrid_offloading_config(
    secondary_tiers: list[dict[str, Any]], groups: list[KVCacheGroupSpec], chunks: int = 48
) -> Any:
    """What vLLM's `build_offloading_config` makes of these groups (blocks_per_chunk 1): each
    group's tokens per block, layer names and window in chunks, by vLLM's own function."""
    chunk_bytes = PAGE_BYTES * sum(len(g.layer_names) for g in groups)
    base = offloading_config(secondary_tiers, chunk_bytes=chunk_bytes, chunks=chunks)
    return replace(
        base,
        cache=replace(base.cache, tokens_per_hash=TOKENS_PER_HASH),
        groups=tuple(
            OffloadingGroupConfig(
                tokens_per_block=g.kv_cache_spec.block_size,
                layer_names=tuple(g.layer_names),
                group_id=i,
                sliding_window_size_in_chunks=get_sliding_window_size_in_chunks(
                    g.kv_cache_spec, g.kv_cache_spec.block_size
                ),
            )
            for i, g in enumerate(groups)
        ),
    )


def expected_row(key: OffloadKey, layer_names: Sequence[str], nbytes: int) -> bytes:
    """The bytes the model computes for this chunk of this group: its key and its layers decide."""
    seed = hashlib.blake2b(bytes(key) + "|".join(layer_names).encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(seed, "little")).bytes(nbytes)


@dataclass
class Prefill:
    """What one request's prefill went through, per group index."""

    hit_tokens: int
    loaded: dict[int, list[OffloadKey]] = field(default_factory=dict)
    stored: dict[int, list[OffloadKey]] = field(default_factory=dict)
    wrong: list[OffloadKey] = field(default_factory=list)


class HybridEngine:
    """One engine's scheduler: vLLM's connector over its tiering manager, and a simulated worker."""

    def __init__(
        self, secondary_tiers: list[dict[str, Any]], groups: list[KVCacheGroupSpec] | None = None
    ) -> None:
        self.groups = kv_cache_groups() if groups is None else groups
        spec = OffloadingSpecFactory.create_spec(hybrid_offloading_config(secondary_tiers, self.groups))
        vllm_config = VllmConfig(
            cache_config=CacheConfig(enable_prefix_caching=True), device_config=DeviceConfig(device="cpu")
        )
        kv_cache_config = KVCacheConfig(num_blocks=1024, kv_cache_tensors=[], kv_cache_groups=self.groups)
        self.connector = OffloadingConnectorScheduler(spec, vllm_config, kv_cache_config)
        self.engine = Engine(self.connector.manager)  # settle / shutdown, as for one-group engines
        self.row_bytes = self.engine.row_bytes
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(TOKENS_PER_HASH, sha256)
        self.gpu: list[dict[int, bytes]] = [{} for _ in self.groups]
        self._next_block = 1  # 0 is vLLM's null block
        self._requests = 0

    # -- what the rest of the scheduler does -------------------------------------------------

    def prefill(self, prompt: Sequence[int], max_steps: int = 20) -> Prefill:
        """One request through lookup, load, prefill, store and finish; every load checked."""
        self._requests += 1
        req = Request(
            f"req-{self._requests}-{uuid.uuid4().hex[:6]}",
            list(prompt),
            SamplingParams(max_tokens=1),
            None,
            block_hasher=self._hasher,
        )
        self.connector.on_new_request(req)
        for _ in range(max_steps):  # RETRY while the tiers are asked: the scheduler asks again
            hits, _load_async = self.connector.get_num_new_matched_tokens(req, 0)
            if hits is not None:
                break
            self._step(SchedulerOutput.make_empty())
            self.engine.settle()
        else:
            raise AssertionError(f"the connector deferred the lookup for {max_steps} steps")
        result = Prefill(hit_tokens=hits)
        blocks = self._allocate(req, hits)
        self.connector.update_state_after_alloc(req, KVCacheBlocks(blocks), hits)
        if hits:  # loads first: the request waits for them, then is scheduled
            self._step(SchedulerOutput.make_empty(), req, result)
            req.num_computed_tokens = hits
        block_ids = tuple([b.block_id for b in group] for group in blocks)
        self._compute(req, block_ids, hits)
        output = SchedulerOutput.make_empty()
        output.scheduled_new_reqs = [NewRequestData.from_request(req, block_ids)]
        output.num_scheduled_tokens = {req.request_id: len(prompt) - hits}
        output.total_num_scheduled_tokens = len(prompt) - hits
        output.kv_connector_block_state = self._boundary_states(req, block_ids, hits)
        self._step(output, req, result)
        req.num_computed_tokens = len(prompt)
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        self.connector.request_finished(req)
        output = SchedulerOutput.make_empty()
        output.finished_req_ids = {req.request_id}
        self._step(output, req, result)
        self.engine.settle()  # the cascade to the secondary tiers has landed
        return result

    def _allocate(self, req: Request, hits: int) -> tuple[list[KVCacheBlock], ...]:
        """Each group's block table for the whole prompt; a windowed group's blocks before the
        window that a load of `hits` tokens needs are the null block."""
        tables = []
        for config in self.connector.config.kv_group_configs:
            n = -(-req.num_tokens // config.tokens_per_block)
            window = config.load_window_size_in_chunks(hits) if hits else None
            first_needed = 0 if window is None else max(0, -(-hits // config.tokens_per_block) - window)
            table = []
            for i in range(n):
                if i < first_needed:
                    table.append(KVCacheBlock(0, is_null=True))
                else:
                    table.append(KVCacheBlock(self._next_block))
                    self._next_block += 1
            tables.append(table)
        return tuple(tables)

    def _compute(self, req: Request, block_ids: tuple[list[int], ...], hits: int) -> None:
        """The model's forward pass: every block of whole chunks past the hit gets its bytes."""
        for g, (config, ids) in enumerate(zip(self.connector.config.kv_group_configs, block_ids)):
            keys = self._group_keys(req, g)
            for i, block_id in enumerate(ids):
                if block_id and i < len(keys) and (i + 1) * config.tokens_per_block > hits:
                    self.gpu[g][block_id] = expected_row(keys[i], self.groups[g].layer_names, self.row_bytes)

    def _boundary_states(
        self, req: Request, block_ids: tuple[list[int], ...], hits: int
    ) -> KVConnectorBlockState | None:
        """The scheduler's Mamba "align" hand-off: each state group's state at the last whole
        chunk of the prompt (vLLM splits an align-mode prefill there), in the block that holds it."""
        entries = []
        for g, config in enumerate(self.connector.config.kv_group_configs):
            boundary = req.num_tokens // config.tokens_per_chunk * config.tokens_per_chunk
            if config.requires_cow_source and boundary > hits:
                entries.append(
                    (config.group_idx, block_ids[g][boundary // config.tokens_per_block - 1], boundary)
                )
        if not entries:
            return None
        return KVConnectorBlockState(
            req_ids={req.request_id},
            resolve_block_ids=lambda _req_id: block_ids,
            boundary_state_offloads={req.request_id: entries},
        )

    def _group_keys(self, req: Request, group: int) -> list[OffloadKey]:
        return list(self.connector._req_status[req.request_id].group_states[group].offload_keys)

    # -- one engine step and the worker -------------------------------------------------------

    def _step(
        self, output: SchedulerOutput, req: Request | None = None, result: Prefill | None = None
    ) -> None:
        meta = self.connector.build_connector_meta(output)
        done = OffloadingWorkerMetadata()
        for job_id, job in meta.load_jobs.items():
            self._copy(job.src_spec, job.dst_spec, to_gpu=True, req=req, result=result)
            done.mark_completed(job_id)
        for job_id, job in meta.store_jobs.items():
            self._copy(job.dst_spec, job.src_spec, to_gpu=False, req=req, result=result)
            done.mark_completed(job_id)
        self.connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=done))

    def _copy(self, cpu_spec: Any, gpu_spec: Any, *, to_gpu: bool, req: Any, result: Any) -> None:
        """vLLM's CPU worker for blocks_per_chunk 1: the job's GPU blocks, group after group, pair
        one for one with its primary rows."""
        rows = cpu_spec.chunk_ids.tolist()
        gpu_ids = list(gpu_spec.block_ids)
        assert len(rows) == len(gpu_ids) == sum(gpu_spec.group_sizes)
        start = 0
        with self._rows() as flat:
            for g, size in enumerate(gpu_spec.group_sizes):
                keys = self._group_keys(req, g)
                first = gpu_spec.block_indices[g]
                for i in range(size):
                    row, block_id = rows[start + i], gpu_ids[start + i]
                    where = slice(row * self.row_bytes, (row + 1) * self.row_bytes)
                    key = keys[first + i]
                    if to_gpu:
                        self.gpu[g][block_id] = bytes(flat[where])
                        result.loaded.setdefault(g, []).append(key)
                        if self.gpu[g][block_id] != expected_row(
                            key, self.groups[g].layer_names, self.row_bytes
                        ):
                            result.wrong.append(key)
                    else:
                        flat[where] = self.gpu[g][block_id]
                        result.stored.setdefault(g, []).append(key)
                start += size

    @contextmanager
    def _rows(self) -> Iterator[memoryview]:
        with self.engine._rows() as flat:
            yield flat

    def reset_cache(self) -> None:
        """vLLM's reset_prefix_cache: the primary tier forgets; the secondary tiers keep theirs."""
        self.connector.reset_cache()
        self._step(SchedulerOutput.make_empty())

    def shutdown(self) -> list[str]:
        return self.engine.shutdown()
