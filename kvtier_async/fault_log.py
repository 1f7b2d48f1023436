"""Logging for faults that repeat: each kind in full once, then at most once per interval.

A tier whose server is down fails every call. Logged each time with its traceback, that was
3,000 records and 12 MB of text in 3 s against a closed Redis port, formatted on the event-loop
thread of a server that is busy enough already. The `stats()` counters still count every fault;
the log says what kind of fault it is, and how many more there were.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable

DEFAULT_INTERVAL_S = 60.0

ExcInfo = bool | BaseException | None


class FaultLog:
    """Logs the first fault of each kind as it comes; later ones of that kind within `interval_s`
    of the last one logged are counted, and the next one logged says how many were not.

    Safe to call from any thread (worker threads log I/O faults).
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._logged_at: dict[Hashable, float] = {}
        self._unlogged: dict[Hashable, int] = {}

    def warning(self, kind: Hashable, msg: str, *args: object, exc_info: ExcInfo = None) -> None:
        self.log(logging.WARNING, kind, msg, *args, exc_info=exc_info)

    def error(self, kind: Hashable, msg: str, *args: object, exc_info: ExcInfo = None) -> None:
        self.log(logging.ERROR, kind, msg, *args, exc_info=exc_info)

    def log(self, level: int, kind: Hashable, msg: str, *args: object, exc_info: ExcInfo = None) -> None:
        """`logger.log(level, msg, *args)`, unless a fault of `kind` was logged under `interval_s` ago."""
        now = self._clock()
        with self._lock:
            last = self._logged_at.get(kind)
            if last is not None and now - last < self._interval_s:
                self._unlogged[kind] = self._unlogged.get(kind, 0) + 1
                return
            self._logged_at[kind] = now
            unlogged = self._unlogged.pop(kind, 0)
        # An error is passed on as its text: a handler that keeps records (pytest's caplog, a
        # MemoryHandler) would otherwise keep its traceback, and through the frames' callers the
        # views of the primary memory they held, which vLLM must be able to unmap.
        args = tuple(str(arg) if isinstance(arg, BaseException) else arg for arg in args)
        if unlogged and last is not None:
            msg += " (and %d more like it in the last %.0f s, not logged)"
            args = (*args, unlogged, now - last)
        self._logger.log(level, msg, *args, exc_info=exc_info)
