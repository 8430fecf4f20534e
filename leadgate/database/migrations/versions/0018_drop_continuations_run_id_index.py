"""continuations: drop ix_continuations_run_id, made redundant by 0016's unique index

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07 02:00:00

Migration 0015 indexed ``continuations.run_id`` so that an agent node executed again
finds its continuation. Migration 0016's unique index on (run_id, node_index) leads with
the same column and serves every lookup by run (SQLite's planner already chose it over
this one for all of them: ``run_view``, ``register_continuation``, the resumer's join);
the single-column index only cost a write per continuation and the space.
"""

from __future__ import annotations

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("continuations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_continuations_run_id"))


def downgrade() -> None:
    with op.batch_alter_table("continuations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_continuations_run_id"), ["run_id"], unique=False)
