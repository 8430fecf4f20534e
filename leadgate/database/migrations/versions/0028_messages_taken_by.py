"""messages.taken_by (the process whose plain REST/MCP/Studio turn took the message in)
and gone_processes (the processes known gone whose messages are not searched yet)

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-07 20:00:00

A plain turn (a worker with no lead) on REST, MCP or Studio records no run, so a message
whose process died before its answer was stored looked like an answered one. The
intake's own INSERT now names its process (``processes.id``); turn recovery finds the
messages of processes known gone that nothing answered, and records their runs
(``leadgate.turns.runs.record_taken``): the processes a reap (or a stop) removed are
noted in ``gone_processes`` and searched once each, within a window of their last
heartbeat, by the partial index (plain turns' user messages alone).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None

# (schema.TAKEN_BY_PREDICATE as of this revision.)
_PREDICATE = "taken_by IS NOT NULL"


def upgrade() -> None:
    op.create_table(
        "gone_processes",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("heartbeat_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gone_processes")),
    )
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.add_column(sa.Column("taken_by", sa.String(40), nullable=True))
        batch_op.create_index(
            "ix_messages_taken_by",
            ["taken_by", "created_at"],
            unique=False,
            sqlite_where=sa.text(_PREDICATE),
            postgresql_where=sa.text(_PREDICATE),
        )


def downgrade() -> None:
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.drop_index("ix_messages_taken_by")
        batch_op.drop_column("taken_by")
    op.drop_table("gone_processes")
