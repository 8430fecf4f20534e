"""catch_up_points.read_through: a catch-up starts from the newest message taken in

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-07 17:10:00

A channel's read point moved only when a catch-up read it through, to that catch-up's
start: a channel that took in live messages for longer than ``catch_up_s`` since was
read back over the whole window at each start (Slack) or READY (Discord), a wasted
history scan per channel against the platform's rate limits. The next catch-up of a
channel whose last one read it through now starts from the newest message taken in
there (less a minute), when that is later; one that is being read or whose read failed
starts from its point alone (a live message taken in since may be newer than those
missed). Existing points have no such mark (false): their next catch-up starts from the
point, as before, and marks it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("catch_up_points", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("read_through", sa.Boolean(), server_default=sa.false(), nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("catch_up_points", schema=None) as batch_op:
        batch_op.drop_column("read_through")
