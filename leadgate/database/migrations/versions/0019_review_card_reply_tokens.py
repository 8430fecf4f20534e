"""review_cards.reply_token_hash: email review cards are answered by replying

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07 10:40:00

With ``[email] review_reply_address`` set, each email card carries a ``Reply-To`` of
that address plus a random token (``<local>+<token>@<domain>``); a reply to it is the
reviewer's decision on that one card. The token's SHA-256 is kept here, unique, so that
the listener finds the card by it; the token itself is stored nowhere. Existing cards
(and every card of a service without the setting) have none and cannot be answered by
mail.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("review_cards", schema=None) as batch_op:
        batch_op.add_column(sa.Column("reply_token_hash", sa.String(length=64), nullable=True))
        batch_op.create_index("uq_review_cards_reply_token_hash", ["reply_token_hash"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("review_cards", schema=None) as batch_op:
        batch_op.drop_index("uq_review_cards_reply_token_hash")
        batch_op.drop_column("reply_token_hash")
