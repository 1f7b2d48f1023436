"""`LookupAnswers`: what an engine process knows of its tier's keys, to answer a lookup at once.

vLLM asks its tiers about a request's chunks from its scheduler thread and wants an
answer now: held, not held, or "ask again". A key is known held (this process stored
it, loaded it or found it present: `KnownKeys`), being stored right now, answered by
an existence check of this step or the last, or unknown: then it is queued for the
next batched existence check, which the integration sends at the end of the step or
when `batch` keys are waiting, and the engine asks again later.

Not locked itself: the integration holds the lock that guards the rest of its state
around every call (the loop thread records answers and stores under it too).
"""

from __future__ import annotations

from collections.abc import Iterable

from .known_keys import KnownKeys

__all__ = ["LookupAnswers"]


class LookupAnswers:
    """Answers to lookups of `bytes` keys; at most `known_limit` keys remembered as held."""

    def __init__(self, known_limit: int, batch: int) -> None:
        self.batch = batch
        self.known: KnownKeys[bytes] = KnownKeys(known_limit)
        self.checks_in_flight = 0
        self._storing: dict[bytes, int] = {}  # keys in store jobs in flight, with how many
        self._asking: set[bytes] = set()  # keys queued or in flight for an existence check
        self._unasked: list[bytes] = []  # queued for the next check
        # Check answers, kept for at least one whole step: the older generation is dropped at
        # each step's end, so answers nobody reads (a request that went away) do not pile up.
        self._answers: dict[bytes, bool] = {}
        self._older_answers: dict[bytes, bool] = {}

    def answer(self, key: bytes) -> bool | None:
        """True (held) or False (not held) where known; None while it is stored or asked about
        (an unknown key is queued for the next check)."""
        if self.known.touch(key):
            return True
        if key in self._storing:
            return None
        answer = self._answers.get(key, self._older_answers.get(key))
        if answer is not None:
            if answer:
                self.known.add([key])
            return answer
        if key not in self._asking:
            self._asking.add(key)
            self._unasked.append(key)
        return None

    @property
    def batch_is_full(self) -> bool:
        return len(self._unasked) >= self.batch

    @property
    def pending(self) -> bool:
        """Whether keys wait for a check or a check is in flight."""
        return bool(self._unasked or self.checks_in_flight)

    def next_step(self) -> None:
        """Forget the answers a step old."""
        self._older_answers, self._answers = self._answers, {}

    def take_unasked(self) -> list[bytes]:
        """The keys for one existence check, counted in flight until `answered`; [] if none."""
        keys, self._unasked = self._unasked, []
        if keys:
            self.checks_in_flight += 1
        return keys

    def drop_unasked(self) -> None:
        """Forget the keys queued for a check that will never be sent."""
        self._asking.difference_update(self._unasked)
        self._unasked = []

    def answered(self, keys: list[bytes], present: list[bool]) -> None:
        self.checks_in_flight -= 1
        for key, found in zip(keys, present):
            self._asking.discard(key)
            self._answers[key] = found
        self.known.add([key for key, found in zip(keys, present) if found])

    def storing(self, keys: Iterable[bytes]) -> None:
        """A store job of `keys` started: their lookups wait for its outcome."""
        for key in keys:
            self._storing[key] = self._storing.get(key, 0) + 1

    def stored(self, keys: Iterable[bytes], stored: Iterable[bytes]) -> None:
        """The store job of `keys` ended; `stored` are the ones the tier now holds."""
        for key in keys:
            self._storing[key] -= 1
            if not self._storing[key]:
                del self._storing[key]
        self.known.add(stored)

    def forget(self, keys: Iterable[bytes]) -> None:
        """The tier let go of `keys`, or a load missed them."""
        self.known.forget(keys)
