"""inbound_events: partial indexes of the Discord gateway's and Slack's messages

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-07 07:00:00

The Discord catch-up at each gateway READY and the Slack catch-up at each start read which
sessions ever took in a message of theirs and which did lately
(``binding.bindings.recorded_since``). ``inbound_events`` has no index on ``session_id``
or ``created_at`` and is never pruned, and a ``LIKE 'discord:message:%'`` cannot use the
unique index on ``external_event_id`` (on SQLite at all, on PostgreSQL outside the C
collation): each read scanned every event of every channel. Each index holds one
channel's events alone (the predicate is repeated literally by the read, and is no LIKE,
which PostgreSQL in the C collation can turn into a range of the unique index instead),
so no other channel's intake writes to it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

# (schema.GATEWAY_EVENT_PREDICATE and SLACK_EVENT_PREDICATE as of this revision.)
_INDEXES = {
    "ix_inbound_events_gateway": "substr(external_event_id, 1, 16) = 'discord:message:'",
    "ix_inbound_events_slack": "substr(external_event_id, 1, 6) = 'slack:'",
}


def upgrade() -> None:
    with op.batch_alter_table("inbound_events", schema=None) as batch_op:
        for name, predicate in _INDEXES.items():
            batch_op.create_index(
                name,
                ["session_id", "created_at", "external_event_id"],
                unique=False,
                sqlite_where=sa.text(predicate),
                postgresql_where=sa.text(predicate),
            )


def downgrade() -> None:
    with op.batch_alter_table("inbound_events", schema=None) as batch_op:
        for name in _INDEXES:
            batch_op.drop_index(name)
