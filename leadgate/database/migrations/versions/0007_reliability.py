"""reliability: live processes, recorded turn runs, lease owners

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 11:20:00

``processes`` holds one row per live service process (heartbeat); ``turn_runs`` holds
the turns recorded before their platform was answered until they finish; the review,
revision and send leases name the process that holds them (``lease_owner``), so a lease
of a process known dead is taken back at once.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "processes",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("host", sa.String(length=200), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("start_token", sa.String(length=40), nullable=False),
        sa.Column("role", sa.String(length=20), nullable=False),
        sa.Column("started_at", sa.BigInteger(), nullable=False),
        sa.Column("heartbeat_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_processes")),
    )
    op.create_table(
        "turn_runs",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("org_id", sa.String(length=40), nullable=False),
        sa.Column("agent_id", sa.String(length=40), nullable=False),
        sa.Column("session_id", sa.String(length=40), nullable=False),
        sa.Column("binding_id", sa.String(length=40), nullable=False),
        sa.Column("work_item_id", sa.String(length=40), nullable=True),
        sa.Column("message_id", sa.String(length=40), nullable=False),
        sa.Column("policy", sa.String(length=10), nullable=False),
        sa.Column("turn_id", sa.String(length=40), nullable=False),
        sa.Column("lease_owner", sa.String(length=40), nullable=True),
        sa.Column("lease_token", sa.String(length=40), nullable=False),
        sa.Column("lease_expires_at", sa.BigInteger(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_turn_runs")),
    )
    op.create_index(op.f("ix_turn_runs_session_id"), "turn_runs", ["session_id"], unique=False)
    op.create_index(op.f("ix_turn_runs_lease_token"), "turn_runs", ["lease_token"], unique=False)
    with op.batch_alter_table("work_items", schema=None) as batch_op:
        batch_op.add_column(sa.Column("lease_owner", sa.String(length=40), nullable=True))
    with op.batch_alter_table("deliveries", schema=None) as batch_op:
        batch_op.add_column(sa.Column("lease_owner", sa.String(length=40), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("deliveries", schema=None) as batch_op:
        batch_op.drop_column("lease_owner")
    with op.batch_alter_table("work_items", schema=None) as batch_op:
        batch_op.drop_column("lease_owner")
    op.drop_index(op.f("ix_turn_runs_lease_token"), table_name="turn_runs")
    op.drop_index(op.f("ix_turn_runs_session_id"), table_name="turn_runs")
    op.drop_table("turn_runs")
    op.drop_table("processes")
