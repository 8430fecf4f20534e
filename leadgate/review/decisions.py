"""The verdict commit path (lead and human share it) and the other human decisions.

Every decision is one transaction: a fenced status transition, its audit row and, for an
approval, the gating delivery row. ``completionPolicy`` is shown on the detail; nothing
here branches on it (SPEC 3).
"""

from __future__ import annotations

import enum
from typing import Any

from leadgate.core.clock import Clock, IdFactory
from leadgate.core.durations import format_duration
from leadgate.core.limits import FEEDBACK_LIMIT, REASON_LIMIT, check_text
from leadgate.database.db import Conn
from leadgate.domain import workitems
from leadgate.domain.rows import Delivery, WorkItem
from leadgate.domain.workitems import Status
from leadgate.review import cards
from outbox.channel import CardOutcome
from outbox.store import Outbox, cancel_for_item, recover


class Verdict(enum.StrEnum):
    """What a lead (or a human approving) decides."""

    approved = "approved"
    changesRequested = "changesRequested"
    escalated = "escalated"


def rounds_remain(item: WorkItem) -> bool:
    """A lead may send work back while ``revision < maxRevisionRounds + allowances``.

    A human's return adds one allowance and is itself a revision, so returns never eat
    into the lead's rounds.
    """
    return item.revision < item.max_revision_rounds + item.extra_allowance


async def commit_verdict(
    conn: Conn,
    outbox: Outbox,
    item: WorkItem,
    verdict: Verdict,
    *,
    actor: str,
    feedback: str | None,
    src: Status,
    lease_token: str | None = None,
    surface: str | None = None,
    identity: str | None = None,
) -> WorkItem:
    """Commit a verdict on ``item`` (currently ``src``); returns the updated row.

    An approval writes the gating delivery through ``outbox`` in the same transaction
    (and, when it has nothing to send, completes the item there: the row returned is
    then ``completed``);
    changes requested without rounds left, and an escalation, go to a human.
    """
    values: dict[str, Any] = {"lease_token": None, "lease_expires_at": None}
    if verdict == Verdict.approved:
        dst, action = Status.approved, "approve"
    elif verdict == Verdict.changesRequested and rounds_remain(item):
        dst, action = Status.inProgress, "changesRequested"
        values.update(
            revision=item.revision + 1,
            # A fresh submission gets a fresh count of expired review leases.
            lease_expiries=0,
            pending_feedback=feedback or "Please revise.",
            last_feedback=feedback,
            last_activity_at=outbox.clock.now_ms(),
        )
    else:
        dst = Status.awaitingHuman
        action = "escalate" if verdict == Verdict.escalated else "roundsExhausted"
        values["last_feedback"] = feedback
    row = await workitems.transition(
        conn,
        outbox.clock,
        outbox.ids,
        item.id,
        src=src,
        dst=dst,
        actor=actor,
        action=action,
        text=feedback,
        lease_token=lease_token,
        values=values,
        surface=surface,
        identity=identity,
    )
    if dst == Status.approved:
        # An internal delivery (api reveal, silent, scheduled) completes the item here.
        row = (await outbox.enqueue_gating(conn, row)).item
    elif dst == Status.awaitingHuman:
        await outbox.review_needed(conn, row.id, Status.awaitingHuman.value)
    return row


async def human_approve(
    conn: Conn,
    outbox: Outbox,
    item: WorkItem,
    actor: str,
    *,
    surface: str | None = None,
    identity: str | None = None,
) -> WorkItem:
    """Approve from awaitingHuman: approved + gating delivery, one transaction."""
    return await commit_verdict(
        conn,
        outbox,
        item,
        Verdict.approved,
        actor=actor,
        feedback=None,
        src=Status.awaitingHuman,
        surface=surface,
        identity=identity,
    )


async def human_reject(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    item: WorkItem,
    actor: str,
    reason: object,
    *,
    surface: str | None = None,
    identity: str | None = None,
) -> WorkItem:
    """Reject from awaitingHuman with a reason of 1..2,000 characters."""
    text = check_text(reason, name="reason", limit=REASON_LIMIT, rule="decision.reason")
    return await workitems.transition(
        conn,
        clock,
        ids,
        item.id,
        src=Status.awaitingHuman,
        dst=Status.rejected,
        actor=actor,
        action="reject",
        text=text,
        surface=surface,
        identity=identity,
    )


async def human_return(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    item: WorkItem,
    actor: str,
    feedback: object,
    *,
    surface: str | None = None,
    identity: str | None = None,
) -> WorkItem:
    """Return to the worker: inProgress, one extra revision allowance, feedback dispatched."""
    text = check_text(feedback, name="feedback", limit=FEEDBACK_LIMIT, rule="decision.feedback")
    return await workitems.transition(
        conn,
        clock,
        ids,
        item.id,
        src=Status.awaitingHuman,
        dst=Status.inProgress,
        actor=actor,
        action="return",
        text=text,
        surface=surface,
        identity=identity,
        values={
            "revision": item.revision + 1,
            "extra_allowance": item.extra_allowance + 1,
            "lease_expiries": 0,
            "pending_feedback": text,
            "last_feedback": text,
            "last_activity_at": clock.now_ms(),
            "lease_token": None,
            "lease_expires_at": None,
        },
    )


async def cancel(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    item: WorkItem,
    actor: str,
    *,
    surface: str | None = None,
    identity: str | None = None,
) -> WorkItem:
    """Cancel from any non-terminal status; unsent deliveries are cancelled too."""
    src = Status(item.status)
    row = await workitems.transition(
        conn,
        clock,
        ids,
        item.id,
        src=src,
        dst=Status.cancelled,
        actor=actor,
        action="cancel",
        values={"lease_token": None, "lease_expires_at": None},
        surface=surface,
        identity=identity,
    )
    await cancel_for_item(conn, clock, item.id)
    return row


# ------------------------------------------------- decisions with their review cards

#: Shown on a card: a decision's text (reason, feedback) is cut to this.
CARD_TEXT_LIMIT = 500


async def decide(
    conn: Conn,
    outbox: Outbox,
    item: WorkItem,
    action: str,
    actor: str,
    text: object = None,
    *,
    surface: str | None = None,
    identity: str | None = None,
) -> WorkItem:
    """One human decision (approve, reject, return, cancel) and, in the same
    transaction, the in-place update of every open review card of the item: whoever
    decides, wherever (chat, console, API, CLI), every card shows it."""
    where = {"surface": surface, "identity": identity}
    clock, ids = outbox.clock, outbox.ids
    if action == "approve":
        row = await human_approve(conn, outbox, item, actor, **where)
    elif action == "reject":
        row = await human_reject(conn, clock, ids, item, actor, text, **where)
    elif action == "return":
        row = await human_return(conn, clock, ids, item, actor, text, **where)
    else:
        row = await cancel(conn, clock, ids, item, actor, **where)
    said = text if action in ("reject", "return") and isinstance(text, str) else None
    await _close_cards(conn, outbox, item.id, action, actor, surface, said)
    return row


async def recover_delivery(
    conn: Conn,
    outbox: Outbox,
    delivery: Delivery,
    action: str,
    actor: str,
    *,
    surface: str | None = None,
    identity: str | None = None,
) -> Delivery:
    """Confirm delivered / retry a ``deliveryUnknown`` delivery; a gating delivery's
    review cards are updated in the same transaction."""
    row = await recover(
        conn,
        outbox.clock,
        outbox.ids,
        delivery,
        action=action,
        actor=actor,
        surface=surface,
        identity=identity,
    )
    if row.kind == "gating" and row.work_item_id:
        await _close_cards(conn, outbox, row.work_item_id, action, actor, surface, None)
    return row


async def expire(conn: Conn, outbox: Outbox, item: WorkItem, after_ms: int) -> WorkItem:
    """No decision within ``after_ms``: reject with the reason ``expired: no decision
    within <duration>``, audited as an expiry (action ``expire``, actor
    ``system:expiry``, surface ``system``), never as a human rejection."""
    reason = f"expired: no decision within {format_duration(after_ms)}"
    row = await workitems.transition(
        conn,
        outbox.clock,
        outbox.ids,
        item.id,
        src=Status.awaitingHuman,
        dst=Status.rejected,
        actor="system:expiry",
        action="expire",
        text=reason,
        surface="system",
    )
    await _close_cards(conn, outbox, item.id, "expire", "system:expiry", "system", reason)
    return row


async def _close_cards(
    conn: Conn,
    outbox: Outbox,
    item_id: str,
    action: str,
    actor: str,
    surface: str | None,
    text: str | None,
) -> None:
    outcome = CardOutcome(
        title=cards.OUTCOME_TITLES.get(action, action),
        by=await cards.who(conn, actor),
        surface=surface,
        at_ms=outbox.clock.now_ms(),
        text=cards.cut(text, CARD_TEXT_LIMIT) if text else None,
    )
    await cards.close_for_item(conn, outbox, item_id, outcome)
