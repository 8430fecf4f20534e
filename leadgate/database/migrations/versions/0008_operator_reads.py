"""operators: audit and work-item indexes for the console's reads, names for users and keys

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 09:00:00

The console's live updates read, about once a second per open console, the newest audit
rows of one organization: (org_id, created_at) serves that as an index range. Agent
Activity lists an organization's items newest first: (org_id, updated_at). Users and API
keys get an optional display name, shown for audit actors and in ``leadgate key list``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("audit", schema=None) as batch_op:
        batch_op.create_index("ix_audit_org_created", ["org_id", "created_at"], unique=False)
    with op.batch_alter_table("work_items", schema=None) as batch_op:
        batch_op.create_index("ix_work_items_org_updated", ["org_id", "updated_at"], unique=False)
    with op.batch_alter_table("users", schema=None) as batch_op:
        batch_op.add_column(sa.Column("name", sa.String(length=200), nullable=True))
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("name", sa.String(length=200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_column("name")
    with op.batch_alter_table("users", schema=None) as batch_op:
        batch_op.drop_column("name")
    with op.batch_alter_table("work_items", schema=None) as batch_op:
        batch_op.drop_index("ix_work_items_org_updated")
    with op.batch_alter_table("audit", schema=None) as batch_op:
        batch_op.drop_index("ix_audit_org_created")
