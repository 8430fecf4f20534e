"""Migration 0022 on SQLite and PostgreSQL: ``turn_runs.not_answered`` exists, runs
stored before it have none (rerun as before) and the schema matches ``schema.py``; down
again, a run marked ``resend`` is a ``rerun`` (the policy the older release knows), and
up again."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from leadgate.database.db import alembic_config
from leadgate.database.schema import metadata
from tests.unit.test_migration_0016 import run

_INSERT = (
    "INSERT INTO turn_runs (id, org_id, agent_id, session_id, binding_id, message_id, "
    "policy, turn_id, lease_token, lease_expires_at, attempts, created_at) VALUES "
    "(:id, 'org_1', 'agt_1', 'ses_1', 'bnd_1', 'msg_1', :policy, 'turn_1', :id, 1, 1, 1)"
)


def test_runs_stored_before_the_migration_have_no_messages_left_unshown(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0021")
    run(db_url, lambda conn: conn.execute(sa.text(_INSERT), {"id": "run_1", "policy": "rerun"}))
    command.upgrade(cfg, "head")

    def check(conn: sa.Connection) -> dict[str, Any]:
        rows = conn.execute(sa.text("SELECT id, not_answered FROM turn_runs")).all()
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
        return {"rows": [tuple(r) for r in rows], "diff": diff}

    out = run(db_url, check)
    assert out["rows"] == [("run_1", None)]
    # The migrated schema is schema.py (the SQLite-only index aside, as in 0005's test).
    assert [
        d
        for d in out["diff"]
        if not (d[0] == "add_index" and d[1].name == "ix_messages_session_rowid")
    ] == []

    def resend(conn: sa.Connection) -> None:
        conn.execute(sa.text(_INSERT), {"id": "run_2", "policy": "resend"})
        conn.execute(
            sa.text("UPDATE turn_runs SET not_answered = :ids WHERE id = 'run_2'"),
            {"ids": '["msg_0"]'},
        )

    run(db_url, resend)
    command.downgrade(cfg, "0021")
    rows = run(db_url, lambda conn: conn.execute(sa.text("SELECT id, policy FROM turn_runs")).all())
    assert sorted(tuple(r) for r in rows) == [("run_1", "rerun"), ("run_2", "rerun")]
    command.upgrade(cfg, "head")
