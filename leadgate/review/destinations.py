"""Where review cards go (``leadgate notify add``), and when reminders, escalations and
expiries fire (``leadgate notify sla``).

Destinations belong to an organization, optionally to one agent, in one of two tiers:
``notify`` (cards when an item starts waiting, and reminders) and ``escalate`` (cards
after ``escalate_after``). An agent that has destinations of its own in a tier uses
those instead of the organization's for that tier.

Targets (``--to``) per channel:

* slack: a channel id (``C0123ABC``), or ``TEAM:CHANNEL`` (``T0123:C0456``). Ids, not
  ``#names``: ``chat.update`` needs the id to edit the card later.
* discord: a channel id (snowflake), or ``GUILD:CHANNEL``.
* email: an address.
* teams: a conversation id (``19:...@thread.tacv2``) that the bot has seen: leadgate
  keeps the Bot Framework conversation reference of every conversation it receives an
  activity from (adding the app to a channel sends one; so does any @mention), and the
  card is posted with that reference. Or a whole conversation reference as JSON
  (``{"serviceUrl": ..., "conversation": {"id": ...}, ...}``).

SLA settings: per organization (``agent_id`` "") and per agent, each field NULL to
inherit (agent, then organization, then ``[review]`` in the configuration), 0 for off.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NamedTuple, TypedDict

import sqlalchemy as sa

from leadgate.core.clock import Clock, IdFactory, iso
from leadgate.core.config import ReviewSettings
from leadgate.core.durations import format_duration
from leadgate.core.errors import NotFound, ValidationError, quoted
from leadgate.database import schema as t
from leadgate.database.db import Conn

RD = t.review_destinations.c
SLA = t.review_sla.c
TC = t.teams_conversations.c
CHANNELS = ("slack", "teams", "discord", "email")
TIERS = ("notify", "escalate")
SLA_FIELDS = ("remind_after", "remind_every", "escalate_after", "expire_after")

_SLACK_ID = re.compile(r"[A-Z0-9]{2,30}")
_SNOWFLAKE = re.compile(r"\d{5,25}")
_EMAIL = re.compile(r"[^@\s<>]+@[^@\s<>]+\.[^@\s<>]+")


class ReviewDestinationView(TypedDict):
    """A review card destination as the CLI prints it (``agent``: its agent's name,
    ``None`` for the organization's)."""

    id: str
    channel: str
    to: str
    tier: str
    agent: str | None
    createdAt: str | None


class SlaView(TypedDict):
    """Review timers as operators write them (a duration, ``off``; an override's
    unset timer is ``inherit``)."""

    remindAfter: str
    remindEvery: str
    escalateAfter: str
    expireAfter: str


class Destination(NamedTuple):
    """One place review cards go (``review_destinations``)."""

    id: str
    org_id: str
    agent_id: str | None
    channel: str
    tier: str
    target: str
    address: dict[str, Any]
    created_at: int

    @classmethod
    def from_row(cls, row: Any) -> Destination:
        """From a ``SELECT review_destinations`` row."""
        return cls._make(row)

    def view(self, agent_name: str | None = None) -> ReviewDestinationView:
        """The CLI's JSON."""
        return {
            "id": self.id,
            "channel": self.channel,
            "to": self.target,
            "tier": self.tier,
            "agent": agent_name,
            "createdAt": iso(self.created_at),
        }


@dataclass(frozen=True)
class Sla:
    """Effective review timers of one agent's items (milliseconds; ``None`` = off)."""

    remind_after_ms: int | None
    remind_every_ms: int | None
    escalate_after_ms: int | None
    expire_after_ms: int | None

    def view(self) -> SlaView:
        """Durations as operators write them."""
        return {
            "remindAfter": format_duration(self.remind_after_ms),
            "remindEvery": format_duration(self.remind_every_ms),
            "escalateAfter": format_duration(self.escalate_after_ms),
            "expireAfter": format_duration(self.expire_after_ms),
        }


# ----------------------------------------------------------------------- targets


async def parse_target(conn: Conn, channel: str, target: str) -> dict[str, Any]:
    """The card address for ``--to TARGET`` on ``channel`` (see the module docstring)."""
    target = target.strip()
    if channel == "slack":
        team, _, chan = target.rpartition(":")
        if not _SLACK_ID.fullmatch(chan) or (team and not _SLACK_ID.fullmatch(team)):
            raise ValidationError(
                "a Slack target is a channel id (C0123ABC) or TEAM:CHANNEL (T0123:C0456)",
                rule="notify.target",
            )
        return {"team": team, "channel": chan}
    if channel == "discord":
        guild, _, chan = target.rpartition(":")
        if not _SNOWFLAKE.fullmatch(chan) or (guild and not _SNOWFLAKE.fullmatch(guild)):
            raise ValidationError(
                "a Discord target is a channel id, or GUILD:CHANNEL (numeric ids)",
                rule="notify.target",
            )
        return {"channel_id": chan, "guild_id": guild or None}
    if channel == "email":
        if not _EMAIL.fullmatch(target) or len(target) > 320:
            raise ValidationError("an email target is an address", rule="notify.target")
        return {"to": target.lower()}
    if channel == "teams":
        return {"reference": await _teams_reference(conn, target)}
    raise ValidationError("channel must be slack, teams, discord or email", rule="notify.channel")


async def _teams_reference(conn: Conn, target: str) -> dict[str, Any]:
    if target.startswith("{"):
        try:
            reference = json.loads(target)
        except ValueError:
            raise ValidationError(
                "the Teams conversation reference is not valid JSON", rule="notify.target"
            ) from None
        conversation = reference.get("conversation") if isinstance(reference, dict) else None
        if not (
            isinstance(reference, dict)
            and isinstance(reference.get("serviceUrl"), str)
            and isinstance(conversation, dict)
            and isinstance(conversation.get("id"), str)
        ):
            raise ValidationError(
                "a Teams conversation reference needs serviceUrl and conversation.id",
                rule="notify.target",
            )
        return reference
    row = (await conn.execute(sa.select(TC.reference).where(TC.conversation_id == target))).first()
    if row is None:
        raise ValidationError(
            f"leadgate has not seen Teams conversation {quoted(target)} yet: add the app to that "
            "channel (or @mention it there once), then run this again; or pass the whole "
            "conversation reference as JSON",
            rule="notify.teams_unknown_conversation",
        )
    return dict(row.reference)


def _fits(value: object, length: int) -> bool:
    return isinstance(value, str) and 0 < len(value) <= length and value.isprintable()


async def remember_teams_conversation(conn: Conn, clock: Clock, reference: dict[str, Any]) -> None:
    """Keep the latest conversation reference of a Teams conversation (upsert)."""
    conversation = reference.get("conversation") or {}
    conversation_id = conversation.get("id")
    # Ids as the columns hold them: printable (PostgreSQL text cannot hold the NUL an
    # unauthenticated local-mode activity may carry) and within the column's length.
    if not _fits(conversation_id, 300):
        return
    tenant = conversation.get("tenantId") or conversation.get("tenantID")
    if not _fits(tenant, 100):
        tenant = None
    now = clock.now_ms()
    res = await conn.execute(
        t.teams_conversations.update()
        .where(TC.conversation_id == conversation_id)
        .values(reference=reference, tenant_id=tenant, updated_at=now)
    )
    if not res.rowcount:
        await conn.execute(
            t.teams_conversations.insert().values(
                conversation_id=conversation_id,
                tenant_id=tenant,
                reference=reference,
                updated_at=now,
            )
        )


# ------------------------------------------------------------------ destinations


async def add_destination(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    *,
    org_id: str,
    agent_id: str | None,
    channel: str,
    target: str,
    tier: str = "notify",
) -> Destination:
    """Add one destination (the same channel and target twice in a scope is one)."""
    if channel not in CHANNELS:
        raise ValidationError(
            "channel must be slack, teams, discord or email", rule="notify.channel"
        )
    if tier not in TIERS:
        raise ValidationError("tier must be notify or escalate", rule="notify.tier")
    address = await parse_target(conn, channel, target)
    if channel == "teams":
        # A whole conversation reference is kept in the address; its id names it.
        target = str(address["reference"]["conversation"]["id"])
    if len(target.strip()) > 500:
        raise ValidationError("the target is longer than 500 characters", rule="notify.target")
    scope = RD.agent_id.is_(None) if agent_id is None else RD.agent_id == agent_id
    existing = (
        await conn.execute(
            sa.select(t.review_destinations).where(
                RD.org_id == org_id,
                scope,
                RD.channel == channel,
                RD.tier == tier,
                RD.target == target.strip(),
            )
        )
    ).first()
    if existing is not None:
        return Destination.from_row(existing)
    values: dict[str, Any] = {
        "id": ids.new("rdst"),
        "org_id": org_id,
        "agent_id": agent_id,
        "channel": channel,
        "tier": tier,
        "target": target.strip(),
        "address": address,
        "created_at": clock.now_ms(),
    }
    await conn.execute(t.review_destinations.insert().values(**values))
    return Destination(**values)


async def remove_destination(conn: Conn, org_id: str, destination_id: str) -> None:
    """Remove one destination (404 for another organization's)."""
    res = await conn.execute(
        t.review_destinations.delete().where(RD.id == destination_id, RD.org_id == org_id)
    )
    if not res.rowcount:
        raise NotFound(f"no review destination {quoted(destination_id)}", rule="notify.not_found")


async def list_destinations(conn: Conn, org_id: str) -> list[Destination]:
    """Every destination of the organization, oldest first."""
    rows = (
        await conn.execute(
            sa.select(t.review_destinations)
            .where(RD.org_id == org_id)
            .order_by(RD.created_at, RD.id)
        )
    ).all()
    return [Destination.from_row(r) for r in rows]


_DESTINATIONS = (
    sa.select(t.review_destinations)
    .where(
        RD.org_id == sa.bindparam("p_org"),
        RD.tier == sa.bindparam("p_tier"),
        sa.or_(RD.agent_id.is_(None), RD.agent_id == sa.bindparam("p_agent")),
    )
    .order_by(RD.created_at, RD.id)
)


async def destinations_for(conn: Conn, org_id: str, agent_id: str, tier: str) -> list[Destination]:
    """Where ``tier`` cards of ``agent_id``'s items go: the agent's own destinations of
    that tier if it has any, else the organization's."""
    rows = [
        Destination.from_row(r)
        for r in (
            await conn.execute(
                _DESTINATIONS, {"p_org": org_id, "p_tier": tier, "p_agent": agent_id}
            )
        ).all()
    ]
    own = [d for d in rows if d.agent_id == agent_id]
    return own or [d for d in rows if d.agent_id is None]


# ------------------------------------------------------------------------- SLA


async def set_sla(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    *,
    org_id: str,
    agent_id: str | None,
    changes: dict[str, int | str | None],
) -> SlaView:
    """Change an override: each of :data:`SLA_FIELDS` maps to milliseconds, ``None``
    (off) or ``"inherit"``; fields not given keep their value."""
    scope = agent_id or ""
    row = (
        await conn.execute(
            sa.select(t.review_sla).where(SLA.org_id == org_id, SLA.agent_id == scope)
        )
    ).first()
    values: dict[str, Any] = {}
    for name, value in changes.items():
        if name not in SLA_FIELDS:
            raise ValidationError(f"unknown SLA setting {name}", rule="notify.sla")
        values[f"{name}_ms"] = None if value == "inherit" else (value or 0)
    now = clock.now_ms()
    if row is None:
        await conn.execute(
            t.review_sla.insert().values(
                id=ids.new("rsla"),
                org_id=org_id,
                agent_id=scope,
                created_at=now,
                updated_at=now,
                **{**{f"{n}_ms": None for n in SLA_FIELDS}, **values},
            )
        )
    elif values:
        await conn.execute(
            t.review_sla.update().where(SLA.id == row.id).values(updated_at=now, **values)
        )
    return await sla_view(conn, org_id, agent_id)


async def sla_view(conn: Conn, org_id: str, agent_id: str | None) -> SlaView:
    """The stored override of a scope (``inherit`` where unset)."""
    row = (
        await conn.execute(
            sa.select(t.review_sla).where(SLA.org_id == org_id, SLA.agent_id == (agent_id or ""))
        )
    ).first()

    def shown(name: str) -> str:
        value = getattr(row, f"{name}_ms") if row is not None else None
        return "inherit" if value is None else format_duration(value or None)

    # The keys in SLA_FIELDS' order, camel-cased.
    return {
        "remindAfter": shown("remind_after"),
        "remindEvery": shown("remind_every"),
        "escalateAfter": shown("escalate_after"),
        "expireAfter": shown("expire_after"),
    }


_SLA_ROWS = sa.select(t.review_sla).where(
    SLA.org_id == sa.bindparam("p_org"),
    SLA.agent_id.in_(sa.bindparam("p_agents", expanding=True)),
)


async def effective_sla(conn: Conn, org_id: str, agent_id: str, defaults: ReviewSettings) -> Sla:
    """The timers that apply to ``agent_id``'s items: agent override, organization
    override, then ``[review]``."""
    rows = {
        r.agent_id: r
        for r in (
            await conn.execute(_SLA_ROWS, {"p_org": org_id, "p_agents": ["", agent_id]})
        ).all()
    }
    resolved: dict[str, int | None] = {}
    for name in SLA_FIELDS:
        value: int | None = None
        for scope in (agent_id, ""):
            row = rows.get(scope)
            stored = getattr(row, f"{name}_ms") if row is not None else None
            if stored is not None:
                value = int(stored) or None
                break
        else:
            value = defaults.ms(name)
        resolved[f"{name}_ms"] = value
    return Sla(**resolved)
