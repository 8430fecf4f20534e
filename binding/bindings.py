"""Sessions and their active trigger binding.

Each intake records where the session's replies go. A session has exactly one active
binding: a new address deactivates the old one in the same transaction. A gating
delivery is resolved through the binding that is active when the approval commits (its
address is copied onto the delivery row in that transaction).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from binding.routes import fold_address
from leadgate.core.clock import Clock, IdFactory
from leadgate.core.types import CATCH_UP_EVENTS, BindingSpec
from leadgate.database import schema as t
from leadgate.database.db import Conn
from leadgate.database.sql import insert_ignore_stmt
from leadgate.domain.rows import Binding, Session

B = t.bindings.c


S = t.sessions.c


class CurrentBinding(NamedTuple):
    """The active binding's fields :func:`activate` compares, as :func:`open_session`
    read them with the session (one statement instead of two)."""

    id: str
    kind: str
    address: Any
    silent: bool


#: Built once (statement construction costs as much as execution on the turn path): the
#: session of (agent, key) with its active binding, if any, in one statement.
SESSION_AND_BINDING = (
    sa.select(
        S.id,
        B.id.label("binding_id"),
        B.kind.label("binding_kind"),
        B.address.label("binding_address"),
        B.silent.label("binding_silent"),
    )
    .select_from(t.sessions.outerjoin(t.bindings, sa.and_(B.session_id == S.id, B.active)))
    .where(S.agent_id == sa.bindparam("p_agent_id"), S.key == sa.bindparam("p_key"))
)

_ACTIVE_BINDING = sa.select(t.bindings).where(
    B.session_id == sa.bindparam("p_session_id"), B.active
)


class OpenSession(NamedTuple):
    """What :func:`open_session` found or made."""

    id: str
    #: the active binding (``None`` when it has none), for :func:`activate`
    binding: CurrentBinding | None
    #: made by this transaction: nothing else (a binding, an item, a message) can refer
    #: to it yet, since no other transaction sees it before this one commits
    created: bool


def session_from_row(row: Any) -> OpenSession:
    """An existing session from a row with :data:`SESSION_AND_BINDING`'s columns."""
    current = None
    if row.binding_id is not None:
        current = CurrentBinding(
            row.binding_id, row.binding_kind, row.binding_address, row.binding_silent
        )
    return OpenSession(str(row.id), current, False)


async def open_session(
    conn: Conn, clock: Clock, ids: IdFactory, org_id: str, agent_id: str, key: str
) -> OpenSession:
    """The session of (agent, key), created on first use (race-safe), with its active
    binding. One SELECT when the session exists (the usual case), a SELECT and an
    INSERT when this transaction creates it."""
    params = {"p_agent_id": agent_id, "p_key": key}
    row = (await conn.execute(SESSION_AND_BINDING, params)).first()
    if row is None:
        session = session_values(clock, ids, org_id, agent_id, key)
        session_id = session["id"]
        res = await conn.execute(insert_ignore_stmt(conn.dialect.name, t.sessions), session)
        if res.rowcount == 1:
            return OpenSession(session_id, None, True)
        # Another transaction created it first (PostgreSQL: we waited for its commit).
        row = (await conn.execute(SESSION_AND_BINDING, params)).one()
    return session_from_row(row)


def session_values(
    clock: Clock, ids: IdFactory, org_id: str, agent_id: str, key: str
) -> dict[str, Any]:
    """A new ``sessions`` row of (agent, key)."""
    return {
        "id": ids.new("ses"),
        "org_id": org_id,
        "agent_id": agent_id,
        "key": key,
        "created_at": clock.now_ms(),
    }


def binding_values(
    clock: Clock, ids: IdFactory, org_id: str, session_id: str, spec: BindingSpec
) -> dict[str, Any]:
    """A new active ``bindings`` row of ``spec`` for the session."""
    return {
        "id": ids.new("bnd"),
        "org_id": org_id,
        "session_id": session_id,
        "kind": spec.kind.value,
        "address": spec.address,
        "silent": spec.silent,
        "route_id": spec.route_id,
        "active": True,
        "created_at": clock.now_ms(),
    }


def is_unchanged(current: Any, spec: BindingSpec) -> bool:
    """Whether the active binding ``current`` already is ``spec`` (:func:`activate`
    then writes nothing). :data:`UNCHANGED_SQL` is the same test in SQL: change both."""
    return bool(
        current.kind == spec.kind.value
        and current.address == spec.address
        and bool(current.silent) == spec.silent
    )


#: PostgreSQL: :func:`is_unchanged` as a condition on a row with the columns of
#: :data:`SESSION_AND_BINDING` (the JSON address compared as ``jsonb``: key order does not
#: matter, as for Python's ``==`` of dicts), with the parameters of
#: :func:`unchanged_params`. False when the session has no active binding.
UNCHANGED_SQL = (
    "binding_kind = :binding_kind"
    " AND CAST(binding_address AS jsonb) = CAST(:binding_address AS jsonb)"
    " AND COALESCE(binding_silent, false) = :binding_silent"
)


def unchanged_params(spec: BindingSpec) -> dict[str, Any]:
    """The parameters of :data:`UNCHANGED_SQL` for ``spec``."""
    return {
        "binding_kind": spec.kind.value,
        "binding_address": json.dumps(spec.address),
        "binding_silent": spec.silent,
    }


_DEACTIVATE = t.bindings.update().where(B.id == sa.bindparam("p_id"))
_INSERT_BINDING = t.bindings.insert()

#: ``activate(current=UNREAD)``: read the active binding in ``activate`` itself.
UNREAD: Any = object()


async def activate(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    org_id: str,
    session_id: str,
    spec: BindingSpec,
    current: Any = UNREAD,
) -> str:
    """Make ``spec`` the session's active binding; returns its id (reused when unchanged).

    ``current`` is the active binding as :func:`open_session` read it earlier in the same
    transaction (saves a SELECT); by default it is read here.
    """
    if current is UNREAD:
        current = (await conn.execute(_ACTIVE_BINDING, {"p_session_id": session_id})).first()
    if current is not None and is_unchanged(current, spec):
        return str(current.id)
    if current is not None:
        await conn.execute(_DEACTIVATE, {"p_id": current.id, "active": False})
    values = binding_values(clock, ids, org_id, session_id, spec)
    await conn.execute(_INSERT_BINDING, values)
    return str(values["id"])


async def active_binding(conn: Conn, session_id: str) -> Binding | None:
    """The session's active binding, if any."""
    row = (await conn.execute(_ACTIVE_BINDING, {"p_session_id": session_id})).first()
    return None if row is None else Binding.from_row(row)


async def get_binding(conn: Conn, binding_id: str) -> Binding | None:
    """A binding by id (active or not), if it exists."""
    row = (await conn.execute(sa.select(t.bindings).where(B.id == binding_id))).first()
    return None if row is None else Binding.from_row(row)


async def deactivate_session(conn: Conn, session_id: str) -> int:
    """Deactivate the session's bindings (gating deliveries then fail as "no active
    binding"; a plain turn's reply is then not queued)."""
    res = await conn.execute(
        t.bindings.update().where(B.session_id == session_id, B.active).values(active=False)
    )
    return int(res.rowcount or 0)


_FIND_SESSION = sa.select(t.sessions).where(
    S.agent_id == sa.bindparam("p_agent_id"), S.key == sa.bindparam("p_key")
)


async def find_session(conn: Conn, agent_id: str, key: str) -> Session | None:
    """The session of (agent, key), if a turn ever ran in it."""
    row = (await conn.execute(_FIND_SESSION, {"p_agent_id": agent_id, "p_key": key})).first()
    return None if row is None else Session.from_row(row)


E = t.inbound_events.c


def _sessions_taking(predicate: str) -> sa.Select[tuple[str, str]]:
    """(id, key) of each session that ever took in an event of ``predicate`` (a
    catch-up's kind: :func:`leadgate.database.schema.catch_up_predicate`): the distinct
    ``session_id`` of that kind's partial index (whose predicate each read repeats
    literally, to use it), one seek each (the least one above the last: neither SQLite
    nor PostgreSQL skips through an index by itself), so the read grows with the
    channels, not with their messages or other channels'."""
    kind = sa.text(predicate)
    first = t.inbound_events.alias("first_event")
    found = (
        sa.select(sa.func.min(first.c.session_id).label("session_id"))
        .where(kind)
        .cte("caught_up_sessions", recursive=True)
    )
    later = t.inbound_events.alias("later_event")
    following = (
        sa.select(sa.func.min(later.c.session_id))
        .where(kind, later.c.session_id > found.c.session_id)
        .scalar_subquery()
    )
    found = found.union_all(sa.select(following).where(found.c.session_id.is_not(None)))
    return sa.select(S.id, S.key).select_from(found.join(t.sessions, S.id == found.c.session_id))


def _events_since(predicate: str) -> sa.Select[tuple[str, str]]:
    """The events of ``predicate`` the sessions ``p_ids`` took in since ``p_since``: the
    same index, one range of each session's."""
    return sa.select(E.session_id, E.external_event_id).where(
        sa.text(predicate),
        E.session_id.in_(sa.bindparam("p_ids", expanding=True)),
        E.created_at >= sa.bindparam("p_since"),
    )


#: The most deliveries read sent under one Message-ID (see :data:`EMAIL_REPLY_SESSIONS`).
_SENT_ROWS_READ = 5


#: The key of the session an event was taken in under (``inbound_events``' unique
#: ``external_event_id``, then the session's primary key): one seek of each.
_EVENT_SESSION_KEY = (
    sa.select(S.key)
    .select_from(t.inbound_events.join(t.sessions, S.id == E.session_id))
    .where(E.external_event_id == sa.bindparam("p_event"))
)


async def event_session_key(conn: Conn, external_event_id: str) -> str | None:
    """The key of the session the message taken in under ``external_event_id`` belongs
    to; None when none was taken in so (or it was taken in no session). An email reply
    naming the person's own earlier mail alone finds that mail's session so."""
    key = await conn.scalar(_EVENT_SESSION_KEY, {"p_event": external_event_id})
    return None if key is None else str(key)


#: The keys of the sessions whose email reply was sent under a Message-ID (a delivery's
#: ``external_id``), in one organization, with the address each was sent to: one seek of
#: ``ix_deliveries_email_reply_external`` (its predicate repeated literally), then each
#: binding's and session's primary key. A Message-ID is one reply's as a rule; a few rows
#: are read at most, whatever else shares it.
_SENT = (
    # Its own select: the predicate's columns unqualified (bindings has a kind too).
    sa.select(t.deliveries.c.binding_id)
    .where(
        sa.text(t.EMAIL_REPLY_PREDICATE),
        t.deliveries.c.external_id == sa.bindparam("p_message_id"),
        t.deliveries.c.org_id == sa.bindparam("p_org"),
    )
    .limit(_SENT_ROWS_READ)
    .subquery("sent")
)
EMAIL_REPLY_SESSIONS = sa.select(S.key, B.address).select_from(
    _SENT.join(t.bindings, B.id == _SENT.c.binding_id).join(t.sessions, S.id == B.session_id)
)


async def email_reply_session_key(
    conn: Conn, org_id: str, message_id: str, *, sent_to: str, sent_from: str
) -> str | None:
    """The key of the session of ``org_id`` whose email reply was sent under
    ``message_id`` to ``sent_to`` from ``sent_from`` (its binding's address; compared as
    :func:`~binding.routes.fold_address` folds them), or None. An answer naming one of
    our replies alone finds its thread so when that reply's Message-ID does not carry
    it; only a thread of the person's own with that address is found, never a reply we
    sent someone else."""
    to, sender = fold_address(sent_to), fold_address(sent_from)
    rows = await conn.execute(EMAIL_REPLY_SESSIONS, {"p_message_id": message_id, "p_org": org_id})
    for key, address in rows:
        if not isinstance(address, Mapping):
            continue
        if (
            fold_address(str(address.get("to") or "")) == to
            and fold_address(str(address.get("from") or "")) == sender
        ):
            return str(key)
    return None


#: Each catch-up's two statements by its event prefix, built once (the plan cache keys
#: on the statement object).
CATCH_UP_READS = {
    prefix: (
        _sessions_taking(t.catch_up_predicate(prefix)),
        _events_since(t.catch_up_predicate(prefix)),
    )
    for prefix in CATCH_UP_EVENTS.values()
}
#: Sessions per read of their recent events (well inside both drivers' bound parameters).
_SESSIONS_PER_READ = 1000


async def recorded_since(
    conn: Conn, event_prefix: str, key_prefix: str, since_ms: int
) -> dict[str, tuple[str, ...]]:
    """Each session whose key starts with ``key_prefix`` and that ever took in an event
    whose id starts with ``event_prefix`` (one of :data:`CATCH_UP_EVENTS`': a Discord
    gateway message, a Slack message; by key: the agents answering one conversation
    share it) -> the external ids of those recorded in it since ``since_ms`` (empty when
    none). A catch-up's starting points, read from the partial index of that kind's
    events alone (``ix_inbound_events_gateway``, ``ix_inbound_events_slack``): the
    channels, then the window's messages."""
    sessions, since = CATCH_UP_READS[event_prefix]
    keys = {
        str(row.id): str(row.key)
        for row in (await conn.execute(sessions)).all()
        if str(row.key).startswith(key_prefix)
    }
    found: dict[str, set[str]] = {key: set() for key in keys.values()}
    ids = list(keys)
    for start in range(0, len(ids), _SESSIONS_PER_READ):
        some = ids[start : start + _SESSIONS_PER_READ]
        recent = await conn.execute(since, {"p_ids": some, "p_since": since_ms})
        for row in recent.all():
            found[keys[str(row.session_id)]].add(str(row.external_event_id))
    return {key: tuple(sorted(ids)) for key, ids in found.items()}


P = t.catch_up_points.c
_READ_POINTS = sa.select(P.conversation, P.start_ms, P.read_through, P.updated_at).where(
    P.channel == sa.bindparam("p_channel")
)


async def read_points(
    conn: Conn, channel: str
) -> tuple[dict[str, int], frozenset[str], dict[str, int]]:
    """Where each catch-up of ``channel`` (a binding kind) starts, by conversation (its
    channel: Discord's id, Slack's ``TEAM:CHANNEL``): those it has a point for; those
    whose last catch-up read them through (:func:`advance_read_points`); and when each
    point was last written (the clock's epoch ms)."""
    rows = (await conn.execute(_READ_POINTS, {"p_channel": channel})).all()
    points = {str(row.conversation): int(row.start_ms) for row in rows}
    written = {str(row.conversation): int(row.updated_at) for row in rows}
    return points, frozenset(str(row.conversation) for row in rows if row.read_through), written


@functools.cache
def _advance_stmt(dialect: str, read_through: bool, kept: bool = False) -> Any:
    """``INSERT ... ON CONFLICT DO UPDATE`` for ``dialect``, built once: one statement,
    so that two catch-ups (two replicas) storing at once keep the later point whichever
    commits last. A read-through (``read_through``) moves the point and marks it only
    where the stored one is not later (a later one is another catch-up's, which may
    have failed: its mark stays). A catch-up starting to read a channel marks it not
    read through whatever the point (it may fail), and keeps the later point. A kept
    live message's point (``kept``) marks it not read through too, and keeps the earlier
    point unless the stored one was read through: a second kept message of the channel
    moved it past the first, which no read-back then read."""
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(t.catch_up_points)
    if read_through:
        return stmt.on_conflict_do_update(
            index_elements=[P.channel, P.conversation],
            set_={
                "start_ms": stmt.excluded.start_ms,
                "updated_at": stmt.excluded.updated_at,
                "read_through": True,
            },
            where=P.start_ms <= stmt.excluded.start_ms,
        )
    later = sa.case((P.start_ms < stmt.excluded.start_ms, stmt.excluded.start_ms), else_=P.start_ms)
    if kept:
        earlier = sa.case(
            (P.start_ms > stmt.excluded.start_ms, stmt.excluded.start_ms), else_=P.start_ms
        )
        later = sa.case((P.read_through, later), else_=earlier)
    return stmt.on_conflict_do_update(
        index_elements=[P.channel, P.conversation],
        set_={"start_ms": later, "updated_at": stmt.excluded.updated_at, "read_through": False},
    )


async def advance_read_points(
    conn: Conn,
    clock: Clock,
    channel: str,
    points: Mapping[str, int],
    *,
    read_through: bool,
    kept: bool = False,
) -> None:
    """Move where the next catch-up of each conversation of ``channel`` starts to
    ``points``' (epoch ms), or keep the stored point where it is later: never back.
    ``read_through``: a catch-up read those conversations through (their next catch-up
    may start from the newest message taken in since); else one is starting to read
    them (their next starts from the point alone until one reads them through).
    ``kept``: the point of a live message kept for the next read-back, which moves a
    point not read through back, never forward (:func:`_advance_stmt`)."""
    now = clock.now_ms()
    stmt = _advance_stmt(conn.dialect.name, read_through, kept)
    for conversation, start_ms in points.items():
        await conn.execute(
            stmt,
            {
                "channel": channel,
                "conversation": conversation,
                "start_ms": start_ms,
                "updated_at": now,
                "read_through": read_through,
            },
        )
