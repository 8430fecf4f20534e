"""session events, idempotency keys, one public session name per api session

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 12:00:00

* ``session_events``: the public per-session event log of the review-status SSE stream
  (``GET /v1/agents/{agent}/sessions/{session}/events``) and of MCP resource updates.
  It starts empty: events are written from this version on (the transcript read serves
  older messages).
* ``sessions.event_seq``: the per-session counter that orders concurrent writers of that
  log on PostgreSQL.
* ``idempotency_keys``: ``Idempotency-Key`` of ``POST /v1/chat/completions`` (hashed).
* Session keys: ``X-Session-Id``, the body's ``user`` and MCP's ``session`` are now one
  namespace (stored as ``h:<name>``). Sessions stored as ``u:<name>`` (named by ``user``)
  are renamed to ``h:<name>`` unless the same agent already has an ``h:<name>`` session;
  on such a collision the ``h:`` session keeps the name and the ``u:`` one stays as it
  is (its history and work items are kept, reachable by operators, no longer by name).
  The downgrade leaves keys as they are.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("event_seq", sa.BigInteger(), nullable=False, server_default="0")
        )
    op.create_table(
        "session_events",
        sa.Column("session_id", sa.String(length=40), nullable=False),
        sa.Column("seq", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("kind", sa.String(length=10), nullable=False),
        sa.Column("message_id", sa.String(length=40), nullable=True),
        sa.Column("status", sa.String(length=20), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("session_id", "seq", name=op.f("pk_session_events")),
    )
    op.create_table(
        "idempotency_keys",
        sa.Column("org_id", sa.String(length=40), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("lease_expires_at", sa.BigInteger(), nullable=False),
        sa.Column("response", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("org_id", "key_hash", name=op.f("pk_idempotency_keys")),
    )
    with op.batch_alter_table("idempotency_keys", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_idempotency_keys_created_at"), ["created_at"], unique=False
        )
    # One public session name, one session: `user` sessions join the X-Session-Id
    # namespace where that causes no collision (see the module docstring).
    op.execute(
        sa.text(
            "UPDATE sessions SET key = 'h:' || substr(key, 3) "
            "WHERE key LIKE 'u:%' AND NOT EXISTS ("
            "SELECT 1 FROM sessions AS other "
            "WHERE other.agent_id = sessions.agent_id AND other.key = 'h:' || substr(sessions.key, 3))"
        )
    )


def downgrade() -> None:
    with op.batch_alter_table("idempotency_keys", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_idempotency_keys_created_at"))
    op.drop_table("idempotency_keys")
    op.drop_table("session_events")
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.drop_column("event_seq")
