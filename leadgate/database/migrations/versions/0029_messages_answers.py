"""messages.answers (the user message an assistant message of a plain REST/MCP/Studio
turn answers)

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-07 23:00:00

Turn recovery took a gone process's plain message as answered when any message of its
session came after it, so the answer to another message of the session (two plain turns
in flight at once: parallel MCP tool calls, REST calls without ``user``) hid a message
that nothing answered. The assistant message such a turn stores now names the user
message it answers, in the INSERT it already runs (no index: the look walks the
session's events after the message). Rows stored before keep NULL: turn recovery counts
such an assistant message as answering what came before it, as it did.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.add_column(sa.Column("answers", sa.String(40), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.drop_column("answers")
