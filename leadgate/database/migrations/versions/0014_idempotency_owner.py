"""idempotency_keys.owner: a claim's renewals and release are fenced by its token

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05 20:20:00

A request that stalled past its claim's lease, and was taken over by a retry, could
release (delete) the key the retry now held, so a third request ran the turn again
beside it. Claims now carry a token; rows written before this migration have none, and
lapse as before.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("idempotency_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("owner", sa.String(length=40), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("idempotency_keys", schema=None) as batch_op:
        batch_op.drop_column("owner")
