"""A memory tier whose reads of chosen keys wait until the test opens a gate."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence
from types import TracebackType

from kvtier_async.tiers.memory import MemoryTier

#: Seconds `until` waits before it reports a hang (far past any state these tests reach).
HANG_S = 120.0


class GatedTier(MemoryTier):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.gated: set[bytes] = set()
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()  # set once a read is held at the gate
        self.reads: list[bytes] = []

    async def read_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        self.reads.extend(keys)
        if self.gated.intersection(keys):
            self.waiting.set()
            await self.gate.wait()
        return await super().read_blocks(keys, blocks)


class LyingTier(MemoryTier):
    """Claims every read succeeded but flips a byte: the demo must notice."""

    async def read_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        results = await super().read_blocks(keys, blocks)
        for block, ok in zip(blocks, results):
            if ok:
                block[0] ^= 0xFF
        return results


class FlakyOpenTier(MemoryTier):
    """Its first open fails, as a server that is not up yet would."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.open_attempts = 0

    async def open_backend(self) -> None:
        self.open_attempts += 1
        if self.open_attempts == 1:
            raise OSError("connection refused")


class ProbeTier(MemoryTier):
    """A memory tier that records what the scheduler lets through and can hold it at gates.

    Tests load it through `module_path`, as users load their own tiers. Each
    hook call waits at its direction's gate (open unless a test clears it) and
    records how many calls of that direction run at once and how often each
    key was read and written. `changed` is set whenever any of that changes, so
    a test can wait for a state (`until`) instead of sleeping.
    """

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        directions = ("read", "write", "contains", "open")
        self.gates = {direction: asyncio.Event() for direction in directions}
        for gate in self.gates.values():
            gate.set()
        self.running = dict.fromkeys(directions, 0)
        self.max_running = dict.fromkeys(directions, 0)
        self.held = dict.fromkeys(directions, 0)  # calls waiting at a gate now
        self.opens = self.closes = 0  # open_backend / close_backend calls that completed
        self.key_reads: Counter[bytes] = Counter()
        self.key_writes: Counter[bytes] = Counter()
        self.changed = asyncio.Event()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            # The test failed, maybe with calls held at a gate it shut. Closing waits for the calls
            # in flight, so open the gates: the failure is reported instead of waiting for ever
            # (a failed assertion in test_lane_limits_are_never_exceeded hung CI so).
            for gate in self.gates.values():
                gate.set()
        await super().__aexit__(exc_type, exc_val, exc_tb)

    async def until(self, predicate: Callable[[], bool]) -> None:
        # A guard against a hang, not a timing bound: a state never reached fails with what the
        # tier held, where the run would otherwise wait until CI's own limit.
        try:
            async with asyncio.timeout(HANG_S):
                while not predicate():
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            lanes = self.stats().get("lanes")
            raise AssertionError(
                f"the state was not reached in {HANG_S:.0f} s: held {self.held}, running "
                f"{self.running}, lanes {lanes}"
            ) from None

    async def _through_gate(self, direction: str, keys: Sequence[bytes]) -> None:
        if direction in ("read", "write"):
            (self.key_reads if direction == "read" else self.key_writes).update(keys)
        self.running[direction] += 1
        self.max_running[direction] = max(self.max_running[direction], self.running[direction])
        self.held[direction] += 1
        self.changed.set()
        try:
            await self.gates[direction].wait()
        finally:
            self.held[direction] -= 1
            self.changed.set()

    def _done(self, direction: str) -> None:
        self.running[direction] -= 1
        self.changed.set()

    async def read_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        try:
            await self._through_gate("read", keys)
            return await super().read_blocks(keys, blocks)
        finally:
            self._done("read")

    async def write_blocks(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        try:
            await self._through_gate("write", keys)
            return await super().write_blocks(keys, blocks)
        finally:
            self._done("write")

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        try:
            await self._through_gate("contains", keys)
            return await super().contains(keys)
        finally:
            self._done("contains")

    async def open_backend(self) -> None:
        try:
            await self._through_gate("open", ())
        finally:
            self._done("open")
        self.opens += 1
        self.changed.set()

    async def close_backend(self) -> None:
        self.closes += 1
        self.changed.set()
