"""catch_up_points: where each channel's next catch-up starts

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-07 08:30:00

The Discord catch-up at each gateway READY and the Slack catch-up at each start read a
channel from the newest message taken in there. A catch-up that failed for a channel
(a refused read, a crash mid-read, the database away) and then a live message taken in
there moved that start past the messages still missed: they were never read. Each
channel now keeps the point its next catch-up starts from, moved forward only when a
catch-up has read it through. Existing channels have none: their first catch-up starts
from the newest message taken in, as before, and stores that.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "catch_up_points",
        sa.Column("channel", sa.String(length=20), nullable=False),
        sa.Column("conversation", sa.String(length=300), nullable=False),
        sa.Column("start_ms", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("channel", "conversation", name=op.f("pk_catch_up_points")),
    )


def downgrade() -> None:
    op.drop_table("catch_up_points")
