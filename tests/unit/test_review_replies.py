"""Reply addresses and reply texts of email review cards (leadgate/review/replies.py)."""

from __future__ import annotations

import pytest

from leadgate.review.replies import new_token, parse_reply, reply_address, token_hash, token_of

BASE = "review@reviews.example.com"


def test_a_token_goes_into_the_address_and_comes_back_out() -> None:
    token = new_token()
    assert len(token) == 32 and token != new_token()  # 128 random bits
    address = reply_address(BASE, token)
    assert address == f"review+{token}@reviews.example.com"
    assert token_of(BASE, address) == token
    assert token_of(BASE, address.upper()) == token  # the listener lower-cases anyway
    assert token_hash(token) != token and len(token_hash(token)) == 64


@pytest.mark.parametrize(
    ("recipient", "found"),
    [
        ("review@reviews.example.com", None),  # the address itself: routed as any other
        ("other+" + "a" * 32 + "@reviews.example.com", None),
        ("review+" + "a" * 32 + "@example.com", None),
        ("review+" + "a" * 32 + "@reviews.example.com.evil", None),
        ("review+short@reviews.example.com", ""),  # ours, but no token of ours
        ("review+" + "a" * 33 + "@reviews.example.com", ""),
        ("review+" + "g" * 32 + "@reviews.example.com", ""),
        ("review+@reviews.example.com", ""),
    ],
)
def test_other_addresses_are_not_card_replies(recipient: str, found: str | None) -> None:
    assert token_of(BASE, recipient) == found


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("approve", ("approve", "")),
        ("Approve.\n", ("approve", "")),
        ("  REJECT: too vague\nsee page 2\n", ("reject", "too vague\nsee page 2")),
        ("reject\n\nthe figures are wrong", ("reject", "the figures are wrong")),
        ("return\tmore sources", ("return", "more sources")),
        ("", ("", "")),
        ("looks fine", ("looks", "fine")),
    ],
)
def test_the_first_word_is_the_verb_and_the_rest_the_text(
    text: str, parsed: tuple[str, str]
) -> None:
    assert parse_reply(text) == parsed
