"""The inline SQLite connection and group commit (leadgate/database/inline_sqlite.py)
behind ``Database.tx``/``read``, ``Database.record_statements`` and the after-commit
listeners (leadgate/database/db.py); on PostgreSQL the same API runs on asyncpg
(leadgate/database/pg.py)."""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import json
import sqlite3
import threading
import time
from collections.abc import AsyncIterator
from contextlib import closing
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import sqlalchemy as sa

from leadgate.core.clock import FakeClock, RandomIds
from leadgate.core.errors import MAY_BE_STORED, Unavailable
from leadgate.database import inline_sqlite
from leadgate.database import schema as t
from leadgate.database.db import Database, signal_after_commit
from leadgate.database.inline_sqlite import InlineConnection, InlineSqlite
from leadgate.database.pg import PgConnection
from outbox.store import Outbox
from tests.statement_faults import PgFaults, SqliteFaults, injector

SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)

B = t.bindings.c
# Module-level statements, as the turn path builds them (the inline connection caches
# one plan per statement object and set of parameter names).
INSERT_BINDING = t.bindings.insert()
ALL_BINDINGS = sa.select(t.bindings).order_by(B.id)
BINDING_BY_ID = sa.select(t.bindings).where(B.id == sa.bindparam("p_id"))
BINDINGS_IN = sa.select(B.id).where(B.id.in_(sa.bindparam("p_ids", expanding=True))).order_by(B.id)


#: A bound on "it did not hang" (a transaction, a lock taken and given back): a lock
#: left held waits the 30 s busy bound, or for ever. Not the thing checked, so wide: 1 s
#: and 2 s were within reach of a loaded 2-CPU machine (a PostgreSQL connection opened).
HANG_S = 10.0
#: Under this, a wait with a 0.1 s bound gave up at its bound, not at the default 30 s.
GIVES_UP_S = 5.0
#: How long another process holds the file in the tests that the loop runs meanwhile: a
#: loop blocked for all of it shows as one gap that long, and a loaded machine's gaps
#: stay under half of it (0.3 s, gaps under 0.15 s, was within their reach).
HOLD_S = 1.0


class Boom(Exception):
    """Raised inside a transaction body on purpose."""


@pytest.fixture
async def db(migrated_url: str) -> AsyncIterator[Database]:
    database = Database(migrated_url)
    yield database
    await database.close()


def path_of(db: Database) -> str:
    path = sa.engine.make_url(db.url).database
    assert path
    return path


def binding(binding_id: str, **extra: Any) -> dict[str, Any]:
    """Parameters of a ``bindings`` row (``silent`` and ``active`` left to their defaults)."""
    return {
        "id": binding_id,
        "org_id": "org_1",
        "session_id": "sess_1",
        "kind": "api",
        "address": {"channel": binding_id, "nested": [1, {"x": None}]},
        "created_at": 1_000,
        **extra,
    }


def raw_ids(path: str, table: str = "bindings") -> set[str]:
    """The ids committed in ``table``, read by a separate plain sqlite3 connection."""
    with closing(sqlite3.connect(path)) as raw:
        return {row[0] for row in raw.execute(f"SELECT id FROM {table}")}


async def committed_ids(db: Database) -> set[str]:
    async with db.read() as conn:
        return set((await conn.execute(sa.select(B.id))).scalars().all())


# ------------------------------------------------------------------------ results


@SQLITE_ONLY
async def test_results_rows_and_rowcounts(db: Database) -> None:
    """first/one/one_or_none/all/scalar, iteration, rowcount, and real Rows with attribute
    and ``_mapping`` access, equal to what the async engine returns."""
    async with db.tx() as conn:
        assert isinstance(conn, InlineConnection)
        for binding_id in ("b1", "b2", "b3"):
            res = await conn.execute(INSERT_BINDING, binding(binding_id))
            assert res.rowcount == 1
        rows = (await conn.execute(ALL_BINDINGS)).all()
        assert [r.id for r in rows] == ["b1", "b2", "b3"]
        assert [r._mapping["id"] for r in rows] == ["b1", "b2", "b3"]
        assert isinstance(rows[0], sa.Row)
        assert rows[0]._fields == tuple(c.name for c in t.bindings.c)

        first = (await conn.execute(ALL_BINDINGS)).first()
        assert first is not None and first.id == "b1"
        one = (await conn.execute(BINDING_BY_ID, {"p_id": "b2"})).one()
        assert (one.id, one.session_id, one[0]) == ("b2", "sess_1", "b2")
        assert (await conn.execute(BINDING_BY_ID, {"p_id": "nope"})).one_or_none() is None
        assert (await conn.execute(BINDING_BY_ID, {"p_id": "nope"})).first() is None
        assert (await conn.execute(BINDING_BY_ID, {"p_id": "nope"})).scalar() is None
        with pytest.raises(sa.exc.NoResultFound):
            (await conn.execute(BINDING_BY_ID, {"p_id": "nope"})).one()
        with pytest.raises(sa.exc.MultipleResultsFound):
            (await conn.execute(ALL_BINDINGS)).one()
        with pytest.raises(sa.exc.MultipleResultsFound):
            (await conn.execute(ALL_BINDINGS)).one_or_none()
        assert [r.id for r in await conn.execute(ALL_BINDINGS)] == ["b1", "b2", "b3"]

        count = sa.select(sa.func.count()).select_from(t.bindings)
        assert await conn.scalar(count) == 3
        assert (await conn.execute(count)).scalar() == 3
        labelled = sa.select(B.id.label("bid"), B.kind).where(B.id == "b3")
        row = (await conn.execute(labelled)).one()
        assert dict(row._mapping) == {"bid": "b3", "kind": "api"}

        update = t.bindings.update().where(B.id.in_(["b1", "b2"])).values(kind="slack")
        assert (await conn.execute(update)).rowcount == 2
        nothing = t.bindings.update().where(B.id == "nope").values(kind="slack")
        assert (await conn.execute(nothing)).rowcount == 0
        delete = t.bindings.delete().where(B.id == sa.bindparam("p_id"))
        assert (await conn.execute(delete, {"p_id": "b3"})).rowcount == 1
        inline_rows = [dict(r._mapping) for r in (await conn.execute(ALL_BINDINGS)).all()]

    async with db.read() as conn:
        engine_rows = [dict(r._mapping) for r in (await conn.execute(ALL_BINDINGS)).all()]
    assert inline_rows == engine_rows
    assert [(r["id"], r["kind"]) for r in engine_rows] == [("b1", "slack"), ("b2", "slack")]


@SQLITE_ONLY
async def test_json_and_boolean_round_trip(db: Database) -> None:
    """Bind and result processors: JSON is stored as JSON text and comes back as the same
    object; booleans are stored as 0/1 and come back as bool, in both directions."""
    address = {"team": "T1", "list": [1, 2.5, "three", None, True], "nested": {"k": {"v": []}}}
    async with db.tx() as conn:
        await conn.execute(
            INSERT_BINDING, binding("j1", address=address, silent=True, active=False)
        )
        row = (await conn.execute(BINDING_BY_ID, {"p_id": "j1"})).one()
        assert row.address == address
        assert row.silent is True
        assert row.active is False
        # A Boolean bind parameter in a WHERE clause goes through the processor too.
        by_flag = sa.select(B.id).where(B.silent == sa.bindparam("p_silent"))
        assert (await conn.execute(by_flag, {"p_silent": True})).scalar() == "j1"
        assert (await conn.execute(by_flag, {"p_silent": False})).first() is None

    with closing(sqlite3.connect(path_of(db))) as raw:
        stored = raw.execute("SELECT address, silent, active FROM bindings").fetchone()
    assert stored[1:] == (1, 0)
    assert json.loads(stored[0]) == address
    async with db.read() as conn:
        engine_row = (await conn.execute(BINDING_BY_ID, {"p_id": "j1"})).one()
    assert (engine_row.address, engine_row.silent, engine_row.active) == (address, True, False)


@SQLITE_ONLY
async def test_scalar_defaults_fill_in_but_never_override(db: Database) -> None:
    """Python-side scalar column defaults are evaluated on insert; values given in
    ``.values()`` or in the parameters win; one statement object run with different
    parameter names gets a plan per name set."""
    with_values = t.bindings.insert().values(active=False)
    async with db.tx() as conn:
        await conn.execute(INSERT_BINDING, binding("d1"))  # both defaulted
        await conn.execute(INSERT_BINDING, binding("d2", silent=True))  # same statement
        await conn.execute(INSERT_BINDING, binding("d3", silent=True, active=False))
        await conn.execute(INSERT_BINDING, binding("d4"))  # back to the first plan
        await conn.execute(with_values, binding("d5"))
        await conn.execute(with_values, binding("d6", silent=True))
        agent = {
            "id": "a1",
            "org_id": "o1",
            "name": "n",
            "slug": "n",
            "model": "script",
            "created_at": 1,
            "updated_at": 1,
        }
        await conn.execute(t.organizations.insert(), {"id": "o1", "name": "acme", "created_at": 1})
        await conn.execute(t.agents.insert(), agent)  # instructions="" and active=True
        await conn.execute(
            t.agents.insert().values(instructions="be brief"), {**agent, "id": "a2", "slug": "m"}
        )
        # An UPDATE with different parameter names per call sets only those columns.
        update = t.bindings.update().where(B.id == sa.bindparam("p_id"))
        await conn.execute(update, {"p_id": "d1", "kind": "slack"})
        await conn.execute(update, {"p_id": "d2", "active": False})

    async with db.read() as conn:
        rows = {
            r.id: (r.kind, r.silent, r.active) for r in (await conn.execute(ALL_BINDINGS)).all()
        }
        agents = {
            r.id: (r.instructions, r.active)
            for r in (await conn.execute(sa.select(t.agents))).all()
        }
    assert rows == {
        "d1": ("slack", False, True),
        "d2": ("api", True, False),
        "d3": ("api", True, False),
        "d4": ("api", False, True),
        "d5": ("api", False, False),
        "d6": ("api", True, False),
    }
    assert agents == {"a1": ("", True), "a2": ("be brief", True)}


@SQLITE_ONLY
async def test_callable_default_and_missing_parameter_are_refused(db: Database) -> None:
    """What the inline connection cannot evaluate is refused, never stored as NULL."""
    metadata = sa.MetaData()
    extra = sa.Table(
        "inline_extra",
        metadata,
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("v", sa.Integer, nullable=True, default=lambda: 7),
    )
    async with db.engine.begin() as engine_conn:
        await engine_conn.run_sync(metadata.create_all)
    with pytest.raises(TypeError, match="cannot evaluate the default"):
        async with db.tx() as conn:
            await conn.execute(extra.insert(), {"id": "x1"})
    with pytest.raises(sa.exc.SQLAlchemyError, match="p_id"):
        async with db.tx() as conn:
            await conn.execute(BINDING_BY_ID, {})
    async with db.tx() as conn:
        await conn.execute(extra.insert(), {"id": "x2", "v": 3})  # given: fine
    assert raw_ids(path_of(db), "inline_extra") == {"x2"}


@SQLITE_ONLY
async def test_expanding_in_lists_of_different_lengths(db: Database) -> None:
    """A caller-supplied expanding IN parameter is expanded per call (lengths 1, 3, 0, 2,
    and back), alone or with other parameters; literal IN lists work too."""
    async with db.tx() as conn:
        assert isinstance(conn, InlineConnection)
        for binding_id in ("e1", "e2", "e3", "e4"):
            await conn.execute(INSERT_BINDING, binding(binding_id, silent=binding_id == "e2"))

        async def ids(values: list[str]) -> list[str]:
            return [r.id for r in (await conn.execute(BINDINGS_IN, {"p_ids": values})).all()]

        assert await ids(["e1"]) == ["e1"]
        assert await ids(["e4", "e2", "missing"]) == ["e2", "e4"]
        assert await ids([]) == []
        assert await ids(["e3", "e1"]) == ["e1", "e3"]
        assert await ids(["e1"]) == ["e1"]
        assert await ids(["e1", "e2", "e3", "e4"]) == ["e1", "e2", "e3", "e4"]

        mixed = (
            sa.select(B.id)
            .where(
                B.id.in_(sa.bindparam("p_ids", expanding=True)),
                B.silent == sa.bindparam("p_silent"),
                B.kind.in_(["api", "slack"]),
            )
            .order_by(B.id)
        )
        got = await conn.execute(mixed, {"p_ids": ["e1", "e2", "e3"], "p_silent": False})
        assert [r.id for r in got] == ["e1", "e3"]
        got = await conn.execute(mixed, {"p_ids": ["e2"], "p_silent": True})
        assert [r.id for r in got] == ["e2"]
        literal = sa.select(B.id).where(B.id.in_(["e4", "e3"])).order_by(B.id)
        assert [r.id for r in await conn.execute(literal)] == ["e3", "e4"]
        flags = sa.select(B.id).where(B.silent.in_(sa.bindparam("p_flags", expanding=True)))
        assert [r.id for r in await conn.execute(flags, {"p_flags": [True]})] == ["e2"]
        delete = t.bindings.delete().where(B.id.in_(sa.bindparam("p_ids", expanding=True)))
        assert (await conn.execute(delete, {"p_ids": ["e1", "e4"]})).rowcount == 2
    assert await committed_ids(db) == {"e2", "e3"}


# ------------------------------------------------------------------------- errors


@SQLITE_ONLY
async def test_errors_are_sqlalchemy_dbapi_errors(db: Database) -> None:
    """A duplicate primary key is an IntegrityError (the failed statement alone is undone
    when caught; the whole transaction when it escapes); other SQLite errors are
    OperationalError / DBAPIError, as on the async engine."""
    async with db.tx() as conn:
        await conn.execute(INSERT_BINDING, binding("p1"))
        with pytest.raises(sa.exc.IntegrityError) as caught:
            await conn.execute(INSERT_BINDING, binding("p1"))
        assert isinstance(caught.value.orig, sqlite3.IntegrityError)
        assert "UNIQUE" in str(caught.value.orig)
        assert "INSERT INTO bindings" in str(caught.value.statement)
        await conn.execute(INSERT_BINDING, binding("p2"))  # the transaction goes on
    assert await committed_ids(db) == {"p1", "p2"}

    with pytest.raises(sa.exc.IntegrityError):
        async with db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding("p3"))
            await conn.execute(INSERT_BINDING, binding("p1"))
    assert await committed_ids(db) == {"p1", "p2"}, "p3 was rolled back with its transaction"

    nowhere = sa.table("no_such_table", sa.column("x"))
    with pytest.raises(sa.exc.OperationalError, match="no such table"):
        async with db.tx() as conn:
            await conn.execute(sa.select(nowhere.c.x))
    with pytest.raises(sa.exc.DBAPIError) as generic:
        async with db.tx() as conn:
            await conn.execute(BINDING_BY_ID, {"p_id": object()})
    assert not isinstance(generic.value, sa.exc.IntegrityError | sa.exc.OperationalError)
    assert isinstance(generic.value.orig, sqlite3.Error)

    # The async engine raises the same class for the same mistake.
    with pytest.raises(sa.exc.IntegrityError):
        async with db.engine.begin() as engine_conn:
            await engine_conn.execute(INSERT_BINDING, binding("p1"))


@SQLITE_ONLY
async def test_returning_text_and_executemany(db: Database) -> None:
    """RETURNING (insert, update, delete) answers its rows and counts them; text() with
    and without rows; executemany of one statement; anything else is a TypeError that
    rolls back without leaving the writer lock held."""
    async with db.tx() as conn:
        inserted = await conn.execute(t.bindings.insert().returning(B.id, B.address), binding("r1"))
        assert [(r.id, r.address) for r in inserted.all()] == [("r1", binding("r1")["address"])]
        await conn.execute(INSERT_BINDING, [binding("r2"), binding("r3")])
        updated = await conn.execute(
            t.bindings.update().where(B.id != "r1").values(kind="x").returning(B.id)
        )
        assert (sorted(updated.scalars().all()), updated.rowcount) == (["r2", "r3"], 2)
        assert (await conn.execute(sa.text("SELECT count(*) AS n FROM bindings"))).one().n == 3
        gone = await conn.execute(t.bindings.delete().where(B.id == "r3").returning(B.id))
        assert (gone.scalar(), gone.rowcount) == ("r3", 1)
    assert await committed_ids(db) == {"r1", "r2"}
    for statement in (sa.union(sa.select(B.id), sa.select(B.org_id)),):
        with pytest.raises(TypeError, match=r"Core SELECT"):
            async with db.tx() as conn:
                await conn.execute(INSERT_BINDING, binding("r4"))
                await conn.execute(statement)
    with pytest.raises(TypeError, match=r"executemany"):
        async with db.tx() as conn:
            await conn.execute(t.bindings.insert().returning(B.id), [binding("r5")])
    async with asyncio.timeout(HANG_S):  # the lock is not left held
        async with db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding("r6"))
    assert await committed_ids(db) == {"r1", "r2", "r6"}


@SQLITE_ONLY
async def test_nested_write_transactions_fail_fast(db: Database) -> None:
    """A write transaction inside another on SQLite would wait for itself: refused."""
    async with asyncio.timeout(HANG_S):
        async with db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding("n1"))
            with pytest.raises(RuntimeError, match="nested"):
                async with db.tx():
                    pass
            with pytest.raises(RuntimeError, match="nested"):
                async with db.tx():
                    pass
    assert await committed_ids(db) == {"n1"}


# ------------------------------------------------------------------- group commit


@SQLITE_ONLY
async def test_concurrent_transactions_share_one_commit_and_fail_alone(db: Database) -> None:
    """Transactions started in the same loop iteration share one BEGIN IMMEDIATE and one
    COMMIT; the one that raises is rolled back alone (the transaction is rolled back and
    the writes of the members before it run again: no member takes a SAVEPOINT); each
    member returns (and its after-commit listeners run) only once the whole group is
    committed; the failed member's listeners never run."""
    path = path_of(db)
    async with asyncio.timeout(HANG_S), db.tx() as conn:  # open the inline connection
        await conn.execute(INSERT_BINDING, binding("warm"))
    members = 5
    failing = 2
    expected = {f"g{i}" for i in range(members) if i != failing}
    visible_on_return: dict[int, set[str]] = {}
    payload_calls: list[tuple[list[Any], set[str]]] = []
    plain_calls: list[set[str]] = []
    db.on_commit_payloads("grp", lambda p: payload_calls.append((p, raw_ids(path))))
    db.on_commit("grp", lambda: plain_calls.append(raw_ids(path)))

    async def member(i: int) -> None:
        async with db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding(f"g{i}"))
            signal_after_commit(conn, "grp", f"g{i}")
            if i == failing:
                raise Boom
        visible_on_return[i] = raw_ids(path)

    with db.record_statements() as statements:
        async with asyncio.timeout(HANG_S):
            results = await asyncio.gather(
                *(member(i) for i in range(members)), return_exceptions=True
            )

    assert [type(r) for r in results] == [
        Boom if i == failing else type(None) for i in range(members)
    ]
    assert statements.count("BEGIN IMMEDIATE") == 2, statements
    assert statements.count("ROLLBACK") == 1, statements
    assert statements.count("COMMIT") == 1, statements
    assert not [s for s in statements if s.startswith(("SAVEPOINT", "RELEASE"))]
    inserts = [json.loads(s.split("'")[9])["channel"] for s in statements if s.startswith("INSERT")]
    # g0 and g1 again after the failed g2's rollback, then the rest.
    assert inserts == ["g0", "g1", "g2", "g0", "g1", "g3", "g4"], inserts
    assert statements.index("ROLLBACK") == statements.index("BEGIN IMMEDIATE", 1) - 1
    # The single COMMIT comes after every member's statements.
    assert statements[-1] == "COMMIT", statements

    assert await committed_ids(db) == expected | {"warm"}
    assert raw_ids(path) == expected | {"warm"}
    # Even the first member returned only after the last member's row was committed.
    assert sorted(visible_on_return) == sorted(i for i in range(members) if i != failing)
    for i, seen in visible_on_return.items():
        assert expected <= seen, i
    assert sorted(p for payloads, _ in payload_calls for p in payloads) == sorted(expected)
    assert all(len(payloads) == 1 for payloads, _ in payload_calls)
    assert all(expected <= seen for _, seen in payload_calls), "listener ran before COMMIT"
    assert len(plain_calls) == members - 1
    assert all(expected <= seen for seen in plain_calls)


@SQLITE_ONLY
async def test_a_first_member_that_fails_rolls_back_alone_and_the_group_goes_on(
    db: Database,
) -> None:
    """When the member that runs first in a group's transaction fails, the whole
    transaction (its work alone) is rolled back and the members after it run in a new
    one, which commits; when every member fails, nothing is committed and the next
    transaction works. The first may also fail on a statement after which SQLite itself
    ended the transaction (a conflict clause): nobody else's work was in it, so the
    others still commit."""
    async with asyncio.timeout(HANG_S), db.tx() as conn:  # open the inline connection
        await conn.execute(INSERT_BINDING, binding("dup"))
    fired: list[list[Any]] = []
    db.on_commit_payloads("grp", fired.append)
    rollback_insert = t.bindings.insert().prefix_with("OR ROLLBACK")

    async def member(binding_id: str, fail: bool = False, statement: Any = INSERT_BINDING) -> None:
        async with db.tx() as conn:
            await conn.execute(statement, binding(binding_id))
            signal_after_commit(conn, "grp", binding_id)
            if fail:
                raise Boom

    with db.record_statements() as statements:
        async with asyncio.timeout(HANG_S):
            # (a list: the gathers below have other lengths)
            results: list[BaseException | None] = list(
                await asyncio.gather(
                    member("f1", fail=True), member("k1"), member("k2"), return_exceptions=True
                )
            )
    assert [type(r) for r in results] == [Boom, type(None), type(None)]
    assert statements.count("BEGIN IMMEDIATE") == 2, statements
    assert statements.count("ROLLBACK") == 1, statements
    assert statements.count("COMMIT") == 1, statements
    assert not [s for s in statements if s.startswith("SAVEPOINT")], statements
    assert sorted(fired) == [["k1"], ["k2"]]
    assert raw_ids(path_of(db)) == {"dup", "k1", "k2"}

    fired.clear()
    with db.record_statements() as statements:
        async with asyncio.timeout(HANG_S):
            results = list(
                await asyncio.gather(
                    member("f2", fail=True), member("f3", fail=True), return_exceptions=True
                )
            )
    assert [type(r) for r in results] == [Boom, Boom]
    assert "COMMIT" not in statements, statements
    assert fired == []

    async with asyncio.timeout(HANG_S):
        results = list(
            await asyncio.gather(
                member("dup", statement=rollback_insert), member("k3"), return_exceptions=True
            )
        )
    assert isinstance(results[0], sa.exc.IntegrityError), results
    assert results[1] is None, results
    assert fired == [["k3"]]
    assert raw_ids(path_of(db)) == {"dup", "k1", "k2", "k3"}
    async with asyncio.timeout(HANG_S), db.tx() as conn:
        await conn.execute(INSERT_BINDING, binding("after"))
    assert raw_ids(path_of(db)) == {"dup", "k1", "k2", "k3", "after"}


@SQLITE_ONLY
async def test_a_member_that_fails_before_writing_leaves_the_group_as_it_was(
    db: Database,
) -> None:
    """A member that fails having changed nothing (a read that found no agent, a request
    refused before its first write, a write SQLite refused and backed out by itself, its
    default ABORT, a fenced update that matched no row) costs the group nothing: no
    ROLLBACK, the kept members' writes are not run again, whether it ran first, between
    or last; the others commit once."""
    async with asyncio.timeout(HANG_S), db.tx() as conn:  # open the inline connection
        await conn.execute(INSERT_BINDING, binding("dup"))
    fired: list[list[Any]] = []
    db.on_commit_payloads("grp", fired.append)

    async def writer(binding_id: str) -> None:
        async with db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding(binding_id))
            signal_after_commit(conn, "grp", binding_id)

    async def reader_that_fails() -> None:
        async with db.tx() as conn:
            await conn.execute(sa.select(t.bindings.c.id).where(t.bindings.c.id == "absent"))
            signal_after_commit(conn, "grp", "never")
            raise Boom

    async def refused_write() -> None:
        async with db.tx() as conn:
            signal_after_commit(conn, "grp", "never")
            await conn.execute(INSERT_BINDING, binding("dup"))  # primary key taken

    async def lost_fence() -> None:
        async with db.tx() as conn:
            moved = await conn.execute(
                t.bindings.update()
                .where(t.bindings.c.id == "dup", t.bindings.c.active.is_(False))
                .values(active=True)
            )
            assert moved.rowcount == 0
            raise Boom  # as a fenced transition that matched nothing does

    with db.record_statements() as statements:
        async with asyncio.timeout(HANG_S):
            results = await asyncio.gather(
                reader_that_fails(),
                writer("k1"),
                refused_write(),
                writer("k2"),
                lost_fence(),
                reader_that_fails(),
                return_exceptions=True,
            )
    assert [type(r) for r in results] == [
        Boom,
        type(None),
        sa.exc.IntegrityError,
        type(None),
        Boom,
        Boom,
    ], results
    assert statements.count("BEGIN IMMEDIATE") == 1, statements
    assert "ROLLBACK" not in statements, statements
    assert statements.count("COMMIT") == 1, statements
    inserts = [json.loads(s.split("'")[9])["channel"] for s in statements if s.startswith("INSERT")]
    assert inserts == ["k1", "dup", "k2"], inserts  # each once: nothing ran again
    assert sorted(fired) == [["k1"], ["k2"]]
    assert raw_ids(path_of(db)) == {"dup", "k1", "k2"}


@SQLITE_ONLY
async def test_a_redone_transaction_keeps_the_committed_token_of_its_first_begin(
    db: Database,
) -> None:
    """``committed_token`` taken inside a write transaction counts only what was
    committed before it began: a reader's snapshot then has not seen the transaction's
    writes. After a member failed and the kept writes were run again, the token still
    leaves those writes out, so one taken after the COMMIT differs and what a reader
    read in between is not used again (the route cache, the kept reads)."""
    async with asyncio.timeout(HANG_S), db.tx() as conn:  # open the inline connection
        await conn.execute(INSERT_BINDING, binding("warm"))
    during: list[object | None] = []

    async def member(binding_id: str | None, fail: bool = False) -> None:
        async with db.tx() as conn:
            if binding_id is None:
                during.append(db.committed_token(["bindings"]))
                return
            await conn.execute(INSERT_BINDING, binding(binding_id))
            if fail:
                raise Boom

    async with asyncio.timeout(HANG_S):
        results = await asyncio.gather(
            member("a"), member("b", fail=True), member(None), return_exceptions=True
        )
    assert [type(r) for r in results] == [type(None), Boom, type(None)]
    assert raw_ids(path_of(db)) == {"warm", "a"}
    assert during[0] is not None
    assert db.committed_token(["bindings"]) != during[0]


@SQLITE_ONLY
async def test_a_group_whose_transaction_sqlite_ended_fails_every_member(db: Database) -> None:
    """A statement that makes SQLite roll back the whole transaction (here a conflict
    clause, OR ROLLBACK; also disk full or I/O errors) takes the work of every member of
    its group with it: each member is told so and none is told it succeeded; a
    transaction arriving after that runs in a new group, not in a stray transaction."""
    async with asyncio.timeout(HANG_S), db.tx() as conn:
        await conn.execute(INSERT_BINDING, binding("dup"))
    fired: list[list[Any]] = []
    db.on_commit_payloads("grp", fired.append)
    rollback_insert = t.bindings.insert().prefix_with("OR ROLLBACK")

    async def member(binding_id: str, statement: sa.Insert = INSERT_BINDING) -> None:
        async with db.tx() as conn:
            await conn.execute(statement, binding(binding_id))
            signal_after_commit(conn, "grp", binding_id)

    async with asyncio.timeout(HANG_S):
        results = await asyncio.gather(
            member("a"), member("dup", rollback_insert), member("c"), return_exceptions=True
        )
    # "a" had finished its body in the group: its row is gone, and it is told so (SQLite
    # let go of its write lock: what "a" wrote cannot be redone). A 503.
    assert isinstance(results[0], Unavailable), results
    assert "rolled back the whole transaction" in str(results[0].__cause__)
    assert isinstance(results[1], sa.exc.IntegrityError), results
    # "c" came after the group broke: it waited for the writer lock and committed alone.
    assert results[2] is None, results
    assert fired == [["c"]]
    assert raw_ids(path_of(db)) == {"dup", "c"}


@SQLITE_ONLY
async def test_kept_writes_are_not_redone_over_another_connections_commit(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kept members' writes are run again only on the database they ran on: if
    another connection commits between the rollback and the new BEGIN (it could take
    SQLite's write lock in that instant), every member of the group is told its work is
    gone (a 503) and none is told it succeeded; nothing of the group is committed, and
    a transaction arriving after that runs in a new group."""
    async with asyncio.timeout(HANG_S), db.tx() as conn:  # open the inline connection
        await conn.execute(INSERT_BINDING, binding("warm"))
    path = path_of(db)
    fired: list[list[Any]] = []
    db.on_commit_payloads("grp", fired.append)
    rollback_for_again = InlineConnection.rollback_for_again

    def and_another_commit(self: InlineConnection) -> int:
        version = rollback_for_again(self)
        with closing(sqlite3.connect(path)) as other, other:
            other.execute(
                "INSERT INTO bindings (id, org_id, session_id, kind, address, silent,"
                " active, created_at) VALUES ('other', 'o', 's', 'api', '{}', 0, 1, 1)"
            )
        return version

    monkeypatch.setattr(InlineConnection, "rollback_for_again", and_another_commit)

    async def member(binding_id: str, fail: bool = False) -> None:
        async with db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding(binding_id))
            signal_after_commit(conn, "grp", binding_id)
            if fail:
                raise Boom

    async def later() -> None:
        await asyncio.sleep(0)
        await member("c")

    async with asyncio.timeout(HANG_S):
        results = await asyncio.gather(
            member("a"), member("b", fail=True), later(), return_exceptions=True
        )
    assert isinstance(results[0], Unavailable), results
    assert "rolled back the whole transaction" in str(results[0].__cause__)
    assert isinstance(results[1], Boom), results
    assert results[2] is None, results
    assert fired == [["c"]]
    assert raw_ids(path) == {"warm", "other", "c"}


@SQLITE_ONLY
async def test_kept_writes_that_cannot_run_again_fail_every_member(db: Database) -> None:
    """If a kept member's write fails when run again (here another connection committed
    the row "a" inserted while the failing member held no write lock), every member of
    the group is told its work is gone (a 503). (The failing member writes too: one that
    wrote nothing leaves the transaction alone, see
    ``test_a_member_that_fails_before_writing_leaves_the_group_as_it_was``.)"""
    async with asyncio.timeout(HANG_S), db.tx() as conn:  # open the inline connection
        await conn.execute(INSERT_BINDING, binding("warm"))
    path = path_of(db)

    async def kept() -> None:
        async with db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding("a"))

    async def spoiler() -> None:
        async with db.tx() as conn:
            assert isinstance(conn, InlineConnection)
            await conn.execute(INSERT_BINDING, binding("s"))
            # End the group's transaction behind its back, have another connection
            # commit the row "a" inserted, and begin again: the redo of "a" fails.
            conn._raw.execute("ROLLBACK")
            with closing(sqlite3.connect(path)) as other, other:
                other.execute(
                    "INSERT INTO bindings (id, org_id, session_id, kind, address, silent,"
                    " active, created_at) VALUES ('a', 'o', 's', 'api', '{}', 0, 1, 1)"
                )
            conn._raw.execute("BEGIN IMMEDIATE")
            raise Boom

    async with asyncio.timeout(HANG_S):
        results = await asyncio.gather(kept(), spoiler(), return_exceptions=True)
    assert isinstance(results[0], Unavailable), results
    assert isinstance(results[1], Boom), results
    assert raw_ids(path) == {"warm", "a"}
    async with asyncio.timeout(HANG_S), db.tx() as conn:
        await conn.execute(INSERT_BINDING, binding("after"))
    assert raw_ids(path) == {"warm", "a", "after"}


@SQLITE_ONLY
async def test_sequential_transactions_each_commit(db: Database) -> None:
    """Transactions that do not overlap in a loop iteration get their own commits."""
    with db.record_statements() as statements:
        for i in range(3):
            async with db.tx() as conn:
                await conn.execute(INSERT_BINDING, binding(f"s{i}"))
    assert statements.count("COMMIT") == 3
    assert statements.count("BEGIN IMMEDIATE") == 3
    assert await committed_ids(db) == {"s0", "s1", "s2"}


@SQLITE_ONLY
async def test_a_failed_group_commit_fails_every_member(db: Database) -> None:
    """When the shared COMMIT itself fails (here a deferred foreign key violation of one
    member), every member gets the error, nothing is stored, no listener runs, and the
    next transaction works."""
    fired: list[list[Any]] = []
    db.on_commit_payloads("grp", fired.append)
    agent = {
        "id": "a1",
        "org_id": "no-such-org",
        "name": "n",
        "slug": "n",
        "model": "script",
        "created_at": 1,
        "updated_at": 1,
    }

    async def orphan() -> None:
        async with db.tx() as conn:
            assert isinstance(conn, InlineConnection)
            # Checked at COMMIT instead of at the INSERT (reset by COMMIT/ROLLBACK).
            conn._raw.execute("PRAGMA defer_foreign_keys=ON")
            await conn.execute(t.agents.insert(), agent)
            signal_after_commit(conn, "grp", "orphan")

    async def innocent() -> None:
        async with db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding("i1"))
            signal_after_commit(conn, "grp", "innocent")

    results = await asyncio.gather(orphan(), innocent(), return_exceptions=True)
    assert all(isinstance(r, sa.exc.IntegrityError) for r in results), results
    assert "FOREIGN KEY" in str(results[0])
    assert fired == []
    assert await committed_ids(db) == set()
    assert raw_ids(path_of(db), "agents") == set()
    async with asyncio.timeout(HANG_S):
        async with db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding("i2"))
            signal_after_commit(conn, "grp", "after")
    assert fired == [["after"]]
    assert await committed_ids(db) == {"i2"}


@SQLITE_ONLY
async def test_checkpoints_run_in_a_worker_thread(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every CHECKPOINT_EVERY commits, a passive WAL checkpoint runs off the loop thread."""
    monkeypatch.setattr(inline_sqlite, "CHECKPOINT_EVERY", 3)
    threads: list[int] = []
    finished: asyncio.Queue[int] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    original = InlineSqlite._run_checkpoint

    def spy(self: InlineSqlite) -> None:
        original(self)
        loop.call_soon_threadsafe(finished.put_nowait, threading.get_ident())

    monkeypatch.setattr(InlineSqlite, "_run_checkpoint", spy)

    async def wait_for_checkpoints(n: int) -> None:
        async with asyncio.timeout(HANG_S):
            while len(threads) < n:
                threads.append(await finished.get())
        # A checkpoint is not started while the previous one runs: let its task finish.
        await asyncio.sleep(0.02)

    for i in range(5):
        async with db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding(f"c{i}"))
        if i == 2:
            await wait_for_checkpoints(1)
    assert len(threads) == 1
    assert finished.empty()
    async with db.tx() as conn:
        await conn.execute(INSERT_BINDING, binding("c5"))  # the 6th commit
    await wait_for_checkpoints(2)
    assert len(threads) == 2
    assert threading.get_ident() not in threads
    assert len(await committed_ids(db)) == 6


@SQLITE_ONLY
async def test_checkpoints_keep_the_wal_from_growing(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that keeps committing while the checkpoints run beside it: each
    checkpoint restarts the WAL, so it holds only the frames of the commits since. A
    passive checkpoint alone (frames appended while it copied are left over) never let
    SQLite restart it: the WAL grew by every commit's frames, for good."""
    monkeypatch.setattr(inline_sqlite, "CHECKPOINT_EVERY", 20)
    inline = db._inline
    assert inline is not None
    commits = 2_000
    for i in range(commits):
        async with db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding(f"w{i}"))
    if inline._checkpoint is not None:
        await inline._checkpoint
    with closing(sqlite3.connect(path_of(db), isolation_level=None)) as other:
        _busy, frames, _done = other.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    assert 0 <= frames < commits // 2, frames  # each commit wrote at least one frame
    assert len(await committed_ids(db)) == commits


# ------------------------------------------------------------- other processes


@SQLITE_ONLY
async def test_tx_waits_for_another_writer_without_blocking_the_loop(
    db: Database,
) -> None:
    """Another connection (another process) holding SQLite's write lock: tx waits,
    the event loop keeps running meanwhile, and tx proceeds once the lock is
    released; it then sees the other writer's row."""
    path = path_of(db)
    async with db.tx() as conn:  # the database is in WAL mode and the inline
        await conn.execute(INSERT_BINDING, binding("w0"))  # connection is open
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute(
            "INSERT INTO bindings (id, org_id, session_id, kind, address, silent, active,"
            " created_at) VALUES ('other', 'o', 's', 'api', '{}', 0, 1, 1)"
        )
        hold_s = HOLD_S
        # Released from a thread, so that a loop blocked inside SQLite would still get
        # out (and fail the tick assertions) instead of hanging the test.
        timer = threading.Timer(hold_s, lambda: other.execute("COMMIT"))
        stamps: list[float] = []

        async def ticker() -> None:
            while True:
                stamps.append(time.monotonic())
                await asyncio.sleep(0.005)

        seen: list[int] = []

        async def writer() -> None:
            async with db.tx() as conn:
                count = sa.select(sa.func.count()).select_from(t.bindings)
                seen.append((await conn.execute(count)).scalar())
                await conn.execute(INSERT_BINDING, binding("w1"))

        ticking = asyncio.create_task(ticker())
        started = time.monotonic()
        timer.start()
        writing = asyncio.create_task(writer())
        await asyncio.sleep(hold_s / 2)
        assert not writing.done(), "tx went ahead while another process held the lock"
        await asyncio.wait_for(writing, timeout=HANG_S)
        finished = time.monotonic()
        ticking.cancel()
        timer.join()
    finally:
        other.close()

    assert finished - started >= hold_s * 0.9
    during = [s for s in stamps if started <= s <= started + hold_s]
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    assert len(during) >= 10, "the loop did not run while tx waited"
    assert max(gaps) < HOLD_S / 2, f"the loop was blocked for {max(gaps):.3f}s"
    assert seen == [2], "tx ran after the other transaction committed"
    assert await committed_ids(db) == {"w0", "other", "w1"}


@SQLITE_ONLY
async def test_begin_immediate_gives_up_after_the_busy_wait(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the busy bound the wait ends with Unavailable (a 503; caused by SQLite's
    "locked"), and the process's writer lock is released (the next transactions run
    once the other process is done)."""
    monkeypatch.setattr(db, "busy_timeout_s", 0.1)
    path = path_of(db)
    async with db.tx() as conn:
        await conn.execute(INSERT_BINDING, binding("x0"))
    assert db._inline is not None
    monkeypatch.setattr(db._inline.connection, "busy_wait_s", 0.1)
    with closing(sqlite3.connect(path, isolation_level=None)) as other:
        other.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        with pytest.raises(Unavailable) as info:
            async with asyncio.timeout(HANG_S), db.tx() as conn:
                await conn.execute(INSERT_BINDING, binding("x1"))
        assert isinstance(info.value.__cause__, sa.exc.OperationalError)
        assert "locked" in str(info.value.__cause__)
        assert 0.1 <= time.monotonic() - started < GIVES_UP_S
        other.execute("COMMIT")
    async with asyncio.timeout(HANG_S):
        async with db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding("x2"))
        async with db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding("x3"))
    assert await committed_ids(db) == {"x0", "x2", "x3"}


def _holding_the_file(path: str) -> sqlite3.Connection:
    """A connection holding the SQLite file exclusively, as one that closes the file's
    last connection (deleting the WAL) or opens the first (rebuilding its index) does
    for a moment: every ``leadgate`` command, beside another one, is such a process."""
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    assert other.execute("PRAGMA journal_mode=WAL").fetchone() == ("wal",)  # the service's
    other.execute("PRAGMA locking_mode=EXCLUSIVE")
    other.execute("SELECT count(*) FROM bindings").fetchall()
    return other


@SQLITE_ONLY
async def test_a_new_reader_waits_out_a_held_file_without_blocking_the_loop(
    db: Database,
) -> None:
    """A process with no connection to the file open (a ``leadgate`` command) reads
    while another holds it: the read waits, the loop running, and then reads. It was
    the driver's "database is locked" at once (a 503; one read in twenty with several
    commands run at once)."""
    other = _holding_the_file(path_of(db))
    hold_s = HOLD_S
    # Closed from a thread: a loop blocked inside SQLite would still get out.
    timer = threading.Timer(hold_s, other.close)
    stamps: list[float] = []

    async def ticker() -> None:
        while True:
            stamps.append(time.monotonic())
            await asyncio.sleep(0.005)

    ticking = asyncio.create_task(ticker())
    started = time.monotonic()
    timer.start()
    try:
        async with asyncio.timeout(HANG_S), db.read() as conn:
            count = await conn.execute(sa.select(sa.func.count()).select_from(t.bindings))
            assert count.scalar() == 0
    finally:
        ticking.cancel()
        timer.join()
    assert time.monotonic() - started >= hold_s * 0.9
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    assert max(gaps) < HOLD_S / 2, f"the loop was blocked for {max(gaps):.3f}s"


@SQLITE_ONLY
async def test_a_new_reader_gives_up_after_the_busy_wait(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the busy bound the read is Unavailable (a 503 with Retry-After; caused by
    SQLite's "locked"), its connection closed, and the next read after the other
    process is done goes through."""
    assert db._readers is not None
    monkeypatch.setattr(db._readers, "busy_wait_s", 0.1)
    with closing(_holding_the_file(path_of(db))):
        started = time.monotonic()
        with pytest.raises(Unavailable) as info:
            async with asyncio.timeout(HANG_S), db.read() as conn:
                await conn.execute(sa.select(sa.func.count()).select_from(t.bindings))
        assert "locked" in str(info.value.__cause__)
        assert 0.1 <= time.monotonic() - started < GIVES_UP_S
    async with asyncio.timeout(HANG_S), db.read() as conn:
        count = await conn.execute(sa.select(sa.func.count()).select_from(t.bindings))
        assert count.scalar() == 0


@SQLITE_ONLY
async def test_a_transaction_behind_a_member_that_does_not_finish_gives_up(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer queue in the process is bounded: a transaction queued behind a member
    whose body does not finish (it awaits something that does not come) gives up with
    Unavailable after the lock wait, having written nothing, and the member's work
    commits once it finishes. (A transaction that joins an open group with no member
    inside cannot wait, and ``InlineSqlite.enter`` arms no timer for it.)"""
    monkeypatch.setattr(Database, "_lock_wait_s", property(lambda self: 0.1))
    async with asyncio.timeout(HANG_S), db.tx() as conn:
        await conn.execute(INSERT_BINDING, binding("warm"))
    inside, release = asyncio.Event(), asyncio.Event()

    async def holder() -> None:
        async with db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding("held"))
            inside.set()
            await release.wait()

    async def write(binding_id: str) -> None:
        async with db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding(binding_id))

    held = asyncio.create_task(holder())
    # Started in the same loop iteration: it joins the holder's group and waits for the
    # member slot; the next one waits for the writer lock behind the closing group.
    joined = asyncio.create_task(write("joined"))
    await asyncio.wait_for(inside.wait(), HANG_S)
    for waiting in (joined, asyncio.create_task(write("queued"))):
        started = time.monotonic()
        with pytest.raises(Unavailable):
            await asyncio.wait_for(waiting, HANG_S)
        assert time.monotonic() - started < GIVES_UP_S
    release.set()
    await asyncio.wait_for(held, HANG_S)
    assert await committed_ids(db) == {"warm", "held"}


@pytest.mark.parametrize("readonly", [False, True], ids=["writer", "reader"])
def test_a_connection_whose_opening_pragma_fails_is_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, readonly: bool
) -> None:
    """Whichever opening PRAGMA fails, the error reaches the caller and the ``sqlite3``
    connection opened for it is closed (nothing else holds it to close it)."""
    path = str(tmp_path / "t.db")
    faults = SqliteFaults(path, monkeypatch)
    faulty_connect = sqlite3.connect
    opened: list[sqlite3.Connection] = []

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        opened.append(faulty_connect(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(sqlite3, "connect", connect)
    dialect = sa.create_engine("sqlite://").dialect
    pragmas = 5 if readonly else 7
    for at in range(1, pragmas + 1):
        faults.arm(at)
        with pytest.raises(sqlite3.OperationalError, match="disk I/O error"):
            InlineConnection(path, dialect, readonly=readonly)
        assert faults.fired is not None and faults.fired.startswith("PRAGMA")
        with pytest.raises(sqlite3.ProgrammingError, match="closed"):
            opened[-1].execute("SELECT 1")
    faults.disarm()
    InlineConnection(path, dialect, readonly=readonly).close()
    assert len(opened) == pragmas + 1


# --------------------------------------------------------------- record_statements


@SQLITE_ONLY
async def test_plans_of_collected_statements_are_dropped(db: Database) -> None:
    """A statement built per call (not a module constant) is compiled for that call only:
    its cached plan goes with it, and a new statement at a reused address never runs
    another statement's SQL."""
    async with db.tx() as conn:
        assert isinstance(conn, InlineConnection)
        await conn.execute(INSERT_BINDING, binding("p0"))
        before = len(conn._plans)
        for i in range(200):
            statement = sa.select(B.id).where(B.id == f"p{i % 2}")
            assert (await conn.execute(statement)).scalar() == ("p0" if i % 2 == 0 else None)
            del statement
        gc.collect()
        assert len(conn._plans) <= before + 1
        assert (await conn.execute(BINDING_BY_ID, {"p_id": "p0"})).one().id == "p0"


@SQLITE_ONLY
async def test_record_statements_sees_writes_and_reads(db: Database) -> None:
    with db.record_statements() as statements:
        async with db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding("rs1"))
            await conn.execute(BINDING_BY_ID, {"p_id": "rs1"})
        async with db.read() as read_conn:
            await read_conn.execute(sa.select(B.id).where(B.kind == "marker"))
    assert "BEGIN IMMEDIATE" in statements
    assert "COMMIT" in statements
    assert any(s.startswith("INSERT INTO bindings") and "rs1" in s for s in statements)
    assert any(s.startswith("SELECT") and "rs1" in s for s in statements)
    # (sqlite3's trace shows statements with their parameters substituted.)
    assert any("bindings.kind = 'marker'" in s for s in statements), "read statement missing"
    # Recording stops with the block.
    async with db.tx() as conn:
        await conn.execute(BINDING_BY_ID, {"p_id": "after"})
    assert not any("after" in s for s in statements)


# ------------------------------------------------------------------ both backends


async def test_tx_commits_rolls_back_and_signals_on_both_backends(
    migrated_url: str,
) -> None:
    """tx is the inline connection on a SQLite file and asyncpg on PostgreSQL; either way
    it commits, rolls back on an exception and runs after-commit listeners only after a
    commit."""
    db = Database(migrated_url)
    try:
        plain: list[str] = []
        payloads: list[list[Any]] = []
        db.on_commit("topic", lambda: plain.append("fired"))
        db.on_commit_payloads("topic", payloads.append)

        async with db.tx() as conn:
            if db.is_sqlite:
                assert isinstance(conn, InlineConnection)
            else:
                assert isinstance(conn, PgConnection)
            await conn.execute(INSERT_BINDING, binding("f1", silent=True))
            signal_after_commit(conn, "topic", {"id": "f1"})
            signal_after_commit(conn, "topic", {"id": "f1-again"})
            assert plain == [] and payloads == [], "a listener ran before the commit"
        assert plain == ["fired"]
        assert payloads == [[{"id": "f1"}, {"id": "f1-again"}]]

        with pytest.raises(Boom):
            async with db.tx() as conn:
                await conn.execute(INSERT_BINDING, binding("f2"))
                signal_after_commit(conn, "topic", {"id": "f2"})
                raise Boom
        with pytest.raises(sa.exc.IntegrityError):
            async with db.tx() as conn:
                await conn.execute(INSERT_BINDING, binding("f3"))
                signal_after_commit(conn, "topic", {"id": "f3"})
                await conn.execute(INSERT_BINDING, binding("f1"))
        assert plain == ["fired"]
        assert len(payloads) == 1

        async with db.tx() as conn:  # no payload: plain listeners only
            signal_after_commit(conn, "topic")
        assert plain == ["fired", "fired"]
        assert len(payloads) == 1

        async with db.read() as read_conn:
            rows = (await read_conn.execute(ALL_BINDINGS)).all()
        assert [(r.id, r.silent, r.active, r.address) for r in rows] == [
            ("f1", True, True, binding("f1")["address"])
        ]
    finally:
        await db.close()


# ------------------------------------------------------------------- savepoints


async def _nested_blocks(conn: Any) -> None:
    """Write n0, then n1 in a nested block that fails, then n2 in one that succeeds."""
    await conn.execute(INSERT_BINDING, binding("n0"))
    with pytest.raises(RuntimeError):
        async with conn.begin_nested():
            await conn.execute(INSERT_BINDING, binding("n1"))
            raise RuntimeError("the block fails")
    async with conn.begin_nested():
        await conn.execute(INSERT_BINDING, binding("n2"))


async def test_a_failing_nested_block_rolls_back_alone(db: Database) -> None:
    """``begin_nested`` (a SAVEPOINT) on every driver: the block's writes go when it
    fails, the transaction's other writes stay; a block that succeeds is kept."""
    async with db.tx() as conn:
        await _nested_blocks(conn)
        await conn.execute(INSERT_BINDING, binding("n3"))
    assert await committed_ids(db) == {"n0", "n2", "n3"}


def _not_a_fault(db: Database) -> Exception:
    """What a failing ROLLBACK TO may raise that is no database fault: SQLite's
    ``SQLITE_NOMEM`` (the stdlib driver raises MemoryError), a PostgreSQL server error."""
    if db.is_postgres:
        error: Exception = asyncpg.exceptions.InternalServerError("cannot roll back")
        return error
    return MemoryError()


@pytest.mark.parametrize("undo", ["fault", "not-a-fault"])
async def test_a_nested_block_whose_undo_fails_fails_the_whole_transaction(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, undo: str
) -> None:
    """Review cards (Outbox.review_needed's nested block) fail, a bug of theirs, and the
    block's undo, its ROLLBACK TO, fails too: the cards' writes are still in the
    transaction. The transaction fails whole, nothing of it stored, whoever caught the
    undo's error: review_needed logs and swallows an error that is not a database fault
    (failed cards must not block the transition). A database fault (an I/O error, a
    dropped connection) it raised already; any other error of the undo was swallowed
    and the half-written cards committed with the transition."""
    faults = injector(migrated_url, monkeypatch)
    db = Database(migrated_url)
    outbox = Outbox(FakeClock(), RandomIds())

    async def cards(conn: Any, item_id: str, reason: str, delivery_id: str | None) -> None:
        await conn.execute(INSERT_BINDING, binding("card"))
        raise Boom

    outbox.on_review_needed(cards)
    try:
        async with asyncio.timeout(HANG_S), db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding("warm"))
        error = None if undo == "fault" else functools.partial(_not_a_fault, db)
        faults.arm_on("ROLLBACK TO", error=error)
        with pytest.raises(Exception) as raised:
            async with asyncio.timeout(HANG_S), db.tx() as conn:
                await conn.execute(INSERT_BINDING, binding("transition"))
                await outbox.review_needed(conn, "wi_1", "escalated")
        faults.disarm()
        assert faults.fired is not None and faults.fired.startswith("ROLLBACK TO")
        assert isinstance(raised.value, Unavailable) is (undo == "fault"), raised.value
        assert await committed_ids(db) == {"warm"}
        async with asyncio.timeout(HANG_S), db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding("after"))
        assert await committed_ids(db) == {"warm", "after"}
    finally:
        await db.close()


@SQLITE_ONLY
async def test_writes_run_again_after_a_failed_member_leave_out_a_failed_nested_block(
    db: Database,
) -> None:
    """The writes run again for a kept member, after a later member of its group failed,
    are the ones it kept: not those of a nested block of it that failed."""
    async with asyncio.timeout(HANG_S), db.tx() as conn:  # open the inline connection
        await conn.execute(INSERT_BINDING, binding("warm"))

    async def kept() -> None:
        async with db.tx() as conn:
            await _nested_blocks(conn)

    async def failing() -> None:
        async with db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding("f"))
            raise Boom

    with db.record_statements() as statements:
        async with asyncio.timeout(HANG_S):
            results = await asyncio.gather(kept(), failing(), return_exceptions=True)
    assert results[0] is None and isinstance(results[1], Boom), results
    assert statements.count("ROLLBACK") == 1, statements  # the redo happened
    assert await committed_ids(db) == {"warm", "n0", "n2"}


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_pooled_postgres_connection_is_released_without_a_reset_round_trip(
    migrated_url: str,
) -> None:
    """asyncpg's pool by default sends ``SELECT pg_advisory_unlock_all(); CLOSE ALL;
    UNLISTEN *; RESET ALL;`` when a connection is released: one more round trip per
    transaction. Ours sends nothing after ``COMMIT`` (the server's last statement of that
    backend stays the COMMIT), and a transaction that failed is still rolled back."""
    import asyncpg

    from leadgate.database.pg import asyncpg_dsn

    db = Database(migrated_url)
    other = await asyncpg.connect(asyncpg_dsn(migrated_url))
    try:
        async with db.tx() as conn:
            pid = await conn.scalar(sa.text("SELECT pg_backend_pid()"))
            await conn.execute(INSERT_BINDING, binding("r1"))
        last = await other.fetchval("SELECT query FROM pg_stat_activity WHERE pid = $1", pid)
        assert last.strip().upper().rstrip(";") == "COMMIT", last
        with pytest.raises(Boom):
            async with db.tx() as conn:
                assert await conn.scalar(sa.text("SELECT pg_backend_pid()")) == pid
                await conn.execute(INSERT_BINDING, binding("r2"))
                raise Boom
        async with db.read() as conn:
            assert await conn.scalar(sa.text("SELECT pg_backend_pid()")) == pid  # reused
            ids = (await conn.execute(ALL_BINDINGS)).all()
        assert [r.id for r in ids] == ["r1"]
    finally:
        await other.close()
        await db.close()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_pooled_postgres_connection_comes_back_from_the_idle_list_until_it_is_dropped(
    migrated_url: str,
) -> None:
    """A connection whose use ended cleanly is handed out again without asyncpg's
    acquire; one the server dropped meanwhile (asyncpg takes it back by itself) is not:
    the next use gets a new backend and works. Nothing is left checked out at close."""
    import asyncpg

    from leadgate.database.pg import asyncpg_dsn

    db = Database(migrated_url)
    other = await asyncpg.connect(asyncpg_dsn(migrated_url))
    try:
        async with db.read() as conn:
            pid = await conn.scalar(sa.text("SELECT pg_backend_pid()"))
        async with db.tx() as conn:
            assert await conn.scalar(sa.text("SELECT pg_backend_pid()")) == pid
            await conn.execute(INSERT_BINDING, binding("i1"))
        assert await other.fetchval("SELECT pg_terminate_backend($1)", pid)
        deadline = time.monotonic() + 10
        while True:  # the client sees the server close the socket
            async with db.read() as conn:
                try:
                    now = await conn.scalar(sa.text("SELECT pg_backend_pid()"))
                except sa.exc.DBAPIError:
                    now = None  # the dropped one, used before the client noticed
            if now not in (None, pid) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        assert now not in (None, pid)
        assert await committed_ids(db) == {"i1"}
    finally:
        await other.close()
        await asyncio.wait_for(db.close(), timeout=10)


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_callers_waiting_for_a_postgres_connection_are_served_not_starved(
    migrated_url: str,
) -> None:
    """More callers than connections: one that had to wait in asyncpg's queue gets the
    next connection given back (none is parked on the idle list while anyone waits), so
    nobody runs into the acquire timeout while the others keep going."""
    db = Database(migrated_url, pool_size=1, busy_timeout_s=3.0)  # two connections
    done: list[int] = []

    async def caller(index: int) -> None:
        for _ in range(10):
            async with db.read() as conn:
                await conn.scalar(sa.text("SELECT pg_sleep(0.002)"))
        done.append(index)

    try:
        await asyncio.wait_for(asyncio.gather(*(caller(i) for i in range(12))), timeout=30)
        assert sorted(done) == list(range(12))
    finally:
        await db.close()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_first_uses_at_once_make_one_postgres_pool(migrated_url: str) -> None:
    """Callers arriving while the pool is being made share it: the connections to the
    database stay within the pool's bound (one pool each used to be made, and all but
    the last leaked)."""
    import asyncpg

    from leadgate.database.pg import asyncpg_dsn

    db = Database(migrated_url, pool_size=1)  # at most two connections
    other = await asyncpg.connect(asyncpg_dsn(migrated_url))
    # Only client connections opened from here on count: the migration's connection may
    # still be on its way out of pg_stat_activity (its backend exits after the client
    # left; seen on a loaded machine as a third connection), and an autovacuum worker on
    # the freshly migrated database shows there with its datname too (seen in CI).
    since = await other.fetchval("SELECT clock_timestamp()")
    try:

        async def first_use() -> None:
            async with db.read() as conn:
                await conn.scalar(sa.text("SELECT pg_sleep(0.05)"))

        await asyncio.gather(*(first_use() for _ in range(8)))
        count = await other.fetchval(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND backend_type = 'client backend' AND backend_start >= $1",
            since,
        )
        assert count <= 2
    finally:
        await other.close()
        await db.close()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_postgres_runs_a_caller_supplied_in_list_as_one_array_parameter(
    migrated_url: str,
) -> None:
    """On PostgreSQL ``IN (<list the caller passes>)`` is ``= ANY($n)``: one SQL text
    (one prepared statement) for every length, empty lists included, with the same rows
    as an expanded list; a literal list of a statement built per call keeps its own
    values (SQLAlchemy's per-object values), and NOT IN is left as it is."""
    db = Database(migrated_url)
    try:
        async with db.tx() as conn:
            for binding_id in ("e1", "e2", "e3", "e4"):
                await conn.execute(INSERT_BINDING, binding(binding_id, silent=binding_id == "e2"))
        with db.record_statements() as statements:
            async with db.read() as conn:
                got = [
                    [r.id for r in (await conn.execute(BINDINGS_IN, {"p_ids": values})).all()]
                    for values in (["e1"], ["e4", "e2", "missing"], [], ("e3", "e1"), {"e2"})
                ]
        assert got == [["e1"], ["e2", "e4"], [], ["e1", "e3"], ["e2"]]
        assert len(set(statements)) == 1 and "= ANY(" in statements[0], statements
        async with db.read() as conn:
            for wanted in (["e4", "e3"], ["e1"]):
                literal = sa.select(B.id).where(B.id.in_(wanted)).order_by(B.id)
                assert [r.id for r in await conn.execute(literal)] == sorted(wanted)
            not_in = sa.select(B.id).where(B.id.not_in(sa.bindparam("p_ids", expanding=True)))
            rows = await conn.execute(not_in.order_by(B.id), {"p_ids": ["e1", "e2"]})
            assert [r.id for r in rows] == ["e3", "e4"]
        async with db.tx() as conn:
            delete = t.bindings.delete().where(B.id.in_(sa.bindparam("p_ids", expanding=True)))
            assert (await conn.execute(delete, {"p_ids": ["e1", "e4"]})).rowcount == 2
        assert await committed_ids(db) == {"e2", "e3"}
    finally:
        await db.close()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_postgres_connections_idle_past_the_bound_go_back_to_asyncpg(
    migrated_url: str,
) -> None:
    """A burst's connections wait on the idle list, but not for ever: once one has been
    unused for ``IDLE_S`` the next use hands it back to asyncpg's pool (whose inactivity
    timeout closes it), keeping the connection just used."""
    from sqlalchemy.dialects.postgresql import asyncpg as pg_asyncpg

    from leadgate.database.pg import IDLE_S, PgPool

    now = [1000.0]
    dialect = pg_asyncpg.dialect()  # type: ignore[no-untyped-call]
    pool = PgPool(migrated_url, dialect, size=4, monotonic=lambda: now[0])
    try:
        release = asyncio.Event()
        holding: asyncio.Queue[None] = asyncio.Queue()

        async def hold() -> int:
            async with pool.read() as conn:
                pid = await conn.scalar(sa.text("SELECT pg_backend_pid()"))
                holding.put_nowait(None)
                await release.wait()
            return int(pid)

        burst = [asyncio.create_task(hold()) for _ in range(3)]
        for _ in burst:
            await asyncio.wait_for(holding.get(), timeout=10)
        release.set()
        pids = set(await asyncio.gather(*burst))
        assert len(pids) == 3 and len(pool._idle) == 3

        now[0] += IDLE_S / 2
        async with pool.read() as conn:
            await conn.scalar(sa.text("SELECT 1"))
        assert len(pool._idle) == 3  # not idle long enough yet

        now[0] += IDLE_S / 2 + 1
        async with pool.read() as conn:
            used = await conn.scalar(sa.text("SELECT pg_backend_pid()"))
        assert used in pids and len(pool._idle) == 1 and pool._idle[0][1] == now[0]
        assert pool._pool is not None and pool._pool.get_idle_size() == 2  # asyncpg's now
    finally:
        await pool.close()


async def insert_signalled(db: Database, binding_id: str) -> None:
    """One member of a group: a binding inserted, ``grp`` signalled with its id."""
    async with db.tx() as conn:
        await conn.execute(INSERT_BINDING, binding(binding_id))
        signal_after_commit(conn, "grp", binding_id)


@SQLITE_ONLY
@pytest.mark.parametrize("whole_transaction", [False, True])
async def test_a_group_commit_that_meets_a_database_fault_is_not_in_doubt(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, whole_transaction: bool
) -> None:
    """SQLite's COMMIT runs in this process: when it fails, the transaction did not
    commit (see InlineSqlite._commit), for every member of the group alike. Each gets
    the plain 503 (not in doubt), nothing is stored, no listener is told it may have
    been (doubt) or was (commit), and the next transaction commits. ``whole_transaction``:
    the I/O error rolled the transaction back by itself first, as SQLite may."""
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    faults = SqliteFaults(path, monkeypatch)
    db = Database(migrated_url)
    fired: list[list[Any]] = []
    doubted: list[list[Any]] = []
    db.on_commit_payloads("grp", fired.append)
    db.on_doubt_payloads("grp", doubted.append)

    try:
        faults.arm_on("INSERT INTO bindings", then="COMMIT", whole_transaction=whole_transaction)
        async with asyncio.timeout(HANG_S):
            results = await asyncio.gather(
                *(insert_signalled(db, b) for b in "abc"), return_exceptions=True
            )
        faults.disarm()
        # One COMMIT failed, and all three were told: they shared it.
        assert faults.fired is not None and faults.fired.startswith("COMMIT"), faults.statements
        assert all(isinstance(r, Unavailable) for r in results), results
        assert [r.in_doubt for r in results if isinstance(r, Unavailable)] == [False] * 3
        assert (fired, doubted) == ([], [])
        assert raw_ids(path) == set()
        async with asyncio.timeout(HANG_S), db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding("after"))
            signal_after_commit(conn, "grp", "after")
        assert fired == [["after"]] and raw_ids(path) == {"after"}
    finally:
        await db.close()


@SQLITE_ONLY
async def test_a_group_whose_commit_and_rollback_fail_tells_every_member(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ROLLBACK after a failed COMMIT fails as well (an I/O error): every member
    still gets the plain 503 (before, none was ever answered, and the transaction stayed
    open on the connection, so every later BEGIN failed), nothing is stored, and the
    next transaction commits on a connection of its own."""
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    faults = SqliteFaults(path, monkeypatch)
    db = Database(migrated_url)
    doubted: list[list[Any]] = []
    db.on_doubt_payloads("grp", doubted.append)

    try:
        faults.arm_on("INSERT INTO bindings", then="COMMIT", and_on="ROLLBACK")
        async with asyncio.timeout(HANG_S):
            results = await asyncio.gather(
                *(insert_signalled(db, b) for b in "ab"), return_exceptions=True
            )
        faults.disarm()
        assert faults.fired is not None and faults.fired.startswith("COMMIT"), faults.statements
        assert "ROLLBACK" in faults.statements, faults.statements
        assert all(isinstance(r, Unavailable) and not r.in_doubt for r in results), results
        assert doubted == [] and raw_ids(path) == set()
        async with asyncio.timeout(HANG_S), db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding("after"))
        assert raw_ids(path) == {"after"}
    finally:
        await db.close()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
@pytest.mark.parametrize("alone", [False, True], ids=["transaction", "statement"])
async def test_a_write_in_doubt_wakes_its_listeners_and_hands_its_payloads_over(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, alone: bool
) -> None:
    """PostgreSQL: a write whose COMMIT (or whose statement run alone) reached the server
    and whose answer was lost may have landed. Its caller gets a 503 in doubt, its
    payloads go to the doubt listeners (never to the commit listeners), and the plain
    listeners of its topics are woken as by a commit: a delivery it made due is sent at
    once, not at the relay's next poll (they were not woken at all)."""
    faults = PgFaults(monkeypatch)
    db = Database(migrated_url)
    woken: list[str] = []
    fired: list[list[Any]] = []
    doubted: list[list[Any]] = []
    db.on_commit("grp", lambda: woken.append("grp"))
    db.on_commit_payloads("grp", fired.append)
    db.on_doubt_payloads("grp", doubted.append)
    try:
        if alone:
            faults.arm_on("INSERT INTO bindings", after_commit=True)
            with pytest.raises(Unavailable) as raised:
                await db.write_alone(INSERT_BINDING, binding("a"), signals=[("grp", "a")])
        else:
            faults.arm_on("INSERT INTO bindings", then="COMMIT", after_commit=True)
            with pytest.raises(Unavailable) as raised:
                async with db.tx() as conn:
                    await conn.execute(INSERT_BINDING, binding("a"))
                    signal_after_commit(conn, "grp", "a")
        faults.disarm()
        assert raised.value.in_doubt
        # It may have landed (it did): the error does not say nothing was stored.
        assert str(raised.value) == raised.value.message == MAY_BE_STORED
        assert (woken, fired, doubted) == (["grp"], [], [["a"]])
        async with db.read() as conn:  # it did land
            assert await conn.scalar(sa.select(t.bindings.c.id)) == "a"
    finally:
        await db.close()


@SQLITE_ONLY
@pytest.mark.parametrize(
    ("kept", "arm", "retry_fails"),
    [
        # The failed member runs first: its ROLLBACK (nothing kept to run again) fails.
        (False, ("ROLLBACK", None), False),
        (False, ("ROLLBACK", None), True),
        # A member was kept before it: the ROLLBACK before the redo fails.
        (True, ("ROLLBACK", None), False),
        (True, ("ROLLBACK", None), True),
        # The ROLLBACK works but the redo of the kept member's write fails, and so does
        # the ROLLBACK of that half-redone transaction.
        (True, ("ROLLBACK", "INSERT INTO bindings"), True),
    ],
    ids=["first", "first-retry-fails", "kept", "kept-retry-fails", "redo"],
)
async def test_a_member_whose_writes_cannot_be_undone_fails_the_whole_group(
    migrated_url: str,
    monkeypatch: pytest.MonkeyPatch,
    kept: bool,
    arm: tuple[str, str | None],
    retry_fails: bool,
) -> None:
    """A member fails and undoing its writes fails too (an I/O error on the ROLLBACK,
    or on the redo of the kept members' writes and then on the ROLLBACK of that): its
    writes (or half the kept ones) were still in the group's transaction, and the
    members after it carried on in it and COMMITted them, so a caller told "failed" had
    its writes stored. Now the whole group fails: the failed member gets its own error,
    every other member (before it, or waiting to run after it) the plain 503 (not in
    doubt), nothing of the group is stored, and the next transaction commits (on a new
    connection when the transaction could not be ended: ``retry_fails``, every ROLLBACK
    failing). No connection to the file can be opened while the group runs: the group,
    having closed its own, opens none (one failing to open would leave every member
    unanswered and the writer lock held)."""
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    faults = SqliteFaults(path, monkeypatch)
    db = Database(migrated_url)
    fired: list[list[Any]] = []
    doubted: list[list[Any]] = []
    db.on_commit_payloads("grp", fired.append)
    db.on_doubt_payloads("grp", doubted.append)
    faulty_connect = sqlite3.connect
    refuse_opening = [False]

    def connect(database: Any, *args: Any, **kwargs: Any) -> sqlite3.Connection:
        if refuse_opening[0] and str(database) == path:
            error = sqlite3.OperationalError("unable to open database file")
            error.sqlite_errorcode = sqlite3.SQLITE_CANTOPEN
            raise error
        opened: sqlite3.Connection = faulty_connect(database, *args, **kwargs)
        return opened

    monkeypatch.setattr(sqlite3, "connect", connect)

    async def member(binding_id: str, fail: bool = False) -> InlineConnection:
        async with db.tx() as conn:
            if fail:
                # The members after it join the group (and wait for its member slot).
                await asyncio.sleep(0)
            await conn.execute(INSERT_BINDING, binding(binding_id))
            signal_after_commit(conn, "grp", binding_id)
            if fail:
                raise Boom
        assert isinstance(conn, InlineConnection)
        return conn

    try:
        async with asyncio.timeout(HANG_S):
            before = await member("warm")
        text, then = arm
        faults.arm_on(text, then=then, and_on="ROLLBACK" if retry_fails else None)
        names = ["a", "b", "c", "d"] if kept else ["b", "c", "d"]
        refuse_opening[0] = True
        async with asyncio.timeout(HANG_S):
            results = await asyncio.gather(
                *(member(name, fail=name == "b") for name in names), return_exceptions=True
            )
        faults.disarm()
        refuse_opening[0] = False
        assert faults.fired is not None and faults.fired.startswith(text if then is None else then)
        assert raw_ids(path) == {"warm"}, results
        told = dict(zip(names, results, strict=True))
        assert isinstance(told.pop("b"), Boom), results
        assert all(isinstance(r, Unavailable) and not r.in_doubt for r in told.values()), results
        assert (fired, doubted) == ([["warm"]], [])
        async with asyncio.timeout(HANG_S):
            after = await member("after")
        assert raw_ids(path) == {"warm", "after"}
        assert fired == [["warm"], ["after"]]
        # A transaction that could not be ended took its connection with it.
        assert (after is before) is not retry_fails
    finally:
        await db.close()


@SQLITE_ONLY
@pytest.mark.parametrize("fault", ["rollback", "rollback-and-retry", "commit-in-between"])
async def test_members_that_only_read_are_answered_when_a_failed_members_undo_fails(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """The members kept before a failed one only read: nothing of theirs needs undoing
    or running again, and what they read was the database as it stood (the failed
    member wrote after them). When the undo of the failed member's writes fails
    (``rollback``: an I/O error on its ROLLBACK; ``rollback-and-retry``: on every
    ROLLBACK, so the connection is closed), the reader is answered with what it read
    (it was the group's 503), while the member waiting behind the failed one still gets
    the 503 and nothing of the failed member is stored. ``commit-in-between``: another
    process commits right after the ROLLBACK; the reader's transaction is not begun
    again over it (that redo found the database changed and failed the whole group),
    and the member behind begins anew and commits."""
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    faults = SqliteFaults(path, monkeypatch)
    db = Database(migrated_url)
    fired: list[list[Any]] = []
    db.on_commit_payloads("grp", fired.append)

    async def reader() -> list[str]:
        async with db.tx() as conn:
            return [row.id for row in await conn.execute(ALL_BINDINGS)]

    async def failing() -> None:
        async with db.tx() as conn:
            await asyncio.sleep(0)  # the member after it joins the group
            await conn.execute(INSERT_BINDING, binding("b"))
            raise Boom

    def other_commit() -> None:
        faults.on_settled = None  # once
        with closing(faults.real_connect(path)) as other, other:
            other.execute(
                "INSERT INTO bindings (id, org_id, session_id, kind, address, silent,"
                " active, created_at) VALUES ('other', 'o', 's', 'api', '{}', 0, 1, 1)"
            )

    try:
        async with asyncio.timeout(HANG_S):
            await insert_signalled(db, "warm")
        if fault == "commit-in-between":
            faults.arm(None)
            faults.on_settled = other_commit
        else:
            faults.arm_on("ROLLBACK", and_on="ROLLBACK" if fault == "rollback-and-retry" else None)
        async with asyncio.timeout(HANG_S):
            results = await asyncio.gather(
                reader(), failing(), insert_signalled(db, "c"), return_exceptions=True
            )
        faults.disarm()
        assert results[0] == ["warm"], results
        assert isinstance(results[1], Boom), results
        if fault == "commit-in-between":
            assert results[2] is None, results
            assert raw_ids(path) == {"warm", "other", "c"}
            assert fired == [["warm"], ["c"]]
        else:
            assert faults.fired == "ROLLBACK", faults.statements
            assert isinstance(results[2], Unavailable) and not results[2].in_doubt, results
            assert raw_ids(path) == {"warm"}
            assert fired == [["warm"]]
        async with asyncio.timeout(HANG_S):
            await insert_signalled(db, "after")
        assert "after" in raw_ids(path)
    finally:
        await db.close()


@SQLITE_ONLY
async def test_a_transaction_waiting_behind_a_group_that_closed_the_connection_uses_a_new_one(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transaction that starts while a group still runs (past its commit point, a
    member still inside) waits for the writer lock; when that group's COMMIT and
    ROLLBACK fail, the group closes the connection. The waiting transaction then begins
    on a new connection and commits: it had taken the connection before waiting, and
    began on the closed one (sqlite3's ProgrammingError, not even a 503)."""
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    faults = SqliteFaults(path, monkeypatch)
    db = Database(migrated_url)
    inside = asyncio.Event()
    go = asyncio.Event()

    async def member(binding_id: str) -> None:
        async with db.tx() as conn:
            await conn.execute(INSERT_BINDING, binding(binding_id))
            if binding_id == "slow":
                inside.set()
                await go.wait()

    async def waiting() -> None:
        await inside.wait()
        task = asyncio.ensure_future(member("later"))
        await asyncio.sleep(0)  # it starts, and waits for the writer lock the group holds
        assert db._lock()._waiters and not task.done()
        go.set()
        await task

    try:
        faults.arm_on("INSERT INTO bindings", then="COMMIT", and_on="ROLLBACK")
        async with asyncio.timeout(HANG_S):
            results = await asyncio.gather(member("slow"), waiting(), return_exceptions=True)
        faults.disarm()
        assert faults.fired is not None and faults.fired.startswith("COMMIT"), faults.statements
        assert isinstance(results[0], Unavailable) and not results[0].in_doubt, results
        assert results[1] is None, results
        assert raw_ids(path) == {"later"}
    finally:
        await db.close()
