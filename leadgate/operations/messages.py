"""Sending a message to a worker: the api binding (REST, MCP) and the channels' inbound
messages (route -> trigger -> turn), on the one turn path."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from binding import routes
from leadgate.core.auth import Principal, Scope
from leadgate.core.tasks import Background
from leadgate.core.types import (
    BindingKind,
    BindingSpec,
    Inbound,
    Outcome,
    Routed,
    RouteMatch,
    Trigger,
)
from leadgate.database.db import Database
from leadgate.operations.sessions import api_session_key
from leadgate.turns.path import DeltaSink, TurnService

log = logging.getLogger("leadgate.messages")


class Messages:
    """What REST, MCP and the channel adapters send."""

    def __init__(self, db: Database, turns: TurnService, background: Background) -> None:
        self.db = db
        self.turns = turns
        self.background = background

    async def send(
        self,
        principal: Principal,
        agent_ref: str,
        text: str,
        *,
        session: str | None,
        user: str | None = None,
        on_delta: DeltaSink | None = None,
        on_start: Callable[[], Awaitable[None]] | None = None,
        binding: BindingKind = BindingKind.api,
        external_event_id: str | None = None,
    ) -> Outcome:
        """One api-binding turn for ``agent_ref`` (id, slug or name) of the caller's
        organization; the agent is looked up (NotFound) in the intake transaction, and
        the message limits are checked by the turn path before anything is stored.

        ``binding`` is ``api`` (REST, MCP) or ``studio``; ``external_event_id`` makes the
        intake take the message at most once (``Duplicate`` afterwards), as for a
        channel's redelivered event (REST's ``Idempotency-Key``)."""
        principal.require(Scope.trigger)
        trigger = Trigger(
            org_id=principal.org_id,
            agent_id=agent_ref,
            session_key=api_session_key(principal, session=session, user=user),
            text=text,
            binding=BindingSpec(binding),
            external_event_id=external_event_id,
        )
        return await self.turns.run(trigger, on_delta=on_delta, on_start=on_start)

    async def resolve_route(self, channel: str, attrs: Mapping[str, str]) -> RouteMatch | None:
        """Most specific active route of ``channel`` matching ``attrs``."""
        async with self.db.read() as conn:
            return await routes.resolve(conn, channel, attrs)

    async def take_inbound(self, inbound: Inbound) -> Routed | None:
        """The one "route -> trigger -> submit" step of every channel adapter.

        ``None`` when no route answers there (logged; no turn runs). A plain reply is
        already queued in the outbox when this returns; gated, busy and duplicate
        outcomes post nothing.
        """
        route = await self.resolve_route(inbound.channel.value, inbound.route_attrs)
        if route is None:
            log.info("%s: no route for %s; no turn", inbound.channel.value, inbound.route_attrs)
            return None
        outcome = await self.turns.run(inbound.trigger(route))
        return Routed(outcome, route)

    def spawn(self, coro: Awaitable[object], *, name: str) -> None:
        """Run ``coro`` in the background (tracked, logged on failure, awaited on shutdown)."""
        self.background.spawn(coro, name=name)
