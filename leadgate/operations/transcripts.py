"""Reading a session as its client may see it (SPEC 13): the visible transcript and the
public session event log, for REST, the review-status SSE stream, MCP resources and Studio.

A session is named as on the turn path (:mod:`leadgate.operations.sessions`): the
agent's id, slug or name of the caller's organization (another organization's agent is
404) and the public session name. Only visible rows are shown: user and assistant
messages that are not leadGated, so a gated answer is absent until it is revealed, and
then appears in place (at its own time). No work item, id or revision appears anywhere.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, NamedTuple, NotRequired, TypedDict

import sqlalchemy as sa

from binding import bindings
from leadgate.core.auth import Principal, Scope
from leadgate.core.clock import Clock, IdFactory, iso
from leadgate.core.decoding import decimal_int
from leadgate.core.errors import ValidationError
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database
from leadgate.domain import agents as agents_mod
from leadgate.domain import session_events
from leadgate.domain.session_events import SessionEvent
from leadgate.operations.sessions import api_session_key

#: ``limit`` of a transcript page: 1..100, 100 when not given.
PAGE_MAX = 100
#: A page ends early (``has_more`` true) once its messages' text passes this many
#: characters, with at least one message: a hundred messages of 100,000 characters made
#: a 9 MB answer, which the service held in full while a client did not read it.
PAGE_MAX_CHARS = 1_000_000

_M = t.messages.c
_VISIBLE = (
    _M.session_id == sa.bindparam("p_sid"),
    _M.role.in_(["user", "assistant"]),
    sa.not_(_M.lead_gated),
)


def _within_chars(page: sa.Select[Any]) -> sa.Select[Any]:
    """``page``'s rows whose earlier rows' text stays within ``p_chars``: the fitting
    rows and at most one more (which tells :meth:`Transcripts.messages` that there
    is more). Cut in the database so that a page of long messages is not fetched whole
    to send a tenth of it (a hundred rows of 100,000 characters were 10 MB per request,
    and on PostgreSQL concurrent reads each held theirs while they waited)."""
    rows = page.subquery("page")
    text = sa.func.coalesce(sa.func.length(rows.c.content), 0)
    running = sa.func.sum(text).over(order_by=(rows.c.created_at, rows.c.id))
    measured = sa.select(rows, (running - text).label("chars_before")).subquery("measured")
    return (
        sa.select(measured.c.id, measured.c.role, measured.c.content, measured.c.created_at)
        .where(measured.c.chars_before <= sa.bindparam("p_chars", type_=sa.BigInteger))
        .order_by(measured.c.created_at, measured.c.id)
    )


_PAGE = _within_chars(
    sa.select(_M.id, _M.role, _M.content, _M.created_at)
    .where(*_VISIBLE)
    .order_by(_M.created_at, _M.id)
    .limit(sa.bindparam("p_limit"))
)
_PAGE_AFTER = _within_chars(
    sa.select(_M.id, _M.role, _M.content, _M.created_at)
    .where(
        *_VISIBLE,
        sa.tuple_(_M.created_at, _M.id)
        > sa.tuple_(sa.bindparam("p_at", type_=sa.BigInteger), sa.bindparam("p_id")),
    )
    .order_by(_M.created_at, _M.id)
    .limit(sa.bindparam("p_limit"))
)
_POSITION = sa.select(_M.created_at, _M.id).where(
    _M.id == sa.bindparam("p_id"), _M.session_id == sa.bindparam("p_sid")
)


#: Sessions whose agent is not deleted, among ``p_ids`` (at most a chunk of them).
_READABLE = (
    sa.select(t.sessions.c.id)
    .select_from(t.sessions.join(t.agents, t.agents.c.id == t.sessions.c.agent_id))
    .where(
        t.sessions.c.id.in_(sa.bindparam("p_ids", expanding=True)),
        t.agents.c.deleted_at.is_(None),
    )
)
_READABLE_CHUNK = 500


class SessionRef(NamedTuple):
    """A session as a reader named it: its agent and, once a turn ran in it, its id."""

    agent_id: str
    session_id: str | None


class MessageView(TypedDict):
    """A visible message of a transcript."""

    id: str
    role: str | None
    content: str | None
    createdAt: str | None


class ReviewStatusView(TypedDict):
    """The public review status of a session's held work."""

    status: str | None


class TranscriptPage(TypedDict):
    """A page of a transcript: ``review`` only when the reader asked for it (MCP)."""

    object: str
    data: list[MessageView]
    has_more: bool
    review: NotRequired[ReviewStatusView | None]


def public_message(
    message_id: str, role: str | None, content: str | None, created_at: int | None
) -> MessageView:
    """A visible message as every public read shows it."""
    return {"id": message_id, "role": role, "content": content, "createdAt": iso(created_at)}


def public_event(event: SessionEvent) -> tuple[str, MessageView | ReviewStatusView]:
    """(SSE event name, data) of a session event: the message, or ``{"status"}``."""
    if event.kind == session_events.MESSAGE and event.message_id is not None:
        return "message", public_message(
            event.message_id, event.role, event.content, event.created_at
        )
    return "review", {"status": event.status}


def parse_limit(raw: str | None) -> int:
    """``limit``: an integer 1..100 (400 naming the rule otherwise); default 100."""
    if raw is None or raw == "":
        return PAGE_MAX
    limit = decimal_int(raw) or 0
    if not 1 <= limit <= PAGE_MAX:
        raise ValidationError(
            f"limit must be an integer from 1 to {PAGE_MAX}", rule="transcript.limit"
        )
    return limit


class Transcripts:
    """Transcript pages and session event reads for the caller's organization."""

    def __init__(self, db: Database, clock: Clock, ids: IdFactory) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids

    async def find(self, principal: Principal, agent_ref: str, name: str) -> SessionRef:
        """The session ``name`` of ``agent_ref`` (404 for an agent of another
        organization; ``session_id`` None when no turn ran in it yet)."""
        principal.require(Scope.trigger)
        key = api_session_key(principal, session=name)
        async with self.db.read() as conn:
            agent = await agents_mod.find_agent(conn, principal.org_id, agent_ref)
            session = await bindings.find_session(conn, agent.id, key)
        return SessionRef(agent.id, session.id if session else None)

    async def open(self, principal: Principal, agent_ref: str, name: str) -> str:
        """The session's id, creating the (empty) session when no turn ran in it yet, so
        that a reader can wait for its first events (race-safe with a first turn)."""
        ref = await self.find(principal, agent_ref, name)
        if ref.session_id is not None:
            return ref.session_id
        key = api_session_key(principal, session=name)
        async with self.db.tx() as conn:
            opened = await bindings.open_session(
                conn, self.clock, self.ids, principal.org_id, ref.agent_id, key
            )
        return opened.id

    async def messages(
        self,
        principal: Principal,
        agent_ref: str,
        name: str,
        *,
        after: str | None = None,
        limit: int = PAGE_MAX,
        with_review: bool = False,
    ) -> TranscriptPage:
        """One page of the visible transcript, oldest first:
        ``{"object": "list", "data": [...], "has_more"}``, at most ``limit`` messages and
        :data:`PAGE_MAX_CHARS` characters of text (one message, whatever its length). An
        unknown session is empty; ``after`` must be the id of a message of this session.
        ``with_review`` (MCP, which has no events stream) adds ``"review": {"status"}`` of
        the session's latest held work (``null`` when none was held), from the same read."""
        ref = await self.find(principal, agent_ref, name)
        if ref.session_id is None:
            empty: TranscriptPage = {"object": "list", "data": [], "has_more": False}
            return {**empty, "review": None} if with_review else empty
        review: str | None = None
        async with self.db.read() as conn:
            rows = await self._page(conn, ref.session_id, after, limit)
            if with_review:
                review = await session_events.latest_review(conn, ref.session_id)
        data: list[MessageView] = []
        chars = 0
        for row in rows[:limit]:
            chars += len(row.content or "")
            if data and chars > PAGE_MAX_CHARS:
                break
            data.append(public_message(*row))
        page: TranscriptPage = {"object": "list", "data": data, "has_more": len(rows) > len(data)}
        if with_review:
            page["review"] = None if review is None else {"status": review}
        return page

    async def _page(self, conn: Conn, session_id: str, after: str | None, limit: int) -> list[Any]:
        params: dict[str, Any] = {
            "p_sid": session_id,
            "p_limit": limit + 1,
            "p_chars": PAGE_MAX_CHARS,
        }
        if not after:
            return list((await conn.execute(_PAGE, params)).all())
        position = (await conn.execute(_POSITION, {"p_id": after, "p_sid": session_id})).first()
        if position is None:
            raise ValidationError(
                "after must be the id of a message of this session", rule="transcript.after"
            )
        params.update(p_at=position.created_at, p_id=position.id)
        return list((await conn.execute(_PAGE_AFTER, params)).all())

    async def readable(self, session_ids: Collection[str]) -> set[str]:
        """Which of ``session_ids`` still have their agent (not deleted): the periodic
        re-check of MCP resource subscriptions, one indexed read per chunk of sessions
        for all of them (not one per subscription, nor any per update)."""
        found: set[str] = set()
        ids = sorted(session_ids)
        async with self.db.read() as conn:
            for start in range(0, len(ids), _READABLE_CHUNK):
                chunk = ids[start : start + _READABLE_CHUNK]
                rows = await conn.execute(_READABLE, {"p_ids": chunk})
                found.update(rows.scalars())
        return found

    async def events(self, session_id: str, *, after: int, limit: int) -> list[SessionEvent]:
        """Events of a session found with :meth:`find`/:meth:`open`, after ``seq``."""
        async with self.db.read() as conn:
            return await session_events.read(conn, session_id, after=after, limit=limit)
