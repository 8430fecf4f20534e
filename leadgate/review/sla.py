"""Reminders, escalation and expiry of items waiting for a human (the SLA runner).

Each open review episode (:mod:`leadgate.review.cards`) carries its timers, fixed when it
opened from ``[review]`` and the ``leadgate notify sla`` overrides: ``next_remind_at``
(then every ``remind_every_ms``, when set), ``escalate_at`` (once, to the escalate
tier's destinations) and ``expire_at`` (awaitingHuman only: a deliveryUnknown item is
reminded about, never expired; a human must say what happened).

Exactly once, across replicas and restarts: every firing is one transaction that moves
the episode's timers with a fenced ``UPDATE ... WHERE id = :id AND due_at = :seen AND
closed_at IS NULL`` and writes the cards of that firing; a second runner that read the
same episode matches no row and writes nothing. An expiry first moves the work item
(fenced on ``awaitingHuman``, the same lock order as a human decision, which moves the
item and then closes the episode), so a decision and an expiry racing each other make
exactly one outcome. Time comes from the injectable clock.
"""

from __future__ import annotations

import logging
from typing import Any

import sqlalchemy as sa

from leadgate.core.clock import Clock, IdFactory
from leadgate.core.errors import NotFound, TransitionError
from leadgate.core.metrics import METRICS
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database
from leadgate.domain import workitems
from leadgate.domain.workitems import Status
from leadgate.review import decisions
from leadgate.review.cards import ReviewNotifier, earliest
from outbox.store import Outbox

log = logging.getLogger("leadgate.review.sla")
E = t.review_episodes.c


class SlaRunner:
    """Fires due reminders, escalations and expiries (see the module docstring)."""

    name = "review-sla"

    def __init__(
        self,
        db: Database,
        clock: Clock,
        ids: IdFactory,
        outbox: Outbox,
        notifier: ReviewNotifier,
        *,
        batch: int = 100,
    ) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.outbox = outbox
        self.notifier = notifier
        self.batch = batch

    async def run_once(self) -> bool:
        """Fire what is due now (one batch of episodes); True when anything fired."""
        now = self.clock.now_ms()
        async with self.db.read() as conn:
            due = (
                await conn.execute(
                    sa.select(t.review_episodes)
                    .where(E.closed_at.is_(None), E.due_at <= now)
                    .order_by(E.due_at, E.id)
                    .limit(self.batch)
                )
            ).all()
        fired = 0
        for episode in due:
            try:
                async with self.db.tx() as conn:
                    fired += await self._fire(conn, episode, now)
            except TransitionError:
                continue  # decided meanwhile: that decision closed the episode
        return fired > 0

    async def _fire(self, conn: Conn, ep: Any, now: int) -> int:
        if ep.expire_at is not None and ep.expire_at <= now:
            return await self._expire(conn, ep)
        purposes: list[str] = []
        next_remind = ep.next_remind_at
        reminders = ep.reminders
        escalate_at, escalated_at = ep.escalate_at, ep.escalated_at
        if next_remind is not None and next_remind <= now:
            purposes.append("reminder")
            reminders += 1
            every = ep.remind_every_ms
            if every:
                while next_remind <= now:  # one reminder for any number of missed ones
                    next_remind += every
            else:
                next_remind = None
        if escalate_at is not None and escalate_at <= now:
            purposes.append("escalation")
            escalate_at, escalated_at = None, now
        moved = await conn.execute(
            t.review_episodes.update()
            .where(E.id == ep.id, E.closed_at.is_(None), E.due_at == ep.due_at)
            .values(
                next_remind_at=next_remind,
                reminders=reminders,
                escalate_at=escalate_at,
                escalated_at=escalated_at,
                due_at=earliest(next_remind, escalate_at, ep.expire_at),
            )
        )
        if not moved.rowcount:
            return 0  # another runner fired it, or a decision closed it
        for purpose in purposes:
            await self.notifier.post_again(conn, ep, purpose)
            (METRICS.reminders if purpose == "reminder" else METRICS.escalations).inc()
            log.info("review %s: %s for work item %s", ep.id, purpose, ep.work_item_id)
        return len(purposes)

    async def _expire(self, conn: Conn, ep: Any) -> int:
        try:
            item = await workitems.get(conn, ep.work_item_id)
        except NotFound:
            item = None
        if item is None or item.status != Status.awaitingHuman.value:
            # Should not happen (every way out of awaitingHuman closes the episode).
            await conn.execute(
                t.review_episodes.update()
                .where(E.id == ep.id, E.closed_at.is_(None))
                .values(closed_at=self.clock.now_ms(), due_at=None, outcome="stale")
            )
            return 0
        await decisions.expire(conn, self.outbox, item, int(ep.expire_after_ms or 0))
        METRICS.expiries.inc()
        log.info("work item %s expired after waiting for a decision", item.id)
        return 1
