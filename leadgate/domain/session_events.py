"""The public session event log: what the review-status SSE stream and MCP resource
subscriptions replay (SPEC 13).

Two kinds of event, one log per session, each with a sequence number ``seq`` that is the
stream's ``id:``:

* ``message``: a visible message (user or assistant, not leadGated) was stored, or a
  gated one was revealed by the relay (``message_id`` names it; readers join its row);
* ``review``: the session's held work changed its public status (``pending`` for every
  non-terminal status of held work, then ``delivered``, ``rejected``, ``cancelled``,
  ``failed`` or ``abandoned``). Nothing else: no work item id, revision or reviewer text.

Events are written in the transaction of the change they report (a message stored, a
message revealed, a work item moved), by :func:`message_visible` and
:func:`status_changed`, which the few places that do those things call. They are queued
and written as the **last** statements of that transaction
(:func:`leadgate.database.db.before_commit`): on SQLite one statement per session (an
``executemany`` over the sessions with as many events), on PostgreSQL one statement for
all of them.

Why a resuming reader (``Last-Event-ID: n``, then ``seq > n`` in ``seq`` order) can
neither miss nor repeat an event, also with concurrent writers:

* **No repeat**: it reads strictly after the last ``seq`` it delivered, and ``seq`` is
  unique per session (the primary key).
* **No loss** needs: whenever a reader sees ``seq = n``, every smaller ``seq`` of that
  session is already visible to it (then nothing can appear later below its position).
  That holds because numbers are handed out in commit order:

  - SQLite: one writer at a time for the whole file (``BEGIN IMMEDIATE`` everywhere; in
    process the writer lock and group commit, whose members are savepoints of one
    transaction). The statement takes ``MAX(seq) + 1..k`` of the session inside the
    writing transaction, so every smaller number was committed before it, or is in the
    same transaction; a WAL reader's snapshot is a prefix of the commit order. (A member
    rolled back alone returns its numbers to the next writer: no gap, nothing seen.)
  - PostgreSQL: the statement first does ``UPDATE sessions SET event_seq = event_seq + k``
    on the session's row. That row lock is held until commit; a concurrent writer of the
    same session waits for it and then (READ COMMITTED re-reads the newest committed
    row version) continues from the committed counter. So the blocks of numbers of one
    session are handed out in commit order, and a writer that rolls back gives its
    block back. A transaction only acquires the lock after the previous holder's commit
    is visible to new snapshots, so a snapshot that sees ``n`` sees every smaller one.
    Lock order is safe because the statement is the transaction's last: a transaction
    holding a session's counter lock waits for nothing but the counters of other
    sessions, which one transaction takes in session id order.

The same statement wakes readers: in process through the after-commit topic
:data:`TOPIC` (payload ``(session_id, has_message)``), on other PostgreSQL replicas
through ``pg_notify`` on :data:`NOTIFY_CHANNEL` (payload ``"<session_id> <m|r>"``, sent
at commit, dropped on rollback) folded into the same statement, so a plain turn with no
reader costs one INSERT per transaction that stored a visible message and nothing more.

**Only watched sessions are NOTIFYed** (PostgreSQL). PostgreSQL signals every listening
backend of the database for each NOTIFY, whatever its channel; each wakes, reads the
queue and passes the notification to its replica, which parses it: about an eighth of a
plain turn's cost, for sessions nobody reads (nearly all of them: API clients, chat
threads). So the statement NOTIFYs only while ``sessions.watched_until`` (ms, the
server's clock) lies ahead (:func:`notify_if_watched`, on the row its ``UPDATE sessions``
returns). A replica whose reader (an SSE stream, an MCP subscription) starts on a
session sets it with :func:`mark_watched` and waits for that commit before the reader's
first read of the log (:meth:`leadgate.operations.event_hub.EventHub.keep_notified`),
and renews it every :data:`WATCH_RENEW_S` while a reader stays; a mark runs out
:data:`WATCH_TTL_S` after the last renewal (a replica that died leaves NOTIFYs on that
long). Why no wake-up is lost: the mark is an ``UPDATE`` of the session's row, like the
event statement's counter, so the two are ordered by its row lock. A writer that takes
the row first commits before the mark can, and the reader's first read, after the mark,
sees its events. A writer that comes after the mark either sees it committed or waits
for it, and then (READ COMMITTED re-reads the row it waited for) sees it and NOTIFYs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import sqlalchemy as sa

from leadgate.core.clock import Clock
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database, before_commit, signal_after_commit
from leadgate.database.sql import later_of

#: Event kinds.
MESSAGE = "message"
REVIEW = "review"
#: The after-commit topic that wakes this process's readers.
TOPIC = "session-events"
#: PostgreSQL NOTIFY channel that wakes readers on every replica.
NOTIFY_CHANNEL = "leadgate_session_events"
#: Public review statuses (``pending`` covers every non-terminal status of held work).
PUBLIC_STATUSES = ("pending", "delivered", "rejected", "cancelled", "failed", "abandoned")

_E = t.session_events.c
_M = t.messages.c
_QUEUE = "session-events"
_HELD = frozenset({"reviewQueued", "reviewing", "awaitingHuman", "approved"})
_TERMINAL = {
    "completed": "delivered",
    "rejected": "rejected",
    "cancelled": "cancelled",
    "failed": "failed",
    "abandoned": "abandoned",
}


# --------------------------------------------------------------------------- message times

# A session's messages are read in ``(created_at, id)`` order (the history window, the
# transcripts). ``created_at`` was the writing replica's clock: with two PostgreSQL
# replicas' clocks 2 s apart, a message taken in later by the one behind sorted before an
# earlier one, and a turn's model was shown the conversation out of order. So on
# PostgreSQL a message is stamped in the statement that inserts it with the later of the
# clock's reading and the session's newest stamp + 1 ms: the order by time is the order
# the database took the rows in, whatever the clocks, with no statement more (one seek of
# the session's index in the insert; a per-session order column would have needed a
# migration, a new index and every reader changed, and still this very subquery to fill
# it). As the work item moves' ``updated_at`` (:class:`leadgate.database.sql.later_of`),
# a clock behind is carried along by the stamps before it. Concurrency: a PostgreSQL
# statement sees the rows committed when it started (READ COMMITTED): two statements of
# one session at the same moment, neither seeing the other's row, may take the same stamp
# (no unique constraint, so no error); ``id`` then orders them, either order being one in
# which each was taken before the other could be seen. Rows of one statement are
# numbered in their given order (:func:`message_created_at_sql`'s ``ord``).
#
# SQLite stores the clock's reading as it is (leadgate.turns.messages.store_message; the
# statements that call message_created_at run on PostgreSQL alone): its processes share
# one host and so one clock, each reads it inside its write transaction (``BEGIN
# IMMEDIATE``: writers one at a time), so the clock's order is already the order taken
# in. The subquery there cost a plain turn 18,000 instructions (+1.9%,
# bench.instructions: two message inserts) for no order it does not already have.
_NEWEST_STAMP = t.messages.alias("newest")
_ZERO: sa.ColumnElement[int] = sa.literal_column("0")
_ONE: sa.ColumnElement[int] = sa.literal_column("1")


def message_created_at(
    now: sa.ColumnElement[Any], session_id: sa.ColumnElement[Any]
) -> sa.ColumnElement[int]:
    """PostgreSQL: the ``created_at`` of a message inserted into ``session_id`` at
    ``now`` (the clock's reading): the later of ``now`` and the session's newest message
    + 1 ms (see the comment above; SQLite stores the clock's reading as it is)."""
    # max(): one seek of ix_messages_session_created_id; literal constants, no parameter.
    newest = (
        sa.select(sa.func.max(_NEWEST_STAMP.c.created_at))
        .where(_NEWEST_STAMP.c.session_id == session_id)
        .scalar_subquery()
    )
    return later_of(now, sa.func.coalesce(newest, _ZERO) + _ONE)


def message_created_at_sql(now: str, session_id: str, ord: str | None = None) -> str:
    """PostgreSQL: :func:`message_created_at` for a hand-written statement: ``now`` and
    ``session_id`` are SQL expressions. ``ord``: for a statement inserting several rows
    into one session, their 1-based place in it, as an expression over the rows of the
    ``SELECT`` (whose columns ``now`` and ``session_id`` name): each row is stamped after
    the session's newest and after the rows before it (a running maximum), and at least
    at its ``now``."""
    newest = f"COALESCE((SELECT max(created_at) FROM messages WHERE session_id = {session_id}), 0)"
    if ord is None:
        return f"GREATEST(CAST({now} AS bigint), {newest} + 1)"
    return (
        f"GREATEST({newest}, max({now} - {ord})"
        f" OVER (PARTITION BY {session_id} ORDER BY {ord})) + {ord}"
    )


class SessionEvent(NamedTuple):
    """One event as a reader gets it (a message event carries its message's columns)."""

    seq: int
    kind: str
    status: str | None
    message_id: str | None
    role: str | None
    content: str | None
    created_at: int | None


class _Queued(NamedTuple):
    session_id: str
    kind: str
    message_id: str | None
    status: str | None
    created_at: int


def public_status(status: str, revision: int) -> str | None:
    """The public status of a work item, or ``None`` while its work is not held.

    A new ``inProgress`` item is not held (its turns answer as usual); it is held from its
    first submission on, so an item back in ``inProgress`` for a revision
    (``revision > 0``) is still ``pending`` to the client.
    """
    if status in _TERMINAL:
        return _TERMINAL[status]
    if status in _HELD or (status == "inProgress" and revision > 0):
        return "pending"
    return None


async def message_visible(conn: Conn, clock: Clock, session_id: str, message_id: str) -> None:
    """A visible message was stored or revealed in ``conn``'s transaction."""
    await before_commit(
        conn, _QUEUE, _flush, _Queued(session_id, MESSAGE, message_id, None, clock.now_ms())
    )


async def status_changed(
    conn: Conn, clock: Clock, session_id: str, src: str, dst: str, revision: int
) -> None:
    """A work item of ``session_id`` moved ``src -> dst`` (``revision`` after the move):
    a ``review`` event when its public status changed."""
    after = public_status(dst, revision)
    if after is None or after == public_status(src, revision):
        return
    await before_commit(
        conn, _QUEUE, _flush, _Queued(session_id, REVIEW, None, after, clock.now_ms())
    )


# --------------------------------------------------------------------------- writing


async def _flush(conn: Conn, queued: list[_Queued]) -> None:
    """Write the transaction's events: one statement per session, sessions in id order."""
    if len(queued) == 1:  # the usual case (a turn's message, a decision): no grouping
        first = queued[0]
        await _write(conn, first.session_id, queued, first.kind == MESSAGE)
        return
    by_session: dict[str, list[_Queued]] = {}
    for event in queued:
        by_session.setdefault(event.session_id, []).append(event)
    if conn.dialect.name == "postgresql":
        await _insert_postgres_many(conn, by_session)
        return
    # SQLite: one executemany per number of events, not one statement per session (a
    # relay's outcome commit answers up to a batch of sessions; each statement run
    # alone costs its Python round about as much as SQLite's own work on the row).
    same_count: dict[int, list[dict[str, Any]]] = {}
    for session_id, events in by_session.items():
        if len(events) > _MAX_ROWS:
            await _write(conn, session_id, events, any(e.kind == MESSAGE for e in events))
            continue
        same_count.setdefault(len(events), []).append(_sqlite_params(session_id, events))
        signal_after_commit(conn, TOPIC, (session_id, any(e.kind == MESSAGE for e in events)))
    for count, params in same_count.items():
        if len(params) == 1:
            await conn.execute(_sqlite_insert(count), params[0])
        else:
            await conn.execute(_sqlite_insert(count), params)


async def _write(conn: Conn, session_id: str, events: Sequence[_Queued], has_message: bool) -> None:
    for start in range(0, len(events), _MAX_ROWS):  # one statement, bar huge transactions
        chunk = events[start : start + _MAX_ROWS]
        if conn.dialect.name == "postgresql":
            await _insert_postgres(conn, session_id, chunk, has_message)
        else:
            await conn.execute(_sqlite_insert(len(chunk)), _sqlite_params(session_id, chunk))
    signal_after_commit(conn, TOPIC, (session_id, has_message))


_MAX_SEQ = (
    sa.select(sa.func.coalesce(sa.func.max(_E.seq), 0))
    .where(_E.session_id == sa.bindparam("p_sid"))
    .scalar_subquery()
)
# Statements built once per row count (a transaction writes one or two events per
# session): the inline connection caches compiled plans by statement object.
_SQLITE_INSERTS: dict[int, sa.Insert] = {}


def _sqlite_insert(count: int) -> sa.Insert:
    stmt = _SQLITE_INSERTS.get(count)
    if stmt is None:
        rows = [
            {
                "session_id": sa.bindparam("p_sid"),
                "seq": _MAX_SEQ + (i + 1),
                "kind": sa.bindparam(f"p_kind{i}"),
                "message_id": sa.bindparam(f"p_msg{i}"),
                "status": sa.bindparam(f"p_status{i}"),
                "created_at": sa.bindparam(f"p_at{i}"),
            }
            for i in range(count)
        ]
        stmt = _SQLITE_INSERTS[count] = t.session_events.insert().values(rows)
    return stmt


def _sqlite_params(session_id: str, events: Sequence[_Queued]) -> dict[str, Any]:
    params: dict[str, Any] = {"p_sid": session_id}
    for (kind, message, status, at), event in zip(_PARAM_NAMES, events, strict=False):
        params[kind] = event.kind
        params[message] = event.message_id
        params[status] = event.status
        params[at] = event.created_at
    return params


#: Rows per statement at most (a transaction writes one or two per session).
_MAX_ROWS = 32
_PARAM_NAMES = [(f"p_kind{i}", f"p_msg{i}", f"p_status{i}", f"p_at{i}") for i in range(_MAX_ROWS)]


#: PostgreSQL: the server's clock in ms since the epoch (``sessions.watched_until``'s).
PG_NOW_MS = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
#: How long a mark of :func:`mark_watched` holds: the replica renews it every
#: :data:`WATCH_RENEW_S` while a reader is there, so a replica gone without a word
#: leaves NOTIFYs on for this long at most.
WATCH_TTL_S = 120.0
WATCH_RENEW_S = 30.0


def notify_if_watched(alias: str, channel: str, payload: str) -> str:
    """PostgreSQL: the select-list expression that NOTIFYs ``payload`` on ``channel``
    (SQL expressions) when the session row ``alias`` (the ``RETURNING`` of the statement's
    ``UPDATE sessions``, with ``watched_until``) is watched; NULL, and no NOTIFY,
    otherwise. One row either way (callers count the rows)."""
    return f"CASE WHEN {alias}.watched_until > {PG_NOW_MS} THEN pg_notify({channel}, {payload}) END"


# The rows are locked in session id order first (``marked``), as the event writers take
# the counters of several sessions (:data:`_POSTGRES_INSERT_MANY`): the plain ``UPDATE
# ... WHERE id = ANY(...)`` locked a renewal's (up to RENEW_CHUNK) sessions in the order
# its plan found them, physical order under a bitmap or sequential scan, and met such a
# writer's id order as a deadlock (40P01, one of the two ended).
_MARK_WATCHED = sa.text(
    "WITH marked AS ("
    " SELECT id FROM sessions WHERE id = ANY(CAST(:sids AS varchar[])) ORDER BY id FOR UPDATE"
    ") UPDATE sessions SET watched_until = GREATEST(watched_until,"
    f" {PG_NOW_MS} + CAST(:ttl_ms AS bigint))"
    " FROM marked WHERE sessions.id = marked.id"
)


async def mark_watched(db: Database, session_ids: Sequence[str]) -> None:
    """PostgreSQL: the sessions' events are NOTIFYed to every replica for the next
    :data:`WATCH_TTL_S` (see the module docstring); committed when this returns."""
    if session_ids:
        await db.write_alone(
            _MARK_WATCHED, {"sids": list(session_ids), "ttl_ms": int(WATCH_TTL_S * 1000)}
        )


# Counter, rows and NOTIFY in one round trip (see the module docstring for the order).
_POSTGRES_INSERT = sa.text(
    "WITH s AS ("
    " UPDATE sessions SET event_seq = event_seq + :n WHERE id = :sid"
    " RETURNING event_seq, watched_until"
    "), e AS ("
    " INSERT INTO session_events (session_id, seq, kind, message_id, status, created_at)"
    " SELECT :sid, s.event_seq - :n + v.i, v.kind, v.message_id, v.status, v.created_at"
    " FROM s, unnest(CAST(:kinds AS varchar[]), CAST(:message_ids AS varchar[]),"
    " CAST(:statuses AS varchar[]), CAST(:created AS bigint[]))"
    " WITH ORDINALITY AS v(kind, message_id, status, created_at, i)"
    f") SELECT {notify_if_watched('s', ':channel', ':payload')} FROM s"
)


def postgres_message_ctes(session: str, *, taken_by: str = "NULL", answers: str = "NULL") -> str:
    """PostgreSQL: CTEs ``m``, ``s`` and ``e`` (to follow ``WITH`` or a comma) storing
    the visible message ``:id`` with its ``message`` event in the session that
    ``session`` (a CTE of at most one row, with its ``id``) names: the message row, the
    session's counter (``s`` returns ``id``, ``event_seq`` and ``watched_until``, for
    :func:`notify_if_watched`; empty when ``session`` is) and the event. Parameters:
    ``:id``, ``:org_id``, ``:work_item_id``, ``:role``, ``:content``, ``:created``,
    ``:kind``; ``taken_by``, the SQL of the message's ``taken_by`` (a plain
    REST/MCP/Studio turn's process); ``answers``, the SQL of its ``answers`` (the user
    message a plain turn's assistant message answers)."""
    return (
        "m AS ("
        " INSERT INTO messages (id, org_id, session_id, work_item_id, role, content,"
        " lead_gated, tool_name, created_at, taken_by, answers)"
        " SELECT :id, :org_id, src.id, :work_item_id, :role, :content, false, NULL, "
        + message_created_at_sql(":created", "src.id")
        + f", {taken_by}, {answers} FROM {session} AS src"
        "), s AS ("
        " UPDATE sessions SET event_seq = sessions.event_seq + 1"
        f" FROM {session} AS src WHERE sessions.id = src.id"
        " RETURNING sessions.id, sessions.event_seq, sessions.watched_until"
        "), e AS ("
        " INSERT INTO session_events (session_id, seq, kind, message_id, status, created_at)"
        " SELECT s.id, s.event_seq, :kind, :id, NULL, :created FROM s"
        ")"
    )


#: PostgreSQL: a visible message, its ``message`` event and the NOTIFY in one statement
#: (what a transaction of store_message alone writes; see :func:`store_visible_alone`).
#: Nothing, not even the message, when the session does not exist.
_POSTGRES_MESSAGE = sa.text(
    "WITH src AS (SELECT id FROM sessions WHERE id = CAST(:sid AS varchar)), "
    + postgres_message_ctes("src", answers="CAST(:answers AS varchar)")
    + f" SELECT {notify_if_watched('s', ':channel', ':payload')} FROM s"
)


def postgres_counters_ctes(rows: str) -> str:
    """PostgreSQL: CTEs ``counts``, ``locked`` and ``s`` (to follow ``WITH`` or a comma)
    that take one event number per row of the CTE ``rows`` (with a ``sid`` column) from
    its session's counter: the counters locked in session id order (as
    :data:`_POSTGRES_INSERT_MANY` locks them, so that no two such statements wait on each
    other in a cycle); ``s`` returns each session's ``id``, ``event_seq`` (the last number
    taken), ``watched_until`` and ``n`` (how many), none for a session that does not
    exist."""
    return (
        "counts AS ("
        f" SELECT sid, count(*) AS n FROM {rows} GROUP BY sid"
        "), locked AS ("
        " SELECT id FROM sessions WHERE id IN (SELECT sid FROM counts) ORDER BY id FOR UPDATE"
        "), s AS ("
        " UPDATE sessions SET event_seq = sessions.event_seq + counts.n"
        " FROM locked JOIN counts ON counts.sid = locked.id WHERE sessions.id = locked.id"
        " RETURNING sessions.id, sessions.event_seq, sessions.watched_until, counts.n"
        ")"
    )


class VisibleMessage(NamedTuple):
    """A visible message (user or assistant) to store with its ``message`` event."""

    id: str
    org_id: str
    session_id: str
    work_item_id: str | None
    role: str
    content: str
    created_at: int
    #: the user message it answers (a plain REST/MCP/Studio turn's reply), or None
    answers: str | None = None


#: PostgreSQL: several visible messages, of one session or many, with their events and
#: NOTIFYs in one statement (what :data:`_POSTGRES_MESSAGE` writes for one). The counters
#: are locked in session id order, as :data:`_POSTGRES_INSERT_MANY` locks them; a message
#: whose session does not exist is not stored (the rows returned name the sessions that
#: do).
_POSTGRES_MESSAGES_MANY = sa.text(
    "WITH visible AS ("
    " SELECT * FROM unnest(CAST(:ids AS varchar[]), CAST(:org_ids AS varchar[]),"
    " CAST(:sids AS varchar[]), CAST(:work_item_ids AS varchar[]), CAST(:roles AS varchar[]),"
    " CAST(:contents AS text[]), CAST(:created AS bigint[]), CAST(:ords AS int[]),"
    " CAST(:answers AS varchar[]))"
    " AS i(id, org_id, sid, work_item_id, role, content, created_at, ord, answers)"
    "), " + postgres_counters_ctes("visible") + ", m AS ("
    " INSERT INTO messages (id, org_id, session_id, work_item_id, role, content,"
    " lead_gated, tool_name, created_at, answers)"
    " SELECT visible.id, visible.org_id, visible.sid, visible.work_item_id, visible.role,"
    " visible.content, false, NULL, "
    + message_created_at_sql("visible.created_at", "visible.sid", "visible.ord")
    + ", visible.answers FROM visible JOIN s ON s.id = visible.sid"
    "), e AS ("
    " INSERT INTO session_events (session_id, seq, kind, message_id, status, created_at)"
    " SELECT visible.sid, s.event_seq - s.n + visible.ord, :kind, visible.id, NULL,"
    " visible.created_at"
    " FROM visible JOIN s ON s.id = visible.sid"
    ") SELECT s.id, " + notify_if_watched("s", ":channel", "s.id || ' m'") + " AS notified FROM s"
)


async def store_visible_alone(db: Database, message: VisibleMessage) -> bool:
    """PostgreSQL: store ``message`` with its ``message`` event in one statement outside
    a transaction block (committed when this returns); whether it was stored (False:
    its session does not exist, and nothing of it was written)."""
    result = await db.write_alone(
        _POSTGRES_MESSAGE,
        {
            "id": message.id,
            "org_id": message.org_id,
            "sid": message.session_id,
            "work_item_id": message.work_item_id,
            "role": message.role,
            "content": message.content,
            "created": message.created_at,
            "answers": message.answers,
            "kind": MESSAGE,
            "channel": NOTIFY_CHANNEL,
            "payload": f"{message.session_id} m",
        },
        signals=[(TOPIC, (message.session_id, True))],
    )
    return result.first() is not None


async def store_visible_many(db: Database, messages: Sequence[VisibleMessage]) -> list[bool]:
    """PostgreSQL: store ``messages`` with their ``message`` events in one statement
    outside a transaction block (committed when this returns); for each message, whether
    it was stored (False: its session does not exist, and nothing of it was written).
    The messages of one session get their events in the order given."""
    ords: list[int] = []
    seen: dict[str, int] = {}
    for message in messages:
        seen[message.session_id] = seen.get(message.session_id, 0) + 1
        ords.append(seen[message.session_id])
    result = await db.write_alone(
        _POSTGRES_MESSAGES_MANY,
        {
            "ids": [m.id for m in messages],
            "org_ids": [m.org_id for m in messages],
            "sids": [m.session_id for m in messages],
            "work_item_ids": [m.work_item_id for m in messages],
            "roles": [m.role for m in messages],
            "contents": [m.content for m in messages],
            "created": [m.created_at for m in messages],
            "ords": ords,
            "answers": [m.answers for m in messages],
            "kind": MESSAGE,
            "channel": NOTIFY_CHANNEL,
        },
        signals_from=lambda row: [(TOPIC, (row.id, True))],
        in_doubt=[(TOPIC, (session_id, True)) for session_id in seen],
    )
    stored = {row.id for row in result.all()}
    return [m.session_id in stored for m in messages]


# Several sessions in one round trip (a relay's outcome commit answers a batch of them):
# the counters are locked in session id order first (``locked``), as one statement per
# session in id order did, so two such transactions cannot wait on each other in a cycle.
_POSTGRES_INSERT_MANY = sa.text(
    "WITH locked AS ("
    " SELECT id FROM sessions WHERE id = ANY(CAST(:sids AS varchar[])) ORDER BY id FOR UPDATE"
    "), input AS ("
    " SELECT * FROM unnest(CAST(:sids AS varchar[]), CAST(:counts AS int[]),"
    " CAST(:payloads AS varchar[])) AS i(sid, n, payload)"
    "), s AS ("
    " UPDATE sessions SET event_seq = sessions.event_seq + input.n"
    " FROM locked JOIN input ON input.sid = locked.id WHERE sessions.id = locked.id"
    " RETURNING sessions.id, sessions.event_seq, sessions.watched_until, input.n, input.payload"
    "), e AS ("
    " INSERT INTO session_events (session_id, seq, kind, message_id, status, created_at)"
    " SELECT v.sid, s.event_seq - s.n + v.i, v.kind, v.message_id, v.status, v.created_at"
    " FROM unnest(CAST(:ev_sids AS varchar[]), CAST(:ev_ords AS int[]),"
    " CAST(:kinds AS varchar[]), CAST(:message_ids AS varchar[]),"
    " CAST(:statuses AS varchar[]), CAST(:created AS bigint[]))"
    " AS v(sid, i, kind, message_id, status, created_at) JOIN s ON s.id = v.sid"
    f") SELECT {notify_if_watched('s', ':channel', 's.payload')} FROM s"
)


class MovedItemEvents(NamedTuple):
    """SQL and parameters that write, inside another PostgreSQL statement, the events
    :func:`status_changed` would queue for the work items that statement moved."""

    #: CTEs to append after the statement's own (each starts with ``, ``)
    ctes: str
    #: select-list items: ``ev_sessions`` (the sessions written) and the NOTIFYs
    columns: str
    params: dict[str, Any]


def postgres_moved_item_events(moved: str, src: str, dst: str) -> MovedItemEvents | None:
    """For a statement whose CTE ``moved`` returns ``id`` and ``session_id`` of the work
    items it moved ``src -> dst`` (at revision > 0 or not: the held and terminal public
    statuses do not depend on it): one ``review`` event per item, the counters locked in
    session id order as :data:`_POSTGRES_INSERT_MANY` does, and each session NOTIFYed.
    ``None`` when the move changes no public status (no event, as :func:`status_changed`).
    The caller binds ``:ev_at`` (the events' time) besides :attr:`MovedItemEvents.params`
    and wakes this process's readers after commit with :func:`woken` of ``ev_sessions``."""
    after = public_status(dst, 0)
    if after is None or after == public_status(src, 0) or public_status(dst, 1) != after:
        return None
    ctes = (
        ", ev_locked AS ("
        f" SELECT id FROM sessions WHERE id IN (SELECT session_id FROM {moved})"
        " ORDER BY id FOR UPDATE"
        "), ev_counts AS ("
        f" SELECT session_id AS sid, count(*) AS n FROM {moved} GROUP BY session_id"
        "), ev_s AS ("
        " UPDATE sessions SET event_seq = sessions.event_seq + ev_counts.n"
        " FROM ev_locked JOIN ev_counts ON ev_counts.sid = ev_locked.id"
        " WHERE sessions.id = ev_locked.id"
        " RETURNING sessions.id, sessions.event_seq, sessions.watched_until, ev_counts.n"
        "), ev_rows AS ("
        " INSERT INTO session_events (session_id, seq, kind, message_id, status, created_at)"
        " SELECT m.session_id,"
        " ev_s.event_seq - ev_s.n + row_number() OVER (PARTITION BY m.session_id ORDER BY m.id),"
        " :ev_kind, NULL, :ev_status, :ev_at"
        f" FROM {moved} AS m JOIN ev_s ON ev_s.id = m.session_id"
        ")"
    )
    columns = (
        "ARRAY(SELECT id FROM ev_s) AS ev_sessions,"
        " (SELECT count("
        + notify_if_watched("ev_s", ":ev_channel", "ev_s.id || ' r'")
        + ") FROM ev_s) AS ev_notified"
    )
    params = {"ev_kind": REVIEW, "ev_status": after, "ev_channel": NOTIFY_CHANNEL}
    return MovedItemEvents(ctes, columns, params)


def woken(session_ids: Sequence[str]) -> list[tuple[str, Any]]:
    """The after-commit signals that wake this process's readers of ``session_ids``
    (status events only, as :func:`postgres_moved_item_events` writes)."""
    return [(TOPIC, (session_id, False)) for session_id in session_ids]


async def _insert_postgres_many(conn: Conn, by_session: dict[str, list[_Queued]]) -> None:
    sids = sorted(by_session)
    if len(sids) == 1:
        events = by_session[sids[0]]
        await _write(conn, sids[0], events, any(e.kind == MESSAGE for e in events))
        return
    ev_sids: list[str] = []
    ev_ords: list[int] = []
    flat: list[_Queued] = []
    payloads: list[str] = []
    for sid in sids:
        events = by_session[sid]
        has_message = any(e.kind == MESSAGE for e in events)
        payloads.append(f"{sid} {'m' if has_message else 'r'}")
        ev_sids += [sid] * len(events)
        ev_ords += range(1, len(events) + 1)
        flat += events
        signal_after_commit(conn, TOPIC, (sid, has_message))
    result = await conn.execute(
        _POSTGRES_INSERT_MANY,
        {
            "sids": sids,
            "counts": [len(by_session[sid]) for sid in sids],
            "payloads": payloads,
            "ev_sids": ev_sids,
            "ev_ords": ev_ords,
            **_columns(flat),
            "channel": NOTIFY_CHANNEL,
        },
    )
    if len(result.all()) != len(sids):
        raise RuntimeError("a session of these events does not exist; none was written")


def _columns(events: Sequence[_Queued]) -> dict[str, list[Any]]:
    """The events' columns as the arrays the PostgreSQL statements unnest."""
    return {
        "kinds": [e.kind for e in events],
        "message_ids": [e.message_id for e in events],
        "statuses": [e.status for e in events],
        "created": [e.created_at for e in events],
    }


async def _insert_postgres(
    conn: Conn, session_id: str, events: Sequence[_Queued], has_message: bool
) -> None:
    result = await conn.execute(
        _POSTGRES_INSERT,
        {
            "n": len(events),
            "sid": session_id,
            **_columns(events),
            "channel": NOTIFY_CHANNEL,
            "payload": f"{session_id} {'m' if has_message else 'r'}",
        },
    )
    if result.first() is None:
        # Every event names a session its transaction stored a message or item of.
        raise RuntimeError(f"session {session_id} does not exist; its events were not written")


# --------------------------------------------------------------------------- reading

_READ = (
    sa.select(_E.seq, _E.kind, _E.status, _E.message_id, _M.role, _M.content, _M.created_at)
    .select_from(t.session_events.outerjoin(t.messages, _M.id == _E.message_id))
    .where(_E.session_id == sa.bindparam("p_sid"), _E.seq > sa.bindparam("p_after"))
    .order_by(_E.seq)
    .limit(sa.bindparam("p_limit"))
)


_LATEST_REVIEW = (
    sa.select(_E.status)
    .where(_E.session_id == sa.bindparam("p_sid"), _E.kind == "review")
    .order_by(_E.seq.desc())
    .limit(1)
)


async def latest_review(conn: Conn, session_id: str) -> str | None:
    """The public status of the session's latest held work (its last ``review`` event),
    or ``None`` when none was ever held."""
    row = (await conn.execute(_LATEST_REVIEW, {"p_sid": session_id})).first()
    return None if row is None else str(row.status)


async def read(conn: Conn, session_id: str, *, after: int, limit: int) -> list[SessionEvent]:
    """Up to ``limit`` events of ``session_id`` after ``seq = after``, in order."""
    rows = (
        await conn.execute(_READ, {"p_sid": session_id, "p_after": after, "p_limit": limit})
    ).all()
    return [SessionEvent._make(row) for row in rows]
