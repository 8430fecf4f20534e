"""The operator web console (SPEC 5, 12): one static page plus login, logout and me.

The page (``web/static/console.*``: plain HTML, CSS and JavaScript, no build step) talks
to the operator JSON API with the ``leadgate_session`` cookie set here. Every POST from
the page carries ``X-Leadgate-Console: 1`` (CSRF: :func:`web.common.require_console_header`,
through ``authenticate`` for the operator API, directly here for logout). Login needs that
header or a JSON content type, neither of which a cross-site form can send.

Failed logins are limited per client address (``LOGIN_FAILURES`` per minute, then 429),
with the same 401 message for an unknown email and a wrong password.
"""

from __future__ import annotations

import collections
import importlib.resources
from typing import Any, Protocol

from aiohttp import web

from leadgate.core.clock import Clock
from leadgate.core.errors import AuthError, ValidationError
from leadgate.operations.access import CONSOLE_SESSION_TTL_S as SESSION_TTL_S
from leadgate.web.common import SESSION_COOKIE, error_response, json_body, require_console_header

STATIC = importlib.resources.files("leadgate.web").joinpath("static")
LOGIN_FAILURES = 10
LOGIN_WINDOW_MS = 60_000
BAD_LOGIN = "the email or password is not correct"

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


class LoginThrottle:
    """Failed logins per client address in a sliding window (in memory, per process)."""

    def __init__(
        self, clock: Clock, *, limit: int = LOGIN_FAILURES, window_ms: int = LOGIN_WINDOW_MS
    ) -> None:
        self.clock = clock
        self.limit = limit
        self.window_ms = window_ms
        self._failures: dict[str, collections.deque[int]] = {}

    def _recent(self, address: str) -> collections.deque[int] | None:
        times = self._failures.get(address)
        if times is None:
            return None
        horizon = self.clock.now_ms() - self.window_ms
        while times and times[0] <= horizon:
            times.popleft()
        if not times:
            del self._failures[address]
            return None
        return times

    def retry_after_s(self, address: str) -> int:
        """Seconds until the next attempt is allowed (0: allowed now)."""
        times = self._recent(address)
        if times is None or len(times) < self.limit:
            return 0
        return max(1, -(-(times[0] + self.window_ms - self.clock.now_ms()) // 1000))

    def failed(self, address: str) -> None:
        """Record one failed attempt."""
        if len(self._failures) > 10_000:  # bound memory: forget addresses gone quiet
            for stale in list(self._failures):
                self._recent(stale)
        self._failures.setdefault(address, collections.deque()).append(self.clock.now_ms())


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

    async def login(self, email: str, password: str) -> str | None: ...

    async def logout(self, token: str) -> None: ...

    async def console_user(self, token: str | None) -> dict[str, Any] | None: ...


def setup(app: web.Application, *, access: ConsoleAccess, clock: Clock, public_url: str) -> None:
    """Register the console routes (handlers are closures over ``access`` and the login
    throttle, as in the other surfaces; the long part is login's checks, in order)."""
    throttle = LoginThrottle(clock)
    # Behind a TLS-terminating proxy the request itself looks like plain http.
    secure = public_url.startswith("https://")
    session_user = access.console_user

    async def page(_: web.Request) -> web.Response:
        return _asset("console.html")

    async def asset(request: web.Request) -> web.Response:
        return _asset(request.match_info["name"])

    async def to_page(_: web.Request) -> web.Response:
        raise web.HTTPFound("/console/")

    async def login(request: web.Request) -> web.Response:
        if request.content_type != "application/json":
            require_console_header(request)
        address = request.remote or "unknown"
        wait = throttle.retry_after_s(address)
        if wait:
            resp = error_response(
                request,
                429,
                f"too many failed logins; try again in {wait} seconds",
                "rate_limited",
                "console.login_rate",
            )
            resp.headers["Retry-After"] = str(wait)
            return resp
        body = await json_body(request)
        email, password = body.get("email"), body.get("password")
        if not isinstance(email, str) or not isinstance(password, str) or not email or not password:
            raise ValidationError("email and password are required", rule="console.login")
        if len(email) > 320 or len(password) > 1024:
            throttle.failed(address)
            raise AuthError(BAD_LOGIN, rule="console.login")
        token = await access.login(email, password)
        user = await session_user(token)
        if token is None or user is None:
            throttle.failed(address)
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
        token = request.cookies.get(SESSION_COOKIE)
        if token:
            require_console_header(request)
            await access.logout(token)
        resp = web.json_response({"loggedOut": True})
        resp.del_cookie(SESSION_COOKIE, path="/", samesite="Strict", httponly=True)
        return resp

    async def me(request: web.Request) -> web.Response:
        user = await session_user(request.cookies.get(SESSION_COOKIE))
        if user is None:
            raise AuthError("not logged in to the console", rule="console.session")
        return web.json_response({"user": user})

    app.router.add_get("/console", to_page)
    app.router.add_get("/console/", page)
    app.router.add_get("/console/static/{name:console\\.(?:js|css)}", asset)
    app.router.add_post("/console/login", login)
    app.router.add_post("/console/logout", logout)
    app.router.add_get("/console/me", me)
