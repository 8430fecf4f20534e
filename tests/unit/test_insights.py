"""Insights (``leadgate.review.insights``) on a known audit trail: the figures, and the
JSON they make, pinned byte for byte on both backends."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from leadgate.core.clock import DAY_MS, MINUTE_MS
from leadgate.database import schema as t
from leadgate.review.insights import insights
from tests.helpers import make_org
from tests.stack import Stack

#: Midday of a UTC day: the window's last day.
NOW = 20_000 * DAY_MS + DAY_MS // 2
LEAD = "lead:agt_lead"
HUMAN = "user:usr_mia"

#: (item, minutes before NOW, actor, action, from, to): each item's trail.
TRAIL = [
    # Escalated, then approved by a human: an override.
    ("a", 3000, "system:turns", "completeTask", "inProgress", "inReview"),
    ("a", 2990, LEAD, "escalate", "inReview", "awaitingHuman"),
    ("a", 2900, HUMAN, "approve", "awaitingHuman", "approved"),
    # No rounds left, returned by a human, then approved by the lead.
    ("b", 1500, "system:turns", "completeTask", "inProgress", "inReview"),
    ("b", 1497, LEAD, "roundsExhausted", "inReview", "awaitingHuman"),
    ("b", 1400, HUMAN, "return", "awaitingHuman", "inProgress"),
    ("b", 1300, "system:turns", "completeTask", "inProgress", "inReview"),
    ("b", 1299, LEAD, "approve", "inReview", "approved"),
    # Changes requested, then escalated and rejected: a confirmation.
    ("c", 100, "system:turns", "completeTask", "inProgress", "inReview"),
    ("c", 95, LEAD, "changesRequested", "inReview", "inProgress"),
    ("c", 60, "system:turns", "completeTask", "inProgress", "inReview"),
    ("c", 50, LEAD, "escalate", "inReview", "awaitingHuman"),
    ("c", 10, HUMAN, "reject", "awaitingHuman", "rejected"),
    # Submitted and escalated before the window; cancelled in it (neither).
    ("d", 12 * 1440, "system:turns", "completeTask", "inProgress", "inReview"),
    ("d", 12 * 1440 - 7, LEAD, "escalate", "inReview", "awaitingHuman"),
    ("d", 30, HUMAN, "cancel", "awaitingHuman", "cancelled"),
    # The system's move to awaitingHuman, then a key's approval: timed, not agreement.
    ("e", 600, "system:sweeper", "leaseExpired", "inReview", "awaitingHuman"),
    ("e", 420, "key:key_ci", "approve", "awaitingHuman", "approved"),
    # An even number of human decisions: the median is the mean of the middle two.
    ("g", 2000, "system:turns", "completeTask", "inProgress", "inReview"),
    ("g", 1999, LEAD, "escalate", "inReview", "awaitingHuman"),
    ("g", 1989, HUMAN, "approve", "awaitingHuman", "approved"),
    # Decided before the window only: not counted.
    ("f", 20 * 1440, "system:turns", "completeTask", "inProgress", "inReview"),
    ("f", 20 * 1440 - 1, LEAD, "approve", "inReview", "approved"),
]

PINNED = (
    '{"days": 7, "since": "2024-09-28T00:00:00Z", "until": "2024-10-04T12:00:00Z", '
    '"decisions": {"perDay": [{"day": "2024-09-28", "byVerdict": {}, "byDecider": {}}, '
    '{"day": "2024-09-29", "byVerdict": {}, "byDecider": {}}, {"day": "2024-09-30", '
    '"byVerdict": {}, "byDecider": {}}, {"day": "2024-10-01", "byVerdict": {}, '
    '"byDecider": {}}, {"day": "2024-10-02", "byVerdict": {"escalated": 1, "approved": '
    '1}, "byDecider": {"lead": 1, "human": 1}}, {"day": "2024-10-03", "byVerdict": '
    '{"changesRequested": 1, "returned": 1, "approved": 2, "escalated": 1}, "byDecider": '
    '{"lead": 3, "human": 2}}, {"day": "2024-10-04", "byVerdict": {"changesRequested": 1,'
    ' "escalated": 1, "rejected": 1, "cancelled": 1, "approved": 1}, "byDecider": '
    '{"lead": 2, "human": 3}}], "byVerdict": {"escalated": 3, "approved": 4, '
    '"changesRequested": 2, "returned": 1, "rejected": 1, "cancelled": 1}, "byDecider": '
    '{"lead": 6, "human": 6}}, "timeToDecision": {"lead": {"count": 6, "medianMs": '
    '240000.0, "p90Ms": 600000}, "human": {"count": 6, "medianMs": 5610000.0, "p90Ms": '
    '1034580000}}, "agreement": {"escalated": {"confirmed": 1, "overrode": 2}, '
    '"changesRequested": {"confirmed": 1, "overrode": 0}, "confirmed": 2, "overrode": 2, '
    '"rate": 0.5}, "roundsUsed": [], "deliveries": {"byOutcome": {}, "byChannel": {}}}'
)


@pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)
async def test_insights_of_a_known_trail(stack: Stack) -> None:
    org = await make_org(stack)
    other = await make_org(stack, "other")
    rows = [
        {
            "id": f"aud_{n:03d}",
            "org_id": org.id,
            "work_item_id": f"wi_{item}",
            "actor": actor,
            "action": action,
            "from_status": from_status,
            "to_status": to_status,
            "created_at": NOW - minutes * MINUTE_MS,
        }
        for n, (item, minutes, actor, action, from_status, to_status) in enumerate(TRAIL)
    ]
    # Another organization's decision counts nowhere.
    rows.append({**rows[2], "id": "aud_other", "org_id": other.id, "work_item_id": "wi_x"})
    async with stack.db.tx() as conn:
        await conn.execute(sa.insert(t.audit), rows)
    with stack.db.record_statements() as statements:
        async with stack.db.read() as conn:
            data = await insights(conn, org.id, now_ms=NOW, days=7)
    assert json.dumps(data) == PINNED
    # Four reads: the verdicts per day, times to decision with agreement (the decisions'
    # trail, most of the cost at size, worked out once for both: it was two statements,
    # each working it out), rounds used, deliveries.
    reads = [s for s in statements if s.lstrip().upper().startswith(("SELECT", "WITH"))]
    assert len(reads) == 4, reads


@pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)
async def test_a_decision_stamped_after_today_counts_in_no_day(stack: Stack) -> None:
    """A verdict stamped after the window's last day (another replica's clock ahead at
    midnight) is in no day shown: it was a KeyError, answered 500."""
    org = await make_org(stack)
    row = {
        "id": "aud_ahead",
        "org_id": org.id,
        "work_item_id": "wi_ahead",
        "actor": HUMAN,
        "action": "approve",
        "from_status": "awaitingHuman",
        "to_status": "approved",
        "created_at": NOW + DAY_MS,
    }
    async with stack.db.tx() as conn:
        await conn.execute(sa.insert(t.audit), [row])
    async with stack.db.read() as conn:
        data = await insights(conn, org.id, now_ms=NOW, days=2)
    assert [day["byVerdict"] for day in data["decisions"]["perDay"]] == [{}, {}]
