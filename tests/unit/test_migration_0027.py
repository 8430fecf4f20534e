"""Migration 0027 on SQLite and PostgreSQL: the partial index of the email replies by
the Message-ID they were sent under (``ix_deliveries_email_reply_external``) exists and
holds those alone, the schema matches ``schema.py``, and the look-up of an answered
reply's session (``binding.bindings.EMAIL_REPLY_SESSIONS``) reaches ``deliveries``
through it on both backends (it scanned every delivery); down and up again."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from binding.bindings import EMAIL_REPLY_SESSIONS
from leadgate.database.db import alembic_config
from leadgate.database.schema import metadata
from tests.unit.test_migration_0016 import run
from tests.unit.test_migration_0026 import delivery_indexes, index_predicate, plan_accesses

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


def _predicate(conn: sa.Connection) -> str:
    return index_predicate(conn, INDEX)


def test_an_answered_replys_session_is_found_through_the_partial_index(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0026")
    before = run(db_url, delivery_indexes)
    assert INDEX not in before
    run(db_url, _fill)
    if db_url.startswith("sqlite"):
        # Every delivery.
        steps = run(db_url, _accesses)
        assert len(steps) == 1 and steps[0].startswith("SCAN "), steps
    command.upgrade(cfg, "head")

    def check(conn: sa.Connection) -> dict[str, Any]:
        return {
            "indexes": delivery_indexes(conn),
            "diff": compare_metadata(MigrationContext.configure(conn), metadata),
            "predicate": _predicate(conn),
            "accesses": _accesses(conn),
        }

    out = run(db_url, check)
    assert out["indexes"] == before | {INDEX}
    # The migrated schema is schema.py (the SQLite-only index aside, as in 0005's test).
    assert [
        d
        for d in out["diff"]
        if not (d[0] == "add_index" and d[1].name == "ix_messages_session_rowid")
    ] == []
    # Email replies alone (those naming their binding): a card, a card's answer or
    # another channel's post adds no entry.
    assert out["predicate"] == (
        "channel = 'email' AND binding_id IS NOT NULL"
        if db_url.startswith("sqlite")
        else "(((channel)::text = 'email'::text) AND (binding_id IS NOT NULL))"
    )
    if db_url.startswith("sqlite"):
        assert out["accesses"] == [f"SEARCH deliveries USING INDEX {INDEX} (external_id=?)"], out[
            "accesses"
        ]
    else:
        assert len(out["accesses"]) == 1 and f"using {INDEX} on" in out["accesses"][0], out[
            "accesses"
        ]

    command.downgrade(cfg, "0026")
    assert run(db_url, delivery_indexes) == before
    command.upgrade(cfg, "head")
    assert run(db_url, delivery_indexes) == out["indexes"]
