"""review_cards: index delivery_id (a card's row found from its outbox row)

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07 18:20:00

Statements go from a card's delivery to its ``review_cards`` row, joined on
``delivery_id``: a click on a card whose post was uncertain
(``leadgate.review.cards.uncertain_card``; a click that names no wait read every card
ever posted for each of the item's deliveries), and the relay reading the waits of
the card deliveries it gives back, or takes back after a lapsed send lease
(``outbox.store.cards_of_closed_waits``).
"""

from __future__ import annotations

from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("review_cards", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_review_cards_delivery_id"), ["delivery_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("review_cards", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_review_cards_delivery_id"))
