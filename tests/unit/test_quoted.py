"""``quoted``: how refusals quote a name or id a client sent."""

from __future__ import annotations

from leadgate.core.errors import QUOTE_LIMIT, quoted


def test_a_short_value_is_quoted_as_repr_quotes_it() -> None:
    assert quoted("ghost") == "'ghost'"
    assert quoted("a\nb\x00") == "'a\\nb\\x00'"  # control characters escaped


def test_a_long_value_is_cut_to_its_head_and_its_length() -> None:
    value = "\x1b" + "y" * 4_999
    told = quoted(value)
    assert told == repr(value[:QUOTE_LIMIT]) + "… (5,000 characters)"
    assert "\x1b" not in told and len(told) < QUOTE_LIMIT + 40
    assert quoted("z" * QUOTE_LIMIT) == repr("z" * QUOTE_LIMIT)  # at the limit: whole
