"""Operators' read-only views beyond the queue: insights and the live change feed.

Both require ``agent:review`` and are confined to the caller's organization.
"""

from __future__ import annotations

from typing import TypedDict

from leadgate.core.auth import Principal, Scope
from leadgate.core.clock import Clock
from leadgate.database.db import Database
from leadgate.review import changes, insights, queue
from leadgate.review.changes import Mark
from leadgate.review.insights import InsightsView


class ChangesView(TypedDict):
    """Which items changed (``None``: too many, refresh all) and the queue's size."""

    items: list[str] | None
    queue: int


class Oversight:
    """Insights (:mod:`leadgate.review.insights`) and change marks
    (:mod:`leadgate.review.changes`) for the operator API and the console."""

    def __init__(self, db: Database, clock: Clock) -> None:
        self.db = db
        self.clock = clock

    async def insights(self, principal: Principal, *, days: int = 30) -> InsightsView:
        """Decisions, time to decision, agreement, rounds and deliveries over ``days``."""
        principal.require(Scope.review)
        async with self.db.read() as conn:
            return await insights.insights(
                conn, principal.org_id, now_ms=self.clock.now_ms(), days=days
            )

    async def mark(self, principal: Principal) -> Mark:
        """Where the organization's audit trail stands now."""
        principal.require(Scope.review)
        async with self.db.read() as conn:
            return await changes.mark(conn, principal.org_id)

    async def changes(self, principal: Principal, since: Mark) -> ChangesView:
        """What changed since ``since``: item ids (``None``: too many, refresh all) and
        the size of the actionable queue."""
        principal.require(Scope.review)
        async with self.db.read() as conn:
            items = await changes.changed_items(conn, principal.org_id, since)
            size = await queue.queue_size(conn, principal.org_id)
        return {"items": items, "queue": size}

    async def queue_size(self, principal: Principal) -> int:
        """How many items wait in the actionable queue."""
        principal.require(Scope.review)
        async with self.db.read() as conn:
            return await queue.queue_size(conn, principal.org_id)
