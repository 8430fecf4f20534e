"""deliveries: a partial index of an organization's gating deliveries by creation time

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-07 18:00:00

The insights' deliveries count (``review.insights.delivery_counts``: an organization's
gating deliveries created in the window) had no index starting with ``org_id`` and read
every delivery of every organization, growing with the table rather than the window.
The index holds gating rows alone (the predicate is repeated literally by the read), so
a plain turn's reply adds no entry, and its columns never change after the insert.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

# (schema.GATING_DELIVERY_PREDICATE as of this revision.)
_PREDICATE = "kind = 'gating'"


def upgrade() -> None:
    with op.batch_alter_table("deliveries", schema=None) as batch_op:
        batch_op.create_index(
            "ix_deliveries_org_gating_created",
            ["org_id", "created_at"],
            unique=False,
            sqlite_where=sa.text(_PREDICATE),
            postgresql_where=sa.text(_PREDICATE),
        )


def downgrade() -> None:
    with op.batch_alter_table("deliveries", schema=None) as batch_op:
        batch_op.drop_index("ix_deliveries_org_gating_created")
