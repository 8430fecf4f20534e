"""Sending a message to a worker: the api binding (REST, MCP) and the channels' inbound
messages (route -> trigger -> turn), on the one turn path."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from binding import bindings, routes
from leadgate.core.auth import Principal, Scope
from leadgate.core.decoding import check_value
from leadgate.core.errors import ValidationError
from leadgate.core.limits import EVENT_ID_LIMIT, validate_message, validate_session_key
from leadgate.core.tasks import Background
from leadgate.core.types import (
    CATCH_UP_EVENTS,
    BindingKind,
    BindingSpec,
    Conversations,
    Inbound,
    Outcome,
    Recorded,
    Routed,
    RouteMatch,
    Trigger,
)
from leadgate.database.db import Database
from leadgate.operations.sessions import api_session_key
from leadgate.turns.intake import Accepted
from leadgate.turns.path import DeltaSink, TurnAnswer, TurnService

log = logging.getLogger("leadgate.messages")
#: Recorded channel turns run at once by this process (see Messages.run_recorded).
MAX_BACKGROUND_TURNS = 256


class Messages:
    """What REST, MCP and the channel adapters send."""

    def __init__(self, db: Database, turns: TurnService, background: Background) -> None:
        self.db = db
        self.turns = turns
        self.background = background
        self._running = 0
        self._routes = routes.RouteCache(db)

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
        answer: TurnAnswer | None = None,
        retake: bool = False,
    ) -> Outcome:
        """One api-binding turn for ``agent_ref`` (id, slug or name) of the caller's
        organization; the agent is looked up (NotFound) in the intake transaction, and
        the message limits are checked by the turn path before anything is stored.

        ``binding`` is ``api`` (REST, MCP) or ``studio``; ``external_event_id`` makes the
        intake take the message at most once (``Duplicate`` afterwards), as for a
        channel's redelivered event (REST's ``Idempotency-Key``); ``answer`` is written in
        the turn's last transaction (:data:`~leadgate.turns.path.TurnAnswer`: REST's
        answer under that key); ``retake``: a duplicate whose recorded run no live
        process runs is run here (REST's retry of a key whose first request's process
        died: :meth:`~leadgate.turns.path.TurnService.run`)."""
        principal.require(Scope.trigger)
        trigger = Trigger(
            org_id=principal.org_id,
            agent_id=agent_ref,
            session_key=api_session_key(principal, session=session, user=user),
            text=text,
            binding=BindingSpec(binding),
            external_event_id=external_event_id,
        )
        return await self.turns.run(
            trigger, on_delta=on_delta, on_start=on_start, answer=answer, retake=retake
        )

    def refuse_unknown(self, principal: Principal, agent_ref: str) -> None:
        """Raise NotFound (``agent.not_found``) when ``agent_ref`` was lately found to
        name no agent of the caller's organization and none has been made since
        (:meth:`leadgate.turns.intake.Intake.refuse_unknown`; no statement). For work a
        request would do before its turn: REST's Idempotency-Key claim."""
        principal.require(Scope.trigger)
        self.turns.intake.refuse_unknown(principal.org_id, agent_ref)

    async def resolve_route(self, channel: str, attrs: Mapping[str, str]) -> RouteMatch | None:
        """Most specific active route of ``channel`` matching ``attrs``."""
        return await self._routes.resolve(channel, attrs)

    async def event_session_key(self, external_event_id: str) -> str | None:
        """The key of the session the channel message taken in under
        ``external_event_id`` belongs to (None: none was): one indexed read."""
        async with self.db.read() as conn:
            return await bindings.event_session_key(conn, external_event_id)

    async def email_reply_session_key(
        self, org_id: str, message_id: str, *, sent_to: str, sent_from: str
    ) -> str | None:
        """The key of the session of ``org_id`` whose email reply was sent under
        ``message_id`` to ``sent_to`` from ``sent_from`` (None: none was): one indexed
        read."""
        async with self.db.read() as conn:
            return await bindings.email_reply_session_key(
                conn, org_id, message_id, sent_to=sent_to, sent_from=sent_from
            )

    async def conversations(
        self, channel: BindingKind, *, key_prefix: str, window_ms: int
    ) -> Conversations:
        """The sessions of ``channel`` (keys starting with ``key_prefix``) that took in
        messages of the kind its catch-up reads back (:data:`CATCH_UP_EVENTS`: Discord's
        gateway messages, Slack's), with those recorded in the last ``window_ms``, the
        match keys of its active routes and the read points stored
        (:meth:`advance_read_points`): where a catch-up of missed messages starts."""
        now = self.turns.clock.now_ms()
        events = CATCH_UP_EVENTS[channel]
        async with self.db.read() as conn:
            sessions = await bindings.recorded_since(conn, events, key_prefix, now - window_ms)
            points, read_through, written = await bindings.read_points(conn, channel.value)
        rows = await self._routes.active(channel.value)
        matches = tuple(dict(row.match) for row in rows)
        return Conversations(now - window_ms, sessions, matches, now, points, read_through, written)

    async def advance_read_points(
        self,
        channel: BindingKind,
        points: Mapping[str, int],
        *,
        read_through: bool = False,
        kept: bool = False,
    ) -> None:
        """Store where the next catch-up of each of ``channel``'s conversations starts
        (``points``: conversation -> epoch ms), never moving a stored point back (another
        replica's catch-up may have read further; a kept message's aside): one
        transaction. ``read_through``: a
        catch-up read them through; else one starts reading them; ``kept``: a live
        message's, kept for the next read-back (:func:`binding.bindings.
        advance_read_points`)."""
        if points:
            async with self.db.tx() as conn:
                await bindings.advance_read_points(
                    conn,
                    self.turns.clock,
                    channel.value,
                    points,
                    read_through=read_through,
                    kept=kept,
                )

    async def take_inbound(self, inbound: Inbound) -> Routed | None:
        """:meth:`record_inbound` then :meth:`run_recorded`, in one call.

        ``None`` when no route answers there (logged; no turn runs). A plain reply is
        already queued in the outbox when this returns; gated, busy and duplicate
        outcomes post nothing.
        """
        recorded = await self.record_inbound(inbound)
        return None if recorded is None else await self.run_recorded(recorded)

    async def record_inbound(self, inbound: Inbound, *, notice: bool = True) -> Recorded | None:
        """The first half of every channel adapter's one shared step, awaited before the
        platform is answered: route, check, and take the message in durably (one short
        transaction; an accepted message is recorded as a run that survives a crash).

        ``None``: no route answers there. A message that breaks a message rule (too
        long, NUL, not text), with ``notice``, is recorded as rejected and answered with
        a reply saying why (without: recorded nowhere, a Discord interaction's HTTP
        response says why); either way, when its worker is deleted or deactivated, it is
        refused as the same message within the rules is (``agent.not_found``,
        ``agent.inactive``).
        Identifiers that cannot be stored (NUL, lone surrogates, over-long) are a
        :class:`ValidationError`: the adapter answers 400 and nothing is stored.
        """
        _check_identifiers(inbound)
        route = await self.resolve_route(inbound.channel.value, inbound.route_attrs)
        if route is None:
            log.info("%s: no route for %s; no turn", inbound.channel.value, inbound.route_attrs)
            return None
        trigger = inbound.trigger(route)
        try:
            validate_message(trigger.text)
        except ValidationError as exc:
            if notice:
                await self.turns.reject_inbound(trigger, exc)
            else:
                await self.turns.refuse_if_worker_off(trigger)
            return Recorded(route, rejected=exc)
        taken = await self.turns.take(trigger)
        if isinstance(taken, Accepted):
            return Recorded(route, turn=taken)
        return Recorded(route, outcome=taken)

    async def run_recorded(self, recorded: Recorded) -> Routed | None:
        """The second half, in the background: run the recorded turn (``None`` for a
        rejected message, or for one left to the recovery runner). A failing turn leaves
        a failure notice for the person.

        At most :data:`MAX_BACKGROUND_TURNS` run at once: under a flood of channel
        messages (or a slow model) the rest stay recorded and the recovery runner takes
        them one session at a time, instead of piling up tasks in memory.
        """
        if recorded.rejected is not None:
            return None
        if recorded.outcome is not None:
            return Routed(recorded.outcome, recorded.route)
        turn: Accepted = recorded.turn
        if self._running >= MAX_BACKGROUND_TURNS and turn.ctx.run_token is not None:
            self.turns.orphaned(turn.ctx.run_token)
            return None
        self._running += 1
        try:
            outcome = await self.turns.execute(turn)
        finally:
            self._running -= 1
        return Routed(outcome, recorded.route)

    def spawn(self, coro: Awaitable[object], *, name: str) -> None:
        """Run ``coro`` in the background (tracked, logged on failure, awaited on shutdown)."""
        self.background.spawn(coro, name=name)


def _check_identifiers(inbound: Inbound) -> None:
    """What an adapter parsed out of a (verified) body must be storable as it is."""
    check_value(
        {"attrs": inbound.route_attrs, "address": inbound.address, "id": inbound.external_event_id}
    )
    validate_session_key(inbound.session_key)
    if len(inbound.external_event_id) > EVENT_ID_LIMIT or any(
        len(value) > EVENT_ID_LIMIT for value in inbound.route_attrs.values()
    ):
        raise ValidationError("an identifier in the request is too long", rule="inbound.id")
