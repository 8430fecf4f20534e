"""flow_runs.recovery_attempts: recovery of a run that cannot go on is bounded

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06 23:50:00

A running run that could not be executed (its flow deleted, its outputs not decoding)
was claimed by the flow-recovery runner again every time its lease lapsed (about every
two minutes), for ever. Every claim now counts here, and a run that makes progress (keeps
a node's output) starts again from zero; after ``MAX_RECOVERIES`` claims without progress
recovery fails the run (rule ``flow.unrecoverable``). Existing runs start at zero.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("flow_runs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("recovery_attempts", sa.Integer(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("flow_runs", schema=None) as batch_op:
        batch_op.drop_column("recovery_attempts")
