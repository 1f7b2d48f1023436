"""vLLM 0.33's real offloading objects, driven as its scheduler drives them, for the adapter tests.

`make_manager` goes the way an engine start goes: `OffloadingConfig` ->
`OffloadingSpecFactory.create_spec` -> `TieringOffloadingSpec.get_manager()` (a real
`/dev/shm` region, the real `SecondaryTierFactory`). `Engine` calls the
`TieringOffloadingManager` as `OffloadingConnectorScheduler` does, with `manager.lock`
held. Only the worker's GPU <-> CPU copy is simulated: a store writes the primary rows
`prepare_store` gave it, a load reads the rows `prepare_load` gave it.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

ADAPTER = {"type": "KVTierSecondaryTier", "module_path": "kvtier_async.integrations.vllm"}
REGION_LOGGER = "vllm.v1.kv_offload.cpu.shared_offload_region"


def offloading_config(
    secondary_tiers: list[dict[str, Any]],
    *,
    chunk_bytes: int = 60_000,  # not a multiple of the page size: each row ends in padding
    chunks: int = 32,
    model: str = "meta-llama/Llama-3.1-8B-Instruct",
    dtype: str = "bfloat16",
    tp_size: int = 1,
    events: bool = True,
) -> OffloadingConfig:
    """What vLLM's connector builds from an engine config, for a one-group model."""
    row = row_bytes(chunk_bytes)
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0",), group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes // tp_size,
        enable_kv_cache_events=events,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": chunks * row,
            "secondary_tiers": secondary_tiers,
        },
        engine_id=f"kvtier-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=tp_size,
            tp_size=tp_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def row_bytes(chunk_bytes: int = 60_000) -> int:
    """vLLM's row stride for chunks of `chunk_bytes`: rounded up to the page size."""
    return -(-chunk_bytes // 4096) * 4096


def make_manager(secondary_tiers: list[dict[str, Any]], **kwargs: Any) -> Any:
    spec = OffloadingSpecFactory.create_spec(offloading_config(secondary_tiers, **kwargs))
    return spec.get_manager()


def chunk_keys(seed: int, n: int) -> list[OffloadKey]:
    """n chunk keys as vLLM makes them: a 32-byte block hash and a 4-byte group index."""
    rng = np.random.default_rng(seed)
    return [make_offload_key(rng.bytes(32), 0) for _ in range(n)]


class Engine:
    """One engine's scheduler side, over a real `TieringOffloadingManager`."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        view = manager.primary_tier.get_kv_memoryview()
        self.rows, self.row_bytes = view.shape[0], view.strides[0]
        self.events: list[OffloadingEvent] = []
        self._requests = 0
        self._lookup_watches = [
            _LookupWatch(tier) for tier in manager.secondary_tiers if _LookupWatch.fits(tier)
        ]

    @contextmanager
    def _rows(self) -> Iterator[memoryview]:
        # Released on exit: vLLM unmaps the region at shutdown only if no view of it is left.
        with memoryview(self.manager.primary_tier.get_kv_memoryview()).cast("B") as flat:
            yield flat

    def new_request(self) -> ReqContext:
        self._requests += 1
        ctx = ReqContext(req_id=f"req-{self._requests}")
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def finish(self, ctx: ReqContext) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(ctx)

    def step_end(self, new_req_ids: Sequence[str] = ()) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=new_req_ids, preempted_req_ids=()))
            self.events.extend(self.manager.take_events())

    def store(self, ctx: ReqContext, payloads: dict[OffloadKey, bytes]) -> list[OffloadKey]:
        """GPU -> primary for `payloads`' keys, then complete_store (which cascades to the tiers)."""
        with self.manager.lock:
            out = self.manager.prepare_store(list(payloads), ctx)
            assert out is not None, "the primary tier had no room"
            with self._rows() as flat:
                for key, row in zip(out.keys_to_store, out.store_spec.chunk_ids.tolist()):
                    flat[row * self.row_bytes : (row + 1) * self.row_bytes] = payloads[key]
            self.manager.complete_store(out.keys_to_store, ctx)
        return list(out.keys_to_store)

    def store_what_fits(self, ctx: ReqContext, payloads: dict[OffloadKey, bytes]) -> int:
        """`store`, where the primary tier may take only some keys, or none (no room): how many."""
        with self.manager.lock:
            out = self.manager.prepare_store(list(payloads), ctx)
            if out is None or not out.keys_to_store:
                return 0
            with self._rows() as flat:
                for key, row in zip(out.keys_to_store, out.store_spec.chunk_ids.tolist()):
                    flat[row * self.row_bytes : (row + 1) * self.row_bytes] = payloads[key]
            self.manager.complete_store(out.keys_to_store, ctx)
        return len(out.keys_to_store)

    def offload(self, payloads: dict[OffloadKey, bytes]) -> None:
        """A request that computed these rows: stored, finished, and the cascade to the tiers landed."""
        ctx = self.new_request()
        assert self.store(ctx, payloads) == list(payloads), "the primary tier took only some"
        self.finish(ctx)
        self.settle()

    def lookup(self, ctx: ReqContext, keys: Sequence[OffloadKey]) -> list[LookupResult]:
        """One scheduler pass over a prefix (it keeps scanning past RETRY, stops at a MISS)."""
        results = []
        with self.manager.lock:
            for key in keys:
                result = self.manager.lookup(key, ctx)
                results.append(result)
                if result is LookupResult.MISS:
                    break
        return results

    def settle(self) -> None:
        """End the step and wait for the tiers' work (jobs and lookups) to finish: a state, not a time."""
        self.step_end()
        with self.manager.lock:
            for tier in self.manager.secondary_tiers:
                tier.drain_jobs()
        for watch in self._lookup_watches:
            watch.wait()

    def lookup_until_settled(self, ctx: ReqContext, keys: Sequence[OffloadKey], steps: int = 10) -> list[Any]:
        """Look up step after step until every answer is final (HIT or MISS); the answers seen."""
        seen: list[Any] = []
        for _ in range(steps):
            results = self.lookup(ctx, keys)
            seen.append(results)
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in results):
                return seen
            self.settle()
        raise AssertionError(f"lookups did not settle in {steps} steps: {seen}")

    def load(self, ctx: ReqContext, keys: Sequence[OffloadKey]) -> dict[OffloadKey, bytes]:
        """Primary -> GPU for keys that are HIT: the rows' bytes, whole (padding included)."""
        with self.manager.lock:
            spec = self.manager.prepare_load(list(keys), ctx)
            with self._rows() as flat:
                got = {
                    key: bytes(flat[row * self.row_bytes : (row + 1) * self.row_bytes])
                    for key, row in zip(keys, spec.chunk_ids.tolist())
                }
            self.manager.complete_load(list(keys), ctx)
        return got

    def reset_cache(self) -> None:
        with self.manager.lock:
            self.manager.reset_cache()
            self.manager.on_reset_flushed()

    def shutdown(self) -> list[str]:
        """Shut the manager down; the warnings vLLM's shared region logged meanwhile."""
        warnings: list[str] = []

        class Catch(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if record.levelno >= logging.WARNING:
                    warnings.append(record.getMessage())

        handler = Catch()
        region_logger = logging.getLogger(REGION_LOGGER)
        region_logger.addHandler(handler)
        try:
            self.manager.shutdown()
        finally:
            region_logger.removeHandler(handler)
        return warnings


def random_rows(keys: Sequence[OffloadKey], row_bytes: int, seed: int) -> dict[OffloadKey, bytes]:
    """Incompressible rows, one per key, padding included."""
    rng = np.random.default_rng(seed)
    return {key: rng.bytes(row_bytes) for key in keys}


class _LookupWatch:
    """Waits for the lookup thread of vLLM's own fs tier (the control), whose `drain_jobs` does not.

    Its `AsyncLookupManager.flush` posts at most one batch of keys to its thread per step, and the
    thread posts one batch of answers back; counting both tells when every question is answered.
    """

    @staticmethod
    def fits(tier: Any) -> bool:
        return hasattr(tier, "_lookup_manager")

    def __init__(self, tier: Any) -> None:
        lookups = tier._lookup_manager
        self._changed = threading.Condition()
        self._asked = self._answered = 0
        flush, answers = lookups.flush, lookups._pending_results
        watch = self

        def counted_flush() -> None:
            batch = list(lookups._lookup_batch)
            flush()
            states = [lookups._lookup_state.get(key) for key, _, _ in batch]
            if any(s is not None and s.generation == g for s, (_, _, g) in zip(states, batch)):
                with self._changed:
                    self._asked += 1

        class CountedAnswers:
            def put(self, item: Any) -> None:
                answers.put(item)
                with watch._changed:
                    watch._answered += 1
                    watch._changed.notify_all()

            def get_nowait(self) -> Any:
                return answers.get_nowait()

        lookups.flush = counted_flush
        lookups._pending_results = CountedAnswers()

    def wait(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._answered >= self._asked)
