"""Migration 0020 on SQLite and PostgreSQL: ``review_cards.delivery_id`` is indexed, the
schema matches ``schema.py``, SQLite's plans for the statements that go from a card's
delivery to its ``review_cards`` row use the index (no scan of every card); down and up
again."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from leadgate.database.db import alembic_config
from leadgate.database.schema import metadata
from leadgate.review.cards import _UNCERTAIN_CARDS
from outbox.store import _SENDING_CARDS_WAITS, D
from tests.helpers import sqlite_plan
from tests.unit.test_migration_0016 import run

#: A click naming no wait (leadgate.review.cards.uncertain_card), and the relay giving
#: back a claim (outbox.store.cards_of_closed_waits, by lease token).
BY_DELIVERY = [
    _UNCERTAIN_CARDS.where(D.work_item_id == "wi_1", D.channel == "discord"),
    _SENDING_CARDS_WAITS.where(D.lease_token == "lease_1"),
]


def _indexes(conn: sa.Connection) -> set[str]:
    return {str(ix["name"]) for ix in sa.inspect(conn).get_indexes("review_cards")}


def _plans(conn: sa.Connection) -> list[str]:
    return [step for stmt in BY_DELIVERY for step in sqlite_plan(conn, stmt)]


def test_review_cards_delivery_id_is_indexed_and_used(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0019")
    before = run(db_url, _indexes)
    assert "ix_review_cards_delivery_id" not in before
    if db_url.startswith("sqlite"):
        assert any("SCAN review_cards" in p for p in run(db_url, _plans))
    command.upgrade(cfg, "head")

    def check(conn: sa.Connection) -> dict[str, Any]:
        return {
            "indexes": _indexes(conn),
            "diff": compare_metadata(MigrationContext.configure(conn), metadata),
            "plans": _plans(conn) if conn.dialect.name == "sqlite" else None,
        }

    out = run(db_url, check)
    assert out["indexes"] == before | {"ix_review_cards_delivery_id"}
    # The migrated schema is schema.py (the SQLite-only index aside, as in 0005's test).
    assert [
        d
        for d in out["diff"]
        if not (d[0] == "add_index" and d[1].name == "ix_messages_session_rowid")
    ] == []
    if out["plans"] is not None:
        assert out["plans"] == [
            "SEARCH deliveries USING INDEX ix_deliveries_work_item_id (work_item_id=?)",
            "SEARCH review_cards USING COVERING INDEX ix_review_cards_delivery_id (delivery_id=?)",
            "SEARCH deliveries USING INDEX ix_deliveries_status_due (status=?)",
            "SEARCH review_cards USING INDEX ix_review_cards_delivery_id (delivery_id=?)",
            "SEARCH review_episodes USING INDEX sqlite_autoindex_review_episodes_1 (id=?)",
            "USE TEMP B-TREE FOR ORDER BY",  # (the lock order, for PostgreSQL)
        ], out["plans"]

    # Down and up again: the index goes and comes back.
    command.downgrade(cfg, "0019")
    assert run(db_url, _indexes) == before
    command.upgrade(cfg, "head")
    assert run(db_url, _indexes) == out["indexes"]
