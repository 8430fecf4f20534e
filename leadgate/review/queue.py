"""Read models for operators: the actionable queue, the review detail, agent activity.

Reads only: nothing here changes state (GET is safe). The queue is built for triage: each
row says what the work is (summary preview), who asked and on which channel, why it
needs a human (the lead's escalation text, rounds used, or an uncertain delivery) and
since when it waits; it is sorted oldest first and filtered by agent, channel and reason.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, TypedDict

import sqlalchemy as sa

from leadgate.core.clock import iso
from leadgate.core.decoding import INT64_MAX, decimal_int
from leadgate.core.errors import ValidationError
from leadgate.database import schema as t
from leadgate.database.db import Conn
from leadgate.domain import agents, workitems
from leadgate.domain.rows import Binding, WorkItem
from leadgate.domain.workitems import Status
from leadgate.review.labels import (
    DestinationView,
    audit_with_actors,
    channel_name,
    delivery_target,
    destination,
    named_audit,
    requester,
)
from outbox.store import DeliveryStatus, for_detail

W = t.work_items.c
D = t.deliveries.c
A = t.agents.c
B = t.bindings.c
S = t.sessions.c
AU = t.audit.c
PAGE_MAX = 200
PREVIEW_CHARS = 240

#: Why an item is in the queue: the audit action that moved it to awaitingHuman.
REASON_OF_ACTION = {
    "escalate": "escalated",
    "roundsExhausted": "roundsExhausted",
    "incompleteProvenance": "incompleteProvenance",
    "leaseExpired": "leaseExpired",
}
REASONS = (*REASON_OF_ACTION.values(), "deliveryUnknown", "other")
ORDERS = ("oldest", "newest")
CHANNELS = ("api", "studio", "slack", "discord", "teams", "email", "scheduled", "flow", "none")
COMPLETION_POLICY_NOTE = (
    "completionPolicy is recorded from the lead configuration when the work item is "
    "created and shown here for reference. It does not decide anything: the verdict does "
    "(approved is delivered; escalated, or changes requested with no rounds left, comes to "
    "a human)."
)


def _encode_cursor(*parts: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(parts)).encode()).decode()


def _decode_cursor(cursor: str, rule: str) -> tuple[int, str]:
    try:
        at, item_id = json.loads(base64.urlsafe_b64decode(cursor.encode()))
    except (ValueError, TypeError, RecursionError):
        raise ValidationError("cursor is not valid", rule=rule) from None
    # Only what _encode_cursor writes: a time the database can hold and an id of printable
    # ASCII (a float, a huge number, a lone surrogate or, on PostgreSQL, a NUL failed
    # later, in the query: a 500).
    if (
        type(at) is not int
        or not -INT64_MAX <= at <= INT64_MAX
        or not isinstance(item_id, str)
        or not (item_id.isascii() and item_id.isprintable())
    ):
        raise ValidationError("cursor is not valid", rule=rule)
    return at, item_id


def parse_time(value: str | None, name: str) -> int | None:
    """``since`` / ``until``: epoch milliseconds, or an ISO 8601 date or time (UTC unless
    it names a zone)."""
    if value is None or value == "":
        return None
    if value.isdigit():
        at = decimal_int(value)
        if at is None:  # "²", or past any time a database column holds
            raise ValidationError(
                f"{name} must be epoch milliseconds (ASCII digits, at most {INT64_MAX}) "
                "or an ISO 8601 time",
                rule=f"activity.{name}",
            )
        return at
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValidationError(
            f"{name} must be an ISO 8601 time or epoch milliseconds", rule=f"activity.{name}"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return int(parsed.timestamp() * 1000)


def _check_limit(limit: int, rule: str) -> None:
    if not 1 <= limit <= PAGE_MAX:
        raise ValidationError(f"limit must be 1..{PAGE_MAX}", rule=rule)


def _check_choice(value: str | None, allowed: tuple[str, ...], name: str, rule: str) -> None:
    if value is not None and value not in allowed:
        raise ValidationError(f"{name} must be one of {', '.join(allowed)}", rule=rule)


def _into_human(column: sa.ColumnElement[Any]) -> sa.ScalarSelect[Any]:
    """``column`` of the item's newest audit row that moved it to awaitingHuman."""
    return (
        sa.select(column)
        .where(AU.work_item_id == W.id, AU.to_status == Status.awaitingHuman.value)
        .order_by(AU.created_at.desc(), AU.id.desc())
        .limit(1)
        .scalar_subquery()
    )


def _actionable(org_id: str) -> sa.Subquery:
    """The actionable queue of ``org_id`` with the columns operators triage by."""
    unknown_since = (
        sa.select(sa.func.max(D.updated_at))
        .where(
            D.work_item_id == W.id,
            D.kind == "gating",
            D.status == DeliveryStatus.deliveryUnknown.value,
        )
        .scalar_subquery()
    )
    last_action = _into_human(AU.action)
    reason = sa.case(
        (W.status == Status.approved.value, sa.literal("deliveryUnknown")),
        else_=sa.case(REASON_OF_ACTION, value=last_action, else_=sa.literal("other")),
    )
    waiting = sa.case((W.status == Status.awaitingHuman.value, W.updated_at), else_=unknown_since)
    return (
        sa.select(
            W.id,
            W.status,
            W.revision,
            W.max_revision_rounds,
            W.extra_allowance,
            W.updated_at,
            W.created_at,
            W.agent_id,
            A.name.label("agent_name"),
            W.summary,
            W.task_context,
            sa.func.coalesce(B.kind, "none").label("channel"),
            B.address.label("address"),
            S.key.label("session_key"),
            reason.label("reason"),
            waiting.label("waiting_since"),
        )
        .select_from(
            t.work_items.join(t.agents, A.id == W.agent_id)
            .outerjoin(t.bindings, B.id == W.binding_id)
            .outerjoin(t.sessions, S.id == W.session_id)
        )
        .where(
            W.org_id == org_id,
            sa.or_(
                W.status == Status.awaitingHuman.value,
                sa.and_(W.status == Status.approved.value, unknown_since.is_not(None)),
            ),
        )
        .subquery("q")
    )


def _preview(summary: str | None, task_context: str) -> tuple[str, str]:
    text, source = (summary, "summary") if summary else (task_context, "taskContext")
    text = " ".join(text.split())
    if len(text) > PREVIEW_CHARS:
        text = text[: PREVIEW_CHARS - 1] + "…"
    return text, source


#: The longest free text a filter or search takes (``agent``, ``q``): no agent name is
#: longer, and the console's fields hold no more (``maxlength``).
FILTER_TEXT_MAX = 200


async def _agent_ids(conn: Conn, org_id: str, ref: str | None, rule: str) -> list[str] | None:
    """Agent filter: ids of the agents named ``ref`` (id, slug or name; deleted agents
    too, whose items stay); ``agent.not_found`` for none, so a misspelt filter is an error
    rather than an empty page; ``rule`` (400) for one longer than any agent's name."""
    if not ref:
        return None
    if len(ref) > FILTER_TEXT_MAX:
        # No agent is named so: said as such, not looked up (it was agent.not_found
        # after a query with the whole text).
        raise ValidationError(
            f"the agent filter is longer than {FILTER_TEXT_MAX} characters", rule=rule
        )
    rows = await conn.execute(
        sa.select(A.id).where(A.org_id == org_id, agents.REF_MATCH), agents.ref_params(ref)
    )
    ids = [r.id for r in rows]
    if not ids:
        raise agents.unknown_agent(ref)
    return ids


class AgentRef(TypedDict):
    """An item's agent: its id and name (``None`` when the agent row is gone)."""

    id: str
    name: str | None


class QueueItemView(TypedDict):
    """One row of the actionable queue."""

    id: str
    status: str
    agent: AgentRef
    revision: int
    roundsUsed: int
    roundsAllowed: int
    updatedAt: str | None
    createdAt: str | None
    waitingSince: str | None
    reason: str
    reasonText: str | None
    preview: str
    previewOf: str
    channel: str
    channelName: str
    requester: str
    detail: str


class AgentCount(TypedDict):
    """How many queued items one agent has."""

    id: str
    name: str | None
    count: int


class QueueCounts(TypedDict):
    """The whole queue's facet counts: all of it, by agent, by channel, by reason."""

    all: int
    agents: list[AgentCount]
    channels: dict[str, int]
    reasons: dict[str, int]


class QueueView(TypedDict):
    """A page of the actionable queue: ``next`` is the cursor of the next page,
    ``total`` counts the filtered queue, ``counts`` the whole one."""

    items: list[QueueItemView]
    next: str | None
    total: int
    counts: QueueCounts


async def actionable(
    conn: Conn,
    org_id: str,
    *,
    limit: int = 50,
    cursor: str | None = None,
    agent: str | None = None,
    channel: str | None = None,
    reason: str | None = None,
    order: str = "oldest",
) -> QueueView:
    """awaitingHuman items, and approved items whose gating delivery is deliveryUnknown,
    waiting longest first (``order="newest"``: the reverse), filtered by agent (id, slug
    or name), channel (binding kind) and reason. ``total`` counts the filtered queue,
    ``counts`` the whole queue by agent, channel and reason (the console's filters)."""
    _check_limit(limit, "queue.limit")
    _check_choice(channel, CHANNELS, "channel", "queue.channel")
    _check_choice(reason, REASONS, "reason", "queue.reason")
    _check_choice(order, ORDERS, "order", "queue.order")
    q = _actionable(org_id)
    agent_ids = await _agent_ids(conn, org_id, agent, "queue.agent")
    filters: list[sa.ColumnElement[bool]] = []
    if agent_ids is not None:
        filters.append(q.c.agent_id.in_(agent_ids))
    if channel:
        filters.append(q.c.channel == channel)
    if reason:
        filters.append(q.c.reason == reason)
    total, counts = await _counts(conn, q, agent_ids, channel, reason)
    newest = order == "newest"
    sort = (q.c.waiting_since.desc(), q.c.id.desc()) if newest else (q.c.waiting_since, q.c.id)
    query = sa.select(q).where(*filters).order_by(*sort).limit(limit + 1)
    if cursor:
        at, after_id = _decode_cursor(cursor, "queue.cursor")
        if newest:
            query = query.where(
                sa.or_(q.c.waiting_since < at, sa.and_(q.c.waiting_since == at, q.c.id < after_id))
            )
        else:
            query = query.where(
                sa.or_(q.c.waiting_since > at, sa.and_(q.c.waiting_since == at, q.c.id > after_id))
            )
    rows = (await conn.execute(query)).all()
    page = rows[:limit]
    texts = await _reason_texts(conn, [r.id for r in page])
    items: list[QueueItemView] = []
    for r in page:
        preview, source = _preview(r.summary, r.task_context)
        items.append(
            {
                "id": r.id,
                "status": r.status,
                "agent": {"id": r.agent_id, "name": r.agent_name},
                "revision": r.revision,
                "roundsUsed": r.revision,
                "roundsAllowed": r.max_revision_rounds + r.extra_allowance,
                "updatedAt": iso(r.updated_at),
                "createdAt": iso(r.created_at),
                "waitingSince": iso(r.waiting_since),
                "reason": r.reason,
                "reasonText": texts.get(r.id),
                "preview": preview,
                "previewOf": source,
                "channel": r.channel,
                "channelName": channel_name(r.channel),
                "requester": requester(r.channel, r.address, r.session_key),
                "detail": f"/operator/reviews/{r.id}",
            }
        )
    nxt = _encode_cursor(page[-1].waiting_since, page[-1].id) if len(rows) > limit else None
    return {"items": items, "next": nxt, "total": total, "counts": counts}


async def _counts(
    conn: Conn,
    q: sa.Subquery,
    agent_ids: list[str] | None,
    channel: str | None,
    reason: str | None,
) -> tuple[int, QueueCounts]:
    """One GROUP BY over the whole queue: the filtered total and the facet counts."""
    rows = (
        await conn.execute(
            sa.select(
                q.c.agent_id, q.c.agent_name, q.c.channel, q.c.reason, sa.func.count().label("n")
            ).group_by(q.c.agent_id, q.c.agent_name, q.c.channel, q.c.reason)
        )
    ).all()
    by_agent: dict[str, AgentCount] = {}
    by_channel: dict[str, int] = {}
    by_reason: dict[str, int] = {}
    total = 0
    for r in rows:
        entry = by_agent.setdefault(
            r.agent_id, {"id": r.agent_id, "name": r.agent_name, "count": 0}
        )
        entry["count"] += r.n
        by_channel[r.channel] = by_channel.get(r.channel, 0) + r.n
        by_reason[r.reason] = by_reason.get(r.reason, 0) + r.n
        if (
            (agent_ids is None or r.agent_id in agent_ids)
            and (not channel or r.channel == channel)
            and (not reason or r.reason == reason)
        ):
            total += r.n
    return total, {
        "all": sum(by_channel.values()),
        "agents": sorted(by_agent.values(), key=lambda e: str(e["name"])),
        "channels": by_channel,
        "reasons": by_reason,
    }


async def queue_size(conn: Conn, org_id: str) -> int:
    """How many items the actionable queue holds (the console's navigation count)."""
    q = _actionable(org_id)
    return int(await conn.scalar(sa.select(sa.func.count()).select_from(q)) or 0)


async def _reason_texts(conn: Conn, ids: list[str]) -> dict[str, str]:
    """The text of each item's newest move to awaitingHuman (the lead's escalation text,
    the system's reason) or of its delivery becoming uncertain."""
    if not ids:
        return {}
    rows = await conn.execute(
        sa.select(AU.work_item_id, AU.text)
        .where(
            AU.work_item_id.in_(ids),
            sa.or_(AU.to_status == Status.awaitingHuman.value, AU.action == "deliveryUnknown"),
        )
        .order_by(AU.created_at, AU.id)
    )
    out: dict[str, str] = {}
    for r in rows:
        if r.text:
            out[r.work_item_id] = r.text  # the newest wins
    return out


_VERDICTS = {
    "approve": "approved",
    "changesRequested": "changesRequested",
    "roundsExhausted": "changesRequested",
    "escalate": "escalated",
    "reject": "rejected",
    "return": "returned",
    "cancel": "cancelled",
}


class VerdictView(TypedDict):
    """One verdict on an item: ``by`` is ``lead`` or ``human``."""

    revision: int
    by: str
    actor: str
    verdict: str
    roundsExhausted: bool
    feedback: str | None
    at: str | None


class NamedVerdictView(VerdictView):
    """A verdict in the review detail, with its actor's display name."""

    actorName: str


#: An audit row that is a verdict (a system actor's move is none, though its action
#: may be named as one: ``roundsExhausted``).
_IS_VERDICT = sa.and_(AU.action.in_(sorted(_VERDICTS)), sa.func.substr(AU.actor, 1, 7) != "system:")
#: The revision a verdict was given on, counted in SQL over every earlier verdict of the
#: item (each that sent the item back to its worker starts the next revision), however
#: few of its rows are read: counted over the rows read, a detail that lists only the
#: newest verdicts numbered them from 0 again.
_VERDICT_REVISION = sa.func.coalesce(
    sa.func.sum(
        sa.case((sa.and_(_IS_VERDICT, AU.to_status == Status.inProgress.value), 1), else_=0)
    ).over(order_by=(AU.created_at, AU.id), rows=(None, -1)),
    0,
).label("verdict_revision")


def verdict_history(audit_rows: Sequence[Any]) -> list[VerdictView]:
    """Each verdict on the item per revision, oldest first: the lead's (approved,
    changesRequested, escalated) and the humans' (approved, rejected, returned,
    cancelled), with their feedback and time. A revision starts at 0 and each
    changesRequested that went back to the worker, or human return, starts the next:
    each row's ``verdict_revision`` (:data:`_VERDICT_REVISION`)."""
    history: list[VerdictView] = []
    for a in audit_rows:
        verdict = _VERDICTS.get(a.action)
        if verdict is None or a.actor.startswith("system:"):
            continue
        by = "lead" if a.actor.startswith("lead:") else "human"
        history.append(
            {
                "revision": int(a.verdict_revision),
                "by": by,
                "actor": a.actor,
                "verdict": verdict,
                "roundsExhausted": a.action == "roundsExhausted",
                "feedback": a.text,
                "at": iso(a.created_at),
            }
        )
    return history


# The detail's reads, built once (every decision answers the detail; the plan cache keys
# on the statement object). Three statements: the item with its names, destination and
# reason, its deliveries, its newest audit with the actors' names (and its newest
# verdicts, a fourth, only when that audit is cut). They were nine, which each decision
# ran inside its write transaction: a third of the decision handler's profile.
_ITEM_BINDING = t.bindings.alias("item_binding")
_DEST = t.bindings.alias("dest")
_ITS_GATING = (D.work_item_id == W.id, D.kind == "gating")
#: Where an approval of the item goes: once approved, the binding its gating delivery
#: was resolved to (at approval); before, the session's active binding (SPEC 6).
_DEST_ID = sa.case(
    (
        sa.exists().where(*_ITS_GATING),
        sa.select(D.binding_id)
        .where(*_ITS_GATING)
        .order_by(D.created_at, D.id)
        .limit(1)
        .scalar_subquery(),
    ),
    else_=sa.select(B.id).where(B.session_id == W.session_id, B.active).limit(1).scalar_subquery(),
)
#: Why an awaitingHuman item waits: the action of its newest move there, whatever its
#: age (the audit listed may be too short to hold it).
_REASON_ACTION = sa.case(
    (
        W.status == Status.awaitingHuman.value,
        sa.select(AU.action)
        .where(AU.work_item_id == W.id, AU.to_status == Status.awaitingHuman.value)
        .order_by(AU.created_at.desc(), AU.id.desc())
        .limit(1)
        .scalar_subquery(),
    ),
    else_=None,
)
_ITEM_COLUMNS = len(t.work_items.c)
_DETAIL_ITEM = (
    sa.select(
        t.work_items,
        A.name,
        _ITEM_BINDING.c.kind,
        _ITEM_BINDING.c.address,
        S.key,
        _REASON_ACTION,
        *_DEST.c,
    )
    .select_from(
        t.work_items.outerjoin(t.agents, A.id == W.agent_id)
        .outerjoin(_ITEM_BINDING, _ITEM_BINDING.c.id == W.binding_id)
        .outerjoin(t.sessions, S.id == W.session_id)
        .outerjoin(_DEST, _DEST.c.id == _DEST_ID)
    )
    .where(W.id == sa.bindparam("p_id"), W.org_id == sa.bindparam("p_org"))
)


class DeliveryLine(TypedDict):
    """One of an item's deliveries in its review detail; ``nextAttemptAt`` only while
    it is pending (else ``None``)."""

    id: str
    status: str
    kind: str
    channel: str
    to: str
    action: str
    attempts: int
    error: str | None
    createdAt: str | None
    updatedAt: str | None
    nextAttemptAt: str | None


AuditLine = TypedDict(
    "AuditLine",
    {
        "at": str | None,
        "actor": str,
        "actorKind": str,
        "actorName": str,
        "actorEmail": str | None,
        "action": str,
        "from": str | None,
        "to": str | None,
        "text": str | None,
        "deliveryId": str | None,
        "surface": str | None,
        "identity": str | None,
    },
)
"""One audit row of an item, with its actor as an operator reads it (``from`` is a
keyword, hence the functional form)."""


#: How many of an item's newest audit rows, verdicts and deliveries its detail lists
#: (and how many of its unsettled deliveries, beside those): an item returned many
#: times grows them all without bound, and the detail read them all.
DETAIL_LIST_MAX = 200
_VERDICTS_NEWEST = named_audit(_IS_VERDICT, newest=True, extra=(_VERDICT_REVISION,))
_AUDIT_NEWEST = named_audit(newest=True, extra=(_VERDICT_REVISION,))


class ReviewDetailView(TypedDict):
    """Everything a reviewer needs about one item (the decision's answer too)."""

    id: str
    status: str
    agent: AgentRef
    leadAgentId: str
    revision: int
    maxRevisionRounds: int
    extraAllowance: int
    roundsUsed: int
    roundsAllowed: int
    completionPolicy: str
    completionPolicyNote: str
    taskContext: str
    summary: str | None
    snapshot: str | None
    lastFeedback: str | None
    createdAt: str | None
    updatedAt: str | None
    channel: str
    channelName: str
    requester: str
    reason: str | None
    destination: DestinationView
    reviews: list[NamedVerdictView]
    reviewsTruncated: bool
    deliveries: list[DeliveryLine]
    deliveriesTruncated: bool
    unsettledDeliveriesTruncated: bool
    audit: list[AuditLine]
    auditTruncated: bool


async def detail(conn: Conn, org_id: str, item_id: str) -> ReviewDetailView:
    """Everything a reviewer needs (reviewers only: snapshot and summary are here)."""
    row = (await conn.execute(_DETAIL_ITEM, {"p_id": item_id, "p_org": org_id})).first()
    if row is None:
        raise workitems.not_found(item_id)
    n = _ITEM_COLUMNS
    item = WorkItem.from_row(row[:n])
    agent_name, bound_kind, bound_address, session_key, reason_action = row[n : n + 5]
    dest = row[n + 5 :]
    target = destination(None if dest[0] is None else Binding.from_row(dest))
    # The unsettled ones whatever their age: an operator acts on them here.
    found = await for_detail(conn, item_id, DETAIL_LIST_MAX)
    deliveries = found.listed
    # One more than shown: whether older ones exist.
    audit_rows, actors = await audit_with_actors(
        conn, org_id, item_id, statement=_AUDIT_NEWEST, newest=DETAIL_LIST_MAX + 1
    )
    audit_cut = len(audit_rows) > DETAIL_LIST_MAX
    audit_rows = audit_rows[-DETAIL_LIST_MAX:]
    if audit_cut:
        # The verdicts older than the rows shown, read on their own (the newest only).
        decisions, deciders = await audit_with_actors(
            conn, org_id, item_id, statement=_VERDICTS_NEWEST, newest=DETAIL_LIST_MAX + 1
        )
    else:
        # The whole audit was read, its verdicts with it: every decision answers the
        # detail, inside its write transaction, and reads no more.
        decisions, deciders = audit_rows, actors
    verdicts = verdict_history(decisions)
    channel = bound_kind if bound_kind is not None else "none"
    history: list[NamedVerdictView] = [
        {**entry, "actorName": deciders[entry["actor"]].name}
        for entry in verdicts[-DETAIL_LIST_MAX:]
    ]
    return {
        "id": item.id,
        "status": item.status,
        "agent": {"id": item.agent_id, "name": agent_name},
        "leadAgentId": item.lead_agent_id,
        "revision": item.revision,
        "maxRevisionRounds": item.max_revision_rounds,
        "extraAllowance": item.extra_allowance,
        "roundsUsed": item.revision,
        "roundsAllowed": item.max_revision_rounds + item.extra_allowance,
        "completionPolicy": item.completion_policy,
        "completionPolicyNote": COMPLETION_POLICY_NOTE,
        "taskContext": item.task_context,
        "summary": item.summary,
        "snapshot": item.snapshot,
        "lastFeedback": item.last_feedback,
        "createdAt": iso(item.created_at),
        "updatedAt": iso(item.updated_at),
        "channel": channel,
        "channelName": channel_name(channel),
        "requester": requester(channel, bound_address, session_key),
        "reason": None if reason_action is None else REASON_OF_ACTION.get(reason_action, "other"),
        "destination": target,
        "reviews": history,
        "reviewsTruncated": len(verdicts) > DETAIL_LIST_MAX,
        "deliveries": [
            {
                "id": d.id,
                "status": d.status,
                "kind": d.kind,
                "channel": d.channel,
                # Where it goes, in words, and when: the detail showed the channel only,
                # which named no conversation to check before Confirm or Retry.
                "to": delivery_target(d.channel, d.address),
                "action": d.action,
                "attempts": d.attempts,
                "error": d.error,
                "createdAt": iso(d.created_at),
                "updatedAt": iso(d.updated_at),
                "nextAttemptAt": (
                    iso(d.next_attempt_at) if d.status == DeliveryStatus.pending.value else None
                ),
            }
            for d in deliveries
        ],
        "deliveriesTruncated": found.total > len(deliveries),
        "unsettledDeliveriesTruncated": found.unsettled > DETAIL_LIST_MAX,
        "audit": [
            {
                "at": iso(a.created_at),
                "actor": a.actor,
                "actorKind": actors[a.actor].kind,
                "actorName": actors[a.actor].name,
                "actorEmail": actors[a.actor].email,
                "action": a.action,
                "from": a.from_status,
                "to": a.to_status,
                "text": a.text,
                "deliveryId": a.delivery_id,
                "surface": a.surface,
                "identity": a.identity,
            }
            for a in audit_rows
        ],
        "auditTruncated": audit_cut,
    }


ACTIVITY_STATUSES = tuple(s.value for s in Status)


def _like_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


class ActivityItem(TypedDict):
    """One work item in Agent Activity (never its approved text)."""

    id: str
    agent: str
    agentId: str
    status: str
    revision: int
    channel: str
    channelName: str
    requester: str
    createdAt: str | None
    updatedAt: str | None
    detail: str


class AgentName(TypedDict):
    """An agent of the organization, for the activity's agent filter."""

    id: str
    name: str


class ActivityView(TypedDict):
    """A page of Agent Activity, newest first; ``agents``: the organization's agents."""

    items: list[ActivityItem]
    next: str | None
    agents: list[AgentName]


async def activity(
    conn: Conn,
    org_id: str,
    *,
    limit: int = 50,
    cursor: str | None = None,
    agent: str | None = None,
    status: str | None = None,
    channel: str | None = None,
    since: int | str | None = None,
    until: int | str | None = None,
    q: str | None = None,
) -> ActivityView:
    """Agent Activity: the organization's work items, newest first, linked to their
    review detail, filtered by agent, status, channel and time (``updatedAt`` in
    ``[since, until)``, epoch ms or ISO 8601), and searched by summary text (``q``,
    case-insensitive). The approved text (snapshot, summary) is never part of the
    answer: the search matches the summary without returning it."""
    _check_limit(limit, "activity.limit")
    _check_choice(status, ACTIVITY_STATUSES, "status", "activity.status")
    _check_choice(channel, CHANNELS, "channel", "activity.channel")
    if q is not None and len(q) > FILTER_TEXT_MAX:
        raise ValidationError(
            f"the search text is longer than {FILTER_TEXT_MAX} characters", rule="activity.q"
        )
    query = (
        sa.select(
            W.id,
            W.status,
            W.revision,
            W.updated_at,
            W.created_at,
            A.name.label("agent_name"),
            A.id.label("agent_id"),
            sa.func.coalesce(B.kind, "none").label("channel"),
            B.address.label("address"),
            S.key.label("session_key"),
        )
        .select_from(
            t.work_items.join(t.agents, A.id == W.agent_id)
            .outerjoin(t.bindings, B.id == W.binding_id)
            .outerjoin(t.sessions, S.id == W.session_id)
        )
        .where(W.org_id == org_id)
        .order_by(W.updated_at.desc(), W.id.desc())
        .limit(limit + 1)
    )
    agent_ids = await _agent_ids(conn, org_id, agent, "activity.agent")
    if agent_ids is not None:
        query = query.where(W.agent_id.in_(agent_ids))
    if status:
        query = query.where(W.status == status)
    if channel == "none":
        query = query.where(B.kind.is_(None))
    elif channel:
        query = query.where(B.kind == channel)
    since_ms = since if isinstance(since, int) else parse_time(since, "since")
    until_ms = until if isinstance(until, int) else parse_time(until, "until")
    if since_ms is not None:
        query = query.where(W.updated_at >= since_ms)
    if until_ms is not None:
        query = query.where(W.updated_at < until_ms)
    if q and q.strip():
        query = query.where(W.summary.ilike(f"%{_like_escape(q.strip())}%", escape="\\"))
    if cursor:
        at, before_id = _decode_cursor(cursor, "activity.cursor")
        query = query.where(
            sa.or_(W.updated_at < at, sa.and_(W.updated_at == at, W.id < before_id))
        )
    rows = (await conn.execute(query)).all()
    page = rows[:limit]
    listed = (
        await conn.execute(
            sa.select(A.id, A.name)
            .where(A.org_id == org_id, A.deleted_at.is_(None))
            .order_by(A.name)
        )
    ).all()
    return {
        "items": [
            {
                "id": r.id,
                "agent": r.agent_name,
                "agentId": r.agent_id,
                "status": r.status,
                "revision": r.revision,
                "channel": r.channel,
                "channelName": channel_name(r.channel),
                "requester": requester(r.channel, r.address, r.session_key),
                "createdAt": iso(r.created_at),
                "updatedAt": iso(r.updated_at),
                "detail": f"/operator/reviews/{r.id}",
            }
            for r in page
        ],
        "next": _encode_cursor(page[-1].updated_at, page[-1].id) if len(rows) > limit else None,
        "agents": [{"id": a.id, "name": a.name} for a in listed],
    }


class UncertainDelivery(TypedDict):
    """One ``deliveryUnknown`` delivery: ``to`` in words, ``address`` raw."""

    id: str
    kind: str
    channel: str
    to: str
    workItemId: str | None
    address: dict[str, Any]
    error: str | None
    since: str | None
    #: sends tried (a Confirm or Retry may name it: see ``Reviews.recover``)
    attempts: int


class UncertainView(TypedDict):
    """A page of uncertain deliveries, oldest first."""

    deliveries: list[UncertainDelivery]
    next: str | None


async def uncertain_deliveries(
    conn: Conn, org_id: str, *, limit: int = 50, cursor: str | None = None
) -> UncertainView:
    """Every ``deliveryUnknown`` delivery of the organization, oldest first: the gating
    ones (their items are in the actionable queue too) and the ones no work item gates
    (plain replies, notices, review cards), which only this list shows. The text is not
    part of the answer; ``to`` says in words where it was being posted (``address`` is
    the raw address)."""
    _check_limit(limit, "deliveries.limit")
    query = (
        sa.select(
            D.id, D.kind, D.channel, D.work_item_id, D.address, D.error, D.updated_at, D.attempts
        )
        .where(D.org_id == org_id, D.status == DeliveryStatus.deliveryUnknown.value)
        .order_by(D.updated_at, D.id)
        .limit(limit + 1)
    )
    if cursor:
        at, after_id = _decode_cursor(cursor, "deliveries.cursor")
        query = query.where(sa.or_(D.updated_at > at, sa.and_(D.updated_at == at, D.id > after_id)))
    rows = (await conn.execute(query)).all()
    page = rows[:limit]
    return {
        "deliveries": [
            {
                "id": r.id,
                "kind": r.kind,
                "channel": r.channel,
                "to": delivery_target(r.channel, r.address),
                "workItemId": r.work_item_id,
                "address": r.address,
                "error": r.error,
                "since": iso(r.updated_at),
                "attempts": r.attempts,
            }
            for r in page
        ],
        "next": _encode_cursor(page[-1].updated_at, page[-1].id) if len(rows) > limit else None,
    }
