"""Transcript rows: storing a turn's messages and the visible reads of them.

A message is ``user``, ``assistant``, ``tool`` or ``internal`` (lead feedback, a
human's return). An assistant message of a turn that called ``complete_task`` is stored
with ``lead_gated = true`` and stays out of every visible read until its item is
approved (the relay's reveal clears the flag).
"""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa

from leadgate.core.clock import Clock, IdFactory
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database
from leadgate.database.groups import Grouped
from leadgate.domain import session_events

# Built once: the turn path stores two or three messages per turn. On PostgreSQL stamped
# in the statement after the session's newest message (session_events.message_created_at:
# the session's order is the order the database took its messages in, whatever the
# replicas' clocks); the other columns are the row's values (message_values). SQLite takes
# the row as it is (its stamp is the clock's reading: session_events says why): the
# stamped statement reduced to the plain insert there still cost a plain turn 5,000
# instructions (+0.5%, bench.instructions), SQLAlchemy working out its cache key at every
# execution.
_INSERT_MESSAGE = t.messages.insert()
_INSERT_STAMPED = t.messages.insert().values(
    created_at=session_events.message_created_at(
        sa.bindparam("m_at", type_=t.messages.c.created_at.type),
        sa.bindparam("m_sid", type_=t.messages.c.session_id.type),
    )
)
#: Roles a visible transcript shows (and the session event log announces).
_VISIBLE_ROLES = frozenset({"user", "assistant"})


async def store_message(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    *,
    org_id: str,
    session_id: str,
    work_item_id: str | None,
    role: str,
    content: str,
    tool_name: str | None = None,
    gated: bool = False,
    created_at: int | None = None,
    taken_by: str | None = None,
    message_id: str | None = None,
    answers: str | None = None,
) -> str:
    """Insert one message; returns its id. A visible one (user or assistant, not gated)
    is announced in the session's public event log in the same transaction. It is
    stamped at ``created_at`` (the clock's now by default), on PostgreSQL at the later
    of that and the session's newest message + 1 ms
    (:func:`session_events.message_created_at`). ``taken_by``: the process whose plain
    REST/MCP/Studio turn takes this user message in (:func:`message_values`).
    ``message_id``: its id, made before (a new one by default). ``answers``: the user
    message an assistant message of a plain REST/MCP/Studio turn answers
    (:func:`message_values`)."""
    values = message_values(
        clock,
        ids,
        org_id=org_id,
        session_id=session_id,
        work_item_id=work_item_id,
        role=role,
        content=content,
        tool_name=tool_name,
        gated=gated,
        created_at=created_at,
        taken_by=taken_by,
        message_id=message_id,
        answers=answers,
    )
    if conn.dialect.name == "postgresql":
        await conn.execute(
            _INSERT_STAMPED, {**values, "m_at": values["created_at"], "m_sid": session_id}
        )
    else:
        await conn.execute(_INSERT_MESSAGE, values)
    if role in _VISIBLE_ROLES and not gated:
        await session_events.message_visible(conn, clock, session_id, values["id"])
    return str(values["id"])


def message_values(
    clock: Clock,
    ids: IdFactory,
    *,
    org_id: str,
    session_id: str,
    work_item_id: str | None,
    role: str,
    content: str,
    tool_name: str | None = None,
    gated: bool = False,
    created_at: int | None = None,
    taken_by: str | None = None,
    message_id: str | None = None,
    answers: str | None = None,
) -> dict[str, Any]:
    """A new ``messages`` row (a new id; ``created_at`` defaults to the clock's now).
    ``taken_by`` (a plain REST/MCP/Studio turn's user message: its process, which turn
    recovery reruns it for once that process is gone, :func:`leadgate.turns.runs.
    record_taken`) is in the row only when given: other inserts keep their columns.
    ``message_id``: its id, made before (a keyed plain turn's, which its inbound event's
    id is derived from: :func:`leadgate.turns.runs.event_id_of`). ``answers`` (a plain
    turn's assistant message: the user message it answers, which turn recovery tells an
    answered message by, :func:`leadgate.turns.runs.answered`) likewise only when given."""
    row = {
        "id": ids.new("msg") if message_id is None else message_id,
        "org_id": org_id,
        "session_id": session_id,
        "work_item_id": work_item_id,
        "role": role,
        "content": content,
        "lead_gated": gated,
        "tool_name": tool_name,
        "created_at": clock.now_ms() if created_at is None else created_at,
    }
    if taken_by is not None:
        row["taken_by"] = taken_by
    if answers is not None:
        row["answers"] = answers
    return row


class VisibleWrites:
    """:func:`store_message` of visible messages (user or assistant) as transactions of
    their own, for a service's turns.

    On PostgreSQL each is one statement outside a transaction block (one round trip, not
    four: ``BEGIN``, the message, its event, ``COMMIT``), and the messages of concurrent
    turns go in one statement (:class:`leadgate.database.groups.Grouped`: a reply costs
    PostgreSQL and the service mostly what a statement costs, whatever it writes)."""

    def __init__(self, db: Database, clock: Clock, ids: IdFactory, *, in_flight: int = 1) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        #: The grouped writes (PostgreSQL), or None.
        self.group: Grouped[session_events.VisibleMessage, bool] | None = None
        if db.statements_alone:
            self.group = Grouped(
                functools.partial(session_events.store_visible_alone, db),
                functools.partial(session_events.store_visible_many, db),
                in_flight=in_flight,
            )

    async def store(
        self,
        *,
        org_id: str,
        session_id: str,
        work_item_id: str | None,
        role: str,
        content: str,
        created_at: int | None = None,
        answers: str | None = None,
    ) -> str:
        """Store the message, committed when this returns; returns its id.
        ``created_at`` defaults to the clock's now; ``answers``: the user message it
        answers (:func:`message_values`)."""
        if role not in _VISIBLE_ROLES:
            # The statement always writes the message event: a hidden role would leak.
            raise ValueError(f"VisibleWrites stores user or assistant messages, not {role!r}")
        if self.group is None:
            async with self.db.tx() as conn:
                return await store_message(
                    conn,
                    self.clock,
                    self.ids,
                    org_id=org_id,
                    session_id=session_id,
                    work_item_id=work_item_id,
                    role=role,
                    content=content,
                    created_at=created_at,
                    answers=answers,
                )
        message = session_events.VisibleMessage(
            self.ids.new("msg"),
            org_id,
            session_id,
            work_item_id,
            role,
            content,
            self.clock.now_ms() if created_at is None else created_at,
            answers,
        )
        if not await self.group(message):
            raise RuntimeError(f"session {session_id} does not exist; the message was not stored")
        return message.id


async def visible_transcript(conn: Conn, org_id: str, session_id: str) -> list[dict[str, Any]]:
    """The transcript as users may see it: leadGated rows are skipped."""
    m = t.messages.c
    rows = (
        await conn.execute(
            sa.select(m.id, m.role, m.content, m.created_at)
            .where(
                m.org_id == org_id,
                m.session_id == session_id,
                m.role.in_(["user", "assistant"]),
                sa.not_(m.lead_gated),
            )
            .order_by(m.created_at, m.id)
        )
    ).all()
    return [dict(r._mapping) for r in rows]
