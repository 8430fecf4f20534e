"""flow_runs lease: a running flow run is leased to the process executing it

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06 10:00:00

A run whose process died while it was ``running`` stayed ``running`` for ever: nothing
held it and nothing looked for it. The executor now holds a lease on the run
(``lease_token``, ``lease_expires_at``, ``lease_owner``: its process), renews it while
nodes run and fences every write of the run's progress and outcome by status and token;
the flow-recovery runner continues a run whose lease lapsed (or whose holder is known
dead) under a new token. Runs left ``running`` by an older version have no lease: they
count as lapsed and are continued too. The index on flow_runs serves the recovery
runner's poll; the one on continuations.run_id, an agent node executed again looking for
the continuation an earlier attempt registered.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("flow_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("lease_token", sa.String(length=40), nullable=True))
        batch_op.add_column(sa.Column("lease_expires_at", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("lease_owner", sa.String(length=40), nullable=True))
        batch_op.create_index(
            "ix_flow_runs_status_lease", ["status", "lease_expires_at"], unique=False
        )
    op.create_index(op.f("ix_continuations_run_id"), "continuations", ["run_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_continuations_run_id"), table_name="continuations")
    with op.batch_alter_table("flow_runs", schema=None) as batch_op:
        batch_op.drop_index("ix_flow_runs_status_lease")
        batch_op.drop_column("lease_owner")
        batch_op.drop_column("lease_expires_at")
        batch_op.drop_column("lease_token")
