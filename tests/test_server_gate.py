"""`ServerGate` and `Coalescer`: the limits a shared tier puts on its own requests, as logic."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

import kvtier_async as kt
from kvtier_async.coalesce import Coalescer
from kvtier_async.scheduler import Priority, current_priority
from kvtier_async.server_gate import QueueTimeout, ServerGate
from kvtier_async.testing import make_key
from kvtier_async.tiers.memory import MemoryTier


class Server:
    """Requests that wait until the test answers them, recording the most at once."""

    def __init__(self) -> None:
        self.waiting: list[tuple[str, asyncio.Future[str]]] = []
        self.inflight = 0
        self.most = 0
        self.arrived: list[str] = []

    async def request(self, name: str) -> str:
        self.inflight += 1
        self.most = max(self.most, self.inflight)
        self.arrived.append(name)
        answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.waiting.append((name, answer))
        try:
            return await answer
        finally:
            self.inflight -= 1

    def answer_all(self) -> None:
        for name, answer in self.waiting:
            if not answer.done():
                answer.set_result(name)
        self.waiting.clear()


async def settle() -> None:
    """Let every ready task run until none is left to run (no timing involved)."""
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_excess_requests_wait_their_turn_instead_of_failing() -> None:
    gate, server = ServerGate("test", 3, timeout_s=60), Server()
    calls = [asyncio.ensure_future(gate.call(server.request(f"r{i}"))) for i in range(10)]
    await settle()
    assert server.inflight == 3 and gate.stats()["queued"] == 7
    while server.waiting:
        server.answer_all()
        await settle()
    assert [await c for c in calls] == [f"r{i}" for i in range(10)]
    assert server.most == 3
    assert server.arrived == [f"r{i}" for i in range(10)]  # in order
    assert gate.stats()["inflight"] == 0


@pytest.mark.asyncio
async def test_loads_go_before_queued_stores() -> None:
    gate, server = ServerGate("test", 1, timeout_s=60), Server()

    async def call(name: str, priority: Priority) -> str:
        current_priority.set(priority)  # as SecondaryTierManager sets it around a hook
        return await gate.call(server.request(name))

    first = asyncio.ensure_future(call("first", Priority.STORE))
    await settle()
    later = [asyncio.ensure_future(call(f"store{i}", Priority.STORE)) for i in range(3)]
    await settle()
    load = asyncio.ensure_future(call("load", Priority.LOAD))
    await settle()
    while server.waiting:
        server.answer_all()
        await settle()
    await asyncio.gather(first, load, *later)
    assert server.arrived == ["first", "load", "store0", "store1", "store2"]


@pytest.mark.asyncio
async def test_a_request_that_never_got_a_place_is_a_queue_timeout() -> None:
    gate, server = ServerGate("test", 1, timeout_s=60), Server()
    holder = asyncio.ensure_future(gate.call(server.request("holder")))
    await settle()
    gate.timeout_s = 0.05  # for the calls from now on: the holder keeps its place
    waiting = server.request("never sent")
    with pytest.raises(QueueTimeout):
        await gate.call(waiting)
    assert server.arrived == ["holder"]  # the waiting request never reached the server
    assert waiting.cr_frame is None  # and was closed, not left un-awaited
    assert gate.stats()["queued"] == 0
    holder.cancel()
    with pytest.raises(asyncio.CancelledError):
        await holder
    assert gate.stats()["inflight"] == 0
    assert await gate.call(asyncio.sleep(0, "free again")) == "free again"


@pytest.mark.asyncio
async def test_a_request_at_the_server_past_its_deadline_is_a_plain_timeout() -> None:
    gate, server = ServerGate("test", 1, timeout_s=0.05), Server()
    with pytest.raises(TimeoutError) as raised:
        await gate.call(server.request("slow"))
    assert not isinstance(raised.value, QueueTimeout)  # the server's fault, not the gate's
    assert gate.stats()["inflight"] == 0


@pytest.mark.asyncio
async def test_a_cancelled_waiter_passes_its_turn_on() -> None:
    gate, server = ServerGate("test", 1, timeout_s=60), Server()
    first = asyncio.ensure_future(gate.call(server.request("first")))
    await settle()
    gone = asyncio.ensure_future(gate.call(server.request("gone")))
    after = asyncio.ensure_future(gate.call(server.request("after")))
    await settle()
    gone.cancel()
    await settle()
    while server.waiting:
        server.answer_all()
        await settle()
    assert await first == "first" and await after == "after"
    assert server.arrived == ["first", "after"]
    assert gate.stats() | {"waited_s": 0} == {
        "limit": 1,
        "inflight": 0,
        "queued": 0,
        "max_inflight_seen": 1,
        "waited_s": 0,
    }


class Backend:
    """A batched request that records what each call carried."""

    def __init__(self, fail: bool = False) -> None:
        self.requests: list[list[int]] = []
        self.priorities: list[Priority] = []
        self.fail = fail
        self.release = asyncio.Event()

    async def request(self, items: list[int]) -> list[int]:
        self.requests.append(list(items))
        self.priorities.append(current_priority.get())
        await self.release.wait()
        if self.fail:
            raise ConnectionError("server gone")
        return [item * 10 for item in items]


@pytest.mark.asyncio
async def test_calls_of_one_turn_share_one_request_and_get_their_own_answers() -> None:
    backend = Backend()
    coalesce = Coalescer(backend.request, max_items=5)
    calls = [asyncio.ensure_future(coalesce([3 * n, 3 * n + 1, 3 * n + 2])) for n in range(4)]
    await settle()
    backend.release.set()
    assert [await c for c in calls] == [[30 * n, 30 * n + 10, 30 * n + 20] for n in range(4)]
    # Five items at most per request: the calls are not split, so each request holds whole calls.
    assert backend.requests == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    wide = Coalescer(backend.request, max_items=100)
    calls = [asyncio.ensure_future(wide([n])) for n in range(6)]
    assert [await c for c in calls] == [[n * 10] for n in range(6)]
    assert backend.requests[-1] == list(range(6))
    assert (wide.requests, wide.calls) == (1, 6)


@pytest.mark.asyncio
async def test_a_shared_request_runs_at_the_best_priority_and_outlives_a_cancelled_caller() -> None:
    backend = Backend()
    coalesce = Coalescer(backend.request, max_items=100)

    async def call(items: list[int], priority: Priority) -> Any:
        current_priority.set(priority)
        return await coalesce(items)

    store = asyncio.ensure_future(call([1], Priority.STORE))
    load = asyncio.ensure_future(call([2], Priority.LOAD))
    await settle()
    assert backend.priorities == [Priority.LOAD]
    store.cancel()
    await settle()
    backend.release.set()
    assert await load == [20]
    with pytest.raises(asyncio.CancelledError):
        await store


@pytest.mark.asyncio
async def test_a_failed_shared_request_fails_every_caller() -> None:
    backend = Backend(fail=True)
    coalesce = Coalescer(backend.request, max_items=100)
    calls = [asyncio.ensure_future(coalesce([n])) for n in range(3)]
    await settle()
    backend.release.set()
    for call in calls:
        with pytest.raises(ConnectionError):
            await call
    assert await Coalescer(backend.request, max_items=1)([]) == []


class BusyTier(MemoryTier):
    """A memory tier behind a gate of one place that a test holds: every hook waits for it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = ServerGate("busy", 1, timeout_s=0.02)
        self.gate_taken = self.gate._lane.try_admit()  # the test's own request, never answered

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return await self.gate.call(super().contains(keys))

    async def read_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        return await self.gate.call(super().read_blocks(keys, blocks))


@pytest.mark.asyncio
async def test_waiting_for_our_own_limit_is_a_miss_but_no_server_fault() -> None:
    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=8)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    tier = BusyTier(spec, primary.view, "memory")
    assert tier.gate_taken
    async with tier:
        for n in range(3 * tier.fault_breaker.streak):
            assert await tier.lookup([make_key(n)]) == 0
            assert await tier.load([make_key(n)], [0]) == [False]
        stats = tier.stats()
    assert stats["queue_timeouts"] == 6 * tier.fault_breaker.streak
    assert (stats["errors"], stats["calls_skipped_while_down"], stats["fault_breaker"]) == (0, 0, "closed")


class CountingTier(MemoryTier):
    check_held_before_write = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked = 0

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self.asked += 1
        return await super().contains(keys)


@pytest.mark.asyncio
async def test_a_tier_may_write_without_asking_first_what_it_holds() -> None:
    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=8)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    async with CountingTier(spec, primary.view, "memory") as tier:
        keys = [make_key(n) for n in range(4)]
        assert await tier.store(keys, [0, 1, 2, 3]) == [True] * 4
        assert await tier.store(keys, [0, 1, 2, 3]) == [True] * 4  # written again, same bytes
        assert tier.asked == 0
        assert (tier.stats()["stored_blocks"], tier.stats()["stores_deduplicated"]) == (8, 0)
        assert await tier.lookup(keys) == 4 and tier.asked == 1
