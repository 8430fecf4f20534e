"""What a reviewer needs to know about a waiting item, in one read (review cards, triage).

:func:`review_facts` is the one place that says, for items in the actionable queue, which
agent they belong to, where the request came from, why the item waits for a human
(the lead's escalation text, rounds used up, an unfinished lead review, incomplete
provenance, or a delivery whose outcome is unknown) and since when. Review cards are
built from it; operator read models (queue rows) can use it too. Reads only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import sqlalchemy as sa

from leadgate.database import schema as t
from leadgate.database.db import Conn
from leadgate.domain.workitems import Status
from outbox.store import DeliveryStatus

W = t.work_items.c
A = t.agents.c
B = t.bindings.c
D = t.deliveries.c
AU = t.audit.c

#: Where the console shows one review (``[server] public_url`` + this + the item id).
CONSOLE_DETAIL = "/console/#/review/"


class ReviewFacts(NamedTuple):
    """One waiting item as a reviewer sees it (see the module docstring)."""

    item_id: str
    org_id: str
    agent_id: str
    agent_name: str
    status: str
    #: awaitingHuman | deliveryUnknown | None (not in the actionable queue)
    reason: str | None
    #: why it waits, in words
    why: str
    #: where the request came from, in words
    source: str
    summary: str
    revision: int
    #: revision rounds the lead may use (maxRevisionRounds + human allowances)
    rounds: int
    #: when it started waiting (epoch ms)
    waiting_since_ms: int
    #: the gating delivery whose outcome is unknown (reason deliveryUnknown)
    delivery_id: str | None

    @property
    def detail_path(self) -> str:
        """The console's page for this item (append to ``[server] public_url``)."""
        return f"{CONSOLE_DETAIL}{self.item_id}"


async def review_facts(
    conn: Conn, item_ids: Sequence[str], *, org_id: str | None = None
) -> dict[str, ReviewFacts]:
    """:class:`ReviewFacts` of ``item_ids`` (those of ``org_id`` when given), by id.

    Four statements whatever the number of items (items with agents, bindings, gating
    deliveries in ``deliveryUnknown``, the audit rows that sent items to a human).
    """
    ids = list(dict.fromkeys(item_ids))
    if not ids:
        return {}
    query = (
        sa.select(t.work_items, A.name.label("agent_name"))
        .select_from(t.work_items.join(t.agents, A.id == W.agent_id))
        .where(W.id.in_(ids))
    )
    if org_id is not None:
        query = query.where(W.org_id == org_id)
    items = (await conn.execute(query)).all()
    if not items:
        return {}
    found = [r.id for r in items]
    binding_ids = [r.binding_id for r in items if r.binding_id]
    bindings: dict[str, Any] = {}
    if binding_ids:
        for b in (
            await conn.execute(sa.select(B.id, B.kind, B.address).where(B.id.in_(binding_ids)))
        ).all():
            bindings[b.id] = b
    unknown: dict[str, Any] = {}
    for d in (
        await conn.execute(
            sa.select(D.id, D.work_item_id, D.error, D.updated_at)
            .where(
                D.work_item_id.in_(found),
                D.kind == "gating",
                D.status == DeliveryStatus.deliveryUnknown.value,
            )
            .order_by(D.updated_at, D.id)
        )
    ).all():
        unknown[d.work_item_id] = d  # the latest wins
    entered: dict[str, Any] = {}
    for a in (
        await conn.execute(
            sa.select(AU.work_item_id, AU.action, AU.text, AU.created_at)
            .where(AU.work_item_id.in_(found), AU.to_status == Status.awaitingHuman.value)
            .order_by(AU.created_at, AU.id)
        )
    ).all():
        entered[a.work_item_id] = a  # the latest wins
    out: dict[str, ReviewFacts] = {}
    for r in items:
        rounds = int(r.max_revision_rounds) + int(r.extra_allowance)
        delivery = unknown.get(r.id) if r.status == Status.approved.value else None
        if r.status == Status.awaitingHuman.value:
            reason: str | None = Status.awaitingHuman.value
            audit = entered.get(r.id)
            why = _why_human(audit, r.revision, rounds)
            since = int(audit.created_at) if audit is not None else int(r.updated_at)
        elif delivery is not None:
            reason = DeliveryStatus.deliveryUnknown.value
            why = "Delivery outcome unknown" + (f": {delivery.error}" if delivery.error else "")
            since = int(delivery.updated_at)
        else:
            reason, why, since = None, f"Not waiting for a decision ({r.status})", int(r.updated_at)
        out[r.id] = ReviewFacts(
            item_id=r.id,
            org_id=r.org_id,
            agent_id=r.agent_id,
            agent_name=r.agent_name,
            status=r.status,
            reason=reason,
            why=why,
            source=_source(bindings.get(r.binding_id) if r.binding_id else None),
            summary=r.summary or (r.snapshot or "")[:2000],
            revision=int(r.revision),
            rounds=rounds,
            waiting_since_ms=since,
            delivery_id=delivery.id if delivery is not None else None,
        )
    return out


def _why_human(audit: Any, revision: int, rounds: int) -> str:
    if audit is None:
        return "Waiting for a human decision"
    text = (audit.text or "").strip()
    said = f": {text}" if text else "."
    if audit.action == "escalate":
        return f"The lead escalated it{said}"
    if audit.action == "roundsExhausted":
        return f"Revision rounds used up ({revision} of {rounds}); the lead asked for changes{said}"
    if audit.action == "leaseExpired":
        return f"The lead review did not finish{said}"
    if audit.action == "incompleteProvenance":
        return f"Incomplete provenance{said}"
    return f"{audit.action}{said}"


def _source(binding: Any) -> str:
    """Where the request came from, from the binding the submission was made on."""
    if binding is None:
        return "unknown (no binding)"
    address = binding.address if isinstance(binding.address, dict) else {}
    kind = binding.kind
    if kind == "slack":
        thread = address.get("thread_ts")
        where = f"Slack channel {address.get('channel', '?')}"
        if address.get("team"):
            where += f" in {address['team']}"
        return where + (f", thread {thread}" if thread else "")
    if kind == "discord":
        guild = address.get("guild_id") or "a direct message"
        return f"Discord channel {address.get('channel_id', '?')} ({guild})"
    if kind == "teams":
        reference = address.get("reference") or {}
        conversation = (reference.get("conversation") or {}).get("id", "?")
        return f"Teams conversation {conversation}"
    if kind == "email":
        subject = address.get("subject") or ""
        return f"Email from {address.get('to', '?')}" + (f": {subject}" if subject else "")
    return {
        "api": "the REST / MCP API",
        "studio": "Studio",
        "scheduled": "a schedule",
        "flow": "an ActionFlow",
    }.get(kind, str(kind))
