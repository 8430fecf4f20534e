"""Action Agent Studio (SPEC 13): a console page where a signed-in user chats with an agent.

The page (``web/static/studio.*``: plain HTML, CSS and JavaScript, no build step, the
console's strict Content-Security-Policy) signs in with the console's own login and
cookie, and talks to the routes below, which take that cookie (or a bearer key) and the
``agent:trigger`` permission (Owner, Admin, Member). Writes need ``X-Leadgate-Console: 1``
(the console's CSRF rule, :func:`leadgate.web.common.require_console_header`).

* ``GET /console/studio/agents``: the organization's active agents;
* ``POST /console/studio/agents/{agent}/sessions/{session}/messages`` ``{"message"}``: one
  turn on the ``studio`` binding: ``{"outcome": "reply", "text"}`` at once, or
  ``{"outcome": "pending"}`` for a turn held for Lead review (409 when the session's work
  is already under review);
* ``GET .../messages`` and ``GET .../events``: the transcript and the review-status event
  stream, as on ``/v1`` (:mod:`leadgate.web.sessions_api`). The page renders the session
  from the stream: a held turn shows "pending review", and the approved answer replaces
  it in place when the relay reveals it, without a reload.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Awaitable, Callable
from typing import Protocol

from aiohttp import web

from leadgate.core.auth import Principal, Scope
from leadgate.core.errors import Conflict, IntakeInDoubt
from leadgate.core.limits import validate_message
from leadgate.core.types import BUSY_RULE, BindingKind, Gated, Outcome, Reply
from leadgate.domain.rows import Agent
from leadgate.web.common import PrincipalLookup, authenticate, json_body
from leadgate.web.sessions_api import (
    SessionReads,
    StreamSettings,
    Wakeups,
    events_response,
    transcript_response,
)

STATIC = importlib.resources.files("leadgate.web").joinpath("static")
BASE = "/console/studio"
# As the console: nothing from anywhere else, no inline script or style.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_ASSETS = {"studio.html": "text/html", "studio.js": "text/javascript", "studio.css": "text/css"}


class StudioChat(Protocol):
    """One turn (:meth:`leadgate.operations.messages.Messages.send`)."""

    async def send(
        self,
        principal: Principal,
        agent_ref: str,
        text: str,
        *,
        session: str | None,
        binding: BindingKind = BindingKind.api,
        on_start: Callable[[], Awaitable[None]] | None = None,
    ) -> Outcome: ...


class StudioAgents(Protocol):
    """The organization's agents (:class:`leadgate.operations.agents.Agents`)."""

    async def list(self, principal: Principal) -> list[Agent]: ...


class SessionBusy(Conflict):
    """The session's work is under review: no new message until it is decided."""

    code = "busy"


def _asset(name: str) -> web.Response:
    return web.Response(
        body=(STATIC / name).read_bytes(),
        content_type=_ASSETS[name],
        charset="utf-8",
        headers={
            "Content-Security-Policy": _CSP,
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-store" if name.endswith(".html") else "no-cache",
        },
    )


def setup(
    app: web.Application,
    *,
    authenticate_with: PrincipalLookup,
    chat: StudioChat,
    agents: StudioAgents,
    reads: SessionReads,
    hub: Wakeups,
    settings: StreamSettings | None = None,
) -> None:
    """Register the Studio page and its routes under ``/console/studio``."""
    stream_settings = settings or StreamSettings()

    async def page(_: web.Request) -> web.Response:
        return _asset("studio.html")

    async def asset(request: web.Request) -> web.Response:
        return _asset(request.match_info["name"])

    async def to_page(_: web.Request) -> web.Response:
        raise web.HTTPFound(f"{BASE}/")

    async def list_agents(request: web.Request) -> web.Response:
        principal = await authenticate(request, authenticate_with, cookie=True)
        principal.require(Scope.trigger)
        rows = await agents.list(principal)
        data = [{"id": a.id, "name": a.name, "slug": a.slug} for a in rows if a.active]
        return web.json_response({"object": "list", "data": data})

    async def send(request: web.Request) -> web.Response:
        principal = await authenticate(request, authenticate_with, cookie=True)
        body = await json_body(request)
        # A database fault after the message was taken in is the turn path's
        # turn.interrupted (no retry asked for): the page must not put it back in the box.
        try:
            outcome = await chat.send(
                principal,
                request.match_info["agent"],
                validate_message(body.get("message")),
                session=request.match_info["session"],
                binding=BindingKind.studio,
            )
        except IntakeInDoubt as exc:
            # REST's text offers a retry with the same Idempotency-Key, which Studio lacks.
            raise exc.told_to("studio") from exc
        if isinstance(outcome, Reply):
            return web.json_response({"outcome": "reply", "text": outcome.text})
        if isinstance(outcome, Gated):
            return web.json_response({"outcome": "pending"})
        raise SessionBusy(
            "this session's work is under review; wait for the review to finish",
            rule=BUSY_RULE,  # as REST and MCP name it (it was studio.busy)
        )

    async def messages(request: web.Request) -> web.Response:
        principal = await authenticate(request, authenticate_with, cookie=True)
        return await transcript_response(request, reads, principal)

    async def events(request: web.Request) -> web.StreamResponse:
        return await events_response(
            request, reads, hub, stream_settings, authenticate_with, cookie=True
        )

    session = f"{BASE}/agents/{{agent}}/sessions/{{session}}"
    app.router.add_get(BASE, to_page)
    app.router.add_get(f"{BASE}/", page)
    app.router.add_get(f"{BASE}/static/{{name:studio\\.(?:js|css)}}", asset)
    app.router.add_get(f"{BASE}/agents", list_agents)
    app.router.add_get(f"{session}/messages", messages)
    app.router.add_post(f"{session}/messages", send)
    app.router.add_get(f"{session}/events", events)
