"""queues: the claim order's tie-breaker (id) in the status indexes

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03 09:00:00

The relay claims ``pending`` deliveries ``ORDER BY next_attempt_at, id`` and the lead
runner ``reviewQueued`` items ``ORDER BY updated_at, id``, each ``LIMIT`` a batch. With
the indexes on (status, time) alone, SQLite sorted every row sharing a timestamp in a
temporary B-tree before the limit applied: a backlog enqueued in one burst (a schedule,
a flow, a restore) was read whole on every claim. With ``id`` last in the index the
order is the index's and the claim reads only the batch, on SQLite and PostgreSQL.
"""

from __future__ import annotations

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("deliveries", schema=None) as batch_op:
        batch_op.drop_index("ix_deliveries_status_due")
        batch_op.create_index(
            "ix_deliveries_status_due", ["status", "next_attempt_at", "id"], unique=False
        )
    with op.batch_alter_table("work_items", schema=None) as batch_op:
        batch_op.drop_index("ix_work_items_status_updated")
        batch_op.create_index(
            "ix_work_items_status_updated", ["status", "updated_at", "id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("work_items", schema=None) as batch_op:
        batch_op.drop_index("ix_work_items_status_updated")
        batch_op.create_index(
            "ix_work_items_status_updated", ["status", "updated_at"], unique=False
        )
    with op.batch_alter_table("deliveries", schema=None) as batch_op:
        batch_op.drop_index("ix_deliveries_status_due")
        batch_op.create_index(
            "ix_deliveries_status_due", ["status", "next_attempt_at"], unique=False
        )
