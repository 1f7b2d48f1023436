"""`LoopLag`: a stall of the loop shows as a late tick, unless the harness paused the count for it."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable

import pytest

from kvtier_async import measure
from kvtier_async.measure import LoopLag, taking_turns

#: How far the patched clock jumps: a "stall" no real tick comes near.
JUMP_S = 1000.0


@pytest.fixture
def jump(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Call it to move LoopLag's clock JUMP_S ahead, as if the loop had stalled that long."""
    offset = [0.0]
    real = time.perf_counter
    monkeypatch.setattr(measure.time, "perf_counter", lambda: real() + offset[0])

    def forward() -> None:
        offset[0] += JUMP_S

    return forward


async def _counted(lag: LoopLag, more: int) -> None:
    """Wait until `more` further ticks have been counted."""
    until = len(lag.lags) + more
    while len(lag.lags) < until:  # noqa: ASYNC110  the ticker appends: no event to wait on
        await asyncio.sleep(lag.period)


@pytest.mark.asyncio
async def test_a_stall_shows_as_a_late_tick(jump: Callable[[], None]) -> None:
    with LoopLag() as lag:
        await _counted(lag, 2)
        jump()
        await _counted(lag, 2)
    assert max(lag.lags) >= JUMP_S
    assert lag.summary()["max_ms"] >= JUMP_S * 1e3


@pytest.mark.asyncio
async def test_a_tick_that_overlaps_a_pause_is_not_counted(jump: Callable[[], None]) -> None:
    with LoopLag() as lag:
        await _counted(lag, 2)
        with lag.paused():
            jump()
        await _counted(lag, 2)  # ticks after the pause count again
        with lag.paused(), lag.paused():  # pauses nest
            pass
        await _counted(lag, 1)
    assert len(lag.lags) >= 5
    assert max(lag.lags) < JUMP_S
    assert len(lag.cpu_waits) == len(lag.woke) == len(lag.lags)


@pytest.mark.asyncio
async def test_a_full_collection_in_a_pause_is_not_counted() -> None:
    with LoopLag() as lag:
        with lag.paused():
            gc.collect()
        in_pause = len(lag.full_gc_pauses)
        gc.collect()
    assert in_pause == 0
    assert len(lag.full_gc_pauses) >= 1


def test_taking_turns_puts_each_side_first_in_turn() -> None:
    sides = ["a", "b", "c"]
    assert [taking_turns(sides, r) for r in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]
    assert sides == ["a", "b", "c"]  # left as it was
