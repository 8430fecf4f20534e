"""Insights for operators: how review goes, over the last N days (UTC days).

Computed from the audit trail (every decision has a row) and the delivery rows; reads
only. Definitions:

* **decisions**: verdicts of a lead (approved, changesRequested, escalated) and of humans
  (approved, rejected, returned, cancelled), per UTC day, by verdict and by decider.
* **time to decision**: lead: from the submission (``completeTask``) to the lead's
  verdict; human: from the item's arrival in awaitingHuman to the human decision.
  Median and 90th percentile in milliseconds.
* **lead–human agreement**: for each human decision on an item the lead escalated, or
  sent back with no rounds left: an approval *overrode* the lead; a rejection or a
  return *confirmed* it (cancellations count as neither).
* **rounds used**: the revision at which decided items ended.
* **deliveries**: gating deliveries created in the window, by outcome (status).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import Literal, TypedDict

import sqlalchemy as sa

from leadgate.core.clock import DAY_MS, iso
from leadgate.core.errors import ValidationError
from leadgate.database import schema as t
from leadgate.database.db import Conn
from leadgate.domain.workitems import Status

AU = t.audit.c
W = t.work_items.c
D = t.deliveries.c
MAX_DAYS = 365

LEAD_VERDICTS = {
    "approve": "approved",
    "changesRequested": "changesRequested",
    "roundsExhausted": "changesRequested",
    "escalate": "escalated",
}
HUMAN_VERDICTS = {
    "approve": "approved",
    "reject": "rejected",
    "return": "returned",
    "cancel": "cancelled",
}
_DECISION_ACTIONS = sorted(set(LEAD_VERDICTS) | set(HUMAN_VERDICTS))
_TIMING_ACTIONS = sorted(
    {*_DECISION_ACTIONS, "completeTask", "incompleteProvenance", "leaseExpired"}
)
_DECIDED = (
    Status.approved,
    Status.completed,
    Status.rejected,
    Status.failed,
    Status.cancelled,
)


def decider(actor: str) -> str | None:
    """``lead``, ``human``, or ``None`` for the system's own moves."""
    if actor.startswith("lead:"):
        return "lead"
    if actor.startswith("system:"):
        return None
    return "human"


class StatsView(TypedDict):
    """Times to decision: how many, median and 90th percentile (``None`` with none)."""

    count: int
    medianMs: float | None
    p90Ms: int | None


def _stats(values: list[int]) -> StatsView:
    if not values:
        return {"count": 0, "medianMs": None, "p90Ms": None}
    ordered = sorted(values)
    # Nearest rank: the smallest value with at least 90% of the values at or below it.
    p90 = ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]
    return {"count": len(values), "medianMs": statistics.median(ordered), "p90Ms": p90}


class DayView(TypedDict):
    """One UTC day's decisions (``day``: YYYY-MM-DD), by verdict and by decider."""

    day: str
    byVerdict: dict[str, int]
    byDecider: dict[str, int]


class DecisionsView(TypedDict):
    """The window's decisions per day, and in all by verdict and by decider."""

    perDay: list[DayView]
    byVerdict: dict[str, int]
    byDecider: dict[str, int]


class TimeToDecisionView(TypedDict):
    """Times to decision of the lead and of humans."""

    lead: StatsView
    human: StatsView


class AgreementCount(TypedDict):
    """How often humans confirmed or overrode one kind of lead verdict."""

    confirmed: int
    overrode: int


class AgreementView(TypedDict):
    """Lead–human agreement by lead verdict, in all, and the override rate (``None``
    with no such human decision)."""

    escalated: AgreementCount
    changesRequested: AgreementCount
    confirmed: int
    overrode: int
    rate: float | None


class RoundsView(TypedDict):
    """How many decided items ended at a revision."""

    rounds: int
    items: int


class DeliveryCountsView(TypedDict):
    """Gating deliveries by outcome, and by channel then outcome."""

    byOutcome: dict[str, int]
    byChannel: dict[str, dict[str, int]]


class InsightsView(TypedDict):
    """An organization's insights over ``days`` UTC days (``since`` .. ``until``)."""

    days: int
    since: str | None
    until: str | None
    decisions: DecisionsView
    timeToDecision: TimeToDecisionView
    agreement: AgreementView
    roundsUsed: list[RoundsView]
    deliveries: DeliveryCountsView


async def insights(conn: Conn, org_id: str, *, now_ms: int, days: int = 30) -> InsightsView:
    """The insights of ``org_id`` over the ``days`` UTC days up to ``now_ms``."""
    if not 1 <= days <= MAX_DAYS:
        raise ValidationError(f"days must be 1..{MAX_DAYS}", rule="insights.days")
    first_day = now_ms // DAY_MS - (days - 1)
    since = first_day * DAY_MS
    # Every audit row that matters for timing, of the items decided in the window (their
    # submissions may predate it).
    decided_items = (
        sa.select(AU.work_item_id)
        .where(
            AU.org_id == org_id,
            AU.created_at >= since,
            AU.action.in_(_DECISION_ACTIONS),
            AU.work_item_id.is_not(None),
        )
        .distinct()
    )
    rows = (
        await conn.execute(
            sa.select(
                AU.work_item_id, AU.actor, AU.action, AU.to_status, AU.from_status, AU.created_at
            )
            .where(
                AU.org_id == org_id,
                AU.work_item_id.in_(decided_items),
                AU.action.in_(_TIMING_ACTIONS),
            )
            .order_by(AU.work_item_id, AU.created_at, AU.id)
        )
    ).all()
    per_day: dict[int, Counter[str]] = {first_day + i: Counter() for i in range(days)}
    per_day_decider: dict[int, Counter[str]] = {first_day + i: Counter() for i in range(days)}
    lead_times: list[int] = []
    human_times: list[int] = []
    agreement: dict[str, AgreementCount] = {
        "escalated": {"confirmed": 0, "overrode": 0},
        "changesRequested": {"confirmed": 0, "overrode": 0},
    }
    item = None
    submitted_at: int | None = None
    human_since: int | None = None
    lead_said: str | None = None
    for r in rows:
        if r.work_item_id != item:
            item, submitted_at, human_since, lead_said = r.work_item_id, None, None, None
        who = decider(r.actor)
        if r.action == "completeTask":
            submitted_at = r.created_at
        if who == "lead" and r.action in LEAD_VERDICTS:
            verdict = LEAD_VERDICTS[r.action]
            if r.created_at >= since:
                per_day[r.created_at // DAY_MS][verdict] += 1
                per_day_decider[r.created_at // DAY_MS]["lead"] += 1
                if submitted_at is not None:
                    lead_times.append(r.created_at - submitted_at)
            submitted_at = None
        if who == "human" and r.action in HUMAN_VERDICTS:
            verdict = HUMAN_VERDICTS[r.action]
            in_window = r.created_at >= since
            if in_window:
                per_day[r.created_at // DAY_MS][verdict] += 1
                per_day_decider[r.created_at // DAY_MS]["human"] += 1
            from_human = r.from_status == Status.awaitingHuman.value
            if in_window and from_human and human_since is not None:
                human_times.append(r.created_at - human_since)
            if in_window and from_human and lead_said in agreement and verdict != "cancelled":
                outcome: Literal["confirmed", "overrode"] = (
                    "overrode" if verdict == "approved" else "confirmed"
                )
                agreement[lead_said][outcome] += 1
        if r.to_status == Status.awaitingHuman.value:
            human_since = r.created_at
            lead_said = (
                LEAD_VERDICTS.get(r.action)
                if who == "lead" and r.action in ("escalate", "roundsExhausted")
                else None
            )
    confirmed = sum(a["confirmed"] for a in agreement.values())
    overrode = sum(a["overrode"] for a in agreement.values())
    rounds = (
        await conn.execute(
            sa.select(W.revision, sa.func.count().label("n"))
            .where(
                W.org_id == org_id,
                W.updated_at >= since,
                W.status.in_([s.value for s in _DECIDED]),
            )
            .group_by(W.revision)
            .order_by(W.revision)
        )
    ).all()
    deliveries = (
        await conn.execute(
            sa.select(D.status, D.channel, sa.func.count().label("n"))
            .where(D.org_id == org_id, D.kind == "gating", D.created_at >= since)
            .group_by(D.status, D.channel)
        )
    ).all()
    by_outcome: Counter[str] = Counter()
    by_channel: dict[str, Counter[str]] = {}
    for d in deliveries:
        by_outcome[d.status] += d.n
        by_channel.setdefault(d.channel, Counter())[d.status] += d.n
    return {
        "days": days,
        "since": iso(since),
        "until": iso(now_ms),
        "decisions": {
            "perDay": [
                {
                    "day": iso(day * DAY_MS)[:10],
                    "byVerdict": dict(per_day[day]),
                    "byDecider": dict(per_day_decider[day]),
                }
                for day in sorted(per_day)
            ],
            "byVerdict": dict(sum(per_day.values(), Counter())),
            "byDecider": dict(sum(per_day_decider.values(), Counter())),
        },
        "timeToDecision": {"lead": _stats(lead_times), "human": _stats(human_times)},
        "agreement": {
            "escalated": agreement["escalated"],
            "changesRequested": agreement["changesRequested"],
            "confirmed": confirmed,
            "overrode": overrode,
            "rate": (confirmed / (confirmed + overrode)) if confirmed + overrode else None,
        },
        "roundsUsed": [{"rounds": r.revision, "items": r.n} for r in rounds],
        "deliveries": {
            "byOutcome": dict(by_outcome),
            "byChannel": {k: dict(v) for k, v in sorted(by_channel.items())},
        },
    }
