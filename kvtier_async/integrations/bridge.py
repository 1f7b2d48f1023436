"""`LoopThread`: the one bridge from an engine's threads to kvtier's event loop.

Engines (vLLM's scheduler, SGLang's cache-controller threads, LMCache's
controllers) call their storage plug-ins synchronously, from threads of their
own, often several at once. kvtier's tiers are asyncio objects that belong to
one event loop. Each integration therefore owns a private loop (uvloop when
installed) running on a daemon thread, and engine threads reach it only here:
`call` runs a coroutine there and waits for its result, `submit` starts one and
returns a `concurrent.futures.Future`, `call_soon` hands over a plain callback.

A coroutine started here runs to its end on the loop even if the thread that
waits for it gives up: tiers write into and read from the engine's memory, and
only the loop knows when that has stopped. At shutdown `settle` gives the tasks
in flight a grace period, then cancels and awaits the rest.

`engine_config` reads the two keys every integration takes from its engine's
plug-in config, `"tier"` and `"limits"`, with the same checks and errors; `start_tier`
makes and starts a tier the way every integration does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Collection, Coroutine, Mapping
from typing import Any, TypeVar

from ..errors import ClosedError, ConfigError
from ..factory import SecondaryTierFactory
from ..spec import LIMIT_FIELDS, OffloadingSpec
from ..tier import SecondaryTierManager

__all__ = ["LoopThread", "engine_config", "settle", "start_tier"]

T = TypeVar("T")


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """An event loop running on a daemon thread named `name`, started at once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop = _new_loop()
        self._lock = threading.Lock()  # orders submissions against stop()
        self._stopped = False
        #: Tasks begun with `start` that have not ended (loop thread only).
        self.started: set[asyncio.Task[Any]] = set()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `work` on the loop; its future, for any thread. Raises `ClosedError` once stopped."""
        with self._lock:
            if self._stopped:
                work.close()  # never started: no "coroutine was never awaited" warning
                raise ClosedError(f"{self.name}: the event-loop thread is stopped")
            return asyncio.run_coroutine_threadsafe(work, self.loop)

    def call(self, work: Coroutine[Any, Any, T]) -> T:
        """Run `work` on the loop and wait for its result (or exception) on this thread."""
        if threading.current_thread() is self._thread:
            work.close()
            raise RuntimeError(f"{self.name}: call() from the loop's own thread would wait forever")
        return self.submit(work).result()

    def start(
        self, work: Coroutine[Any, Any, T], done: Callable[[asyncio.Task[T]], object] | None = None
    ) -> None:
        """Start `work` as a task on the loop, soon, from any thread; `done(task)` runs on the loop
        once it has ended. Until then the task is in `started`, so that a shutdown can settle
        what is still running. Once stopped, `work` is dropped unrun."""
        with self._lock:
            if self._stopped:
                work.close()  # never started: no "coroutine was never awaited" warning
                return
            self.loop.call_soon_threadsafe(self._create_task, work, done)

    def _create_task(
        self, work: Coroutine[Any, Any, T], done: Callable[[asyncio.Task[T]], object] | None
    ) -> None:
        task = self.loop.create_task(work)
        self.started.add(task)
        task.add_done_callback(self.started.discard)
        if done is not None:
            task.add_done_callback(done)

    def call_soon(self, callback: Callable[..., object], *args: Any) -> None:
        """Run `callback(*args)` on the loop thread, soon; ignored once stopped."""
        with self._lock:
            if not self._stopped:
                self.loop.call_soon_threadsafe(callback, *args)

    def finish(self, last: Coroutine[Any, Any, Any]) -> None:
        """Run `last` on the loop (the integration's own shutdown: its tasks settled, its tiers
        closed) and wait for it, then stop, whatever `last` raised. If the loop has already
        stopped, `last` is dropped unrun."""
        try:
            if self.running:
                self.call(last)
            else:
                last.close()
        finally:
            self.stop()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def stop(self) -> None:
        """Stop the loop after what it is running now, join the thread, close the loop. Idempotent.

        Tasks still pending are dropped with the loop: callers finish or cancel their own work
        (with `call`) before they stop the thread."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        on_loop_thread = threading.current_thread() is self._thread
        if self._thread.is_alive() and not on_loop_thread:
            # The loop's default executor (run_in_executor(None, ...)) has threads of its own.
            with contextlib.suppress(RuntimeError):
                asyncio.run_coroutine_threadsafe(self.loop.shutdown_default_executor(), self.loop).result()
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if not on_loop_thread:
            self._thread.join()
            self.loop.close()


async def settle(tasks: Collection[asyncio.Task[Any]], grace_s: float) -> int:
    """Let `tasks` finish within `grace_s`, cancel those still running, and wait for them to end
    (their I/O may touch the engine's memory until then). Returns how many were cancelled."""
    if not tasks:
        return 0
    _, running = await asyncio.wait(set(tasks), timeout=grace_s)
    for task in running:
        task.cancel()
    if running:
        await asyncio.wait(running)
    return len(running)


def engine_config(who: str, where: str, params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The kvtier tier config (`"tier"`) and scheduler sizing (`"limits"`) an engine's plug-in config
    holds, checked the same way for every integration: `who` names the integration and `where`
    the engine's field, in the errors. An unknown tier type, or one whose module is not
    installed, raises here, while the engine starts."""
    tier = params.get("tier")
    if not isinstance(tier, Mapping) or not isinstance(tier.get("type"), str):
        raise ConfigError(
            f'{who}: {where} needs a kvtier tier config under "tier", '
            'e.g. "tier": {"type": "fs", "root": "/nvme/kv"}'
        )
    limits = params.get("limits") or {}
    if not isinstance(limits, Mapping) or set(limits) - set(LIMIT_FIELDS):
        raise ConfigError(f'{who}: "limits" must be a dict of {sorted(LIMIT_FIELDS)}, got {limits!r}')
    SecondaryTierFactory.get_tier_class(tier["type"], tier.get("module_path"))
    return dict(tier), dict(limits)


async def start_tier(
    config: Mapping[str, Any], primary_kv_view: memoryview, spec: OffloadingSpec
) -> SecondaryTierManager:
    """The tier `config` names over `primary_kv_view`, started as `async with tier:` starts one
    (on the loop): a configuration that can never work (a root others may write, a bucket that
    does not exist) raises its `ConfigError`, the tier closed, so that the engine's start-up
    stops with the message; a fault that may pass (a server down, a full disk) is counted and
    logged, and the tier's calls read as misses and failed stores until an opening succeeds.
    The tier is made on a worker thread: a constructor reads files (`secret_file`,
    `password_file`), which the loop, shared by every engine thread's calls, must not wait for."""
    tier = await asyncio.to_thread(SecondaryTierFactory.create_secondary_tier, config, primary_kv_view, spec)
    return await tier.__aenter__()  # closes the tier if it raises
