"""PostgreSQL: writes to agents, presets and policy rules NOTIFY every replica

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 19:00:00

Every turn's intake reads its agent (with its lead) and the organization's policy rules:
two of a plain turn's nine round trips on PostgreSQL, for rows that change a few times a
day. A replica keeps them between turns only while it hears of every change, whoever
makes it (another replica, the CLI, ``psql``): a statement-level trigger on each table
sends ``pg_notify('leadgate_table_changes', '<table> <writer tag>')``, delivered at commit to each
replica's LISTEN connection (``leadgate.database.pg.TableChanges``). Statement-level:
one notification per statement however many rows it changes, and PostgreSQL folds equal
notifications of one transaction into one. SQLite needs nothing (``PRAGMA data_version``).
"""

from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# Frozen here (a migration must not change with the code): leadgate.database.pg's
# CHANGES_CHANNEL and NOTIFYING_TABLES, which a test compares with these.
CHANNEL = "leadgate_table_changes"
TABLES = ("agents", "presets", "policy_rules")
FUNCTION = "leadgate_notify_table_change"
# The writing connection's tag (set at connect by the service's pool; unset elsewhere):
# a replica skips the notifications of its own writes, which it counted at commit.
SENDER = "leadgate.sender"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        f"CREATE FUNCTION {FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$"
        f" BEGIN PERFORM pg_notify('{CHANNEL}', TG_TABLE_NAME || ' '"
        f" || coalesce(current_setting('{SENDER}', true), '')); RETURN NULL; END $$"
    )
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
    op.execute(f"DROP FUNCTION IF EXISTS {FUNCTION}()")
