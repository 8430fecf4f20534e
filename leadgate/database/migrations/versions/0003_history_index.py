"""messages: one (session_id, created_at, id) index for the history read

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 07:40:00

The turn path reads a session's newest 50 messages ordered by (created_at, id). With the
old (session_id, created_at) index SQLite sorted every message of the session in a temp
B-tree; the new index is walked in order and the read stops after 50 rows. It replaces
the old index, a prefix of it. On SQLite, (session_id, rowid) serves the in-process
history cache (engine/history.py), which reads only the rows added since its last read.
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.create_index(
            "ix_messages_session_created_id", ["session_id", "created_at", "id"], unique=False
        )
        batch_op.drop_index("ix_messages_session_created")
    if op.get_bind().dialect.name == "sqlite":
        # (session_id, rowid): the history cache reads a session's new rows by rowid.
        op.create_index("ix_messages_session_rowid", "messages", ["session_id"], unique=False)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.drop_index("ix_messages_session_rowid", table_name="messages")
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.create_index(
            "ix_messages_session_created", ["session_id", "created_at"], unique=False
        )
        batch_op.drop_index("ix_messages_session_created_id")
