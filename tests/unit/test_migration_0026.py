"""Migration 0026 on SQLite and PostgreSQL: the partial index of the gating deliveries
(``ix_deliveries_org_gating_created``) exists and holds those alone, the schema matches
``schema.py``, the insights' deliveries count (``review.insights.delivery_counts``)
reaches ``deliveries`` through it on both backends (it scanned every organization's
deliveries) and counts the same; down and up again."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from leadgate.database.db import alembic_config
from leadgate.database.schema import metadata
from leadgate.review.insights import delivery_counts
from tests.unit.test_migration_0016 import run

INDEX = "ix_deliveries_org_gating_created"
#: The count's window: the newer half of the rows.
SINCE = 1000

_DELIVERY = (
    "INSERT INTO deliveries (id, org_id, work_item_id, kind, action, channel, address, "
    "text, status, attempts, next_attempt_at, created_at, updated_at) VALUES "
    "(:id, :org, 'wi_1', :kind, 'post', :channel, '{}', 'x', :status, 1, :at, :at, :at)"
)


#: 2,000 deliveries of 7 organizations over 2,000 ms: a third replies, the rest gating
#: rows in two channels and three outcomes, so that PostgreSQL's planner, once it has
#: statistics, weighs the index against the table as it would in service.
ROWS: list[dict[str, Any]] = [
    {
        "id": f"dlv_{i}",
        "org": f"org_{i % 7}",
        "kind": "reply" if i % 3 == 0 else "gating",
        "channel": ("slack", "teams")[i // 7 % 2],
        "status": ("sent", "failed", "deliveryUnknown")[i // 14 % 3],
        "at": i,
    }
    for i in range(2000)
]
#: org_3's gating deliveries since SINCE, by (status, channel).
EXPECTED = sorted(
    (status, channel, n)
    for (status, channel), n in Counter(
        (r["status"], r["channel"])
        for r in ROWS
        if r["org"] == "org_3" and r["kind"] == "gating" and r["at"] >= SINCE
    ).items()
)


def _fill(conn: sa.Connection) -> None:
    conn.execute(sa.text(_DELIVERY), ROWS)


def _counts(conn: sa.Connection) -> list[tuple[str, str, int]]:
    rows = conn.execute(delivery_counts("org_3", SINCE)).all()
    return sorted((r.status, r.channel, r.n) for r in rows)


def plan_accesses(
    conn: sa.Connection,
    stmt: sa.Select[Any],
    params: dict[str, Any] | None = None,
    tables: tuple[str, ...] = ("deliveries",),
) -> list[str]:
    """Each step of ``stmt``'s plan that reads one of ``tables``, its values bound as the
    service binds them (``params``; a partial index whose predicate a bound value had to
    imply would not be used): SQLite's ``EXPLAIN QUERY PLAN`` lines; PostgreSQL's scan
    nodes of the generic plan a prepared statement comes to, with statistics (as
    autovacuum keeps them) and sequential scans turned off (on a table this small the
    planner may scan anyway: the question is whether the index is used at all)."""
    compiled = stmt.compile(dialect=conn.dialect)
    values = compiled.construct_params(params)
    bound = tuple(values[name] for name in compiled.positiontup or ())
    if conn.dialect.name == "sqlite":
        plan = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {compiled}", bound)
        return [str(row[3]) for row in plan if any(n in str(row[3]) for n in tables)]
    conn.exec_driver_sql("ANALYZE")
    # (The service's own connections plan without bitmap scans: leadgate.database.pg.)
    conn.exec_driver_sql("SET enable_bitmapscan = off")
    conn.exec_driver_sql("SET enable_seqscan = off")
    conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
    conn.exec_driver_sql(f"PREPARE planned AS {compiled}")
    literals = ", ".join(repr(v) for v in bound)
    plan = conn.exec_driver_sql(f"EXPLAIN (COSTS OFF) EXECUTE planned({literals})")
    return [str(row[0]).strip() for row in plan if any(f" on {n} " in f"{row[0]} " for n in tables)]


def _accesses(conn: sa.Connection) -> list[str]:
    """The count's :func:`plan_accesses`."""
    return plan_accesses(conn, delivery_counts("org_3", SINCE))


def delivery_indexes(conn: sa.Connection) -> set[str]:
    """The names of ``deliveries``' indexes."""
    return {str(ix["name"]) for ix in sa.inspect(conn).get_indexes("deliveries")}


def index_predicate(conn: sa.Connection, index: str) -> str:
    """``index``'s WHERE, as the database keeps it."""
    if conn.dialect.name == "sqlite":
        sql = conn.exec_driver_sql(f"SELECT sql FROM sqlite_master WHERE name = '{index}'")
        return str(sql.scalar_one()).partition(" WHERE ")[2]
    predicate = conn.exec_driver_sql(
        "SELECT pg_get_expr(indpred, indrelid) FROM pg_index "
        f"WHERE indexrelid = '{index}'::regclass"
    )
    return str(predicate.scalar_one())


class IndexAtHead(NamedTuple):
    """What :func:`migrated_with_index` read at head, for the test to check."""

    predicate: str
    accesses: list[str]


def migrated_with_index(
    db_url: str,
    previous: str,
    index: str,
    fill: Callable[[sa.Connection], object],
    accesses: Callable[[sa.Connection], list[str]],
) -> IndexAtHead:
    """A migration adding ``index`` to ``deliveries``, checked the one way: migrated to
    ``previous`` and ``fill``-ed, SQLite reads every delivery for the statement
    ``accesses`` plans; at head the index is there and the schema is ``schema.py``'s
    (the SQLite-only index aside, as in 0005's test); down to ``previous`` and up again,
    the index goes and comes back. Its predicate and the statement's plan steps at head."""
    cfg = alembic_config(db_url)
    command.upgrade(cfg, previous)
    before = run(db_url, delivery_indexes)
    assert index not in before
    run(db_url, fill)
    if db_url.startswith("sqlite"):
        steps = run(db_url, accesses)
        assert len(steps) == 1 and steps[0].startswith("SCAN deliveries"), steps
    command.upgrade(cfg, "head")

    def at_head(conn: sa.Connection) -> tuple[set[str], list[Any], IndexAtHead]:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
        return (
            delivery_indexes(conn),
            diff,
            IndexAtHead(index_predicate(conn, index), accesses(conn)),
        )

    got: tuple[set[str], list[Any], IndexAtHead] = run(db_url, at_head)
    indexes, diff, found = got
    assert index in indexes
    assert [
        d for d in diff if not (d[0] == "add_index" and d[1].name == "ix_messages_session_rowid")
    ] == []
    command.downgrade(cfg, previous)
    assert run(db_url, delivery_indexes) == before
    command.upgrade(cfg, "head")
    assert run(db_url, delivery_indexes) == indexes
    return found


def _filled(conn: sa.Connection) -> None:
    _fill(conn)
    assert _counts(conn) == EXPECTED and len(EXPECTED) == 4


def test_the_deliveries_count_reads_gating_rows_through_their_partial_index(
    db_url: str,
) -> None:
    found = migrated_with_index(db_url, "0025", INDEX, _filled, _accesses)
    assert run(db_url, _counts) == EXPECTED
    # Gating rows alone: a reply adds no entry.
    assert found.predicate == (
        "kind = 'gating'" if db_url.startswith("sqlite") else "((kind)::text = 'gating'::text)"
    )
    if db_url.startswith("sqlite"):
        assert found.accesses == [
            f"SEARCH deliveries USING INDEX {INDEX} (org_id=? AND created_at>?)"
        ], found.accesses
    else:
        assert len(found.accesses) == 1 and f"using {INDEX} on" in found.accesses[0], found
