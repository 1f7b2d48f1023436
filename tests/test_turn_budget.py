"""`TurnBudget`: calls started in one turn of the loop share a slice of it, the rest go on later."""

from __future__ import annotations

import asyncio

import pytest

from kvtier_async.turn_budget import TurnBudget


@pytest.mark.asyncio
async def test_calls_past_the_budget_go_on_in_later_turns_in_order() -> None:
    budget = TurnBudget(seconds=0.0)  # spent by the first call of each turn
    entered: list[int] = []

    async def call(n: int) -> None:
        await budget.enter()
        entered.append(n)

    tasks = [asyncio.ensure_future(call(n)) for n in range(20)]
    seen = []
    while len(entered) < 20:
        await asyncio.sleep(0)  # one turn of the loop
        seen.append(len(entered))
    await asyncio.gather(*tasks)
    assert entered == list(range(20))  # first come, first served
    assert all(b - a <= 1 for a, b in zip([0, *seen], seen))  # at most one call a turn


@pytest.mark.asyncio
async def test_calls_within_the_budget_do_not_yield() -> None:
    budget = TurnBudget(seconds=3600.0)
    entered: list[int] = []

    async def call(n: int) -> None:
        await budget.enter()
        entered.append(n)

    tasks = [asyncio.ensure_future(call(n)) for n in range(20)]
    await asyncio.sleep(0)  # the turn in which they all start
    assert entered == list(range(20))
    await asyncio.gather(*tasks)
