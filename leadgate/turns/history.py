"""The history a worker's model sees: a session's newest 50 user/assistant/internal
messages, oldest first (ordered by ``created_at``, then ``id``: the order the database
took them in, since each message is stamped after the session's newest in the statement
that stores it, :func:`leadgate.domain.session_events.message_created_at`).

Every turn reads it, and on SQLite that read was the turn's most expensive statement: 50
rows, each a B-tree lookup from the index into the table. On the inline SQLite connection
(:mod:`leadgate.database.inline_sqlite`) :class:`HistoryCache` keeps each recently active session's
window in process and reads only the rows added since, by ``rowid``:

* SQLite gives a new row ``max(rowid) + 1`` and writers are serialized, so every row
  committed after the cached read has a larger rowid than the cached newest one, whatever
  its ``created_at`` (clocks of other processes may differ) and whichever process wrote
  it. Messages are never deleted, and the columns read here are never updated.
* ``VACUUM`` may renumber rowids (tables without an INTEGER PRIMARY KEY). The delta read
  starts *at* the cached newest row and checks that it still has the same id there;
  if not, the entry is dropped and the window is read again in full.
* The cache changes only after the transaction that read the delta commits (the entry is
  handed to :func:`leadgate.database.db.signal_after_commit`): a rolled-back turn leaves no trace,
  and an older entry never replaces a newer one.

Elsewhere (PostgreSQL, the general transaction) the window is read with one query. A
plain turn on PostgreSQL reads it in the statement that stores its message
(:func:`store_into_window`; the turns that arrive together in one statement,
:class:`PlainIntakes`).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from itertools import repeat
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import psycopg2

from binding import bindings
from leadgate.core.types import BindingSpec
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database, signal_after_commit
from leadgate.database.groups import Grouped
from leadgate.database.inline_sqlite import InlineConnection
from leadgate.domain import session_events
from leadgate.turns.providers.base import ChatMessage

HISTORY_LIMIT = 50
#: Sessions and characters of message text the cache holds at most (least recently
#: used sessions are dropped first).
MAX_SESSIONS = 4096
MAX_CHARS = 16_000_000
#: The after-commit topic carrying new cache entries.
TOPIC = "history"

_ROLES = ("user", "assistant", "internal")
_M = t.messages.c
_ROWID: sa.ColumnClause[int] = sa.literal_column("messages.rowid")

# Built once (statement construction costs as much as execution on the turn path).
_WINDOW = (
    sa.select(_M.role, _M.content, _M.created_at, _M.id)
    .where(_M.session_id == sa.bindparam("p_session_id"), _M.role.in_(_ROLES))
    .order_by(_M.created_at.desc(), _M.id.desc())
    .limit(HISTORY_LIMIT)
)
_NEWEST = (
    sa.select(_ROWID.label("rid"), _M.id)
    .where(_M.session_id == sa.bindparam("p_session_id"))
    .order_by(_ROWID.desc())
    .limit(1)
)
_SINCE = (
    sa.select(_ROWID.label("rid"), _M.id, _M.role, _M.content, _M.created_at)
    .where(_M.session_id == sa.bindparam("p_session_id"), _ROWID >= sa.bindparam("p_rowid"))
    .order_by(_ROWID)
)


# PostgreSQL: a plain turn's whole intake in one statement (see store_into_window): the
# session of (agent, key) with its active binding (sb: bindings.SESSION_AND_BINDING,
# compiled with named parameters); the user message and its event stored only when that
# binding is the one the turn comes through (ok: bindings.UNCHANGED_SQL, then the message
# CTEs of session_events); the window, as of the statement's start (the message just
# stored is not in it: the caller adds it), aggregated into one row.
_SESSION_AND_BINDING_SQL = str(
    # psycopg2's compiler writes plain ``:name`` parameters (asyncpg's adds casts, which
    # text() would not read as parameters); only the SQL text is used.
    bindings.SESSION_AND_BINDING.compile(
        dialect=psycopg2.dialect(paramstyle="named")  # type: ignore[no-untyped-call]
    )
)
# PostgreSQL: the window of the session ``sb.id`` (the newest 50 rows, newest first), as
# one row of arrays, for a LATERAL join.
_WINDOW_OF_SB = (
    "SELECT array_agg(x.role) AS roles, array_agg(x.content) AS contents,"
    " array_agg(x.created_at) AS created, array_agg(x.id) AS ids FROM ("
    " SELECT role, content, created_at, id FROM messages"
    " WHERE session_id = sb.id AND role IN ("
    + ", ".join(f"'{role}'" for role in _ROLES)
    + f") ORDER BY created_at DESC, id DESC LIMIT {HISTORY_LIMIT}"
    ") AS x"
)
_STORE_INTO_WINDOW = sa.text(
    f"WITH sb AS ({_SESSION_AND_BINDING_SQL}),"
    f" ok AS (SELECT id FROM sb WHERE {bindings.UNCHANGED_SQL} LIMIT 1), "
    + session_events.postgres_message_ctes("ok", taken_by="CAST(:taken_by AS varchar)")
    + ", n AS MATERIALIZED (SELECT "
    + session_events.notify_if_watched("s", ":channel", "s.id || ' m'")
    + " FROM s)"
    " SELECT sb.id, sb.binding_id, sb.binding_kind, sb.binding_address, sb.binding_silent,"
    " (SELECT count(*) FROM n) AS stored,"
    " w.roles, w.contents, w.created, w.ids"
    f" FROM sb LEFT JOIN LATERAL ({_WINDOW_OF_SB}) AS w ON true LIMIT 1"
)


async def store_into_window(
    db: Database, intake: PlainIntake
) -> tuple[bindings.OpenSession, Window] | None:
    """PostgreSQL: store the user message of a plain turn (``intake``), with its
    session event, in the session of (agent, key), provided the session exists and its
    active binding is the turn's already; return that session and its window as it was
    before the message (:meth:`Window.with_newest` adds the message). One statement
    outside a transaction block (``Database.write_alone``): one round trip where a read
    and then the write were two. ``None``, with nothing written, when the session is
    missing or its binding is another: the turn takes the transaction then."""
    result = await db.write_alone(
        _STORE_INTO_WINDOW,
        {
            "p_agent_id": intake.agent_id,
            "p_key": intake.key,
            **bindings.unchanged_params(intake.binding),
            "id": intake.message_id,
            "org_id": intake.org_id,
            "work_item_id": None,
            "role": "user",
            "content": intake.content,
            "created": intake.created_at,
            "taken_by": intake.taken_by,
            "kind": session_events.MESSAGE,
            "channel": session_events.NOTIFY_CHANNEL,
        },
        signals_from=lambda row: [(session_events.TOPIC, (row.id, True))] if row.stored else [],
    )
    row = result.first()
    if row is None or not row.stored:
        return None
    return bindings.session_from_row(row), Window.newest_first(
        row.roles or [], row.contents or [], row.created or [], row.ids or []
    )


class PlainIntake(NamedTuple):
    """A plain turn's user message to store into its session (see
    :func:`store_into_window`)."""

    message_id: str
    org_id: str
    agent_id: str
    key: str
    binding: BindingSpec
    content: str
    created_at: int
    #: the process whose turn takes it in (``messages.taken_by``; None: not recorded)
    taken_by: str | None = None


# PostgreSQL: store_into_window for several turns at once (:class:`PlainIntakes`): the
# same CTEs over the rows of ``intake`` (k: the turn's place in the statement), the
# counters locked in session id order as session_events' statements for many sessions
# lock them, the events of one session in the turns' order, and each turn's window.
_ROW_UNCHANGED = (
    "sb.binding_kind = intake.b_kind"
    " AND CAST(sb.binding_address AS jsonb) = CAST(intake.b_address AS jsonb)"
    " AND COALESCE(sb.binding_silent, false) = intake.b_silent"
)
_STORE_INTO_WINDOWS = sa.text(
    "WITH intake AS MATERIALIZED ("
    " SELECT * FROM unnest(CAST(:ids AS varchar[]), CAST(:org_ids AS varchar[]),"
    " CAST(:agent_ids AS varchar[]), CAST(:keys AS varchar[]), CAST(:kinds AS varchar[]),"
    " CAST(:addresses AS varchar[]), CAST(:silents AS boolean[]), CAST(:contents AS text[]),"
    " CAST(:created AS bigint[]), CAST(:taken_by AS varchar[])) WITH ORDINALITY"
    " AS i(id, org_id, agent_id, key, b_kind, b_address, b_silent, content, created_at,"
    " taken_by, k)"
    "), sb AS MATERIALIZED ("
    " SELECT intake.k, sessions.id, bindings.id AS binding_id, bindings.kind AS binding_kind,"
    " bindings.address AS binding_address, bindings.silent AS binding_silent"
    " FROM intake JOIN sessions"
    " ON sessions.agent_id = intake.agent_id AND sessions.key = intake.key"
    " LEFT OUTER JOIN bindings ON bindings.session_id = sessions.id AND bindings.active"
    "), ok AS MATERIALIZED ("
    " SELECT DISTINCT ON (sb.k) sb.k, sb.id AS sid, intake.id, intake.org_id, intake.content,"
    " intake.created_at, intake.taken_by FROM sb JOIN intake ON intake.k = sb.k"
    f" WHERE {_ROW_UNCHANGED} ORDER BY sb.k"
    "), " + session_events.postgres_counters_ctes("ok") + ", m AS ("
    " INSERT INTO messages (id, org_id, session_id, work_item_id, role, content,"
    " lead_gated, tool_name, created_at, taken_by)"
    " SELECT o.id, o.org_id, o.sid, NULL, 'user', o.content, false, NULL, "
    + session_events.message_created_at_sql("o.created_at", "o.sid", "o.r")
    + ", o.taken_by"
    + " FROM (SELECT ok.*, row_number() OVER (PARTITION BY ok.sid ORDER BY ok.k) AS r"
    " FROM ok JOIN s ON s.id = ok.sid) AS o"
    "), e AS ("
    " INSERT INTO session_events (session_id, seq, kind, message_id, status, created_at)"
    " SELECT ok.sid,"
    " s.event_seq - s.n + row_number() OVER (PARTITION BY ok.sid ORDER BY ok.k),"
    " :kind, ok.id, NULL, ok.created_at FROM ok JOIN s ON s.id = ok.sid"
    "), n AS MATERIALIZED (SELECT s.id, "
    + session_events.notify_if_watched("s", ":channel", "s.id || ' m'")
    + " AS notified FROM s)"
    " SELECT DISTINCT ON (sb.k) sb.k, sb.id, sb.binding_id, sb.binding_kind,"
    " sb.binding_address, sb.binding_silent,"
    " (ok.k IS NOT NULL AND EXISTS (SELECT 1 FROM n WHERE n.id = sb.id)) AS stored,"
    " w.roles, w.contents, w.created, w.ids"
    f" FROM sb LEFT JOIN ok ON ok.k = sb.k LEFT JOIN LATERAL ({_WINDOW_OF_SB}) AS w ON true"
    " ORDER BY sb.k, (ok.k IS NOT NULL) DESC"
)


async def store_into_windows(
    db: Database, intakes: Sequence[PlainIntake]
) -> list[tuple[bindings.OpenSession, Window] | None]:
    """PostgreSQL: :func:`store_into_window` for several turns in one statement, each
    turn's outcome in order (``None``: its session is missing or bound otherwise, and
    nothing of it was written). Turns of one session get their events in the order
    given; each window is the session's as the statement found it (as for turns whose
    statements run at the same time)."""
    params: dict[str, Any] = {
        "ids": [i.message_id for i in intakes],
        "org_ids": [i.org_id for i in intakes],
        "agent_ids": [i.agent_id for i in intakes],
        "keys": [i.key for i in intakes],
        "kinds": [],
        "addresses": [],
        "silents": [],
        "contents": [i.content for i in intakes],
        "created": [i.created_at for i in intakes],
        "taken_by": [i.taken_by for i in intakes],
        "kind": session_events.MESSAGE,
        "channel": session_events.NOTIFY_CHANNEL,
    }
    for intake in intakes:
        unchanged = bindings.unchanged_params(intake.binding)
        params["kinds"].append(unchanged["binding_kind"])
        params["addresses"].append(unchanged["binding_address"])
        params["silents"].append(unchanged["binding_silent"])
    result = await db.write_alone(
        _STORE_INTO_WINDOWS,
        params,
        signals_from=lambda row: [(session_events.TOPIC, (row.id, True))] if row.stored else [],
    )
    found: list[tuple[bindings.OpenSession, Window] | None] = [None] * len(intakes)
    for row in result.all():
        if row.stored:
            found[row.k - 1] = (
                bindings.session_from_row(row),
                Window.newest_first(
                    row.roles or [], row.contents or [], row.created or [], row.ids or []
                ),
            )
    return found


class PlainIntakes(Grouped[PlainIntake, "tuple[bindings.OpenSession, Window] | None"]):
    """:func:`store_into_window` for a service's plain turns: the intakes of concurrent
    turns go in one statement (:func:`store_into_windows`), as the replies do
    (:class:`leadgate.turns.messages.VisibleWrites`)."""

    def __init__(self, db: Database, *, in_flight: int = 1) -> None:
        super().__init__(
            functools.partial(store_into_window, db),
            functools.partial(store_into_windows, db),
            in_flight=in_flight,
        )


@dataclass(frozen=True, slots=True)
class Window:
    """A session's window as one statement read it: its messages, oldest first (by
    ``(created_at, id)``).

    A PostgreSQL turn builds one from 50 rows: the rows go into lists by C-level calls
    (``zip``, ``map``, slicing) rather than a Python call or two per row, which cost a
    plain turn about 20 us of its ~420 us (cProfile: 250 of its 1,500 calls)."""

    messages: list[ChatMessage]

    @classmethod
    def newest_first(
        cls,
        roles: Sequence[str],
        contents: Sequence[str],
        created: Sequence[int],
        ids: Sequence[str],
    ) -> Window:
        """The window of rows read newest first (as the statement's ``ORDER BY ...
        DESC`` gives them; any other order is sorted)."""
        keys = list(zip(created, ids, strict=True))
        if keys == sorted(keys, reverse=True):
            roles, contents = roles[::-1], contents[::-1]
        else:
            order = sorted(range(len(keys)), key=keys.__getitem__)
            roles, contents = [roles[i] for i in order], [contents[i] for i in order]
        if "internal" in roles:
            messages = [to_message(role, text) for role, text in zip(roles, contents, strict=True)]
        else:
            # tuple.__new__ builds each named tuple from (role, content, defaults) in C;
            # ChatMessage(...) runs the named tuple's Python __new__ per row (twice the
            # cost of the whole list).
            messages = list(
                map(
                    tuple.__new__,
                    repeat(ChatMessage),
                    zip(roles, contents, repeat(()), repeat(None), strict=False),
                )
            )
        return cls(messages)

    def with_newest(self, message: ChatMessage) -> list[ChatMessage]:
        """The window a model sees once ``message`` is stored by the statement that read
        this one: the newest 50, oldest first, as a read after storing it would give.
        The message is the newest: it is stamped after every row the statement saw
        (:func:`leadgate.domain.session_events.message_created_at`), whatever the clock
        of the replica that took it."""
        return [*self.messages[-(HISTORY_LIMIT - 1) :], message]


def to_message(role: str, content: str) -> ChatMessage:
    """A stored message as the model sees it (lead feedback is a user message)."""
    if role == "internal":
        return ChatMessage("user", f"Feedback from your lead reviewer:\n{content}")
    return ChatMessage(role, content)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class _Entry:
    """One session's window: sort keys and messages (oldest first) and its newest row."""

    keys: tuple[tuple[int, str], ...]
    messages: tuple[ChatMessage, ...]
    last_rowid: int
    last_id: str
    chars: int


def _build(
    pairs: list[tuple[tuple[int, str], ChatMessage]], last_rowid: int, last_id: str
) -> _Entry:
    """An entry from ((created_at, id), message) pairs; the newest 50 are kept."""
    if any(pairs[i][0] > pairs[i + 1][0] for i in range(len(pairs) - 1)):
        pairs.sort(key=lambda pair: pair[0])
    kept = pairs[-HISTORY_LIMIT:]
    messages = tuple(m for _, m in kept)
    return _Entry(
        keys=tuple(k for k, _ in kept),
        messages=messages,
        last_rowid=last_rowid,
        last_id=last_id,
        chars=sum(len(m.content) for m in messages),
    )


def _extend(
    entry: _Entry, fresh: list[tuple[tuple[int, str], ChatMessage]], last_rowid: int, last_id: str
) -> _Entry:
    """``entry`` with newer rows. The usual case (they sort after the window) appends and
    trims; rows that sort before it (SQLite stamps a message with its process's clock:
    one stepped back, or two rows in one millisecond ordered by id) go through
    :func:`_build`."""
    if not fresh:
        return replace(entry, last_rowid=last_rowid, last_id=last_id)
    keys = [k for k, _ in fresh]
    if (entry.keys and keys[0] <= entry.keys[-1]) or any(
        keys[i] > keys[i + 1] for i in range(len(keys) - 1)
    ):
        pairs = list(zip(entry.keys, entry.messages, strict=True)) + fresh
        return _build(pairs, last_rowid, last_id)
    all_keys = entry.keys + tuple(keys)
    messages = entry.messages + tuple(m for _, m in fresh)
    chars = entry.chars + sum(len(m.content) for _, m in fresh)
    overflow = len(all_keys) - HISTORY_LIMIT
    if overflow > 0:
        chars -= sum(len(m.content) for m in messages[:overflow])
        all_keys, messages = all_keys[overflow:], messages[overflow:]
    return _Entry(all_keys, messages, last_rowid, last_id, chars)


#: The entry of a session cached when it was created (rowids start at 1).
_NEW_SESSION = _Entry(keys=(), messages=(), last_rowid=0, last_id="", chars=0)


class HistoryCache:
    """Session windows kept in process for the inline SQLite path (see the module doc)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS, max_chars: int = MAX_CHARS) -> None:
        self.max_sessions = max_sessions
        self.max_chars = max_chars
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._chars = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def read(
        self, conn: Conn, session_id: str, *, without: Collection[str] = ()
    ) -> list[ChatMessage]:
        """The session's window, read in ``conn``'s transaction; ``without`` the messages
        of those ids (a recovered turn's: messages whose clients send them again)."""
        if without or not isinstance(conn, InlineConnection):
            # (``without`` is rare, turn recovery's: read in full, the cache left alone.)
            query = _WINDOW.where(_M.id.not_in(list(without))) if without else _WINDOW
            rows = (await conn.execute(query, {"p_session_id": session_id})).all()
            return [to_message(role, content) for role, content, _, _ in reversed(rows)]
        entry = self._entries.get(session_id)
        if entry is not None:
            params = {"p_session_id": session_id, "p_rowid": entry.last_rowid}
            new: Sequence[Any] = conn.run(_SINCE, params).all()
            if entry is _NEW_SESSION:
                skip = 0  # cached before its first row: every row is new
            elif new and new[0][0] == entry.last_rowid and new[0][1] == entry.last_id:
                skip = 1
            else:
                skip = -1
            if skip >= 0:
                self.hits += 1
                if len(new) == skip:
                    return list(entry.messages)
                fresh = [
                    ((r[4], r[1]), to_message(r[2], r[3])) for r in new[skip:] if r[2] in _ROLES
                ]
                entry = _extend(entry, fresh, new[-1][0], new[-1][1])
                signal_after_commit(conn, TOPIC, (session_id, entry))
                return list(entry.messages)
            self.drop(session_id)  # renumbered (VACUUM): read it all again
        self.misses += 1
        newest: Any = conn.run(_NEWEST, {"p_session_id": session_id}).first()
        if newest is None:
            return []
        window: Sequence[Any] = conn.run(_WINDOW, {"p_session_id": session_id}).all()
        pairs = [((at, mid), to_message(role, content)) for role, content, at, mid in window]
        entry = _build(pairs, newest[0], newest[1])
        signal_after_commit(conn, TOPIC, (session_id, entry))
        return list(entry.messages)

    def started(self, conn: Conn, session_id: str) -> None:
        """``conn``'s transaction created the session: once it commits, cache the session
        as it was before its first row (empty), so that its next turn reads only the rows
        since (all of them) instead of the window. The turn that created it needs no read:
        its only message is the one it stored."""
        if isinstance(conn, InlineConnection):
            signal_after_commit(conn, TOPIC, (session_id, _NEW_SESSION))

    def apply(self, payloads: list[Any]) -> None:
        """After-commit listener: store entries a committed transaction read, unless the
        cache already holds a newer one for the session."""
        for session_id, entry in payloads:
            current = self._entries.get(session_id)
            if current is not None:
                if current.last_rowid > entry.last_rowid:
                    continue
                self._chars -= current.chars
            self._entries[session_id] = entry
            self._entries.move_to_end(session_id)
            self._chars += entry.chars
        while self._entries and (
            len(self._entries) > self.max_sessions or self._chars > self.max_chars
        ):
            _, dropped = self._entries.popitem(last=False)
            self._chars -= dropped.chars

    def drop(self, session_id: str) -> None:
        """Forget a session's window."""
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._chars -= entry.chars
