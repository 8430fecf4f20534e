"""The one transaction API: SQLite (embedded default) or PostgreSQL.

Every module talks to the database through :meth:`Database.tx` (a write transaction)
and :meth:`Database.read` (a read-only one); both run SQLAlchemy Core statements compiled
once (:mod:`leadgate.database.plans`) on a thin driver, fast on both backends:

* SQLite file: write transactions on the inline ``sqlite3`` connection on the event loop
  with group commit (:mod:`.inline_sqlite`: ``BEGIN IMMEDIATE``, so read-then-write never
  fails with "database is locked"; waiting for another process's lock is an asyncio
  sleep), reads on read-only inline connections (WAL: readers never wait for writers).
  A transaction's body must await nothing but its connection: the group's other members
  and SQLite's single writer wait for it.
* PostgreSQL: ``asyncpg`` directly (:mod:`.pg`), one pooled connection per transaction;
  ``FOR UPDATE SKIP LOCKED`` and the fenced updates are plain Core, as before.
* SQLite in memory: refused by :func:`checked_url` (no other connection sees it).

Errors are SQLAlchemy's (``IntegrityError``, ``OperationalError`` ...) on every path.
Alembic (migrations, the schema check) keeps SQLAlchemy's engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import logging
import os
import secrets
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from leadgate.core.errors import ConfigError, DatabaseDamaged, NotMigratedError, Unavailable
from leadgate.database.faults import pg_damage, refused, unavailable
from leadgate.database.inline_sqlite import InlineConnection, InlineReaders, InlineSqlite, Member
from leadgate.database.plans import AnyRow
from leadgate.database.revision import HEAD

if TYPE_CHECKING:
    # Imported where a PostgreSQL Database is made: the module loads asyncpg, which a
    # SQLite process (every operator command on the embedded default) never uses.
    from leadgate.database.pg import PgConnection, PgPool, TableChanges

log = logging.getLogger("leadgate.database")

#: The Alembic scripts ship inside the package (an installed wheel needs no checkout).
MIGRATIONS = importlib.resources.files("leadgate.database").joinpath("migrations")

# Key in ``AsyncConnection.info`` holding the topics signalled during a write transaction.
_TOPICS = "leadgate_after_commit_topics"
#: Locked forms of statements kept by :meth:`Database.skip_locked` (built-once ones).
_SKIP_LOCKED_CACHE = 256
# Key in ``AsyncConnection.info`` holding the write transaction's before-commit queues.
_BEFORE = "leadgate_before_commit"
# Key in ``AsyncConnection.info`` holding the Database's NOTIFY sender tag.
_SENDER = "leadgate_notify_sender"
# Key in ``AsyncConnection.info`` holding the Database of the write transaction
# (:func:`damage_met`).
_DB = "leadgate_database"

#: Writes a before-commit queue's items as the transaction's last statements.
Flush = Callable[["Conn", list[Any]], Awaitable[None]]
# Topic of the counts :func:`count_after_commit` holds until the commit.
_COUNTS = "leadgate_counts"


class Counted(Protocol):
    """What :func:`count_after_commit` increments (a Prometheus counter or one of its
    labelled children)."""

    def inc(self, amount: float = 1) -> None: ...


class Result(Protocol):
    """What callers of :class:`Conn` use of a statement's result."""

    @property
    def rowcount(self) -> int: ...

    def __iter__(self) -> Iterator[AnyRow]: ...

    def first(self) -> AnyRow | None: ...

    def one(self) -> AnyRow: ...

    def all(self) -> Sequence[AnyRow]: ...

    def scalar(self) -> Any: ...

    def scalar_one(self) -> Any: ...

    def scalars(self) -> Any: ...


class Conn(Protocol):
    """A connection inside a transaction of :meth:`Database.tx` or :meth:`Database.read`
    (the inline SQLite connection, an asyncpg connection, or SQLAlchemy's)."""

    @property
    def dialect(self) -> sa.Dialect: ...

    @property
    def info(self) -> dict[Any, Any]: ...

    async def execute(
        self,
        statement: sa.Executable,
        parameters: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    ) -> Result: ...

    async def scalar(
        self, statement: sa.Executable, parameters: Mapping[str, Any] | None = None
    ) -> Any: ...

    def begin_nested(self) -> AbstractAsyncContextManager[Any]:
        """A SAVEPOINT: an error in the block undoes the block's writes alone."""
        ...

    def cache_token(self, tables: Sequence[str]) -> object | None:
        """Equal on two calls only if no row of ``tables`` can have changed in between
        (inline SQLite, see :meth:`InlineConnection.cache_token`); None where that cannot
        be known cheaply (PostgreSQL: other replicas write without telling)."""
        ...


def notify_sender(conn: Conn) -> str:
    """The tag of the :class:`Database` whose transaction ``conn`` is, for NOTIFY payloads
    (PostgreSQL): its own listener skips what this process already handled at commit."""
    return str(conn.info.get(_SENDER, ""))


def signal_after_commit(conn: Conn, topic: str, payload: Any = None) -> None:
    """Run ``topic``'s in-process listeners once the current :meth:`Database.tx` commits.

    Used to wake runners (the outbox relay) without polling and without racing the
    commit: a listener never runs for a transaction that rolled back, and never before
    the row it is woken for is visible. ``payload`` (when not None) is handed to the
    listeners registered with :meth:`Database.on_commit_payloads`, in signalling order.
    """
    topics = conn.info.get(_TOPICS)
    if topics is not None:
        payloads = topics.setdefault(topic, [])
        if payload is not None:
            payloads.append(payload)


def count_after_commit(conn: Conn, counter: Counted, amount: float = 1) -> None:
    """Increment ``counter`` by ``amount`` once the current :meth:`Database.tx` (or
    :meth:`Database.write_alone`) commits: a count stands for what committed, never for
    a transaction that rolled back (a database fault at its ``COMMIT``, a fenced move
    that failed later in it) nor for one in doubt (nothing known to have landed). Held
    as the transaction's other after-commit signals are, with no statement of its own.
    Outside a write transaction nothing waits for a commit: counted at once."""
    topics = conn.info.get(_TOPICS)
    if topics is None:
        counter.inc(amount)
        return
    topics.setdefault(_COUNTS, []).append((counter, amount))


#: Counts :func:`count_after_commit` held: (counter, amount) pairs.
Held = Sequence[tuple[Counted, float]]
#: A transaction's own list of counts held for its commit (:func:`held_counts`), kept by
#: reference by the looks that may find a write in doubt landed (:func:`count_found`).
Counts = list[tuple[Counted, float]]


def held_counts(conn: Conn) -> Counts:
    """The counts the current :meth:`Database.tx` holds for its commit, those its body
    holds later included (the list is the transaction's own). For a write whose
    ``COMMIT`` may end in doubt, which counts nothing, and that a later look may find
    landed: the caller keeps them, and :func:`count_held` makes them when it is found.
    Outside a write transaction (counted at once): an empty list."""
    topics = conn.info.get(_TOPICS)
    if topics is None:
        return []
    held: Counts = topics.setdefault(_COUNTS, [])
    return held


def count_held(held: Held) -> None:
    """Make the counts ``held`` (at a commit, or of a write in doubt found landed)."""
    for counter, amount in held:
        counter.inc(amount)


def count_found(held: Counts) -> None:
    """Make the counts ``held`` of a write in doubt that a look found landed, and empty
    the list: the same write found again, by this look or another that keeps the same
    list, counts nothing more."""
    count_held(held)
    held.clear()


def damage_met(conn: Conn, exc: BaseException) -> DatabaseDamaged | None:
    """The :class:`DatabaseDamaged` that ``exc``, met by a statement inside the write
    transaction of ``conn`` and handled there (a SAVEPOINT rolled back), stands for, as
    the transaction's end would raise it (``db.damaged`` is set: ``/healthz`` reports
    it); None for any other error. What handles such an error itself sees the driver's
    error, which it logged with a traceback."""
    db = conn.info.get(_DB)
    if not isinstance(db, Database):
        return None
    try:
        _raise_fault(exc, db)
    except DatabaseDamaged as found:
        return found
    except Exception:  # (unavailable: not damage)
        return None
    return None


def signal_once(conn: Conn, topic: str, payload: Any) -> bool:
    """:func:`signal_after_commit` of ``payload`` on ``topic``, unless the current
    transaction signalled it already; whether this call signalled it. What goes with a
    signal (a NOTIFY to other replicas) is then sent once per transaction, however many
    rows of it the transaction writes. Outside a :meth:`Database.tx` nothing can be
    signalled, and nothing is known to have been sent: True."""
    topics = conn.info.get(_TOPICS)
    if topics is None:
        return True
    payloads = topics.setdefault(topic, [])
    if payload in payloads:
        return False
    payloads.append(payload)
    return True


async def before_commit(conn: Conn, key: str, flush: Flush, item: Any) -> None:
    """Queue ``item``; ``flush(conn, items)`` writes the queue of ``key`` once, after the
    rest of the current :meth:`Database.tx` body and just
    before its commit (nothing is written when the body fails).

    Used where the *last* statement of a transaction matters: a row lock taken there is
    the last lock the transaction takes, so it cannot close a lock cycle, and the queued
    rows go in one statement. Outside such a transaction ``flush`` runs at once.
    """
    queues: dict[str, tuple[Flush, list[Any]]] | None = conn.info.get(_BEFORE)
    if queues is None:
        await flush(conn, [item])
        return
    entry = queues.get(key)
    if entry is None:
        entry = queues[key] = (flush, [])
    entry[1].append(item)


async def _flush_before_commit(conn: Conn, queues: dict[str, tuple[Flush, list[Any]]]) -> None:
    while queues:  # in the order the queues were opened; a flush may open another
        key = next(iter(queues))
        flush, items = queues.pop(key)
        await flush(conn, items)


class Database:
    """The process's database: the one transaction API over the backend's driver."""

    def __init__(
        self,
        url: str,
        *,
        pool_size: int = 10,
        busy_timeout_s: float = 30.0,
        statements_alone: bool = True,
        settle_doubt: bool = False,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.url = url
        #: PostgreSQL: a :meth:`tx` whose ``COMMIT`` is in doubt asks the server, on a
        #: fresh connection, whether its transaction committed (:meth:`_settle`), and
        #: ends as that one did: normally when it committed, with
        #: :class:`~leadgate.core.errors.Unavailable` "nothing was stored" (not in
        #: doubt) when it did not; in doubt still only when the server cannot say. For a
        #: caller with no watch of its own to make good a write that landed: the
        #: ``leadgate`` command, which exits on the error.
        self.settle_doubt = settle_doubt
        #: The time (seconds) and the wait :meth:`committed` asks again by while a
        #: transaction is in progress: real ones here; tests pass a clock they move by
        #: hand and a wait that moves it, so asking on for ``busy_timeout_s`` takes none.
        self.monotonic = monotonic
        self.sleep = sleep
        #: Sent as the payload of this Database's NOTIFYs (see :func:`notify_sender`).
        self.notify_tag = secrets.token_hex(8)
        #: The bound on waiting for a writer slot (SQLite: another process's write lock;
        #: this process's writer queue), and on PostgreSQL for a pooled connection. Past
        #: it a transaction fails with :class:`leadgate.core.errors.Unavailable` (503).
        self.busy_timeout_s = busy_timeout_s
        parsed = checked_url(url)
        self.is_sqlite = parsed.get_backend_name() == "sqlite"
        self.is_postgres = parsed.get_backend_name() == "postgresql"
        self._skip_locked: dict[int, tuple[sa.Select[Any], sa.Select[Any]]] = {}
        #: Whether a write that has a one-statement form runs as that statement (see
        #: :meth:`write_alone`); otherwise its transaction writes the same rows. Only
        #: PostgreSQL has such forms: they are data-modifying CTEs, which SQLite lacks,
        #: and there a short transaction on the inline connection shares its commit
        #: (group commit) anyway. Domain code asks this, never which backend it is on;
        #: False on PostgreSQL (``statements_alone=False``) runs every such write as its
        #: transaction, which tests compare the statements against, row for row.
        self.statements_alone = self.is_postgres and statements_alone
        # Statement parameters hold message text: never put them into error messages
        # (which reach the log).
        kwargs: dict[str, Any] = {"hide_parameters": True}
        if self.is_postgres:
            # Only Alembic and the schema check use the engine: a small pool. A server
            # that does not answer the connect is as down as one that refuses it.
            kwargs.update(
                pool_size=1,
                max_overflow=1,
                pool_pre_ping=True,
                connect_args={"timeout": max(1.0, busy_timeout_s)},
            )
        self.engine: AsyncEngine = create_async_engine(url, **kwargs)
        if self.is_sqlite:
            _install_sqlite_recipe(self.engine, busy_timeout_s)
        self._listeners: dict[str, list[Callable[[], None]]] = {}
        self._payload_listeners: dict[str, list[Callable[[list[Any]], None]]] = {
            _COUNTS: [count_held]
        }
        self._doubt_listeners: dict[str, list[Callable[[list[Any]], None]]] = {}
        self._write_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._write_owner: asyncio.Task[Any] | None = None
        self._inline: InlineSqlite | None = None
        #: What a transaction found damaged in the SQLite file or the PostgreSQL
        #: database (naming it), once one did
        #: (:class:`leadgate.core.errors.DatabaseDamaged`): ``/healthz`` reports it until
        #: :meth:`recheck_damage` finds it repaired (a statement that happens not to
        #: touch the damaged pages succeeds meanwhile, so success elsewhere proves
        #: nothing).
        self.damaged: str | None = None
        #: Counts the times damage was met, so a re-check clears only what it checked.
        self._damage_met = 0
        #: PostgreSQL: each statement that met the damage, for :meth:`recheck_damage`:
        #: by its SQL, the parameters it last met it with and the :attr:`_damage_met`
        #: count then (in memory only: the parameters are what clients sent), oldest
        #: first, at most :data:`DAMAGE_REPLAYS`.
        self._damaged_by: dict[str, tuple[Sequence[Any], int]] = {}
        #: PostgreSQL: damage was met that no statement can be run again for (at
        #: ``COMMIT``, or beyond :data:`DAMAGE_REPLAYS` statements): it stays reported
        #: until a restart.
        self._damage_unreplayable = False
        #: How the log names a PostgreSQL database: ``dbname on host:port`` (never the
        #: user or the password).
        self._pg_name = _pg_name(parsed) if self.is_postgres else ""
        self._readers: InlineReaders | None = None
        self._pg: PgPool | None = None
        if self.is_sqlite and parsed.database not in (None, "", ":memory:"):
            self._inline = InlineSqlite(
                parsed.database, self.engine.dialect, busy_wait_s=busy_timeout_s
            )
            self._readers = InlineReaders(
                parsed.database, self.engine.dialect, busy_wait_s=busy_timeout_s
            )
        if self.is_postgres:
            from leadgate.database.pg import PgPool  # see the imports

            # Bounded: waiting for a pooled connection or a connect past the busy bound
            # is a 503 (Unavailable), not a request hanging on.
            self._pg = PgPool(
                url,
                self.engine.dialect,
                size=pool_size,
                acquire_timeout_s=busy_timeout_s,
                connect_timeout_s=max(1.0, busy_timeout_s),
                tag=self.notify_tag,
            )

    def _note_damage(self, detail: str, exc: BaseException) -> None:
        """Remember damage met by ``exc`` (:func:`_raise_fault`)."""
        self.damaged = detail
        self._damage_met += 1
        if not self.is_postgres:
            return
        replay = _replayable(exc)
        if replay is None or (
            replay[0] not in self._damaged_by and len(self._damaged_by) >= DAMAGE_REPLAYS
        ):
            self._damage_unreplayable = True
        else:
            sql, args = replay
            self._damaged_by[sql] = (args, self._damage_met)

    async def recheck_damage(self) -> bool:
        """Look again at the damage :attr:`damaged` reports; clear it (True) when it is
        gone, an operator having repaired it while the service ran. SQLite:
        ``PRAGMA quick_check`` of the whole file (every page, on a connection of its
        own in a thread: it takes time in proportion to the file, so callers bound how
        often). PostgreSQL: each distinct statement that met the damage (by its SQL,
        with the parameters it last met it with), run again in a transaction that is
        always rolled back (a ``REINDEX`` of the index it met, or the data restored,
        lets it pass), oldest first, until one fails; one that passes is not run again.
        The damage is cleared once every one has passed; when one cannot be run again
        (the damage was met at ``COMMIT``, or by more than :data:`DAMAGE_REPLAYS`
        statements), it stays reported until a restart. Damage met again while this ran
        is not cleared."""
        if self.damaged is None:
            return True
        met = self._damage_met
        if self._inline is not None:
            repaired = await asyncio.to_thread(_quick_check, self._inline.path)
        else:
            repaired = await self._replay_damaged()
        if repaired and met == self._damage_met:
            self.damaged = None
            return True
        return False

    async def _replay_damaged(self) -> bool:
        """:meth:`recheck_damage` on PostgreSQL: True when every statement runs."""
        if self._damage_unreplayable:
            return False
        for sql, (args, met) in list(self._damaged_by.items()):
            if not await self._replays(sql, args):
                return False  # damaged still: the others wait for the next re-check
            kept = self._damaged_by.get(sql)
            if kept is not None and kept[1] == met:
                del self._damaged_by[sql]  # (one met again meanwhile stays)
        return not self._damaged_by

    async def _replays(self, sql: str, args: Sequence[Any]) -> bool:
        """Whether ``sql`` runs, in a transaction rolled back."""
        pool = self._pg
        if pool is None:
            return False
        try:
            async with pool.transaction() as conn:
                # Bounded: the re-check must not wait on locks or run long.
                await conn.raw.execute("SET LOCAL statement_timeout = '5s'")
                await conn.raw.execute("SET LOCAL lock_timeout = '1s'")
                await conn.raw.fetch(sql, *args)
                raise _Undo
        except _Undo:
            return True
        except Exception:  # damaged still, or unknown: keep reporting it
            return False

    @property
    def table_changes(self) -> TableChanges | None:
        """PostgreSQL: the writes to the notifying tables this process knows of (its
        LISTEN connection feeds :meth:`TableChanges.notified`, see
        :data:`leadgate.database.pg.CHANGES_CHANNEL`); None on SQLite."""
        return None if self._pg is None else self._pg.changes

    @property
    def connection_uses(self) -> int:
        """PostgreSQL: pooled connections handed out so far (tests count them); 0 on
        SQLite."""
        return 0 if self._pg is None else self._pg.uses

    def on_commit(self, topic: str, callback: Callable[[], None]) -> None:
        """Call ``callback`` after every committed :meth:`tx` that signalled ``topic``
        (see :func:`signal_after_commit`)."""
        self._listeners.setdefault(topic, []).append(callback)

    def on_commit_payloads(self, topic: str, callback: Callable[[list[Any]], None]) -> None:
        """Like :meth:`on_commit`, with the payloads the transaction signalled."""
        self._payload_listeners.setdefault(topic, []).append(callback)

    def off_commit_payloads(self, topic: str, callback: Callable[[list[Any]], None]) -> None:
        """Remove a callback added with :meth:`on_commit_payloads` (no-op if absent)."""
        listeners = self._payload_listeners.get(topic, [])
        if callback in listeners:
            listeners.remove(callback)

    def on_doubt_payloads(self, topic: str, callback: Callable[[list[Any]], None]) -> None:
        """Call ``callback`` with ``topic``'s payloads when a transaction (or
        :meth:`write_alone`) that signalled them failed with a database fault: it may
        have committed (the connection dropped after the COMMIT reached the server) or
        not. PostgreSQL only: a SQLite COMMIT that fails did not commit (see
        ``_InlineTx.__aexit__``). What was promised to happen after commit did not
        happen; the listener makes good what may be in the database (fenced, so a
        rollback leaves nothing to do)."""
        self._doubt_listeners.setdefault(topic, []).append(callback)

    def off_doubt_payloads(self, topic: str, callback: Callable[[list[Any]], None]) -> None:
        """Remove a callback added with :meth:`on_doubt_payloads` (no-op if absent)."""
        listeners = self._doubt_listeners.get(topic, [])
        if callback in listeners:
            listeners.remove(callback)

    # -------------------------------------------------------------- transactions

    def tx(self) -> AbstractAsyncContextManager[Conn]:
        """A write transaction, committed when the block ends without an error.

        SQLite has one writer: within this process writers queue on an asyncio lock (FIFO)
        and transactions started in one loop iteration share one commit (group commit;
        each caller returns after the COMMIT). Other processes (admin CLI, replicas) meet
        ``BEGIN IMMEDIATE``'s non-blocking wait.
        """
        if self._inline is not None:
            return _InlineTx(self, self._inline)
        assert self._pg is not None  # checked_url admits a SQLite file or PostgreSQL
        return self._pg_tx()

    async def write_alone(
        self,
        statement: sa.Executable,
        parameters: Mapping[str, Any],
        *,
        signals: Sequence[tuple[str, Any]] = (),
        signals_from: Callable[[AnyRow], Sequence[tuple[str, Any]]] | None = None,
        in_doubt: Sequence[tuple[str, Any]] = (),
    ) -> Result:
        """One statement that is a whole write transaction by itself.

        On PostgreSQL it runs outside a transaction block, where a single statement is
        atomic anyway: one round trip instead of three (``BEGIN``, it, ``COMMIT``), which
        are most of a short transaction's cost there. Elsewhere it is a :meth:`tx` of
        that statement. ``signals`` (``(topic, payload)`` pairs) are signalled after its
        commit, as :func:`signal_after_commit` does inside a transaction, and so are
        those ``signals_from`` makes of each row the statement returned. When it fails
        with a database fault on PostgreSQL, ``signals`` and ``in_doubt`` go to the
        :meth:`on_doubt_payloads` listeners (what ``signals_from`` would have made of
        the rows is unknown then: ``in_doubt`` stands for it); on SQLite a failed write
        never landed, and they are not called.
        """
        if self._pg is None:
            # SQLite: a transaction like any other, whose failure is never in doubt (see
            # _InlineTx.__aexit__): nothing for the doubt listeners.
            async with self.tx() as conn:
                result = await conn.execute(statement, parameters)
                for topic, payload in _signals(result, signals, signals_from):
                    signal_after_commit(conn, topic, payload)
            return result
        try:
            result = await self._pg.execute_alone(statement, parameters)
        except Exception as exc:
            self._in_doubt(exc, _by_topic((*signals, *in_doubt)))
            _raise_fault(exc, self, in_doubt=True)
            raise
        self._after_commit(_by_topic(_signals(result, signals, signals_from)))
        return result

    def committed_token(self, tables: Sequence[str]) -> object | None:
        """A token for caching what a :meth:`read` started after this call reads of
        ``tables``: equal on two calls only if no write to them was committed in between
        (by this process or any other). Inline SQLite: see
        :meth:`InlineConnection.committed_token`. PostgreSQL: :class:`TableChanges`,
        which counts this process's writes when their transaction has ended and other
        writers' when their notification arrives; None while it does not listen, or for
        a table that does not notify. None elsewhere: read every time."""
        if self._inline is not None:
            return self._inline.committed_token(tables)
        changes = self.table_changes
        return None if changes is None else changes.token(tables)

    def read(self) -> AbstractAsyncContextManager[Conn]:
        """A read-only transaction: on SQLite one snapshot for all its statements; on
        PostgreSQL (READ COMMITTED) each statement sees what was committed when it
        started, and the statements run outside a transaction block."""
        if self._readers is not None:
            return _InlineRead(self._readers, self)
        assert self._pg is not None
        return self._pg_read()

    @asynccontextmanager
    async def _pg_tx(self) -> AsyncIterator[Conn]:
        assert self._pg is not None
        topics: dict[str, list[Any]] = {}
        before: dict[str, tuple[Flush, list[Any]]] = {}
        committing = False
        xid: int | None = None
        try:
            async with self._pg.transaction() as conn:
                conn.info[_TOPICS] = topics
                conn.info[_BEFORE] = before
                conn.info[_SENDER] = self.notify_tag
                conn.info[_DB] = self
                yield conn
                _undo_failed(conn)
                # Before the COMMIT, so not in doubt: a statement failed and its caller
                # went on (PostgreSQL aborted the transaction; see PgPool.transaction).
                conn.raise_aborted()
                await _flush_before_commit(conn, before)
                conn.raise_aborted()
                if self.settle_doubt:
                    xid = await conn.scalar(sa.text("SELECT txid_current()"))
                committing = True
        except Exception as exc:
            if committing:  # (before the COMMIT, a failure rolls everything back)
                self._in_doubt(exc, topics)
            try:
                _raise_fault(exc, self, in_doubt=committing)
            except Unavailable as fault:
                if xid is None or not fault.in_doubt:
                    raise
                await self._settle(fault, xid)  # (returns only when it committed)
            else:
                raise
        self._after_commit(topics)

    async def _settle(self, fault: Unavailable, xid: int) -> None:
        """The ``COMMIT`` of transaction ``xid`` met ``fault``, in doubt: return when
        :meth:`committed` says it committed (one WARNING line); raise ``fault`` no
        longer in doubt ("nothing was stored") when it rolled back; raise it as it is
        when the server cannot say."""
        landed = await self.committed(xid)
        if landed is None:
            raise fault
        if not landed:
            fault.in_doubt = False
            raise fault
        log.warning(
            "a write's COMMIT was in doubt (%s); the server says it committed",
            fault.detail or fault.rule,
        )

    async def committed(self, xid: int) -> bool | None:
        """PostgreSQL: whether transaction ``xid`` (``txid_current()``) committed (True)
        or rolled back (False), asked on another connection (``txid_status``, the
        server's own answer to a connection lost during ``COMMIT``). While it is still
        in progress (its ``COMMIT`` not yet applied, or not received by a server that
        has not yet seen its connection go) this asks again, 10 ms on and doubling to
        200 ms, for at most ``busy_timeout_s`` (by :attr:`monotonic` and :attr:`sleep`).
        None: the server could not say then (unreachable, or still in progress)."""
        assert self._pg is not None
        deadline = self.monotonic() + self.busy_timeout_s
        pause = 0.01
        try:
            async with self._pg.read() as conn:
                while True:
                    status = await conn.scalar(sa.text("SELECT txid_status(:xid)"), {"xid": xid})
                    if status != "in progress" or self.monotonic() >= deadline:
                        break
                    await self.sleep(pause)
                    pause = min(pause * 2, 0.2)
        except Exception as exc:
            if unavailable(exc) is None:
                raise
            return None
        return {"committed": True, "aborted": False}.get(status)

    @asynccontextmanager
    async def _pg_read(self) -> AsyncIterator[Conn]:
        assert self._pg is not None
        try:
            async with self._pg.read() as conn:
                yield conn
        except Exception as exc:
            _raise_fault(exc, self)
            raise

    def _in_doubt(self, exc: BaseException, topics: Mapping[str, list[Any]]) -> None:
        """A write failed: when with a database fault, wake the :meth:`on_commit`
        listeners of its topics and hand its payloads to the :meth:`on_doubt_payloads`
        listeners."""
        if unavailable(exc) is None or refused(exc):
            return  # an error of the statement itself, or refused by the server: rolled back
        for topic, payloads in topics.items():
            # It may have landed: the work it gave a runner (a delivery due) must not
            # wait for the runner's poll. Woken for a write that did not land, the
            # runner finds nothing.
            for wake in self._listeners.get(topic, ()):
                wake()
            if payloads:
                for callback in self._doubt_listeners.get(topic, ()):
                    callback(payloads)

    def _after_commit(self, topics: dict[str, list[Any]]) -> None:
        for topic, payloads in topics.items():
            for callback in self._listeners.get(topic, ()):
                callback()
            if payloads:
                for payload_callback in self._payload_listeners.get(topic, ()):
                    payload_callback(payloads)

    @property
    def _lock_wait_s(self) -> float:
        # The writer queue in this process, plus SQLite's own wait (the busy bound) for
        # another process's lock: past this, a transaction gives up (Unavailable).
        return self.busy_timeout_s + 1.0

    def _not_nested(self) -> asyncio.Task[Any] | None:
        """The current task, unless it already holds a write transaction here (SQLite
        could never serve the nested one either: it would wait for itself)."""
        task = asyncio.current_task()
        if task is not None and task is self._write_owner:
            raise RuntimeError("nested write transaction on SQLite")
        return task

    def _lock(self) -> asyncio.Lock:
        """The writer lock; one per event loop, as a Database may outlive a loop (tests)."""
        loop = asyncio.get_running_loop()
        if self._write_lock is None or self._write_lock[0] is not loop:
            self._write_lock = (loop, asyncio.Lock())
        return self._write_lock[1]

    @contextmanager
    def record_statements(self) -> Iterator[list[str]]:
        """Collect the SQL of every statement this process runs meanwhile, on every
        driver (tests and debugging; SQLite's BEGIN/COMMIT included)."""
        statements: list[str] = []

        def on_engine(_conn: Any, _cursor: Any, sql: str, *_: Any) -> None:
            statements.append(sql)

        sync_engine = self.engine.sync_engine
        event.listen(sync_engine, "before_cursor_execute", on_engine)
        if self._inline is not None:
            self._inline.connection.set_trace(statements.append)
        if self._readers is not None:
            self._readers.set_trace(statements.append)
        if self._pg is not None:
            self._pg.trace = statements.append
        try:
            yield statements
        finally:
            event.remove(sync_engine, "before_cursor_execute", on_engine)
            if self._inline is not None:
                self._inline.connection.set_trace(None)
            if self._readers is not None:
                self._readers.set_trace(None)
            if self._pg is not None:
                self._pg.trace = None

    def skip_locked(self, select: sa.Select[Any], *, of: sa.Table | None = None) -> sa.Select[Any]:
        """``FOR UPDATE SKIP LOCKED`` on PostgreSQL; SQLite serializes writers anyway.
        ``of``: the one table of a join whose rows are locked (``FOR UPDATE OF``).

        The locked form of a statement built once is built once too (kept with its
        source, so the plan cache, which keys on the object, compiles it once)."""
        if not self.is_postgres:
            return select
        known = self._skip_locked.get(id(select))
        if known is not None and known[0] is select:
            return known[1]
        locked = select.with_for_update(skip_locked=True, of=of)
        if len(self._skip_locked) < _SKIP_LOCKED_CACHE:
            self._skip_locked[id(select)] = (select, locked)
        return locked

    def _check_file_exists(self) -> None:
        if self._inline is not None and not os.path.exists(self._inline.path):
            # Connecting would create the file, empty: a misspelt path left a stray
            # database behind each time it was used.
            raise NotMigratedError(
                f"the database file {self._inline.path} does not exist: create it with "
                "`leadgate db upgrade --config <your config>`",
                rule="db.not_migrated",
            )

    async def check_migrated(self) -> None:
        """Raise :class:`NotMigratedError` unless the schema is at the newest revision
        (rule ``db.not_migrated``: behind it, or never migrated; ``db.newer_schema``: at a
        revision this version does not know)."""
        # The head is a constant and the revision one SELECT: Alembic (and the Mako and
        # Pygments it loads) is imported only when they differ, not by every command
        # and service start.
        self._check_file_exists()
        try:
            if self._inline is not None:
                rev = await asyncio.to_thread(self._sqlite_revision, current_revision)
            else:
                async with self.engine.connect() as conn:
                    rev = await conn.run_sync(current_revision)
        except sa.exc.DBAPIError as exc:
            not_sqlite = _not_a_database(exc, self._inline.path if self._inline else None)
            if not_sqlite is not None:
                raise not_sqlite from None
            raise
        if rev != HEAD:
            if rev is not None and rev not in known_revisions():
                raise newer_schema(rev, HEAD)
            raise NotMigratedError(
                f"the database is at schema revision {rev or 'none'}, this version needs {HEAD}: "
                "run `leadgate db upgrade --config <your config>` first",
                rule="db.not_migrated",
            )

    def _sqlite_revision(self, current: Callable[[sa.Connection], str | None]) -> str | None:
        """``current`` on a plain connection to the SQLite file: a read that changes
        nothing in it. The engine's connections put the file into WAL mode (a write to
        its header), so a refused start left an old or never-migrated file changed."""
        assert self._inline is not None
        path, timeout = self._inline.path, self.busy_timeout_s
        engine = sa.create_engine(
            "sqlite://",
            creator=lambda: sqlite3.connect(path, timeout=timeout, check_same_thread=False),
            poolclass=sa.pool.NullPool,
        )
        try:
            with engine.connect() as conn:
                return current(conn)
        finally:
            engine.dispose()

    async def close(self) -> None:
        """Close the drivers' connections and dispose of the engine."""
        if self._inline is not None:
            await self._inline.close()
        if self._readers is not None:
            self._readers.close()
        if self._pg is not None:
            await self._pg.close()
        await self.engine.dispose()


class _InlineTx:
    """:meth:`Database.tx` on the inline SQLite connection (a class, not a generator
    context manager: it runs on every hot path and this is measurably cheaper)."""

    __slots__ = ("before", "db", "inline", "member", "topics")

    def __init__(self, db: Database, inline: InlineSqlite) -> None:
        self.db = db
        self.inline = inline
        self.topics: dict[str, list[Any]] = {}
        self.before: dict[str, tuple[Flush, list[Any]]] = {}

    async def __aenter__(self) -> InlineConnection:
        task = self.db._not_nested()
        try:
            self.member: Member = await self.inline.enter(self.db._lock(), self.db._lock_wait_s)
        except Exception as exc:
            _raise_fault(exc, self.db)
            raise
        conn = self.inline.connection
        conn.info[_TOPICS] = self.topics
        conn.info[_BEFORE] = self.before
        conn.info[_DB] = self.db
        self.db._write_owner = task
        return conn

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        conn = self.inline.connection
        ok = exc_type is None
        flush_error: BaseException | None = None
        try:
            # (Taken in any case: the next member of the group uses this connection.)
            failed, conn.undo_failed = conn.undo_failed, None
            if ok and failed is not None:
                raise failed  # see _undo_failed
            if ok and self.before:
                # Inside this member's transaction: a failing flush rolls back the member.
                await _flush_before_commit(conn, self.before)
        except BaseException as failure:
            ok, flush_error = False, failure
        finally:
            self.db._write_owner = None
            conn.info.pop(_TOPICS, None)
            conn.info.pop(_BEFORE, None)
            conn.info.pop(_DB, None)
            waiter = self.inline.leave(self.member, ok=ok)
        if not ok:
            if waiter is not None:
                with contextlib.suppress(Exception):  # this member's own error wins
                    await waiter
            error = flush_error if flush_error is not None else exc
            if isinstance(error, Exception):
                _raise_fault(error, self.db)
            if flush_error is not None:
                raise flush_error
            return
        try:
            if waiter is not None:
                await waiter
        except Exception as failure:
            # The group's COMMIT failed, or SQLite had ended its transaction under it:
            # never in doubt, for any member. The COMMIT runs in this process (no answer
            # to lose on the way back, unlike PostgreSQL's), SQLite reports an error
            # only for a transaction it did not commit, and InlineSqlite._commit rolls
            # the transaction back before telling the members (one transaction, one
            # outcome for them all). So: the plain 503, and no doubt listener.
            _raise_fault(failure, self.db)
            raise
        self.db._after_commit(self.topics)


def _undo_failed(conn: PgConnection) -> None:
    """Raise the error of a nested block's undo that failed in ``conn``'s transaction
    (:meth:`PgConnection.begin_nested`; inline SQLite: :meth:`_InlineTx.__aexit__`),
    whoever caught it meanwhile: the block's writes may still be in the transaction,
    which must not commit them."""
    failed, conn.undo_failed = conn.undo_failed, None
    if failed is not None:
        raise failed


def _signals(
    result: Result,
    signals: Sequence[tuple[str, Any]],
    signals_from: Callable[[AnyRow], Sequence[tuple[str, Any]]] | None,
) -> list[tuple[str, Any]]:
    """:meth:`Database.write_alone`'s signals: the fixed ones, then the rows' own."""
    if signals_from is None:
        return list(signals)
    return [*signals, *(signal for row in result.all() for signal in signals_from(row))]


def _by_topic(signals: Sequence[tuple[str, Any]]) -> dict[str, list[Any]]:
    """``(topic, payload)`` pairs as the payloads of each topic (None: no payload)."""
    topics: dict[str, list[Any]] = {}
    for topic, payload in signals:
        topics.setdefault(topic, []).extend(() if payload is None else (payload,))
    return topics


def _raise_unavailable(exc: BaseException, *, in_doubt: bool = False) -> None:
    """Re-raise a database fault as :class:`Unavailable` (503); other errors pass.
    ``in_doubt``: it met the write's COMMIT (see :attr:`Unavailable.in_doubt`)."""
    fault = unavailable(exc)
    if fault is not None and fault is not exc:
        # (The server's ERROR answer to the COMMIT says it did not commit.)
        fault.in_doubt = in_doubt and not refused(exc)
        raise fault from exc


def _raise_fault(exc: BaseException, db: Database, *, in_doubt: bool = False) -> None:
    """:func:`_raise_unavailable`, where a transaction may also meet a damaged database:
    a damaged SQLite file (:func:`_not_a_database`), or PostgreSQL reporting damaged
    data or a damaged index (:func:`leadgate.database.faults.pg_damage`). That is
    re-raised as :class:`DatabaseDamaged` and remembered in ``db.damaged``. It was the
    driver's error, which the web layer answered as a bug (500 ``internal``, a
    traceback per request) and the runners logged with a traceback per pass."""
    if isinstance(exc, DatabaseDamaged):
        return
    if isinstance(exc, sa.exc.DBAPIError) and db._inline is not None:
        found = _not_a_database(exc, db._inline.path)
        if found is not None:
            db._note_damage(found.message, exc)
            raise DatabaseDamaged(found.message) from exc
    if db.is_postgres:
        detail = _pg_damaged(exc, db._pg_name)
        if detail is not None:
            db._note_damage(detail, exc)
            raise DatabaseDamaged(detail) from exc
    _raise_unavailable(exc, in_doubt=in_doubt)


class _Undo(Exception):
    """Rolls back :meth:`Database.recheck_damage`'s transaction."""


#: Statements :meth:`Database.recheck_damage` may run again (in a transaction it rolls
#: back): never BEGIN, COMMIT, SAVEPOINT or the like, which would end or change it.
_REPLAYABLE = ("select", "with", "insert", "update", "delete")

#: Distinct statements (by SQL) that met damage kept for :meth:`Database.recheck_damage`
#: to run again; it runs them until one fails, each at most 5 s. Damage met by one more
#: than this stays reported until a restart, as damage met at ``COMMIT`` does: the
#: re-check stays bounded, and never reports good what it could not look at.
DAMAGE_REPLAYS = 8


def _replayable(exc: BaseException) -> tuple[str, Sequence[Any]] | None:
    """The statement (SQL and parameters) of the driver's error in ``exc``, when it is
    one that can be run again."""
    item: BaseException | None = exc
    while item is not None and not isinstance(item, sa.exc.StatementError):
        item = item.__cause__
    if item is None or not isinstance(item.statement, str):
        return None
    sql = item.statement
    if not sql.lstrip().lower().startswith(_REPLAYABLE):
        return None
    params = item.params
    if params is None:
        return sql, ()
    if isinstance(params, Sequence) and not isinstance(params, str):
        return sql, tuple(params)
    return None


def _quick_check(path: str) -> bool:
    """``PRAGMA quick_check`` of the SQLite file at ``path`` on a read-only connection
    of its own (SQLite shares the file's locks between connections of one process):
    True when it finds nothing wrong."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    except sqlite3.Error:
        return False
    try:
        return bool(conn.execute("PRAGMA quick_check(1)").fetchone() == ("ok",))
    except sqlite3.Error:
        return False
    finally:
        conn.close()


def _pg_damaged(exc: BaseException, name: str) -> str | None:
    """The log's line for PostgreSQL reporting damage in the database ``name``
    (:func:`_pg_name`); None when ``exc`` is no such report."""
    said = pg_damage(exc)
    return None if said is None else f"the PostgreSQL database {name} is damaged ({said})"


def _pg_name(parsed: sa.engine.URL) -> str:
    """``dbname on host:port`` of a PostgreSQL URL (a socket directory for a host given
    as ``?host=``), for the log: nothing of the credentials."""
    host = parsed.host or parsed.query.get("host") or "localhost"
    if not isinstance(host, str):  # (a query key given twice: a tuple)
        host = ",".join(host)
    return f"{parsed.database or parsed.username or '?'} on {host}:{parsed.port or 5432}"


class _InlineRead:
    """:meth:`Database.read` on a read-only inline connection."""

    __slots__ = ("conn", "db", "readers")

    def __init__(self, readers: InlineReaders, db: Database) -> None:
        self.readers = readers
        self.db = db

    async def __aenter__(self) -> InlineConnection:
        try:
            conn = self.readers.take()
            self.conn = await self.readers.open() if conn is None else conn
        except Exception as exc:
            _raise_fault(exc, self.db)
            raise
        return self.conn

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.readers.give(self.conn)
        if isinstance(exc, Exception):
            _raise_fault(exc, self.db)


def _install_sqlite_recipe(engine: AsyncEngine, busy_timeout_s: float) -> None:
    sync_engine = engine.sync_engine

    @event.listens_for(sync_engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(sync_engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        if conn.get_execution_options().get("leadgate_readonly"):
            conn.exec_driver_sql("BEGIN")
        else:
            conn.exec_driver_sql("BEGIN IMMEDIATE")


#: The PostgreSQL advisory lock ``leadgate db upgrade`` holds for its transaction, which
#: applies every pending revision and commits (a failure leaves none applied). Replicas
#: upgrading at once take turns: the next one reads the revision the first committed and
#: finds nothing left to do (without it both created ``alembic_version`` and one failed,
#: exit 1 with the driver's error). The value is arbitrary: "lgup" in ASCII.
UPGRADE_LOCK = 0x6C677570


def current_revision(conn: sa.Connection) -> str | None:
    """The revision ``alembic_version`` holds (what Alembic's ``MigrationContext`` reads),
    None when the table is missing or empty."""
    if not sa.inspect(conn).has_table("alembic_version"):
        return None
    found = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all()
    # More than one row is a branched history, which ours never is: shown as it is.
    return ",".join(sorted(found)) or None


def known_revisions() -> set[str]:
    """Every revision under ``migrations/versions``, read by Alembic."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    return {s.revision for s in script.walk_revisions()}


def alembic_config(url: str) -> Any:
    """An Alembic ``Config`` pointing at our migrations and ``url``."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


#: The drivers the service runs on, by backend (``postgres`` is the name Heroku and
#: others give PostgreSQL).
_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+asyncpg"}
_DRIVERS["postgres"] = _DRIVERS["postgresql"]


def checked_url(url: str) -> sa.engine.URL:
    """``database.url`` parsed: a ``sqlite+aiosqlite://`` or ``postgresql+asyncpg://``
    URL, and for SQLite a file that SQLite can open: not in memory, not a directory, in
    a folder that exists. Each was a driver's error from deep in a command, exit 1 (``The
    asyncio extension requires an async driver``, ``No module named 'psycopg'``, ``unable
    to open database file``), or worked and was never usable (in memory). A file that is
    not a SQLite database is found by its first statement (:func:`_not_a_database`).
    :class:`ConfigError` otherwise, whose message never quotes the URL (it may hold a
    password)."""
    try:
        parsed = sa.engine.make_url(url)
    except sa.exc.ArgumentError as exc:
        raise ConfigError(f"database.url is not a valid URL: {exc}", rule="database.url") from None
    except ValueError:
        # A port that is no number; its text is not quoted: with a "/" or "@" in the
        # password left unescaped, the "port" is a piece of the password.
        raise ConfigError(
            "database.url is not a valid URL: its port is not a number (a password "
            "holding @, /, : or % must be percent-encoded: @ is %40)",
            rule="database.url",
        ) from None
    if parsed.host and "@" in parsed.host:
        # An unescaped @ in the password: the driver would try a host named after the
        # rest of the password, and say so in its error.
        raise ConfigError(
            "database.url has more than one @ before its host: percent-encode the "
            "password (@ is %40)",
            rule="database.url",
        )
    driver = parsed.drivername
    if driver not in _DRIVERS.values():
        # Checked before Alembic or the engine imports a driver for it.
        raise ConfigError(
            "database.url must start with sqlite+aiosqlite:/// (a SQLite file) or "
            f"postgresql+asyncpg:// (PostgreSQL), not {driver}://{_corrected(parsed)}",
            rule="database.url",
        )
    if driver != _DRIVERS["sqlite"]:
        return parsed
    path = parsed.database
    if not path or path == ":memory:" or parsed.query.get("mode") == "memory":
        # Every connection (each command, the service's readers) would have a database
        # of its own, empty, gone when it closes: `db upgrade` succeeded, nothing else.
        raise ConfigError(
            "database.url names no SQLite file but a database in memory, which no other "
            "connection or command sees and which is gone at exit: name a file, e.g. "
            "sqlite+aiosqlite:///./leadgate.db",
            rule="database.url",
        )
    if os.path.isdir(path):
        raise ConfigError(
            f"database.url names a directory, not a database file: {os.path.abspath(path)}",
            rule="database.url",
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(
            f"the folder of the database file does not exist: {folder}", rule="database.url"
        )
    return parsed


def damaged_file(exc: BaseException, url: str) -> ConfigError | None:
    """:func:`_not_a_database` for an error met anywhere in a command (a damaged page may
    lie under any table), for the SQLite file of ``url``; for a PostgreSQL ``url``, the
    server reporting damaged data or a damaged index
    (:func:`leadgate.database.faults.pg_damage`), naming the database; None for
    anything else."""
    if not isinstance(exc, sa.exc.DBAPIError):
        return None
    try:
        parsed = sa.engine.make_url(url)
    except (sa.exc.ArgumentError, ValueError):
        return None
    if parsed.get_backend_name() == "postgresql":
        detail = _pg_damaged(exc, _pg_name(parsed))
        return None if detail is None else ConfigError(detail, rule="database.file")
    sqlite = parsed.drivername == _DRIVERS["sqlite"]
    return _not_a_database(exc, parsed.database if sqlite else None)


def _not_a_database(exc: sa.exc.DBAPIError, path: str | None) -> ConfigError | None:
    """SQLite's ``file is not a database`` (``SQLITE_NOTADB``) or ``database disk image is
    malformed`` (``SQLITE_CORRUPT``: a valid header, damaged pages) as one line naming the
    file, where the first statement meets it: the driver's error was exit 1 with its SQL
    and a sqlalche.me link. (Not by reading the file's header beforehand: opening and
    closing the file in a process that holds SQLite connections to it drops their POSIX
    locks, and another process may then checkpoint the WAL under them.)"""
    orig = exc.orig
    if not isinstance(orig, sqlite3.DatabaseError) or path is None:
        return None
    # The primary code: the extended ones (SQLITE_CORRUPT_INDEX, ...) share its low byte.
    # The module's own errors (a parameter it cannot bind) have none.
    extended = getattr(orig, "sqlite_errorcode", None)
    if not isinstance(extended, int):
        return None
    code = extended & 0xFF
    if code == sqlite3.SQLITE_NOTADB:
        return ConfigError(
            f"{os.path.abspath(path)} is not a SQLite database (or its header is damaged): "
            "database.url names another file, or the file was overwritten",
            rule="database.file",
        )
    if code == sqlite3.SQLITE_CORRUPT:
        return ConfigError(
            f"the SQLite database {os.path.abspath(path)} is damaged (SQLite: database disk "
            "image is malformed): stop the service and restore the file from a backup "
            "(`sqlite3 FILE .recover` may save what is left of it)",
            rule="database.file",
        )
    return None


def _corrected(parsed: sa.engine.URL) -> str:
    """``: write <the URL with its driver>`` for a known backend's other driver."""
    driver = _DRIVERS.get(parsed.get_backend_name().lower())
    if driver is None:
        return ""
    if driver == _DRIVERS["sqlite"]:
        # Nothing secret in a SQLite URL: the whole corrected one.
        return f": write {parsed.set(drivername=driver).render_as_string()}"
    return f": start it with {driver}:// instead (the rest as it is)"


#: Where :func:`upgrade` leaves the SQLite busy timeout for the migration environment
#: (``leadgate/database/migrations/env.py``), in the Alembic config's attributes.
BUSY_TIMEOUT_ATTRIBUTE = "leadgate.busy_timeout_s"


def upgrade(url: str, *, busy_timeout_s: float = 5.0) -> str:
    """Migrate the database at ``url`` to the newest revision; returns that revision. A
    database at a revision this version does not know is refused, untouched
    (:func:`newer_schema`); on PostgreSQL the upgrade holds :data:`UPGRADE_LOCK`, on
    SQLite the file's write lock, waited for up to ``busy_timeout_s`` (``[database]
    busy_timeout_s``) and then refused, untouched (:func:`_locked`)."""
    from alembic import command
    from alembic.script import ScriptDirectory
    from alembic.script.revision import ResolutionError
    from alembic.util import CommandError

    parsed = checked_url(url)
    cfg = alembic_config(url)
    cfg.attributes[BUSY_TIMEOUT_ATTRIBUTE] = busy_timeout_s
    head = str(ScriptDirectory.from_config(cfg).get_current_head())
    try:
        command.upgrade(cfg, "head")
    except sa.exc.DBAPIError as exc:
        refusal = _not_a_database(exc, parsed.database) or _locked(
            exc, parsed.database, busy_timeout_s
        )
        if refusal is not None:
            raise refusal from None
        raise
    except CommandError as exc:
        # The one revision Alembic cannot resolve here is the database's own: a newer
        # release wrote it (exit 1 with "Can't locate revision ..." until this).
        cause = exc.__cause__
        if isinstance(cause, ResolutionError) and cause.argument != "head":
            raise newer_schema(cause.argument, head) from None
        raise
    return head


def _locked(exc: sa.exc.DBAPIError, path: str | None, waited_s: float) -> Unavailable | None:
    """SQLite's ``database is locked`` (``SQLITE_BUSY``) met by ``db upgrade``: another
    upgrade or a running service kept the file's write lock past the busy timeout. One
    line naming the file and what to do; it was exit 1 with the driver's error and its
    SQL. The upgrade's one transaction rolled back: the file is as it was."""
    orig = exc.orig
    if not isinstance(orig, sqlite3.OperationalError) or path is None:
        return None
    extended = getattr(orig, "sqlite_errorcode", None)
    if not isinstance(extended, int) or extended & 0xFF != sqlite3.SQLITE_BUSY:
        return None
    return Unavailable(
        "another `leadgate db upgrade` or a running service held the write lock of the "
        f"SQLite database {os.path.abspath(path)} for longer than [database] busy_timeout_s "
        f"({waited_s:g} s): nothing was changed; run `leadgate db upgrade` again once that "
        "upgrade is done, or with the service stopped",
        rule="db.locked",
    )


def newer_schema(revision: str, head: str) -> NotMigratedError:
    """The refusal for a database at a revision this version does not know: a newer
    release migrated it (and this one was installed over it, a rollback). Nothing is
    written to it; migrations only go forward."""
    return NotMigratedError(
        f"the database is at schema revision {revision}, newer than this version knows "
        f"(it needs {head}): a newer release of leadgate upgraded it. Run that release "
        "again, or restore the backup taken before its `leadgate db upgrade`",
        rule="db.newer_schema",
    )
