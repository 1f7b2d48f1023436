"""`LookupAnswers`, the vLLM integration's immediate answers to lookups, as a state object."""

from __future__ import annotations

from kvtier_async.integrations.lookup_answers import LookupAnswers


def test_an_unknown_key_is_asked_about_once_and_its_answer_kept_for_a_whole_step() -> None:
    answers = LookupAnswers(known_limit=8, batch=4)
    assert answers.answer(b"a") is None and answers.answer(b"a") is None  # queued once
    assert answers.answer(b"b") is None
    assert answers.take_unasked() == [b"a", b"b"] and answers.pending
    assert answers.answer(b"a") is None  # in flight: not queued again
    assert answers.take_unasked() == [] and answers.checks_in_flight == 1
    answers.answered([b"a", b"b"], [True, False])
    assert not answers.pending
    assert answers.answer(b"a") is True and answers.answer(b"b") is False
    answers.next_step()
    assert answers.answer(b"b") is False  # the last step's answers still count
    answers.next_step()
    assert answers.answer(b"b") is None  # two steps old: asked again
    assert answers.answer(b"a") is True  # a hit stays known


def test_a_key_being_stored_waits_for_the_outcome() -> None:
    answers = LookupAnswers(known_limit=8, batch=4)
    answers.storing([b"k", b"k", b"j"])
    assert answers.answer(b"k") is None and answers.take_unasked() == []
    answers.stored([b"k", b"j"], [b"j"])
    assert answers.answer(b"k") is None  # the second store of it is still in flight
    assert answers.answer(b"j") is True
    answers.stored([b"k"], [])
    assert answers.answer(b"k") is None and answers.take_unasked() == [b"k"]  # failed: asked about


def test_queued_keys_dropped_leave_nothing_pending() -> None:
    answers = LookupAnswers(known_limit=8, batch=4)
    answers.answer(b"a")
    assert answers.pending
    answers.drop_unasked()
    assert not answers.pending and answers.take_unasked() == []
    assert answers.answer(b"a") is None and answers.take_unasked() == [b"a"]  # queued afresh


def test_a_full_batch_is_reported_and_forgotten_keys_are_asked_again() -> None:
    answers = LookupAnswers(known_limit=2, batch=2)
    answers.answer(b"a")
    assert not answers.batch_is_full
    answers.answer(b"b")
    assert answers.batch_is_full
    answers.answered(answers.take_unasked(), [True, True])
    answers.next_step()
    answers.next_step()
    assert answers.answer(b"a") is True  # now the most recently used
    answers.storing([b"c"])
    answers.stored([b"c"], [b"c"])  # a third known key: the least recently used (b) goes
    assert answers.answer(b"b") is None
    answers.forget([b"a"])  # the tier let go of it
    assert answers.answer(b"a") is None and answers.answer(b"c") is True
