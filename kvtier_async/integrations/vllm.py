"""kvtier tiers as vLLM secondary tiers: vLLM's synchronous tier surface over a private event loop.

vLLM's tiering manager calls its secondary tiers synchronously from the
scheduler: `lookup(key, req_context)`, `submit_store(job)`, `submit_load(job)`
(a job carries `job_id`, `keys` and `block_ids`, slots of the primary tier's
memoryview), then polls `get_finished()` / `get_finished_jobs()` each step.
`KVTierSecondaryTier` offers exactly that over any kvtier tier, configured by
a nested `"tier"` dict:

    {"type": "KVTierSecondaryTier", "module_path": "kvtier_async.integrations.vllm",
     "tier": {"type": "fs", "root": "/nvme/kv"}}

The tier runs on a private event loop (uvloop when installed) on a daemon
thread. No method blocks its caller on I/O: jobs are handed to the loop and
their results come back through `get_finished*`; `lookup` answers from a local
record of what this process stored or saw, and otherwise starts an existence
check on the tier and answers "in flight" (None, or RETRY) until it is back.
`drain_jobs` waits for every job; `shutdown` fails what has not started,
waits for the rest, closes the tier and stops the thread. vLLM itself is never
imported here at module import time.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..errors import ClosedError, ConfigError
from ..factory import SecondaryTierFactory
from ..spec import OffloadingSpec

__all__ = ["JobResult", "KVTierSecondaryTier", "LookupResult"]

log = logging.getLogger(__name__)


class LookupResult(enum.Enum):
    """The newer lookup convention, used when the caller asks for it and vLLM's own is absent."""

    HIT = "hit"
    MISS = "miss"
    RETRY = "retry"


@dataclass(frozen=True)
class JobResult:
    """What `get_finished*` returns per job."""

    job_id: Any
    success: bool


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _vllm_lookup_result() -> Any:
    """vLLM's LookupResult enum where this vLLM has one (looked up lazily), else None."""
    import importlib

    for module in (
        "vllm.v1.kv_offload.tiering.base",
        "vllm.v1.kv_offload.tiering",
        "vllm.v1.kv_offload.abstract",
    ):
        try:
            found = getattr(importlib.import_module(module), "LookupResult", None)
        except ImportError:
            continue
        if found is not None:
            return found
    return None


class KVTierSecondaryTier:
    """A kvtier tier behind vLLM's synchronous secondary-tier surface.

    `lookup_result`: "bool" answers True / False / None (in flight); "enum"
    answers HIT / MISS / RETRY of vLLM's `LookupResult` where importable, else
    of ours; "auto" (the default) takes "enum" when vLLM has a `LookupResult`.
    """

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str = "kvtier",
        *,
        tier: dict[str, Any] | None = None,
        lookup_result: str = "auto",
    ) -> None:
        if not isinstance(tier, dict) or "type" not in tier:
            raise ConfigError('the vLLM adapter needs a nested tier config, e.g. "tier": {"type": "fs", ...}')
        if lookup_result not in ("auto", "bool", "enum"):
            raise ConfigError(f'lookup_result must be "auto", "bool" or "enum", got {lookup_result!r}')
        spec = offloading_spec
        if not isinstance(spec, OffloadingSpec):
            spec = OffloadingSpec.from_vllm(offloading_spec)
        self.offloading_spec = spec
        self.tier_type = tier_type
        enum_type = _vllm_lookup_result() if lookup_result != "bool" else None
        if lookup_result == "enum" and enum_type is None:
            enum_type = LookupResult
        self._results: Any = enum_type
        self._tier = SecondaryTierFactory.create_secondary_tier(dict(tier), primary_kv_view, spec)
        self._lock = threading.Lock()
        self._finished: list[JobResult] = []
        self._jobs: dict[Any, Future[bool]] = {}
        self._held: set[bytes] = set()  # keys this process stored or found on the tier
        self._storing: dict[bytes, int] = {}  # keys in stores in flight, with how many
        self._checking: dict[bytes, Future[list[bool]]] = {}
        self._closed = False
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtier-vllm", daemon=True)
        self._thread.start()

    # -- lookups -------------------------------------------------------------------------------
    def lookup(self, key: bytes, req_context: Any = None) -> Any:
        """Whether `key` is on this tier: HIT / MISS, or "in flight" while that is being found out."""
        self._check_open()
        with self._lock:
            if key in self._held:
                return self._answer(True)
            if key in self._storing:
                return self._answer(None)
            check = self._checking.get(key)
            if check is None:
                self._checking[key] = asyncio.run_coroutine_threadsafe(
                    self._tier.lookup_each([key]), self._loop
                )
                return self._answer(None)
            if not check.done():
                return self._answer(None)
            del self._checking[key]  # one answer per check: a later lookup asks the tier again
        present = not check.cancelled() and check.exception() is None and check.result() == [True]
        if present:
            with self._lock:
                self._held.add(key)
        return self._answer(present)

    def _answer(self, present: bool | None) -> Any:
        if self._results is None:
            return present
        if present is None:
            return self._results.RETRY
        return self._results.HIT if present else self._results.MISS

    def touch(self, keys: Sequence[bytes], *args: Any, **kwargs: Any) -> None:
        """Recency is the tier's own business (its LRU sees every read)."""

    # -- jobs ----------------------------------------------------------------------------------
    def submit_store(self, job: Any) -> None:
        """Write `job.block_ids` (primary slots) under `job.keys`; the result comes via get_finished."""
        keys, ids = self._job_args(job)
        with self._lock:
            for key in keys:
                self._storing[key] = self._storing.get(key, 0) + 1
        self._start(job.job_id, self._store(keys, ids), stored=keys)

    def submit_load(self, job: Any) -> None:
        """Read `job.keys` into `job.block_ids` (primary slots); success only if every block arrived."""
        keys, ids = self._job_args(job)
        self._start(job.job_id, self._load(keys, ids))

    async def _store(self, keys: list[bytes], ids: list[int]) -> bool:
        results = await self._tier.store(keys, ids)
        with self._lock:
            self._held.update(key for key, ok in zip(keys, results) if ok)
        return bool(results) and all(results)

    async def _load(self, keys: list[bytes], ids: list[int]) -> bool:
        results = await self._tier.load(keys, ids)
        with self._lock:
            for key, ok in zip(keys, results):
                if not ok:
                    self._held.discard(key)  # gone from the tier (evicted, or a restarted server)
        return bool(results) and all(results)

    def get_finished(self) -> list[JobResult]:
        """Jobs finished since the last call, each once."""
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def get_finished_jobs(self) -> list[JobResult]:
        return self.get_finished()

    def drain_jobs(self, timeout: float | None = None) -> None:
        """Block until every submitted job (and existence check) has finished; results stay for
        get_finished."""
        with self._lock:
            pending: list[Future[Any]] = [*self._jobs.values(), *self._checking.values()]
        for future in pending:
            with contextlib.suppress(Exception):  # a failure is reported as a failed job
                future.result(timeout)

    # -- request lifecycle: nothing per request is kept here -----------------------------------
    def on_request_started(self, *args: Any, **kwargs: Any) -> None:
        pass

    def on_request_finished(self, *args: Any, **kwargs: Any) -> None:
        pass

    # -- shutting down -------------------------------------------------------------------------
    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Fail the jobs not yet started, wait for the rest, close the tier, stop the thread."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending: list[Future[Any]] = [*self._jobs.values(), *self._checking.values()]
        for future in pending:
            future.cancel()  # a job already running is cancelled inside; its result says so
        self.drain_jobs(timeout)
        closing = asyncio.run_coroutine_threadsafe(self._tier.aclose(), self._loop)
        try:
            closing.result(timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._loop.close()

    # -- internals -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the kvtier vLLM tier is shut down")

    def _job_args(self, job: Any) -> tuple[list[bytes], list[int]]:
        self._check_open()
        keys, ids = list(job.keys), [int(i) for i in job.block_ids]
        if len(keys) != len(ids):
            raise ValueError(f"job {job.job_id!r}: {len(keys)} keys but {len(ids)} block ids")
        with self._lock:
            if job.job_id in self._jobs:
                raise ValueError(f"job {job.job_id!r} is already in flight")
        return keys, ids

    def _start(self, job_id: Any, work: Any, stored: list[bytes] | None = None) -> None:
        # Registered under the lock before its done-callback can run, so it is always removed.
        with self._lock:
            future = asyncio.run_coroutine_threadsafe(work, self._loop)
            self._jobs[job_id] = future
        future.add_done_callback(lambda f: self._on_job_done(job_id, f, stored or []))

    def _on_job_done(self, job_id: Any, future: Future[Any], stored: list[bytes]) -> None:
        """Runs however the job ended, even cancelled before it started."""
        success = not future.cancelled() and future.exception() is None and future.result() is True
        if not future.cancelled() and future.exception() is not None:
            log.warning("kvtier vLLM tier: job %r failed", job_id, exc_info=future.exception())
        with self._lock:
            for key in stored:
                self._storing[key] -= 1
                if not self._storing[key]:
                    del self._storing[key]
            self._jobs.pop(job_id, None)
            self._finished.append(JobResult(job_id, success))
