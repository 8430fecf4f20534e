"""What the chat adapters' review-card handlers ask of the core, and how they identify
a click (``bots/slack_review.py``, ``bots/teams_review.py``, ``bots/discord_review.py``;
the email listener's replies to cards, ``bots/email.py``).

:class:`ChatReviewBackend` is satisfied by
:class:`leadgate.operations.chat_reviews.ChatReviews`; the adapters get it through
``enable_reviews(backend)`` from the composition root. Card rendering lives beside each
adapter; the card itself (:class:`outbox.channel.Card`) is channel-neutral.
"""

from __future__ import annotations

from typing import Any, Protocol

from leadgate.review.replies import AnswerTo, ReplyCard
from outbox.channel import Card


def obj(value: Any) -> dict[str, Any]:
    """``value`` if it is a JSON object, else an empty one.

    A click's payload is signed by the platform, but its fields are still only JSON: a
    string or list where an object belongs must read as absent (a refusal the clicker
    sees), not raise on ``.get`` (a 500 with a traceback)."""
    return value if isinstance(value, dict) else {}


def text(value: Any) -> str | None:
    """``value`` if it is a non-empty string, else ``None`` (see :func:`obj`)."""
    return value if isinstance(value, str) and value else None


class Answer(Protocol):
    """What became of a click (:class:`leadgate.operations.chat_reviews.ChatAnswer`)."""

    @property
    def kind(self) -> str: ...

    @property
    def text(self) -> str: ...

    @property
    def card(self) -> Card | None: ...

    @property
    def said(self) -> str | None:
        """The decision's reason or feedback ``text`` names, to be shown quoted."""
        ...

    @property
    def decided(self) -> bool: ...


class ChatReviewBackend(Protocol):
    """Decisions from chat cards (see :mod:`leadgate.operations.chat_reviews`)."""

    async def check(
        self,
        platform: str,
        identity: str,
        item_id: str,
        episode_id: str | None = None,
        *,
        message_id: str | None = None,
        conversation: str | None = None,
        card_id: str | None = None,
    ) -> Answer:
        """Whether ``identity`` may decide ``item_id`` now (``kind`` ``open``); the
        clicked card's message (``message_id`` in ``conversation``) is settled as in
        :meth:`decide` when its post was uncertain."""
        ...

    async def decide(
        self,
        platform: str,
        identity: str,
        item_id: str,
        action: str,
        text: object = None,
        *,
        episode_id: str | None = None,
        message_id: str | None = None,
        conversation: str | None = None,
        card_id: str | None = None,
    ) -> Answer:
        """Approve / reject / return as the user linked to ``identity``."""
        ...

    async def recover(
        self,
        platform: str,
        identity: str,
        delivery_id: str,
        action: str,
        *,
        episode_id: str | None = None,
        message_id: str | None = None,
        conversation: str | None = None,
        card_id: str | None = None,
    ) -> Answer:
        """Confirm delivered / retry a deliveryUnknown delivery (from the card of
        ``episode_id``)."""
        ...

    async def reply_card(self, token: str) -> ReplyCard | None:
        """The email card whose reply token is ``token`` (``None``: no card has it)."""
        ...

    async def email_reply(
        self,
        token: str,
        sender: str,
        envelope_sender: str,
        action: str,
        text: str,
        answer_to: AnswerTo,
    ) -> Answer:
        """A reply to the email card of ``token``: ``action`` (its first word) and
        ``text`` (the reason or feedback) from ``sender`` (the ``From`` address); the
        answer mail to ``answer_to`` is queued in the outbox, committed with the
        decision (nothing is committed when the answer is ``unavailable``)."""
        ...

    async def remember_teams_conversation(self, reference: dict[str, object]) -> None:
        """Keep a Teams conversation reference for ``notify add --channel teams``."""
        ...


#: Button actions of an awaitingHuman card and of a deliveryUnknown card.
DECISION_ACTIONS = ("approve", "reject", "return")
RECOVERY_ACTIONS = ("confirm", "retry")
#: Longest reason and feedback the modals accept (the platform may allow less).
REASON_MAX = 2_000
FEEDBACK_MAX = 10_000
