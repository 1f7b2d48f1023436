"""`WorkerThreads`: bounded worker threads for blocking work, all started before the first job.

`concurrent.futures.ThreadPoolExecutor` starts its threads lazily, inside
`submit()`, and `Thread.start()` waits until the new thread has run and taken
the GIL. Called from the event loop while the other workers keep the CPUs and
the GIL busy, that wait held the loop for up to 200 ms (`bench/loop_lag.py`).
Here every thread is started once, from a helper thread, and awaited from the
loop; after that, submitting only queues.

The threads also run at a lower CPU priority (nice +10) than the loop: their
work is bulk (copies, checksums, O_DIRECT set-up), and on a machine with few
cores the loop otherwise waits behind them for a CPU, and for the GIL they
take back after each call. And they ask for a long CPU slice: Linux (>= 6.12,
EEVDF) lets a waking thread preempt a running one at once only if its slice is
the shorter; otherwise the running worker keeps the CPU to the end of its slice
(1.4 ms on 2 cores) while the loop waits to run.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import platform
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from .errors import ClosedError, InvalidArgumentError

__all__ = ["WorkerThreads", "wait_uncancellable"]

T = TypeVar("T")
A = TypeVar("A")

#: How much nicer than the event loop the worker threads are (Linux: per thread).
WORKER_NICENESS = 10

#: The CPU slice a worker thread asks for (Linux >= 6.12; older kernels ignore it). Longer than the
#: kernel's default slice (0.7 ms times 1 + log2 of the CPU count, up to 2.8 ms) that the loop thread
#: runs with, so the loop can preempt a busy worker the moment it wakes. `bench/loop_lag.py`, 11
#: interleaved runs each on 2 cores: cold-load lag p99 0.79-1.53 ms with it, 1.03-3.84 ms without.
WORKER_SLICE_NS = 10_000_000

# sched_setattr(2), which sets a thread's nice value and slice in one call; os has no wrapper.
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}.get(platform.machine())
_SCHED_ATTR = struct.Struct("IIQiIQQQ")  # struct sched_attr, first version: size, policy, flags, nice, ...


async def wait_uncancellable(future: asyncio.Future[T]) -> T:
    """Await `future` to the end even if we are cancelled meanwhile; then re-raise the cancel.

    Used where a worker thread reads or writes a buffer the caller owns: the
    call must not return (cancelled or not) while the thread still touches it.
    """
    cancelled: asyncio.CancelledError | None = None
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError as exc:
            # Ours, unless the work itself was cancelled (then future.result() raises it below).
            # Kept even if the work has just finished: a cancelled call must raise, always.
            if not future.cancelled():
                cancelled = exc
        except BaseException:
            pass  # the work's own error: future.result() below raises it
    if cancelled is not None:
        if not future.cancelled():
            future.exception()  # retrieved, so asyncio does not warn about it
        raise cancelled
    return future.result()


class WorkerThreads:
    """`threads` worker threads named `<name>_<n>`, used from one event loop."""

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise InvalidArgumentError(f"WorkerThreads needs at least one thread, got {threads}")
        self.threads = threads
        self.name = name
        self._executor: ThreadPoolExecutor | None = None
        self._starting: asyncio.Future[ThreadPoolExecutor] | None = None
        self._closed = False

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on a worker thread; returns (or raises) only once it has finished."""
        executor = self._executor or await self.start()
        return await wait_uncancellable(asyncio.wrap_future(executor.submit(fn, *args)))

    async def run_each(self, fn: Callable[[A], T], items: Sequence[A]) -> list[T]:
        """`fn(item)` for each item, all queued at once and in order (each on whichever thread
        is free); their results, once every one has finished, even if we are cancelled
        meanwhile (then the cancel is re-raised), or the first one's error."""
        executor = self._executor or await self.start()
        futures: list[asyncio.Future[T]] = []
        refused: BaseException | None = None
        for item in items:
            try:
                futures.append(asyncio.wrap_future(executor.submit(fn, item)))
            except BaseException as exc:  # closed meanwhile: what was queued still runs
                refused = exc
                break
        outcomes = await wait_uncancellable(asyncio.gather(*futures, return_exceptions=True))
        results: list[T] = []
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
            results.append(outcome)
        if refused is not None:
            raise refused
        return results

    async def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue `fn(*args)` on a worker thread and return at once, for another thread to wait
        on. The caller sees the future to its end before it lets go of what `fn` reads."""
        executor = self._executor or await self.start()
        return executor.submit(fn, *args)

    async def start(self) -> ThreadPoolExecutor:
        """Start the threads now, if not yet started (the first `run` otherwise does)."""
        if self._executor is not None:
            return self._executor
        if self._closed:
            raise ClosedError(f"worker threads {self.name!r} are closed")
        if self._starting is None:
            loop = asyncio.get_running_loop()
            self._starting = loop.run_in_executor(None, _started_executor, self.threads, self.name)
        starting = self._starting
        try:
            # Shielded: a caller cancelled here leaves the start to finish for the others.
            executor = await asyncio.shield(starting)
        except Exception:
            if self._starting is starting:
                self._starting = None  # the next call tries again
            raise
        if self._closed:  # closed while starting: nobody else will shut these down
            executor.shutdown(wait=False)
            raise ClosedError(f"worker threads {self.name!r} are closed")
        self._executor = executor
        return executor

    def close(self) -> None:
        """Let the threads exit once their queued work is done; never blocks."""
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None


def _started_executor(threads: int, name: str) -> ThreadPoolExecutor:
    """A ThreadPoolExecutor whose `threads` threads are all running (blocks: call off the loop)."""
    executor = ThreadPoolExecutor(threads, thread_name_prefix=name)
    # Each job holds its thread until all have arrived, so each submit starts a new thread.
    barrier = threading.Barrier(threads)

    def settle() -> None:
        _lower_priority()
        with contextlib.suppress(threading.BrokenBarrierError):  # a sibling failed to start
            barrier.wait()

    jobs = []
    try:
        for _ in range(threads):
            jobs.append(executor.submit(settle))  # raises if no thread can start (interpreter exit)
    except BaseException:
        barrier.abort()  # the threads already started stop waiting for the rest
        executor.shutdown(wait=False)
        raise
    for job in wait(jobs).done:
        job.result()
    return executor


def _lower_priority() -> None:
    """Make the calling thread WORKER_NICENESS nicer, with a WORKER_SLICE_NS slice where it can.

    A no-op where threads have no priority of their own.
    """
    if not sys.platform.startswith("linux"):
        return  # elsewhere PRIO_PROCESS with a thread id would renice the whole process
    tid = threading.get_native_id()
    try:
        nice = min(19, os.getpriority(os.PRIO_PROCESS, tid) + WORKER_NICENESS)
        if not _set_nice_and_slice(tid, nice, WORKER_SLICE_NS):
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        pass  # a sandbox without setpriority: run at the loop's priority


def _set_nice_and_slice(tid: int, nice: int, slice_ns: int) -> bool:
    """sched_setattr(2) for a thread under the default (or batch) policy; False if it cannot be used.

    Real-time threads keep their policy: the slice only means something to the fair scheduler.
    """
    if _SCHED_SETATTR is None:
        return False
    try:
        policy = os.sched_getscheduler(tid)
    except OSError:
        return False
    if policy not in (os.SCHED_OTHER, os.SCHED_BATCH):
        return False
    attr = _SCHED_ATTR.pack(_SCHED_ATTR.size, policy, 0, nice, 0, slice_ns, 0, 0)
    libc = ctypes.CDLL(None, use_errno=True)
    result: int = libc.syscall(_SCHED_SETATTR, tid, ctypes.create_string_buffer(attr, len(attr)), 0)
    # Refused (e.g. by a seccomp filter) is no error: the caller falls back to setpriority.
    return result == 0
