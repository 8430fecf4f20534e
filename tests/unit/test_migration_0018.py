"""Migration 0018 on SQLite and PostgreSQL: ``ix_continuations_run_id`` is dropped (0016's
unique index on (run_id, node_index) serves lookups by run), the schema matches
``schema.py``, SQLite's plans for lookups by run use the unique index; down and up
again."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from leadgate.database import schema as t
from leadgate.database.db import alembic_config
from leadgate.database.schema import metadata
from tests.helpers import sqlite_plan
from tests.unit.test_migration_0016 import run

C = t.continuations.c
#: Every statement that finds continuations by run (flows.runs: run_view,
#: register_continuation's read-back).
BY_RUN = [
    sa.select(t.continuations).where(C.run_id == "run_1"),
    sa.select(C.id).where(C.run_id == "run_1", C.node_index == 0),
]


def _indexes(conn: sa.Connection) -> set[str]:
    return {str(ix["name"]) for ix in sa.inspect(conn).get_indexes("continuations")}


def _plans(conn: sa.Connection) -> list[str]:
    return [step for stmt in BY_RUN for step in sqlite_plan(conn, stmt)]


def test_the_run_id_index_is_dropped_and_lookups_by_run_use_the_unique_index(
    db_url: str,
) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0017")
    before = run(db_url, _indexes)
    assert {"ix_continuations_run_id", "uq_continuations_run_node"} <= before
    command.upgrade(cfg, "head")

    def check(conn: sa.Connection) -> dict[str, Any]:
        return {
            "indexes": _indexes(conn),
            "diff": compare_metadata(MigrationContext.configure(conn), metadata),
            "plans": _plans(conn) if conn.dialect.name == "sqlite" else None,
        }

    out = run(db_url, check)
    assert out["indexes"] == before - {"ix_continuations_run_id"}
    # The migrated schema is schema.py (the SQLite-only index aside, as in 0005's test).
    assert [
        d
        for d in out["diff"]
        if not (d[0] == "add_index" and d[1].name == "ix_messages_session_rowid")
    ] == []
    if out["plans"] is not None:
        assert out["plans"] == [
            "SEARCH continuations USING INDEX uq_continuations_run_node (run_id=?)",
            "SEARCH continuations USING INDEX uq_continuations_run_node (run_id=? AND "
            "node_index=?)",
        ]

    # Down and up again: the index comes back and goes.
    command.downgrade(cfg, "0017")
    assert run(db_url, _indexes) == before
    command.upgrade(cfg, "head")
    assert run(db_url, _indexes) == out["indexes"]
