"""sessions.watched_until: NOTIFY a session's events only while some replica reads them

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 05:00:00

Every visible message and every public status change of a session sent a ``pg_notify``
on ``leadgate_session_events``, so that event streams and MCP subscriptions on other
replicas wake up. PostgreSQL signals every listening backend of the database for each
one, and each then reads the queue and passes the notification on: about an eighth of a
plain turn's cost on PostgreSQL, for sessions nobody reads (nearly all of them). A
replica whose reader starts on a session now sets ``watched_until`` (the server's clock
plus a lease it keeps renewing) before the reader's first read, and the statements that
write events NOTIFY only while it lies ahead (see ``leadgate.domain.session_events``).
SQLite has no NOTIFY; the column is there on both so that the schema is one.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("watched_until", sa.BigInteger(), server_default="0", nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.drop_column("watched_until")
