"""Studio's HTTP side (SPEC 13) through a real aiohttp server on 127.0.0.1: the console
cookie and its CSRF rule, roles, the ``studio`` binding, the page's strict CSP, and the
events stream on the cookie. (The page itself: tests/acceptance/test_studio_browser.py.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from aiohttp import web
from aiohttp.test_utils import TestClient

from leadgate.app import App
from leadgate.database import schema as t
from leadgate.domain import orgs
from tests.helpers import Org, make_agent, make_org
from tests.integration.test_sessions_api import Stream
from tests.serving import served_app

PASSWORD = "correct horse battery"
#: PASSWORD's argon2 hash, made once (users are created with a hash).
HASHED = orgs.hash_password(PASSWORD)
CSRF = {"X-Leadgate-Console": "1"}


@dataclass
class Env:
    service: App
    client: TestClient[web.Request, web.Application]
    org: Org

    async def login(self, email: str, role: str, org: Org | None = None) -> None:
        async with self.service.db.tx() as conn:
            await orgs.create_user(
                conn,
                self.service.clock,
                self.service.ids,
                (org or self.org).id,
                email,
                role,
                HASHED,
            )
        resp = await self.client.post(
            "/console/login", json={"email": email, "password": PASSWORD}, headers=CSRF
        )
        assert resp.status == 200


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    """SQLite only: the surface (the reads it shares are tested on both backends)."""
    return f"sqlite+aiosqlite:///{tmp_path}/t.db"


@pytest.fixture
async def env(migrated_url: str) -> AsyncIterator[Env]:
    # Streams check their console session every 50 ms (instead of 5 s).
    config = {"api": {"events_reauth_s": 0.05}}
    async with served_app(migrated_url, config=config) as (service, client):
        org = await make_org(service)
        await make_agent(service, org, "lead")
        await make_agent(service, org, "worker", lead="lead")
        await make_agent(service, org, "plain")
        yield Env(service, client, org)


async def test_page_and_assets_have_the_strict_policy(env: Env) -> None:
    for path, kind in (
        ("/console/studio/", "text/html"),
        ("/console/studio/static/studio.js", "text/javascript"),
        ("/console/studio/static/studio.css", "text/css"),
    ):
        resp = await env.client.get(path)
        assert resp.status == 200 and resp.content_type == kind
        csp = resp.headers["Content-Security-Policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp
        assert "unsafe-inline" not in csp
    moved = await env.client.get("/console/studio", allow_redirects=False)
    assert moved.status == 302 and moved.headers["Location"] == "/console/studio/"
    console = await (await env.client.get("/console/")).text()
    assert 'href="/console/studio/"' in console


async def test_member_chats_on_the_studio_binding(env: Env) -> None:
    await env.login("mia@example.com", "Member")
    agents = await (await env.client.get("/console/studio/agents")).json()
    assert {a["slug"] for a in agents["data"]} == {"lead", "worker", "plain"}
    path = "/console/studio/agents/plain/sessions/chat/messages"
    no_header = await env.client.post(path, json={"message": "hi"})
    assert no_header.status == 401 and (await no_header.json())["error"]["rule"] == "csrf"
    reply = await env.client.post(path, json={"message": "hi"}, headers=CSRF)
    assert await reply.json() == {"outcome": "reply", "text": "Echo: hi"}
    gated = await env.client.post(
        "/console/studio/agents/worker/sessions/chat/messages",
        json={"message": "x #escalate #complete"},
        headers=CSRF,
    )
    assert await gated.json() == {"outcome": "pending"}
    busy = await env.client.post(
        "/console/studio/agents/worker/sessions/chat/messages",
        json={"message": "again"},
        headers=CSRF,
    )
    # Named as REST's busy 409 and MCP's busy tool error name it (it was studio.busy).
    assert busy.status == 409 and (await busy.json())["error"]["rule"] == "turn.busy"
    empty = await env.client.post(path, json={"message": ""}, headers=CSRF)
    assert empty.status == 400
    async with env.service.db.read() as conn:
        kinds = (
            await conn.execute(
                sa.select(t.bindings.c.kind)
                .select_from(
                    t.bindings.join(t.sessions, t.sessions.c.id == t.bindings.c.session_id)
                )
                .where(t.sessions.c.key == "h:chat", t.bindings.c.active)
            )
        ).scalars()
        assert set(kinds) == {"studio"}
    page = await (await env.client.get(path)).json()
    assert [m["content"] for m in page["data"]] == ["hi", "Echo: hi"]
    stream = await env.client.get("/console/studio/agents/plain/sessions/chat/events")
    assert stream.status == 200
    first = (await stream.content.readline()).decode()
    assert first == ": connected\n"
    stream.close()


async def test_viewers_and_strangers_cannot_chat(env: Env) -> None:
    anonymous = await env.client.get("/console/studio/agents")
    assert anonymous.status == 401
    await env.login("vic@example.com", "Viewer")
    assert (await env.client.get("/console/studio/agents")).status == 403
    denied = await env.client.post(
        "/console/studio/agents/plain/sessions/s/messages", json={"message": "hi"}, headers=CSRF
    )
    assert denied.status == 403


async def test_another_organizations_user_gets_404(env: Env) -> None:
    other = await make_org(env.service, "other")
    await env.login("otto@example.com", "Member", other)
    for method, path in (
        ("GET", "/console/studio/agents/plain/sessions/s/messages"),
        ("GET", "/console/studio/agents/plain/sessions/s/events"),
        ("POST", "/console/studio/agents/plain/sessions/s/messages"),
    ):
        resp = await env.client.request(method, path, json={"message": "hi"}, headers=CSRF)
        assert resp.status == 404, (method, path)


async def test_a_demoted_users_stream_ends(env: Env) -> None:
    """A user whose role no longer grants ``agent:trigger`` loses its open stream at the
    next re-check (``events_reauth_s``), told why and by which rule: the re-check asked
    only whether the console session was valid, and a demoted user went on hearing the
    session's messages for as long as the page stayed open."""
    await env.login("dee@example.com", "Member")
    resp = await env.client.get("/console/studio/agents/plain/sessions/chat/events")
    assert resp.status == 200
    stream = Stream(resp)
    path = "/console/studio/agents/plain/sessions/chat/messages"
    assert (await env.client.post(path, json={"message": "hi"}, headers=CSRF)).status == 200
    assert (await stream.next())["data"]["content"] == "hi"
    async with env.service.db.tx() as conn:
        await orgs.update_user(
            conn, env.service.clock, env.org.id, "dee@example.com", role="Viewer"
        )
    event = await stream.next()
    while event["event"] == "message":  # the reply to "hi" may still be on its way
        event = await stream.next()
    assert event["event"] == "end"
    assert event["data"] == {
        "reason": "this action requires the agent:trigger permission",
        "rule": "scope.agent:trigger",
    }
    assert await resp.content.read() == b""  # and the stream is over
    # Still logged in (the page shows the reason, not the login form), but refused.
    assert (await env.client.get("/console/me")).status == 200
    assert (await env.client.get(path)).status == 403


async def test_a_removed_users_stream_ends_naming_the_rule(env: Env) -> None:
    """A user disabled (removed) loses its console sessions, and its open stream ends
    at the next re-check naming ``console.session`` (the page then shows the login)."""
    await env.login("rue@example.com", "Member")
    resp = await env.client.get("/console/studio/agents/plain/sessions/gone/events")
    assert resp.status == 200
    stream = Stream(resp)
    async with env.service.db.tx() as conn:
        await orgs.update_user(
            conn, env.service.clock, env.org.id, "rue@example.com", disabled=True
        )
    event = await stream.next()
    assert event["event"] == "end"
    assert event["data"] == {
        "reason": "the key or console session is no longer valid",
        "rule": "console.session",
    }
    assert await resp.content.read() == b""
    assert (await env.client.get("/console/me")).status == 401
