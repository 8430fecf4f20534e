"""A cheap change cursor over one organization's work items, for live operator views.

Every state change of a work item writes an audit row in its own transaction (a
transition, a delivery becoming uncertain, a recovery), so "something changed" is "the
organization's audit rows changed". The mark is two index-only reads on
``ix_audit_org_created``: the newest ``created_at`` and how many rows lie in the
``SKEW_MS`` before it. A row committed later than a newer one (another replica whose
clock is behind, or a long transaction) still lands inside that window and changes the
count, so a mark works across replicas and restarts without any notification channel.
"""

from __future__ import annotations

from typing import NamedTuple

import sqlalchemy as sa

from leadgate.database import schema as t
from leadgate.database.db import Conn

AU = t.audit.c
#: How far behind the newest row a late commit may be and still be noticed.
SKEW_MS = 60_000
#: At most this many item ids per change; more means "refresh everything".
MAX_ITEMS = 200


class Mark(NamedTuple):
    """Where an organization's audit trail stands."""

    newest: int
    recent: int

    def token(self) -> str:
        """The mark as an SSE event id."""
        return f"{self.newest}-{self.recent}"


async def mark(conn: Conn, org_id: str) -> Mark:
    """The organization's current mark."""
    newest = await conn.scalar(sa.select(sa.func.max(AU.created_at)).where(AU.org_id == org_id))
    if newest is None:
        return Mark(0, 0)
    recent = await conn.scalar(
        sa.select(sa.func.count())
        .select_from(t.audit)
        .where(AU.org_id == org_id, AU.created_at >= newest - SKEW_MS)
    )
    return Mark(int(newest), int(recent or 0))


async def changed_items(conn: Conn, org_id: str, since: Mark) -> list[str] | None:
    """Ids of the items with audit rows since ``since`` (a superset: rows up to
    ``SKEW_MS`` older are included), or ``None`` when there are more than ``MAX_ITEMS``."""
    rows = await conn.execute(
        sa.select(AU.work_item_id)
        .where(
            AU.org_id == org_id,
            AU.created_at >= since.newest - SKEW_MS,
            AU.work_item_id.is_not(None),
        )
        .distinct()
        .limit(MAX_ITEMS + 1)
    )
    ids = [str(r.work_item_id) for r in rows]
    return None if len(ids) > MAX_ITEMS else ids
