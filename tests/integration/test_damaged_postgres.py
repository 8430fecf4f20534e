"""PostgreSQL reporting damaged data or a damaged index (SQLSTATE ``XX001``
data_corrupted, ``XX002`` index_corrupted) while the service runs: it was the driver's
error, answered as a bug (500 ``internal``, a traceback in the log per request) and
logged with a traceback by every runner pass that met it. Now it is met as a damaged
SQLite file is (tests/integration/test_damaged_database.py).

The server raises those codes here from functions installed in the test's database (a
view in place of ``messages`` whose condition raises ``XX001``; a trigger on inserting
into ``messages`` raising ``XX002``): the errors reach the service over the wire as a
damaged page or index would, without damaging a file under the shared test server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import asyncpg
import openai
import pytest
import sqlalchemy as sa
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from leadgate.app import DAMAGE_RECHECK_MS, App
from leadgate.cli.main import main
from leadgate.core.errors import DatabaseDamaged
from leadgate.database.db import DAMAGE_REPLAYS
from leadgate.database.pg import asyncpg_dsn
from leadgate.domain import workitems
from leadgate.domain.workitems import Sweeper
from leadgate.web.common import DAMAGED_ANSWERS
from tests.helpers import fake_clock, make_agent, make_org, ours
from tests.review_support import review_env
from tests.serving import Client, served_app
from tests.stack import Stack

pytestmark = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)

PAGE_TEXT = "invalid page in block 7 of relation base/16384/16402"
INDEX_TEXT = 'index "messages_session_idx" contains unexpected zero page at block 3'
PASSWORD = "not-for-the-log-7f3a"


def damage_reads(table: str) -> str:
    """Every read of ``table`` meets ``XX001``: a view in its place whose condition
    raises it (STABLE: evaluated once per statement, rows or none)."""
    return f"""
        CREATE OR REPLACE FUNCTION damaged_page() RETURNS boolean LANGUAGE plpgsql STABLE AS $$
        BEGIN
            RAISE EXCEPTION '{PAGE_TEXT}' USING ERRCODE = 'XX001';
        END $$;
        ALTER TABLE {table} RENAME TO {table}_kept;
        CREATE VIEW {table} AS SELECT * FROM {table}_kept WHERE damaged_page();
    """


def damage_inserts(table: str) -> str:
    """Every insert into ``table`` meets ``XX002`` (with PostgreSQL's hint for it)."""
    return f"""
        CREATE FUNCTION damaged_index() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION '{INDEX_TEXT}'
                USING ERRCODE = 'XX002', HINT = 'Please REINDEX it.';
        END $$;
        CREATE TRIGGER damaged_index BEFORE INSERT ON {table}
            FOR EACH ROW EXECUTE FUNCTION damaged_index();
    """


async def run_sql(url: str, sql: str) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def with_password(url: str) -> str:
    """``url`` with a password (the test server trusts its users: it is never asked
    for), to see that it stays out of the log."""
    return sa.engine.make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)


def named(url: str) -> str:
    parsed = sa.engine.make_url(url)
    return f"the PostgreSQL database {parsed.database} on {parsed.host}:{parsed.port}"


async def test_a_read_meeting_damaged_data_is_a_500_naming_the_database(
    migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    url = with_password(migrated_url)
    async with served_app(url) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        auth = {"Authorization": f"Bearer {org.key}"}
        body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
        headers = {**auth, "X-Session-Id": "s1"}
        assert (await client.post("/v1/chat/completions", json=body, headers=headers)).status == 200
        assert (await client.get("/healthz")).status == 200
        await run_sql(migrated_url, damage_reads("messages"))

        for _ in range(2):
            resp = await client.get("/v1/agents/plain/sessions/s1/messages", headers=auth)
            answer = await resp.json()
            assert resp.status == 500, answer
            error = answer["error"]
            assert (error["rule"], error["code"]) == ("database.file", "database_damaged")
            assert "restore it from a backup" in error["message"]
            assert "XX001" not in error["message"] and "base/" not in error["message"]
            assert resp.headers["x-should-retry"] == "false"
        assert client.app[DAMAGED_ANSWERS].answered == 2
        # /healthz says so from then on (its SELECT 1 reads no table).
        health = await client.get("/healthz")
        assert health.status == 500 and (await health.json())["error"]["rule"] == "database.file"

    lines = [r for r in ours(caplog) if r.levelno >= logging.ERROR]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # three answers, one line
    said = lines[0].getMessage()
    assert f"{named(migrated_url)} is damaged (SQLSTATE XX001 data_corrupted" in said
    assert PAGE_TEXT in said and "restore the damaged data from a backup" in said
    assert PASSWORD not in said
    assert not [r for r in ours(caplog) if r.exc_info], "no traceback"


async def test_a_write_meeting_a_damaged_index_is_a_500_the_client_does_not_retry(
    migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with served_app(migrated_url) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        await run_sql(migrated_url, damage_inserts("messages"))
        official = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=org.key)
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.InternalServerError) as refused:
            await official.chat.completions.create(
                model="plain", messages=messages, extra_headers={"X-Session-Id": "s1"}
            )
        assert refused.value.code == "database_damaged"
        assert client.app[DAMAGED_ANSWERS].answered == 1  # not retried
        assert service.db.damaged is not None and "XX002" in service.db.damaged

    lines = [r for r in ours(caplog) if r.levelno >= logging.ERROR]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    said = lines[0].getMessage()
    assert f"{named(migrated_url)} is damaged (SQLSTATE XX002 index_corrupted" in said
    assert INDEX_TEXT in said and "Please REINDEX it." in said
    assert not [r for r in ours(caplog) if r.exc_info], "no traceback"


async def test_storing_an_answer_under_its_idempotency_key_on_damage_is_one_line(
    migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The turn ran and its answer goes to the client; storing it under the key met
    damage: that was a WARNING with the driver's traceback per request, not counted.
    (A model failure's 502: the turn's own answers, a reply's or a gated 409, are stored
    in the turn's last transaction, where damage fails the turn as any would.)"""
    async with served_app(migrated_url) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        await run_sql(
            migrated_url,
            damage_inserts("idempotency_keys").replace("BEFORE INSERT", "BEFORE UPDATE"),
        )
        body = {"model": "plain", "messages": [{"role": "user", "content": "hi #fail"}]}
        headers = {"Authorization": f"Bearer {org.key}", "Idempotency-Key": "k1"}
        resp = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert resp.status == 502, await resp.text()
        assert client.app[DAMAGED_ANSWERS].answered == 1
    records = [r for r in ours(caplog) if r.levelno >= logging.WARNING]
    lines = [r for r in records if r.name != "leadgate.turns"]  # (the model error's own)
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR, lines
    assert "XX002 index_corrupted" in lines[0].getMessage()
    assert not [r for r in ours(caplog) if r.exc_info], "no traceback"


async def test_a_runner_meeting_damaged_data_gets_database_damaged(
    service: App, migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A runner's pass meets :class:`DatabaseDamaged`, which the runner loop logs as one
    line a minute (tests/integration/test_damaged_database.py), not the driver's error
    with a traceback per pass."""
    sweeper = Sweeper(service.db, service.clock, service.ids)
    assert await sweeper.run_once() is False
    await run_sql(migrated_url, damage_reads("work_items"))
    with pytest.raises(DatabaseDamaged) as met:
        await sweeper.run_once()
    assert f"{named(migrated_url)} is damaged (SQLSTATE XX001" in met.value.detail
    assert service.db.damaged == met.value.detail  # /healthz reports it
    assert not [r for r in ours(caplog) if r.exc_info], "no traceback"


def test_a_command_meeting_damaged_data_is_one_line_naming_the_database(
    migrated_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An admin command's own query, and ``db upgrade``'s (Alembic's engine: the
    driver's error with its SQL, exit 1), meeting damage: exit 2, one line naming the
    database and what PostgreSQL said, as for a damaged SQLite file."""
    config = tmp_path / "config.toml"
    config.write_text(f'[database]\nurl = "{with_password(migrated_url)}"\n')
    assert main(["--config", str(config), "org", "create", "acme"]) == 0
    capsys.readouterr()
    for table, command in (
        ("api_keys", ["key", "list", "--org", "acme"]),
        ("alembic_version", ["db", "upgrade"]),
    ):
        asyncio.run(run_sql(migrated_url, damage_reads(table)))
        code = main(["--config", str(config), *command])
        out, err = capsys.readouterr()
        assert (code, out) == (2, ""), err
        assert f"{named(migrated_url)} is damaged (SQLSTATE XX001 data_corrupted" in err, err
        assert err.count("\n") == 1 and err.rstrip().endswith("[database.file]"), err
        assert PASSWORD not in err and "[SQL:" not in err, err


async def test_review_cards_meeting_damaged_data_are_one_line_and_the_item_waits(
    make_stack: Callable[..., Stack], migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The cards are written in a SAVEPOINT of the item's move to awaitingHuman: meeting
    damage there was the driver's error with a traceback per item; now it is counted in
    one ERROR line a minute, and the move commits (the item waits, without cards)."""
    env = await review_env(make_stack)
    await run_sql(migrated_url, damage_reads("review_destinations"))
    items = [await env.escalated(session) for session in ("s1", "s2")]
    async with env.stack.db.read() as conn:
        for item_id in items:
            assert (await workitems.get(conn, item_id)).status == "awaitingHuman"
    assert not await env.deliveries(items[0], "card")
    lines = [r for r in ours(caplog) if r.levelno >= logging.ERROR]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # two items, one line
    said = lines[0].getMessage()
    assert said.startswith(
        f"1 review card write(s) met a damaged database (the latest: work item {items[0]})"
    )
    assert f"{named(migrated_url)} is damaged (SQLSTATE XX001" in said
    assert env.stack.outbox.cards_damaged.total == 2
    assert not [r for r in ours(caplog) if r.exc_info], "no traceback"
    assert env.stack.db.damaged is not None  # /healthz reports it


async def test_healthz_recovers_once_the_damage_is_repaired_while_it_runs(
    migrated_url: str,
) -> None:
    """/healthz answered 500 from the first damage met until every replica that met it
    restarted. Now it runs the statement that met the damage again (rolled back) at
    most every DAMAGE_RECHECK_MS: 500 while it still fails, 200 once it runs."""
    async with served_app(migrated_url) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
        headers = {"Authorization": f"Bearer {org.key}", "X-Session-Id": "s1"}
        await run_sql(migrated_url, damage_inserts("messages"))
        resp = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert resp.status == 500
        assert (await client.get("/healthz")).status == 500
        fake_clock(service).advance(DAMAGE_RECHECK_MS)
        assert (await client.get("/healthz")).status == 500  # the insert fails still

        # The operator rebuilds the index (here: the trigger raising XX002 goes).
        await run_sql(migrated_url, "DROP TRIGGER damaged_index ON messages")
        assert (await client.get("/healthz")).status == 500  # not looked again yet
        fake_clock(service).advance(DAMAGE_RECHECK_MS)
        health = await client.get("/healthz")
        assert health.status == 200, await health.text()
        async with service.db.read() as conn:  # the re-check's insert was rolled back
            count = await conn.scalar(sa.text("SELECT count(*) FROM messages"))
        assert count == 0
        resp = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert resp.status == 200, await resp.text()


#: Puts ``review_destinations`` back after :func:`damage_reads` (the data restored).
RESTORE_READS = """
    DROP VIEW review_destinations;
    ALTER TABLE review_destinations_kept RENAME TO review_destinations;
    DROP FUNCTION damaged_page();
"""


async def meet_damage(service: App, sql: str) -> None:
    """Run ``sql`` on the service's database, meeting the damage it reads."""
    with pytest.raises(DatabaseDamaged):
        async with service.db.read() as conn:
            await conn.execute(sa.text(sql))


async def health_after_a_recheck(service: App, client: Client) -> int:
    """``/healthz``'s status once its next re-check is due."""
    fake_clock(service).advance(DAMAGE_RECHECK_MS)
    return int((await client.get("/healthz")).status)


async def test_healthz_stays_500_until_every_damaged_statement_runs(migrated_url: str) -> None:
    """Two statements met damage, an insert into a damaged index and then a read of
    damaged data. The re-check ran the latest one only: once that one's data was
    restored /healthz answered 200, though the first still failed on every request.
    Now each statement that met damage runs again until it passes."""
    async with served_app(migrated_url) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
        headers = {"Authorization": f"Bearer {org.key}", "X-Session-Id": "s1"}
        await run_sql(migrated_url, damage_inserts("messages"))
        assert (await client.post("/v1/chat/completions", json=body, headers=headers)).status == 500
        await run_sql(migrated_url, damage_reads("review_destinations"))
        await meet_damage(service, "SELECT count(*) FROM review_destinations")
        assert (await client.get("/healthz")).status == 500

        await run_sql(migrated_url, RESTORE_READS)  # the latest repaired, not the first
        assert await health_after_a_recheck(service, client) == 500
        resp = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert resp.status == 500  # (indeed)
        assert await health_after_a_recheck(service, client) == 500

        await run_sql(migrated_url, "DROP TRIGGER damaged_index ON messages")
        assert await health_after_a_recheck(service, client) == 200
        resp = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert resp.status == 200, await resp.text()


async def test_healthz_keeps_damage_met_by_more_statements_than_it_reruns(
    migrated_url: str,
) -> None:
    """The re-check runs at most DAMAGE_REPLAYS distinct statements again; damage met by
    one more is reported until a restart (as damage met at COMMIT), never cleared by
    the statements it did keep passing."""
    async with served_app(migrated_url) as (service, client):
        await run_sql(migrated_url, damage_reads("review_destinations"))
        for n in range(DAMAGE_REPLAYS):
            await meet_damage(service, f"SELECT {n} FROM review_destinations")
        await meet_damage(service, "SELECT 0 FROM review_destinations")  # (the same one)
        assert await health_after_a_recheck(service, client) == 500
        await run_sql(migrated_url, RESTORE_READS)
        assert await health_after_a_recheck(service, client) == 200  # each of them runs

        await run_sql(migrated_url, damage_reads("review_destinations"))
        for n in range(DAMAGE_REPLAYS + 1):
            await meet_damage(service, f"SELECT {n} FROM review_destinations")
        await run_sql(migrated_url, RESTORE_READS)
        assert await health_after_a_recheck(service, client) == 500
        assert await health_after_a_recheck(service, client) == 500


async def test_damage_met_at_commit_is_kept_whatever_met_damage_after_it(
    migrated_url: str,
) -> None:
    """Damage met at COMMIT has no statement to run again, so it is reported until a
    restart. A statement meeting damage after it took its place in the re-check, which
    then answered 200 once that statement ran, the damage met at COMMIT untouched."""
    async with served_app(migrated_url) as (service, client):
        await run_sql(
            migrated_url,
            damage_inserts("organizations")
            .replace("CREATE TRIGGER", "CREATE CONSTRAINT TRIGGER")
            .replace("BEFORE INSERT", "AFTER INSERT")
            .replace("FOR EACH ROW", "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW"),
        )
        with pytest.raises(DatabaseDamaged):
            async with service.db.tx() as conn:
                await conn.execute(
                    sa.text("INSERT INTO organizations (id, name, created_at) VALUES ('o', 'o', 1)")
                )
        await run_sql(migrated_url, damage_reads("review_destinations"))
        await meet_damage(service, "SELECT count(*) FROM review_destinations")
        await run_sql(migrated_url, RESTORE_READS)
        assert await health_after_a_recheck(service, client) == 500
