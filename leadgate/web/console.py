"""The operator web console (SPEC 5, 12): one static page plus login, logout and me.

The page (``web/static/console.*``: plain HTML, CSS and JavaScript, no build step) talks
to the operator JSON API with the ``leadgate_session`` cookie set here. Every POST from
the page carries ``X-Leadgate-Console: 1`` (CSRF: :func:`web.common.require_console_header`,
through ``authenticate`` for the operator API, directly here for logout). Login needs that
header or a JSON content type, neither of which a cross-site form can send.

Login attempts are limited per client address and per account before the password is
checked (:mod:`leadgate.operations.logins`: 10 per minute, then 429 with a Retry-After
that says when there is room again), with the same 401 message for an unknown email and
a wrong password.
"""

from __future__ import annotations

import importlib.resources
from typing import Protocol

from aiohttp import web

from leadgate.core.clock import Clock
from leadgate.core.errors import AuthError, ValidationError
from leadgate.domain.orgs import ConsoleUserView
from leadgate.operations.access import CONSOLE_SESSION_TTL_S as SESSION_TTL_S
from leadgate.web.common import (
    SESSION_COOKIE,
    ClientAddress,
    json_body,
    require_console_header,
    session_cookie,
)

STATIC = importlib.resources.files("leadgate.web").joinpath("static")
BAD_LOGIN = "the email or password is not correct"
#: ``/favicon.ico``'s caching: the same empty answer for everyone, for a day.
FAVICON_CACHE = "public, max-age=86400"

# The page needs nothing from anywhere else; inline script and style are refused too.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_ASSETS = {
    "console.html": "text/html",
    "console.js": "text/javascript",
    "console.css": "text/css",
}


def _asset(name: str) -> web.Response:
    headers = {
        "Content-Security-Policy": _CSP,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-store" if name.endswith(".html") else "no-cache",
    }
    return web.Response(
        body=(STATIC / name).read_bytes(),
        content_type=_ASSETS[name],
        charset="utf-8",
        headers=headers,
    )


class ConsoleAccess(Protocol):
    """What the console needs (:class:`leadgate.operations.access.Access`)."""

    async def login(self, email: str, password: str, *, address: str = ...) -> str | None: ...

    async def logout(self, token: str) -> None: ...

    async def console_user(self, token: str | None) -> ConsoleUserView | None: ...


def setup(
    app: web.Application,
    *,
    access: ConsoleAccess,
    clock: Clock,
    public_url: str,
    client_address: ClientAddress | None = None,
) -> None:
    """Register the console routes (handlers are closures over ``access``, as in the
    other surfaces; the long part is login's checks, in order)."""
    # Behind a TLS-terminating proxy the request itself looks like plain http.
    secure = public_url.startswith("https://")
    address_of = (client_address or ClientAddress()).of
    session_user = access.console_user

    async def page(_: web.Request) -> web.Response:
        return _asset("console.html")

    async def asset(request: web.Request) -> web.Response:
        return _asset(request.match_info["name"])

    async def to_page(_: web.Request) -> web.Response:
        raise web.HTTPFound("/console/")

    async def favicon(_: web.Request) -> web.Response:
        # Every browser asks for /favicon.ico; it was a 404, an error in the browser's
        # console on every page. No icon, kept a day: asked once, not per page.
        return web.Response(status=204, headers={"Cache-Control": FAVICON_CACHE})

    async def login(request: web.Request) -> web.Response:
        if request.content_type != "application/json":
            require_console_header(request)
        address = address_of(request)
        body = await json_body(request)
        email, password = body.get("email"), body.get("password")
        if not isinstance(email, str) or not isinstance(password, str) or not email or not password:
            raise ValidationError("email and password are required", rule="console.login")
        # Counted before the password check (429 with Retry-After past the limit).
        token = await access.login(email, password, address=address)
        user = await session_user(token)
        if token is None or user is None:
            raise AuthError(BAD_LOGIN, rule="console.login")
        resp = web.json_response({"user": user})
        resp.set_cookie(
            SESSION_COOKIE,
            token,
            max_age=SESSION_TTL_S,
            path="/",
            httponly=True,
            samesite="Strict",
            secure=secure or request.secure,
        )
        return resp

    async def logout(request: web.Request) -> web.Response:
        token = session_cookie(request)
        if token:
            require_console_header(request)
            await access.logout(token)
        resp = web.json_response({"loggedOut": True})
        resp.del_cookie(SESSION_COOKIE, path="/", samesite="Strict", httponly=True)
        return resp

    async def me(request: web.Request) -> web.Response:
        user = await session_user(session_cookie(request))
        if user is None:
            raise AuthError("not logged in to the console", rule="console.session")
        return web.json_response({"user": user})

    app.router.add_get("/favicon.ico", favicon)
    app.router.add_get("/console", to_page)
    app.router.add_get("/console/", page)
    app.router.add_get("/console/static/{name:console\\.(?:js|css)}", asset)
    app.router.add_post("/console/login", login)
    app.router.add_post("/console/logout", logout)
    app.router.add_get("/console/me", me)
