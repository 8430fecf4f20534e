"""The served app's routes and hosted MCP capabilities, by enumeration, with real ids to
fill them: what the tests that go through every route share (``test_confinement``: each
is confined to its caller's organization; ``test_database_down``: each answers a
database fault as documented).

:func:`served_routes` lists ``app.router.routes()`` (with the Slack, Discord and Teams
webhooks mounted: :func:`config`); :data:`FILLS` knows how to call each route that is not
:data:`PUBLIC` or a :data:`WEBHOOKS` entry, on the names and ids of :class:`Names`
(organization A's real ones from :func:`world`, or ones nobody has from :func:`unknown`);
:data:`MCP_TOOLS` and :data:`MCP_TEMPLATES` the same for the hosted MCP server. A route
or capability not in them fails the tests that enumerate them, so whoever adds one adds
it here.
"""

from __future__ import annotations

import itertools
import json
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import httpx2
import mcp_types as mt
import sqlalchemy as sa
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestServer
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from leadgate.app import App
from leadgate.core.runners import drain
from leadgate.database import schema as t
from leadgate.domain import agents as agents_mod
from leadgate.domain import orgs
from leadgate.web.common import SESSION_COOKIE
from tests.helpers import (
    Org,
    listened,
    make_agent,
    make_org,
    mcp_initialize,
    session_item,
    slack_trigger,
)
from tests.serving import Client

PASSWORD = "correct horse battery"
CONSOLE = {"X-Leadgate-Console": "1"}

#: Routes anyone may call, each for a reason. Every other route must refuse a request
#: without credentials and confine one with credentials to the caller's organization.
PUBLIC: Mapping[str, str] = {
    "GET /healthz": "liveness for load balancers; says nothing of any organization",
    "GET /metrics": "counters over every organization, no names or ids; open only on a "
    "loopback listener, else behind [server] metrics_token or metrics_host "
    "(tests/reliability/test_channel_inputs.py)",
    "GET /openapi.json": "the published API document",
    "GET /favicon.ico": "an empty icon for browsers",
    "GET /console": "redirect to the console page",
    "GET /console/": "the console page (static; its data comes from the routes below)",
    "GET /console/static/{name}": "the console's script and style sheet",
    "GET /console/studio": "redirect to the Studio page",
    "GET /console/studio/": "the Studio page (static)",
    "GET /console/studio/static/{name}": "Studio's script and style sheet",
    "POST /console/login": "where a console session starts (rate-limited, see Security)",
    "POST /console/logout": "ends the session its own cookie names, if any; without one "
    "there is nothing to end",
}

#: Channel webhooks: authenticated by the platform's signature, not by a key. Without
#: one they refuse (this status) and take nothing in.
WEBHOOKS: Mapping[str, int] = {
    "POST /slack/events": 401,
    "POST /discord/interactions": 401,
    "POST /api/messages": 401,
}


@dataclass(frozen=True)
class Names:
    """The names and ids a request fills in: organization A's real ones, or ones of the
    same shape that nobody has."""

    agent: str  # a worker agent's name (``model``, ``{agent}``)
    agent_id: str
    lead: str  # its lead's name
    lead_id: str
    preset: str  # an organization preset's name
    preset_id: str
    session: str  # a public session name with messages in it
    message: str  # the id of a message in that session
    item: str  # a work item awaiting a human decision
    idempotency_key: str  # an Idempotency-Key A used
    delivery: str  # a pending delivery
    mcp_session: str  # an open MCP session's id (Mcp-Session-Id)


#: B's own agent and session (B reaches them; a query naming A's ids rides on them).
B_AGENT, B_SESSION = "b-own", "b-sess"


@dataclass(frozen=True)
class Call:
    """One request: a path with its query, and a JSON body for writes."""

    path: str
    body: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    #: the call rides on B's own objects (only a query names A's): A's key cannot reach
    #: it, so it is not part of the check that the fill names A's real objects
    on_b: bool = False
    #: whether the two answers are compared whole, or (a new turn each: its answer has
    #: its own ids and usage) by status and type only
    exact: bool = True


def at(template: str, **values: str) -> str:
    """``template`` with each ``{name}`` replaced by ``values[name]``."""
    for name, value in values.items():
        template = template.replace(f"{{{name}}}", value)
    assert "{" not in template, template
    return template


def chat(w: Names, _: str) -> list[Call]:
    message = [{"role": "user", "content": "hello"}]
    body = {"model": w.agent, "messages": message, "user": w.session}
    mine = {"model": B_AGENT, "messages": message}
    return [
        Call("/v1/chat/completions", body),
        # B's own agent, under the Idempotency-Key A used for another request.
        Call(
            "/v1/chat/completions",
            mine,
            {"Idempotency-Key": w.idempotency_key},
            on_b=True,
            exact=False,
        ),
    ]


def transcript(w: Names, path: str) -> list[Call]:
    # A's agent and session; and B's own session asked to page after A's message.
    return [
        Call(at(path, agent=w.agent, session=w.session)),
        Call(at(path, agent=w.agent_id, session=w.session)),
        Call(at(path, agent=B_AGENT, session=B_SESSION) + f"?after={w.message}", on_b=True),
    ]


def stream(w: Names, path: str) -> list[Call]:
    return [
        Call(at(path, agent=w.agent, session=w.session)),
        Call(at(path, agent=w.agent_id, session=w.session)),
    ]


def studio_send(w: Names, path: str) -> list[Call]:
    return [Call(at(path, agent=w.agent, session=w.session), {"message": "hello"})]


def agent_ref(w: Names, path: str) -> list[Call]:
    return [Call(at(path, agent_id=w.agent_id)), Call(at(path, agent_id=w.agent))]


def references(w: Names) -> list[dict[str, str]]:
    """Agent bodies naming A's lead or preset (by name and by id)."""
    return [
        {"leadAgentId": w.lead},
        {"leadAgentId": w.lead_id},
        {"presetId": w.preset},
        {"presetId": w.preset_id},
    ]


def agent_update(w: Names, path: str) -> list[Call]:
    body = {"instructions": "taken over"}
    return [Call(at(path, agent_id=w.agent_id), body), Call(at(path, agent_id=w.agent), body)] + [
        # B's own agent given A's lead or preset: as if they did not exist.
        Call(at(path, agent_id=B_AGENT), ref, on_b=True)
        for ref in references(w)
    ]


def agent_create(w: Names, path: str) -> list[Call]:
    # A new agent of B's naming A's lead or preset: B must not learn A has them (and
    # A's key, creating it, succeeds once per name: a new name each time).
    return [
        Call(path, {"name": f"new-{n}", "model": "script", **ref})
        for n, ref in enumerate(references(w))
    ]


def listing(w: Names, path: str) -> list[Call]:
    """A route without ids: only checked for what it quotes."""
    return [Call(path)]


def filtered(w: Names, path: str) -> list[Call]:
    return [Call(f"{path}?agent={w.agent}"), Call(f"{path}?agent={w.agent_id}")]


def activity(w: Names, path: str) -> list[Call]:
    return [
        Call(f"{path}?agent={w.agent}"),
        Call(f"{path}?agent={w.agent_id}"),
        Call(f"{path}?q={w.item}"),  # (the cursor is opaque, not an id)
    ]


def review(w: Names, path: str) -> list[Call]:
    return [Call(at(path, item_id=w.item))]


def decide(w: Names, path: str) -> list[Call]:
    # With the text a reject or return needs (and no other field: 400), so the request
    # passes its validation.
    text = {"reject": "reason", "return": "feedback"}.get(path.rsplit("/", 1)[-1])
    body = {text: "decided by someone else"} if text else {}
    return [Call(at(path, item_id=w.item), body)]


def delivery(w: Names, path: str) -> list[Call]:
    return [Call(at(path, delivery_id=w.delivery), {})]


def model(w: Names, path: str) -> list[Call]:
    return [Call(at(path, model=w.agent)), Call(at(path, model=w.agent_id))]


MCP_HEADERS = {
    "Accept": "application/json, text/event-stream",
    "Mcp-Protocol-Version": "2025-11-25",
}


def mcp_session(w: Names, path: str) -> list[Call]:
    # GET opens the session's stream, DELETE ends the session; POST sends a ping on it.
    ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
    return [Call(path, ping, {**MCP_HEADERS, "Mcp-Session-Id": w.mcp_session})]


#: How to fill each route (``METHOD canonical path``; a path segment that takes one of a
#: few fixed words, such as a decision's action, is filled with each word in turn).
FILLS: Mapping[str, Callable[[Names, str], list[Call]]] = {
    "POST /v1/chat/completions": chat,
    "GET /v1/models": listing,
    "GET /v1/models/{model}": model,
    "GET /v1/agents": listing,
    "POST /v1/agents": agent_create,
    "GET /v1/agents/{agent_id}": agent_ref,
    "PATCH /v1/agents/{agent_id}": agent_update,
    "GET /v1/agents/{agent}/sessions/{session}/messages": transcript,
    "GET /v1/agents/{agent}/sessions/{session}/events": stream,
    "GET /console/studio/agents": listing,
    "GET /console/studio/agents/{agent}/sessions/{session}/messages": transcript,
    "POST /console/studio/agents/{agent}/sessions/{session}/messages": studio_send,
    "GET /console/studio/agents/{agent}/sessions/{session}/events": stream,
    "GET /console/me": listing,
    "GET /operator/reviews": filtered,
    "GET /operator/reviews/{item_id}": review,
    "POST /operator/reviews/{item_id}/{action}": decide,
    "POST /operator/deliveries/{delivery_id}/{action}": delivery,
    "GET /operator/activity": activity,
    "GET /operator/deliveries": listing,
    "GET /operator/insights": listing,
    "GET /operator/insights/charts/{name}.svg": listing,
    "GET /operator/events": listing,
    # MCP's own protocol on A's session id; its tools and templates are probed one by
    # one below.
    "GET /mcp": mcp_session,
    "POST /mcp": mcp_session,
    "DELETE /mcp": mcp_session,
}


WORDS = re.compile(r"\(\?P<(\w+)>(\w+(?:\|\w+)+)\)")


def web_app(client: Client) -> web.Application:
    """The application ``client`` is served (aiohttp types the server as the base
    class, which has no ``app``)."""
    assert isinstance(client.server, TestServer)
    return client.server.app


def served_routes(client: Client) -> list[tuple[str, str]]:
    """Every ``(METHOD canonical path, path)`` the app serves, public ones included (HEAD
    aside: aiohttp adds it to GET), a parameter of a few fixed words expanded into one
    path per word."""
    found: list[tuple[str, str]] = []
    for route in web_app(client).router.routes():
        if route.method == "HEAD" or route.resource is None:
            continue
        canonical = route.resource.canonical
        key = f"{route.method} {canonical}"
        info = route.resource.get_info()
        words = dict(WORDS.findall(info["pattern"].pattern)) if "pattern" in info else {}
        choices = [
            [(name, w) for w in alternatives.split("|")] for name, alternatives in words.items()
        ]
        for combination in itertools.product(*choices):
            path = canonical
            for name, word in combination:
                path = path.replace(f"{{{name}}}", word)
            found.append((key, path))
    return found


def routes(client: Client) -> list[tuple[str, str]]:
    """:func:`served_routes` but the :data:`PUBLIC` ones."""
    return [(key, path) for key, path in served_routes(client) if key not in PUBLIC]


def unknown_routes(client: Client) -> list[str]:
    """Routes served that are in none of :data:`FILLS`, :data:`PUBLIC` and
    :data:`WEBHOOKS`, and routes named there that are not served (an empty list: the
    tables describe the app)."""
    served = {key for key, _ in served_routes(client)}
    known = set(FILLS) | set(PUBLIC) | set(WEBHOOKS)
    return [f"not known here: {key}" for key in sorted(served - known)] + [
        f"named here, not served: {key}" for key in sorted(known - served)
    ]


@dataclass
class Answer:
    """What a client learns from an answer (a stream: only its status and type)."""

    status: int
    content_type: str
    body: str

    def named(self, names: Names) -> Answer:
        """The answer with each of ``names`` replaced by its field's name."""
        body = self.body
        for f in fields(names):
            body = body.replace(getattr(names, f.name), f"<{f.name}>")
        return Answer(self.status, self.content_type, body)

    def outline(self) -> Answer:
        """Only the status and type (an error keeps its envelope)."""
        return self if self.status >= 400 else Answer(self.status, self.content_type, "")


async def answer(resp: ClientResponse) -> Answer:
    async with resp:
        if resp.content_type == "text/event-stream":
            return Answer(resp.status, resp.content_type, "<stream>")
        return Answer(resp.status, resp.content_type, await resp.text())


class Prober:
    """Requests as one caller: a bearer key, or a console session cookie."""

    def __init__(self, client: Client, *, key: str = "", cookie: str = "") -> None:
        self.client = client
        self.headers: dict[str, str] = {}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"
        if cookie:
            self.headers.update({"Cookie": f"{SESSION_COOKIE}={cookie}", **CONSOLE})

    #: whether a redirect is followed (the answer is the redirect's target's)
    follow_redirects = True

    async def __call__(self, method: str, call: Call) -> Answer:
        resp = await self.client.request(
            method,
            call.path,
            headers={**self.headers, **call.headers},
            json=call.body if method in ("POST", "PATCH", "PUT") else None,
            allow_redirects=self.follow_redirects,
        )
        return await self.read(resp)

    async def read(self, resp: ClientResponse) -> Answer:
        """The :class:`Answer` of ``resp``."""
        return await answer(resp)


async def world(service: App, client: Client, org: Org) -> Names:
    """Organization A's objects: a worker with a lead, a preset, a session with
    messages, an item awaiting a human, a pending Slack delivery, an MCP session."""
    lead = await make_agent(service, org, "a-lead")
    async with service.db.tx() as conn:
        preset = await agents_mod.create_preset(
            conn, service.clock, service.ids, org_id=org.id, name="a-preset"
        )
    worker = await make_agent(service, org, "a-worker", lead="a-lead")
    plain = await make_agent(service, org, "a-plain")
    resp = await client.post(
        "/v1/chat/completions",
        json={
            "model": "a-worker",
            "messages": [{"role": "user", "content": "x #complete #escalate"}],
        },
        headers={
            "Authorization": f"Bearer {org.key}",
            "X-Session-Id": "a-sess",
            "Idempotency-Key": "a-idempotency-key",
        },
    )
    assert resp.status == 409, await resp.text()
    await drain(service.lead_runner)
    item = await session_item(service, "h:a-sess")
    async with service.db.read() as conn:
        message = await conn.scalar(
            sa.select(t.messages.c.id)
            .join(t.sessions, t.sessions.c.id == t.messages.c.session_id)
            .where(t.sessions.c.key == "h:a-sess")
        )
    await service.turns.run(slack_trigger(org, plain, "hello", "1700000000.000100"))
    async with service.db.read() as conn:
        pending = await conn.scalar(
            sa.select(t.deliveries.c.id).where(t.deliveries.c.org_id == org.id)
        )
    resp = await client.post(
        "/mcp",
        json=mcp_initialize("2025-11-25"),
        headers={**MCP_HEADERS, "Authorization": f"Bearer {org.key}"},
    )
    assert resp.status == 200, await resp.text()
    return Names(
        agent="a-worker",
        agent_id=str(worker["id"]),
        lead="a-lead",
        lead_id=str(lead["id"]),
        preset="a-preset",
        preset_id=str(preset["id"]),
        session="a-sess",
        message=str(message),
        item=item,
        idempotency_key="a-idempotency-key",
        delivery=str(pending),
        mcp_session=resp.headers["Mcp-Session-Id"],
    )


def unknown(service: App, a: Names) -> Names:
    """Names and ids of A's shape that nobody has."""

    def like(value: str) -> str:
        prefix, _, _ = value.partition("_")
        return service.ids.new(prefix)

    return Names(
        agent="no-such-agent",
        agent_id=like(a.agent_id),
        lead="no-such-lead",
        lead_id=like(a.lead_id),
        preset="no-such-preset",
        preset_id=like(a.preset_id),
        session="no-such-session",
        message=like(a.message),
        item=like(a.item),
        idempotency_key="no-such-idempotency-key",
        delivery=like(a.delivery),
        mcp_session=uuid.uuid4().hex,
    )


async def console_cookie(service: App, client: Client, org: Org, email: str) -> str:
    """A console session of an Owner of ``org`` (the cookie's value)."""
    async with service.db.tx() as conn:
        await orgs.create_user(
            conn, service.clock, service.ids, org.id, email, "Owner", orgs.hash_password(PASSWORD)
        )
    resp = await client.post(
        "/console/login", json={"email": email, "password": PASSWORD}, headers=CONSOLE
    )
    assert resp.status == 200, await resp.text()
    cookie = resp.cookies[SESSION_COOKIE].value
    client.session.cookie_jar.clear()  # each prober sends its own credentials
    return cookie


@dataclass
class Scene:
    """The served app with organization A's objects and organization B's callers."""

    service: App
    client: Client
    a: Org
    b: Org
    names: Names  # A's
    nobody: Names
    b_cookie: str

    @property
    def secrets(self) -> list[str]:
        """What no answer to B may quote."""
        return [getattr(self.names, f.name) for f in fields(self.names)] + ["a-plain", self.a.id]

    def quoted(self, text: str, sent: str) -> list[str]:
        """The secrets ``text`` quotes that were not ``sent`` (an error may name what
        the request named: the caller knew that already)."""
        return [s for s in self.secrets if s in text and s not in sent]


async def scene(service: App, client: Client) -> Scene:
    """Organizations A (with :func:`world`) and B (its own agent and session, an Owner
    logged in to the console)."""
    a, b = await make_org(service, "org-a"), await make_org(service, "org-b")
    names = await world(service, client, a)
    await make_agent(service, b, B_AGENT)
    resp = await client.post(
        "/v1/chat/completions",
        json={"model": B_AGENT, "messages": [{"role": "user", "content": "mine"}]},
        headers={"Authorization": f"Bearer {b.key}", "X-Session-Id": B_SESSION},
    )
    assert resp.status == 200, await resp.text()
    b_cookie = await console_cookie(service, client, b, "owner@b.example")
    return Scene(service, client, a, b, names, unknown(service, names), b_cookie)


# ------------------------------------------------------------------------ hosted MCP


def send_message(w: Names) -> list[dict[str, Any]]:
    return [
        {"agent": w.agent, "message": "hello", "session": w.session},
        {"agent": w.agent_id, "message": "hello", "session": w.session},
    ]


def transcript_uris(w: Names) -> list[str]:
    base = "leadgate://agents/{agent}/sessions/{session}/messages"
    return [
        at(base, agent=w.agent, session=w.session),
        at(base, agent=w.agent_id, session=w.session),
    ]


#: How to fill each MCP tool (its arguments) and resource template (its URIs).
MCP_TOOLS: Mapping[str, Callable[[Names], list[dict[str, Any]]]] = {
    "send_action_agent_message": send_message,
}
MCP_TEMPLATES: Mapping[str, Callable[[Names], list[str]]] = {
    "leadgate://agents/{agent}/sessions/{session}/messages": transcript_uris,
}


@dataclass
class Eras:
    """One MCP client of each protocol era, with the same key."""

    handshake: ClientSession  # initialize, resources/subscribe
    modern: ClientSession  # server/discover, subscriptions/listen (2026-07-28)


@asynccontextmanager
async def mcp_clients(s: Scene, key: str) -> AsyncIterator[Eras]:
    """An MCP client session with ``key`` of each protocol era."""
    url = str(s.client.make_url("/mcp"))
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as http,
        streamable_http_client(url, http_client=http) as (r1, w1),
        ClientSession(r1, w1) as handshake,
        streamable_http_client(url, http_client=http) as (r2, w2),
        ClientSession(r2, w2) as modern,
    ):
        await handshake.initialize()
        await modern.discover()
        yield Eras(handshake, modern)


def tool_answer(result: mt.CallToolResult) -> str:
    """A tool result as text."""
    return json.dumps(result.model_dump(mode="json", by_alias=True), sort_keys=True)


async def resource_answer(call: Awaitable[Any]) -> str:
    """A resource call's result or protocol error as text."""
    try:
        result = await call
        text = (
            result
            if isinstance(result, str)
            else json.dumps(result.model_dump(mode="json", by_alias=True), sort_keys=True)
        )
    except MCPError as exc:
        text = json.dumps(exc.error.model_dump(mode="json", by_alias=True), sort_keys=True)
    return text


async def mcp_answers(clients: Eras, names: Names) -> list[tuple[str, str]]:
    """Every tool called, and every template read, subscribed to and listened to, on
    ``names``: what was sent and what came back, each as text."""
    session = clients.handshake
    answers: list[tuple[str, str]] = []
    tools = (await session.list_tools()).tools
    unfilled = sorted(tool.name for tool in tools if tool.name not in MCP_TOOLS)
    assert not unfilled, f"MCP tools this test does not know how to fill: {unfilled}"
    for tool in tools:
        for arguments in MCP_TOOLS[tool.name](names):
            result = await session.call_tool(tool.name, arguments)
            answers.append((json.dumps(arguments), tool_answer(result)))
    templates = (await session.list_resource_templates()).resource_templates
    unfilled = sorted(t.uri_template for t in templates if t.uri_template not in MCP_TEMPLATES)
    assert not unfilled, f"MCP templates this test does not know how to fill: {unfilled}"
    for template in templates:
        for uri in MCP_TEMPLATES[template.uri_template](names):
            answers.append((uri, await resource_answer(session.read_resource(uri))))
            answers.append((uri, await resource_answer(session.subscribe_resource(uri))))
            answers.append((uri, await resource_answer(listened(clients.modern, uri))))
    return answers
