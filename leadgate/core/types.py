"""Neutral types shared by every way in (REST, MCP, channels, schedules, flows).

A surface turns its own request into a :class:`Trigger` (channels: an
:class:`Inbound`), hands it to the operations layer and maps the :data:`Outcome` onto its
own wire format. No surface re-implements a work-item rule.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

from leadgate.core.errors import LeadgateError, ValidationError


class BindingKind(enum.StrEnum):
    """Where a session's replies go. ``api`` covers REST and MCP."""

    api = "api"
    studio = "studio"
    slack = "slack"
    discord = "discord"
    teams = "teams"
    email = "email"
    scheduled = "scheduled"
    flow = "flow"

    @property
    def is_channel(self) -> bool:
        """Channels post replies through the outbox; api/studio answer inline."""
        return self in CHANNEL_KINDS


CHANNEL_KINDS = frozenset(
    {BindingKind.slack, BindingKind.discord, BindingKind.teams, BindingKind.email}
)


@dataclass(frozen=True)
class BindingSpec:
    """The conversation address a session replies to.

    ``address`` is channel-specific JSON (Slack: ``{"team", "channel", "thread_ts"}``;
    Discord: ``{"channel_id", "application_id", "interaction_token", "message_id"}``;
    Teams: ``{"reference": <conversation reference dict>}``; email: ``{"to", "subject",
    "message_id", "references"}``). ``silent`` bindings never post anything.
    """

    kind: BindingKind
    address: dict[str, Any] = field(default_factory=dict)
    silent: bool = False
    route_id: str | None = None


@dataclass(frozen=True)
class Trigger:
    """One external message for one worker agent in one session."""

    org_id: str
    # The agent's id, or the caller's reference to it (id, slug or name: REST, MCP). The
    # turn path resolves it inside the intake transaction (NotFound when unknown).
    agent_id: str
    session_key: str
    text: str
    binding: BindingSpec
    # Platform event id for de-duplication of redelivered events (Slack retries).
    external_event_id: str | None = None
    # Internal turns (lead feedback, human return) are not external messages.
    internal: bool = False


@dataclass(frozen=True)
class Usage:
    """Tokens one model call (or a whole turn: their sum) used, as the provider reports
    them (the ``script`` model counts its own: see its module)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """prompt + completion."""
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
        )


@dataclass(frozen=True)
class Reply:
    """The turn produced visible text (already screened by the output policy).

    ``streamed`` is True when the text already went out delta by delta; ``usage`` is the
    turn's token count (``None`` when the provider reported none; not part of equality).
    """

    text: str
    streamed: bool = False
    usage: Usage | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Gated:
    """The turn called complete_task: its text is withheld pending Lead review.

    ``work_item_id`` is kept for internal callers (flows, logs); public surfaces never
    reveal it (SPEC 7, 8).
    """

    work_item_id: str | None
    revision: int | None


@dataclass(frozen=True)
class Busy:
    """The session's work item is under review: the message was rejected (recorded)."""

    work_item_id: str


@dataclass(frozen=True)
class Duplicate:
    """The same external event was already taken in: no second turn ran.

    ``busy``: that event was recorded busy (``rejectedBusy``: the session's item waited
    for review), so its message is not in the transcript; its answer was :class:`Busy`.
    ``running``: its turn is still being run, by a live process or by turn recovery
    (only a caller that asked to run a cut turn again learns this:
    :meth:`leadgate.turns.path.TurnService.run`'s ``retake``).
    """

    busy: bool = False
    running: bool = False


Outcome = Reply | Gated | Busy | Duplicate

#: The rule every surface names for a turn held for its lead's review (``Gated``; the
#: ``gated`` outcome of ``leadgate_turns_total``): REST's 409 ``LEAD_REVIEW_PENDING``.
GATED_RULE: Final = "turn.gated"
#: The rule every surface names for a message refused because the session's item already
#: waits for review (``Busy``, and a ``Duplicate`` where one is refused the same way):
#: REST's busy 409, MCP's tool error, Studio's 409.
BUSY_RULE: Final = "turn.busy"


@dataclass(frozen=True)
class RouteMatch:
    """Which organization and agent answer an inbound channel trigger (a route)."""

    route_id: str
    org_id: str
    agent_id: str
    silent: bool
    #: when the route was made (ms): a catch-up answers nothing posted before it
    created_at: int = 0


#: The external event id of a message a Discord gateway delivered is this prefix and the
#: message's id: the intake's de-duplication, and what a catch-up reads back from.
DISCORD_MESSAGE_EVENT: Final = "discord:message:"
#: The route attribute of a trigger posted in a conversation under another: a Discord
#: thread's parent channel (a route naming that channel answers in its threads too, see
#: :func:`binding.routes.best_route`).
ROUTE_PARENT: Final = "parent"
#: The same for a Slack message (Events API): ``slack:TEAM:CHANNEL:TS``.
SLACK_MESSAGE_EVENT: Final = "slack:"
#: The external event ids a channel's catch-up reads back from, by channel (each has a
#: partial index of its own: ``leadgate.database.schema.catch_up_predicate``).
CATCH_UP_EVENTS: Final[Mapping[BindingKind, str]] = MappingProxyType(
    {BindingKind.discord: DISCORD_MESSAGE_EVENT, BindingKind.slack: SLACK_MESSAGE_EVENT}
)


@dataclass(frozen=True)
class Conversations:
    """What the store knows of one channel's conversations, where a catch-up of the
    messages the platform delivered to no process starts (Discord's gateway, Slack)."""

    #: the clock's now minus the window asked for: nothing older is caught up
    since_ms: int
    #: each session of the channel that took in events of the kind asked for (by
    #: session key) -> those recorded in it since ``since_ms`` (empty: none lately)
    sessions: dict[str, tuple[str, ...]]
    #: the match keys of the channel's active routes, oldest route first
    routes: tuple[dict[str, str], ...]
    #: the clock's now when this was read: a channel read through by the catch-up that
    #: asked has had every message posted before it read
    read_at_ms: int = 0
    #: where each channel's next catch-up starts (epoch ms), by conversation (Discord's
    #: channel id, Slack's ``TEAM:CHANNEL``), for those that have a point stored
    points: Mapping[str, int] = field(default_factory=dict)
    #: those of ``points`` stored by a catch-up that read the conversation through (the
    #: next may start from the newest message taken in there since, when later)
    read_through: frozenset[str] = frozenset()
    #: when each of ``points`` was last written (the clock's epoch ms): a point not read
    #: through that a live message kept for the read-back left where an earlier one's
    #: was is older than the message, which is within the window when this is
    written_at: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Inbound:
    """One message that arrived on a channel, before any route is known.

    ``route_attrs`` are the channel's route match keys (slack ``team``/``channel``,
    discord ``guild``/``channel``, and ``parent`` in a thread, teams
    ``tenant``/``conversation``, email ``address``/``sender``); ``address`` is where
    replies go (see :class:`BindingSpec`);
    ``external_event_id`` de-duplicates the platform's redeliveries.
    """

    channel: BindingKind
    route_attrs: dict[str, str]
    session_key: str
    text: str
    address: dict[str, Any]
    external_event_id: str

    def trigger(self, route: RouteMatch) -> Trigger:
        """The trigger for this message once ``route`` answers it."""
        return Trigger(
            org_id=route.org_id,
            agent_id=route.agent_id,
            session_key=self.session_key,
            text=self.text,
            binding=BindingSpec(
                kind=self.channel,
                address=self.address,
                silent=route.silent,
                route_id=route.route_id,
            ),
            external_event_id=self.external_event_id,
        )


@dataclass(frozen=True)
class Routed:
    """What became of an :class:`Inbound` that a route answered."""

    outcome: Outcome
    route: RouteMatch


@dataclass(frozen=True)
class Recorded:
    """An :class:`Inbound` taken in durably, before the platform is answered.

    ``outcome`` is set when no turn runs (busy, duplicate); ``rejected`` is the rule the
    message itself broke (too long, NUL: the person was sent :func:`not_processed`);
    otherwise ``turn`` is the accepted turn (opaque outside the turn path) that
    ``run_recorded`` runs in the background. A process that dies before it finishes
    leaves a recorded run that the recovery runner takes over.
    """

    route: RouteMatch
    outcome: Outcome | None = None
    rejected: ValidationError | None = None
    turn: Any = None


def not_processed(refused: LeadgateError) -> str:
    """The notice a person is sent for a message that broke a message rule, naming the
    rule as every other refusal does (``... [message.too_long]``): the chat channels
    and email show it, Discord in its ephemeral answer (also for an ``/ask`` refused
    otherwise: its worker deactivated, ``agent.inactive``). It quotes nothing of the
    message, and it is posted, never logged."""
    return f"Your message was not processed: {refused.message} [{refused.rule}]."
