"""Small SQL helpers shared by the engine, the review runner and the outbox."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

from leadgate.database.plans import AnyRow

if TYPE_CHECKING:
    from leadgate.database.db import Conn


@functools.cache
def one_row(claim: sa.CTE) -> sa.Join:
    """``(SELECT 1) LEFT JOIN claim ON true``: the FROM of a claim statement that answers
    one row even when ``claim`` (a locked pick, or the move of one) took none, its
    columns NULL then, so that the statement still reports what it saw beside the claim
    (whether rows it skipped as locked by another transaction were there). A claim of
    several rows answers one row for each."""
    return sa.select(sa.literal(1)).subquery("one").outerjoin(claim, sa.true())


def locked_by_id(table: sa.Table, *where: sa.ColumnElement[bool], name: str) -> sa.CTE:
    """PostgreSQL: ``SELECT id FROM table WHERE ... ORDER BY id FOR UPDATE`` as CTE
    ``name``, for a multi-row fenced update or delete to join (``table.c.id ==
    cte.c.id``, or :func:`is_locked`) so that it locks its rows in id order, in the same
    statement. The id is the table's primary key: a table keyed by several columns
    (``idempotency_keys``) has its rows locked in the order of that key. An ``UPDATE ... WHERE id
    IN (...)`` alone locks them in the order its plan finds them: a bitmap or sequential
    scan, chosen at size, finds them in physical order, and two transactions locking
    overlapping rows in different orders deadlock (PostgreSQL ends one: 40P01). The
    update keeps its own fence too (the CTE's rows are re-read at their newest version
    when a lock was waited for, and a row that no longer matches is not locked)."""
    key = list(table.primary_key.columns)
    return sa.select(*key).where(*where).order_by(*key).with_for_update().cte(name)


def is_locked(table: sa.Table, locked: sa.CTE) -> sa.ColumnElement[bool]:
    """The join of ``table``'s rows to ``locked`` (a :func:`locked_by_id` of it) on its
    whole primary key."""
    return sa.and_(*(col == locked.c[col.name] for col in table.primary_key.columns))


async def bound_lock_waits(conn: Conn, seconds: float) -> None:
    """PostgreSQL: this transaction waits at most ``seconds`` for a lock (then a database
    fault, 55P03); by default it would wait for ever. SQLite's writer waited for its lock
    already (``BEGIN IMMEDIATE``, bounded by the busy timeout) and has no row locks."""
    if conn.dialect.name == "postgresql":
        ms = max(1, round(seconds * 1000))
        await conn.execute(sa.text(f"SET LOCAL lock_timeout = '{ms}ms'"))


def insert_ignore_stmt(dialect: str, table: sa.Table) -> Any:
    """``INSERT ... ON CONFLICT DO NOTHING`` for ``dialect``, built once: execute it with
    the row as parameters (hot paths: a new statement per call is compiled per call on
    the inline SQLite connection)."""
    if dialect == "postgresql":
        return postgresql.insert(table).on_conflict_do_nothing()
    return sqlite.insert(table).on_conflict_do_nothing()


def row_dict(row: AnyRow | None) -> dict[str, Any] | None:
    """A result row as a plain dict (``None`` passes)."""
    return None if row is None else dict(row._mapping)


class unindexed(FunctionElement[Any]):  # lower case: used like a SQL function
    """A column that SQLite must not look up by index in this term: ``+column`` on
    SQLite, the plain column elsewhere.

    Batch updates fenced by status (``WHERE id IN (...) AND status = 'pending'``): without
    statistics SQLite's planner prefers the equality on the indexed status column to the
    primary-key list, so every batch scanned *all* rows in that status (the whole backlog:
    quadratic in it). A unary ``+`` is SQLite's documented way to disqualify a term from
    index use (sqlite.org/optoverview.html, "Disqualifying WHERE clause terms using
    unary-+"); PostgreSQL plans from statistics and keeps the plain column.
    """

    inherit_cache = True

    def __init__(self, column: sa.ColumnElement[Any]) -> None:
        super().__init__(column)
        self.type = column.type


@compiles(unindexed)
def _unindexed(element: unindexed, compiler: Any, **kw: Any) -> str:
    return str(compiler.process(element.clauses, **kw))


@compiles(unindexed, "sqlite")
def _unindexed_sqlite(element: unindexed, compiler: Any, **kw: Any) -> str:
    return "+" + str(compiler.process(element.clauses, **kw))


class later_of(FunctionElement[Any]):  # lower case: used like a SQL function
    """The later of two times: ``GREATEST(a, b)`` on PostgreSQL, the two-argument
    (scalar) ``max(a, b)`` on SQLite.

    A work item's move takes this of its own clock reading and the item's
    ``updated_at``: the clock was read before the statement waited for a connection or
    a lock, or on another replica whose clock runs behind, and a move must not carry a
    time before the move it follows (the audit trail is read in time order).
    Hand-written PostgreSQL statements use :func:`later_of_sql`."""

    inherit_cache = True

    def __init__(self, a: Any, b: Any) -> None:
        super().__init__(a, b)
        self.type = sa.BigInteger()


@compiles(later_of)
def _later_of(element: later_of, compiler: Any, **kw: Any) -> str:
    return f"greatest({compiler.process(element.clauses, **kw)})"


@compiles(later_of, "sqlite")
def _later_of_sqlite(element: later_of, compiler: Any, **kw: Any) -> str:
    return f"max({compiler.process(element.clauses, **kw)})"


def later_of_sql(param: str, column: str) -> str:
    """:class:`later_of` written out for a hand-written PostgreSQL statement (``text()``,
    which cannot hold the construct): the later of bound parameter ``:param`` and
    ``column``."""
    return f"GREATEST(CAST(:{param} AS bigint), {column})"
