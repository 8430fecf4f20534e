"""The verdict commit path (lead and human share it) and the other human decisions.

Every decision is one transaction: a fenced status transition, its audit row and, for an
approval, the gating delivery row. ``completionPolicy`` is shown on the detail; nothing
here branches on it (SPEC 3).
"""

from __future__ import annotations

import enum
import functools
from typing import Any

import sqlalchemy as sa

from leadgate.core.clock import Clock, IdFactory
from leadgate.core.durations import format_duration
from leadgate.core.errors import ValidationError
from leadgate.core.limits import FEEDBACK_LIMIT, REASON_LIMIT, check_text, cut
from leadgate.core.metrics import METRICS, labelled
from leadgate.core.types import BindingKind
from leadgate.database import schema as t
from leadgate.database.db import Conn, Counts, Database, count_held
from leadgate.database.plans import AnyRow
from leadgate.database.sql import later_of_sql
from leadgate.domain import session_events, wakes, workitems
from leadgate.domain.rows import Delivery, WorkItem
from leadgate.domain.wakes import Wake
from leadgate.domain.workitems import Status
from leadgate.review import cards
from outbox.channel import CardOutcome
from outbox.store import (
    HANDOFF_TOPIC,
    NOTIFY_CHANNEL,
    OUTBOX_ACTOR,
    OUTBOX_TOPIC,
    POST_KINDS,
    REVEAL_KINDS,
    Handoff,
    Outbox,
    cancel_for_item,
    is_internal,
    recover,
)


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
    audit_id: str | None = None,
) -> WorkItem:
    """Commit a verdict on ``item`` (currently ``src``); returns the updated row.

    An approval writes the gating delivery through ``outbox`` in the same transaction
    (and, when it has nothing to send, completes the item there: the row returned is
    then ``completed``);
    changes requested without rounds left, and an escalation, go to a human.
    ``audit_id``: the verdict's audit row's id, made beforehand (see
    :func:`workitems.transition`).
    """
    values: dict[str, Any] = {"lease_token": None, "lease_expires_at": None}
    gating: dict[str, Any] | None = None
    then: workitems.Then | None = None
    if verdict == Verdict.approved:
        dst, action = Status.approved, "approve"
        gating = await outbox.gating_row(conn, item)
        if is_internal(gating):
            # Nothing to send (an api reveal, a silent or scheduled binding): the item
            # is delivered in this transaction, and its move goes on to ``completed``
            # in the approval's own UPDATE.
            deliver = functools.partial(outbox.deliver_internal, conn, gating)
            then = workitems.Then(Status.completed, OUTBOX_ACTOR, "delivered", deliver)
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
        then=then,
        audit_id=audit_id,
    )
    if gating is not None and then is None:
        await outbox.write_gating(conn, gating)
    elif dst == Status.awaitingHuman:
        await outbox.review_needed(conn, row.id, Status.awaitingHuman.value)
    return row


def _approve_alone() -> sa.TextClause:
    """PostgreSQL: a lead's approval of an item whose answer is a channel post, as one
    statement outside a transaction block (:func:`approve_alone`)."""
    src, dst = Status.reviewing, Status.approved
    workitems.require_move(src, dst, event=False)
    return sa.text(
        "WITH b AS MATERIALIZED ("
        " SELECT id, kind, address FROM bindings"
        " WHERE id = :binding AND session_id = :session AND active AND NOT silent"
        "), moved AS ("
        " UPDATE work_items SET status = :dst, lease_token = NULL, lease_expires_at = NULL,"
        f" updated_at = {later_of_sql('now', 'updated_at')}"
        " WHERE id = :item AND status = :src AND lease_token = :lease"
        " AND EXISTS (SELECT 1 FROM b)"
        " RETURNING id, org_id, updated_at"
        "), audit_row AS ("
        " INSERT INTO audit (id, org_id, work_item_id, delivery_id, actor, action,"
        " from_status, to_status, text, created_at)"
        " SELECT CAST(:audit_id AS varchar), moved.org_id, moved.id, NULL,"
        " CAST(:actor AS varchar), 'approve', CAST(:src AS varchar), CAST(:dst AS varchar),"
        " CAST(:feedback AS varchar), moved.updated_at FROM moved"
        "), delivery AS ("
        " INSERT INTO deliveries (id, org_id, work_item_id, kind, action, channel,"
        " binding_id, address, text, status, attempts, next_attempt_at, lease_token,"
        " lease_expires_at, lease_owner, created_at, updated_at)"
        " SELECT CAST(:d_id AS varchar), moved.org_id, moved.id, 'gating', 'post', b.kind,"
        " b.id, b.address, CAST(:d_text AS text), CAST(:d_status AS varchar),"
        " CAST(:d_attempts AS integer), CAST(:now AS bigint), CAST(:d_lease AS varchar),"
        " CAST(:d_expires AS bigint), CAST(:d_owner AS varchar), CAST(:now AS bigint),"
        " CAST(:now AS bigint)"
        " FROM moved CROSS JOIN b"
        " RETURNING channel, binding_id, address"
        ")"
        " SELECT d.channel, d.binding_id, d.address,"
        " (SELECT count(pg_notify(:relays, '')) FROM delivery"
        " WHERE NOT CAST(:handed AS boolean)) AS notified"
        " FROM delivery AS d"
    ).bindparams(src=src.value, dst=dst.value, relays=NOTIFY_CHANNEL)


_APPROVE_ALONE = _approve_alone()


def _reveal_alone() -> sa.TextClause:
    """PostgreSQL: a lead's approval of an item whose answer is revealed (an api or
    studio binding), with that internal delivery done, as one statement outside a
    transaction block (:func:`approve_alone`)."""
    workitems.require_move(Status.reviewing, Status.approved, event=False)
    workitems.require_move(Status.approved, Status.completed, event=True)
    delivered = session_events.public_status(Status.completed.value, 0)
    return sa.text(
        "WITH b AS MATERIALIZED ("
        " SELECT id, kind, address FROM bindings"
        " WHERE id = :binding AND session_id = :session AND active AND NOT silent"
        # One update for both moves (reviewing -> approved -> completed): a statement
        # cannot change a row twice. Each move has its audit row, as in the transaction.
        "), done AS ("
        " UPDATE work_items SET status = :completed, lease_token = NULL,"
        f" lease_expires_at = NULL, updated_at = {later_of_sql('now', 'updated_at')}"
        " WHERE id = :item AND status = :reviewing AND lease_token = :lease"
        " AND EXISTS (SELECT 1 FROM b)"
        " RETURNING id, org_id, session_id, gated_message_id, updated_at"
        "), audit_rows AS ("
        " INSERT INTO audit (id, org_id, work_item_id, delivery_id, actor, action,"
        " from_status, to_status, text, created_at)"
        " SELECT CAST(:audit_approve AS varchar), org_id, id, NULL, CAST(:actor AS varchar),"
        " 'approve', CAST(:reviewing AS varchar), CAST(:approved AS varchar),"
        " CAST(:feedback AS varchar), updated_at FROM done"
        " UNION ALL"
        " SELECT CAST(:audit_delivered AS varchar), org_id, id, NULL,"
        " CAST(:outbox_actor AS varchar), 'delivered', CAST(:approved AS varchar),"
        " CAST(:completed AS varchar), NULL, updated_at FROM done"
        "), delivery AS ("
        " INSERT INTO deliveries (id, org_id, work_item_id, kind, action, channel,"
        " binding_id, address, text, status, attempts, next_attempt_at, created_at,"
        " updated_at)"
        " SELECT CAST(:d_id AS varchar), done.org_id, done.id, 'gating', 'reveal', b.kind,"
        " b.id, b.address, CAST(:d_text AS text), 'sent', 1, CAST(:now AS bigint),"
        " CAST(:now AS bigint), CAST(:now AS bigint) FROM done CROSS JOIN b"
        "), revealed AS ("
        " UPDATE messages SET lead_gated = false FROM done"
        " WHERE messages.id = done.gated_message_id"
        " RETURNING messages.id, messages.session_id"
        # The session's events as the transaction numbers them: the message, then the
        # item delivered.
        "), ev_s AS ("
        " UPDATE sessions SET event_seq = sessions.event_seq + 1"
        " + (SELECT count(*) FROM revealed)"
        " FROM done WHERE sessions.id = done.session_id"
        " RETURNING sessions.id, sessions.event_seq, sessions.watched_until"
        "), ev_rows AS ("
        " INSERT INTO session_events (session_id, seq, kind, message_id, status, created_at)"
        " SELECT ev_s.id, ev_s.event_seq - 1, :message_kind, revealed.id, NULL,"
        " CAST(:now AS bigint) FROM ev_s CROSS JOIN revealed"
        " UNION ALL"
        " SELECT ev_s.id, ev_s.event_seq, :review_kind, NULL, :delivered, CAST(:now AS bigint)"
        " FROM ev_s"
        ")"
        " SELECT ev_s.id AS session_id, (SELECT count(*) FROM revealed) AS revealed, "
        + session_events.notify_if_watched("ev_s", ":events_channel", "ev_s.id || ' m'")
        + " AS notified FROM ev_s"
    ).bindparams(
        reviewing=Status.reviewing.value,
        approved=Status.approved.value,
        completed=Status.completed.value,
        outbox_actor=OUTBOX_ACTOR,
        message_kind=session_events.MESSAGE,
        review_kind=session_events.REVIEW,
        delivered=delivered,
        events_channel=session_events.NOTIFY_CHANNEL,
    )


_REVEAL_ALONE = _reveal_alone()


async def approve_alone(
    db: Database,
    outbox: Outbox,
    item: WorkItem,
    binding_id: str,
    binding_kind: str,
    *,
    actor: str,
    feedback: str | None,
    audit_id: str | None = None,
    held: Counts | None = None,
) -> bool:
    """PostgreSQL: :func:`commit_verdict` of a lead's approval of ``item`` (``reviewing``
    under its lease) as one statement outside a transaction block, when its gating
    delivery on ``binding_id`` (of ``binding_kind``, as the claim saw it) is one of:

    * a channel post: the fenced move to ``approved``, its audit row and the delivery
      (claimed for this process's relay when it has room, else announced to every
      relay). One round trip where the transaction took six or seven (``BEGIN``, the
      move, its audit row, the binding, the delivery, the relays' NOTIFY, ``COMMIT``).
      ``reviewing -> approved`` changes no public status: no session event.
    * a reveal (:func:`_reveal`): the item approved and completed with both audit rows,
      the delivery ``sent``, the withheld answer visible, the session's two events.
      One round trip where the transaction took ten.

    False, with nothing written, for another binding, when the lease is lost, or when
    the binding is no longer the session's active one: :func:`commit_verdict` then
    decides as before.

    ``audit_id``: the approval's audit row's id, made beforehand (the lead runner looks
    for it after a fault in doubt). ``held``: what the approval counts when it lands,
    the caller's counts (its verdict's) to which it adds its own moves (and a reveal's
    delivery) before its statement runs; made here when the statement lands, as a
    transaction makes what it holds at its commit. When the statement ends in doubt
    they are the caller's to keep for its look (:func:`leadgate.database.db.count_found`);
    when it writes nothing, its own are taken out again."""
    if not db.statements_alone:
        return False
    counts = [] if held is None else held
    audit = outbox.ids.new("aud") if audit_id is None else audit_id
    mark = len(counts)
    if binding_kind in REVEAL_KINDS:
        counts += [
            (labelled(METRICS.transitions, Status.reviewing.value, Status.approved.value), 1),
            (labelled(METRICS.transitions, Status.approved.value, Status.completed.value), 1),
            (labelled(METRICS.deliveries, binding_kind, "sent"), 1),
        ]
        landed = await _reveal(
            db, outbox, item, binding_id, actor=actor, feedback=feedback, audit_id=audit
        )
    elif binding_kind in POST_KINDS:
        counts.append(
            (labelled(METRICS.transitions, Status.reviewing.value, Status.approved.value), 1)
        )
        landed = await _post(
            db,
            outbox,
            item,
            binding_id,
            actor=actor,
            feedback=feedback,
            audit_id=audit,
            held=counts,
        )
    else:
        return False
    if not landed:
        del counts[mark:]
        return False
    count_held(counts)
    return True


async def _post(
    db: Database,
    outbox: Outbox,
    item: WorkItem,
    binding_id: str,
    *,
    actor: str,
    feedback: str | None,
    audit_id: str,
    held: Counts,
) -> bool:
    now = outbox.clock.now_ms()
    values = outbox.post_values(item, now)
    handed = outbox.claim_for_local(values, now)

    def signals(row: AnyRow) -> list[tuple[str, Any]]:
        if not handed:
            return [(OUTBOX_TOPIC, None)]
        return [
            (
                HANDOFF_TOPIC,
                Handoff(
                    {
                        **values,
                        "channel": row.channel,
                        "binding_id": row.binding_id,
                        "address": row.address,
                    },
                    held,
                ),
            )
        ]

    result = await db.write_alone(
        _APPROVE_ALONE,
        {
            "binding": binding_id,
            "session": item.session_id,
            "item": item.id,
            "lease": item.lease_token,
            "now": now,
            "audit_id": audit_id,
            "actor": actor,
            "feedback": feedback,
            "d_id": values["id"],
            "d_text": values["text"],
            "d_status": values["status"],
            "d_attempts": values["attempts"],
            "d_lease": values["lease_token"],
            "d_expires": values["lease_expires_at"],
            "d_owner": values["lease_owner"],
            "handed": handed,
        },
        signals_from=signals,
        # a fault may hide a commit: the relay gives the claimed post back if it exists
        # (and makes what the approval counts, unless the lead runner's look did)
        in_doubt=[(HANDOFF_TOPIC, Handoff(values, held))] if handed else (),
    )
    return result.first() is not None


async def _reveal(
    db: Database,
    outbox: Outbox,
    item: WorkItem,
    binding_id: str,
    *,
    actor: str,
    feedback: str | None,
    audit_id: str,
) -> bool:
    now = outbox.clock.now_ms()
    result = await db.write_alone(
        _REVEAL_ALONE,
        {
            "binding": binding_id,
            "session": item.session_id,
            "item": item.id,
            "lease": item.lease_token,
            "now": now,
            "audit_approve": audit_id,
            "audit_delivered": outbox.ids.new("aud"),
            "actor": actor,
            "feedback": feedback,
            "d_id": outbox.ids.new("dlv"),
            "d_text": item.snapshot or item.summary or "",
        },
        signals_from=lambda row: [(session_events.TOPIC, (row.session_id, bool(row.revealed)))],
    )
    return result.first() is not None


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


async def _decision_text(
    conn: Conn, item: WorkItem, value: object, *, name: str, limit: int, rule: str
) -> str:
    """A reject's reason or a return's feedback, checked (:func:`check_text`). One that
    breaks its rule on an item no longer ``awaitingHuman`` (as read in the decision's
    transaction) is refused as the decision would be: a 409 ``workItem.status`` naming
    who decided meanwhile, not a 400 about the text (a second reviewer whose form was
    sent empty was told to give a reason, then, giving one, that it was decided)."""
    try:
        return check_text(value, name=name, limit=limit, rule=rule)
    except ValidationError:
        if item.status != Status.awaitingHuman.value:
            raise await workitems.not_there(conn, item.id, Status.awaitingHuman) from None
        raise


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
    text = await _decision_text(
        conn, item, reason, name="reason", limit=REASON_LIMIT, rule="decision.reason"
    )
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
    """Return to the worker: inProgress, one extra revision allowance, feedback dispatched
    (the revision dispatcher is woken at commit, on every replica: a person decides on
    an ``api`` replica or the command line, the dispatcher runs on a ``worker``)."""
    text = await _decision_text(
        conn, item, feedback, name="feedback", limit=FEEDBACK_LIMIT, rule="decision.feedback"
    )
    row = await workitems.transition(
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
    await wakes.after_commit(conn, Wake.revision)
    return row


async def cancel(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    item: WorkItem,
    actor: str,
    reason: object = None,
    *,
    surface: str | None = None,
    identity: str | None = None,
) -> WorkItem:
    """Cancel from any non-terminal status; unsent deliveries are cancelled too.
    ``reason``: optional, why (1..2,000 characters, kept in the audit entry as a
    reject's is); none, or an empty or blank one, is a cancel without a reason."""
    src = Status(item.status)
    if src in workitems.TERMINAL:
        raise await workitems.ended_already(conn, item, Status.cancelled)
    # Checked after the status: a cancel of an item that ended is told so, whatever it says.
    text = (
        None
        if reason is None or (isinstance(reason, str) and not reason.strip())
        else check_text(reason, name="reason", limit=REASON_LIMIT, rule="decision.reason")
    )
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
        text=text,
        surface=surface,
        identity=identity,
    )
    await cancel_for_item(conn, clock, item.id)
    return row


# ------------------------------------------------- decisions with their review cards


async def ended_by_flow(conn: Conn, outbox: Outbox, item_id: str) -> None:
    """Close the open review episode of ``item_id``, which its failed flow run cancelled
    (:attr:`leadgate.flows.runs.FlowService.item_ended`), and show its posted cards
    ``Cancelled`` by ``system:flow``, as an operator's cancel does: left open, the SLA
    runner kept reminding reviewers of an item nobody could decide any more."""
    await _close_cards(conn, outbox, item_id, "cancel", "system:flow", None, None)


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
        row = await cancel(conn, clock, ids, item, actor, text, **where)
    # A cancel's reason is shown too (blank: none), as a reject's is: the cards said who
    # cancelled, never why.
    said = text if action in ("reject", "return", "cancel") and isinstance(text, str) else None
    said = said if said and said.strip() else None
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
    external_id: str | None = None,
    attempts: int | None = None,
) -> Delivery:
    """Confirm delivered / retry a ``deliveryUnknown`` delivery; a gating delivery's
    review cards are updated in the same transaction (``external_id``, ``attempts``: see
    :func:`outbox.store.recover`)."""
    row = await recover(
        conn,
        outbox.clock,
        outbox.ids,
        delivery,
        action=action,
        actor=actor,
        surface=surface,
        identity=identity,
        external_id=external_id,
        attempts=attempts,
    )
    if row.kind == "gating" and row.work_item_id:
        await _close_cards(conn, outbox, row.work_item_id, action, actor, surface, None)
    elif action == "confirm":
        # A card posted uncertainly and decided meanwhile: shown decided like the others.
        await cards.settled_card(conn, outbox, row)
    return row


#: The kind of a binding, by id (an expiry's: is the item a flow node's?). Built once.
_BINDING_KIND = sa.select(t.bindings.c.kind).where(t.bindings.c.id == sa.bindparam("p_id"))


async def expire(conn: Conn, outbox: Outbox, item: WorkItem, after_ms: int) -> WorkItem:
    """No decision within ``after_ms``: reject with the reason ``expired: no decision
    within <duration>``, audited as an expiry (action ``expire``, actor
    ``system:expiry``, surface ``system``), never as a human rejection. When the item was
    a flow node's (its binding is a flow's), the flow resumer is woken at commit, on
    every replica: the run paused on it ends then, not at the resumer's poll."""
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
    if (
        item.binding_id is not None
        and await conn.scalar(_BINDING_KIND, {"p_id": item.binding_id}) == BindingKind.flow.value
    ):
        # A rejected flow node's item: the run paused on it can never resume, and the
        # flow resumer ends it (here at commit, on every replica by NOTIFY). A primary
        # key read, on an expiry only (never on the per-turn path).
        await wakes.after_commit(conn, Wake.flow)
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
        text=cut(text, CARD_TEXT_LIMIT) if text else None,
    )
    await cards.close_for_item(conn, outbox, item_id, outcome)
