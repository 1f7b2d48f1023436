"""`WorkerThreads`: every thread runs before the first job, so submitting never starts one."""

from __future__ import annotations

import asyncio
import ctypes
import os
import platform
import sys
import threading

import pytest

from kvtier_async.errors import ClosedError
from kvtier_async.workers import _SCHED_ATTR, WORKER_NICENESS, WORKER_SLICE_NS, WorkerThreads


async def _loop_turns(n: int = 5) -> None:
    """Let the loop run what is ready a few times over (callbacks that chain through futures)."""
    for _ in range(n):
        await asyncio.sleep(0)


def _named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix + "_")]


@pytest.mark.asyncio
async def test_all_threads_run_before_the_first_job() -> None:
    workers = WorkerThreads(3, "kvtier-test-start")
    try:
        # Inside the first job, every thread of the pool already exists.
        assert await workers.run(lambda: len(_named("kvtier-test-start"))) == 3
        idents = await asyncio.gather(*(workers.run(threading.get_ident) for _ in range(50)))
        assert len(_named("kvtier-test-start")) == 3
        assert set(idents) <= {t.ident for t in _named("kvtier-test-start")}
    finally:
        workers.close()


@pytest.mark.asyncio
async def test_concurrent_first_calls_share_one_start_even_if_one_is_cancelled() -> None:
    workers = WorkerThreads(2, "kvtier-test-share")
    try:
        first = asyncio.ensure_future(workers.run(lambda: 1))
        others = [asyncio.ensure_future(workers.run(lambda: 2)) for _ in range(5)]
        await asyncio.sleep(0)
        first.cancel()
        assert await asyncio.gather(*others) == [2] * 5
        with pytest.raises(asyncio.CancelledError):
            await first
        assert len(_named("kvtier-test-share")) == 2
    finally:
        workers.close()


@pytest.mark.asyncio
async def test_errors_come_back_and_closed_pools_refuse_work() -> None:
    workers = WorkerThreads(1, "kvtier-test-errors")

    def fail() -> None:
        raise OSError("disk on fire")

    with pytest.raises(OSError, match="disk on fire"):
        await workers.run(fail)
    assert await workers.run(lambda: "still serving") == "still serving"
    workers.close()
    with pytest.raises(ClosedError):
        await workers.run(lambda: None)


@pytest.mark.asyncio
async def test_run_each_queues_the_jobs_in_order_and_returns_their_results_in_order() -> None:
    workers = WorkerThreads(1, "kvtier-test-each")
    order: list[int] = []

    def job(n: int) -> int:
        order.append(n)
        return n * n

    try:
        assert await workers.run_each(job, range(20)) == [n * n for n in range(20)]
        assert order == list(range(20))  # one thread: run as queued
        assert await workers.run_each(job, []) == []
    finally:
        workers.close()


@pytest.mark.asyncio
async def test_run_each_returns_only_once_every_job_has_finished() -> None:
    # Its jobs write into memory the caller owns: neither an error of one nor a cancel may let
    # the caller go on while another still runs.
    workers = WorkerThreads(1, "kvtier-test-each-wait")  # one thread: job 0 is done when 1 starts
    release, started = threading.Event(), threading.Event()
    finished: list[int] = []

    def job(n: int) -> int:
        if n == 0:
            raise OSError("first job failed")
        started.set()
        release.wait(timeout=60)
        finished.append(n)
        return n

    try:
        failing = asyncio.ensure_future(workers.run_each(job, [0, 1]))
        await asyncio.to_thread(started.wait, 60)
        await _loop_turns()  # job 0's failure has reached the loop
        assert not failing.done(), "returned while a job still ran"
        release.set()
        with pytest.raises(OSError, match="first job failed"):
            await failing
        assert finished == [1]

        release.clear()
        started.clear()
        cancelled = asyncio.ensure_future(workers.run_each(job, [1, 2]))
        await asyncio.to_thread(started.wait, 60)
        cancelled.cancel()
        await _loop_turns()
        assert not cancelled.done(), "a cancel returned while the jobs still ran"
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert sorted(finished) == [1, 1, 2]
    finally:
        workers.close()


@pytest.mark.asyncio
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux only")
@pytest.mark.parametrize("sched_setattr", [True, False], ids=["sched_setattr", "setpriority"])
async def test_workers_yield_the_cpu_to_the_loop(
    sched_setattr: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not sched_setattr:  # as on a machine without the syscall: renicing alone must still happen
        monkeypatch.setattr("kvtier_async.workers._SCHED_SETATTR", None)
    workers = WorkerThreads(2, "kvtier-test-nice")
    try:
        loop_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        worker_nice = await workers.run(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        assert worker_nice == min(19, loop_nice + WORKER_NICENESS)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == loop_nice
    finally:
        workers.close()


def _slice_ns() -> int:
    """The calling thread's CPU slice from sched_getattr(2); 0 where the kernel reports none (< 6.12)."""
    number = {"x86_64": 315, "aarch64": 275}[platform.machine()]
    attr = ctypes.create_string_buffer(_SCHED_ATTR.size)
    libc = ctypes.CDLL(None, use_errno=True)
    done = libc.syscall(number, threading.get_native_id(), attr, _SCHED_ATTR.size, 0)
    assert done == 0, os.strerror(ctypes.get_errno())
    runtime: int = _SCHED_ATTR.unpack_from(attr.raw)[5]
    return runtime


@pytest.mark.asyncio
@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"),
    reason="sched_getattr is read by syscall number",
)
async def test_workers_ask_for_a_longer_slice_than_the_loop() -> None:
    loop_slice = _slice_ns()
    if loop_slice == 0:
        pytest.skip("this kernel has no per-thread CPU slice (Linux < 6.12)")
    workers = WorkerThreads(1, "kvtier-test-slice")
    try:
        assert await workers.run(_slice_ns) == WORKER_SLICE_NS > loop_slice
        assert _slice_ns() == loop_slice
    finally:
        workers.close()


def test_needs_a_thread() -> None:
    with pytest.raises(ValueError, match="at least one thread"):
        WorkerThreads(0, "kvtier-test-none")
