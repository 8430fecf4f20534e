"""users.disabled_at: a console user can be disabled (offboarding, a leaked password)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05 17:30:00

A disabled user cannot log in, has no console session (disabling deletes them), decides
nothing from a chat card, and cannot be named by ``--as``. The row stays, so the audit
trail keeps naming who decided what.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("users", schema=None) as batch_op:
        batch_op.add_column(sa.Column("disabled_at", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("users", schema=None) as batch_op:
        batch_op.drop_column("disabled_at")
