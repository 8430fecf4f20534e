"""``send_action_agent_message`` calls that are cancelled, sent again, or sent to
another replica, through the real app on 127.0.0.1 and the official ``mcp`` client, in
both protocol eras. A handshake-era client cancels a call with ``notifications/cancelled``
(its call cancelled or timed out), a 2026-07-28 client by closing the call's response
stream (a dropped connection is the same signal): the turn, its message taken in, runs
to its end as a REST request's does when its client goes away. The same message sent
again while that turn runs is answered by it. A handshake-era session lives in the
replica that opened it: another refuses it before anything is taken in."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx2
import pytest
import sqlalchemy as sa
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp_types import TextContent

from leadgate.app import App
from leadgate.core.auth import Scope
from leadgate.core.errors import ModelError
from leadgate.core.runners import drain
from leadgate.database import schema as t
from leadgate.runners.recovery import TurnRecovery
from leadgate.turns.providers.base import Provider
from leadgate.turns.providers.script import ScriptProvider
from leadgate.web.mcp import ToolTurns
from tests.fakes import FaultProvider, GateProvider
from tests.helpers import Org, eventually, make_agent, make_key, make_org, mcp_initialize, ours
from tests.serving import Client, served_app
from tests.statement_faults import injector

TOOL = "send_action_agent_message"
ERAS = ["handshake", "2026-07-28"]


@asynccontextmanager
async def mcp_client(client: Client, key: str, era: str) -> AsyncIterator[ClientSession]:
    """An MCP client session of ``era`` with ``key``."""
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as http,
        streamable_http_client(str(client.make_url("/mcp")), http_client=http) as streams,
        ClientSession(*streams) as session,
    ):
        if era == "handshake":
            await session.initialize()
        else:
            await session.discover()
        yield session


@asynccontextmanager
async def slow_worker(
    migrated_url: str, gate: GateProvider, *, lead: bool
) -> AsyncIterator[tuple[App, Client, Org]]:
    """The app served for the block, with the worker ``slow`` on ``gate``'s model (with a
    lead, ``lead``, when ``lead``): the service, its client and the organization."""
    providers: dict[str, Provider] = {"script": ScriptProvider(), "gate": gate}
    async with served_app(migrated_url, providers=providers, like_production=True) as (
        service,
        client,
    ):
        org = await make_org(service)
        if lead:
            await make_agent(service, org, "lead")
            await make_agent(service, org, "slow", model="gate", lead="lead")
        else:
            await make_agent(service, org, "slow", model="gate")
        yield service, client, org


def turns_of(service: App) -> ToolTurns:
    assert service._mcp is not None
    return service._mcp.turns


async def cancelled_mid_turn(
    service: App, client: Client, key: str, era: str, gate: GateProvider
) -> None:
    """Call the tool for the worker ``slow`` (session ``c``), and cancel the call once
    its turn waits for the model, until the server has let it go."""
    async with mcp_client(client, key, era) as session:
        call = asyncio.create_task(
            session.call_tool(TOOL, {"agent": "slow", "message": "hi", "session": "c"})
        )
        await eventually(lambda: gate.calls == 1)
        call.cancel()
        # The server's side: the handler let go of its turn (or, before, cancelled it).
        await eventually(lambda: turns_of(service).detached() == 1 or gate.cancelled)


async def session_rows(service: App, key: str = "h:c") -> tuple[list[tuple[str, str]], int]:
    """The session ``key``'s stored messages (role, content), oldest first, and the
    recorded runs (default: the session ``c`` these tests' calls name)."""
    async with service.db.read() as conn:
        messages = (
            await conn.execute(
                sa.select(t.messages.c.role, t.messages.c.content)
                .select_from(
                    t.messages.join(t.sessions, t.sessions.c.id == t.messages.c.session_id)
                )
                .where(t.sessions.c.key == key)
                .order_by(t.messages.c.created_at, t.messages.c.id)
            )
        ).all()
        runs = await conn.scalar(sa.select(sa.func.count()).select_from(t.turn_runs))
    return [(m.role, m.content) for m in messages], int(runs or 0)


@pytest.mark.parametrize("era", ERAS)
async def test_a_cancelled_call_leaves_its_turn_running_to_its_end(
    migrated_url: str, era: str
) -> None:
    """The turn ran inside the call's handler, and the SDK cancels that handler when the
    client cancels the call: the turn stopped wherever it was, its message taken in, and
    nothing answered it; a worker with a lead left its run leased to this live process
    (closed unanswered 15 minutes on, the item ``inProgress`` for the week-long sweep).
    Now the turn runs to its end: its answer is in the transcript, its run closed."""
    gate = GateProvider()
    async with slow_worker(migrated_url, gate, lead=True) as (service, client, org):
        await cancelled_mid_turn(service, client, org.key, era, gate)
        assert gate.cancelled == 0, "the turn was cancelled with its call"
        gate.release.set()
        await eventually(lambda: turns_of(service).detached() == 0)
        assert await session_rows(service) == ([("user", "hi"), ("assistant", "slow answer")], 0)


async def test_a_turn_left_by_its_call_is_stopped_when_the_server_stops(
    migrated_url: str,
) -> None:
    """The turn of a cancelled call has no HTTP request the shutdown waits for: the
    server's stop cancels it (as the end of the shutdown grace cancels a REST request's
    turn), before the database closes; it is not left running on."""
    gate = GateProvider()
    async with slow_worker(migrated_url, gate, lead=True) as (service, client, org):
        await cancelled_mid_turn(service, client, org.key, "handshake", gate)
        await client.close()  # the server stops (the app's cleanup)
        assert gate.cancelled == 1
        assert turns_of(service).detached() == 0


async def test_a_left_turns_model_failure_is_logged_without_the_providers_words(
    migrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The turn of a cancelled call fails on its model: the WARNING that says so names
    the failure as the turn path's own line does (the provider's status and the rule),
    not the provider's own words, which may echo the request (the message's text
    included). It logged the error's whole message, those words too."""
    gate = GateProvider()
    gate.failure = ModelError(
        "the model server at http://model rejected the request (HTTP 400)",
        rule="model.bad_request",
        detail=": your prompt 'the secret plan' breaks the policy",
    )
    caplog.set_level(logging.INFO)
    async with slow_worker(migrated_url, gate, lead=False) as (service, client, org):
        await cancelled_mid_turn(service, client, org.key, "handshake", gate)
        gate.release.set()
        await eventually(lambda: turns_of(service).detached() == 0)
    said = [r.getMessage() for r in ours(caplog)]
    assert [line for line in said if "secret plan" in line] == []
    [left] = [line for line in said if "MCP turn of a cancelled tool call failed" in line]
    assert "(HTTP 400)" in left and "model.bad_request" in left


ANSWER = {"success": True, "result": {"leadReviewPending": False, "text": "slow answer"}}


@pytest.mark.parametrize("era", ERAS)
async def test_a_call_sent_again_while_its_turn_runs_is_answered_by_that_turn(
    migrated_url: str, era: str
) -> None:
    """The same message (caller's key, agent, session, text) sent again while its turn
    still runs (here, its first call cancelled; as well its answer lost on the way)
    awaits that turn and gets its answer: the message is taken in once and answered
    once. It was a new message whose own turn ran beside the first: answered twice."""
    gate = GateProvider()
    async with slow_worker(migrated_url, gate, lead=True) as (service, client, org):
        await cancelled_mid_turn(service, client, org.key, era, gate)
        async with mcp_client(client, org.key, era) as session:
            again = asyncio.create_task(
                session.call_tool(TOOL, {"agent": "slow", "message": "hi", "session": "c"})
            )
            await eventually(lambda: gate.calls == 2 or turns_of(service).detached() == 0)
            gate.release.set()
            result = await again
        assert gate.calls == 1, "the message was taken in and run a second time"
        assert result.is_error is False and result.structured_content == ANSWER
        assert await session_rows(service) == ([("user", "hi"), ("assistant", "slow answer")], 0)


async def test_a_call_sent_again_naming_the_default_session_another_way_joins_its_turn(
    migrated_url: str,
) -> None:
    """``session`` omitted and ``session: "default"`` name the same session (the key's
    default): the same message sent again the other way while its turn runs is that
    call again, answered by that turn. It was taken in a second time and answered twice."""
    gate = GateProvider()
    async with slow_worker(migrated_url, gate, lead=False) as (service, client, org):
        async with mcp_client(client, org.key, "handshake") as session:
            first = asyncio.create_task(
                session.call_tool(TOOL, {"agent": "slow", "message": "hi", "session": "default"})
            )
            await eventually(lambda: gate.calls == 1)
            first.cancel()
            await eventually(lambda: turns_of(service).detached() == 1)
            again = asyncio.create_task(session.call_tool(TOOL, {"agent": "slow", "message": "hi"}))
            await eventually(lambda: gate.calls == 2 or turns_of(service).detached() == 0)
            gate.release.set()
            result = await again
        assert gate.calls == 1, "the message was taken in and run a second time"
        assert result.is_error is False and result.structured_content == ANSWER


@pytest.mark.parametrize("differs", ["message", "session", "key"])
async def test_another_message_while_a_turn_runs_is_a_turn_of_its_own(
    migrated_url: str, differs: str
) -> None:
    """Only the very same message joins a running turn: another text, another session,
    or another key's call (its default session is another) runs its own turn."""
    gate = GateProvider()
    async with slow_worker(migrated_url, gate, lead=False) as (service, client, org):
        first = {"agent": "slow", "message": "hi"}
        second = {
            "message": {**first, "message": "hello"},
            "session": {**first, "session": "other"},
            "key": first,
        }[differs]
        other_key = await make_key(service, org, Scope.trigger) if differs == "key" else org.key
        async with (
            mcp_client(client, org.key, "handshake") as one,
            mcp_client(client, other_key, "handshake") as two,
        ):
            calls = [
                asyncio.create_task(one.call_tool(TOOL, first)),
                asyncio.create_task(two.call_tool(TOOL, second)),
            ]
            await eventually(lambda: gate.calls == 2)
            gate.release.set()
            results = await asyncio.gather(*calls)
        assert [r.structured_content for r in results] == [ANSWER, ANSWER]


async def test_a_session_of_one_replica_is_refused_by_another_before_any_intake(
    migrated_pg: str,
) -> None:
    """PostgreSQL, two replicas without sticky routing: a tool call of a session that
    replica A opened, sent to replica B, is 404 ``mcp.session`` and takes nothing in
    (the same call to A is then answered once); a 2026-07-28 client, with no session,
    is served by either."""
    async with (
        served_app(migrated_pg, like_production=True) as (a, a_client),
        served_app(migrated_pg, like_production=True) as (_, b_client),
        httpx2.AsyncClient() as http,
    ):
        org = await make_org(a)
        await make_agent(a, org, "plain")
        headers = {
            "Authorization": f"Bearer {org.key}",
            "Accept": "application/json, text/event-stream",
        }
        opened = await http.post(
            str(a_client.make_url("/mcp")), json=mcp_initialize(), headers=headers
        )
        assert opened.status_code == 200
        of_a = {
            **headers,
            "Mcp-Session-Id": opened.headers["mcp-session-id"],
            "Mcp-Protocol-Version": "2025-06-18",
        }
        initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        assert (
            await http.post(str(a_client.make_url("/mcp")), json=initialized, headers=of_a)
        ).status_code == 202
        call = {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {"name": TOOL, "arguments": {"agent": "plain", "message": "hi"}},
        }
        on_b = await http.post(str(b_client.make_url("/mcp")), json=call, headers=of_a)
        assert on_b.status_code == 404, on_b.text
        assert on_b.json()["error"]["data"] == {"rule": "mcp.session"}
        transcript = str(a_client.make_url("/v1/agents/plain/sessions/default/messages"))
        auth = {"Authorization": f"Bearer {org.key}"}
        assert (await http.get(transcript, headers=auth)).json()["data"] == []
        on_a = await http.post(str(a_client.make_url("/mcp")), json=call, headers=of_a)
        assert on_a.status_code == 200 and "Echo: hi" in on_a.text
        stored = (await http.get(transcript, headers=auth)).json()["data"]
        assert [m["content"] for m in stored] == ["hi", "Echo: hi"]
        for client in (a_client, b_client):
            async with mcp_client(client, org.key, "2026-07-28") as session:
                result = await session.call_tool(
                    TOOL, {"agent": "plain", "message": "again", "session": "modern"}
                )
                assert result.structured_content == {
                    "success": True,
                    "result": {"leadReviewPending": False, "text": "Echo: again"},
                }


@pytest.mark.parametrize("era", ERAS)
async def test_a_turn_stopped_by_a_database_fault_is_a_ruled_tool_error_and_rerun_once(
    migrated_url: str, era: str
) -> None:
    """A lead worker's turn stops on a database fault after its message was taken in:
    the call is a tool error (``isError``, not a JSON-RPC error) naming
    ``turn.interrupted`` in ``_meta``, saying not to send the message again, and the
    process's own turn recovery reruns the run: the answer is in the transcript, once."""
    providers: dict[str, Provider] = {"script": ScriptProvider(), "fault": FaultProvider()}
    async with served_app(migrated_url, providers=providers, like_production=True) as (
        service,
        client,
    ):
        org = await make_org(service)
        await make_agent(service, org, "lead")
        await make_agent(service, org, "slow", model="fault", lead="lead")
        async with mcp_client(client, org.key, era) as session:
            told = await session.call_tool(
                TOOL, {"agent": "slow", "message": "once", "session": "c"}
            )
        assert told.is_error is True and told.meta is not None
        assert told.meta["rule"] == "turn.interrupted"
        [block] = told.content
        assert isinstance(block, TextContent) and "Do not send it again" in block.text
        assert await session_rows(service) == ([("user", "once")], 1)
        assert await drain(TurnRecovery(service.turns)) == 1  # rerun in this process
        assert await session_rows(service) == (
            [("user", "once"), ("assistant", "answered once the database was back")],
            0,
        )


async def test_a_database_fault_before_the_intake_says_when_to_retry(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database fault before the message was taken in is a tool error saying nothing
    was stored, ``_meta`` naming its rule and, as a resource read's error and REST's
    ``Retry-After`` do, when to retry (``retryAfterS``; it said "retry shortly" only).
    The retry is taken in once and answered once."""
    faults = injector(migrated_url, monkeypatch)
    async with served_app(migrated_url, like_production=True) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "plain")
        arguments = {"agent": "plain", "message": "hi", "session": "c"}
        async with mcp_client(client, org.key, "handshake") as session:
            faults.arm_on("INSERT INTO messages")
            told = await session.call_tool(TOOL, arguments)
            faults.disarm()
            assert faults.fired is not None
            assert told.is_error is True
            assert told.meta == {"rule": "service.unavailable", "retryAfterS": 2}
            [block] = told.content
            assert isinstance(block, TextContent) and "nothing was stored" in block.text
            again = await session.call_tool(TOOL, arguments)
        assert again.structured_content == {
            "success": True,
            "result": {"leadReviewPending": False, "text": "Echo: hi"},
        }
        assert await session_rows(service) == ([("user", "hi"), ("assistant", "Echo: hi")], 0)
