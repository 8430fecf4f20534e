"""review destinations, reviewer links, review SLAs, episodes, cards, Teams conversations

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 12:00:00

Review cards tell reviewers where they already are (Slack, Teams, Discord, email) and
let them decide there; episodes carry the reminder, escalation and expiry timers.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

ID = sa.String(length=40)


def upgrade() -> None:
    op.create_table(
        "review_destinations",
        sa.Column("id", ID, nullable=False),
        sa.Column("org_id", ID, nullable=False),
        sa.Column("agent_id", ID, nullable=True),
        sa.Column("channel", sa.String(length=20), nullable=False),
        sa.Column("tier", sa.String(length=20), nullable=False),
        sa.Column("target", sa.String(length=500), nullable=False),
        sa.Column("address", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_review_destinations")),
    )
    with op.batch_alter_table("review_destinations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_review_destinations_org_id"), ["org_id"], unique=False)

    op.create_table(
        "user_links",
        sa.Column("id", ID, nullable=False),
        sa.Column("org_id", ID, nullable=False),
        sa.Column("user_id", ID, nullable=False),
        sa.Column("platform", sa.String(length=20), nullable=False),
        sa.Column("identity", sa.String(length=300), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_user_links")),
        sa.UniqueConstraint(
            "org_id", "platform", "identity", name=op.f("uq_user_links_org_id_platform_identity")
        ),
    )
    with op.batch_alter_table("user_links", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_user_links_user_id"), ["user_id"], unique=False)

    op.create_table(
        "review_sla",
        sa.Column("id", ID, nullable=False),
        sa.Column("org_id", ID, nullable=False),
        sa.Column("agent_id", ID, nullable=False),
        sa.Column("remind_after_ms", sa.BigInteger(), nullable=True),
        sa.Column("remind_every_ms", sa.BigInteger(), nullable=True),
        sa.Column("escalate_after_ms", sa.BigInteger(), nullable=True),
        sa.Column("expire_after_ms", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_review_sla")),
        sa.UniqueConstraint("org_id", "agent_id", name=op.f("uq_review_sla_org_id_agent_id")),
    )

    op.create_table(
        "review_episodes",
        sa.Column("id", ID, nullable=False),
        sa.Column("org_id", ID, nullable=False),
        sa.Column("work_item_id", ID, nullable=False),
        sa.Column("agent_id", ID, nullable=False),
        sa.Column("reason", sa.String(length=20), nullable=False),
        sa.Column("delivery_id", ID, nullable=True),
        sa.Column("started_at", sa.BigInteger(), nullable=False),
        sa.Column("due_at", sa.BigInteger(), nullable=True),
        sa.Column("next_remind_at", sa.BigInteger(), nullable=True),
        sa.Column("remind_every_ms", sa.BigInteger(), nullable=True),
        sa.Column("reminders", sa.Integer(), nullable=False),
        sa.Column("escalate_at", sa.BigInteger(), nullable=True),
        sa.Column("escalated_at", sa.BigInteger(), nullable=True),
        sa.Column("expire_at", sa.BigInteger(), nullable=True),
        sa.Column("expire_after_ms", sa.BigInteger(), nullable=True),
        sa.Column("closed_at", sa.BigInteger(), nullable=True),
        sa.Column("outcome", sa.String(length=40), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_review_episodes")),
    )
    with op.batch_alter_table("review_episodes", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_review_episodes_work_item_id"), ["work_item_id"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_review_episodes_due_at"), ["due_at"], unique=False)
        batch_op.create_index(
            "uq_review_episodes_open",
            ["work_item_id"],
            unique=True,
            sqlite_where=sa.text("closed_at IS NULL"),
            postgresql_where=sa.text("closed_at IS NULL"),
        )

    op.create_table(
        "review_cards",
        sa.Column("id", ID, nullable=False),
        sa.Column("org_id", ID, nullable=False),
        sa.Column("episode_id", ID, nullable=False),
        sa.Column("work_item_id", ID, nullable=False),
        sa.Column("delivery_id", ID, nullable=False),
        sa.Column("channel", sa.String(length=20), nullable=False),
        sa.Column("purpose", sa.String(length=20), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_review_cards")),
    )
    with op.batch_alter_table("review_cards", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_review_cards_episode_id"), ["episode_id"], unique=False
        )

    op.create_table(
        "teams_conversations",
        sa.Column("conversation_id", sa.String(length=300), nullable=False),
        sa.Column("tenant_id", sa.String(length=100), nullable=True),
        sa.Column("reference", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("conversation_id", name=op.f("pk_teams_conversations")),
    )


def downgrade() -> None:
    op.drop_table("teams_conversations")
    with op.batch_alter_table("review_cards", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_review_cards_episode_id"))
    op.drop_table("review_cards")
    with op.batch_alter_table("review_episodes", schema=None) as batch_op:
        batch_op.drop_index("uq_review_episodes_open")
        batch_op.drop_index(batch_op.f("ix_review_episodes_due_at"))
        batch_op.drop_index(batch_op.f("ix_review_episodes_work_item_id"))
    op.drop_table("review_episodes")
    op.drop_table("review_sla")
    with op.batch_alter_table("user_links", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_user_links_user_id"))
    op.drop_table("user_links")
    with op.batch_alter_table("review_destinations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_review_destinations_org_id"))
    op.drop_table("review_destinations")
