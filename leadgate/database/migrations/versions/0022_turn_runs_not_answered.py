"""turn_runs.not_answered: a rerun keeps the messages its claim closed

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-07 06:30:00

A turn recovery claim closes the REST runs whose clients were told nothing was stored
(their resends are their turns) and reruns the others of the session, whose model is
not shown those messages. The claim writes their ids on the runs it reruns, in its own
transaction, so that a rerun whose process dies is run again without them too (they
were shown again, and the rerun answered one of them). A keyed REST request's run rerun
because its intake was in doubt says so in ``policy`` (``resend``), which needs no
column. Existing runs have none (NULL): they are rerun as before.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("turn_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("not_answered", sa.JSON(), nullable=True))


def downgrade() -> None:
    # The release before this one knows no ``resend`` policy: such a run is a rerun
    # there, as it was before (its failure's audit says its client was told not to
    # resend).
    op.execute("UPDATE turn_runs SET policy = 'rerun' WHERE policy = 'resend'")
    with op.batch_alter_table("turn_runs", schema=None) as batch_op:
        batch_op.drop_column("not_answered")
