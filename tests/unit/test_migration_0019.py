"""Migration 0019 on SQLite and PostgreSQL: ``review_cards.reply_token_hash`` (unique,
nullable) is added, existing cards keep their rows with no token, the schema matches
``schema.py``; down and up again."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from leadgate.database.db import alembic_config
from leadgate.database.schema import metadata
from tests.unit.test_migration_0016 import run

CARD = {
    "id": "rcard_1",
    "org_id": "org_1",
    "episode_id": "rep_1",
    "work_item_id": "wi_1",
    "delivery_id": "dlv_1",
    "channel": "email",
    "purpose": "notify",
    "created_at": 1,
}


def _columns(conn: sa.Connection) -> set[str]:
    return {str(c["name"]) for c in sa.inspect(conn).get_columns("review_cards")}


def _unique_indexes(conn: sa.Connection) -> dict[str, list[str]]:
    return {
        str(ix["name"]): [str(c) for c in ix["column_names"]]
        for ix in sa.inspect(conn).get_indexes("review_cards")
        if ix["unique"]
    }


def test_the_reply_token_hash_is_added_and_existing_cards_keep_their_rows(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0018")

    def seed(conn: sa.Connection) -> None:
        conn.execute(sa.table("review_cards", *map(sa.column, CARD)).insert().values(**CARD))

    run(db_url, seed)
    assert "reply_token_hash" not in run(db_url, _columns)
    command.upgrade(cfg, "head")

    def check(conn: sa.Connection) -> dict[str, Any]:
        return {
            "columns": _columns(conn),
            "unique": _unique_indexes(conn),
            "rows": [
                tuple(r)
                for r in conn.execute(sa.text("SELECT id, reply_token_hash FROM review_cards"))
            ],
            "diff": compare_metadata(MigrationContext.configure(conn), metadata),
        }

    out = run(db_url, check)
    assert "reply_token_hash" in out["columns"]
    assert out["unique"]["uq_review_cards_reply_token_hash"] == ["reply_token_hash"]
    assert out["rows"] == [("rcard_1", None)]
    # The migrated schema is schema.py (the SQLite-only index aside, as in 0005's test).
    assert [
        d
        for d in out["diff"]
        if not (d[0] == "add_index" and d[1].name == "ix_messages_session_rowid")
    ] == []

    # Down and up again: the column goes and comes back; the card stays.
    command.downgrade(cfg, "0018")
    assert "reply_token_hash" not in run(db_url, _columns)
    command.upgrade(cfg, "head")
    assert run(db_url, check)["rows"] == [("rcard_1", None)]
