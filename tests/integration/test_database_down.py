"""The database down, on every route and every MCP capability, by enumeration (README,
Reliability and security: "Faults answer 503").

The served app's routes and the hosted MCP server's tools and resource templates are
listed by :mod:`tests.integration.routes_kit` (as for ``test_confinement``), and each
is called with organization A's key, and again with A's console session cookie, on A's
real names and ids, while the database cannot be used:

- PostgreSQL: the service reaches it through a TCP proxy on 127.0.0.1, which the test
  closes (every connection cut, new ones refused: a server down or restarting);
- SQLite: another connection holds the file's write lock past ``[database]
  busy_timeout_s`` (another process writing). In WAL mode reads go on, so a call that
  only reads answers as usual; every write is refused.

The service's clock is moved past the key cache's lifetime as the outage starts, as
any outage longer than a few seconds does: every key is checked against the database
again.

Every answer is then the documented one: 503 with ``Retry-After`` in the error
envelope naming ``service.unavailable`` (or, on SQLite, a call that went through); a
channel webhook the platform's documented answer (Slack 503 before its last try and
200 with a word in the thread on it, Discord an ephemeral answer, Teams 202 after a
reply saying so; email 451); an MCP call the documented JSON-RPC error or tool error
naming the rule. Never a 500, never a traceback in a body or in the log, never an
answer later than :data:`CALL_S`. :data:`NO_DATABASE` lists the routes that need no
database, with what they answer. When the database is back every call is answered
again, without a restart, and the log had one WARNING line for the 503s, not one per
request.

A route or capability this module does not know fails the test: add it to the
tables of :mod:`tests.integration.routes_kit` (and, if it needs no database, to
:data:`NO_DATABASE`; a channel webhook to :data:`WEBHOOK_CALLS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import aiohttp
import mcp_types as mt
import pytest
from aiosmtpd.smtp import SMTP, Envelope, Session
from mcp.shared.exceptions import MCPError
from nacl.signing import SigningKey
from sqlalchemy.engine import make_url

from bots.email import EmailHandler
from leadgate.core.clock import FakeClock
from leadgate.core.errors import CANNOT_READ, NOTHING_STORED
from leadgate.core.runners import drain
from leadgate.operations.access import PRINCIPAL_TTL_S
from tests.helpers import LEGACY_SUBSCRIBE, held_sqlite_lock, listened, make_route
from tests.integration.routes_kit import (
    CONSOLE,
    FILLS,
    MCP_TEMPLATES,
    MCP_TOOLS,
    PASSWORD,
    PUBLIC,
    WEBHOOKS,
    Answer,
    Call,
    Eras,
    Prober,
    Scene,
    console_cookie,
    mcp_clients,
    scene,
    served_routes,
    unknown_routes,
)
from tests.integration.test_listener_liveness import SilenceableProxy
from tests.serving import Client, served_app
from tests.standins.connector import ConnectorStandin, message_activity, post_activity
from tests.standins.discord_api import interaction_headers
from tests.standins.slack_api import SlackApiStandin, signed_headers

pytestmark = [LEGACY_SUBSCRIBE, pytest.mark.timeout(120)]

#: No answer may take longer, fault or not.
CALL_S = 10.0
SLACK_SECRET = "slack-signing-secret"
OWNER = "owner@a.example"

#: Routes that need no database: (the path called, the status it answers), database
#: down or not.
NO_DATABASE: Mapping[str, tuple[str, int]] = {
    "GET /metrics": ("/metrics", 200),  # counters in process memory
    "GET /openapi.json": ("/openapi.json", 200),  # built from the routes
    "GET /favicon.ico": ("/favicon.ico", 204),
    "GET /console": ("/console", 302),
    "GET /console/": ("/console/", 200),  # static files; their data comes from the API
    "GET /console/static/{name}": ("/console/static/console.js", 200),
    "GET /console/studio": ("/console/studio", 302),
    "GET /console/studio/": ("/console/studio/", 200),
    "GET /console/studio/static/{name}": ("/console/studio/static/studio.js", 200),
}

#: Public routes that do use the database (the rest of :data:`PUBLIC` is in
#: :data:`NO_DATABASE`): how to call each. ``/healthz`` is what a load balancer asks
#: whether this replica can serve: with the database down it cannot.
PUBLIC_CALLS: Mapping[str, Callable[[], Call]] = {
    "GET /healthz": lambda: Call("/healthz"),
    "POST /console/login": lambda: Call(
        "/console/login", {"email": OWNER, "password": PASSWORD}, CONSOLE
    ),
    "POST /console/logout": lambda: Call("/console/logout", {}, CONSOLE),
}


@dataclass
class Signed:
    """A channel webhook's request as its platform sends it."""

    body: bytes
    headers: dict[str, str]


_counter = iter(range(100, 10_000))


def slack_event(retry_num: int | None) -> Signed:
    """A Slack message event (a new ``ts`` each time), signed, on try ``retry_num``."""
    n = next(_counter)
    ts = f"1700000100.{n:06d}"
    body = json.dumps(
        {
            "type": "event_callback",
            "team_id": "T0STANDIN",
            "event_id": f"Ev{n:010d}",
            "event": {
                "type": "message",
                "channel": "C0ASK",
                "user": "U0HUMAN",
                "text": f"SECRET-TEXT slack {n}",
                "ts": ts,
            },
        }
    )
    headers = signed_headers(SLACK_SECRET, body, retry_num=retry_num)
    return Signed(body.encode(), {**headers, "Content-Type": "application/json"})


def discord_ask(key: SigningKey) -> Signed:
    """A Discord ``/ask`` interaction, signed with ``key``."""
    n = next(_counter)
    body = json.dumps(
        {
            "id": f"9000000000000{n:05d}",
            "application_id": "1100000000000000001",
            "type": 2,
            "token": f"itoken-{n}",
            "version": 1,
            "channel_id": "1000000000000000002",
            "guild_id": "1000000000000000001",
            "data": {
                "id": "700000000000000001",
                "name": "ask",
                "type": 1,
                "options": [{"name": "message", "type": 3, "value": f"SECRET-TEXT ask {n}"}],
            },
        }
    ).encode()
    return Signed(body, {**interaction_headers(key, body), "Content-Type": "application/json"})


@dataclass
class Channels:
    """The platforms' stand-ins the channel webhooks answer through."""

    key: SigningKey  # Discord's application key
    slack: SlackApiStandin
    connector: ConnectorStandin


SAID = "could not be taken in"


async def slack_webhook(client: Client, ch: Channels, *, down: bool) -> list[str]:
    """Slack before its last try (503 while down: Slack redelivers) and on it (200, and
    while down the person is told in the thread)."""
    problems = []
    for retry_num in (None, 3):
        posts = len(ch.slack.posts)
        event = slack_event(retry_num)
        resp = await client.post("/slack/events", data=event.body, headers=event.headers)
        got = await answer_of(resp)
        told = [p["text"] for p in ch.slack.posts[posts:]]
        if not down:
            if got.status != 200:
                problems.append(f"slack try {retry_num}: {got}")
        elif retry_num is None:
            if got.status != 503 or told:
                problems.append(f"slack first try: {got} (told {told})")
        elif got.status != 200 or not told or "(service.unavailable)" not in told[0]:
            problems.append(f"slack last try: {got} (told {told})")
    return problems


async def discord_webhook(client: Client, ch: Channels, *, down: bool) -> list[str]:
    """An ``/ask``: while down, an ephemeral answer saying so (Discord never sends it
    again)."""
    ask = discord_ask(ch.key)
    resp = await client.post("/discord/interactions", data=ask.body, headers=ask.headers)
    got = await answer_of(resp)
    if got.status != 200:
        return [f"discord: {got}"]
    data = json.loads(got.body.partition("\n")[2])
    if down and not (
        data["type"] == 4
        and data["data"]["flags"] == 64
        and SAID in data["data"]["content"]
        and "(service.unavailable)" in data["data"]["content"]
    ):
        return [f"discord: {got}"]
    return []


async def teams_webhook(client: Client, ch: Channels, *, down: bool) -> list[str]:
    """A Teams message: while down, a reply saying so, then 202."""
    replies = len(ch.connector.activities)
    n = next(_counter)
    activity = message_activity(
        service_url=ch.connector.url, text=f"SECRET-TEXT teams {n}", activity_id=f"act-{n}"
    )
    status, body = await post_activity(str(client.make_url("/api/messages")), activity)
    told = [a["activity"]["text"] for a in ch.connector.activities[replies:]]
    if status >= 500 or (down and (status != 202 or not told or SAID not in told[0])):
        return [f"teams: {status} {body} (told {told})"]
    return []


#: How to call each channel webhook, database down or not: the problems found.
WEBHOOK_CALLS: Mapping[str, Callable[..., Awaitable[list[str]]]] = {
    "POST /slack/events": slack_webhook,
    "POST /discord/interactions": discord_webhook,
    "POST /api/messages": teams_webhook,
}


async def answer_of(resp: aiohttp.ClientResponse) -> Answer:
    """An answer, with its ``Retry-After`` (if any) ahead of its body."""
    async with resp:
        body = "<stream>" if resp.content_type == "text/event-stream" else await resp.text()
        retry = resp.headers.get("Retry-After")
        return Answer(resp.status, resp.content_type, f"Retry-After: {retry}\n{body}")


def refusal(got: Answer) -> str | None:
    """What is wrong with ``got`` as the answer to a database fault (None: nothing)."""
    retry, _, body = got.body.partition("\n")
    if got.status != 503:
        return f"{got.status}, not 503"
    if not retry.removeprefix("Retry-After: ").isdigit():
        return f"no Retry-After ({retry})"
    try:
        error = json.loads(body)["error"]
        # POST /mcp: a JSON-RPC error naming the rule in its data (the MCP client shows
        # it); elsewhere the error envelope.
        rule = error["data"]["rule"] if error.get("code") == mt.INTERNAL_ERROR else error["rule"]
    except (ValueError, KeyError, TypeError):
        return f"neither the error envelope nor a JSON-RPC error: {body[:200]}"
    return None if rule == "service.unavailable" else f"rule {rule}"


@dataclass
class Outage:
    """Makes the service's database unavailable, and available again."""

    down: Callable[[], Awaitable[None]]
    up: Callable[[], Awaitable[None]]
    #: reads go on while it is down (SQLite's write lock)
    reads: bool
    #: ``[database] busy_timeout_s``: how long a write waits for SQLite's lock, or a
    #: request for a PostgreSQL connection from the pool, before it is refused (short:
    #: every write waits it out while SQLite's lock is held)
    bound_s: float


@contextlib.asynccontextmanager
async def database(migrated_url: str) -> AsyncIterator[tuple[str, Outage]]:
    """The URL the service is to use, and the outage of its database."""
    if migrated_url.startswith("sqlite"):
        lock: list[contextlib.ExitStack] = []

        async def lock_it() -> None:
            stack = contextlib.ExitStack()
            stack.enter_context(held_sqlite_lock(migrated_url.removeprefix("sqlite+aiosqlite:///")))
            lock.append(stack)

        async def unlock() -> None:
            lock.pop().close()

        try:
            yield migrated_url, Outage(lock_it, unlock, reads=True, bound_s=0.05)
        finally:
            for stack in lock:
                stack.close()
        return
    url = make_url(migrated_url)
    assert url.host is not None and url.port is not None
    proxy = SilenceableProxy(url.host, url.port)
    port = await proxy.start()

    async def close() -> None:
        await proxy.stop()

    async def reopen() -> None:
        await proxy.start(port)

    try:
        yield (
            url.set(host="127.0.0.1", port=port).render_as_string(hide_password=False),
            Outage(close, reopen, reads=False, bound_s=0.2),
        )
    finally:
        await proxy.stop()


@dataclass
class Phase:
    """One phase, the database down or back: what each call was answered (by a label
    naming the route or capability, the caller and the call), and the problems found
    by the calls checked on the spot (the routes that need no database, the channel
    webhooks, email)."""

    answers: dict[str, Answer]
    problems: list[str]


async def bounded(what: str, call: Awaitable[Any]) -> Any:
    """``call``, failing the test if it takes longer than :data:`CALL_S`."""
    try:
        return await asyncio.wait_for(call, CALL_S)
    except TimeoutError:
        raise AssertionError(f"{what}: no answer within {CALL_S} s") from None


async def call_routes(
    s: Scene, ch: Channels, callers: Mapping[str, Prober], phase: Phase, *, down: bool
) -> None:
    """Every route the app serves, called as each of ``callers`` (with A's real ids)."""
    for key, path in served_routes(s.client):
        method = key.split(" ", 1)[0]
        if key in NO_DATABASE:
            where, status = NO_DATABASE[key]
            resp = await bounded(key, s.client.request(method, where, allow_redirects=False))
            got = await answer_of(resp)
            if got.status != status:
                phase.problems.append(f"{key}: {got}")
            continue
        if key in WEBHOOK_CALLS:
            phase.problems += await bounded(key, WEBHOOK_CALLS[key](s.client, ch, down=down))
            continue
        calls = [PUBLIC_CALLS[key]()] if key in PUBLIC_CALLS else FILLS[key](s.names, path)
        for who, caller in callers.items():
            # Logging out ends the session its cookie names: only the throwaway one's.
            if (key == "POST /console/logout") != (who == "logout"):
                continue
            for n, call in enumerate(calls):
                label = f"{key} as {who} #{n}: {call.path}"
                phase.answers[label] = await bounded(label, caller(method, call))


class Retried(Prober):
    """A :class:`Prober` whose answers carry ``Retry-After`` (:func:`answer_of`) and
    that follows no redirect."""

    follow_redirects = False

    async def read(self, resp: aiohttp.ClientResponse) -> Answer:
        return await answer_of(resp)


# ------------------------------------------------------------------------ hosted MCP

#: Calls other than GETs that only read: where reads go on (SQLite's write lock) they
#: are answered as usual. The MCP session's own requests (a ping, its end: the key's
#: check is all they read), the listings of what the server offers, and a transcript's
#: read, subscription and listen stream.
ONLY_READ = frozenset(
    {
        "POST /mcp",
        "DELETE /mcp",
        "MCP tools/list",
        "MCP resources/templates/list",
        "MCP read",
        "MCP subscribe",
        "MCP listen",
    }
)


@dataclass
class Capabilities:
    """The hosted MCP server's tools and resource templates, listed while it was up."""

    tools: list[str]
    templates: list[str]


async def listed(clients: Eras) -> Capabilities:
    """Every tool and template, each known to :data:`MCP_TOOLS` / :data:`MCP_TEMPLATES`."""
    tools = [tool.name for tool in (await clients.handshake.list_tools()).tools]
    templates = [
        template.uri_template
        for template in (await clients.handshake.list_resource_templates()).resource_templates
    ]
    unknown = sorted(set(tools) - set(MCP_TOOLS)) + sorted(set(templates) - set(MCP_TEMPLATES))
    assert not unknown, f"MCP capabilities this test does not know how to fill: {unknown}"
    return Capabilities(tools, templates)


def mcp_answer(result: object) -> Answer:
    """An MCP call's outcome as an :class:`Answer`: 200 and its result, or (an error
    naming a rule: an MCP error, or a tool error) 503 when the rule is
    ``service.unavailable`` and the wait is named, else 400; the body says it."""
    if isinstance(result, MCPError):
        data = result.error.data if isinstance(result.error.data, dict) else {}
        fault = (
            result.error.code == mt.INTERNAL_ERROR
            and data.get("rule") == "service.unavailable"
            and isinstance(data.get("retryAfterS"), int)
        )
        body = json.dumps(result.error.model_dump(mode="json"), sort_keys=True)
        return Answer(503 if fault else 400, "mcp", body)
    if isinstance(result, mt.CallToolResult) and result.is_error:
        fault = (result.meta or {}).get("rule") == "service.unavailable"
        return Answer(503 if fault else 400, "mcp", str(result))
    return Answer(200, "mcp", str(result))


async def outcome(call: Awaitable[object]) -> object:
    """``call``'s result, or the :class:`MCPError` it raised."""
    try:
        return await call
    except MCPError as exc:
        return exc


async def call_mcp(clients: Eras, caps: Capabilities, s: Scene, phase: Phase) -> None:
    """Every MCP capability on A's real names: the listings, each tool, and each template
    read, subscribed to and listened to."""
    session = clients.handshake
    calls: list[tuple[str, Callable[[], Awaitable[object]]]] = [
        ("tools/list", session.list_tools),
        ("resources/templates/list", session.list_resource_templates),
    ]
    for tool in caps.tools:
        for arguments in MCP_TOOLS[tool](s.names):
            calls.append((f"{tool} {arguments}", partial(session.call_tool, tool, arguments)))
    for template in caps.templates:
        for uri in MCP_TEMPLATES[template](s.names):
            calls += [
                (f"read {uri}", partial(session.read_resource, uri)),
                (f"subscribe {uri}", partial(session.subscribe_resource, uri)),
                (f"listen {uri}", partial(listened, clients.modern, uri)),
            ]
    for what, call in calls:
        phase.answers[f"MCP {what}"] = mcp_answer(await bounded(what, outcome(call())))


async def email(handler: EmailHandler, *, down: bool) -> list[str]:
    """A mail to the routed address: while down, 451 at ``RCPT`` (the route looked up)
    or at ``DATA`` (the mail recorded), which the sending server retries."""
    n = next(_counter)
    envelope = Envelope()
    envelope.mail_from = "alice@example.com"
    session = Session(asyncio.get_running_loop())
    said = await handler.handle_RCPT(SMTP(handler), session, envelope, "bot@example.com", [])
    if said.startswith("250"):
        envelope.content = (
            f"From: alice@example.com\r\nTo: bot@example.com\r\nSubject: s{n}\r\n"
            f"Message-ID: <m{n}@example.com>\r\n\r\nSECRET-TEXT mail {n}\r\n"
        ).encode()
        said = await handler.handle_DATA(SMTP(handler), session, envelope)
    ok = said.startswith("451 ") if down else said.startswith("250")
    return [] if ok else [f"email ({'down' if down else 'up'}): {said}"]


def config(key: SigningKey, ch_slack: SlackApiStandin, url: str, bound_s: float) -> dict[str, Any]:
    """Every channel on, with a short bound on waiting for the database."""
    return {
        "database": {"url": url, "busy_timeout_s": bound_s},
        "slack": {
            "signing_secret": SLACK_SECRET,
            "bot_token": "xoxb-x",
            "api_url": ch_slack.api_url,
        },
        "discord": {"public_key": key.verify_key.encode().hex()},
        "teams": {"enabled": True},
    }


#: The loggers of what serves a request: the service's own, the channel adapters', and
#: the libraries underneath (asyncpg's pool, aiohttp's server, the MCP SDK's server).
SERVING = (
    "leadgate",
    "bots.",
    "binding",
    "outbox",
    "asyncpg",
    "aiohttp.server",
    "aiohttp.web",
    "mcp.server",
)


@contextlib.contextmanager
def logged(caplog: pytest.LogCaptureFixture) -> Iterator[list[logging.LogRecord]]:
    """The log records of :data:`SERVING` from here to the end of the block."""
    start = len(caplog.records)
    records: list[logging.LogRecord] = []
    try:
        yield records
    finally:
        records += [r for r in caplog.records[start:] if r.name.startswith(SERVING)]


#: Calls other than GETs that only read, and are told so when they meet the fault:
#: the MCP session's ping (the key's check is all it reads), the listings and a
#: transcript's read (a subscription may create the session it names).
TOLD_READING = frozenset(
    {"POST /mcp", "MCP tools/list", "MCP resources/templates/list", "MCP read"}
)


def wrong_words(route: str, got: Answer) -> str | None:
    """What is wrong with what a fault's 503 tells ``route`` (None: nothing): a call
    that only reads (a GET, one of :data:`TOLD_READING`) that the database is
    unavailable; any other that nothing was stored."""
    reads = route.startswith("GET ") or route in TOLD_READING
    said, not_said = (CANNOT_READ, NOTHING_STORED) if reads else (NOTHING_STORED, CANNOT_READ)
    if said in got.body and not_said not in got.body:
        return None
    return f"a {'read' if reads else 'write'} not told {said!r}"


def wrong_while_down(down: Phase, up: Phase, *, reads: bool) -> list[str]:
    """The calls not answered as documented while the database was down: each must be
    the 503 (:func:`refusal`; an MCP call its JSON-RPC or tool error naming the rule)
    telling what is true of it (:func:`wrong_words`); or a 401 the same call gets with
    the database up (that credential is not taken there: a console cookie on ``/v1``);
    or, where reads go on (SQLite's write lock), a read answered as usual (a GET, or one
    of :data:`ONLY_READ`)."""
    wrong = list(down.problems)
    for label, got in down.answers.items():
        route = label.split(" as ", 1)[0]
        if route.startswith("MCP "):
            route = " ".join(route.split(" ", 2)[:2])
        why = "not the documented error" if got.status != 503 else None
        if got.content_type != "mcp":
            why = refusal(got)
        if why is None and got.status == 503:
            why = wrong_words(route, got)
        if "Traceback" in got.body:
            wrong.append(f"{label}: a traceback: {got.body[:300]}")
        elif why is None:
            continue
        elif got.status == 401 and up.answers[label].status == 401:
            continue
        elif reads and got.status < 500 and (route.startswith("GET ") or route in ONLY_READ):
            continue
        else:
            wrong.append(f"{label}: {why}: {got.status} {got.body[:300]}")
    return wrong


def wrong_once_up(up: Phase) -> list[str]:
    """The calls not answered once the database was back: no 5xx, no fault's error,
    and each call answered for at least one of the credentials (the rest: 401)."""
    wrong = list(up.problems)
    for label, got in up.answers.items():
        if got.status >= 500 or "Traceback" in got.body:
            wrong.append(f"{label}: {got.status} {got.body[:300]}")
    heard: dict[str, bool] = {}
    for label, got in up.answers.items():
        call = label.split(" as ", 1)[0] + label.split("#", 1)[-1]
        heard[call] = heard.get(call, False) or got.status != 401
    return wrong + [f"{call}: 401 to every credential" for call, ok in heard.items() if not ok]


async def test_every_route_and_mcp_capability_with_the_database_down(
    migrated_url: str,
    key: SigningKey,
    slack_api: SlackApiStandin,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    connector = ConnectorStandin()
    await connector.start()
    async with (
        database(migrated_url) as (url, outage),
        served_app(
            url,
            config=config(key, slack_api, url, outage.bound_s),
            adapters=True,
            like_production=True,
        ) as (service, client),
    ):
        s = await scene(service, client)
        assert not unknown_routes(client), unknown_routes(client)
        assert set(WEBHOOK_CALLS) == set(WEBHOOKS)
        assert set(NO_DATABASE) | set(PUBLIC_CALLS) == set(PUBLIC)
        for channel in ("slack", "discord", "teams", "email"):
            await make_route(service, s.a, s.names.agent_id, channel)
        ch = Channels(key, slack_api, connector)
        callers: dict[str, Prober] = {
            "key": Retried(client, key=s.a.key),
            "cookie": Retried(client, cookie=await console_cookie(service, client, s.a, OWNER)),
            "logout": Retried(
                client, cookie=await console_cookie(service, client, s.a, "logout@a.example")
            ),
        }
        mail = EmailHandler(service.messages)
        down, up = Phase({}, []), Phase({}, [])
        async with mcp_clients(s, s.a.key) as clients:
            caps = await listed(clients)
            with logged(caplog) as records:
                started = time.monotonic()
                await outage.down()
                # An outage outlasts the key cache: every key is checked again.
                assert isinstance(service.clock, FakeClock)
                service.clock.advance(int(PRINCIPAL_TTL_S * 1000) + 1)
                try:
                    await call_routes(s, ch, callers, down, down=True)
                    await call_mcp(clients, caps, s, down)
                    down.problems += await email(mail, down=True)
                finally:
                    await outage.up()
                lasted = time.monotonic() - started
            # Back by itself: the same app, the same calls.
            with logged(caplog) as after:
                await call_routes(s, ch, callers, up, down=False)
                await call_mcp(clients, caps, s, up)
                up.problems += await email(mail, down=False)
        await drain(service.lead_runner)
    await connector.close()
    assert not wrong_while_down(down, up, reads=outage.reads), wrong_while_down(
        down, up, reads=outage.reads
    )
    assert not wrong_once_up(up), wrong_once_up(up)
    # Each call named on a route or capability needing the database was refused on
    # PostgreSQL; on SQLite every write was (a read goes on).
    refused = [label for label, got in down.answers.items() if got.status == 503]
    assert refused
    # The log: no traceback, no ERROR; the 503s in one WARNING line per 10 s, each
    # WARNING naming the rule (a channel message that could not be taken in, the
    # email route lookup, a background task: one line each).
    said = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in records]
    assert not [r for r in records + after if r.exc_info], said
    assert all(r.levelno < logging.ERROR for r in records), said
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    unnamed = [w for w in warnings if "service.unavailable" not in w]
    assert not unnamed, unnamed
    lines = [w for w in warnings if "answered 503 [service.unavailable]" in w]
    assert 1 <= len(lines) <= 1 + lasted // 10, (lines, lasted)
