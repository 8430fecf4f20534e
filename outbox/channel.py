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

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class OutboundMessage:
    """One message to post.

    ``idempotency_key`` is stable per delivery (derived from its id) so that platforms
    that de-duplicate (Discord nonce, email Message-ID, Teams activity id) do.
    ``kind`` is ``"reply"`` for a plain turn's immediate reply and ``"gating"`` for
    approved output posted later.
    """

    delivery_id: str
    idempotency_key: str
    address: dict[str, Any]
    text: str
    kind: str = "gating"


@dataclass(frozen=True)
class Sent:
    """Posted."""

    external_id: str | None = None


@dataclass(frozen=True)
class Retry:
    """Not posted; try again after ``delay_s`` (None: the relay's backoff decides)."""

    error: str
    delay_s: float | None = None


@dataclass(frozen=True)
class Permanent:
    """Not posted and never will be."""

    error: str


@dataclass(frozen=True)
class Uncertain:
    """Maybe posted. Never retried automatically."""

    error: str


SendOutcome = Sent | Retry | Permanent | Uncertain


class Channel(Protocol):
    """The outbound half of a channel adapter."""

    #: binding kind this channel serves ("slack", "discord", "teams", "email")
    name: str
    #: longest text one platform message may carry; longer text is split by the relay
    max_chars: int

    async def send(self, message: OutboundMessage) -> SendOutcome:
        """Post one message. Must not raise for platform errors: map them."""
        ...

    async def close(self) -> None:
        """Release HTTP sessions and connections."""
        ...
