"""Migration 0021 on SQLite and PostgreSQL: ``turn_runs.external_event_id`` exists, runs
stored before it have none (recovered as before); down and up again."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import command

from leadgate.database.db import alembic_config
from tests.unit.test_migration_0016 import run


def test_runs_stored_before_the_migration_have_no_external_event_id(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0020")
    run(
        db_url,
        lambda conn: conn.execute(
            sa.text(
                "INSERT INTO turn_runs (id, org_id, agent_id, session_id, binding_id, "
                "message_id, policy, turn_id, lease_token, lease_expires_at, attempts, "
                "created_at) VALUES ('run_1', 'org_1', 'agt_1', 'ses_1', 'bnd_1', 'msg_1', "
                "'client', 'turn_1', 'lease_1', 1, 1, 1)"
            )
        ),
    )
    command.upgrade(cfg, "head")
    rows = run(
        db_url,
        lambda conn: conn.execute(sa.text("SELECT id, external_event_id FROM turn_runs")).all(),
    )
    assert [tuple(r) for r in rows] == [("run_1", None)]
    command.downgrade(cfg, "0020")
    command.upgrade(cfg, "head")
