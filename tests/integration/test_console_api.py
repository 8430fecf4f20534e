"""The console's HTTP side (SPEC 5, 12) through a real aiohttp server on 127.0.0.1:
login / logout / me, the session cookie, brute-force limiting, the CSRF header on
cookie-authenticated writes, and roles on the operator API."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient, TestServer
from pydantic import ValidationError as PydanticValidationError

from leadgate.app import App
from leadgate.core.clock import FakeClock
from leadgate.core.config import Settings
from leadgate.core.runners import drain
from leadgate.database import schema as t
from leadgate.domain import orgs
from tests.helpers import Org, api_trigger, fake_clock, make_agent, make_org

PASSWORD = "correct horse battery"
#: PASSWORD's argon2 hash, made once (users are created with a hash).
HASHED = orgs.hash_password(PASSWORD)
CSRF = {"X-Leadgate-Console": "1"}
# For tests of code that never touches the database (in-memory throttle, static files).
sqlite_only = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


@dataclass
class Env:
    service: App
    client: TestClient[web.Request, web.Application]
    org: Org
    worker: dict[str, Any] | None = None

    @property
    def clock(self) -> FakeClock:
        return fake_clock(self.service)

    async def user(self, email: str, role: str, org: Org | None = None) -> None:
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

    async def login(self, email: str, password: str = PASSWORD) -> ClientResponse:
        return await self.client.post(
            "/console/login", json={"email": email, "password": password}, headers=CSRF
        )

    async def awaiting_item(self, session: str = "s1") -> str:
        """A work item in awaitingHuman (the script lead escalates on #escalate)."""
        if self.worker is None:
            await make_agent(self.service, self.org, "lead")
            self.worker = await make_agent(self.service, self.org, "worker", lead="lead")
        out = await self.service.turns.run(
            api_trigger(self.org, self.worker, "draft it #complete #escalate", session)
        )
        await drain(self.service.lead_runner)
        item_id = str(out.work_item_id)  # type: ignore[union-attr]
        resp = await self.client.get(
            f"/operator/reviews/{item_id}", headers={"Authorization": f"Bearer {self.org.key}"}
        )
        assert (await resp.json())["status"] == "awaitingHuman"
        return item_id


@pytest.fixture
async def env(service: App) -> AsyncIterator[Env]:
    org = await make_org(service)
    client = TestClient(TestServer(service.web_app(), host="127.0.0.1"))
    await client.start_server()
    try:
        yield Env(service, client, org)
    finally:
        await client.close()


def session_cookie(resp: ClientResponse) -> str:
    headers = [h for h in resp.headers.getall("Set-Cookie", []) if "leadgate_session=" in h]
    assert len(headers) == 1, resp.headers
    return headers[0]


async def test_login_sets_a_strict_httponly_session_cookie_and_me_answers(env: Env) -> None:
    await env.user("Ann@Example.com", "Member")
    resp = await env.login("ann@example.com")
    assert resp.status == 200
    body = await resp.json()
    assert body == {
        "user": {
            "id": body["user"]["id"],
            "email": "ann@example.com",
            "role": "Member",
            "orgId": env.org.id,
            "orgName": "acme",
            "name": None,
            "scopes": ["agent:review", "agent:trigger"],
        }
    }
    cookie = session_cookie(resp)
    attrs = {part.strip().split("=")[0].lower(): part for part in cookie.split(";")}
    assert "httponly" in attrs
    assert attrs["samesite"].strip() == "SameSite=Strict"
    assert attrs["path"].strip() == "Path=/"
    assert attrs["max-age"].strip() == "Max-Age=43200"
    assert "secure" not in attrs  # plain http on 127.0.0.1; set on https
    me = await env.client.get("/console/me")
    assert me.status == 200
    assert (await me.json())["user"]["email"] == "ann@example.com"


async def test_me_without_a_session_or_after_expiry_is_401(env: Env) -> None:
    assert (await env.client.get("/console/me")).status == 401
    await env.user("ann@example.com", "Member")
    assert (await env.login("ann@example.com")).status == 200
    assert (await env.client.get("/console/me")).status == 200
    env.clock.advance(12 * 3600 * 1000 + 1)
    assert (await env.client.get("/console/me")).status == 401
    ended = await env.client.get("/operator/reviews")
    assert ended.status == 401
    # The page is told its session ended, not that an API key is required.
    assert (await ended.json())["error"]["rule"] == "console.session"
    # The expired row is deleted by the next login (anyone's): nothing else would.
    await env.user("bob@example.com", "Member")
    assert (await env.login("bob@example.com")).status == 200
    async with env.service.db.read() as conn:
        users = [r.user_id for r in await conn.execute(sa.select(t.console_sessions.c.user_id))]
    assert len(users) == 1


async def test_logout_deletes_the_session_and_the_cookie(env: Env) -> None:
    await env.user("ann@example.com", "Member")
    resp = await env.login("ann@example.com")
    token = resp.cookies["leadgate_session"].value
    # The cookie alone is not enough to log out: the CSRF header is required.
    denied = await env.client.post("/console/logout")
    assert denied.status == 401
    assert (await denied.json())["error"]["rule"] == "csrf"
    assert (await env.client.get("/console/me")).status == 200

    out = await env.client.post("/console/logout", headers=CSRF)
    assert out.status == 200
    cleared = session_cookie(out)
    assert "Max-Age=0" in cleared
    assert (await env.client.get("/console/me")).status == 401
    # The old token is dead on the server, not just forgotten by the browser.
    env.client.session.cookie_jar.clear()
    replay = {"Cookie": f"leadgate_session={token}"}
    assert (await env.client.get("/console/me", headers=replay)).status == 401
    assert (await env.client.get("/operator/reviews", headers=replay)).status == 401
    # Logging out without a session is harmless.
    assert (await env.client.post("/console/logout", headers=CSRF)).status == 200


async def test_wrong_password_and_unknown_email_get_the_same_401(env: Env) -> None:
    await env.user("ann@example.com", "Member")
    wrong = await env.login("ann@example.com", "not the password")
    unknown = await env.login("nobody@example.com")
    assert wrong.status == unknown.status == 401
    assert await wrong.json() == await unknown.json()
    assert "leadgate_session" not in wrong.cookies
    assert (await env.client.get("/console/me")).status == 401


async def test_login_input_is_validated(env: Env) -> None:
    bad = await env.client.post("/console/login", json={"email": "a@b.c"}, headers=CSRF)
    assert bad.status == 400
    assert (await bad.json())["error"]["message"] == "email and password are required"
    junk = await env.client.post("/console/login", data=b"{", headers={**CSRF})
    assert junk.status == 400
    # A cross-site form can send neither the header nor a JSON content type.
    form = await env.client.post("/console/login", data={"email": "a@b.c", "password": "x" * 10})
    assert form.status == 401
    assert (await form.json())["error"]["rule"] == "csrf"


@sqlite_only
async def test_brute_force_is_limited_per_address(env: Env) -> None:
    await env.user("ann@example.com", "Member")
    for _ in range(10):
        assert (await env.login("ann@example.com", "guess-guess")).status == 401
    limited = await env.login("ann@example.com")  # even the right password now
    assert limited.status == 429
    assert int(limited.headers["Retry-After"]) == 60
    assert (await limited.json())["error"]["code"] == "rate_limited"
    assert "leadgate_session" not in limited.cookies
    env.clock.advance(30_000)
    assert (await env.login("ann@example.com")).status == 429
    env.clock.advance(30_001)
    assert (await env.login("ann@example.com")).status == 200


@sqlite_only
async def test_behind_a_trusted_proxy_each_client_has_its_own_login_limit(
    migrated_url: str,
) -> None:
    # The test client connects from 127.0.0.1: here, the proxy in front.
    settings = Settings.model_validate(
        {"database": {"url": migrated_url}, "server": {"trusted_proxies": ["127.0.0.0/8"]}}
    )
    service = App(settings, clock=FakeClock(), enable_adapters=False)
    client = TestClient(TestServer(service.web_app(), host="127.0.0.1"))
    await client.start_server()
    try:
        env = Env(service, client, await make_org(service))
        await env.user("ann@example.com", "Member")

        async def login(email: str, password: str, forwarded: str) -> int:
            resp = await client.post(
                "/console/login",
                json={"email": email, "password": password},
                headers={**CSRF, "X-Forwarded-For": forwarded},
            )
            return resp.status

        attacker = "203.0.113.7"
        for n in range(10):  # a different made-up account each time
            assert await login(f"nobody{n}@example.com", "guess-guess", attacker) == 401
        assert await login("nobody@example.com", "guess-guess", attacker) == 429
        # Hops left of the proxy's own are whatever the client wrote: not read.
        assert await login("x@example.com", "guess-guess", f"198.51.100.9, {attacker}") == 429
        # Everyone else behind the same proxy still logs in.
        assert await login("ann@example.com", PASSWORD, "198.51.100.9") == 200
    finally:
        await client.close()
        await service.stop()


@sqlite_only
async def test_without_trusted_proxies_x_forwarded_for_is_never_read(env: Env) -> None:
    for n in range(10):
        forged = {**CSRF, "X-Forwarded-For": f"198.51.100.{n}"}
        resp = await env.client.post(
            "/console/login", json={"email": "a@b.c", "password": "guess-guess"}, headers=forged
        )
        assert resp.status == 401
    assert (await env.login("a@b.c", "guess-guess")).status == 429


def test_trusted_proxies_must_be_addresses_or_networks() -> None:
    ok = Settings.model_validate({"server": {"trusted_proxies": ["10.0.0.0/8", "::1", "1.2.3.4"]}})
    assert ok.server.trusted_proxies == ["10.0.0.0/8", "::1", "1.2.3.4"]
    with pytest.raises(PydanticValidationError, match="not an IP address or network"):
        Settings.model_validate({"server": {"trusted_proxies": ["proxy.internal"]}})


async def test_cookie_writes_need_the_console_header(env: Env) -> None:
    item_id = await env.awaiting_item()
    await env.user("ann@example.com", "Member")
    assert (await env.login("ann@example.com")).status == 200

    # GETs with the cookie are fine without the header.
    queue = await env.client.get("/operator/reviews")
    assert queue.status == 200
    assert [i["id"] for i in (await queue.json())["items"]] == [item_id]

    forged = await env.client.post(f"/operator/reviews/{item_id}/approve")
    assert forged.status == 401
    assert (await forged.json())["error"]["rule"] == "csrf"
    detail = await (await env.client.get(f"/operator/reviews/{item_id}")).json()
    assert detail["status"] == "awaitingHuman"

    ok = await env.client.post(f"/operator/reviews/{item_id}/approve", json={}, headers=CSRF)
    assert ok.status == 200
    body = await ok.json()
    assert body["status"] == "completed"  # the api binding's reveal sends nothing
    approve = body["audit"][-2]
    assert approve["action"] == "approve" and approve["actor"].startswith("user:")
    assert approve["surface"] == "console"


async def test_viewer_can_log_in_but_cannot_review(env: Env) -> None:
    item_id = await env.awaiting_item()
    await env.user("vic@example.com", "Viewer")
    resp = await env.login("vic@example.com")
    assert resp.status == 200
    assert (await resp.json())["user"]["scopes"] == []
    for path in ("/operator/reviews", f"/operator/reviews/{item_id}", "/operator/activity"):
        denied = await env.client.get(path)
        assert denied.status == 403, path
        assert (await denied.json())["error"]["rule"] == "scope.agent:review"
    post = await env.client.post(f"/operator/reviews/{item_id}/approve", json={}, headers=CSRF)
    assert post.status == 403


async def test_a_session_sees_only_its_own_organization(env: Env) -> None:
    item_id = await env.awaiting_item()
    other = await make_org(env.service, "globex")
    await env.user("eve@globex.example", "Owner", org=other)
    assert (await env.login("eve@globex.example")).status == 200
    assert (await (await env.client.get("/operator/reviews")).json())["items"] == []
    assert (await env.client.get(f"/operator/reviews/{item_id}")).status == 404
    denied = await env.client.post(f"/operator/reviews/{item_id}/approve", json={}, headers=CSRF)
    assert denied.status == 404


@sqlite_only
async def test_the_page_and_its_assets_are_served_with_a_strict_policy(env: Env) -> None:
    page = await env.client.get("/console/")
    assert page.status == 200
    assert page.content_type == "text/html"
    html = await page.text()
    assert '<script src="/console/static/console.js"' in html
    csp = page.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    assert page.headers["X-Content-Type-Options"] == "nosniff"
    for name, kind in (("console.js", "text/javascript"), ("console.css", "text/css")):
        asset = await env.client.get(f"/console/static/{name}")
        assert asset.status == 200
        assert asset.content_type == kind
    assert (await env.client.get("/console/static/console.py")).status == 404
    assert (await env.client.get("/console/static/..%2fconsole.py")).status == 404
    redirect = await env.client.get("/console", allow_redirects=False)
    assert redirect.status == 302
    assert redirect.headers["Location"] == "/console/"


async def test_the_favicon_is_an_empty_cacheable_answer_without_a_login(env: Env) -> None:
    """Browsers ask for /favicon.ico by themselves: it was a 404 (an error in the
    browser's console on every page)."""
    icon = await env.client.get("/favicon.ico")
    assert icon.status == 204 and await icon.read() == b""
    assert icon.headers["Cache-Control"] == "public, max-age=86400"
    assert (await env.client.head("/favicon.ico")).status == 204


async def raw_get(env: Env, head: bytes) -> tuple[int, dict[str, Any]]:
    """One request written byte for byte (an HTTP client would refuse to send such
    headers), and its status and JSON body."""
    url = env.client.make_url("/")
    reader, writer = await asyncio.open_connection(url.host, url.port)
    try:
        writer.write(head + b"Host: 127.0.0.1\r\nConnection: close\r\n\r\n")
        raw = await reader.read()
    finally:
        writer.close()
    status_line, _, rest = raw.partition(b"\r\n")
    body = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(body)


@sqlite_only
async def test_a_cookie_that_is_not_printable_ascii_is_no_session(env: Env) -> None:
    # Bytes that are not UTF-8 reach the handlers as surrogate escapes, which the token's
    # hash could not encode: a 500 with a traceback until the cookie was checked.
    for cookie in (b"\xff\xfeabc", "caf\u00e9".encode()):
        for target in (b"GET /console/me", b"GET /operator/reviews"):
            status, body = await raw_get(
                env, target + b" HTTP/1.1\r\nCookie: leadgate_session=" + cookie + b"\r\n"
            )
            assert status == 401, (target, cookie, body)
            assert body["error"]["rule"] in ("console.session", "auth.key")
        status, body = await raw_get(
            env,
            b"POST /console/logout HTTP/1.1\r\nX-Leadgate-Console: 1\r\nContent-Length: 0\r\n"
            b"Cookie: leadgate_session=" + cookie + b"\r\n",
        )
        assert (status, body) == (200, {"loggedOut": True})
