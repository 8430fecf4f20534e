"""The outbox relay: claims due deliveries in batches, posts them, commits outcomes.

One relay per process (several per PostgreSQL cluster). A claim is a fenced batch update
(``pending -> sending`` with a lease token and a send lease); on PostgreSQL the rows are
chosen with ``FOR UPDATE SKIP LOCKED`` so replicas never claim the same row, on SQLite
``BEGIN IMMEDIATE`` serializes claims. Outcomes are committed in one transaction per
batch, each row fenced by its lease token, together with the work item's move to
``completed`` / ``failed``. A ``sending`` row whose lease expired means a relay died
mid-send: for a channel post that is an uncertain send (``deliveryUnknown``), never
retried automatically; internal actions (reveal, silent, scheduled) are idempotent and
simply go back to ``pending``.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from engine import schema as t
from engine import workitems
from engine.clock import Clock, IdFactory
from engine.db import Database
from engine.errors import TransitionError
from engine.metrics import METRICS
from engine.workitems import Status
from outbox.channel import Channel, OutboundMessage, Permanent, Retry, SendOutcome, Sent, Uncertain
from outbox.store import DeliveryStatus

log = logging.getLogger("leadgate.relay")
D = t.deliveries.c

SEND_LEASE_MS = 120_000
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 300.0
INTERNAL_ACTIONS = frozenset({"reveal", "silent", "scheduled"})


def split_text(text: str, limit: int) -> list[str]:
    """Split ``text`` into parts of at most ``limit`` characters, on line breaks or
    spaces where possible. Nothing is dropped: ``"".join`` of the parts, modulo the
    break characters, gives the text back."""
    if len(text) <= limit:
        return [text]
    parts: list[str] = []
    rest = text
    while len(rest) > limit:
        cut = rest.rfind("\n", 0, limit)
        if cut < limit // 2:
            cut = rest.rfind(" ", 0, limit)
        if cut < limit // 2:
            cut = limit
        parts.append(rest[:cut])
        rest = rest[cut:].lstrip("\n ") if cut < limit else rest[cut:]
    if rest:
        parts.append(rest)
    return parts


@dataclass
class _Done:
    row: dict[str, Any]
    outcome: SendOutcome


class Relay:
    """Drains the outbox. ``run_once`` handles one batch; the runner loop repeats it."""

    name = "outbox-relay"

    def __init__(
        self,
        db: Database,
        clock: Clock,
        ids: IdFactory,
        channels: dict[str, Channel],
        *,
        batch: int = 100,
        concurrency: int = 64,
        max_attempts: int = 8,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.channels = channels
        self.batch = batch
        self.max_attempts = max_attempts
        self.rand = rand
        self._sem = asyncio.Semaphore(concurrency)

    async def run_once(self) -> bool:
        """Expire send leases, claim one batch, deliver it. True when it did work."""
        expired = await self.expire_send_leases()
        rows = await self.claim()
        if not rows:
            return expired > 0
        done = await asyncio.gather(*(self._deliver(row) for row in rows))
        await self.complete(list(done))
        return True

    async def expire_send_leases(self) -> int:
        """A relay died mid-send: posts become deliveryUnknown, internal ones pending."""
        now = self.clock.now_ms()
        async with self.db.tx() as conn:
            rows = (
                await conn.execute(
                    sa.select(D.id, D.action, D.lease_token, D.org_id, D.work_item_id).where(
                        D.status == DeliveryStatus.sending.value, D.lease_expires_at < now
                    )
                )
            ).all()
            for row in rows:
                internal = row.action in INTERNAL_ACTIONS
                status = DeliveryStatus.pending if internal else DeliveryStatus.deliveryUnknown
                res = await conn.execute(
                    t.deliveries.update()
                    .where(D.id == row.id, D.lease_token == row.lease_token)
                    .values(
                        status=status.value,
                        lease_token=None,
                        lease_expires_at=None,
                        updated_at=now,
                        error=None
                        if internal
                        else "send lease expired: the relay stopped "
                        "mid-send; the message may or may not have been posted",
                    )
                )
                if res.rowcount and not internal:
                    METRICS.deliveries.labels("unknown", "deliveryUnknown").inc()
                    await workitems.audit(
                        conn,
                        self.clock,
                        self.ids,
                        org_id=row.org_id,
                        actor="system:relay",
                        action="deliveryUnknown",
                        work_item_id=row.work_item_id,
                        delivery_id=row.id,
                        text="send lease expired",
                    )
        return len(rows)

    async def claim(self) -> list[dict[str, Any]]:
        """Claim up to ``batch`` due deliveries (fenced; SKIP LOCKED on PostgreSQL)."""
        now = self.clock.now_ms()
        token = self.ids.new("lease")
        async with self.db.tx() as conn:
            due = self.db.skip_locked(
                sa.select(D.id)
                .where(D.status == DeliveryStatus.pending.value, D.next_attempt_at <= now)
                .order_by(D.next_attempt_at, D.id)
                .limit(self.batch)
            )
            rows = (
                await conn.execute(
                    t.deliveries.update()
                    .where(
                        D.id.in_(due.scalar_subquery()), D.status == DeliveryStatus.pending.value
                    )
                    .values(
                        status=DeliveryStatus.sending.value,
                        lease_token=token,
                        lease_expires_at=now + SEND_LEASE_MS,
                        attempts=D.attempts + 1,
                        updated_at=now,
                    )
                    .returning(*t.deliveries.c)
                )
            ).all()
        return [dict(r._mapping) for r in rows]

    async def _deliver(self, row: dict[str, Any]) -> _Done:
        if row["action"] in INTERNAL_ACTIONS:
            return _Done(row, Sent())
        channel = self.channels.get(row["channel"])
        if row["channel"] == "none" or not row["binding_id"]:
            return _Done(row, Permanent("no active binding for the session"))
        if channel is None:
            return _Done(row, Permanent(f"channel {row['channel']} is not configured"))
        if not row["text"]:
            return _Done(row, Sent())
        parts = split_text(row["text"], channel.max_chars)
        external: str | None = None
        async with self._sem:
            for index, part in enumerate(parts):
                key = row["id"] if index == 0 else f"{row['id']}.{index}"
                try:
                    outcome = await channel.send(
                        OutboundMessage(
                            delivery_id=row["id"],
                            idempotency_key=key,
                            address=row["address"],
                            text=part,
                            kind=row["kind"],
                        )
                    )
                except Exception as exc:  # an adapter bug must not lose the delivery
                    log.exception("channel %s raised instead of mapping an error", row["channel"])
                    outcome = Uncertain(f"adapter error: {type(exc).__name__}")
                if not isinstance(outcome, Sent):
                    if index > 0:
                        # Earlier parts are posted: resending would duplicate them.
                        return _Done(
                            row,
                            Uncertain(
                                f"part {index + 1} of {len(parts)}: {getattr(outcome, 'error', '')}"
                            ),
                        )
                    return _Done(row, outcome)
                external = external or outcome.external_id
        return _Done(row, Sent(external))

    def backoff_s(self, attempts: int, retry_after: float | None) -> float:
        """Exponential backoff with full jitter, never sooner than Retry-After."""
        base = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** max(0, attempts - 1))
        delay = base * (0.5 + 0.5 * self.rand())
        return float(max(delay, retry_after or 0.0))

    async def complete(self, done: list[_Done]) -> None:
        """Commit a batch of outcomes in one transaction."""
        now = self.clock.now_ms()
        async with self.db.tx() as conn:
            for item in done:
                await self._commit_one(conn, item.row, item.outcome, now)

    async def _commit_one(
        self, conn: AsyncConnection, row: dict[str, Any], outcome: SendOutcome, now: int
    ) -> None:
        values: dict[str, Any] = {"lease_token": None, "lease_expires_at": None, "updated_at": now}
        item_dst: Status | None = None
        label = type(outcome).__name__.lower()
        if isinstance(outcome, Sent):
            values.update(
                status=DeliveryStatus.sent.value, external_id=outcome.external_id, error=None
            )
            item_dst = Status.completed
        elif isinstance(outcome, Retry):
            if row["attempts"] >= self.max_attempts:
                values.update(
                    status=DeliveryStatus.failed.value,
                    error=f"gave up after {row['attempts']} attempts: {outcome.error}",
                )
                item_dst = Status.failed
                label = "failed"
            else:
                delay = self.backoff_s(row["attempts"], outcome.delay_s)
                values.update(
                    status=DeliveryStatus.pending.value,
                    error=outcome.error,
                    next_attempt_at=now + int(delay * 1000),
                )
        elif isinstance(outcome, Permanent):
            values.update(status=DeliveryStatus.failed.value, error=outcome.error)
            item_dst = Status.failed
        else:
            values.update(status=DeliveryStatus.deliveryUnknown.value, error=outcome.error)
            label = "deliveryUnknown"
        res = await conn.execute(
            t.deliveries.update()
            .where(
                D.id == row["id"],
                D.lease_token == row["lease_token"],
                D.status == DeliveryStatus.sending.value,
            )
            .values(**values)
        )
        METRICS.deliveries.labels(row["channel"], label).inc()
        if not res.rowcount:
            log.warning("delivery %s: send lease lost before commit", row["id"])
            return
        if row["action"] == "reveal" and isinstance(outcome, Sent):
            await conn.execute(
                t.messages.update()
                .where(
                    t.messages.c.id
                    == sa.select(t.work_items.c.gated_message_id)
                    .where(t.work_items.c.id == row["work_item_id"])
                    .scalar_subquery()
                )
                .values(lead_gated=False)
            )
        if row["kind"] != "gating" or row["work_item_id"] is None:
            return
        if item_dst is None:
            if values["status"] == DeliveryStatus.deliveryUnknown.value:
                await workitems.audit(
                    conn,
                    self.clock,
                    self.ids,
                    org_id=row["org_id"],
                    actor="system:relay",
                    action="deliveryUnknown",
                    work_item_id=row["work_item_id"],
                    delivery_id=row["id"],
                    text=values.get("error"),
                )
            return
        try:
            await workitems.transition(
                conn,
                self.clock,
                self.ids,
                row["work_item_id"],
                src=Status.approved,
                dst=item_dst,
                actor="system:relay",
                action="delivered" if item_dst == Status.completed else "deliveryFailed",
                text=values.get("error"),
            )
        except TransitionError:
            log.warning(
                "work item %s was not approved when its delivery finished", row["work_item_id"]
            )
