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

Works on any asyncio loop (uvloop too); Linux, macOS and Windows have a per-thread clock.
"""

from __future__ import annotations

import asyncio
import gc
import time

__all__ = ["LoopHold"]


class LoopHold:
    """`with LoopHold() as hold:` (on the loop), then `hold.longest_s`: the most CPU seconds the
    loop's thread spent between two ticks `period` seconds apart."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.longest_s = 0.0
        self.ticks = 0
        self._last = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._gc_was_enabled = False

    def _measure(self) -> None:
        now = time.thread_time()
        self.longest_s = max(self.longest_s, now - self._last)
        self.ticks += 1
        self._last = now

    def _tick(self) -> None:
        self._measure()
        self._handle = asyncio.get_running_loop().call_later(self.period, self._tick)

    def __enter__(self) -> LoopHold:
        self._gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        self._last = time.thread_time()
        self._handle = asyncio.get_running_loop().call_later(self.period, self._tick)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._measure()  # the stretch since the last tick counts too
        if self._gc_was_enabled:
            gc.enable()
