"""audit: the surface and platform identity of human decisions

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 10:50:00

A decision records where it was made (console, api, cli, slack, teams, discord, email)
and which platform identity made it, beside the leadgate actor.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("audit", schema=None) as batch_op:
        batch_op.add_column(sa.Column("surface", sa.String(length=20), nullable=True))
        batch_op.add_column(sa.Column("identity", sa.String(length=300), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("audit", schema=None) as batch_op:
        batch_op.drop_column("identity")
        batch_op.drop_column("surface")
