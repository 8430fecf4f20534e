"""Migration 0027 on SQLite and PostgreSQL: the partial index of the email replies by
the Message-ID they were sent under (``ix_deliveries_email_reply_external``) exists and
holds those alone, the schema matches ``schema.py``, and the look-up of an answered
reply's session (``binding.bindings.EMAIL_REPLY_SESSIONS``) reaches ``deliveries``
through it on both backends (it scanned every delivery); down and up again."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from binding.bindings import EMAIL_REPLY_SESSIONS
from tests.unit.test_migration_0026 import migrated_with_index, plan_accesses

INDEX = "ix_deliveries_email_reply_external"

_DELIVERY = (
    "INSERT INTO deliveries (id, org_id, work_item_id, kind, action, channel, binding_id, "
    "address, text, status, attempts, next_attempt_at, external_id, created_at, updated_at) "
    "VALUES (:id, :org, 'wi_1', :kind, 'post', :channel, :binding, '{}', 'x', 'sent', 1, :at, "
    ":ext, :at, :at)"
)
#: 2,000 sent deliveries of 7 organizations: email replies (plain and gated), email cards
#: and Slack posts.
ROWS: list[dict[str, Any]] = [
    {
        "id": f"dlv_{i}",
        "org": f"org_{i % 7}",
        "kind": "reply" if i % 3 else "gating",
        "channel": "email" if i % 2 else "slack",
        "ext": f"<dlv_{i}@lg.example>",
        # Cards name no binding.
        "binding": None if i % 5 == 0 else f"bnd_{i % 40}",
        "at": i,
    }
    for i in range(2000)
]
#: What the look-up is asked, bound as the service binds it.
ASKED = {"p_message_id": "<dlv_7@lg.example>", "p_org": "org_0"}


def _fill(conn: sa.Connection) -> None:
    conn.execute(sa.text(_DELIVERY), ROWS)


def _accesses(conn: sa.Connection) -> list[str]:
    """The look-up's :func:`plan_accesses` (as in 0026's test)."""
    return plan_accesses(conn, EMAIL_REPLY_SESSIONS, ASKED)


def test_an_answered_replys_session_is_found_through_the_partial_index(db_url: str) -> None:
    found = migrated_with_index(db_url, "0026", INDEX, _fill, _accesses)
    # Email replies alone (those naming their binding): a card, a card's answer or
    # another channel's post adds no entry.
    assert found.predicate == (
        "channel = 'email' AND binding_id IS NOT NULL"
        if db_url.startswith("sqlite")
        else "(((channel)::text = 'email'::text) AND (binding_id IS NOT NULL))"
    )
    if db_url.startswith("sqlite"):
        assert found.accesses == [f"SEARCH deliveries USING INDEX {INDEX} (external_id=?)"], found
    else:
        assert len(found.accesses) == 1 and f"using {INDEX} on" in found.accesses[0], found
