"""The blocking-call detector is live in async tests: a blocking call on the loop fails them."""

from __future__ import annotations

import time

import pytest
from blockbuster import BlockingError


@pytest.mark.asyncio
async def test_sleep_on_the_loop_is_caught() -> None:
    with pytest.raises(BlockingError):
        time.sleep(0.001)  # noqa: ASYNC251 - the point of the test


@pytest.mark.asyncio
async def test_file_io_on_the_loop_is_caught(tmp_path: object) -> None:
    with pytest.raises(BlockingError):
        open(__file__).read()  # noqa: ASYNC230, SIM115
