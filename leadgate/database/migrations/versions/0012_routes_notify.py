"""PostgreSQL: writes to routes NOTIFY every replica, as agents' do (0010)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03 07:30:00

Every Slack, Discord, Teams or email message resolves its route before the platform is
answered: one round trip per inbound message on PostgreSQL, for rows that change a few
times a day. With this trigger a replica keeps each channel's routes while it hears of
every change to them (``binding.routes.RouteCache`` under
``leadgate.database.pg.TableChanges``), as it keeps agents and policy rules since 0010,
whose notifying function this reuses. SQLite needs nothing (``PRAGMA data_version``).
"""

from __future__ import annotations

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

# Frozen here (a migration must not change with the code); a test compares them with
# leadgate.database.pg's NOTIFYING_TABLES together with 0010's.
TABLES = ("routes",)
FUNCTION = "leadgate_notify_table_change"  # created by 0010


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in TABLES:
        op.execute(
            f"CREATE TRIGGER {table}_notify_change"
            f" AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON {table}"
            f" FOR EACH STATEMENT EXECUTE FUNCTION {FUNCTION}()"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in TABLES:
        op.execute(f"DROP TRIGGER IF EXISTS {table}_notify_change ON {table}")
