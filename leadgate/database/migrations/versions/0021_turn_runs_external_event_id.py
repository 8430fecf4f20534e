"""turn_runs.external_event_id: a recorded turn knows the event it was taken in under

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-07 02:00:00

A REST request with an ``Idempotency-Key`` takes its message in under an external event
id made from the key (``idem:...``). When its process dies mid-turn, the client's
retry with the same key takes the key over and finds that message taken in; it finds
the message's run by this column and runs the turn itself (the run waits for its
client's resend), or, once turn recovery reran it, the rerun stored its answer under
the key through it. Existing runs have none (NULL): they are recovered as before.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("turn_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("external_event_id", sa.String(300), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("turn_runs", schema=None) as batch_op:
        batch_op.drop_column("external_event_id")
