"""The hosted MCP server's transcript resource, its subscriptions and the conformance
fixes (SPEC 13, issue 12), through the real app on 127.0.0.1 and the official ``mcp``
client, in both protocol eras: handshake (``initialize``, ``resources/subscribe``,
``notifications/resources/updated``) and 2026-07-28 (``server/discover``,
``subscriptions/listen``). Runners are drained by hand."""

from __future__ import annotations

import asyncio
import json
import logging
import warnings
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import mcp_types as mt
import pytest
import sqlalchemy as sa
from aiohttp import web
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.client.subscriptions import SubscriptionLost, listen
from mcp.shared.exceptions import MCPError

from leadgate.app import App, package_version
from leadgate.core.auth import Scope
from leadgate.core.clock import FakeClock
from leadgate.core.config import Settings
from leadgate.core.errors import CANNOT_READ
from leadgate.core.runners import drain
from leadgate.database import schema as t
from leadgate.domain import orgs
from leadgate.web.mcp_resources import URI_QUOTE_LIMIT
from tests.fakes import DownFor
from tests.helpers import (
    LEGACY_SUBSCRIBE,
    Org,
    delete_agent,
    eventually,
    listened,
    make_agent,
    make_key,
    make_org,
    mcp_initialize,
)

TOOL = "send_action_agent_message"


@dataclass
class Env:
    service: App
    url: str
    org: Org
    other: Org
    updates: list[str] = field(default_factory=list)

    async def settle(self) -> None:
        await drain(self.service.lead_runner)
        await drain(self.service.relay)


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    """SQLite only: the surface, not the database (tests/unit covers both)."""
    return f"sqlite+aiosqlite:///{tmp_path}/t.db"


@pytest.fixture
async def env(migrated_url: str) -> AsyncIterator[Env]:
    """The service with the MCP sessions' idle timeout at its default. The SDK counts
    it in real time from the end of the last request in flight, and a request is in
    flight only once its key was checked (a database read): with the 1 s this fixture
    had, key checks slowed past 1 s on a loaded machine ended the session between
    ``initialize`` and the next request ('Session not found')."""
    async with served_env(migrated_url) as served:
        yield served


@asynccontextmanager
async def served_env(migrated_url: str, **api: float) -> AsyncIterator[Env]:
    """The app on 127.0.0.1 with two organizations and their agents; ``api`` settings
    on top of a fast key re-check."""
    settings = Settings.model_validate(
        {"database": {"url": migrated_url}, "api": {"events_reauth_s": 0.05, **api}}
    )
    service = App(settings, clock=FakeClock(), enable_adapters=False)
    org = await make_org(service)
    other = await make_org(service, "other")
    await make_agent(service, org, "lead")
    await make_agent(service, org, "worker", lead="lead")
    await make_agent(service, other, "theirs")
    # As `leadgate serve` runs it (aiohttp's TestServer cancels handlers when a client
    # disconnects, which the service's server does not do).
    runner = web.AppRunner(service.web_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield Env(service, f"http://{host}:{port}/mcp", org, other)
    finally:
        await runner.cleanup()
        await service.stop()


@asynccontextmanager
async def session(env: Env, key: str | None = None) -> AsyncIterator[ClientSession]:
    async def on_message(message: Any) -> None:
        if isinstance(message, mt.ResourceUpdatedNotification):
            env.updates.append(str(message.params.uri))

    # mcp 2.x: the bearer key travels on an httpx2 client given to the transport.
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {key or env.org.key}"}) as http,
        streamable_http_client(env.url, http_client=http) as (read, write),
        ClientSession(read, write, message_handler=on_message) as client,
    ):
        yield client


def uri(agent: str, name: str) -> str:
    return f"leadgate://agents/{agent}/sessions/{name}/messages"


async def transcript(client: ClientSession, resource: str) -> dict[str, Any]:
    result = await client.read_resource(resource)
    [content] = result.contents
    assert isinstance(content, mt.TextResourceContents)
    assert content.mime_type == "application/json"
    return dict(json.loads(content.text))


async def test_handshake_capabilities_and_server_info(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    async with session(env) as client:
        init = await client.initialize()
        caps = init.capabilities
        assert caps.prompts is None  # nothing served, nothing advertised
        assert caps.tools is not None
        assert caps.resources is not None and caps.resources.subscribe is True
        assert init.server_info.name == "leadgate"
        assert init.server_info.version == package_version() != ""
        with pytest.raises(MCPError) as unknown:
            await client.get_prompt("nothing")
        assert unknown.value.error.code == mt.METHOD_NOT_FOUND
        # A client's unknown method is the client's mistake: nothing at ERROR, no traceback.
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
        templates = (await client.list_resource_templates()).resource_templates
        assert [t.uri_template for t in templates] == [
            "leadgate://agents/{agent}/sessions/{session}/messages"
        ]
        assert (await client.list_resources()).resources == []
        bad_tool = await client.call_tool("approve_work_item", {})
        assert bad_tool.is_error is True  # as the SDK's MCPServer: a tool error result


@LEGACY_SUBSCRIBE
async def test_read_then_subscribe_then_the_approved_answer(env: Env) -> None:
    resource = uri("worker", "m1")
    async with session(env) as client:
        await client.initialize()
        assert await transcript(client, resource) == {
            "object": "list",
            "data": [],
            "has_more": False,
            "review": None,
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # removed in 2026-07-28
            await client.subscribe_resource(resource)
        result = await client.call_tool(
            TOOL, {"agent": "worker", "message": "ship it #complete", "session": "m1"}
        )
        assert result.structured_content == {
            "success": True,
            "result": {"leadReviewPending": True, "text": "", "revision": None, "workItemId": None},
        }
        # Stored: the user message (an update), then the answer held (an update: the
        # review status), and no answer yet.
        await eventually(lambda: len(env.updates) == 2)
        assert env.updates == [resource, resource]
        held = await transcript(client, resource)
        assert [(m["role"], m["content"]) for m in held["data"]] == [("user", "ship it #complete")]
        assert held["review"] == {"status": "pending"}
        await env.settle()  # the lead approves; the relay reveals (one transaction)
        await eventually(lambda: len(env.updates) == 3)
        assert env.updates == [resource] * 3
        done = await transcript(client, resource)
        assert [m["content"] for m in done["data"]] == [
            "ship it #complete",
            "Echo: ship it #complete",
        ]
        assert done["review"] == {"status": "delivered"}
        assert "wi_" not in json.dumps(done)
        assert env.service._mcp is not None and env.service._mcp.resources is not None
        assert env.service._mcp.resources.subscriptions == 1
    # The MCP session ended (DELETE): its subscription is gone with it.
    resources = env.service._mcp.resources
    await eventually(lambda: resources.subscriptions == 0)
    assert resources.subscriptions == 0


@LEGACY_SUBSCRIBE
async def test_a_rejected_answer_updates_subscribers_and_the_page_says_so(env: Env) -> None:
    """MCP has no events stream: the page's ``review`` names the held work's public
    status, and a status change (here a person's rejection) is an update. A rejected
    answer sent no update and showed nowhere, so a subscriber waiting for it waited
    forever."""
    resource = uri("worker", "rj")
    async with session(env) as client:
        await client.initialize()
        await client.subscribe_resource(resource)
        await client.call_tool(
            TOOL, {"agent": "worker", "message": "risky #escalate #complete", "session": "rj"}
        )
        await env.settle()  # the lead escalates: awaitingHuman
        held = await transcript(client, resource)
        assert held["review"] == {"status": "pending"}
        assert [m["role"] for m in held["data"]] == ["user"]
        async with env.service.db.read() as conn:
            item_id = (await conn.execute(sa.select(t.work_items.c.id))).scalar_one()
        before = len(env.updates)
        await env.service.reviews.decide(env.org.principal, item_id, "reject", "off topic")
        await eventually(lambda: len(env.updates) > before)
        assert env.updates[before:] == [resource]
        done = await transcript(client, resource)
    assert done["review"] == {"status": "rejected"}
    assert [m["role"] for m in done["data"]] == ["user"]
    assert "wi_" not in json.dumps(done) and "off topic" not in json.dumps(done)


async def test_the_same_session_as_rest_and_the_default(env: Env) -> None:
    async with session(env) as client:
        await client.initialize()
        await client.call_tool(TOOL, {"agent": "worker", "message": "named", "session": "n"})
        await client.call_tool(TOOL, {"agent": "worker", "message": "unnamed"})
        named = await transcript(client, uri("worker", "n"))
        default = await transcript(client, uri("worker", "default"))
        paged = await transcript(client, uri("worker", "n") + "?limit=1")
    assert [m["content"] for m in named["data"]] == ["named", "Echo: named"]
    assert [m["content"] for m in default["data"]] == ["unnamed", "Echo: unnamed"]
    assert len(paged["data"]) == 1 and paged["has_more"] is True


@LEGACY_SUBSCRIBE
async def test_a_query_parameter_given_twice_is_refused_naming_it(env: Env) -> None:
    """``?limit=1&limit=2`` took the last value here and the first on REST: a client could
    not tell which one counted. Both surfaces refuse it now, naming ``query.repeated``
    (an empty value counts: REST's ``?limit=&limit=2`` is two values too)."""
    async with session(env) as client:
        await client.initialize()
        await client.call_tool(TOOL, {"agent": "worker", "message": "twice", "session": "t"})
        for query, name in (
            ("limit=1&limit=2", "limit"),
            ("limit=&limit=2", "limit"),
            ("after=&after=x&limit=1", "after"),
        ):
            resource = uri("worker", "t") + "?" + query
            with pytest.raises(MCPError) as refused:
                await client.read_resource(resource)
            assert refused.value.error.code == mt.INVALID_PARAMS
            assert refused.value.error.data == {"uri": resource, "rule": "query.repeated"}
            assert f"query parameter {name} was given 2 times" in refused.value.error.message
            with warnings.catch_warnings(), pytest.raises(MCPError) as sub:
                warnings.simplefilter("ignore", DeprecationWarning)
                await client.subscribe_resource(resource)
            assert sub.value.error.data == {"uri": resource, "rule": "query.repeated"}
        # Once each, and an empty value, is read as before.
        page = await transcript(client, uri("worker", "t") + "?limit=1&after=")
        assert len(page["data"]) == 1 and page["has_more"] is True


@LEGACY_SUBSCRIBE
async def test_another_organizations_resource_is_unknown(env: Env) -> None:
    async with session(env, env.other.key) as client:
        await client.initialize()
        for resource, rule in (
            (uri("worker", "m1"), "agent.not_found"),
            ("leadgate://agents/worker/nope", "resource.unknown"),
            ("file:///etc", "resource.unknown"),
        ):
            with pytest.raises(MCPError) as read:
                await client.read_resource(resource)
            assert read.value.error.code == mt.INVALID_PARAMS
            # Named like every other refusal (it named no rule).
            assert read.value.error.data == {"uri": resource, "rule": rule}
            assert read.value.error.message == f"Unknown resource: {resource!r}"
        # A long name is quoted short, as every refusal quotes what a client sent: 5,000
        # characters came back whole in the message.
        with pytest.raises(MCPError) as long_read:
            await client.read_resource(uri("ghost-" + "x" * 4_994, "m1"))
        said = long_read.value.error.message
        assert long_read.value.error.data["rule"] == "agent.not_found"
        assert len(said) < URI_QUOTE_LIMIT + 100 and "… (5,0" in said, said
        # Its ``data.uri`` is cut the same way, saying the full length: it was the whole
        # URI, a megabyte sent came back a megabyte.
        long_uri = uri("ghost-" + "x" * 4_994, "m1")
        assert long_read.value.error.data == {
            "uri": long_uri[:URI_QUOTE_LIMIT],
            "uriLength": len(long_uri),
            "rule": "agent.not_found",
        }
        with pytest.raises(MCPError) as long_query:
            await client.read_resource(uri("theirs", "x") + "?limit=1000&pad=" + "y" * 5_000)
        assert long_query.value.error.data["rule"] == "transcript.limit"
        assert len(long_query.value.error.data["uri"]) == URI_QUOTE_LIMIT
        with (
            warnings.catch_warnings(),
            pytest.raises(MCPError) as sub,
        ):
            warnings.simplefilter("ignore", DeprecationWarning)
            await client.subscribe_resource(uri("worker", "m1"))
        assert sub.value.error.code == mt.INVALID_PARAMS
        assert sub.value.error.data == {"uri": uri("worker", "m1"), "rule": "agent.not_found"}
        # Its own agent is fine.
        assert (await transcript(client, uri("theirs", "x")))["data"] == []
        # A session name no surface accepts (PostgreSQL text cannot hold a NUL) is refused
        # before anything is stored, as a read and as a subscription.
        for name in ("%00", "a%01b"):
            resource = f"leadgate://agents/theirs/sessions/{name}/messages"
            with pytest.raises(MCPError) as bad:
                await client.read_resource(resource)
            assert bad.value.error.code == mt.INVALID_PARAMS
            with warnings.catch_warnings(), pytest.raises(MCPError) as bad_sub:
                warnings.simplefilter("ignore", DeprecationWarning)
                await client.subscribe_resource(resource)
            assert bad_sub.value.error.code == mt.INVALID_PARAMS
    async with env.service.db.read() as conn:
        keys = (await conn.execute(sa.select(t.sessions.c.key))).scalars().all()
    assert not [k for k in keys if "\x00" in k or "\x01" in k]


async def test_2026_listen_gets_the_update(env: Env) -> None:
    resource = uri("worker", "modern")
    async with session(env) as client:
        await client.discover()
        async with listen(client, resource_subscriptions=[resource]) as sub:
            await client.call_tool(
                TOOL, {"agent": "worker", "message": "new era", "session": "modern"}
            )
            event = await asyncio.wait_for(sub.__anext__(), 5.0)
            assert getattr(event, "uri", None) == resource
        page = await transcript(client, resource)
        assert [m["content"] for m in page["data"]] == ["new era", "Echo: new era"]
        with pytest.raises(MCPError) as refused:
            async with listen(client, resource_subscriptions=[uri("theirs", "x")]):
                pass
        assert refused.value.error.code == mt.INVALID_PARAMS


async def refusal(call: Awaitable[object]) -> mt.ErrorData:
    """The protocol error ``call`` is refused with."""
    with pytest.raises(MCPError) as refused:
        await call
    return refused.value.error


@LEGACY_SUBSCRIBE
@pytest.mark.parametrize(
    ("resource", "rule", "fault"),
    [
        (uri("theirs", "x"), "agent.not_found", False),  # another organization's
        (uri("nobody", "x"), "agent.not_found", False),
        ("leadgate://agents/worker/messages", "resource.unknown", False),
        (uri("worker", "x") + "?limit=1&limit=2", "query.repeated", False),
        (uri("worker", "x"), "service.unavailable", True),
    ],
)
async def test_listen_is_refused_as_read_and_subscribe_are(
    env: Env, monkeypatch: pytest.MonkeyPatch, resource: str, rule: str, fault: bool
) -> None:
    """``subscriptions/listen`` (and a 2026-07-28 read) of a URI the service refuses
    named ``mcp.request`` and no ``uri`` (the bridge took the transport's HTTP 400 for
    one of the SDK's own refusals); it is the error a handshake-era read and
    subscription get."""
    db = env.service.db

    def down() -> None:  # the next database call fails (the lookup's)
        if fault:
            monkeypatch.setattr(db, "read", DownFor(db.read, 1, after_commit=False))

    async with session(env) as old, session(env) as modern:
        await old.initialize()
        await modern.discover()
        answers = []
        for call in (
            lambda: old.read_resource(resource),
            lambda: old.subscribe_resource(resource),
            lambda: modern.read_resource(resource),
            lambda: listened(modern, resource),
        ):
            down()
            answers.append(await refusal(call()))
    assert answers[0].data is not None and answers[0].data["uri"] == resource
    assert answers[0].data["rule"] == rule
    assert [(a.code, a.data) for a in answers] == [(answers[0].code, answers[0].data)] * 4
    # The same words, but that a database fault tells the reads (not the subscription
    # and the listen, which may create the session) the database is unavailable.
    if fault:
        assert [a.message for a in answers[::2]] == [CANNOT_READ] * 2
    else:
        assert answers == [answers[0]] * 4


async def test_a_database_fault_reading_a_transcript_is_a_server_error_naming_its_rule(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database fault met reading a transcript was ``INVALID_PARAMS`` ("change your
    request") with no rule; it is ``INTERNAL_ERROR`` naming the rule and when to retry,
    and the retry answers. A refusal of the request itself names its rule too."""
    resource = uri("worker", "fault")
    async with session(env) as client:
        await client.initialize()
        db = env.service.db
        monkeypatch.setattr(db, "read", DownFor(db.read, 1, after_commit=False))
        with pytest.raises(MCPError) as failed:
            await client.read_resource(resource)
        assert failed.value.error.code == mt.INTERNAL_ERROR
        # (not "nothing was stored": it only reads)
        assert failed.value.error.message == CANNOT_READ
        assert failed.value.error.data == {
            "uri": resource,
            "rule": "service.unavailable",
            "retryAfterS": 2,
        }
        assert (await transcript(client, resource))["data"] == []
        bad = uri("worker", "fault") + "?limit=1000"
        with pytest.raises(MCPError) as refused:
            await client.read_resource(bad)
        assert refused.value.error.code == mt.INVALID_PARAMS
        assert refused.value.error.data == {"uri": bad, "rule": "transcript.limit"}


async def test_a_listen_stream_hears_only_its_own_sessions(env: Env) -> None:
    """The same URI text names another session in each organization, and in each key's
    ``default``: an update goes only to the streams opened on its session. Each stream
    also listens to a session only it writes to; its first event must be that one's (a
    stray update would have been written to it first: one task sends them in order)."""
    await make_agent(env.service, env.other, "worker")
    second_key = await make_key(env.service, env.org, Scope.trigger)
    shared, default = uri("worker", "shared"), uri("worker", "default")
    async with (
        session(env) as a,
        session(env, env.other.key) as b,
        session(env, second_key) as c,
    ):
        for client in (a, b, c):
            await client.discover()
        async with (
            listen(a, resource_subscriptions=[shared, default]) as heard_a,
            listen(b, resource_subscriptions=[shared, uri("worker", "b-own")]) as heard_b,
            listen(c, resource_subscriptions=[default, uri("worker", "c-own")]) as heard_c,
        ):
            await a.call_tool(TOOL, {"agent": "worker", "message": "mine", "session": "shared"})
            await a.call_tool(TOOL, {"agent": "worker", "message": "mine too"})
            heard = {getattr(await asyncio.wait_for(heard_a.__anext__(), 5.0), "uri", None)}
            while heard != {shared, default}:
                heard.add(getattr(await asyncio.wait_for(heard_a.__anext__(), 5.0), "uri", None))
            for client, stream, own in ((b, heard_b, "b-own"), (c, heard_c, "c-own")):
                await client.call_tool(TOOL, {"agent": "worker", "message": "x", "session": own})
                event = await asyncio.wait_for(stream.__anext__(), 5.0)
                assert getattr(event, "uri", None) == uri("worker", own)


async def test_a_listen_stream_ends_once_its_key_is_revoked(env: Env) -> None:
    key = await make_key(env.service, env.org, Scope.trigger)
    async with session(env, key) as client:
        await client.discover()
        async with listen(client, resource_subscriptions=[uri("worker", "rv")]) as stream:
            async with env.service.db.tx() as conn:
                await orgs.revoke_key(conn, env.service.clock, env.org.id, key.split(".")[1])
            assert isinstance(env.service.clock, FakeClock)
            env.service.clock.advance(5_001)  # past the key cache's lifetime
            with pytest.raises((SubscriptionLost, StopAsyncIteration)):
                await asyncio.wait_for(stream.__anext__(), 10.0)
        with pytest.raises(MCPError):  # and the key opens nothing new
            async with listen(client, resource_subscriptions=[uri("worker", "rv")]):
                pass


@LEGACY_SUBSCRIBE
async def test_subscriptions_to_a_deleted_agents_session_end(env: Env) -> None:
    """Every ``events_reauth_s`` the subscribed sessions are checked (one read for all):
    a deleted agent's subscriptions (either era) hear no more of its session, which every
    read now refuses. Its held work was still decided after the deletion, and each
    decision went on reaching the subscribers."""
    doomed = await make_agent(env.service, env.org, "doomed", lead="lead")
    gone, kept, marker = uri("doomed", "d"), uri("worker", "k"), uri("worker", "z")
    assert env.service._mcp is not None and env.service._mcp.resources is not None
    resources = env.service._mcp.resources
    async with session(env) as client, session(env) as modern:
        await client.initialize()
        await client.subscribe_resource(gone)
        await client.subscribe_resource(kept)
        await client.subscribe_resource(marker)
        await modern.discover()
        async with listen(modern, resource_subscriptions=[gone, kept]):
            await client.call_tool(
                TOOL, {"agent": "doomed", "message": "risky #escalate #complete", "session": "d"}
            )
            await env.settle()  # the lead escalates: held for a person
            # One task sends the updates in order: once the kept session's (asked for
            # after) arrived, every update of the doomed one so far did.
            await client.call_tool(TOOL, {"agent": "worker", "message": "one", "session": "k"})
            await eventually(lambda: kept in env.updates)
            assert gone in env.updates
            before = len(env.updates)
            assert len(resources.sessions()) == 3
            async with env.service.db.read() as conn:
                held = sa.select(t.work_items.c.id).where(t.work_items.c.agent_id == doomed["id"])
                item_id = (await conn.execute(held)).scalar_one()
            await delete_agent(env.service, env.org, doomed["id"])
            # Both eras' hold on the doomed session is gone; the kept one's stays.
            await eventually(lambda: resources.subscriptions == 2)
            await eventually(lambda: len(resources.sessions()) == 2)
            await env.service.reviews.decide(env.org.principal, item_id, "reject", "no")
            # The marker's update is sent after any the rejection would have sent.
            await client.call_tool(TOOL, {"agent": "worker", "message": "two", "session": "z"})
            await eventually(lambda: marker in env.updates[before:])
            assert gone not in env.updates[before:]
        with pytest.raises(MCPError) as refused:
            await client.read_resource(gone)
        assert refused.value.error.code == mt.INVALID_PARAMS


@LEGACY_SUBSCRIBE
async def test_subscribed_sessions_are_kept_notified_by_every_replica(env: Env) -> None:
    """On PostgreSQL other replicas NOTIFY a session's events only while it is marked
    watched: a subscription (either era) marks its session before it is confirmed, and
    the hub's renewals cover the sessions subscribed here until they are not. (SQLite
    has no marks; a recording one stands in for PostgreSQL's.)"""
    marked: list[list[str]] = []

    async def mark(session_ids: Sequence[str]) -> None:
        marked.append(sorted(session_ids))

    hub = env.service.event_hub
    hub.mark = mark
    old, modern = uri("worker", "old"), uri("worker", "modern")
    async with session(env) as client:
        await client.initialize()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # removed in 2026-07-28
            await client.subscribe_resource(old)
        assert len(marked) == 1
        async with session(env) as modern_client:
            await modern_client.discover()
            async with listen(modern_client, resource_subscriptions=[modern]):
                assert len(marked) == 2
                await hub.renew()
                assert marked[-1] == sorted(marked[0] + marked[1])
            assert env.service._mcp is not None and env.service._mcp.resources is not None
            resources = env.service._mcp.resources
            # The server ends the listen stream after the client.
            await eventually(lambda: resources.sessions() == set(marked[0]))
            await hub.renew()
            assert marked[-1] == marked[0]  # the listen stream ended
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            await client.unsubscribe_resource(old)
        renewals = len(marked)
        await hub.renew()
        assert len(marked) == renewals  # nothing is read here any more


@LEGACY_SUBSCRIBE
async def test_a_subscription_hears_a_turn_on_another_replica(pg_url: str) -> None:
    """PostgreSQL, two services: a turn taken by one replica reaches the MCP subscriber
    of another (resources/updated), though writers NOTIFY only watched sessions: the
    subscription marked its session before it was confirmed."""
    import asyncpg

    from leadgate.database.db import upgrade
    from leadgate.database.pg import asyncpg_dsn
    from tests.serving import served_app

    await asyncio.to_thread(upgrade, pg_url)
    settings = Settings.model_validate({"database": {"url": pg_url}})
    reader = App(settings, clock=FakeClock(), enable_adapters=False)
    runner = web.AppRunner(reader.web_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    probe = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        async with served_app(pg_url) as (writer, writer_client):
            org = await make_org(writer)
            await make_agent(writer, org, "plain")

            async def both_listening() -> bool:
                listening = await probe.fetchval(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND query LIKE 'LISTEN %'"
                )
                return bool(listening >= 2)

            # Both replicas' LISTEN connections are up (a NOTIFY before is not heard).
            await eventually(both_listening, what="both replicas' LISTEN connections")
            env = Env(reader, f"http://{host}:{port}/mcp", org, org)
            resource = uri("plain", "across")
            async with session(env) as client:
                await client.initialize()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    await client.subscribe_resource(resource)
                sent = await writer_client.post(
                    "/v1/chat/completions",
                    json={"model": "plain", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"Authorization": f"Bearer {org.key}", "X-Session-Id": "across"},
                )
                assert sent.status == 200
                await eventually(lambda: env.updates, 5)
                assert set(env.updates) == {resource}
    finally:
        await probe.close()
        await runner.cleanup()
        await reader.stop()


#: The idle timeout of test_idle_sessions_expire: the SDK counts it in real time, from
#: the end of a session's last request, so the ping after ``initialize`` must come
#: within it; at 1 s a loaded machine (the whole suite on two CPUs) could miss that.
IDLE_S = 2.0


async def test_idle_sessions_expire(migrated_url: str) -> None:
    init = mcp_initialize("2025-11-25")
    async with (
        served_env(migrated_url, mcp_session_idle_s=IDLE_S) as env,
        httpx2.AsyncClient() as http,
    ):
        headers = {
            "Accept": "application/json, text/event-stream",
            "Authorization": f"Bearer {env.org.key}",
        }
        opened = await http.post(env.url, json=init, headers=headers)
        assert opened.status_code == 200
        sid = {**headers, "Mcp-Session-Id": opened.headers["mcp-session-id"]}
        sid["Mcp-Protocol-Version"] = "2025-11-25"
        ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
        assert (await http.post(env.url, json=ping, headers=sid)).status_code == 200
        # No request in flight for longer than the idle timeout: gone.
        await asyncio.sleep(IDLE_S + 1.0)
        assert (await http.post(env.url, json=ping, headers=sid)).status_code == 404
        # A new session works.
        assert (await http.post(env.url, json=init, headers=headers)).status_code == 200
