"""kvtier tiers inside vLLM 0.33: `KVTierSecondaryTier` is a vLLM secondary tier.

vLLM's `TieringOffloadingManager` keeps a CPU primary tier (a `/dev/shm` mapping,
one row per chunk) and cascades every stored chunk to its secondary tiers; it
loads them back ("promotion") when a request's prefix is found there. It loads an
out-of-tree tier from the connector's extra config::

    {"type": "KVTierSecondaryTier", "module_path": "kvtier_async.integrations.vllm",
     "tier": {"type": "fs", "root": "/nvme/kv"}}

`KVTierSecondaryTier` subclasses vLLM's own `SecondaryTierManager` and runs the
kvtier tier named by `"tier"` on a private event loop (uvloop when installed) on
a daemon thread (`bridge.LoopThread`, shared by every integration). vLLM calls
it synchronously from its scheduler, under the manager's lock, and nothing here
blocks that thread on I/O: jobs become tasks on the loop and come back through
`get_finished_jobs`; `lookup` answers from what
this process stored or was told, and otherwise queues the key for one batched
existence check (sent at the end of the step) and answers RETRY until it is back.
Only `drain_jobs` and `shutdown` wait, as vLLM's contract says they must.

This module imports vLLM; `import kvtier_async` does not.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine, Iterable, Mapping
from functools import partial
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .. import __version__
from ..errors import ClosedError, ConfigError, InvalidArgumentError
from ..keys import check_block_ids, check_keys, check_lengths
from ..spec import OffloadingSpec
from ..tier import SecondaryTierManager as KVTier
from .bridge import LoopThread, settle, start_tier
from .lookup_answers import LookupAnswers
from .vllm_metrics import METRICS, TierMetrics, metric_definitions, tier_label

__all__ = ["METRICS", "KVTierSecondaryTier"]

log = logging.getLogger(__name__)

# Where each built-in kvtier tier keeps its blocks, as vLLM's tier filters and hit sources see it:
# (medium, locality, cache hit source). A tier config's "locality" overrides the locality (an fs
# root on a network file system is REMOTE). Out-of-tree kvtier tiers are STORAGE, locality unknown.
_PLACEMENT: dict[str, tuple[Medium, Locality | None, CacheHitSource]] = {
    "memory": (Medium.CPU, Locality.LOCAL, CacheHitSource.HOST),
    "fs": (Medium.STORAGE, Locality.LOCAL, CacheHitSource.DISK),
    "redis": (Medium.CPU, Locality.REMOTE, CacheHitSource.EXTERNAL_UNSPECIFIED),
    "s3": (Medium.STORAGE, Locality.REMOTE, CacheHitSource.DISK),
}
_UNKNOWN_PLACEMENT = (Medium.STORAGE, None, CacheHitSource.EXTERNAL_UNSPECIFIED)

#: Keys this process knows a tier holds, kept to answer `lookup` at once; least recently
#: used are forgotten first (and then asked about again).
KNOWN_KEYS = 1 << 18
#: Unknown keys gathered for one existence check; a step's lookups beyond it start another.
_CHECK_BATCH = 1024
#: How long `shutdown` lets jobs in flight finish before it cancels them.
SHUTDOWN_GRACE_S = 10.0


class KVTierSecondaryTier(SecondaryTierManager):
    """Any kvtier tier as a vLLM 0.33 secondary tier.

    Args (after vLLM's own):
        tier: the kvtier tier config, `{"type": "fs" | "redis" | "s3" | "memory" | ..., **kwargs}`.
        locality: "LOCAL" or "REMOTE", where the built-in default for the tier type is wrong
            (vLLM also picks back-pressure defaults from it).
        limits: kvtier scheduler sizing (`io_threads`, `max_inflight_loads`, ...).

    The tier is started while vLLM builds its manager (`bridge.start_tier`): a configuration
    that can never work (a root others may write, a bucket that does not exist) stops the
    engine's start-up with its `ConfigError`; a fault that may pass (a server down) is counted
    and logged, and the engine starts with the tier degraded until it opens.
    """

    # Every instance sets its own from the tier it wraps; see _PLACEMENT.
    medium: ClassVar[Medium | None] = None
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        *,
        tier: Mapping[str, Any] | None = None,
        locality: str | None = None,
        limits: Mapping[str, int] | None = None,
    ) -> None:
        if not isinstance(tier, Mapping) or not isinstance(tier.get("type"), str):
            raise ConfigError(
                "KVTierSecondaryTier needs a nested kvtier tier config, "
                'e.g. "tier": {"type": "fs", "root": "/nvme/kv"}'
            )
        if locality is not None and locality.upper() not in Locality.__members__:
            raise ConfigError(f'KVTierSecondaryTier: locality must be "LOCAL" or "REMOTE", got {locality!r}')
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.spec = OffloadingSpec.from_vllm(
            offloading_spec, primary_kv_view, secondary_tiers=[tier], **dict(limits or {})
        )
        medium, default_locality, hit_source = _PLACEMENT.get(tier["type"], _UNKNOWN_PLACEMENT)
        # Instance attributes on purpose: vLLM reads them from the tier object, and what they are
        # depends on the tier this one wraps.
        self.medium = medium  # type: ignore[misc]
        self.cache_hit_source = hit_source  # type: ignore[misc]
        self.locality = Locality[locality.upper()] if locality is not None else default_locality
        self._metrics = TierMetrics(tier_label(offloading_spec, tier_type, tier))
        self._ownership = f"kvtier:{tier['type']}"
        self._events: list[OffloadingEvent] | None = (
            []
            if getattr(getattr(offloading_spec, "kv_events_config", None), "enable_kv_cache_events", False)
            else None
        )
        self._lock = threading.Lock()  # guards everything below; the loop thread takes it too
        self._changed = threading.Condition(self._lock)  # notified when a job finishes
        self._closed = False
        self._pending_jobs: set[int] = set()
        self._finished: list[JobResult] = []
        self._lookups = LookupAnswers(KNOWN_KEYS, _CHECK_BATCH)
        self._bridge = LoopThread("kvtier-vllm")
        try:
            self._tier: KVTier = self._bridge.call(self._open(tier))
        except BaseException:
            self._bridge.stop()
            raise

    async def _open(self, config: Mapping[str, Any]) -> KVTier:
        tier = await start_tier(config, self._primary_kv_view, self.spec)
        tier.removal_listeners.append(self._on_removed)
        self._metrics.refresh_gauges(tier)
        return tier

    # -- lookups ------------------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT or MISS where known; RETRY while the key is being stored or asked about."""
        with self._lock:
            self._check_open()
            answer = self._lookups.answer(key)
            flush = answer is None and self._lookups.batch_is_full
        if flush:
            self._send_checks()
        if answer is None:
            return LookupResult.RETRY
        return LookupResult.HIT if answer else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Send this step's unknown keys as one existence check; forget answers a step old."""
        with self._lock:
            self._lookups.next_step()
        self._send_checks()

    def _send_checks(self) -> None:
        with self._lock:
            if self._closed:  # shut down: no check will be sent, none is pending
                self._lookups.drop_unasked()
                return
            if not (keys := self._lookups.take_unasked()):
                return
        self._bridge.call_soon(self._start_check, keys)

    def _start_check(self, keys: list[bytes]) -> None:
        task = self._bridge.loop.create_task(self._tier.lookup_each(keys))
        task.add_done_callback(lambda done: self._check_done(keys, done))

    def _check_done(self, keys: list[bytes], task: asyncio.Task[list[bool]]) -> None:
        present = [False] * len(keys)
        if not task.cancelled() and task.exception() is None:
            present = task.result()
        with self._lock:
            self._lookups.answered(keys, present)
            self._changed.notify_all()

    def _on_removed(self, keys: list[bytes]) -> None:
        """The tier let go of `keys` (evicted, deleted, found corrupt): loop thread."""
        with self._lock:
            self._lookups.forget(keys)
            if self._events is not None:
                self._events.append(self._event(keys, removed=True))

    def _event(self, keys: list[bytes], *, removed: bool) -> OffloadingEvent:
        return OffloadingEvent(
            keys=[OffloadKey(key) for key in keys],
            medium=self.medium or Medium.STORAGE,
            removed=removed,
            locality=self.locality,
            ownership=self._ownership,
            removal_expected=not removed,
        )

    # -- jobs ---------------------------------------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        """Write the job's primary rows to the tier; the result comes back via `get_finished_jobs`."""
        keys, rows = self._job_args(job_metadata)
        with self._lock:
            self._lookups.storing(keys)
        self._start(job_metadata.job_id, self._store(job_metadata.job_id, keys, rows))

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Read the job's keys into its primary rows; success only where the exact bytes arrived."""
        keys, rows = self._job_args(job_metadata)
        self._start(job_metadata.job_id, self._load(job_metadata.job_id, keys, rows))

    async def _store(self, job_id: int, keys: list[bytes], rows: list[int]) -> JobResult:
        started = time.monotonic()
        results = [False] * len(keys)
        try:
            results = await self._tier.store(keys, rows)
        finally:
            stored = [key for key, ok in zip(keys, results) if ok]
            with self._lock:  # one step: a lookup sees the key as being stored, or its outcome
                self._lookups.stored(keys, stored)
                if self._events is not None and stored:
                    self._events.append(self._event(stored, removed=False))
        elapsed = time.monotonic() - started
        return JobResult(
            job_id=job_id,
            success=len(stored) == len(keys),
            transfer_time=elapsed,
            transfer_bytes=len(stored) * self.block_size_bytes,
        )

    async def _load(self, job_id: int, keys: list[bytes], rows: list[int]) -> JobResult:
        started = time.monotonic()
        results = await self._tier.load(keys, rows)
        elapsed = time.monotonic() - started
        loaded = [OffloadKey(key) for key, ok in zip(keys, results) if ok]
        with self._lock:
            # Gone (evicted, or another process's server restarted).
            self._lookups.forget(key for key, ok in zip(keys, results) if not ok)
        complete = len(loaded) == len(keys)
        return JobResult(
            job_id=job_id,
            success=complete,
            successful_keys=None if complete or not loaded else loaded,
            transfer_time=elapsed,
            transfer_bytes=len(loaded) * self.block_size_bytes,
        )

    def _job_args(self, job: TransferJob) -> tuple[list[bytes], list[int]]:
        """Check a job before anything starts; a bad one raises `InvalidArgumentError`."""
        keys = [bytes(key) for key in job.keys]
        rows = [int(row) for row in job.chunk_ids]
        check_keys(keys)
        check_lengths(keys, rows)
        check_block_ids(rows, self.spec.num_cpu_blocks, what="chunk_ids")
        with self._lock:
            self._check_open()
            if job.job_id in self._pending_jobs:
                raise InvalidArgumentError(f"job {job.job_id!r} is already in flight")
        return keys, rows

    def _start(self, job_id: int, work: Coroutine[Any, Any, JobResult]) -> None:
        with self._lock:
            self._pending_jobs.add(job_id)
        # The result is recorded when the task has really ended, never earlier: until then its
        # I/O may still touch the job's primary rows.
        self._bridge.start(work, partial(self._job_done, job_id))

    def _job_done(self, job_id: int, task: asyncio.Task[JobResult]) -> None:
        if task.cancelled():
            result = JobResult(job_id=job_id, success=False)
        elif (error := task.exception()) is not None:
            self._tier.fault_log.warning(
                ("job", type(error)), "kvtier vLLM tier: job %r failed", job_id, exc_info=error
            )
            result = JobResult(job_id=job_id, success=False)
        else:
            result = task.result()
        self._metrics.refresh_gauges(self._tier)
        with self._lock:
            self._finished.append(result)
            self._pending_jobs.discard(job_id)
            self._changed.notify_all()

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Jobs finished since the last call, each once."""
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def drain_jobs(self) -> None:
        """Wait until every submitted job has finished, its result queued for `get_finished_jobs`,
        and every existence check sent has been answered. A job is never abandoned half-way."""
        waited = 0.0
        with self._lock:
            while self._pending_jobs or self._lookups.checks_in_flight:
                if not self._changed.wait(timeout=5.0):
                    waited += 5.0
                    log.warning(
                        "kvtier vLLM tier: still waiting for %d jobs and %d lookups after %.0f s",
                        len(self._pending_jobs),
                        self._lookups.checks_in_flight,
                        waited,
                    )

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._pending_jobs or self._lookups.pending)

    # -- what vLLM asks of every tier -------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()  # chunk by chunk, as they are computed

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Chunks this tier stored and let go of since the last call (with KV events enabled)."""
        if self._events is None:
            return ()
        with self._lock:
            events, self._events = self._events, []
        return events

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    def get_stats(self) -> OffloadingConnectorStats | None:
        """Counter increments since the last call, and the tier's gauges, labelled by tier."""
        return self._metrics.stats(self._tier.counters)

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("kvtier_tier", "kvtier_namespace", "kvtier_version")

    def config_info(self) -> ConfigInfoMapping:
        return {
            "kvtier_tier": self._ownership,
            "kvtier_namespace": self.spec.namespace,
            "kvtier_version": __version__,
        }

    # -- shutting down --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Let jobs in flight finish (cancel them after `SHUTDOWN_GRACE_S`), close the tier, stop the
        thread. Afterwards nothing here holds a view of vLLM's primary region, so vLLM unmaps it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._bridge.finish(self._close())
        finally:
            with self._lock:
                # Results of jobs that never started (the loop was gone); none touches memory now.
                for job_id in self._pending_jobs:
                    self._finished.append(JobResult(job_id=job_id, success=False))
                self._pending_jobs.clear()
                self._changed.notify_all()

    async def _close(self) -> None:
        if cancelled := await settle(self._bridge.started, SHUTDOWN_GRACE_S):
            log.warning("kvtier vLLM tier: cancelled %d jobs still running at shutdown", cancelled)
        await self._tier.aclose()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"kvtier vLLM tier {self.tier_type!r} is shut down")
