"""The verdict commit path (lead and human share it) and the other human decisions.

Every decision is one transaction: a fenced status transition, its audit row and, for an
approval, the gating delivery row. ``completionPolicy`` is shown on the detail; nothing
here branches on it (SPEC 3).
"""

from __future__ import annotations

import enum
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from engine import workitems
from engine.clock import Clock, IdFactory
from engine.errors import ValidationError
from engine.workitems import Status
from outbox.store import cancel_for_item, enqueue_gating

REASON_LIMIT = 2_000
FEEDBACK_LIMIT = 10_000


class Verdict(enum.StrEnum):
    """What a lead (or a human approving) decides."""

    approved = "approved"
    changesRequested = "changesRequested"
    escalated = "escalated"


def rounds_remain(item: dict[str, Any]) -> bool:
    """A lead may send work back while ``revision < maxRevisionRounds + allowances``.

    A human's return adds one allowance and is itself a revision, so returns never eat
    into the lead's rounds.
    """
    return int(item["revision"]) < int(item["max_revision_rounds"]) + int(item["extra_allowance"])


async def commit_verdict(
    conn: AsyncConnection,
    clock: Clock,
    ids: IdFactory,
    item: dict[str, Any],
    verdict: Verdict,
    *,
    actor: str,
    feedback: str | None,
    src: Status,
    lease_token: str | None = None,
) -> dict[str, Any]:
    """Commit a verdict on ``item`` (currently ``src``); returns the updated row."""
    common = {"lease_token": None, "lease_expires_at": None}
    if verdict == Verdict.approved:
        row = await workitems.transition(
            conn,
            clock,
            ids,
            item["id"],
            src=src,
            dst=Status.approved,
            actor=actor,
            action="approve",
            text=feedback,
            lease_token=lease_token,
            values=common,
        )
        await enqueue_gating(conn, clock, ids, row)
        return row
    if verdict == Verdict.changesRequested and rounds_remain(item):
        return await workitems.transition(
            conn,
            clock,
            ids,
            item["id"],
            src=src,
            dst=Status.inProgress,
            actor=actor,
            action="changesRequested",
            text=feedback,
            lease_token=lease_token,
            values={
                **common,
                "revision": item["revision"] + 1,
                # A fresh submission gets a fresh count of expired review leases.
                "lease_expiries": 0,
                "pending_feedback": feedback or "Please revise.",
                "last_feedback": feedback,
                "last_activity_at": clock.now_ms(),
            },
        )
    action = "escalate" if verdict == Verdict.escalated else "roundsExhausted"
    return await workitems.transition(
        conn,
        clock,
        ids,
        item["id"],
        src=src,
        dst=Status.awaitingHuman,
        actor=actor,
        action=action,
        text=feedback,
        lease_token=lease_token,
        values={**common, "last_feedback": feedback},
    )


def check_text(value: Any, *, name: str, limit: int, rule: str) -> str:
    """Required decision text: 1..``limit`` characters after trimming."""
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(f"{name} is required", rule=rule)
    if len(value) > limit:
        raise ValidationError(f"{name} must be at most {limit:,} characters", rule=rule)
    return value


async def human_approve(
    conn: AsyncConnection, clock: Clock, ids: IdFactory, item: dict[str, Any], actor: str
) -> dict[str, Any]:
    """Approve from awaitingHuman: approved + gating delivery, one transaction."""
    return await commit_verdict(
        conn,
        clock,
        ids,
        item,
        Verdict.approved,
        actor=actor,
        feedback=None,
        src=Status.awaitingHuman,
    )


async def human_reject(
    conn: AsyncConnection,
    clock: Clock,
    ids: IdFactory,
    item: dict[str, Any],
    actor: str,
    reason: Any,
) -> dict[str, Any]:
    """Reject from awaitingHuman with a reason of 1..2,000 characters."""
    text = check_text(reason, name="reason", limit=REASON_LIMIT, rule="decision.reason")
    return await workitems.transition(
        conn,
        clock,
        ids,
        item["id"],
        src=Status.awaitingHuman,
        dst=Status.rejected,
        actor=actor,
        action="reject",
        text=text,
    )


async def human_return(
    conn: AsyncConnection,
    clock: Clock,
    ids: IdFactory,
    item: dict[str, Any],
    actor: str,
    feedback: Any,
) -> dict[str, Any]:
    """Return to the worker: inProgress, one extra revision allowance, feedback dispatched."""
    text = check_text(feedback, name="feedback", limit=FEEDBACK_LIMIT, rule="decision.feedback")
    return await workitems.transition(
        conn,
        clock,
        ids,
        item["id"],
        src=Status.awaitingHuman,
        dst=Status.inProgress,
        actor=actor,
        action="return",
        text=text,
        values={
            "revision": item["revision"] + 1,
            "extra_allowance": item["extra_allowance"] + 1,
            "lease_expiries": 0,
            "pending_feedback": text,
            "last_feedback": text,
            "last_activity_at": clock.now_ms(),
            "lease_token": None,
            "lease_expires_at": None,
        },
    )


async def cancel(
    conn: AsyncConnection, clock: Clock, ids: IdFactory, item: dict[str, Any], actor: str
) -> dict[str, Any]:
    """Cancel from any non-terminal status; unsent deliveries are cancelled too."""
    src = Status(item["status"])
    row = await workitems.transition(
        conn,
        clock,
        ids,
        item["id"],
        src=src,
        dst=Status.cancelled,
        actor=actor,
        action="cancel",
        values={"lease_token": None, "lease_expires_at": None},
    )
    await cancel_for_item(conn, clock, item["id"])
    return row
