"""The admin CLI's review-card operations: destinations (``notify add|list|remove``),
SLA overrides (``notify sla``) and reviewer links (``user link|unlink|links``).

Like :mod:`leadgate.operations.admin`, whoever can read the configuration can run these,
so they take no principal; each is one transaction calling the review layer / domain.
"""

from __future__ import annotations

from typing import Any, TypedDict

import sqlalchemy as sa

from leadgate.core.clock import Clock, IdFactory
from leadgate.core.config import ReviewSettings
from leadgate.core.durations import parse_duration
from leadgate.core.errors import ValidationError
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database
from leadgate.domain import agents as agents_mod
from leadgate.domain import links, orgs
from leadgate.domain.links import LinkView, ListedLinkView, UnlinkedView
from leadgate.review import destinations as dest
from leadgate.review.destinations import ReviewDestinationView, SlaView


class SlaPair(TypedDict):
    """A scope's stored override and the timers in effect."""

    override: SlaView
    effective: SlaView


class DestinationsView(TypedDict):
    """``notify list``: the destinations and the timers."""

    destinations: list[ReviewDestinationView]
    sla: SlaPair


class RemovedDestinationView(TypedDict):
    """``notify remove``: the destination removed."""

    id: str
    removed: bool


class SetSlaView(TypedDict):
    """``notify sla``: the scope's agent (``None``: the organization), its override and
    the timers in effect."""

    agent: str | None
    override: SlaView
    effective: SlaView


class ReviewSetup:
    """Review destinations, SLA overrides and reviewer links on ``db``."""

    def __init__(
        self, db: Database, clock: Clock, ids: IdFactory, defaults: ReviewSettings
    ) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.defaults = defaults

    async def _scope(
        self, conn: Any, org: str, agent: str | None
    ) -> tuple[str, str | None, str | None]:
        org_id = (await orgs.find_org(conn, org))["id"]
        if agent is None:
            return org_id, None, None
        found = await agents_mod.find_agent(conn, org_id, agent)
        return org_id, found.id, found.name

    async def add_destination(
        self, org: str, channel: str, target: str, *, agent: str | None, escalation: bool
    ) -> ReviewDestinationView:
        """Add a destination (``escalation``: the escalate tier)."""
        async with self.db.tx() as conn:
            org_id, agent_id, agent_name = await self._scope(conn, org, agent)
            added = await dest.add_destination(
                conn,
                self.clock,
                self.ids,
                org_id=org_id,
                agent_id=agent_id,
                channel=channel,
                target=target,
                tier="escalate" if escalation else "notify",
            )
            return added.view(agent_name)

    async def list_destinations(self, org: str, agent: str | None) -> DestinationsView:
        """The organization's destinations, and the effective timers (of ``agent``'s
        items when given, else the organization's)."""
        async with self.db.read() as conn:
            org_id, agent_id, _ = await self._scope(conn, org, agent)
            names = await self._agent_names(conn, org_id)
            rows = await dest.list_destinations(conn, org_id)
            effective = await dest.effective_sla(conn, org_id, agent_id or "", self.defaults)
            return {
                "destinations": [
                    d.view(names.get(d.agent_id) if d.agent_id else None)
                    for d in rows
                    if agent_id is None or d.agent_id in (None, agent_id)
                ],
                "sla": {
                    "override": await dest.sla_view(conn, org_id, agent_id),
                    "effective": effective.view(),
                },
            }

    async def remove_destination(self, org: str, destination_id: str) -> RemovedDestinationView:
        """Remove a destination."""
        async with self.db.tx() as conn:
            org_id, _, _ = await self._scope(conn, org, None)
            await dest.remove_destination(conn, org_id, destination_id)
            return {"id": destination_id, "removed": True}

    async def set_sla(
        self, org: str, agent: str | None, settings: dict[str, str | None]
    ) -> SetSlaView:
        """Set timers of the organization (or one agent): each value a duration, ``off``
        or ``inherit``; ``None`` leaves that timer as it is."""
        changes: dict[str, int | str | None] = {}
        for name, raw in settings.items():
            if raw is None:
                continue
            if raw.strip().lower() == "inherit":
                changes[name] = "inherit"
            else:
                changes[name] = parse_duration(raw, name=f"--{name.replace('_', '-')}")
        if not changes:
            raise ValidationError(
                "give at least one of --remind-after, --remind-every, --escalate-after, "
                "--expire-after (a duration such as 30m, off, or inherit)",
                rule="notify.sla",
            )
        async with self.db.tx() as conn:
            org_id, agent_id, agent_name = await self._scope(conn, org, agent)
            override = await dest.set_sla(
                conn, self.clock, self.ids, org_id=org_id, agent_id=agent_id, changes=changes
            )
            effective = await dest.effective_sla(conn, org_id, agent_id or "", self.defaults)
            return {"agent": agent_name, "override": override, "effective": effective.view()}

    async def link(self, org: str, email: str, platform: str, identity: str) -> LinkView:
        """Link a platform identity to a user."""
        async with self.db.tx() as conn:
            org_id, _, _ = await self._scope(conn, org, None)
            return await links.link(
                conn,
                self.clock,
                self.ids,
                org_id=org_id,
                email=email,
                platform=platform,
                identity=identity,
            )

    async def unlink(self, org: str, email: str, platform: str, identity: str) -> UnlinkedView:
        """Remove a link."""
        async with self.db.tx() as conn:
            org_id, _, _ = await self._scope(conn, org, None)
            return await links.unlink(
                conn, org_id=org_id, email=email, platform=platform, identity=identity
            )

    async def links(self, org: str) -> list[ListedLinkView]:
        """The organization's links."""
        async with self.db.read() as conn:
            org_id, _, _ = await self._scope(conn, org, None)
            return await links.list_links(conn, org_id)

    async def _agent_names(self, conn: Conn, org_id: str) -> dict[str, str]:
        rows = (
            await conn.execute(
                sa.select(t.agents.c.id, t.agents.c.name).where(t.agents.c.org_id == org_id)
            )
        ).all()
        return {r.id: r.name for r in rows}
