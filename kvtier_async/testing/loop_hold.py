"""`LoopHold`: the longest the event loop's thread computed without coming back to the loop.

The blocking-call detector (blockbuster) sees a call that waits on the loop (a sleep, file
I/O, a lock); it cannot see the loop's thread kept busy: a long pure-Python step, a native
copy or checksum, or many short steps that one turn of the loop runs back to back (a batch's
tasks, each copying a block). `LoopHold` measures that: a ticker on the loop (every `period`
seconds) reads the loop thread's own CPU time at each tick, and the longest CPU time between
two ticks is the most the thread computed without letting the ticker run. CPU time, not wall
time: a thread that waits for a CPU on a busy machine, or for the GIL, gains none, so the
figure does not grow with the machine's load. The garbage collector is held off meanwhile (a
full collection takes as long as the whole heap's size makes it, whoever allocated).

On Linux it also counts the longest stretch's page faults (`longest_page_faults`): memory the
loop's thread touched for the first time (a large buffer allocated on the loop), which the kernel
zeroes or reclaims on the thread's CPU time, rather than Python or a native step of its own.

Works on any asyncio loop (uvloop too); Linux, macOS and Windows have a per-thread clock.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time

if sys.platform == "linux":  # per-thread counts
    from resource import RUSAGE_THREAD, getrusage

__all__ = ["LoopHold"]


class LoopHold:
    """`with LoopHold() as hold:` (on the loop), then `hold.longest_s`: the most CPU seconds the
    loop's thread spent between two ticks `period` seconds apart."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.longest_s = 0.0
        #: The page faults of the longest stretch (Linux; else 0).
        self.longest_page_faults = 0
        self.ticks = 0
        self._last = 0.0
        self._last_faults = 0
        self._handle: asyncio.TimerHandle | None = None
        self._gc_was_enabled = False

    def _measure(self) -> None:
        now, faults = time.thread_time(), _page_faults()
        if now - self._last > self.longest_s:
            self.longest_s = now - self._last
            self.longest_page_faults = faults - self._last_faults
        self.ticks += 1
        self._last, self._last_faults = now, faults

    def describe(self) -> str:
        """The longest stretch, in words."""
        text = f"{self.longest_s * 1e3:.1f} ms of CPU"
        if sys.platform == "linux":
            text += f" ({self.longest_page_faults} page faults)"
        return text

    def _tick(self) -> None:
        self._measure()
        self._handle = asyncio.get_running_loop().call_later(self.period, self._tick)

    def __enter__(self) -> LoopHold:
        self._gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        self._last, self._last_faults = time.thread_time(), _page_faults()
        self._handle = asyncio.get_running_loop().call_later(self.period, self._tick)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._measure()  # the stretch since the last tick counts too
        if self._gc_was_enabled:
            gc.enable()


def _page_faults() -> int:
    """The calling thread's page faults so far (Linux; else 0)."""
    if sys.platform != "linux":
        return 0
    usage = getrusage(RUSAGE_THREAD)
    return usage.ru_minflt + usage.ru_majflt
