"""Migration 0030 on SQLite and PostgreSQL: ``processes.turns_since`` and
``gone_processes.turns_since`` (when the oldest plain REST/MCP/Studio turn a process had
in flight at its last heartbeat began: turn recovery's search of a gone process reaches
back to it); the schema matches ``schema.py``; rows written before keep theirs (NULL:
the search's window is the heartbeat's, as it was); down and up again. (The search's
plan is unchanged: ``test_migration_0029.py``.)"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from leadgate.database.db import alembic_config
from leadgate.database.schema import metadata
from tests.unit.test_migration_0016 import run

TABLES = ("processes", "gone_processes")


def _columns(conn: sa.Connection) -> dict[str, set[str]]:
    inspector = sa.inspect(conn)
    return {table: {str(c["name"]) for c in inspector.get_columns(table)} for table in TABLES}


def _old_rows(conn: sa.Connection) -> None:
    conn.execute(
        sa.text(
            "INSERT INTO processes (id, host, pid, start_token, role, started_at, "
            "heartbeat_at) VALUES ('prc_1', 'h', 1, '?', 'api', 1, 2)"
        )
    )
    conn.execute(sa.text("INSERT INTO gone_processes (id, heartbeat_at) VALUES ('prc_2', 3)"))


def test_processes_and_their_notes_gain_turns_since(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0029")
    assert all("turns_since" not in columns for columns in run(db_url, _columns).values())
    run(db_url, _old_rows)
    command.upgrade(cfg, "head")

    def check(conn: sa.Connection) -> dict[str, Any]:
        return {
            "columns": _columns(conn),
            "diff": compare_metadata(MigrationContext.configure(conn), metadata),
            "since": [
                conn.execute(sa.text(f"SELECT turns_since FROM {table}")).all() for table in TABLES
            ],
        }

    out = run(db_url, check)
    assert all("turns_since" in columns for columns in out["columns"].values())
    assert [
        d
        for d in out["diff"]
        if not (d[0] == "add_index" and d[1].name == "ix_messages_session_rowid")
    ] == []
    assert out["since"] == [[(None,)], [(None,)]]
    command.downgrade(cfg, "0029")
    assert all("turns_since" not in columns for columns in run(db_url, _columns).values())
    command.upgrade(cfg, "head")
    assert run(db_url, _columns) == out["columns"]
