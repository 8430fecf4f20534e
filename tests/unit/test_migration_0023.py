"""Migration 0023 on SQLite and PostgreSQL: the partial indexes of the Discord gateway's
events (``ix_inbound_events_gateway``) and of Slack's (``ix_inbound_events_slack``) exist
and each holds those alone, the schema matches ``schema.py``, both statements of each
catch-up's read (``binding.bindings.recorded_since``: Discord's at each READY, Slack's at
each start) reach ``inbound_events`` through that kind's index alone on both backends
(they scanned every event of every channel); down and up again."""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from binding.bindings import CATCH_UP_READS
from leadgate.core.types import DISCORD_MESSAGE_EVENT, SLACK_MESSAGE_EVENT
from leadgate.database.db import alembic_config
from leadgate.database.schema import metadata
from tests.helpers import sqlite_plan
from tests.unit.test_migration_0016 import run

#: Each index, with the event prefix its catch-up reads.
INDEXES = {
    "ix_inbound_events_gateway": DISCORD_MESSAGE_EVENT,
    "ix_inbound_events_slack": SLACK_MESSAGE_EVENT,
}


def _read(prefix: str) -> list[Any]:
    """The catch-up's two statements for ``prefix``, their values inlined."""
    sessions, since = CATCH_UP_READS[prefix]
    return [sessions, since.params(p_ids=["ses_1", "ses_2"], p_since=1)]


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


def _accesses(conn: sa.Connection, prefix: str) -> list[str]:
    """Each step of the read's plans that reads ``inbound_events`` (its three aliases):
    SQLite's ``EXPLAIN QUERY PLAN`` lines; PostgreSQL's scan nodes, with statistics
    (as autovacuum keeps them), sequential scans turned off (on tables this small the
    planner may scan anyway: the question is whether the index is used at all) and run
    (``ANALYZE``: a plain ``EXPLAIN`` does not show the subquery of the CTE's recursive
    step)."""
    if conn.dialect.name == "sqlite":
        steps = [step for stmt in _read(prefix) for step in sqlite_plan(conn, stmt)]
        return [s for s in steps if "_event" in s or "inbound_events" in s]
    conn.exec_driver_sql("ANALYZE")
    # (The service's own connections plan without bitmap scans: leadgate.database.pg.)
    conn.exec_driver_sql("SET enable_bitmapscan = off")
    conn.exec_driver_sql("SET enable_seqscan = off")
    steps = []
    for stmt in _read(prefix):
        sql = str(stmt.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True}))
        explain = "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) "
        steps += [str(row[0]) for row in conn.exec_driver_sql(explain + sql)]
    return [s.strip() for s in steps if " on inbound_events" in s]


def _predicate(conn: sa.Connection, index: str) -> str:
    """The index's WHERE, as the database keeps it."""
    if conn.dialect.name == "sqlite":
        sql = conn.exec_driver_sql(f"SELECT sql FROM sqlite_master WHERE name = '{index}'")
        return str(sql.scalar_one()).partition(" WHERE ")[2]
    predicate = conn.exec_driver_sql(
        "SELECT pg_get_expr(indpred, indrelid) FROM pg_index "
        f"WHERE indexrelid = '{index}'::regclass"
    )
    return str(predicate.scalar_one())


def test_each_catch_up_reads_its_events_through_their_partial_index(db_url: str) -> None:
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0022")
    before = run(db_url, _indexes)
    assert not before & INDEXES.keys()
    run(db_url, _fill)
    if db_url.startswith("sqlite"):
        # Every event of every channel (the read as it was scanned as much, twice).
        for prefix in INDEXES.values():
            steps = run(db_url, functools.partial(_accesses, prefix=prefix))
            assert any(s.startswith("SCAN") for s in steps)
    command.upgrade(cfg, "head")

    def check(conn: sa.Connection) -> dict[str, Any]:
        return {
            "indexes": _indexes(conn),
            "diff": compare_metadata(MigrationContext.configure(conn), metadata),
            "accesses": {index: _accesses(conn, prefix) for index, prefix in INDEXES.items()},
            "predicates": {index: _predicate(conn, index) for index in INDEXES},
        }

    out = run(db_url, check)
    assert out["indexes"] == before | INDEXES.keys()
    # The migrated schema is schema.py (the SQLite-only index aside, as in 0005's test).
    assert [
        d
        for d in out["diff"]
        if not (d[0] == "add_index" and d[1].name == "ix_messages_session_rowid")
    ] == []
    for index, prefix in INDEXES.items():
        accesses = out["accesses"][index]
        if db_url.startswith("sqlite"):
            assert accesses == [
                f"SEARCH first_event USING COVERING INDEX {index}",  # (min: its first entry)
                f"SEARCH later_event USING COVERING INDEX {index} (session_id>?)",
                f"SEARCH inbound_events USING COVERING INDEX {index} "
                "(session_id=? AND created_at>?)",
            ], accesses
            assert out["predicates"][index] == (
                f"substr(external_event_id, 1, {len(prefix)}) = '{prefix}'"
            )
        else:
            assert len(accesses) == 3 and all(f"using {index} on" in s for s in accesses), accesses
            assert out["predicates"][index] == (
                f"(substr((external_event_id)::text, 1, {len(prefix)}) = '{prefix}'::text)"
            )

    # Down and up again: the indexes go and come back.
    command.downgrade(cfg, "0022")
    assert run(db_url, _indexes) == before
    command.upgrade(cfg, "head")
    assert run(db_url, _indexes) == out["indexes"]
