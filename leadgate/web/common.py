"""Shared HTTP plumbing: JSON errors, body parsing, authentication."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from leadgate.core.auth import Principal
from leadgate.core.decoding import json_object, read_body
from leadgate.core.errors import AuthError, LeadgateError
from leadgate.database.faults import unavailable

log = logging.getLogger("leadgate.web")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SESSION_COOKIE = "leadgate_session"


def openai_error(
    status: int, message: str, type_: str, code: str | None, rule: str | None = None
) -> web.Response:
    """An OpenAI-style error envelope (plus ``rule``, the name of the broken rule)."""
    error: dict[str, Any] = {"message": message, "type": type_, "param": None, "code": code}
    if rule is not None:
        error["rule"] = rule
    return web.json_response({"error": error}, status=status)


_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
}


def error_response(
    request: web.Request, status: int, message: str, code: str, rule: str
) -> web.Response:
    """A JSON error in the surface's style (OpenAI envelope under /v1/)."""
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    if request.path.startswith("/v1/"):
        resp = openai_error(status, message, _OPENAI_TYPES.get(status, "api_error"), code, rule)
        if headers:
            resp.headers.update(headers)
        return resp
    return web.json_response(
        {"error": {"message": message, "code": code, "rule": rule}}, status=status, headers=headers
    )


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes a JSON error; nothing crashes the process or leaks internals."""
    try:
        return await handler(request)
    except LeadgateError as exc:
        resp = error_response(request, exc.status, exc.message, exc.code, exc.rule)
        if exc.retry_after_s is not None:
            resp.headers["Retry-After"] = str(exc.retry_after_s)
        return resp
    except web.HTTPRequestEntityTooLarge:
        return error_response(
            request, 413, "the request body is too large", "request_too_large", "body.size"
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(request, exc.status, exc.reason, "http_error", "http")
    except Exception as exc:
        fault = unavailable(exc)
        if fault is not None:
            # A database fault that escaped the transaction helpers: still a 503.
            log.warning("database unavailable on %s %s: %s", request.method, request.path, exc)
            resp = error_response(request, 503, fault.message, fault.code, fault.rule)
            resp.headers["Retry-After"] = str(fault.retry_after_s)
            return resp
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(request, 500, "internal error", "internal_error", "internal")


async def json_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object body through the one decoding path
    (:mod:`leadgate.core.decoding`: 400 naming the rule, 413 too large, 408 too slow)."""
    return json_object(await read_body(request))


def bearer(request: web.Request) -> str | None:
    """The bearer token of the request, if any."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def require_console_header(request: web.Request) -> None:
    """Cookie-authenticated writes must come from our own page (CSRF): a cross-site form
    cannot set a custom header, and a cross-site fetch with one needs CORS we never grant."""
    if request.headers.get("X-Leadgate-Console") != "1":
        raise AuthError("console requests must carry X-Leadgate-Console: 1", rule="csrf")


PrincipalLookup = Callable[[str | None, str | None], Awaitable[Principal | None]]


async def authenticate(request: web.Request, lookup: PrincipalLookup, *, cookie: bool) -> Principal:
    """Bearer key, or (where allowed) the console session cookie. 401 otherwise."""
    token = bearer(request)
    session = request.cookies.get(SESSION_COOKIE) if cookie and token is None else None
    if cookie and session and request.method not in ("GET", "HEAD"):
        require_console_header(request)
    principal = await lookup(token, session)
    if principal is None:
        raise AuthError(
            "a valid API key is required (Authorization: Bearer <key>)", rule="auth.key"
        )
    return principal
