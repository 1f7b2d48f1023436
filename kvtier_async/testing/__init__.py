"""The tier contract as a reusable pytest suite: subclass `TierContractTests`.

The suite lives in `contract` and `blocks_by_view`, registered here for pytest's assertion
rewriting before they are imported, so that a failing check in a user's test run shows the
values it compared, not a bare AssertionError (pytest rewrites only test modules, conftest
files and what is registered).
"""

import pytest

pytest.register_assert_rewrite("kvtier_async.testing.contract", "kvtier_async.testing.blocks_by_view")

from .contract import TierContractTests, make_key  # noqa: E402  (after the registration)
from .loop_hold import LoopHold  # noqa: E402

__all__ = ["LoopHold", "TierContractTests", "make_key"]
