"""FaultLog's logic, on a clock the test moves (the Redis and fs tests show it on real faults)."""

from __future__ import annotations

import logging

import pytest

from kvtier_async.fault_log import FaultLog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_each_kind_is_logged_once_per_interval_then_with_the_count(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    clock = Clock()
    faults = FaultLog(logging.getLogger("faults"), interval_s=60.0, clock=clock)
    for _ in range(500):
        faults.warning("store", "store failed: %s", "refused")
    faults.warning("load", "load failed")  # another kind is not held back by the first
    assert [r.getMessage() for r in caplog.records] == ["store failed: refused", "load failed"]
    clock.now += 59.0
    faults.warning("store", "store failed: %s", "refused")
    assert len(caplog.records) == 2
    clock.now += 1.0
    faults.warning("store", "store failed: %s", "refused")
    assert caplog.records[-1].getMessage() == (
        "store failed: refused (and 500 more like it in the last 60 s, not logged)"
    )
    clock.now += 600.0
    faults.error("store", "store failed: %s", "refused")  # nothing held back since: no count
    assert caplog.records[-1].getMessage() == "store failed: refused"
    assert caplog.records[-1].levelno == logging.ERROR


def test_the_traceback_goes_with_the_logged_record(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    faults = FaultLog(logging.getLogger("faults"), clock=Clock())
    try:
        raise ConnectionRefusedError("no server")
    except ConnectionRefusedError:
        faults.warning("open", "opening failed", exc_info=True)
        faults.warning("open", "opening failed", exc_info=True)
    (record,) = caplog.records
    assert record.exc_info is not None and record.exc_info[0] is ConnectionRefusedError


def test_a_record_keeps_the_text_of_an_error_not_the_error(caplog: pytest.LogCaptureFixture) -> None:
    # A handler that keeps records (caplog here, a MemoryHandler) would otherwise keep the
    # error's traceback and every frame's locals behind it: views of memory vLLM must unmap.
    caplog.set_level(logging.WARNING)
    faults = FaultLog(logging.getLogger("faults"), clock=Clock())
    try:
        raise FileNotFoundError(2, "No such file or directory")
    except FileNotFoundError as exc:
        faults.warning("compact", "compacting a log failed: %s", exc)
    (record,) = caplog.records
    assert record.getMessage() == "compacting a log failed: [Errno 2] No such file or directory"
    assert not any(isinstance(arg, BaseException) for arg in record.args or ())
