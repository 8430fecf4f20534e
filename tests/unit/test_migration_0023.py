"""Migration 0023 on SQLite and PostgreSQL: the partial index of the Discord gateway's
events (``ix_inbound_events_gateway``) exists and holds those alone, the schema matches
``schema.py``, both statements of the catch-up's read at each READY
(``binding.bindings.recorded_since``) reach ``inbound_events`` through that index alone
on both backends (they scanned every event of every channel); down and up again."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from binding.bindings import _GATEWAY_EVENTS_SINCE, _GATEWAY_SESSIONS
from leadgate.database.db import alembic_config
from leadgate.database.schema import metadata
from tests.helpers import sqlite_plan
from tests.unit.test_migration_0016 import run

INDEX = "ix_inbound_events_gateway"
#: The two statements, their values inlined.
READ = [_GATEWAY_SESSIONS, _GATEWAY_EVENTS_SINCE.params(p_ids=["ses_1", "ses_2"], p_since=1)]

_SESSION = (
    "INSERT INTO sessions (id, org_id, agent_id, key, created_at, event_seq, watched_until) "
    "VALUES (:id, 'org_1', 'agt_1', :key, 1, 0, 0)"
)
_EVENT = (
    "INSERT INTO inbound_events (id, org_id, agent_id, session_id, outcome, content, "
    "external_event_id, created_at) VALUES "
    "(:id, 'org_1', 'agt_1', :session, 'accepted', 'x', :event, :at)"
)


def _fill(conn: sa.Connection) -> None:
    """40 sessions, 2,000 events: one in a hundred a Discord gateway message (in 4 of
    them), the rest other channels' (Slack, a slash command, REST without a key), so
    that PostgreSQL's planner, once it has statistics, weighs the index against the
    table as it would in service."""
    conn.execute(sa.text(_SESSION), [{"id": f"ses_{i}", "key": f"k{i}"} for i in range(40)])
    events = []
    for i in range(2000):
        other = (f"slack:T1:C1:{i}.1", f"discord:interaction:{i}", None)[i % 3]
        event = f"discord:message:{i}" if i % 100 == 0 else other
        events.append({"id": f"evt_{i}", "session": f"ses_{i % 40}", "event": event, "at": i})
    conn.execute(sa.text(_EVENT), events)


def _indexes(conn: sa.Connection) -> set[str]:
    return {str(ix["name"]) for ix in sa.inspect(conn).get_indexes("inbound_events")}


def _accesses(conn: sa.Connection) -> list[str]:
    """Each step of the read's plans that reads ``inbound_events`` (its three aliases):
    SQLite's ``EXPLAIN QUERY PLAN`` lines; PostgreSQL's scan nodes, with statistics
    (as autovacuum keeps them), sequential scans turned off (on tables this small the
    planner may scan anyway: the question is whether the index is used at all) and run
    (``ANALYZE``: a plain ``EXPLAIN`` does not show the subquery of the CTE's recursive
    step)."""
    if conn.dialect.name == "sqlite":
        steps = [step for stmt in READ for step in sqlite_plan(conn, stmt)]
        return [s for s in steps if "_event" in s or "inbound_events" in s]
    conn.exec_driver_sql("ANALYZE")
    # (The service's own connections plan without bitmap scans: leadgate.database.pg.)
    conn.exec_driver_sql("SET enable_bitmapscan = off")
    conn.exec_driver_sql("SET enable_seqscan = off")
    steps = []
    for stmt in READ:
        sql = str(stmt.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True}))
        explain = "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) "
        steps += [str(row[0]) for row in conn.exec_driver_sql(explain + sql)]
    return [s.strip() for s in steps if " on inbound_events" in s]


def _predicate(conn: sa.Connection) -> str:
    """The index's WHERE, as the database keeps it."""
    if conn.dialect.name == "sqlite":
        sql = conn.exec_driver_sql(f"SELECT sql FROM sqlite_master WHERE name = '{INDEX}'")
        return str(sql.scalar_one()).partition(" WHERE ")[2]
    predicate = conn.exec_driver_sql(
        "SELECT pg_get_expr(indpred, indrelid) FROM pg_index "
        f"WHERE indexrelid = '{INDEX}'::regclass"
    )
    return str(predicate.scalar_one())


def test_the_catch_up_reads_the_gateway_events_through_their_partial_index(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0022")
    before = run(db_url, _indexes)
    assert INDEX not in before
    run(db_url, _fill)
    if db_url.startswith("sqlite"):
        # Every event of every channel (the read as it was scanned as much, twice).
        assert any(s.startswith("SCAN") for s in run(db_url, _accesses))
    command.upgrade(cfg, "head")

    def check(conn: sa.Connection) -> dict[str, Any]:
        return {
            "indexes": _indexes(conn),
            "diff": compare_metadata(MigrationContext.configure(conn), metadata),
            "accesses": _accesses(conn),
            "predicate": _predicate(conn),
        }

    out = run(db_url, check)
    assert out["indexes"] == before | {INDEX}
    # The migrated schema is schema.py (the SQLite-only index aside, as in 0005's test).
    assert [
        d
        for d in out["diff"]
        if not (d[0] == "add_index" and d[1].name == "ix_messages_session_rowid")
    ] == []
    accesses = out["accesses"]
    if db_url.startswith("sqlite"):
        assert accesses == [
            f"SEARCH first_event USING COVERING INDEX {INDEX}",  # (min: its first entry)
            f"SEARCH later_event USING COVERING INDEX {INDEX} (session_id>?)",
            f"SEARCH inbound_events USING COVERING INDEX {INDEX} (session_id=? AND created_at>?)",
        ], accesses
        assert out["predicate"] == "substr(external_event_id, 1, 16) = 'discord:message:'"
    else:
        assert len(accesses) == 3 and all(f"using {INDEX} on" in s for s in accesses), accesses
        assert out["predicate"] == (
            "(substr((external_event_id)::text, 1, 16) = 'discord:message:'::text)"
        )

    # Down and up again: the index goes and comes back.
    command.downgrade(cfg, "0022")
    assert run(db_url, _indexes) == before
    command.upgrade(cfg, "head")
    assert run(db_url, _indexes) == out["indexes"]
