"""`LoopThread`: engine threads reaching kvtier's event loop (the bridge every integration uses)."""

from __future__ import annotations

import asyncio
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

from kvtier_async.errors import ClosedError
from kvtier_async.integrations.bridge import LoopThread


async def where_am_i() -> str:
    await asyncio.sleep(0)
    return threading.current_thread().name


async def fail() -> None:
    raise ValueError("from the loop")


def test_call_runs_on_the_loop_thread_and_returns_or_raises() -> None:
    bridge = LoopThread("kvtier-test-bridge")
    try:
        assert bridge.call(where_am_i()) == "kvtier-test-bridge"
        with pytest.raises(ValueError, match="from the loop"):
            bridge.call(fail())
    finally:
        bridge.stop()


def test_many_threads_call_at_once_and_each_gets_its_own_answer() -> None:
    bridge = LoopThread("kvtier-test-bridge")
    results: dict[int, int] = {}

    async def double(n: int) -> int:
        await asyncio.sleep(0)
        return 2 * n

    def caller(n: int) -> None:
        for i in range(50):
            assert bridge.call(double(n * 1000 + i)) == 2 * (n * 1000 + i)
        results[n] = n

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(8)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        bridge.stop()
    assert sorted(results) == list(range(8))


def test_call_from_the_loop_thread_refuses_instead_of_deadlocking() -> None:
    bridge = LoopThread("kvtier-test-bridge")

    async def nested() -> None:
        bridge.call(where_am_i())

    try:
        with pytest.raises(RuntimeError, match="wait forever"):
            bridge.call(nested())
    finally:
        bridge.stop()


def test_stop_joins_the_thread_and_later_work_is_refused_cleanly() -> None:
    bridge = LoopThread("kvtier-test-bridge")
    bridge.stop()
    bridge.stop()  # idempotent
    assert not bridge.running
    assert "kvtier-test-bridge" not in {t.name for t in threading.enumerate()}
    assert bridge.loop.is_closed()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a coroutine left un-awaited would warn
        with pytest.raises(ClosedError):
            bridge.call(where_am_i())
        bridge.call_soon(print, "never")  # ignored, not an error


def test_start_runs_work_on_the_loop_and_tells_done_once_it_has_ended() -> None:
    # From an engine thread: the task runs on the loop, stays in `started` until it has
    # ended, and `done` hears of it on the loop thread, after it has left `started`.
    bridge = LoopThread("kvtier-test-bridge")
    release = threading.Event()
    ended = threading.Event()
    seen: list[object] = []

    async def job() -> str:
        await asyncio.to_thread(release.wait, 60)
        return threading.current_thread().name

    def done(task: asyncio.Task[str]) -> None:
        seen.extend([task.result(), threading.current_thread().name, task in bridge.started])
        ended.set()

    try:
        bridge.start(job(), done)
        bridge.start(where_am_i())  # no `done`: just run

        async def running() -> int:  # on the loop, after the two starts (its queue is in order)
            return len(bridge.started)

        assert bridge.call(running()) >= 1  # the job has not ended
        release.set()
        assert ended.wait(60)
        assert seen == ["kvtier-test-bridge", "kvtier-test-bridge", False]
    finally:
        release.set()  # a failed assertion must not leave the job holding up stop()
        bridge.stop()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a coroutine left un-awaited would warn
        bridge.start(where_am_i())  # dropped once stopped, not an error


def test_settle_lets_tasks_finish_then_cancels_and_awaits_the_rest() -> None:
    from kvtier_async.integrations.bridge import settle

    async def scenario() -> tuple[int, list[str]]:
        done: list[str] = []
        release = asyncio.Event()

        async def quick() -> None:
            done.append("quick")

        async def stuck() -> None:
            try:
                await release.wait()
            finally:
                done.append("stuck ended")

        tasks = [asyncio.ensure_future(quick()), asyncio.ensure_future(stuck())]
        cancelled = await settle(tasks, grace_s=0.05)
        return cancelled, done

    cancelled, done = asyncio.run(scenario())
    assert cancelled == 1 and done == ["quick", "stuck ended"]  # the cancelled one has ended too


def test_engine_config_checks_tier_and_limits_the_same_way_for_every_engine() -> None:
    from kvtier_async.errors import ConfigError, UnknownTierError
    from kvtier_async.integrations.bridge import engine_config

    tier, limits = engine_config("x", "params", {"tier": {"type": "memory"}, "limits": {"io_threads": 2}})
    assert tier == {"type": "memory"} and limits == {"io_threads": 2}
    with pytest.raises(ConfigError, match='params needs a kvtier tier config under "tier"'):
        engine_config("x", "params", {})
    with pytest.raises(ConfigError, match='"limits"'):
        engine_config("x", "params", {"tier": {"type": "memory"}, "limits": {"threads": 2}})
    with pytest.raises(UnknownTierError):
        engine_config("x", "params", {"tier": {"type": "nvme"}})


def test_finish_runs_the_last_work_then_stops_even_when_it_fails() -> None:
    bridge = LoopThread("kvtier-test-bridge")
    with pytest.raises(ValueError, match="from the loop"):
        bridge.finish(fail())
    assert not bridge.running and bridge.loop.is_closed()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a stopped bridge drops the work without running it
        bridge.finish(where_am_i())


def test_start_tier_makes_the_tier_off_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier's constructor reads files (its `secret_file`, a `password_file`): `start_tier`
    runs it on a worker thread, so the loop every engine thread's calls wait on never waits
    for a file. (The blocking-call detector cannot see these reads: the private-file path
    opens with O_NONBLOCK, which a regular file ignores.)"""
    import kvtier_async as kt
    from kvtier_async import secret
    from kvtier_async.integrations.bridge import start_tier

    read_on: list[threading.Thread] = []
    real_load = secret.load_private_value

    def load_private_value(*args: Any, **kwargs: Any) -> Any:
        read_on.append(threading.current_thread())
        return real_load(*args, **kwargs)

    monkeypatch.setattr(secret, "load_private_value", load_private_value)
    secret_file = tmp_path / "secret"
    secret_file.write_text(secret.new_secret())
    secret_file.chmod(0o600)
    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=4, namespace="bridge-test")
    primary = kt.PrimaryTier(spec, pin_memory=False)
    config = {"type": "fs", "root": str(tmp_path / "root"), "secret_file": str(secret_file)}

    async def scenario() -> bool:
        tier = await start_tier(config, primary.view, spec)
        try:
            return bool(tier.stats()["sealed"])
        finally:
            await tier.aclose()

    assert asyncio.run(scenario()) is True
    assert read_on and threading.main_thread() not in read_on  # asyncio.run's loop: this thread
