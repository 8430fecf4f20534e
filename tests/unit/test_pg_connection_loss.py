"""Pooled PostgreSQL connections the server dropped while they sat idle.

When PostgreSQL restarts, fails over or an administrator runs ``pg_terminate_backend``,
every idle pooled connection is dead, but the process learns of it only when it reads
from the socket. A read or a transaction's ``BEGIN`` that meets such a connection has
sent nothing that could have changed data: it runs again on a fresh connection instead
of answering 503, and the rest of the pool is renewed at once (the first dead
connection says the others are dead too). A write sent alone may have been committed
before the connection died: it stays a 503 (the client's retry is safe), and the
connections after it are fresh.
"""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa

from leadgate.core.errors import Unavailable
from leadgate.database.db import Database, upgrade
from tests.pg import PostgresServer

pytestmark = pytest.mark.timeout(60)

SELECT_ONE = sa.text("SELECT 1")


def kill_every_backend(server: PostgresServer, url: str) -> int:
    """Terminate every connection to ``url``'s database and wait until each is gone.

    Run synchronously on purpose: the event loop is blocked meanwhile, so no pooled
    connection has noticed its socket close when the test goes on (as with a restart
    the process had no reason to read from the socket during)."""
    database = url.rsplit("/", 1)[1]
    return int(
        server.psql(
            "SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity "
            f"WHERE datname = '{database}' AND pid <> pg_backend_pid()"
        ).strip()
    )


async def warm(db: Database, connections: int) -> None:
    """Leave ``connections`` pooled connections idle (concurrent reads open them)."""

    async def hold() -> None:
        async with db.read() as conn:
            await conn.execute(sa.text("SELECT pg_sleep(0.05)"))

    await asyncio.gather(*(hold() for _ in range(connections)))


@pytest.fixture
def migrated_pg(pg_url: str) -> str:
    upgrade(pg_url)
    return pg_url


async def test_a_read_on_a_dropped_connection_runs_again_on_a_fresh_one(
    migrated_pg: str, postgres_server: PostgresServer
) -> None:
    db = Database(migrated_pg)
    try:
        await warm(db, 3)
        assert kill_every_backend(postgres_server, migrated_pg) >= 3
        async with db.read() as conn:
            assert await conn.scalar(SELECT_ONE) == 1
            assert await conn.scalar(SELECT_ONE) == 1
    finally:
        await db.close()


async def test_a_transaction_whose_begin_meets_a_dropped_connection_runs_on_a_fresh_one(
    migrated_pg: str, postgres_server: PostgresServer
) -> None:
    db = Database(migrated_pg)
    try:
        await warm(db, 3)
        assert kill_every_backend(postgres_server, migrated_pg) >= 3
        async with db.tx() as conn:
            await conn.execute(
                sa.text("INSERT INTO organizations (id, name, created_at) VALUES ('o1', 'x', 1)")
            )
        async with db.read() as conn:
            assert await conn.scalar(sa.text("SELECT count(*) FROM organizations")) == 1
    finally:
        await db.close()


async def test_a_write_alone_on_a_dropped_connection_is_a_503_and_renews_the_pool(
    migrated_pg: str, postgres_server: PostgresServer
) -> None:
    """The statement may have committed before the connection died: no retry here (the
    client retries a 503). The first dead connection renews the rest, so the writes
    after it, however many at once, find live ones."""
    db = Database(migrated_pg)
    insert = sa.text("INSERT INTO organizations (id, name, created_at) VALUES (:id, :id, 1)")
    try:
        await warm(db, 4)
        assert kill_every_backend(postgres_server, migrated_pg) >= 4
        with pytest.raises(Unavailable) as raised:
            await db.write_alone(insert, {"id": "lost"})
        assert raised.value.rule == "service.unavailable"
        await asyncio.gather(*(db.write_alone(insert, {"id": f"o{i}"}) for i in range(3)))
        async with db.read() as conn:
            ids = (await conn.execute(sa.text("SELECT id FROM organizations"))).scalars()
            assert sorted(ids) == ["o0", "o1", "o2"]
    finally:
        await db.close()
