"""What a person is told on a channel when their message met a database fault
(``bots.base.not_taken_in``)."""

from __future__ import annotations

from bots.base import not_taken_in
from leadgate.core.errors import NOTHING_STORED, IntakeInDoubt, Unavailable


def test_a_message_not_recorded_could_not_be_taken_in() -> None:
    said = not_taken_in(Unavailable(NOTHING_STORED, rule="service.unavailable"))
    assert said.startswith("Your message could not be taken in")
    assert "(service.unavailable)" in said


def test_a_read_back_that_found_nothing_is_not_in_doubt_for_the_person() -> None:
    fault = Unavailable(NOTHING_STORED, rule="service.unavailable")
    fault.in_doubt = True
    assert not_taken_in(fault.found_nothing()).startswith("Your message could not be taken in")


def test_a_message_whose_recording_is_in_doubt_is_told_so() -> None:
    """Its commit may have landed (the read-back failed): "could not be taken in" may be
    untrue, and its answer then comes from the turn's recovery once the service is back;
    the person was told to send it again, and got two answers."""
    said = not_taken_in(IntakeInDoubt("connection lost"))
    assert said.startswith("Your message may or may not have been taken in")
    assert "(intake.in_doubt)" in said and "once the service is back" in said
    assert "could not be taken in" not in said
