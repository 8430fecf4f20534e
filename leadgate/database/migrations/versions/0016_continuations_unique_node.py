"""continuations: one per (run_id, node_index)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06 23:30:00

Only the run's lease fence kept an agent node from registering two continuations (two
waiting continuations of one node could resume the flow twice). A unique index on
(run_id, node_index) now says so in the schema; the executor registers a node's
continuation with ``INSERT ... ON CONFLICT DO NOTHING`` and takes the row that is
there. Duplicates written before this migration would make the index fail to build:
the earliest of each pair is kept (by created_at, then id: deterministic), the others
are deleted.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

#: Delete every continuation that has an earlier one of the same run and node (ties on
#: created_at broken by id), keeping exactly one per pair; portable SQL (SQLite and
#: PostgreSQL both accept the correlated subquery on the table being deleted from).
_DROP_LATER_DUPLICATES = sa.text(
    "DELETE FROM continuations WHERE EXISTS ("
    " SELECT 1 FROM continuations AS earlier"
    " WHERE earlier.run_id = continuations.run_id"
    " AND earlier.node_index = continuations.node_index"
    " AND (earlier.created_at < continuations.created_at"
    " OR (earlier.created_at = continuations.created_at AND earlier.id < continuations.id)))"
)


def upgrade() -> None:
    op.execute(_DROP_LATER_DUPLICATES)
    with op.batch_alter_table("continuations", schema=None) as batch_op:
        batch_op.create_index("uq_continuations_run_node", ["run_id", "node_index"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("continuations", schema=None) as batch_op:
        batch_op.drop_index("uq_continuations_run_node")
