"""Read models for operators: the actionable queue, the review detail, agent activity.

Reads only: nothing here changes state (GET is safe).
"""

from __future__ import annotations

import base64
import json
from typing import Any

import sqlalchemy as sa

from leadgate.core.clock import iso
from leadgate.core.errors import ValidationError
from leadgate.database import schema as t
from leadgate.database.db import Conn
from leadgate.domain import workitems
from leadgate.domain.workitems import Status
from outbox.store import DeliveryStatus, for_item

W = t.work_items.c
D = t.deliveries.c
A = t.agents.c
PAGE_MAX = 200


def _encode_cursor(updated_at: int, item_id: str) -> str:
    return base64.urlsafe_b64encode(json.dumps([updated_at, item_id]).encode()).decode()


def _decode_cursor(cursor: str) -> tuple[int, str]:
    try:
        updated_at, item_id = json.loads(base64.urlsafe_b64decode(cursor.encode()))
        return int(updated_at), str(item_id)
    except (ValueError, TypeError):
        raise ValidationError("cursor is not valid", rule="queue.cursor") from None


def _unknown_delivery() -> sa.ColumnElement[bool]:
    return sa.exists(
        sa.select(D.id).where(
            D.work_item_id == W.id,
            D.kind == "gating",
            D.status == DeliveryStatus.deliveryUnknown.value,
        )
    )


async def actionable(
    conn: Conn, org_id: str, *, limit: int = 50, cursor: str | None = None
) -> dict[str, Any]:
    """awaitingHuman items, and approved items whose gating delivery is deliveryUnknown."""
    if not 1 <= limit <= PAGE_MAX:
        raise ValidationError(f"limit must be 1..{PAGE_MAX}", rule="queue.limit")
    query = (
        sa.select(W.id, W.status, W.revision, W.updated_at, W.agent_id, A.name.label("agent_name"))
        .select_from(t.work_items.join(t.agents, A.id == W.agent_id))
        .where(
            W.org_id == org_id,
            sa.or_(
                W.status == Status.awaitingHuman.value,
                sa.and_(W.status == Status.approved.value, _unknown_delivery()),
            ),
        )
        .order_by(W.updated_at, W.id)
        .limit(limit + 1)
    )
    if cursor:
        after_ts, after_id = _decode_cursor(cursor)
        query = query.where(
            sa.or_(W.updated_at > after_ts, sa.and_(W.updated_at == after_ts, W.id > after_id))
        )
    rows = (await conn.execute(query)).all()
    page = rows[:limit]
    items = [
        {
            "id": r.id,
            "status": r.status,
            "agent": {"id": r.agent_id, "name": r.agent_name},
            "revision": r.revision,
            "updatedAt": iso(r.updated_at),
            "reason": "awaitingHuman" if r.status == Status.awaitingHuman else "deliveryUnknown",
            "detail": f"/operator/reviews/{r.id}",
        }
        for r in page
    ]
    nxt = _encode_cursor(page[-1].updated_at, page[-1].id) if len(rows) > limit else None
    return {"items": items, "next": nxt}


async def detail(conn: Conn, org_id: str, item_id: str) -> dict[str, Any]:
    """Everything a reviewer needs (reviewers only: snapshot and summary are here)."""
    item = await workitems.get(conn, item_id, org_id)
    agent_name = await conn.scalar(sa.select(A.name).where(A.id == item.agent_id))
    deliveries = await for_item(conn, item_id)
    audit_rows = (
        await conn.execute(
            sa.select(t.audit)
            .where(t.audit.c.work_item_id == item_id)
            .order_by(t.audit.c.created_at, t.audit.c.id)
        )
    ).all()
    return {
        "id": item.id,
        "status": item.status,
        "agent": {"id": item.agent_id, "name": agent_name},
        "leadAgentId": item.lead_agent_id,
        "revision": item.revision,
        "maxRevisionRounds": item.max_revision_rounds,
        "extraAllowance": item.extra_allowance,
        "completionPolicy": item.completion_policy,
        "taskContext": item.task_context,
        "summary": item.summary,
        "snapshot": item.snapshot,
        "lastFeedback": item.last_feedback,
        "createdAt": iso(item.created_at),
        "updatedAt": iso(item.updated_at),
        "deliveries": [
            {
                "id": d.id,
                "status": d.status,
                "channel": d.channel,
                "action": d.action,
                "attempts": d.attempts,
                "error": d.error,
            }
            for d in deliveries
        ],
        "audit": [
            {
                "at": iso(a.created_at),
                "actor": a.actor,
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
    }


async def activity(conn: Conn, org_id: str, *, limit: int = 50) -> dict[str, Any]:
    """Agent Activity: recent work items linked to their review detail, without the
    approved text (no snapshot, no summary)."""
    if not 1 <= limit <= PAGE_MAX:
        raise ValidationError(f"limit must be 1..{PAGE_MAX}", rule="activity.limit")
    rows = (
        await conn.execute(
            sa.select(W.id, W.status, W.revision, W.updated_at, A.name.label("agent_name"))
            .select_from(t.work_items.join(t.agents, A.id == W.agent_id))
            .where(W.org_id == org_id)
            .order_by(W.updated_at.desc(), W.id.desc())
            .limit(limit)
        )
    ).all()
    return {
        "items": [
            {
                "id": r.id,
                "agent": r.agent_name,
                "status": r.status,
                "revision": r.revision,
                "updatedAt": iso(r.updated_at),
                "detail": f"/operator/reviews/{r.id}",
            }
            for r in rows
        ]
    }
