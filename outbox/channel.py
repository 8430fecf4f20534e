"""What the relay needs from a channel, and nothing more.

The relay and the core never import a channel SDK. Each adapter in ``bots/`` implements
:class:`Channel` and maps its SDK's errors onto exactly one of the four outcome classes
of SPEC section 6:

::

    SendOutcome
    ├── Sent         posted; ``external_id`` is the platform's message id
    ├── Retry        definitely not posted, worth retrying (429, refused, pre-write 5xx);
    │                ``delay_s`` carries Retry-After when the platform sent one
    ├── Permanent    definitely not posted, never will be (bad channel, revoked token)
    └── Uncertain    may or may not have been posted (timeout/reset after the request
                     was written): the delivery goes to ``deliveryUnknown``, a human decides
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

#: Address keys a delivery's row keeps only until it is sent (the relay drops them with
#: the move to ``sent``): ``reply_to``, an email review card's Reply-To, whose token
#: is otherwise kept only as a hash (``[email] review_reply_address``).
UNTIL_SENT = ("reply_to",)


@dataclass(frozen=True)
class CardOutcome:
    """How a review card's item was decided (the card shows it instead of buttons)."""

    #: "Approved", "Rejected", "Returned to the worker", "Cancelled", "Delivery confirmed",
    #: "Delivery retried", "Expired (rejected)"
    title: str
    #: who decided: a user's email, "API key key_...", "the lead", "expiry"
    by: str
    #: where: console, api, cli, slack, teams, discord, email, system
    surface: str | None
    at_ms: int
    #: the reason or feedback, when the decision carried one
    text: str | None = None


@dataclass(frozen=True)
class Card:
    """A review card: what a reviewer needs to decide, in channel-neutral form.

    The review layer builds it (:mod:`leadgate.review.cards`) and stores it on the
    card's delivery row; each adapter renders it its own way (Block Kit, an Adaptive
    Card, Discord components, plain text). ``outcome`` set = decided: no buttons.
    ``reason`` ``awaitingHuman`` offers Approve / Reject / Return;
    ``deliveryUnknown`` offers Confirm delivered / Retry for ``delivery_id``.
    """

    item_id: str
    episode_id: str
    #: notify (the item started waiting) | reminder | escalation
    purpose: str
    reason: str
    delivery_id: str | None
    agent: str
    source: str
    why: str
    summary: str
    revision: int
    rounds: int
    waiting_since_ms: int
    link: str
    outcome: CardOutcome | None = None
    #: The card's own delivery id, which Slack, Teams and Discord cards carry in their
    #: actions so that a click names its card exactly (``None``: a card written before
    #: they did).
    card_id: str | None = None

    @property
    def title(self) -> str:
        """The card's headline."""
        head = {"reminder": "Reminder: ", "escalation": "Escalation: "}.get(self.purpose, "")
        what = "Delivery outcome unknown" if self.reason == "deliveryUnknown" else "Review needed"
        return f"{head}{what}: {self.agent}"

    def decided(self, outcome: CardOutcome) -> Card:
        """The same card, decided."""
        return replace(self, outcome=outcome)

    def to_json(self) -> dict[str, Any]:
        """JSON for the delivery row's address."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Card:
        """Back from :meth:`to_json`."""
        fields = dict(data)
        outcome = fields.pop("outcome", None)
        return cls(**fields, outcome=CardOutcome(**outcome) if outcome else None)


@dataclass(frozen=True)
class OutboundMessage:
    """One message to post.

    ``idempotency_key`` is stable per delivery (derived from its id) so that platforms
    that de-duplicate (Discord nonce, email Message-ID, Teams activity id) do: the
    delivery's id for its first part, and for a later part of a long text one naming
    where that part lies in the text (:func:`outbox.relay.part_key`), the same key only
    ever for the same text.
    ``kind`` is ``"reply"`` for a plain turn's immediate reply and ``"gating"`` for
    approved output posted later; ``"card"`` posts a review ``card`` (``text`` is its
    plain-text form) and ``"cardUpdate"`` is the payload of :meth:`Channel.update`.
    """

    delivery_id: str
    idempotency_key: str
    address: dict[str, Any]
    text: str
    kind: str = "gating"
    card: Card | None = None
    #: The most this send may take, all of it, in seconds (``None``: the channel's own
    #: deadline, at most :data:`outbox.relay.SEND_DEADLINE_S`): for a later part of a
    #: long text, what the earlier parts left of their delivery's send deadline. A
    #: channel that cannot end its send within it sends nothing: a Retry.
    within_s: float | None = None

    def budget_s(self, own_s: float) -> float:
        """The most this send may take: ``own_s`` (the channel's own bound), or less
        when its delivery's deadline leaves less (:attr:`within_s`)."""
        return own_s if self.within_s is None else min(own_s, self.within_s)


@dataclass(frozen=True)
class Sent:
    """Posted."""

    external_id: str | None = None


# ``said`` on the outcomes below: the platform's own words about a refusal (an SMTP
# relay's reply to the message, Discord's or the Bot Connector's error text), which can
# quote what was posted. They are stored with the delivery's error (:func:`stored_error`:
# its operators see them) and never logged; ``error`` is what logs say.


@dataclass(frozen=True)
class Retry:
    """Not posted; try again after ``delay_s`` (None: the relay's backoff decides)."""

    error: str
    delay_s: float | None = None
    said: str = ""


@dataclass(frozen=True)
class Permanent:
    """Not posted and never will be."""

    error: str
    said: str = ""


@dataclass(frozen=True)
class Uncertain:
    """Maybe posted. Never retried automatically."""

    error: str
    said: str = ""


SendOutcome = Sent | Retry | Permanent | Uncertain


def too_little_left(who: str, left_s: float, needs_s: float, what: str) -> Retry:
    """The Retry of a send not started, nothing sent: its delivery's send deadline
    leaves ``left_s`` (:meth:`OutboundMessage.budget_s`), less than the ``needs_s``
    that ``what`` may take (``who``: the channel, as its errors name it)."""
    return Retry(
        f"{who}: {max(left_s, 0):g} s left of the delivery's send deadline, less than "
        f"the {needs_s:g} s {what} may take; nothing was sent"
    )


def stored_error(outcome: Retry | Permanent | Uncertain) -> str:
    """The delivery's error as stored (and shown to its operators): ``error``, then what
    the platform said, if anything."""
    return f"{outcome.error}: {outcome.said}" if outcome.said else outcome.error


class Channel(Protocol):
    """The outbound half of a channel adapter."""

    #: binding kind this channel serves ("slack", "discord", "teams", "email")
    name: str
    #: longest text one platform message may carry; longer text is split by the relay.
    #: Characters, unless the channel has a ``text_size(text) -> int`` saying how its
    #: platform counts (Teams: the bytes of the JSON it posts).
    max_chars: int

    async def send(self, message: OutboundMessage) -> SendOutcome:
        """Post one message (a review card when ``message.card`` is set). Must not raise
        for platform errors: map them."""
        ...

    async def update(self, message: OutboundMessage, external_id: str) -> SendOutcome:
        """Edit the message ``external_id`` (what :meth:`send` returned for a card) in
        place to show ``message.card``. An edit is idempotent, so a timeout is a
        :class:`Retry` here, not :class:`Uncertain`."""
        ...

    async def close(self) -> None:
        """Release HTTP sessions and connections."""
        ...
