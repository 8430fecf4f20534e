"""Email review cards answered by reply (``[email] review_reply_address``).

Each email card gets a random token (128 bits, from the injectable :data:`TokenFactory`)
and says ``Reply-To: <local>+<token>@<domain>``; only the token's SHA-256 is stored
(``review_cards.reply_token_hash``), bound to that one card: its organization, item and
wait. A reply's recipient names the token, :func:`token_of` reads it back and
:func:`token_hash` finds the card. SHA-256 is enough here, not a password hash such as
argon2: the token is random with 128 bits, so nothing can be guessed from its hash and
no slow hash is needed against guessing (argon2 guards low-entropy secrets such as
passwords), and one indexed lookup by the hash costs nothing per mail.

The token alone does not decide: the reply's sender must also be a reviewer of the
card's organization (:meth:`leadgate.operations.chat_reviews.ChatReviews.email_reply`).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Callable
from typing import NamedTuple

#: Makes one reply token (tests inject a predictable one).
TokenFactory = Callable[[], str]
#: A token as :func:`new_token` makes it: 32 lower-case hex digits (lower case survives
#: the listener's lower-casing of recipients).
_TOKEN = re.compile(r"[0-9a-f]{32}")

#: What a reply's first word may be, per card reason.
VERBS = {
    "awaitingHuman": ("approve", "reject", "return"),
    "deliveryUnknown": ("confirm", "retry"),
}


def new_token() -> str:
    """A fresh reply token: 128 random bits as hex."""
    return secrets.token_hex(16)


def token_hash(token: str) -> str:
    """The stored form of ``token``: its SHA-256, hex."""
    return hashlib.sha256(token.encode("ascii", "replace")).hexdigest()


def reply_address(base: str, token: str) -> str:
    """``<local>+<token>@<domain>`` of the configured ``base`` address."""
    local, _, domain = base.partition("@")
    return f"{local}+{token}@{domain}"


def token_of(base: str, recipient: str) -> str | None:
    """The token of a recipient of the form ``<local>+<token>@<domain>`` of ``base``
    (``""``: that form with a token that cannot be one of ours); ``None``: another
    address (the listener routes it as any other)."""
    local, _, domain = base.lower().partition("@")
    r_local, _, r_domain = recipient.strip().lower().rpartition("@")
    head, plus, token = r_local.partition("+")
    if not plus or head != local or r_domain != domain:
        return None
    return token if _TOKEN.fullmatch(token) else ""


class ReplyCard(NamedTuple):
    """The card a reply token names."""

    org_id: str
    item_id: str
    episode_id: str
    #: awaitingHuman | deliveryUnknown
    reason: str
    #: the gating delivery of a deliveryUnknown card
    delivery_id: str | None
    #: the card (``review_cards.id``) and the agent whose item it is
    card_id: str
    agent_id: str


class AnswerTo(NamedTuple):
    """Where the answer to a reviewer's reply goes: a reply to their mail."""

    #: the reply's ``From`` address
    to: str
    subject: str
    #: the reply's Message-ID, and the thread it is in
    in_reply_to: str | None
    references: str | None

    def address(self) -> dict[str, str | None]:
        """The answer mail's address, as an email delivery row holds it."""
        return self._asdict()


def decided_text(outcome: str) -> str:
    """The answer mail's text to a reply that decided (``outcome``: the card's outcome
    line); other answers say why nothing changed in words of their own."""
    return f"Your decision was recorded: {outcome}"


def accepted(reason: str) -> str:
    """What a card of ``reason`` accepts as a reply, in words."""
    if reason == "deliveryUnknown":
        return (
            "Reply with 'confirm' as the first line if the answer was delivered, or "
            "'retry' to send it again."
        )
    return (
        "Reply with 'approve' as the first line; or 'reject' followed by the reason "
        "(1 to 2,000 characters), or 'return' followed by feedback for the worker (1 to "
        "10,000 characters)."
    )


def instructions(reason: str) -> str:
    """The lines an answerable email card ends with."""
    return (
        f"To decide by email: {accepted(reason)} "
        "Everything from the quoted original down is ignored."
    )


def parse_reply(text: str) -> tuple[str, str]:
    """A reply's first word (lower case, ``""`` when none) and the rest of its text
    (the reason or feedback), the quoted original already removed."""
    stripped = text.strip()
    word, _, rest = stripped.partition("\n")
    parts = word.split(None, 1)
    if not parts:
        return "", ""
    verb = parts[0].rstrip(".:!,").lower()
    tail = parts[1] if len(parts) > 1 else ""
    return verb, f"{tail.strip()}\n{rest}".strip()
