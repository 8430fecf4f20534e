"""processes.turns_since and gone_processes.turns_since (when the oldest plain turn a
process had in flight at its last heartbeat took its message in)

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-08 01:00:00

Turn recovery searched a gone process's plain REST/MCP/Studio messages within its last
heartbeat less 15 minutes (``RUN_LEASE_MS``), so a turn that ran longer before its
process died (a long model stream, a tool loop: no limit bounds a whole turn) was never
found and its message never answered. Each heartbeat now writes, in the UPDATE it
already runs, when the oldest such turn in flight took its message in (NULL: none); a
reap or a stop copies it into the process's note, and the search reaches back to it
(``leadgate.turns.runs.record_taken``), by the same index. Rows of older releases keep
NULL: the window is the heartbeat's, as it was.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None

_TABLES = ("processes", "gone_processes")


def upgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("turns_since", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("turns_since")
