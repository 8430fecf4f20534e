"""continuations: one per (run_id, node_index)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06 23:30:00

Only the run's lease fence kept an agent node from registering two continuations (two
waiting continuations of one node could resume the flow twice). A unique index on
(run_id, node_index) now says so in the schema; the executor registers a node's
continuation with ``INSERT ... ON CONFLICT DO NOTHING`` and takes the row that is
there. Duplicates written before this migration would make the index fail to build:
one of each group is kept, the others are deleted. The kept one is the row that records
how the node's pause was settled: a ``resumed`` one (its summary and resumed run), else a
``closed`` one (its run ended), else one that knows its work item, else the earliest (by
created_at, then id: deterministic). A ``waiting`` duplicate of a settled node is the
stale one: the resumer never selects it (its item is completed, or its run no longer
``waitingForHitl``), so keeping it instead would only lose the record of the resume.

(Changed after 0016 first shipped, when it kept the earliest whatever its status: on a
database that ran it already nothing runs again, and running it again after a
downgrade finds no duplicates, so the change only decides which row a database that
has not run it yet keeps.)
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

#: Delete every continuation but the first of its (run_id, node_index) in the order above;
#: portable SQL (a window function: SQLite 3.25+, which RETURNING, used elsewhere,
#: already exceeds; PostgreSQL).
_DROP_DUPLICATES = sa.text(
    "DELETE FROM continuations WHERE id IN ("
    " SELECT id FROM ("
    "  SELECT id, ROW_NUMBER() OVER ("
    "   PARTITION BY run_id, node_index"
    "   ORDER BY CASE status WHEN 'resumed' THEN 0 WHEN 'closed' THEN 1 ELSE 2 END,"
    "   CASE WHEN work_item_id IS NULL THEN 1 ELSE 0 END, created_at, id"
    "  ) AS n FROM continuations"
    " ) AS ranked WHERE n > 1)"
)


def upgrade() -> None:
    op.execute(_DROP_DUPLICATES)
    with op.batch_alter_table("continuations", schema=None) as batch_op:
        batch_op.create_index("uq_continuations_run_node", ["run_id", "node_index"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("continuations", schema=None) as batch_op:
        batch_op.drop_index("uq_continuations_run_node")
