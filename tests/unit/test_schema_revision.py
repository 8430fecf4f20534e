"""The schema revision constant the CLI and ``check_migrated`` read without Alembic."""

from __future__ import annotations

from alembic.script import ScriptDirectory

from leadgate.database.db import alembic_config, known_revisions
from leadgate.database.revision import HEAD


def test_the_constant_is_alembics_head() -> None:
    # A new migration under leadgate/database/migrations/versions moves the head: this
    # fails until leadgate/database/revision.py says so too.
    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    assert script.get_current_head() == HEAD


def test_known_revisions_are_every_migration() -> None:
    known = known_revisions()
    assert HEAD in known
    assert {"0001", "0018"} <= known
