"""FaultBreaker's logic, on a clock the test moves (the Redis and S3 tests show it against real
dead and stuck servers)."""

from __future__ import annotations

from kvtier_async.fault_breaker import FaultBreaker, Pass


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make() -> tuple[FaultBreaker, Clock]:
    clock = Clock()
    return FaultBreaker(streak=3, cooldown_s=1.0, max_cooldown_s=4.0, clock=clock), clock


def test_it_opens_after_a_streak_of_faults_and_a_success_resets_the_streak() -> None:
    breaker, _ = make()
    for _ in range(2):
        breaker.failed(Pass.CALL)
    breaker.succeeded()  # the streak is broken
    for _ in range(2):
        breaker.failed(Pass.CALL)
    assert breaker.enter() is Pass.CALL and breaker.state() == "closed"
    breaker.failed(Pass.CALL)
    assert breaker.enter() is None and breaker.state() == "open"


def test_one_probe_after_the_cool_down_and_longer_cool_downs_while_it_fails() -> None:
    breaker, clock = make()
    for _ in range(3):
        breaker.failed(Pass.CALL)
    for cooldown in (1.0, 2.0, 4.0, 4.0):  # doubled, up to max_cooldown_s
        clock.now += cooldown - 0.01
        assert breaker.enter() is None
        clock.now += 0.01
        assert breaker.enter() is Pass.PROBE
        assert breaker.enter() is None and breaker.state() == "probing"  # one probe at a time
        breaker.failed(Pass.PROBE)
    clock.now += 4.0
    assert breaker.enter() is Pass.PROBE
    breaker.succeeded()
    assert breaker.enter() is Pass.CALL and breaker.state() == "closed"
    for _ in range(3):  # a new outage starts from the first cool-down again
        breaker.failed(Pass.CALL)
    clock.now += 1.0
    assert breaker.enter() is Pass.PROBE


def test_calls_in_flight_when_it_opened_do_not_lengthen_the_cool_down() -> None:
    breaker, clock = make()
    for _ in range(50):  # the server died under 50 calls at once
        breaker.failed(Pass.CALL)
    clock.now += 1.0
    assert breaker.enter() is Pass.PROBE


def test_a_probe_that_got_no_answer_lets_the_next_call_probe() -> None:
    breaker, clock = make()
    for _ in range(3):
        breaker.failed(Pass.CALL)
    clock.now += 1.0
    assert breaker.enter() is Pass.PROBE
    breaker.left(Pass.CALL)  # another call's cancellation does not release the probe
    assert breaker.enter() is None
    breaker.left(Pass.PROBE)  # cancelled
    assert breaker.enter() is Pass.PROBE
