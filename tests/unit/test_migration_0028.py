"""Migration 0028 on SQLite and PostgreSQL: ``messages.taken_by`` with its partial index
(``ix_messages_taken_by``: the plain REST/MCP/Studio turns' user messages alone) and the
``gone_processes`` table; the schema matches ``schema.py``; a message stored before it
keeps its row (``taken_by`` NULL, outside the index); down and up again. (Turn
recovery's search of a gone process's messages, which reaches them through that index:
``test_migration_0029.py``.)"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from leadgate.database.db import alembic_config
from leadgate.database.schema import TAKEN_BY_PREDICATE, metadata
from tests.unit.test_migration_0016 import run
from tests.unit.test_migration_0026 import index_predicate

INDEX = "ix_messages_taken_by"


def _shape(conn: sa.Connection) -> tuple[set[str], set[str], set[str]]:
    inspector = sa.inspect(conn)
    return (
        {str(c["name"]) for c in inspector.get_columns("messages")},
        {str(ix["name"]) for ix in inspector.get_indexes("messages")},
        set(inspector.get_table_names()),
    )


def _old_message(conn: sa.Connection) -> None:
    conn.execute(
        sa.text(
            "INSERT INTO messages (id, org_id, session_id, role, content, lead_gated, "
            "created_at) VALUES ('msg_1', 'org_1', 'ses_1', 'user', 'hi', false, 1)"
        )
    )


def test_messages_gain_taken_by_and_gone_processes_appear(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0027")
    columns, indexes, tables = run(db_url, _shape)
    assert "taken_by" not in columns and INDEX not in indexes and "gone_processes" not in tables
    run(db_url, _old_message)
    command.upgrade(cfg, "head")

    def check(conn: sa.Connection) -> dict[str, Any]:
        return {
            "shape": _shape(conn),
            "diff": compare_metadata(MigrationContext.configure(conn), metadata),
            "taken_by": conn.execute(sa.text("SELECT taken_by FROM messages")).all(),
            "predicate": index_predicate(conn, INDEX),
        }

    out = run(db_url, check)
    columns, indexes, tables = out["shape"]
    assert "taken_by" in columns and INDEX in indexes and "gone_processes" in tables
    assert [
        d
        for d in out["diff"]
        if not (d[0] == "add_index" and d[1].name == "ix_messages_session_rowid")
    ] == []
    assert out["taken_by"] == [(None,)]
    # The migration's predicate is schema.py's (compare_metadata does not compare them).
    assert out["predicate"] == (
        TAKEN_BY_PREDICATE if db_url.startswith("sqlite") else f"({TAKEN_BY_PREDICATE})"
    )
    command.downgrade(cfg, "0027")
    columns, indexes, tables = run(db_url, _shape)
    assert "taken_by" not in columns and INDEX not in indexes and "gone_processes" not in tables
    command.upgrade(cfg, "head")
    assert run(db_url, _shape) == out["shape"]
