from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import probe_tier
import pytest
from child_env import child_env

from kvtier_async.testing import TierContractTests


class TestMemoryTier(TierContractTests):
    @pytest.fixture
    def tier_config(self) -> dict[str, Any]:
        return {"type": "memory"}


@pytest.mark.asyncio
async def test_stores_beyond_the_pending_budget_are_dropped() -> None:
    import asyncio

    import kvtier_async as kt
    from kvtier_async.testing import make_key

    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=16, max_pending_stores=4)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    config = {"type": "ProbeTier", "module_path": "probe_tier"}
    async with kt.SecondaryTierFactory.create_secondary_tier(config, primary.view, spec) as tier:
        assert isinstance(tier, probe_tier.ProbeTier)
        keys = [make_key(i) for i in range(10)]
        tier.gates["contains"].clear()  # the first call holds its budget until the test lets it on
        first = asyncio.ensure_future(tier.store(keys[:6], list(range(6))))
        await tier.until(lambda: tier.held["contains"] == 1)
        assert await tier.store(keys[6:], list(range(6, 10))) == [False] * 4  # the budget is taken
        tier.gates["contains"].set()
        assert await first == [True] * 4 + [False] * 2  # the excess of a call is dropped at once
        assert tier.stats()["stores_dropped"] == 6
        assert tier.stats()["lanes"]["store"]["pending_blocks"] == 0
        assert await tier.store(keys[6:], list(range(6, 10))) == [True] * 4  # budget back


@pytest.mark.asyncio
async def test_held_blocks_are_passed_over_by_eviction_until_released() -> None:
    import kvtier_async as kt
    from kvtier_async.testing import make_key

    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=8)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    tier = kt.SecondaryTierFactory.create_secondary_tier(
        {"type": "memory", "capacity_bytes": 2 * 4096}, primary.view, spec
    )
    async with tier:
        a, b, c, d = (make_key(i) for i in range(4))
        assert await tier.store([a, b], [0, 1]) == [True, True]
        assert tier.hold([a, c]) == [True, False]
        assert await tier.store([c], [2]) == [True]  # evicts b, the oldest not held
        assert await tier.contains([a, b, c]) == [True, False, True]
        assert tier.hold([c]) == [True]
        assert await tier.store([d], [3]) == [False]  # every block held: no room, nothing lost
        assert await tier.contains([a, c, d]) == [True, True, False]
        tier.release([a])
        assert await tier.store([d], [3]) == [True]  # a goes now
        assert await tier.contains([a, c, d]) == [False, True, True]


@pytest.mark.asyncio
async def test_a_failed_open_is_a_fault_not_an_exception_and_is_retried() -> None:
    import kvtier_async as kt
    from kvtier_async.testing import make_key

    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=4)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    config = {"type": "FlakyOpenTier", "module_path": "probe_tier"}
    tier = kt.SecondaryTierFactory.create_secondary_tier(config, primary.view, spec)
    try:  # not started: the first store opens it
        assert await tier.store([make_key(0)], [0]) == [False]
        stats = tier.stats()
        assert stats["errors"] == 1 and stats["store_failed_blocks"] == 1
        assert stats["lanes"]["store"]["pending_blocks"] == 0
        assert await tier.store([make_key(0)], [0]) == [True]  # opened on the second try
        assert await tier.load([make_key(0)], [1]) == [True]
    finally:
        await tier.aclose()


@pytest.mark.asyncio
async def test_a_failed_open_at_start_is_a_fault_not_an_exception_and_is_retried() -> None:
    import kvtier_async as kt
    from kvtier_async.testing import make_key

    spec = kt.OffloadingSpec(block_nbytes=4096, num_cpu_blocks=4)
    primary = kt.PrimaryTier(spec, pin_memory=False)
    config = {"type": "FlakyOpenTier", "module_path": "probe_tier"}
    # Its first open fails as a server not up yet would: `async with` starts it degraded.
    async with kt.SecondaryTierFactory.create_secondary_tier(config, primary.view, spec) as tier:
        assert isinstance(tier, probe_tier.FlakyOpenTier)
        assert tier.open_attempts == 1 and tier.stats()["errors"] == 1
        assert await tier.store([make_key(0)], [0]) == [True]  # opened by the next call
        assert await tier.load([make_key(0)], [1]) == [True]
        assert tier.open_attempts == 2


FORGETFUL_TIER = """
from kvtier_async.tiers.memory import MemoryTier

class ForgetfulTier(MemoryTier):
    async def contains(self, keys):
        return [False] * len(await super().contains(keys))
"""

FORGETFUL_TESTS = """
import pytest
from kvtier_async.testing import TierContractTests

class TestForgetful(TierContractTests):
    @pytest.fixture
    def tier_config(self):
        return {"type": "ForgetfulTier", "module_path": "forgetful"}
"""


def test_a_failing_contract_check_shows_what_it_compared(tmp_path: Path) -> None:
    """Run in a user's suite, the kit's asserts are rewritten: a failure names the values."""
    (tmp_path / "forgetful.py").write_text(FORGETFUL_TIER)
    (tmp_path / "test_forgetful.py").write_text(FORGETFUL_TESTS)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "missing_keys_are_misses"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=child_env(tmp_path),
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "assert [False, False] == [False, True]" in done.stdout, done.stdout[-3000:]
