"""``/v1/agents``: list, create, get, update. Public payloads never show lead fields."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from engine import agents as agents_mod
from engine.auth import Scope
from engine.errors import ValidationError
from web.common import authenticate, json_body

if TYPE_CHECKING:
    from engine.service import Service

FIELDS = {
    "name": "name",
    "model": "model",
    "instructions": "instructions",
    "presetId": "preset",
    "leadAgentId": "lead",
    "leadReviewConfig": "review_config",
    "active": "active",
}


def _changes(body: dict[str, Any]) -> dict[str, Any]:
    unknown = set(body) - set(FIELDS)
    if unknown:
        raise ValidationError(
            f"unknown agent fields: {', '.join(sorted(unknown))}", rule="agent.unknown_field"
        )
    if "active" in body and not isinstance(body["active"], bool):
        raise ValidationError("active must be a boolean", rule="agent.active")
    if (
        "presetId" in body
        and body["presetId"] is not None
        and not isinstance(body["presetId"], str)
    ):
        raise ValidationError("presetId must be a string or null", rule="agent.preset")
    return {FIELDS[key]: value for key, value in body.items()}


def setup(app: web.Application, service: Service) -> None:
    """Register the routes."""

    async def list_agents(request: web.Request) -> web.Response:
        principal = await authenticate(request, service.lookup_principal, cookie=True)
        async with service.db.read() as conn:
            rows = await agents_mod.list_agents(conn, principal.org_id)
        return web.json_response(
            {"object": "list", "data": [agents_mod.public_agent(r) for r in rows]}
        )

    async def create_agent(request: web.Request) -> web.Response:
        principal = await authenticate(request, service.lookup_principal, cookie=True)
        body = await json_body(request)
        principal.require(Scope.update)
        changes = _changes(body)
        async with service.db.tx() as conn:
            row = await agents_mod.save_agent(
                conn,
                service.clock,
                service.ids,
                principal.org_id,
                known_models=service.model_names,
                **changes,
            )
        return web.json_response(agents_mod.public_agent(row), status=201)

    async def get_agent(request: web.Request) -> web.Response:
        principal = await authenticate(request, service.lookup_principal, cookie=True)
        row = await service.find_agent(principal.org_id, request.match_info["agent_id"])
        return web.json_response(agents_mod.public_agent(row))

    async def update_agent(request: web.Request) -> web.Response:
        principal = await authenticate(request, service.lookup_principal, cookie=True)
        body = await json_body(request)
        principal.require(Scope.update)
        changes = _changes(body)
        async with service.db.tx() as conn:
            row = await agents_mod.save_agent(
                conn,
                service.clock,
                service.ids,
                principal.org_id,
                agent_ref=request.match_info["agent_id"],
                known_models=service.model_names,
                **changes,
            )
        return web.json_response(agents_mod.public_agent(row))

    app.router.add_get("/v1/agents", list_agents)
    app.router.add_post("/v1/agents", create_agent)
    app.router.add_get("/v1/agents/{agent_id}", get_agent)
    app.router.add_patch("/v1/agents/{agent_id}", update_agent)
