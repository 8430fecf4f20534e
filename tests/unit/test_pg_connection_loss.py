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
from collections.abc import AsyncIterator, Sequence

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect

from leadgate.core.errors import Unavailable
from leadgate.database.db import Database, upgrade
from leadgate.database.groups import Grouped
from leadgate.database.pg import IDLE_S, PgPool
from tests.pg import PostgresServer

pytestmark = pytest.mark.timeout(60)

SELECT_ONE = sa.text("SELECT 1")


def kill_backends(server: PostgresServer, url: str, pid: int | None = None) -> int:
    """Terminate every connection to ``url``'s database (or the one of ``pid``) and wait
    until each is gone.

    Run synchronously on purpose: the event loop is blocked meanwhile, so no pooled
    connection has noticed its socket close when the test goes on (as with a restart
    the process had no reason to read from the socket during)."""
    database = url.rsplit("/", 1)[1]
    which = "pid <> pg_backend_pid()" if pid is None else f"pid = {pid}"
    return int(
        server.psql(
            "SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity "
            # Client connections only: an autovacuum worker on the freshly written
            # database shows in pg_stat_activity with its datname too.
            f"WHERE datname = '{database}' AND backend_type = 'client backend' AND {which}"
        ).strip()
    )


async def backends(db: Database | PgPool, connections: int) -> set[int]:
    """The server pids of ``connections`` pooled connections used at once (which then
    wait idle in the pool)."""

    async def hold() -> int:
        async with db.read() as conn:
            return int(await conn.scalar(sa.text("SELECT pg_backend_pid() FROM pg_sleep(0.05)")))

    return set(await asyncio.gather(*(hold() for _ in range(connections))))


@pytest.fixture
async def dropped(pg_url: str, postgres_server: PostgresServer) -> AsyncIterator[Database]:
    """A migrated database whose four idle pooled connections the server dropped."""
    await asyncio.to_thread(upgrade, pg_url)
    db = Database(pg_url)
    try:
        assert len(await backends(db, 4)) == 4
        assert kill_backends(postgres_server, pg_url) >= 4
        yield db
    finally:
        await db.close()


async def organization_ids(db: Database) -> list[str]:
    async with db.read() as conn:
        return sorted((await conn.execute(sa.text("SELECT id FROM organizations"))).scalars())


INSERT = sa.text("INSERT INTO organizations (id, name, created_at) VALUES (:id, :id, 1)")


async def test_a_read_on_a_dropped_connection_runs_again_on_a_fresh_one(
    dropped: Database,
) -> None:
    async with dropped.read() as conn:
        assert await conn.scalar(SELECT_ONE) == 1
        assert await conn.scalar(SELECT_ONE) == 1


async def test_a_transaction_whose_begin_meets_a_dropped_connection_runs_on_a_fresh_one(
    dropped: Database,
) -> None:
    async with dropped.tx() as conn:
        await conn.execute(INSERT, {"id": "o1"})
    assert await organization_ids(dropped) == ["o1"]


async def test_a_write_alone_on_a_dropped_connection_is_a_503_and_renews_the_pool(
    dropped: Database,
) -> None:
    """The statement may have committed before the connection died: no retry here (the
    client retries a 503). The writes after it, however many at once, find live
    connections."""
    with pytest.raises(Unavailable) as raised:
        await dropped.write_alone(INSERT, {"id": "lost"})
    assert raised.value.rule == "service.unavailable"
    await asyncio.gather(*(dropped.write_alone(INSERT, {"id": f"o{i}"}) for i in range(3)))
    assert await organization_ids(dropped) == ["o0", "o1", "o2"]


async def test_one_dropped_connection_renews_the_whole_pool(
    pg_url: str, postgres_server: PostgresServer
) -> None:
    """A restart or failover drops every connection, though each is found only when
    used: after the first, none opened before it is used again (the idle ones are
    closed, asyncpg's reconnect on their next acquire)."""
    await asyncio.to_thread(upgrade, pg_url)
    db = Database(pg_url)
    try:
        before = await backends(db, 4)
        async with db.read() as conn:  # the newest idle one, next in line again after
            newest = int(await conn.scalar(sa.text("SELECT pg_backend_pid()")))
        assert kill_backends(postgres_server, pg_url, newest) == 1
        async with db.read() as conn:
            assert await conn.scalar(SELECT_ONE) == 1
        after = await backends(db, 4)
        assert not after & before, (before, after)
    finally:
        await db.close()


async def test_connections_parked_in_asyncpgs_pool_are_renewed_too(
    pg_url: str, postgres_server: PostgresServer
) -> None:
    """Connections idle past ``IDLE_S`` go back to asyncpg's own pool, where the
    process cannot close them one by one: the renewal expires them there, and asyncpg
    opens fresh ones on their next acquire."""
    now = [0.0]
    dialect = asyncpg_dialect()  # type: ignore[no-untyped-call]
    pool = PgPool(pg_url, dialect, size=4, monotonic=lambda: now[0])
    try:
        assert len(await backends(pool, 4)) == 4
        now[0] = IDLE_S + 1  # the next use ends by handing the other three to asyncpg
        await backends(pool, 1)
        assert kill_backends(postgres_server, pg_url) == 4
        # The one left on the process's list fails and is replaced from asyncpg's pool,
        # whose connections are as dead.
        async with pool.read() as conn:
            assert await conn.scalar(SELECT_ONE) == 1
    finally:
        await pool.close()


INSERT_MANY = sa.text(
    "INSERT INTO organizations (id, name, created_at)"
    " SELECT id, id, 1 FROM unnest(CAST(:ids AS varchar[])) AS i(id)"
)


async def test_grouped_writes_behind_one_that_met_a_dropped_connection_are_written(
    dropped: Database,
) -> None:
    """Writes grouped while the first is under way (``Grouped``): the first meets a
    dropped connection and is a 503 alone (it may have committed); the ones that
    waited behind it go together on a live connection."""

    async def alone(org_id: str) -> None:
        await dropped.write_alone(INSERT, {"id": org_id})

    async def many(org_ids: Sequence[str]) -> list[None]:
        await dropped.write_alone(INSERT_MANY, {"ids": list(org_ids)})
        return [None] * len(org_ids)

    grouped: Grouped[str, None] = Grouped(alone, many)
    results = await asyncio.gather(
        *(grouped(org_id) for org_id in ("lost", "o1", "o2", "o3")), return_exceptions=True
    )
    assert isinstance(results[0], Unavailable) and results[1:] == [None, None, None]
    assert (grouped.statements, grouped.items) == (2, 4)
    assert await organization_ids(dropped) == ["o1", "o2", "o3"]
