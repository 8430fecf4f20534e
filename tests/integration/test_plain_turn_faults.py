"""A plain worker's (no lead) REST, MCP and Studio turn that meets a database fault
after its message was taken in, through the real app on 127.0.0.1 and the official
``openai`` and ``mcp`` clients, on both backends. The fault is a real statement fault
(:mod:`tests.statement_faults`) at the statement that stores the reply.

Its client is told 503 ``turn.interrupted`` ("do not send it again"). Such a turn
records no run (a plain chat message has only its transcript row), so turn recovery,
which claims recorded runs only, had nothing to rerun: nobody ever answered the
message. The process now owes it: once the database is back its own turn recovery
records a run for it and reruns it, answering into the transcript once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx2
import openai
import pytest
import sqlalchemy as sa
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp_types import TextContent
from openai import AsyncOpenAI

from leadgate.app import App
from leadgate.core.clock import FakeClock
from leadgate.core.errors import Unavailable
from leadgate.core.runners import drain
from leadgate.database import schema as t
from leadgate.database.db import Database
from leadgate.runners.recovery import TurnRecovery
from leadgate.turns import runs
from leadgate.turns.providers.base import Provider
from leadgate.turns.providers.openai import OpenAIProvider
from leadgate.turns.providers.script import ScriptProvider
from tests.fakes import FaultProvider, GateProvider, LandsLater
from tests.helpers import eventually, make_agent, make_org, stops_beating
from tests.serving import Client, served_app
from tests.standins.model_server import ModelServer
from tests.statement_faults import PgFaults, SqliteFaults, injector

#: The session's exchange before the fault (see :func:`arm`).
EARLIER = [("user", "first"), ("assistant", "Echo: first")]
#: The reply's statement: the second message insert after the fault is armed (the
#: first is the intake's user message).
REPLY = "INSERT INTO messages"


@asynccontextmanager
async def faulted(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[App, Client, SqliteFaults | PgFaults, str]]:
    """The app on ``url`` with a plain worker ``plain`` (the script model, which
    answers ``Echo: <message>``), its client, the fault injector, and an API key."""
    faults = injector(url, monkeypatch)
    providers: dict[str, Provider] = {"script": ScriptProvider(), "fault": FaultProvider()}
    async with served_app(url, providers=providers, like_production=True) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        # (its model meets the fault: FaultProvider)
        await make_agent(service, org, "faulty", model="fault")
        yield service, client, faults, org.key


async def arm(
    faults: SqliteFaults | PgFaults, client: Client, key: str, session: str, *, studio: bool = False
) -> None:
    """Fail the reply's statement in ``session`` (the message was taken in by then).
    The session is opened first by an exchange (:data:`EARLIER`): a new session's
    intake is two statements on PostgreSQL (the plain one finds no session), one
    otherwise. Through Studio for a Studio turn (its binding then unchanged)."""
    headers = {"Authorization": f"Bearer {key}", "X-Session-Id": session}
    if studio:
        page = f"/console/studio/agents/plain/sessions/{session}/messages"
        first = await client.post(page, json={"message": "first"}, headers=headers)
    else:
        body = {"model": "plain", "messages": [{"role": "user", "content": "first"}]}
        first = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert first.status == 200, await first.text()
    faults.arm_on(REPLY, then=REPLY)


async def transcript(service: App, key: str) -> tuple[list[tuple[str, str]], int]:
    """The messages of the session whose key is ``key`` (role, content), and the
    recorded runs left."""
    async with service.db.read() as conn:
        rows = (
            await conn.execute(
                sa.select(t.messages.c.role, t.messages.c.content)
                .select_from(
                    t.messages.join(t.sessions, t.sessions.c.id == t.messages.c.session_id)
                )
                .where(t.sessions.c.key == f"h:{key}")
                .order_by(t.messages.c.created_at, t.messages.c.id)
            )
        ).all()
        left = await conn.scalar(sa.select(sa.func.count()).select_from(t.turn_runs))
    return [(r.role, r.content) for r in rows], int(left or 0)


async def answered_once(service: App, key: str, text: str) -> None:
    """Before recovery: the message alone. Recovery (this process's own) answers it
    once, and nothing is left for a second pass."""
    assert await transcript(service, key) == ([*EARLIER, ("user", text)], 0)
    assert await drain(TurnRecovery(service.turns)) == 1
    answered = [*EARLIER, ("user", text), ("assistant", f"Echo: {text}")]
    assert await transcript(service, key) == (answered, 0)
    assert await drain(TurnRecovery(service.turns)) == 0


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_a_plain_rest_turn_cut_by_a_fault_is_answered_once_the_database_is_back(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, streamed: bool
) -> None:
    """The official client is told 503 ``turn.interrupted`` (a stream: its one error
    frame) and sends nothing again; the answer comes into the transcript once."""
    async with faulted(migrated_url, monkeypatch) as (service, client, faults, key):
        official = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key)
        session = {"X-Session-Id": "s"}
        await arm(faults, client, key, "s")
        with pytest.raises(openai.APIError) as told:
            if streamed:
                stream = await official.chat.completions.create(
                    model="plain",
                    messages=[{"role": "user", "content": "hi"}],
                    extra_headers=session,
                    stream=True,
                )
                async for _ in stream:
                    pass
            else:
                await official.chat.completions.create(
                    model="plain",
                    messages=[{"role": "user", "content": "hi"}],
                    extra_headers=session,
                )
        faults.disarm()
        assert faults.fired is not None and REPLY in faults.fired
        assert "turn.interrupted" in str(told.value.body)
        await answered_once(service, "s", "hi")


async def test_a_keyed_plain_rest_turn_cut_by_a_fault_replays_the_reruns_answer(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under an ``Idempotency-Key`` the retry got ``turn.interrupted`` for ever; it
    now gets the rerun's answer (stored under the key in the rerun's last transaction)."""
    async with faulted(migrated_url, monkeypatch) as (service, client, faults, key):
        headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": "k", "X-Session-Id": "s"}
        body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
        await arm(faults, client, key, "s")
        told = await client.post("/v1/chat/completions", json=body, headers=headers)
        faults.disarm()
        assert told.status == 503
        assert (await told.json())["error"]["rule"] == "turn.interrupted"
        await answered_once(service, "s", "hi")
        retry = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert retry.status == 200 and retry.headers["Idempotent-Replayed"] == "true"
        assert (await retry.json())["choices"][0]["message"]["content"] == "Echo: hi"
        answered = [*EARLIER, ("user", "hi"), ("assistant", "Echo: hi")]
        assert await transcript(service, "s") == (answered, 0)


async def test_a_plain_mcp_turn_cut_by_a_fault_is_answered_once_the_database_is_back(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tool error names ``turn.interrupted``; the answer comes into the transcript
    once."""
    async with (
        faulted(migrated_url, monkeypatch) as (service, client, faults, key),
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as http,
        streamable_http_client(str(client.make_url("/mcp")), http_client=http) as streams,
        ClientSession(*streams) as session,
    ):
        await session.initialize()
        await arm(faults, client, key, "m")
        told = await session.call_tool(
            "send_action_agent_message", {"agent": "plain", "message": "hi", "session": "m"}
        )
        faults.disarm()
        assert told.is_error is True and told.meta is not None
        assert told.meta["rule"] == "turn.interrupted"
        [block] = told.content
        assert isinstance(block, TextContent) and "Do not send it again" in block.text
        await answered_once(service, "m", "hi")


async def test_a_plain_studio_turn_cut_by_a_fault_is_answered_once_the_database_is_back(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Studio's 503 ``turn.interrupted`` (the page keeps the box empty); the answer
    comes into the transcript once, where the page shows it from the events stream."""
    async with faulted(migrated_url, monkeypatch) as (service, client, faults, key):
        await arm(faults, client, key, "st", studio=True)
        told = await client.post(
            "/console/studio/agents/plain/sessions/st/messages",
            json={"message": "hi"},
            headers={"Authorization": f"Bearer {key}"},
        )
        faults.disarm()
        assert told.status == 503
        assert (await told.json())["error"]["rule"] == "turn.interrupted"
        await answered_once(service, "st", "hi")


async def test_a_rerun_whose_model_fails_stores_the_failure_notice_as_the_answer(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plain turn's rerun fails (the model): nobody waits for it and nobody sends
    the message again, so the failure notice is stored as the session's answer, and a
    keyed request's retry gets the model's 502 instead of ``turn.interrupted``."""
    async with faulted(migrated_url, monkeypatch) as (service, client, _, key):
        headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": "k", "X-Session-Id": "f"}
        body = {"model": "faulty", "messages": [{"role": "user", "content": "fails later"}]}
        told = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert told.status == 503
        assert (await told.json())["error"]["rule"] == "turn.interrupted"
        assert await drain(TurnRecovery(service.turns)) == 1
        notice = [("user", "fails later"), ("assistant", runs.FAILURE_NOTICE)]
        assert await transcript(service, "f") == (notice, 0)
        retry = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert retry.status == 502 and retry.headers["Idempotent-Replayed"] == "true"
        assert (await retry.json())["error"]["rule"] == "model.failed"


#: The read-back of an intake in doubt (leadgate.turns.intake._LANDED).
READ_BACK = "FROM messages LEFT OUTER JOIN bindings"


@pytest.mark.parametrize("surface", ["mcp", "studio"])
async def test_an_intake_in_doubt_tells_mcp_and_studio_what_is_true_for_them(
    migrated_pg: str, monkeypatch: pytest.MonkeyPatch, surface: str
) -> None:
    """PostgreSQL: an intake whose one statement landed with its answer lost and whose
    read-back failed too is ``intake.in_doubt``. Its text offered "a retry with the
    same Idempotency-Key is safe" to MCP and Studio clients too, which have no such
    header; each is now told where it looks for the message instead."""
    async with faulted(migrated_pg, monkeypatch) as (_, client, faults, key):
        faults.arm_on("WITH new_session", after_commit=True, and_on=READ_BACK)
        if surface == "mcp":
            async with (
                httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as http,
                streamable_http_client(str(client.make_url("/mcp")), http_client=http) as io,
                ClientSession(*io) as session,
            ):
                await session.initialize()
                result = await session.call_tool(
                    "send_action_agent_message", {"agent": "plain", "message": "hi"}
                )
            assert result.is_error is True and result.meta == {"rule": "intake.in_doubt"}
            [block] = result.content
            assert isinstance(block, TextContent)
            text = block.text
            where = "leadgate://agents/{agent}/sessions/{session}/messages"
        else:
            told = await client.post(
                "/console/studio/agents/plain/sessions/st/messages",
                json={"message": "hi"},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert told.status == 503 and told.headers["x-should-retry"] == "false"
            error = (await told.json())["error"]
            assert error["rule"] == "intake.in_doubt"
            text = error["message"]
            where = "reload the page"
        faults.disarm()
        assert faults.fired is not None
        assert "may have been taken in" in text and where in text, text
        assert "Idempotency-Key" not in text


@pytest.mark.parametrize(
    ("landed", "db_url"),
    [
        (False, "sqlite"),
        (False, "postgres"),
        # (A SQLite COMMIT's answer cannot be lost.)
        (True, "postgres"),
    ],
    indirect=["db_url"],
    ids=["refused-sqlite", "refused-postgres", "landed-postgres"],
)
async def test_a_run_owed_while_the_database_is_still_away_is_recorded_at_a_later_pass(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, landed: bool
) -> None:
    """The first recovery pass meets the database still away as it records the owed
    run (``landed``, PostgreSQL: its ``COMMIT`` reached the server and the answer was
    lost): the run stays owed, and a later pass (an ``api`` process's own loop:
    ``own_only``) records it, not twice, and reruns it once."""
    async with faulted(migrated_url, monkeypatch) as (service, client, faults, key):
        headers = {"Authorization": f"Bearer {key}", "X-Session-Id": "s"}
        body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
        await arm(faults, client, key, "s")
        told = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert told.status == 503
        assert (await told.json())["error"]["rule"] == "turn.interrupted"
        assert len(service.turns.owed) == 1
        if landed:
            faults.arm_on("INSERT INTO turn_runs", then="COMMIT", after_commit=True)
        else:
            faults.arm_on("INSERT INTO turn_runs")
        recovery = TurnRecovery(service.turns, own_only=True)
        with pytest.raises(Unavailable):
            await recovery.run_once()
        faults.disarm()
        assert faults.fired is not None
        assert len(service.turns.owed) == 1 and not service.turns.orphans
        assert await transcript(service, "s") == ([*EARLIER, ("user", "hi")], int(landed))
        assert await drain(recovery) == 1
        answered = [*EARLIER, ("user", "hi"), ("assistant", "Echo: hi")]
        assert await transcript(service, "s") == (answered, 0)
        assert not service.turns.owed and await drain(recovery) == 0


async def _owed(service: App, client: Client, faults: SqliteFaults | PgFaults, key: str) -> None:
    """A plain REST turn in session ``s`` cut by a fault: 503 ``turn.interrupted``, its
    run owed by the process (the fault disarmed)."""
    headers = {"Authorization": f"Bearer {key}", "X-Session-Id": "s"}
    body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
    await arm(faults, client, key, "s")
    told = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert told.status == 503
    assert (await told.json())["error"]["rule"] == "turn.interrupted"
    faults.disarm()
    assert len(service.turns.owed) == 1


async def _follow_up(client: Client, key: str) -> list[tuple[str, str]]:
    """The client's next message in session ``s`` after :func:`_owed`'s, answered (200):
    the transcript the session then shows (the cut ``hi`` unanswered before it)."""
    headers = {"Authorization": f"Bearer {key}", "X-Session-Id": "s"}
    body = {"model": "plain", "messages": [{"role": "user", "content": "next"}]}
    later = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert later.status == 200, await later.text()
    return [*EARLIER, ("user", "hi"), ("user", "next"), ("assistant", "Echo: next")]


async def _runs_left(url: str) -> list[str | None]:
    """The lease owners of the recorded runs, read after the service stopped."""
    db = Database(url)
    try:
        async with db.read() as conn:
            return list((await conn.execute(sa.select(t.turn_runs.c.lease_owner))).scalars())
    finally:
        await db.close()


async def test_a_graceful_stop_records_the_runs_it_owes(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process stopped (SIGTERM) with an owed run, the database back: the run is
    recorded as it stops, under this process, which then unregisters, so a worker's
    turn recovery reruns it. It was dropped with the process's memory, unanswered."""
    async with faulted(migrated_url, monkeypatch) as (service, client, faults, key):
        await _owed(service, client, faults, key)
        owner = service.turns.owner()
        await service.stop()
        assert not service.turns.owed
    assert await _runs_left(migrated_url) == [owner]


async def test_a_stop_with_the_database_away_names_the_owed_runs_it_drops(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Stopped while the database is still away, the owed run cannot be recorded: one
    WARNING says how many messages stay unanswered (nothing said it before)."""
    async with faulted(migrated_url, monkeypatch) as (service, client, faults, key):
        await _owed(service, client, faults, key)
        faults.arm_on("INSERT INTO turn_runs")
        with caplog.at_level(logging.WARNING, logger="leadgate"):
            await service.stop()
        faults.disarm()
    said = [r.getMessage() for r in caplog.records if "owed turn" in r.getMessage()]
    assert len(said) == 1 and "stopping with 1 owed turn(s) not recorded" in said[0]
    assert await _runs_left(migrated_url) == []


async def test_an_owed_run_that_cannot_be_recorded_for_another_reason_is_given_up(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The record failing for a reason that is no database fault (a bug, a row the
    database refuses) gives that run up with one ERROR: it raised out of every recovery
    pass, for ever, before the pass's claims (every other run this process left to
    recovery stayed unrecovered)."""
    async with faulted(migrated_url, monkeypatch) as (service, client, faults, key):
        await _owed(service, client, faults, key)
        faults.arm_on("INSERT INTO turn_runs", error=lambda: ValueError("a bug"))
        recovery = TurnRecovery(service.turns, own_only=True)
        with caplog.at_level(logging.ERROR, logger="leadgate"):
            assert await recovery.run_once() is False
        faults.disarm()
        assert not service.turns.owed and not service.turns.orphans
        said = [r for r in caplog.records if "could not record the owed run" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.ERROR
        assert await drain(recovery) == 0


@pytest.mark.parametrize("gap_ms", [1_000, 0], ids=["later-ms", "same-ms"])
async def test_an_owed_run_whose_session_took_a_follow_up_is_not_rerun(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, gap_ms: int
) -> None:
    """The database back, the client sends its next message before the owed run is
    recorded: that message's turn sees the cut one in its history and answers. The owed
    run is then dropped, not recorded and rerun: its rerun, shown the whole session,
    answered the follow-up a second time. A follow-up in the same millisecond
    (``gap_ms`` 0) is a later message too: their timestamps were compared, strictly,
    and it was missed (answered twice)."""
    async with faulted(migrated_url, monkeypatch) as (service, client, faults, key):
        await _owed(service, client, faults, key)
        assert isinstance(service.clock, FakeClock)
        service.clock.advance(gap_ms)
        answered = await _follow_up(client, key)
        assert await transcript(service, "s") == (answered, 0)
        assert await drain(TurnRecovery(service.turns, own_only=True)) == 0
        assert not service.turns.owed and not service.turns.orphans
        assert await transcript(service, "s") == (answered, 0)


async def test_an_owed_run_is_rerun_by_its_own_process_not_by_another_replicas_recovery(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recorded by an ``api`` process's own recovery, the owed run is leased to that
    live process: a worker replica's turn recovery, running beside it, does not claim
    it, and the api process's reruns it once (found sound)."""
    async with faulted(migrated_url, monkeypatch) as (service, client, faults, key):
        await service.start_liveness("api")
        assert isinstance(service.clock, FakeClock)
        async with served_app(migrated_url, clock=service.clock) as (worker, _client):
            await worker.start_liveness("worker")
            await _owed(service, client, faults, key)
            await service.turns.record_owed()
            assert await _runs_left(migrated_url) == [service.turns.owner()]
            assert await drain(TurnRecovery(worker.turns)) == 0
            assert await drain(TurnRecovery(service.turns, own_only=True)) == 1
            answered = [*EARLIER, ("user", "hi"), ("assistant", "Echo: hi")]
            assert await transcript(service, "s") == (answered, 0)
            assert await drain(TurnRecovery(worker.turns)) == 0


async def _reaped_and_rerun(service: App, worker: App) -> TurnRecovery:
    """``service``, owing its turn, stops beating and ``worker`` reaps it: the worker's
    turn recovery records the owed message's run, waits for a resend and reruns it,
    answering it once. That recovery, for what the test checks after."""
    assert isinstance(service.clock, FakeClock)
    await stops_beating(worker, worker.liveness.dead_after_ms, service.liveness.id)
    assert await worker.liveness.reap() == 1
    recovery = TurnRecovery(worker.turns)
    assert await drain(recovery) == 1  # recorded, left to wait for a resend
    service.clock.advance(runs.RESEND_GRACE_MS + 1)
    assert await drain(recovery) == 1  # rerun: answered
    answered = [*EARLIER, ("user", "hi"), ("assistant", "Echo: hi")]
    assert await transcript(service, "s") == (answered, 0)
    return recovery


async def test_an_owed_run_of_a_process_reaped_meanwhile_is_answered_once(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process owing the run is alive but thought dead (its heartbeat lapsed while
    the database was away) and reaped: the worker's turn recovery records the message's
    run (under the owed run's id), reruns it after the resend wait and deletes it. The
    process, back (registered anew), then records what it owes: not again, the rerun's
    answer is after its message. It was recorded (only a later user message stopped
    it) and the message answered a second time."""
    async with faulted(migrated_url, monkeypatch) as (service, client, faults, key):
        await service.start_liveness("api")
        assert isinstance(service.clock, FakeClock)
        async with served_app(migrated_url, clock=service.clock) as (worker, _client):
            await worker.start_liveness("worker")
            await _owed(service, client, faults, key)
            recovery = await _reaped_and_rerun(service, worker)
            answered = [*EARLIER, ("user", "hi"), ("assistant", "Echo: hi")]
            await service.liveness.beat()  # its row gone: registered anew
            await service.turns.record_owed()
            assert not service.turns.owed and not service.turns.orphans
            assert await drain(TurnRecovery(service.turns, own_only=True)) == 0
            assert await drain(recovery) == 0
            assert await transcript(service, "s") == (answered, 0)


async def test_a_run_owed_longer_than_a_run_lease_by_a_process_that_died_is_answered_once(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process owes the run (not recorded yet: the database flapping), its beats
    going on for 20 minutes, and dies: the search of its messages reaches back to the
    owed turn (each beat names the oldest turn it has in flight or owes), not only to
    its last beat less 15 minutes, and the worker's turn recovery answers it once (it
    was never found: the debt died with the process)."""
    async with faulted(migrated_url, monkeypatch) as (service, client, faults, key):
        await service.start_liveness("api")
        assert isinstance(service.clock, FakeClock)
        async with served_app(migrated_url, clock=service.clock) as (worker, _client):
            await worker.start_liveness("worker")
            await _owed(service, client, faults, key)
            service.clock.advance(runs.RUN_LEASE_MS + 5 * 60_000)
            await service.liveness.beat()
            await _reaped_and_rerun(service, worker)


async def test_a_keyed_retry_while_its_run_is_owed_runs_no_second_turn(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key's retry, sent once the database is back but before the owed run is
    recorded, gets the stored 503 ``turn.interrupted`` again (no run to take over, the
    message a duplicate): no second turn. The rerun then answers once and the next
    retry gets its answer (found sound)."""
    async with faulted(migrated_url, monkeypatch) as (service, client, faults, key):
        headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": "k", "X-Session-Id": "s"}
        body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
        await arm(faults, client, key, "s")
        told = await client.post("/v1/chat/completions", json=body, headers=headers)
        faults.disarm()
        assert told.status == 503 and len(service.turns.owed) == 1
        early = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert early.status == 503 and early.headers["Idempotent-Replayed"] == "true"
        assert (await early.json())["error"]["rule"] == "turn.interrupted"
        await answered_once(service, "s", "hi")
        retry = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert retry.status == 200 and retry.headers["Idempotent-Replayed"] == "true"
        assert (await retry.json())["choices"][0]["message"]["content"] == "Echo: hi"


async def test_a_follow_up_after_the_owed_run_was_recorded_is_answered_once(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owed run recorded, the client's next message comes before turn recovery
    claims it: that message's turn answers (the cut one in its history), and the rerun,
    shown the whole session, answered the follow-up a second time. It now ends without
    an answer, its run closed."""
    async with faulted(migrated_url, monkeypatch) as (service, client, faults, key):
        await _owed(service, client, faults, key)
        await service.turns.record_owed()
        assert service.turns.orphans and not service.turns.owed
        answered = await _follow_up(client, key)
        assert await transcript(service, "s") == (answered, 1)
        assert await drain(TurnRecovery(service.turns, own_only=True)) == 1
        assert await transcript(service, "s") == (answered, 0)
        assert not service.turns.orphans


async def test_a_rerun_a_later_message_answers_does_not_call_the_model(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owed run recorded and the client's next message answered before turn
    recovery claims the run: the rerun ends without an answer, and now without calling
    the model first (the stand-in model server counts its requests). It called it and
    dropped the answer: the call's cost spent, and a tool with effects run, for nothing."""
    faults = injector(migrated_url, monkeypatch)
    async with ModelServer(api_key="sk-standin", empty_reply="echo") as model:
        remote = OpenAIProvider(
            base_url=model.base_url, api_key="sk-standin", model="standin-model", max_retries=0
        )
        async with served_app(migrated_url, providers={"remote": remote}, like_production=True) as (
            service,
            client,
        ):
            org = await make_org(service)
            await make_agent(service, org, "plain", model="remote")
            await _owed(service, client, faults, org.key)
            await service.turns.record_owed()
            answered = await _follow_up(client, org.key)
            # (first, the cut hi, next)
            assert len(model.requests) == 3
            assert await drain(TurnRecovery(service.turns, own_only=True)) == 1
            assert len(model.requests) == 3
            assert await transcript(service, "s") == (answered, 0)
            assert not service.turns.orphans


async def test_a_reruns_look_for_a_later_message_takes_no_transaction_of_its_own(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owed run recorded and no later message: its rerun looks for one before the
    model call in the read that loads its turn (one statement), and answers. The look
    was a write transaction of its own (SQLite: the writer's lock taken for a read;
    PostgreSQL: BEGIN, SELECT, COMMIT, two round trips more): a rerun now writes in
    two transactions, its claim and its last one."""
    async with faulted(migrated_url, monkeypatch) as (service, client, faults, key):
        await _owed(service, client, faults, key)
        await service.turns.record_owed()
        with service.db.record_statements() as statements:
            assert await drain(TurnRecovery(service.turns, own_only=True)) == 1
        answered = [*EARLIER, ("user", "hi"), ("assistant", "Echo: hi")]
        assert await transcript(service, "s") == (answered, 0)
        looks = [sql for sql in statements if "FROM session_events AS later" in sql]
        # (before the model call, and again in the last transaction)
        assert len(looks) == 2, statements
        writes = "BEGIN" if service.db.is_postgres else "BEGIN IMMEDIATE"
        assert statements.count(writes) == 2, statements
        if service.db.is_postgres:  # (every statement, BEGIN and COMMIT a round trip)
            assert len(statements) <= 16, statements


async def test_an_owed_run_given_up_after_a_follow_up_stores_no_failure_notice(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owed run recorded, its attempts spent (its reruns' processes died: the row's
    count says so), and the client's next message answered before turn recovery claims
    it: the claim gives the run up, and the follow-up's turn answered the session. The
    give-up stored the failure notice after that answer all the same, telling the
    person their message went unanswered; it now closes the run without a notice."""
    async with faulted(migrated_url, monkeypatch) as (service, client, faults, key):
        await _owed(service, client, faults, key)
        await service.turns.record_owed()
        async with service.db.tx() as conn:
            await conn.execute(sa.update(t.turn_runs).values(attempts=runs.MAX_ATTEMPTS))
        answered = await _follow_up(client, key)
        assert await drain(TurnRecovery(service.turns, own_only=True)) == 1
        assert await transcript(service, "s") == (answered, 0)
        assert not service.turns.orphans


async def test_a_follow_up_while_the_owed_run_is_rerun_is_answered_once(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's next message comes while the owed run's rerun waits for its model:
    its turn is shown the cut message unanswered and answers the session, and the rerun
    answered that message too (two answers). The rerun now ends without one."""
    gate = GateProvider()
    faults = injector(migrated_url, monkeypatch)
    providers: dict[str, Provider] = {"gate": gate}
    async with served_app(migrated_url, providers=providers, like_production=True) as (
        service,
        client,
    ):
        org = await make_org(service)
        await make_agent(service, org, "slow", model="gate")
        headers = {"Authorization": f"Bearer {org.key}", "X-Session-Id": "g"}

        def body(text: str) -> dict[str, object]:
            return {"model": "slow", "messages": [{"role": "user", "content": text}]}

        gate.release.set()
        first = await client.post("/v1/chat/completions", json=body("first"), headers=headers)
        assert first.status == 200, await first.text()
        faults.arm_on(REPLY, then=REPLY)
        told = await client.post("/v1/chat/completions", json=body("hi"), headers=headers)
        faults.disarm()
        assert told.status == 503 and len(service.turns.owed) == 1
        gate.release.clear()
        rerun = asyncio.create_task(drain(TurnRecovery(service.turns, own_only=True)))
        await eventually(lambda: gate.calls == 3, what="the rerun's model call")
        later = asyncio.create_task(
            client.post("/v1/chat/completions", json=body("next"), headers=headers)
        )
        await eventually(lambda: gate.calls == 4, what="the follow-up's model call")
        gate.release.set()
        assert await rerun == 1
        assert (await later).status == 200
        said = [("user", "first"), ("assistant", "slow answer"), ("user", "hi")]
        said += [("user", "next"), ("assistant", "slow answer")]
        assert await transcript(service, "g") == (said, 0)


#: A plain turn's intake into an existing session, one statement (PostgreSQL:
#: leadgate.turns.history's store into the window).
PLAIN_INTAKE = "WITH sb AS"


@pytest.mark.parametrize(
    ("landed", "db_url"),
    # (PostgreSQL only: a SQLite COMMIT's answer cannot be lost, so no intake is in doubt.)
    [(True, "postgres"), (False, "postgres")],
    indirect=["db_url"],
    ids=["landed", "not-landed"],
)
async def test_a_plain_intake_in_doubt_is_answered_once_whether_or_not_it_landed(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, landed: bool
) -> None:
    """The intake's statement in doubt and its read-back failing too: 503
    ``intake.in_doubt``, "send it only if the transcript lacks it". Landed, the client
    finds it there and sends nothing, and nothing ever answered it (a plain turn records
    no run): this process now owes its turn, and its recovery answers it once. Not
    landed, the owed run is not recorded, and the client's resend is answered once."""
    async with faulted(migrated_url, monkeypatch) as (service, client, faults, key):
        headers = {"Authorization": f"Bearer {key}", "X-Session-Id": "d"}
        body = {"model": "plain", "messages": [{"role": "user", "content": "first"}]}
        first = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert first.status == 200, await first.text()
        faults.arm_on(PLAIN_INTAKE, after_commit=landed, and_on=READ_BACK)
        body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
        told = await client.post("/v1/chat/completions", json=body, headers=headers)
        faults.disarm()
        assert faults.fired is not None and PLAIN_INTAKE in faults.fired
        assert told.status == 503 and told.headers["x-should-retry"] == "false"
        assert (await told.json())["error"]["rule"] == "intake.in_doubt"
        assert len(service.turns.owed) == 1
        recovery = TurnRecovery(service.turns, own_only=True)
        if landed:
            await answered_once(service, "d", "hi")
            return
        assert await drain(recovery) == 0
        assert not service.turns.owed and not service.turns.orphans
        assert await transcript(service, "d") == (EARLIER, 0)
        again = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert again.status == 200, await again.text()
        answered = [*EARLIER, ("user", "hi"), ("assistant", "Echo: hi")]
        assert await transcript(service, "d") == (answered, 0)
        assert await drain(recovery) == 0


async def _hi_in_doubt_landing_later(
    service: App,
    client: Client,
    faults: SqliteFaults | PgFaults,
    key: str,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[LandsLater, dict[str, str], dict[str, Any]]:
    """Session ``d`` answered "first"; then "hi", its intake's statement in doubt (the
    server applies it at ``land()``) and every try of its read-back failing (the
    database still away): answered 503 ``intake.in_doubt``. The statement, and the
    request's headers and body (to send it again)."""
    headers = {"Authorization": f"Bearer {key}", "X-Session-Id": "d"}
    body = {"model": "plain", "messages": [{"role": "user", "content": "first"}]}
    first = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert first.status == 200, await first.text()
    late = LandsLater(service.db.write_alone)
    monkeypatch.setattr(service.db, "write_alone", late)
    faults.arm_on(READ_BACK, and_on=READ_BACK)
    body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
    told = await client.post("/v1/chat/completions", json=body, headers=headers)
    faults.disarm()
    assert told.status == 503
    assert (await told.json())["error"]["rule"] == "intake.in_doubt"
    return late, headers, body


@pytest.mark.parametrize("resent", [False, True], ids=["not-resent", "resent-first"])
async def test_a_plain_intake_in_doubt_applied_after_the_owed_record_looked_is_answered_once(
    migrated_pg: str, monkeypatch: pytest.MonkeyPatch, resent: bool
) -> None:
    """PostgreSQL (a SQLite COMMIT's answer cannot be lost, so no intake is in doubt):
    the intake's statement in doubt, its read-back failing too (503 ``intake.in_doubt``),
    and the server applying the statement only after the owed run's record looked for
    the message and found none. The record dropped it: the client, finding the message
    in the transcript, sent nothing, and nothing answered it. It is now looked for
    again a second on, found, and answered once. When the client looked before it
    landed and sent it again (``resent``), that resend's turn answered it, and the late
    copy (after the resend in the session's order) is not answered a second time."""
    async with faulted(migrated_pg, monkeypatch) as (service, client, faults, key):
        late, headers, body = await _hi_in_doubt_landing_later(
            service, client, faults, key, monkeypatch
        )
        recovery = TurnRecovery(service.turns, own_only=True)
        assert await drain(recovery) == 0
        assert not service.turns.owed and len(service.turns.owed_lost) == 1
        assert await transcript(service, "d") == (EARLIER, 0)
        answered = [*EARLIER, ("user", "hi"), ("assistant", "Echo: hi")]
        assert isinstance(service.clock, FakeClock)
        if resent:
            service.clock.advance(1)  # (the client looked at the transcript first)
            again = await client.post("/v1/chat/completions", json=body, headers=headers)
            assert again.status == 200, await again.text()
            assert await transcript(service, "d") == (answered, 0)
            # (in the order the database took them: the late copy after the resend's
            # exchange, though its intake's clock reading was before the resend's)
            answered = [*answered, ("user", "hi")]
        await late.land()
        service.clock.advance(1_000)  # (LostClaims.first_ms)
        assert recovery.due_in_s() == 0
        assert await drain(recovery) == int(not resent)
        assert await transcript(service, "d") == (answered, 0)
        assert not service.turns.owed_lost and await drain(recovery) == 0


@pytest.mark.parametrize(
    ("skew_ms", "resent"),
    [(-2_000, True), (2_000, False), (2_000, True), (-2_000, False)],
    ids=[
        "resent-on-a-replica-2s-behind",
        "said-before-on-a-replica-2s-ahead",
        "resent-on-a-replica-2s-ahead",
        "said-before-on-a-replica-2s-behind",
    ],
)
async def test_whether_an_intake_in_doubt_was_resent_does_not_depend_on_replicas_clocks(
    migrated_pg: str, monkeypatch: pytest.MonkeyPatch, skew_ms: int, resent: bool
) -> None:
    """PostgreSQL (no SQLite intake is in doubt): two replicas on one database, the
    other's clock ``skew_ms`` from the doubting one's. "hi" is in doubt on this replica
    and lands after its owed run's first look found it absent. Its client's resend of
    "hi" through the other replica (``resent``) answered it: the late copy is not
    answered again. The same words said on the other replica before it (not ``resent``)
    are a message of their own: the late copy is answered too. By time, the resend on a
    replica 2 s behind was missed (answered twice) and the earlier message on a replica
    2 s ahead was taken for a resend (the owed message never answered)."""
    async with faulted(migrated_pg, monkeypatch) as (service, client, faults, key):
        assert isinstance(service.clock, FakeClock)
        other_clock = FakeClock(service.clock.now_ms() + skew_ms)
        providers: dict[str, Provider] = {"script": ScriptProvider()}
        async with served_app(
            migrated_pg, providers=providers, like_production=True, clock=other_clock
        ) as (_, other):
            hi = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
            headers = {"Authorization": f"Bearer {key}", "X-Session-Id": "d"}
            if not resent:
                before = await other.post("/v1/chat/completions", json=hi, headers=headers)
                assert before.status == 200, await before.text()
                other_clock.advance(1)
            late, _, _ = await _hi_in_doubt_landing_later(service, client, faults, key, monkeypatch)
            recovery = TurnRecovery(service.turns, own_only=True)
            assert await drain(recovery) == 0
            assert len(service.turns.owed_lost) == 1
            if resent:
                other_clock.advance(1)  # (the client looked at the transcript first)
                again = await other.post("/v1/chat/completions", json=hi, headers=headers)
                assert again.status == 200, await again.text()
            await late.land()
            service.clock.advance(1_000)  # (LostClaims.first_ms)
            assert await drain(recovery) == int(not resent)
            messages, left = await transcript(service, "d")
            assert left == 0 and not service.turns.owed_lost
            # (in the order the database took them, whatever the replicas' clocks)
            if resent:
                exchanges = [*EARLIER, ("user", "hi"), ("assistant", "Echo: hi"), ("user", "hi")]
            else:
                said = [("user", "hi"), ("assistant", "Echo: hi")]
                exchanges = [*said, *EARLIER, *said]
            assert messages == exchanges


@pytest.mark.parametrize(
    ("after_ms", "answers"),
    [(runs.RESEND_CLOCK_SLACK_MS + 1_000, 2), (1_000, 3)],
    ids=["past-the-slack", "within-the-slack"],
)
async def test_a_resend_taken_in_before_the_first_look_is_told_by_its_time(
    migrated_pg: str, monkeypatch: pytest.MonkeyPatch, after_ms: int, answers: int
) -> None:
    """PostgreSQL (see above): "hi" in doubt, its client's resend taken in ``after_ms``
    after the intake began, before the owed run's first look, and the first copy landed
    after it. No look found the message absent, so the session's order cannot place the
    resend (the rows are those of an earlier message saying the same): it is told by its
    time, :data:`~leadgate.turns.runs.RESEND_CLOCK_SLACK_MS` past the intake's start,
    and the late copy is not answered again (by the event order alone it was answered
    twice, whatever the resend's time). Within the slack it is answered, twice rather
    than never."""
    async with faulted(migrated_pg, monkeypatch) as (service, client, faults, key):
        late, headers, body = await _hi_in_doubt_landing_later(
            service, client, faults, key, monkeypatch
        )
        assert service.turns.owed and isinstance(service.clock, FakeClock)
        service.clock.advance(after_ms)
        again = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert again.status == 200, await again.text()
        await late.land()
        recovery = TurnRecovery(service.turns, own_only=True)
        assert await drain(recovery) == answers - 2
        messages, left = await transcript(service, "d")
        assert left == 0 and not service.turns.owed and not service.turns.owed_lost
        assert sorted(text for role, text in messages if role == "user") == ["first", "hi", "hi"]
        assert sum(role == "assistant" for role, _ in messages) == answers


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
async def test_a_stop_looks_once_more_for_a_plain_intake_in_doubt(
    migrated_pg: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    landed: bool,
) -> None:
    """PostgreSQL (see above): a plain intake in doubt not found by its owed run's
    record, the process stopped (SIGTERM) before the next look was due. The stop looks
    once more: the message landed by then, its run is recorded under this process,
    which then unregisters, so a worker's turn recovery reruns it (it was dropped with
    the process's memory). Not landed, one WARNING says a message the database applies
    after the stop stays unanswered (nothing said it)."""
    async with faulted(migrated_pg, monkeypatch) as (service, client, faults, key):
        late, _, _ = await _hi_in_doubt_landing_later(service, client, faults, key, monkeypatch)
        assert await drain(TurnRecovery(service.turns, own_only=True)) == 0
        assert len(service.turns.owed_lost) == 1
        if landed:
            await late.land()
        owner = service.turns.owner()
        with caplog.at_level(logging.WARNING, logger="leadgate"):
            await service.stop()
    said = [r.getMessage() for r in caplog.records if "in doubt not found" in r.getMessage()]
    if landed:
        assert said == []
        assert await _runs_left(migrated_pg) == [owner]
    else:
        assert len(said) == 1 and "stopping with 1 intake(s) in doubt" in said[0]
        assert await _runs_left(migrated_pg) == []
