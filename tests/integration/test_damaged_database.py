"""A damaged SQLite file met while the service runs (a valid header over broken pages:
SQLite's ``database disk image is malformed``): it was the driver's error, answered as a
bug (500 ``internal``, a traceback in the log per request) and logged with a traceback
by every runner pass that met it."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path

import httpx2
import openai
import pytest
import sqlalchemy as sa
from aiosmtpd.smtp import SMTP, Envelope, Session
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import TextContent
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from bots.email import EmailHandler
from leadgate.app import DAMAGE_RECHECK_MS, App
from leadgate.core import runners
from leadgate.core.errors import DatabaseDamaged
from leadgate.core.runners import drain, run_loop
from leadgate.core.types import BindingKind, BindingSpec, Gated, Trigger
from leadgate.database import schema as t
from leadgate.domain.workitems import Sweeper
from leadgate.flows.runs import create_flow
from leadgate.runners.recovery import TurnRecovery
from leadgate.runners.revisions import RevisionRunner
from leadgate.runners.schedules import ScheduleRunner, add_schedule
from leadgate.turns.intake import Accepted
from leadgate.web.common import DAMAGED_ANSWERS
from tests.helpers import (
    eventually,
    fake_clock,
    make_agent,
    make_org,
    make_route,
    ours,
    slack_trigger,
)
from tests.review_support import review_env
from tests.serving import served_app
from tests.stack import Stack

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


def damage_table(path: str, table: str) -> None:
    """Overwrite the root pages of ``table`` and its indexes in place, once everything
    the WAL holds is in the main file (else readers find the pages' good copies there)."""
    with sqlite3.connect(path, isolation_level=None) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        roots = conn.execute(
            "SELECT rootpage FROM sqlite_master WHERE tbl_name = ? AND rootpage > 0", (table,)
        ).fetchall()
    conn.close()
    with open(path, "r+b") as file:
        for (number,) in roots:
            file.seek((number - 1) * page)
            file.write(b"\x07" * page)


async def test_a_request_meeting_a_damaged_file_is_a_500_naming_the_rule(
    migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    caplog.set_level(logging.INFO)
    async with served_app(migrated_url) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        auth = {"Authorization": f"Bearer {org.key}"}
        page = "/v1/agents/plain/sessions/s1/messages"
        official = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=org.key)
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
        session = {"X-Session-Id": "s1"}
        await official.chat.completions.create(
            model="plain", messages=messages, extra_headers=session
        )
        assert (await client.get("/healthz")).status == 200
        damage_table(path, "messages")

        resp = await client.get(page, headers=auth)
        body = await resp.json()
        assert resp.status == 500, body
        error = body["error"]
        assert (error["rule"], error["code"], error["type"]) == (
            "database.file",
            "database_damaged",
            "server_error",
        )
        assert "restore it from a backup" in error["message"]
        assert path not in error["message"]  # the file is the operators' business
        assert resp.headers["x-should-retry"] == "false" and "Retry-After" not in resp.headers
        # The official client does not retry it (it retries a 500 twice otherwise).
        answers = client.app[DAMAGED_ANSWERS]
        before = answers.answered
        with pytest.raises(openai.InternalServerError) as refused:
            await official.chat.completions.create(
                model="plain", messages=messages, extra_headers=session
            )
        assert refused.value.code == "database_damaged"
        assert answers.answered == before + 1
        # /healthz says so from then on (its SELECT 1 reads no table's pages).
        health = await client.get("/healthz")
        assert health.status == 500 and (await health.json())["error"]["rule"] == "database.file"

    lines = [r for r in ours(caplog) if r.levelno >= logging.ERROR]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # three answers, one line
    assert f"the SQLite database {path} is damaged" in lines[0].getMessage()
    assert not [r for r in ours(caplog) if r.exc_info], "no traceback"


async def test_a_runner_meeting_a_damaged_file_logs_a_line_not_a_traceback(
    service: App, migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    sweeper = Sweeper(service.db, service.clock, service.ids)
    assert await sweeper.run_once() is False
    damage_table(path, "work_items")
    wake, stop = asyncio.Event(), asyncio.Event()
    before = runners.DAMAGED.total
    loop = asyncio.create_task(run_loop(sweeper, wake=wake, stop=stop, poll_s=60))
    await eventually(lambda: runners.DAMAGED.total > before)
    # Stopping does not wait out the back-off (the operator stops the service to
    # restore the file).
    stop.set()
    await asyncio.wait_for(loop, timeout=5)
    lines = [r for r in caplog.records if r.name == "leadgate.runners"]
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR, lines
    assert f"the SQLite database {path} is damaged" in lines[0].getMessage()
    assert "sweeper" in lines[0].getMessage() and lines[0].exc_info is None
    # /healthz of a process whose runners met it says so too.
    assert service.db.damaged is not None


async def test_a_schedule_meeting_a_damaged_file_stays_due_without_a_traceback(
    service: App, migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The scheduled turn's failure was logged with a traceback and the firing skipped
    (the schedule advanced): now the firing stays due and the runner's loop says what
    it is in one line, as for a database fault."""
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    org = await make_org(service)
    agent = await make_agent(service, org, "plain")
    async with service.db.tx() as conn:
        added = await add_schedule(
            conn,
            service.clock,
            service.ids,
            org_id=org.id,
            agent_id=agent["id"],
            cron="* * * * *",
            message="tick",
        )
        await conn.execute(t.schedules.update().values(next_fire_at=service.clock.now_ms()))
    damage_table(path, "messages")
    with pytest.raises(DatabaseDamaged):
        await ScheduleRunner(service.db, service.clock, service.turns).run_once()
    async with service.db.read() as conn:
        due = await conn.scalar(
            sa.select(t.schedules.c.next_fire_at).where(t.schedules.c.id == added["id"])
        )
    assert due == service.clock.now_ms()
    assert not [r for r in ours(caplog) if r.exc_info], "no traceback"


async def test_a_flow_node_meeting_a_damaged_file_leaves_its_run_running(
    service: App, migrated_url: str
) -> None:
    """A damaged file ended the run as failed, as if its node had broken a rule: it is
    the database's fault, not the node's, and the run stays running for recovery once
    the file is restored, as after a database fault."""
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    org = await make_org(service)
    await make_agent(service, org, "plain")
    async with service.db.tx() as conn:
        flow = await create_flow(
            conn,
            service.clock,
            service.ids,
            org.id,
            "f",
            [{"type": "agent", "agent": "plain", "prompt": "hi"}],
        )
    damage_table(path, "messages")
    with pytest.raises(DatabaseDamaged):
        await service.flows.start(org.id, flow["id"])
    async with service.db.read() as conn:
        statuses = (await conn.execute(sa.select(t.flow_runs.c.status))).scalars().all()
    assert statuses == ["running"]


async def test_a_revision_turn_meeting_a_damaged_file_is_no_traceback(
    service: App, migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The revision turn's failure was logged with a traceback on every pass: now it
    reaches the runner's loop (one line a minute), and the item's lease lapses as
    before, so a pass after the restore runs it."""
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    org = await make_org(service)
    await make_agent(service, org, "lead")
    worker = await make_agent(service, org, "worker", lead="lead")
    out = await service.turns.run(
        Trigger(org.id, worker["id"], "a", "memo #revise #complete", BindingSpec(BindingKind.api))
    )
    assert isinstance(out, Gated)
    await drain(service.lead_runner)  # changes requested: a revision turn is due
    damage_table(path, "messages")
    with pytest.raises(DatabaseDamaged):
        await RevisionRunner(service.turns).run_once()
    assert not [r for r in ours(caplog) if r.exc_info], "no traceback"


async def test_a_recovered_turn_meeting_a_damaged_file_is_no_traceback(
    service: App, migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Recovering a dead process's turn logged a traceback per pass and claimed it
    again at once, each claim an attempt (the third ends in a failure notice, for a
    file the operators had yet to restore)."""
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    org = await make_org(service)
    plain = await make_agent(service, org, "plain")
    # A process that recorded the turn and died before running it (tests/unit/test_recovery).
    service.turns.intake.owner = lambda: "prc_dead_process"
    taken = await service.turns.take(slack_trigger(org, plain, "hello", "1.1"))
    assert isinstance(taken, Accepted)
    damage_table(path, "messages")
    with pytest.raises(DatabaseDamaged):
        await TurnRecovery(service.turns).run_once()
    assert not [r for r in ours(caplog) if r.exc_info], "no traceback"


async def test_an_mcp_tool_call_meeting_a_damaged_file_is_a_tool_error_and_one_line(
    migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The tool error said so, but nothing reached the log: the operators never heard."""
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    # (The test server cancels a handler whose client went away: the MCP session's.)
    async with served_app(migrated_url, like_production=True) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        damage_table(path, "messages")
        async with (
            httpx2.AsyncClient(headers={"Authorization": f"Bearer {org.key}"}) as http,
            streamable_http_client(str(client.make_url("/mcp")), http_client=http) as (
                read,
                write,
            ),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            result = await session.call_tool(
                "send_action_agent_message", {"agent": "plain", "message": "hi"}
            )
    assert result.is_error is True
    text = result.content[0]
    assert isinstance(text, TextContent) and "restore it from a backup" in text.text
    assert path not in text.text
    lines = [r for r in ours(caplog) if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and f"the SQLite database {path} is damaged" in lines[0].getMessage()
    assert not [r for r in ours(caplog) if r.exc_info], "no traceback"


async def test_an_event_stream_meeting_a_damaged_file_ends_in_one_line(
    migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A session's event stream whose log lies on damaged pages ended with a traceback,
    each time its reader reconnected (EventSource does, every few seconds)."""
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    async with served_app(migrated_url) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        auth = {"Authorization": f"Bearer {org.key}"}
        body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
        headers = {**auth, "X-Session-Id": "s1"}
        assert (await client.post("/v1/chat/completions", json=body, headers=headers)).status == 200
        damage_table(path, "session_events")
        for _ in range(2):  # a reader reconnecting
            async with client.get("/v1/agents/plain/sessions/s1/events", headers=auth) as stream:
                assert stream.status == 200
                said = (await stream.read()).decode()
            assert said.startswith(": connected\n\nevent: end\ndata: "), said
            assert "restore it from a backup" in said and path not in said
    lines = [r for r in ours(caplog) if r.levelno >= logging.ERROR]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert f"the SQLite database {path} is damaged" in lines[0].getMessage()
    assert "/events" in lines[0].getMessage()
    assert not [r for r in ours(caplog) if r.exc_info], "no traceback"


async def test_an_mcp_resource_read_meeting_a_damaged_file_is_counted_with_the_requests(
    migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Reading a transcript resource whose messages lie on damaged pages was an MCP error
    for the client and nothing in the log; now it is counted in the one ERROR line a
    minute with the application's requests (and a tool call's), naming the file."""
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    async with served_app(migrated_url, like_production=True) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        auth = {"Authorization": f"Bearer {org.key}"}
        body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
        headers = {**auth, "X-Session-Id": "s1"}
        assert (await client.post("/v1/chat/completions", json=body, headers=headers)).status == 200
        damage_table(path, "messages")
        answers = client.app[DAMAGED_ANSWERS]
        async with (
            httpx2.AsyncClient(headers=auth) as http,
            streamable_http_client(str(client.make_url("/mcp")), http_client=http) as (
                read,
                write,
            ),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            for _ in range(2):
                with pytest.raises(MCPError) as refused:
                    await session.read_resource("leadgate://agents/plain/sessions/s1/messages")
                assert "restore it from a backup" in refused.value.error.message
                assert path not in refused.value.error.message
            assert answers.answered == 2
            result = await session.call_tool(
                "send_action_agent_message", {"agent": "plain", "message": "hi", "session": "s1"}
            )
            assert result.is_error is True
        assert answers.answered == 3  # and a tool call's, with the requests
    lines = [r for r in ours(caplog) if r.levelno >= logging.ERROR]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    said = lines[0].getMessage()
    assert f"the SQLite database {path} is damaged" in said and "/mcp" in said
    assert not [r for r in ours(caplog) if r.exc_info], "no traceback"


async def test_a_heartbeat_meeting_a_damaged_file_is_one_line_naming_it(
    service: App, migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each beat logged ``heartbeat failed: <the clients' message>``: a WARNING every
    beat, which told the operators to restore "it" without saying which file."""
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    await service.liveness.register()
    await service.beat_once()
    damage_table(path, "processes")
    for _ in range(3):
        await service.beat_once()
    lines = [r for r in caplog.records if r.name == "leadgate.app"]
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR, lines
    said = lines[0].getMessage()
    assert said.startswith("1 heartbeat(s) met a damaged database: ")
    assert f"the SQLite database {path} is damaged" in said
    assert not [r for r in ours(caplog) if r.exc_info], "no traceback"
    assert service.db.damaged is not None  # /healthz reports it


async def test_the_operator_event_stream_meeting_a_damaged_file_ends_in_one_line(
    migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The console's live stream ended with the clients' message when the change mark
    lay on damaged pages, and nothing reached the log (the console reconnects, and
    every stream ended so, unheard of)."""
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    async with served_app(migrated_url) as (service, client):
        org = await make_org(service)
        auth = {"Authorization": f"Bearer {org.key}"}
        async with client.get("/operator/events", headers=auth) as stream:
            assert stream.status == 200
            async with asyncio.timeout(15):
                while not (await stream.content.readline()).startswith(b"event: hello"):
                    pass
                damage_table(path, "audit")
                said = (await stream.read()).decode()
        assert "event: end\ndata: " in said and "restore it from a backup" in said
        assert path not in said
        assert client.app[DAMAGED_ANSWERS].answered == 1
    lines = [r for r in ours(caplog) if r.levelno >= logging.ERROR]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert f"the SQLite database {path} is damaged" in lines[0].getMessage()
    assert "/operator/events" in lines[0].getMessage()
    assert not [r for r in ours(caplog) if r.exc_info], "no traceback"


async def test_the_operator_event_stream_rechecking_its_key_on_a_damaged_file_says_so(
    migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A key re-checked on damaged pages ended the stream saying the key was not valid."""
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    config = {"api": {"events_reauth_s": 0.05}}
    async with served_app(migrated_url, config=config) as (service, client):
        org = await make_org(service)
        auth = {"Authorization": f"Bearer {org.key}"}
        async with client.get("/operator/events", headers=auth) as stream:
            async with asyncio.timeout(15):
                while not (await stream.content.readline()).startswith(b"event: hello"):
                    pass
                damage_table(path, "api_keys")
                fake_clock(service).advance(5_001)  # past the key cache's lifetime
                said = (await stream.read()).decode()
        assert "event: end\ndata: " in said and "restore it from a backup" in said, said
        assert "not valid" not in said
    lines = [r for r in ours(caplog) if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and f"the SQLite database {path} is damaged" in lines[0].getMessage()


async def test_review_cards_meeting_a_damaged_file_are_one_line_not_a_traceback(
    make_stack: Callable[..., Stack], migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The cards of an item that starts waiting for a human are written in a SAVEPOINT
    of its move: when they met damaged pages, the driver's error was logged with a
    traceback for every such item. (SQLite then refuses the move's COMMIT too: the
    runner's pass meets the damage, counted in its own line;
    tests/integration/test_damaged_postgres.py has a move that commits.)"""
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    env = await review_env(make_stack)
    damage_table(path, "review_destinations")  # what the cards are written for
    for session in ("s1", "s2"):
        with pytest.raises(DatabaseDamaged):
            await env.escalated(session)
    lines = [r for r in ours(caplog) if r.levelno >= logging.ERROR]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # two items, one line
    said = lines[0].getMessage()
    assert said.startswith("1 review card write(s) met a damaged database")
    assert f"the SQLite database {path} is damaged" in said
    assert env.stack.outbox.cards_damaged.total == 2
    assert not [r for r in ours(caplog) if r.exc_info], "no traceback"
    assert env.stack.db.damaged is not None  # /healthz reports it


async def test_an_email_route_lookup_meeting_a_damaged_file_is_451_and_one_line(
    service: App, migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The SMTP listener looks the route up at RCPT TO (and again for a From: that is
    not the envelope's sender): on damaged pages that was the driver's traceback per
    mail. Each mail is still asked to retry (451)."""
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    org = await make_org(service)
    agent = await make_agent(service, org, "plain")
    await make_route(service, org, agent["id"], "email")
    damage_table(path, "routes")
    handler = EmailHandler(service.messages)
    for _ in range(3):
        envelope = Envelope()
        envelope.mail_from = "alice@example.com"
        said = await handler.handle_RCPT(
            SMTP(handler), Session(asyncio.get_running_loop()), envelope, "bot@example.com", []
        )
        assert said.startswith("451 "), said
        assert envelope.rcpt_tos == []
    lines = [r for r in ours(caplog) if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR, [r.getMessage() for r in lines]
    said = lines[0].getMessage()
    assert said.startswith("email: 1 mail(s) met a damaged database (asked to retry, 451): ")
    assert f"the SQLite database {path} is damaged" in said
    assert not [r for r in ours(caplog) if r.exc_info], "no traceback"
    assert handler.damaged.total == 3
    assert service.db.damaged is not None  # /healthz reports it


def copy_of(path: str, copy: str) -> None:
    """``copy`` made a consistent copy of the SQLite file ``path`` (SQLite's backup,
    what ``sqlite3 FILE ".backup COPY"`` does), or ``path`` restored from it when
    called the other way round (``".restore"``: through SQLite, with its locks, so the
    service's open connections see the restored pages, not their own stale ones)."""
    with sqlite3.connect(path) as source, sqlite3.connect(copy) as target:
        source.backup(target)
    source.close()
    target.close()


async def test_healthz_recovers_once_the_damaged_file_is_restored_while_it_runs(
    migrated_url: str, tmp_path: Path
) -> None:
    """/healthz answered 500 from the first damage met until the process restarted,
    repaired or not. Now it looks again at most every DAMAGE_RECHECK_MS: still damaged
    is still 500; restored, 200 again at the next look."""
    path = migrated_url.removeprefix("sqlite+aiosqlite:///")
    backup = str(tmp_path / "backup.db")
    async with served_app(migrated_url) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        auth = {"Authorization": f"Bearer {org.key}"}
        page = "/v1/agents/plain/sessions/s1/messages"
        body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
        headers = {**auth, "X-Session-Id": "s1"}
        assert (await client.post("/v1/chat/completions", json=body, headers=headers)).status == 200
        copy_of(path, backup)
        damage_table(path, "messages")
        assert (await client.get(page, headers=auth)).status == 500
        assert (await client.get("/healthz")).status == 500  # looked: damaged

        fake_clock(service).advance(DAMAGE_RECHECK_MS)
        assert (await client.get("/healthz")).status == 500  # looked again: still

        copy_of(backup, path)
        assert (await client.get("/healthz")).status == 500  # not looked again yet
        fake_clock(service).advance(DAMAGE_RECHECK_MS - 1)
        assert (await client.get("/healthz")).status == 500
        fake_clock(service).advance(1)
        health = await client.get("/healthz")
        assert health.status == 200, await health.text()
        assert service.db.damaged is None
        resp = await client.get(page, headers=auth)
        assert resp.status == 200 and len((await resp.json())["data"]) == 2

        # Met again, it is reported again at once.
        damage_table(path, "messages")
        assert (await client.get(page, headers=auth)).status == 500
        assert (await client.get("/healthz")).status == 500
