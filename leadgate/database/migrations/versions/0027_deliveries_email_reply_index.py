"""deliveries: a partial index of the email replies by the Message-ID they were sent under

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-07 20:00:00

A person's answer naming in ``In-Reply-To`` alone (no ``References``) one of our email
replies sent before its Message-ID carried its thread (``.t.<base32>``) finds that reply's
session by the delivery that sent it (``external_id``, the Message-ID): one seek of this
index. Email replies alone, a plain turn's and a gated turn's (those name their binding;
cards and card answers name none; the predicate is repeated literally by the read), and a row's
``external_id`` is written once, when it is sent.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None

# (schema.EMAIL_REPLY_PREDICATE as of this revision.)
_PREDICATE = "channel = 'email' AND binding_id IS NOT NULL"


def upgrade() -> None:
    with op.batch_alter_table("deliveries", schema=None) as batch_op:
        batch_op.create_index(
            "ix_deliveries_email_reply_external",
            ["external_id"],
            unique=False,
            sqlite_where=sa.text(_PREDICATE),
            postgresql_where=sa.text(_PREDICATE),
        )


def downgrade() -> None:
    with op.batch_alter_table("deliveries", schema=None) as batch_op:
        batch_op.drop_index("ix_deliveries_email_reply_external")
