"""Test helpers that create real rows through the real engine functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from engine import agents as agents_mod
from engine import orgs, workitems
from engine import schema as t
from engine.auth import Principal, Scope
from engine.service import Service
from engine.types import BindingKind, BindingSpec, Trigger
from outbox.store import for_item


@dataclass
class Org:
    """An organization with its Owner key and principal."""

    id: str
    key: str
    principal: Principal


async def make_org(service: Service, name: str = "acme") -> Org:
    """Create an organization (Owner key with every scope)."""
    async with service.db.tx() as conn:
        org = await orgs.create_org(conn, service.clock, service.ids, name)
    async with service.db.read() as conn:
        principal = await orgs.authenticate_key(conn, org["apiKey"])
    assert principal is not None
    return Org(org["id"], org["apiKey"], principal)


async def make_key(service: Service, org: Org, *scopes: Scope) -> str:
    """A key with exactly ``scopes``."""
    async with service.db.tx() as conn:
        key = await orgs.create_key(conn, service.clock, service.ids, org.id, frozenset(scopes))
    return str(key["key"])


async def make_agent(service: Service, org: Org, name: str, **kwargs: Any) -> dict[str, Any]:
    """Create an agent (``lead=``, ``review_config=``, ``preset=`` as in save_agent)."""
    kwargs.setdefault("model", "script")
    async with service.db.tx() as conn:
        return await agents_mod.save_agent(
            conn, service.clock, service.ids, org.id, name=name, **kwargs
        )


def api_trigger(org: Org, agent: dict[str, Any], text: str, session: str = "s1") -> Trigger:
    """A REST-like trigger (api binding) for ``agent``."""
    return Trigger(
        org_id=org.id,
        agent_id=agent["id"],
        session_key=session,
        text=text,
        binding=BindingSpec(BindingKind.api),
    )


async def item_row(service: Service, item_id: str) -> dict[str, Any]:
    """A work item as stored."""
    async with service.db.read() as conn:
        return await workitems.get(conn, item_id)


async def item_deliveries(service: Service, item_id: str) -> list[dict[str, Any]]:
    """A work item's delivery rows, oldest first."""
    async with service.db.read() as conn:
        return await for_item(conn, item_id)


async def item_audit(service: Service, item_id: str) -> list[dict[str, Any]]:
    """A work item's audit rows, oldest first."""
    a = t.audit.c
    async with service.db.read() as conn:
        rows = (
            await conn.execute(
                sa.select(t.audit).where(a.work_item_id == item_id).order_by(a.created_at, a.id)
            )
        ).all()
    return [dict(r._mapping) for r in rows]
