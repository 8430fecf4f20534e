"""``/v1/agents``: list, create, get, update. Public payloads never show lead fields."""

from __future__ import annotations

from typing import Any, Protocol

from aiohttp import web

from leadgate.core.auth import Principal
from leadgate.domain.agents import public_agent
from leadgate.domain.rows import Agent
from leadgate.web.common import PrincipalLookup, authenticate, json_body


class AgentBackend(Protocol):
    """What the routes need (:class:`leadgate.operations.agents.Agents`)."""

    async def list(self, principal: Principal) -> list[Agent]: ...

    async def get(self, principal: Principal, ref: str) -> Agent: ...

    async def save(
        self, principal: Principal, body: dict[str, Any], *, ref: str | None = None
    ) -> Agent: ...


def setup(
    app: web.Application, *, authenticate_with: PrincipalLookup, agents: AgentBackend
) -> None:
    """Register the routes."""

    async def list_agents(request: web.Request) -> web.Response:
        principal = await authenticate(request, authenticate_with, cookie=True)
        rows = await agents.list(principal)
        return web.json_response({"object": "list", "data": [public_agent(r) for r in rows]})

    async def create_agent(request: web.Request) -> web.Response:
        principal = await authenticate(request, authenticate_with, cookie=True)
        body = await json_body(request)
        return web.json_response(public_agent(await agents.save(principal, body)), status=201)

    async def get_agent(request: web.Request) -> web.Response:
        principal = await authenticate(request, authenticate_with, cookie=True)
        return web.json_response(
            public_agent(await agents.get(principal, request.match_info["agent_id"]))
        )

    async def update_agent(request: web.Request) -> web.Response:
        principal = await authenticate(request, authenticate_with, cookie=True)
        body = await json_body(request)
        row = await agents.save(principal, body, ref=request.match_info["agent_id"])
        return web.json_response(public_agent(row))

    app.router.add_get("/v1/agents", list_agents)
    app.router.add_post("/v1/agents", create_agent)
    app.router.add_get("/v1/agents/{agent_id}", get_agent)
    app.router.add_patch("/v1/agents/{agent_id}", update_agent)
