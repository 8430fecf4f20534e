"""Migration 0025 on SQLite and PostgreSQL: ``catch_up_points.read_through`` exists,
false for the points stored before it (their next catch-up starts from the point, as
before, and marks it), and the schema matches ``schema.py``; down and up again."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from leadgate.database.db import alembic_config
from leadgate.database.schema import metadata
from tests.unit.test_migration_0016 import run

_POINTS = "SELECT channel, conversation, start_ms{} FROM catch_up_points"


def test_points_stored_before_are_not_read_through(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0024")
    run(
        db_url,
        lambda conn: conn.execute(
            sa.text("INSERT INTO catch_up_points VALUES ('slack', 'T1:C1', 5, 6)")
        ),
    )
    command.upgrade(cfg, "head")

    def check(conn: sa.Connection) -> dict[str, Any]:
        rows = conn.execute(sa.text(_POINTS.format(", read_through"))).all()
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
        return {"rows": [tuple(r) for r in rows], "diff": diff}

    out = run(db_url, check)
    assert out["rows"] == [("slack", "T1:C1", 5, False)]
    # The migrated schema is schema.py (the SQLite-only index aside, as in 0005's test).
    assert [
        d
        for d in out["diff"]
        if not (d[0] == "add_index" and d[1].name == "ix_messages_session_rowid")
    ] == []

    # Down and up again: the column goes, the points stay.
    command.downgrade(cfg, "0024")
    kept = run(db_url, lambda conn: [tuple(r) for r in conn.execute(sa.text(_POINTS.format("")))])
    assert kept == [("slack", "T1:C1", 5)]
    command.upgrade(cfg, "head")
