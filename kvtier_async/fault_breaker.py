"""Stop calling a backend that keeps failing, for a while: a server that is down costs a load
nothing, instead of a timeout each.

A tier whose server has died or hangs fails every call, and each failure can take the whole
`timeout_s` (a stuck Redis or S3 server) or several retries (obstore backs off between them).
Loads are on a request's critical path, so after `streak` faults in a row the breaker opens:
calls fail at once (a miss, a store not made, counted) for `cooldown_s`. Then one call is let
through as a probe; while it runs the others still fail at once. A probe that succeeds closes
the breaker; one that fails opens it again for twice as long, up to `max_cooldown_s`.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable

DEFAULT_STREAK = 5
DEFAULT_COOLDOWN_S = 1.0
DEFAULT_MAX_COOLDOWN_S = 10.0


class Pass(enum.Enum):
    """How a call went through: as usual, or as the probe after a cool-down."""

    CALL = "call"
    PROBE = "probe"


class FaultBreaker:
    """Counts faults in a row and says whether a call may go to the backend now."""

    def __init__(
        self,
        streak: int = DEFAULT_STREAK,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        max_cooldown_s: float = DEFAULT_MAX_COOLDOWN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.streak = streak
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.clock = clock
        self._lock = threading.Lock()  # `stats()` may be read from another thread
        self._faults = 0  # in a row, since the last success
        self._open_until: float | None = None  # None: closed
        self._next_cooldown_s = cooldown_s
        self._probing = False

    def enter(self) -> Pass | None:
        """Whether a call may go to the backend now: None if not; `PROBE` once after a cool-down.
        The caller then reports `succeeded`, `failed` or, if it got no answer (cancelled), `left`."""
        with self._lock:
            if self._open_until is None:
                return Pass.CALL
            if self._probing or self.clock() < self._open_until:
                return None
            self._probing = True
            return Pass.PROBE

    def succeeded(self) -> None:
        with self._lock:
            self._faults = 0
            self._open_until = None
            self._next_cooldown_s = self.cooldown_s
            self._probing = False

    def failed(self, entered: Pass) -> None:
        with self._lock:
            self._faults += 1
            if entered is Pass.PROBE:
                self._probing = False
            # Calls that were in flight when the breaker opened fail too: they must not
            # lengthen the cool-down, only a probe's failure does.
            if self._faults >= self.streak and (self._open_until is None or entered is Pass.PROBE):
                self._open_until = self.clock() + self._next_cooldown_s
                self._next_cooldown_s = min(2 * self._next_cooldown_s, self.max_cooldown_s)

    def left(self, entered: Pass) -> None:
        """A call that went through got no answer: if it was the probe, the next call probes."""
        if entered is Pass.PROBE:
            with self._lock:
                self._probing = False

    def state(self) -> str:
        """Its state for `stats()`: "closed", "open" (cooling down) or "probing"."""
        with self._lock:
            if self._open_until is None:
                return "closed"
            return "probing" if self._probing or self.clock() >= self._open_until else "open"
