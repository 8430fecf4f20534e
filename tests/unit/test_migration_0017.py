"""Migration 0017 on SQLite and PostgreSQL: ``flow_runs.recovery_attempts`` exists and
runs stored before it start at zero; down and up again."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import command

from leadgate.database.db import alembic_config
from tests.unit.test_migration_0016 import run


def test_runs_stored_before_the_migration_start_with_no_recovery_attempts(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0016")
    run(
        db_url,
        lambda conn: conn.execute(
            sa.text(
                "INSERT INTO flow_runs (id, org_id, flow_id, status, outputs, start_index, "
                "created_at, updated_at) VALUES ('run_1', 'org_1', 'flw_1', 'running', '[]', "
                "0, 1, 1)"
            )
        ),
    )
    command.upgrade(cfg, "head")
    attempts = run(
        db_url,
        lambda conn: conn.execute(sa.text("SELECT id, recovery_attempts FROM flow_runs")).all(),
    )
    assert [tuple(r) for r in attempts] == [("run_1", 0)]
    command.downgrade(cfg, "0016")
    command.upgrade(cfg, "head")
