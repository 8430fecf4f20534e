"""The test harness itself: the throwaway PostgreSQL and the database fixtures."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from leadgate.core.errors import Unavailable
from leadgate.database.db import Database
from tests.fakes import CommitLandsLater
from tests.helpers import make_org
from tests.pg import PostgresServer
from tests.stack import Stack

_seen_databases: set[str] = set()


async def test_server_answers_through_asyncpg(postgres_server: PostgresServer) -> None:
    conn = await asyncpg.connect(postgres_server.dsn())
    try:
        assert await conn.fetchval("SELECT 1") == 1
        assert await conn.fetchval("SELECT current_database()") == "leadgate_test"
        version = await conn.fetchval("SHOW server_version_num")
        assert int(version) >= 150000
        if not postgres_server.external:
            assert await conn.fetchval("SHOW listen_addresses") == "127.0.0.1"
            assert await conn.fetchval("SHOW fsync") == "off"
    finally:
        await conn.close()


async def test_server_answers_through_sqlalchemy(postgres_server: PostgresServer) -> None:
    assert postgres_server.url.startswith("postgresql+asyncpg://")
    engine = create_async_engine(postgres_server.url)
    try:
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT 1"))).scalar_one() == 1
    finally:
        await engine.dispose()


@pytest.mark.parametrize("round_", [1, 2])
async def test_pg_url_gives_distinct_empty_databases(pg_url: str, round_: int) -> None:
    # Each round must get a database it has never seen and that holds no table, even
    # though every round leaves a table behind in its own database.
    name = make_url(pg_url).database
    assert name and name not in _seen_databases
    _seen_databases.add(name)
    engine = create_async_engine(pg_url)
    try:
        async with engine.begin() as conn:
            assert (await conn.execute(text("SELECT current_database()"))).scalar_one() == name
            tables = await conn.execute(
                text("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
            )
            assert tables.scalar_one() == 0
            await conn.execute(text("CREATE TABLE leftover (id int PRIMARY KEY)"))
            await conn.execute(text("INSERT INTO leftover VALUES (:round)"), {"round": round_})
    finally:
        await engine.dispose()


async def test_create_database_is_usable(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database("harness_extra")
    try:
        engine = create_async_engine(url)
        try:
            async with engine.connect() as conn:
                db = (await conn.execute(text("SELECT current_database()"))).scalar_one()
                assert db == "harness_extra"
        finally:
            await engine.dispose()
    finally:
        postgres_server.drop_database("harness_extra")


async def test_db_url_runs_on_both_backends(db_url: str) -> None:
    engine = create_async_engine(db_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE t (id integer PRIMARY KEY, v text)"))
            await conn.execute(text("INSERT INTO t VALUES (1, 'x')"))
            assert (await conn.execute(text("SELECT v FROM t WHERE id = 1"))).scalar_one() == "x"
    finally:
        await engine.dispose()


def test_postgres_tests_are_marked(request: pytest.FixtureRequest) -> None:
    # This test does not use PostgreSQL, so it must not carry the marker.
    assert request.node.get_closest_marker("postgres") is None


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_commit_left_to_land_later_is_rolled_back_when_the_test_ends(
    stack: Stack, commit_lands_later: Callable[[Database], CommitLandsLater]
) -> None:
    """``commit_lands_later``'s finalizer (what it runs is :meth:`CommitLandsLater.abandon`)
    rolls back a transaction a test left held: its rows never land, and the pool, its
    connection given back, closes at once. Held, the stack's close at teardown waited
    for that connection for ever (a test that failed before its ``land()`` hung)."""
    late = commit_lands_later(stack.db)
    with pytest.raises(Unavailable):
        await make_org(stack)
    assert late.held is not None
    await late.abandon()  # (what the fixture does when the test ends, however it ends)
    assert late.held is None
    await asyncio.wait_for(stack.db.close(), 10)
    engine = create_async_engine(stack.db.engine.url)
    try:
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM organizations"))).scalar() == 0
    finally:
        await engine.dispose()
