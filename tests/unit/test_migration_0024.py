"""Migration 0024 on SQLite and PostgreSQL: ``catch_up_points`` (where each channel's
next catch-up starts) exists, empty (every channel's first catch-up starts from the newest
message taken in there, as before), and the schema matches ``schema.py``; down and up
again."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from leadgate.database.db import alembic_config
from leadgate.database.schema import metadata
from tests.unit.test_migration_0016 import run


def _tables(conn: sa.Connection) -> set[str]:
    return set(sa.inspect(conn).get_table_names())


def test_channels_have_no_read_point_until_their_first_catch_up(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0023")
    before = run(db_url, _tables)
    assert "catch_up_points" not in before
    command.upgrade(cfg, "head")

    def check(conn: sa.Connection) -> dict[str, Any]:
        rows = conn.execute(sa.text("SELECT * FROM catch_up_points")).all()
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
        return {"rows": rows, "diff": diff}

    out = run(db_url, check)
    assert out["rows"] == []
    # The migrated schema is schema.py (the SQLite-only index aside, as in 0005's test).
    assert [
        d
        for d in out["diff"]
        if not (d[0] == "add_index" and d[1].name == "ix_messages_session_rowid")
    ] == []

    # Down and up again: the table goes (its points with it) and comes back.
    run(
        db_url,
        lambda conn: conn.execute(
            sa.text(
                "INSERT INTO catch_up_points (channel, conversation, start_ms, updated_at) "
                "VALUES ('discord', '1', 1, 1)"
            )
        ),
    )
    command.downgrade(cfg, "0023")
    assert run(db_url, _tables) == before
    command.upgrade(cfg, "head")
    assert (
        run(db_url, lambda conn: conn.execute(sa.text("SELECT * FROM catch_up_points")).all()) == []
    )
