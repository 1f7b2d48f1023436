"""`FaultGuard`: a tier's calls to its backend, each turned into an answer whatever happens.

A hook that raises, or answers something malformed, becomes all-False (misses, failed
stores), counted in `errors` and logged once a minute per kind; the fault breaker hears of
each fault and success, and while it is open the hook is not called at all. Waiting for
our own limit until the deadline (`QueueTimeout`) is all-False too, but no server fault.
Cancellation passes through, and is no answer.
"""

from __future__ import annotations

import inspect
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable

from .errors import ConfigError
from .fault_breaker import FaultBreaker, Pass
from .fault_log import FaultLog
from .scheduler import Priority, current_priority
from .server_gate import QueueTimeout

__all__ = ["FaultGuard"]


def _clear_frames(error: BaseException) -> None:
    """Clear the locals of every finished frame in `error`'s tracebacks, its causes' too."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        pending += [exc.__cause__, exc.__context__]


class FaultGuard:
    """Guards the hook calls of the tier `name`, counting in `counters`."""

    def __init__(self, name: str, counters: Counter[str], breaker: FaultBreaker, fault_log: FaultLog) -> None:
        self.name = name
        self.counters = counters
        self.breaker = breaker
        self.fault_log = fault_log

    async def open(self, opening: Callable[[], Awaitable[None]], *, starting: bool = False) -> bool:
        """Run `opening`; False (counted, logged) if it failed this time.

        A failed open is a backend fault like any other: the operation reports misses or
        failed stores, and the next operation tries to open again (once the breaker lets it).
        Except when `starting` (a cache's `async with`, `TierResource.start`) and the opening raised a
        `ConfigError`: a configuration that can never work (a root others may write, a bucket
        that does not exist) is raised, so that the start-up fails with its message instead of
        running with a tier that never stores a byte. Any other fault (a server down, a full
        disk) may pass: it degrades, as on first use.
        """
        entered = self.breaker.enter()
        if entered is None:
            self.counters["calls_skipped_while_down"] += 1
            return False
        try:
            await opening()
        except ConfigError:
            if not starting:
                self._open_failed(entered)
                return False
            self.breaker.left(entered)
            raise
        except Exception:
            self._open_failed(entered)
            return False
        except BaseException:  # cancelled: no answer
            self.breaker.left(entered)
            raise
        self.breaker.succeeded()
        return True

    def _open_failed(self, entered: Pass) -> None:
        """Count and log the opening that failed (in its `except` block, for the traceback)."""
        self.counters["errors"] += 1
        self.breaker.failed(entered)
        self.fault_log.warning("open", "tier %r: opening failed", self.name, exc_info=True)

    async def call(self, what: str, call: Awaitable[list[bool]], n: int, priority: Priority) -> list[bool]:
        """Await a hook's `call` about `n` keys at `priority`; its answer, or all-False."""
        entered = self.breaker.enter()
        if entered is None:
            if inspect.iscoroutine(call):
                call.close()  # never started
            self.counters["calls_skipped_while_down"] += 1
            return [False] * n
        token = current_priority.set(priority)
        try:
            result = await call
        except QueueTimeout:
            self.counters["queue_timeouts"] += 1
            self.breaker.left(entered)
            self.fault_log.warning(
                (what, "queue"), "tier %r: %s waited too long for a place", self.name, what
            )
            return [False] * n
        except Exception as exc:
            self.counters["errors"] += 1
            self.breaker.failed(entered)
            self.fault_log.warning((what, type(exc)), "tier %r: %s failed", self.name, what, exc_info=True)
            # The error may outlive this call (redis-py's dead connection keeps the one it died of)
            # and its traceback holds the hook's frames, whose locals are views of the primary
            # memory: vLLM could then not unmap its /dev/shm region at shutdown. Drop them, and
            # those of the errors it was raised from or while handling.
            _clear_frames(exc)
            return [False] * n
        except BaseException:  # cancelled: no answer
            self.breaker.left(entered)
            raise
        finally:
            current_priority.reset(token)
        if not isinstance(result, list) or len(result) != n:
            self.counters["errors"] += 1
            self.breaker.failed(entered)
            self.fault_log.error(
                (what, "answer"), "tier %r: %s returned %r for %d keys", self.name, what, result, n
            )
            return [False] * n
        self.breaker.succeeded()
        return [r is True for r in result]
