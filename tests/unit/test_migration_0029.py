"""Migration 0029 on SQLite and PostgreSQL: ``messages.answers`` (the user message a
plain REST/MCP/Studio turn's assistant message answers), no index; the schema matches
``schema.py``; a message stored before it keeps its row (``answers`` NULL); down and up
again. Turn recovery's looks for an answer walk the session's events after the message
by the event log's primary key and read each message they name by its own."""

from __future__ import annotations

import asyncio
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from leadgate.database import schema as t
from leadgate.database.db import Database, alembic_config
from leadgate.database.schema import metadata
from leadgate.turns import runs
from tests.unit.test_migration_0016 import run
from tests.unit.test_migration_0026 import plan_accesses
from tests.unit.test_migration_0028 import INDEX, _old_message


def _columns(conn: sa.Connection) -> set[str]:
    return {str(c["name"]) for c in sa.inspect(conn).get_columns("messages")}


def test_messages_gain_answers(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0028")
    assert "answers" not in run(db_url, _columns)
    run(db_url, _old_message)
    command.upgrade(cfg, "head")

    def check(conn: sa.Connection) -> dict[str, Any]:
        return {
            "columns": _columns(conn),
            "diff": compare_metadata(MigrationContext.configure(conn), metadata),
            "answers": conn.execute(sa.text("SELECT answers FROM messages")).all(),
        }

    out = run(db_url, check)
    assert "answers" in out["columns"]
    assert [
        d
        for d in out["diff"]
        if not (d[0] == "add_index" and d[1].name == "ix_messages_session_rowid")
    ] == []
    assert out["answers"] == [(None,)]
    command.downgrade(cfg, "0028")
    assert "answers" not in run(db_url, _columns)
    command.upgrade(cfg, "head")
    assert run(db_url, _columns) == out["columns"]


def test_the_gone_process_search_walks_each_sessions_events_after_the_message(
    migrated_url: str,
) -> None:
    """The search of a gone process's unanswered messages (``runs._TAKEN``) reaches them
    through ``ix_messages_taken_by``, finds each one's event and walks the events after
    it by the event log's primary key (session, seq), each message they name read by its
    primary key: no scan of the session's messages, no new index."""

    def accesses(conn: sa.Connection) -> list[str]:
        params = {"p_process": "prc_1", "p_since": 0}
        return plan_accesses(conn, runs._TAKEN, params, ("messages", "session_events", "B-TREE"))

    found = run(migrated_url, accesses)
    if migrated_url.startswith("sqlite"):
        assert found == [
            f"SEARCH messages USING INDEX {INDEX} (taken_by=? AND created_at>?)",
            "SEARCH after_event USING INDEX sqlite_autoindex_session_events_1 "
            "(session_id=? AND seq>?)",
            # (ORDER BY seq DESC LIMIT 1: the walk stops at the message's own event.)
            "SEARCH session_events USING INDEX sqlite_autoindex_session_events_1 (session_id=?)",
            "SEARCH after_message USING INDEX sqlite_autoindex_messages_1 (id=?)",
            "USE TEMP B-TREE FOR RIGHT PART OF ORDER BY",  # (the few rows found, by id)
        ]
    else:
        assert [a.removeprefix("->  ") for a in found] == [
            f"Index Scan using {INDEX} on messages",
            "Index Scan using pk_session_events on session_events after_event",
            "Index Scan using pk_messages on messages after_message",
            "Index Scan Backward using pk_session_events on session_events",
        ]


def test_a_thought_dead_turns_look_for_its_stored_answer_walks_the_events_after_it(
    migrated_url: str,
) -> None:
    """``runs._STORED_ANSWER`` (a turn whose process may have been reaped, before it
    stores its answer) reads the same way, for one message."""

    def accesses(conn: sa.Connection) -> list[str]:
        params = {"p_session": "ses_1", "p_message": "msg_1"}
        return plan_accesses(
            conn, runs._STORED_ANSWER, params, ("messages", "session_events", "B-TREE")
        )

    found = run(migrated_url, accesses)
    if migrated_url.startswith("sqlite"):
        assert found == [
            "SEARCH after_event USING INDEX sqlite_autoindex_session_events_1 "
            "(session_id=? AND seq>?)",
            "SEARCH session_events USING INDEX sqlite_autoindex_session_events_1 (session_id=?)",
            "SEARCH after_message USING INDEX sqlite_autoindex_messages_1 (id=?)",
        ]
    else:
        assert [a.removeprefix("->  ") for a in found] == [
            "Index Scan Backward using pk_session_events on session_events",
            "Index Scan using pk_session_events on session_events after_event",
            "Index Scan using pk_messages on messages after_message",
        ]


def test_a_recovery_claim_reads_its_sessions_runs_by_index_in_the_messages_order(
    migrated_url: str,
) -> None:
    """A recovery claim's runs of one session (``runs.session_runs``, the session's
    order: their messages') are found through the runs' session index, each message
    read by its primary key, and sorted in memory (a session's few runs): no scan. On
    PostgreSQL only the runs are locked (``FOR UPDATE OF turn_runs``), never the
    messages a turn is writing beside them."""
    db = Database(migrated_url)
    try:
        takeable = runs.R.lease_expires_at < sa.bindparam("p_now")
        stmt = db.skip_locked(
            runs.session_runs(takeable, sa.bindparam("p_session")), of=t.turn_runs
        )
    finally:
        asyncio.run(db.close())

    def accesses(conn: sa.Connection) -> list[str]:
        params = {"p_now": 0, "p_session": "ses_1"}
        return plan_accesses(conn, stmt, params, ("messages", "turn_runs", "B-TREE"))

    found = run(migrated_url, accesses)
    if migrated_url.startswith("sqlite"):
        assert found == [
            "SEARCH turn_runs USING INDEX ix_turn_runs_session_id (session_id=?)",
            "SEARCH messages USING INDEX sqlite_autoindex_messages_1 (id=?)",
            "USE TEMP B-TREE FOR ORDER BY",
        ]
    else:
        sql = run(migrated_url, lambda conn: str(stmt.compile(dialect=conn.dialect)))
        assert sql.endswith("FOR UPDATE OF turn_runs SKIP LOCKED")
        assert [a.removeprefix("->  ") for a in found] == [
            "Index Scan using ix_turn_runs_session_id on turn_runs",
            "Index Scan using pk_messages on messages",
        ]
