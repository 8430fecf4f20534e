"""A PostgreSQL transaction whose statement failed outside a savepoint and whose caller
caught the error and went on.

PostgreSQL aborts the transaction at the error and answers its ``COMMIT`` with
``ROLLBACK``, which asyncpg does not report: the caller was told its writes committed
while none had. Ending such a transaction now raises the error again, before the
``COMMIT`` (nothing in doubt); an error caught inside a savepoint (``begin_nested``),
whose undo took it back, still commits the rest.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

import asyncpg
import pytest
import sqlalchemy as sa

from leadgate.core.errors import Unavailable
from leadgate.database.db import Database, signal_after_commit
from leadgate.database.pg import asyncpg_dsn
from tests.helpers import eventually
from tests.integration.test_damaged_postgres import run_sql
from tests.unit.test_pg_connection_loss import INSERT, organization_ids

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def db(migrated_pg: str) -> AsyncIterator[Database]:
    database = Database(migrated_pg)
    try:
        yield database
    finally:
        await database.close()


async def test_a_swallowed_integrity_error_fails_the_transaction(db: Database) -> None:
    woken: list[str] = []
    doubted: list[list[object]] = []
    db.on_commit("t", lambda: woken.append("t"))
    db.on_doubt_payloads("t", doubted.append)
    async with db.tx() as conn:
        await conn.execute(INSERT, {"id": "taken"})
    with pytest.raises(sa.exc.IntegrityError) as raised:
        async with db.tx() as conn:
            await conn.execute(INSERT, {"id": "o1"})
            signal_after_commit(conn, "t", "p")
            try:
                await conn.execute(INSERT, {"id": "taken"})
            except sa.exc.IntegrityError:
                pass  # and the block ends: its COMMIT was answered ROLLBACK
    assert "nothing of the transaction committed" in "".join(raised.value.__notes__)
    assert await organization_ids(db) == ["taken"]
    assert (woken, doubted) == ([], [])  # no commit, and nothing in doubt
    async with db.tx() as conn:  # the connection is fine for the next one
        await conn.execute(INSERT, {"id": "o2"})
    assert await organization_ids(db) == ["o2", "taken"]


async def test_a_swallowed_fault_is_a_503_not_in_doubt(db: Database) -> None:
    """A statement cancelled by ``statement_timeout`` and caught: the transaction fails
    as a database fault would, before its COMMIT."""
    with pytest.raises(Unavailable) as raised:
        async with db.tx() as conn:
            await conn.execute(INSERT, {"id": "o1"})
            await conn.execute(sa.text("SET LOCAL statement_timeout = '50ms'"))
            try:
                await conn.execute(sa.text("SELECT pg_sleep(5)"))
            except sa.exc.DBAPIError:
                pass
    assert raised.value.rule == "service.unavailable" and not raised.value.in_doubt
    assert await organization_ids(db) == []


async def test_an_error_undone_by_a_savepoint_commits_the_rest(db: Database) -> None:
    async with db.tx() as conn:
        await conn.execute(INSERT, {"id": "taken"})
    async with db.tx() as conn:
        await conn.execute(INSERT, {"id": "o1"})
        try:
            async with conn.begin_nested():
                await conn.execute(INSERT, {"id": "taken"})
        except sa.exc.IntegrityError:
            pass
        await conn.execute(INSERT, {"id": "o2"})
    assert await organization_ids(db) == ["o1", "o2", "taken"]


async def test_an_error_caught_inside_a_savepoint_fails_the_transaction(db: Database) -> None:
    """Caught inside the block, the error is not undone: the block's end (``RELEASE``)
    fails with that error (not PostgreSQL's 25P02), and with it caught too the
    transaction still fails whole, with it."""
    async with db.tx() as conn:
        await conn.execute(INSERT, {"id": "taken"})
    with pytest.raises(sa.exc.IntegrityError) as raised:
        async with db.tx() as conn:
            await conn.execute(INSERT, {"id": "o1"})
            try:
                async with conn.begin_nested():
                    try:
                        await conn.execute(INSERT, {"id": "taken"})
                    except sa.exc.IntegrityError:
                        pass
            except sa.exc.DBAPIError as released:
                assert isinstance(released, sa.exc.IntegrityError), released
    assert _sqlstate(raised.value) != IN_FAILED_TRANSACTION
    assert "refused the RELEASE" in "".join(raised.value.__notes__)
    assert await organization_ids(db) == ["taken"]


async def test_the_pools_own_transaction_fails_too(db: Database) -> None:
    """:meth:`PgPool.transaction` itself, whoever uses it."""
    pool = db._pg
    assert pool is not None
    async with db.tx() as conn:
        await conn.execute(INSERT, {"id": "taken"})
    with pytest.raises(sa.exc.IntegrityError):
        async with pool.transaction() as raw:
            await raw.execute(INSERT, {"id": "o1"})
            try:
                await raw.execute(INSERT, {"id": "taken"})
            except sa.exc.IntegrityError:
                pass
    assert await organization_ids(db) == ["taken"]


async def test_a_session_ended_idle_in_its_transaction_is_a_503(
    db: Database, migrated_pg: str
) -> None:
    """``idle_in_transaction_session_timeout`` (SQLSTATE 25P03, FATAL): the server closes
    the connection, which the next statement finds closed. The wait is the server's
    timer, not ours: it cannot be faked."""
    name = sa.engine.make_url(migrated_pg).database
    await run_sql(
        migrated_pg, f"ALTER DATABASE {name} SET idle_in_transaction_session_timeout = '100ms'"
    )
    other = await asyncpg.connect(asyncpg_dsn(migrated_pg))

    async def ended(pid: int) -> bool:
        return not await other.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid)

    try:
        with pytest.raises(Unavailable) as raised:
            async with db.tx() as conn:
                await conn.execute(INSERT, {"id": "o1"})
                pid = await conn.scalar(sa.text("SELECT pg_backend_pid()"))
                # The server ends the session, waited for: a loaded machine's server
                # could take longer than the 0.5 s this slept (the insert then went in).
                await eventually(functools.partial(ended, pid))
                await conn.execute(INSERT, {"id": "o2"})
    finally:
        await other.close()
    assert raised.value.rule == "service.unavailable" and not raised.value.in_doubt
    assert await organization_ids(db) == []


#: A deferred constraint trigger that refuses, at COMMIT, an organization whose id
#: starts with "refused", with a serialization failure (an ERROR answer: the server
#: rolled the transaction back).
REFUSE_AT_COMMIT = """
CREATE FUNCTION lg_refuse_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.id LIKE 'refused%' THEN
    RAISE EXCEPTION 'could not serialize access' USING ERRCODE = '40001';
  END IF;
  RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER lg_refuse_at_commit AFTER INSERT ON organizations
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION lg_refuse_at_commit();
"""


@pytest.mark.parametrize("path", ["transaction", "alone"])
async def test_a_commit_the_server_refuses_is_not_in_doubt(
    db: Database, migrated_pg: str, path: str
) -> None:
    """The server answered the COMMIT with an ERROR (here a serialization failure): it
    did not commit, so the 503 is the plain one, not in doubt, and no doubt listener is
    told the write may have landed (a COMMIT whose answer is lost still is in doubt:
    ``test_pg_connection_loss``)."""
    await run_sql(migrated_pg, REFUSE_AT_COMMIT)
    doubted: list[list[object]] = []
    db.on_doubt_payloads("t", doubted.append)
    with pytest.raises(Unavailable) as raised:
        if path == "transaction":
            async with db.tx() as conn:
                await conn.execute(INSERT, {"id": "refused1"})
                signal_after_commit(conn, "t", "p")
        else:
            await db.write_alone(INSERT, {"id": "refused1"}, signals=[("t", "p")])
    assert not raised.value.in_doubt
    assert doubted == []
    assert await organization_ids(db) == []


#: What the next statement sent into an aborted transaction met: PostgreSQL's
#: in_failed_sql_transaction ("current transaction is aborted, commands ignored until
#: end of transaction block"), which names the symptom, not the error.
IN_FAILED_TRANSACTION = "25P02"


def _sqlstate(exc: BaseException) -> str | None:
    orig = getattr(exc, "orig", None)
    return getattr(orig, "sqlstate", None)


async def test_the_next_statement_raises_the_error_that_aborted_the_transaction(
    db: Database,
) -> None:
    """A caller that caught a statement's error outside a savepoint and ran another
    statement met 25P02, a 500 naming the symptom: it gets the error that aborted the
    transaction (here the constraint violation), and the statement is not sent."""
    async with db.tx() as conn:
        await conn.execute(INSERT, {"id": "taken"})
    with db.record_statements() as statements, pytest.raises(sa.exc.DBAPIError) as raised:
        async with db.tx() as conn:
            try:
                await conn.execute(INSERT, {"id": "taken"})
            except sa.exc.IntegrityError:
                pass
            await conn.execute(INSERT, {"id": "o1"})
    assert isinstance(raised.value, sa.exc.IntegrityError), raised.value
    assert _sqlstate(raised.value) != IN_FAILED_TRANSACTION
    assert "was not sent" in "".join(raised.value.__notes__)
    sent = [sql for sql in statements if sql.startswith("INSERT INTO organizations")]
    assert len(sent) == 1, statements  # the first INSERT only
    assert await organization_ids(db) == ["taken"]


async def test_the_next_statement_after_a_swallowed_fault_is_a_503(db: Database) -> None:
    """The error that aborted it was a database fault (a statement cancelled): the
    transaction fails as that fault, a 503 not in doubt (it was a 500 with 25P02)."""
    with pytest.raises(Unavailable) as raised:
        async with db.tx() as conn:
            await conn.execute(INSERT, {"id": "o1"})
            await conn.execute(sa.text("SET LOCAL statement_timeout = '50ms'"))
            try:
                await conn.execute(sa.text("SELECT pg_sleep(5)"))
            except sa.exc.DBAPIError:
                pass
            await conn.execute(INSERT, {"id": "o2"})
    assert raised.value.rule == "service.unavailable" and not raised.value.in_doubt
    assert _sqlstate(raised.value.__cause__ or raised.value) != IN_FAILED_TRANSACTION
    assert await organization_ids(db) == []


async def test_a_savepoint_in_an_aborted_transaction_raises_its_error(db: Database) -> None:
    async with db.tx() as conn:
        await conn.execute(INSERT, {"id": "taken"})
    with pytest.raises(sa.exc.IntegrityError):
        async with db.tx() as conn:
            try:
                await conn.execute(INSERT, {"id": "taken"})
            except sa.exc.IntegrityError:
                pass
            async with conn.begin_nested():
                await conn.execute(INSERT, {"id": "o1"})
    assert await organization_ids(db) == ["taken"]


async def test_a_statement_after_an_error_caught_in_a_savepoint_is_undone_with_it(
    db: Database,
) -> None:
    """Caught inside the savepoint's block and followed by another statement there: that
    statement raises the block's error (not 25P02), which the caller catches outside
    the block as the error it expects; the undo takes it back and the rest commits."""
    async with db.tx() as conn:
        await conn.execute(INSERT, {"id": "taken"})
    async with db.tx() as conn:
        await conn.execute(INSERT, {"id": "o1"})
        try:
            async with conn.begin_nested():
                try:
                    await conn.execute(INSERT, {"id": "taken"})
                except sa.exc.IntegrityError:
                    pass
                await conn.execute(INSERT, {"id": "o3"})
        except sa.exc.IntegrityError:
            pass
        await conn.execute(INSERT, {"id": "o2"})
    assert await organization_ids(db) == ["o1", "o2", "taken"]
