from __future__ import annotations

from typing import Any

import pytest

from kvtier_async.testing import TierContractTests


class TestMemoryTier(TierContractTests):
    @pytest.fixture
    def tier_config(self) -> dict[str, Any]:
        return {"type": "memory"}
