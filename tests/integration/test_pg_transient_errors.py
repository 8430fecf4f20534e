"""PostgreSQL errors that end a statement or a transaction for a passing reason, met by a
REST turn and by a runner (README, Reliability and security: "Faults answer 503").

Operators set ``statement_timeout`` and ``lock_timeout`` on a role or the server, and
PostgreSQL ends a deadlock's victim (``40P01``) and a transaction it cannot serialize
(``40001``) itself: each was the driver's error, a 500 ``internal`` with a traceback
(a runner's pass: its traceback), where the same request a moment later goes through.
Each is now a database fault: 503 ``service.unavailable`` with ``Retry-After``, nothing
stored, and the next request after the condition clears is answered.

The timeouts are real (set on the test's database, a 1 s statement made to sleep, a
table lock held from a second connection); the deadlock and the serialization failure
are raised by a trigger with their SQLSTATE, as the server sends them. A genuine
statement error raised the same way (a check constraint's) stays a 500.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import asyncpg
import pytest
import sqlalchemy as sa

from leadgate.core.errors import Unavailable
from leadgate.database.pg import asyncpg_dsn
from leadgate.domain.workitems import Sweeper
from tests.helpers import make_agent, make_org, ours
from tests.integration.test_damaged_postgres import run_sql
from tests.serving import Client, served_app

pytestmark = [
    pytest.mark.parametrize("db_url", ["postgres"], indirect=True),
    pytest.mark.timeout(60),
]

BODY = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}


def database_of(url: str) -> str:
    name = sa.engine.make_url(url).database
    assert name is not None
    return name


def raising(sqlstate: str) -> str:
    """Every insert into ``messages`` fails with ``sqlstate`` (a trigger's RAISE)."""
    return f"""
        CREATE FUNCTION fails() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'raised by the test' USING ERRCODE = '{sqlstate}';
        END $$;
        CREATE TRIGGER fails BEFORE INSERT ON messages FOR EACH ROW EXECUTE FUNCTION fails();
    """


SLOW_INSERTS = """
    CREATE FUNCTION fails() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_sleep(5);
        RETURN NEW;
    END $$;
    CREATE TRIGGER fails BEFORE INSERT ON messages FOR EACH ROW EXECUTE FUNCTION fails();
"""
CLEARED = "DROP TRIGGER fails ON messages"


async def stored(url: str) -> tuple[int, int]:
    """How many messages and turn runs the database holds."""
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        messages = await conn.fetchval("SELECT count(*) FROM messages")
        runs = await conn.fetchval("SELECT count(*) FROM turn_runs")
        return int(messages), int(runs)
    finally:
        await conn.close()


async def turn(client: Client, key: str) -> tuple[int, str | None, dict[str, object]]:
    """A chat completion: its status, ``Retry-After`` and body."""
    headers = {"Authorization": f"Bearer {key}", "X-Session-Id": "s1"}
    resp = await client.post("/v1/chat/completions", json=BODY, headers=headers)
    async with resp:
        return resp.status, resp.headers.get("Retry-After"), json.loads(await resp.text())


async def refused_then_answered(
    url: str, caplog: pytest.LogCaptureFixture, *, meet: str, clear: str
) -> None:
    """A turn while ``meet`` (SQL run before it) holds is a 503 naming the rule with
    ``Retry-After`` and leaves nothing; after ``clear`` the same request is answered."""
    async with served_app(url) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        await run_sql(url, meet)
        status, retry, body = await turn(client, org.key)
        assert status == 503, body
        assert retry is not None and retry.isdigit(), retry
        error = body["error"]
        assert isinstance(error, dict) and error["rule"] == "service.unavailable", body
        assert "raised by the test" not in json.dumps(body)  # the server's text stays out
        assert await stored(url) == (0, 0)
        await run_sql(url, clear)
        status, _, body = await turn(client, org.key)
        assert status == 200, body
        assert (await stored(url))[0] == 2
    assert not [r for r in ours(caplog) if r.exc_info], "no traceback"


async def test_a_turn_past_statement_timeout_is_a_503_then_answered(
    migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``statement_timeout`` (SQLSTATE 57014 query_canceled), set on the database as an
    operator sets it on the service's role."""
    await run_sql(
        migrated_url, f"ALTER DATABASE {database_of(migrated_url)} SET statement_timeout = '1s'"
    )
    await refused_then_answered(migrated_url, caplog, meet=SLOW_INSERTS, clear=CLEARED)


async def test_a_turn_past_lock_timeout_is_a_503_then_answered(
    migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``lock_timeout`` (SQLSTATE 55P03 lock_not_available): another session holds a
    lock the turn's insert waits for."""
    await run_sql(
        migrated_url, f"ALTER DATABASE {database_of(migrated_url)} SET lock_timeout = '200ms'"
    )
    holder = await asyncpg.connect(asyncpg_dsn(migrated_url))
    try:
        async with served_app(migrated_url) as (service, client):
            org = await make_org(service)
            await make_agent(service, org, "plain")
            await holder.execute("BEGIN; LOCK TABLE messages IN SHARE MODE")
            status, retry, body = await turn(client, org.key)
            assert status == 503, body
            assert retry is not None and retry.isdigit(), retry
            error = body["error"]
            assert isinstance(error, dict) and error["rule"] == "service.unavailable", body
            await holder.execute("ROLLBACK")
            assert await stored(migrated_url) == (0, 0)
            status, _, body = await turn(client, org.key)
            assert status == 200, body
    finally:
        await holder.close()
    assert not [r for r in ours(caplog) if r.exc_info], "no traceback"


@pytest.mark.parametrize("sqlstate", ["40P01", "40001"], ids=["deadlock", "serialization"])
async def test_a_turn_meeting_a_retryable_transaction_error_is_a_503_then_answered(
    migrated_url: str, caplog: pytest.LogCaptureFixture, sqlstate: str
) -> None:
    await refused_then_answered(migrated_url, caplog, meet=raising(sqlstate), clear=CLEARED)


async def test_a_genuine_statement_error_stays_a_500(migrated_url: str) -> None:
    """A check constraint's violation (23514) is the statement's own error, not the
    database's state: no retry makes it pass."""
    async with served_app(migrated_url) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        await run_sql(migrated_url, raising("23514"))
        status, retry, body = await turn(client, org.key)
        assert status == 500 and retry is None, body


@pytest.fixture
async def locked_work_items(migrated_url: str) -> AsyncIterator[None]:
    """``work_items`` locked by another session, past the database's ``lock_timeout``."""
    await run_sql(
        migrated_url, f"ALTER DATABASE {database_of(migrated_url)} SET lock_timeout = '200ms'"
    )
    holder = await asyncpg.connect(asyncpg_dsn(migrated_url))
    try:
        await holder.execute("BEGIN; LOCK TABLE work_items IN ACCESS EXCLUSIVE MODE")
        yield
    finally:
        await holder.close()


async def test_a_runner_past_lock_timeout_meets_a_database_fault(
    migrated_url: str, locked_work_items: None
) -> None:
    """What a runner's loop logs as one WARNING naming the rule and backs off from
    (it was the driver's error, logged with a traceback per pass)."""
    from leadgate.app import App
    from leadgate.core.clock import FakeClock
    from leadgate.core.config import Settings

    settings = Settings.model_validate({"database": {"url": migrated_url}})
    service = App(settings, clock=FakeClock(), enable_adapters=False)
    try:
        sweeper = Sweeper(service.db, service.clock, service.ids)
        with pytest.raises(Unavailable) as met:
            await sweeper.run_once()
        assert met.value.rule == "service.unavailable" and not met.value.in_doubt
        assert "lock timeout" in met.value.detail
    finally:
        await service.stop()
