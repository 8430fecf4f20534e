"""Agents as the public API and the CLI see them (SPEC 2 rules in the domain)."""

from __future__ import annotations

from typing import Any

from leadgate.core.auth import Principal, Scope
from leadgate.core.clock import Clock, IdFactory
from leadgate.core.decoding import refuse_unknown_fields
from leadgate.core.errors import ValidationError
from leadgate.database.db import Database
from leadgate.domain import agents as agents_mod
from leadgate.domain.rows import Agent

#: Public field names of an agent body -> :func:`leadgate.domain.agents.save_agent` keywords.
FIELDS = {
    "name": "name",
    "model": "model",
    "instructions": "instructions",
    "presetId": "preset",
    "leadAgentId": "lead",
    "leadReviewConfig": "review_config",
    "active": "active",
}


def changes_from_body(body: dict[str, Any]) -> dict[str, Any]:
    """The save_agent keywords of a public agent body (unknown fields are an error)."""
    refuse_unknown_fields(body, FIELDS, rule="agent.unknown_field", what="agent fields")
    if "active" in body and not isinstance(body["active"], bool):
        raise ValidationError("active must be a boolean", rule="agent.active")
    if (
        "presetId" in body
        and body["presetId"] is not None
        and not isinstance(body["presetId"], str)
    ):
        raise ValidationError("presetId must be a string or null", rule="agent.preset")
    return {FIELDS[key]: value for key, value in body.items()}


class Agents:
    """List, read, create and update agents of the caller's organization."""

    def __init__(
        self, db: Database, clock: Clock, ids: IdFactory, model_names: frozenset[str]
    ) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.model_names = model_names

    async def list(self, principal: Principal) -> list[Agent]:
        """The organization's agents (not deleted), oldest first."""
        async with self.db.read() as conn:
            return await agents_mod.list_agents(conn, principal.org_id)

    async def get(self, principal: Principal, ref: str) -> Agent:
        """An agent by id, slug or name (404 otherwise)."""
        async with self.db.read() as conn:
            return await agents_mod.find_agent(conn, principal.org_id, ref)

    async def save(
        self, principal: Principal, body: dict[str, Any], *, ref: str | None = None
    ) -> Agent:
        """Create (``ref`` None) or update an agent from a public body; needs
        ``agent:update``."""
        principal.require(Scope.update)
        changes = changes_from_body(body)
        async with self.db.tx() as conn:
            return await agents_mod.save_agent(
                conn,
                self.clock,
                self.ids,
                principal.org_id,
                agent_ref=ref,
                known_models=self.model_names,
                **changes,
            )
