"""SQLite on the event loop's own thread, for the turn path's short write transactions.

Why this exists (measured, see ``bench/bench_rest.py`` and the README): through
SQLAlchemy's asyncio layer and aiosqlite, every statement costs several thread hops and
greenlet switches, about 0.3-0.5 ms of event-loop time, against 10-30 us for SQLite
itself. A plain REST turn runs about eight statements, so that layer, not SQLite, bounded
the service at ~100 turns/s. Here the statements of a transaction run directly on a
stdlib ``sqlite3`` connection:

* statements are the same SQLAlchemy Core objects the rest of the code uses, compiled
  once per statement object (and set of parameter names) by SQLAlchemy's own compiler and
  type processors; only the execution is ours;
* a write transaction never suspends between its statements, so the in-process writer
  lock (:meth:`leadgate.database.db.Database.tx`) is held for microseconds;
* waiting for another *process* that holds SQLite's write lock must not block the loop:
  the connection has ``busy_timeout = 0`` and ``BEGIN IMMEDIATE`` is retried with
  ``asyncio.sleep`` back-off instead (up to the same 30 s other connections wait);
* group commit: transactions that start in the same event-loop iteration share one
  SQLite transaction and one COMMIT at the start of the next iteration; each caller
  returns only after that COMMIT. Under load this saves most of a commit's cost (about
  100 us of WAL writes) per turn. A failing one rolls back alone: its writes are undone
  by rolling the SQLite transaction back and running the writes of the members kept so
  far again (recorded as they ran; see :meth:`InlineSqlite.leave`), which costs nothing
  until a member fails, where a SAVEPOINT per member cost 8% of a plain turn. When that
  undo fails (the ROLLBACK meets an I/O error, the redo cannot run), the whole group
  fails instead, nothing of it committed: the failed member's writes would otherwise
  have been committed with the others' (kept members that only read are answered all
  the same: their reads stand);
* WAL checkpoints (which fsync) never run on the loop: ``wal_autocheckpoint = 0`` here and
  :class:`InlineSqlite` runs checkpoints in a worker thread every
  :data:`CHECKPOINT_EVERY` commits: a passive one, then a restart of the WAL, which
  keeps it bounded (see :meth:`InlineSqlite._checkpoint_wal`).

Core SELECT, INSERT, UPDATE and DELETE (with RETURNING), ``text()`` and executemany are
supported (compilation: :mod:`leadgate.database.plans`); results offer
``first``/``one``/``one_or_none``/``all``/``scalar``/``scalars`` and ``rowcount`` like
SQLAlchemy's, with real :class:`sqlalchemy.engine.Row` rows. Errors are raised as
SQLAlchemy's DBAPI exceptions (``IntegrityError`` ...), as on the async engine.

Reads run on a small pool of read-only connections (:class:`InlineReaders`), each in its
own deferred transaction (a consistent WAL snapshot), also on the loop's thread: WAL
readers never wait for the writer. They can meet SQLITE_BUSY only while this process
holds no connection to the file (:meth:`InlineReaders.open`), and wait out that one the
same way.
"""

from __future__ import annotations

import asyncio
import itertools
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect

from leadgate.database.plans import PlanCache, Result

#: For callers that name the result class of this driver.
InlineResult = Result

#: Default total time ``BEGIN IMMEDIATE`` waits for another process's write lock.
BUSY_WAIT_S = 30.0
#: WAL checkpoint (in a worker thread) after this many inline commits.
CHECKPOINT_EVERY = 500
#: How long a checkpoint's WAL restart waits for the writer and for readers.
RESTART_WAIT_MS = 50
#: The WAL file is truncated to this size when it restarts (after a burst grew it).
WAL_SIZE_LIMIT = 64 * 1024 * 1024


_SERIALS = itertools.count()


#: One write statement as run: (SQL, arguments, whether executemany).
Write = tuple[str, Any, bool]


class InlineConnection:
    """One ``sqlite3`` connection executing SQLAlchemy Core statements inline.

    Not thread-safe and not for concurrent transactions: :class:`leadgate.database.db.Database`
    hands it out under its writer lock (write transactions) or one reader at a time.
    """

    def __init__(
        self,
        path: str,
        dialect: Dialect,
        *,
        readonly: bool = False,
        busy_wait_s: float = BUSY_WAIT_S,
    ) -> None:
        self.dialect = dialect
        self.busy_wait_s = busy_wait_s
        self.info: dict[Any, Any] = {}
        self._nested = 0
        self._raw = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        pragmas = [
            "PRAGMA busy_timeout=0",
            "PRAGMA wal_autocheckpoint=0",
            "PRAGMA foreign_keys=ON",
            # The statement journal of savepoints (nested blocks; every group-commit
            # member ran in one until session 22) in memory: by default SQLite spills it
            # past 64 KiB to a temp file in /var/tmp, and a group of ten members wrote
            # ~200 pages there per lifecycle (pwrite64 was 13% of the service's CPU). It
            # only serves ROLLBACK TO inside a live transaction; the WAL alone makes a
            # commit durable.
            "PRAGMA temp_store=MEMORY",
        ]
        if readonly:
            pragmas.append("PRAGMA query_only=ON")
        else:
            pragmas[:0] = [
                "PRAGMA journal_mode=WAL",
                "PRAGMA synchronous=NORMAL",
                f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}",
            ]
        # One cursor for every statement: Connection.execute makes a cursor per call
        # (and registers a weak reference to it); statements here run one at a time and
        # are read to the end before the next.
        self._cur = self._raw.cursor()
        try:
            for pragma in pragmas:
                self._cur.execute(pragma)
        except BaseException:
            # Nobody holds this object when __init__ raises: the file would stay open
            # until the garbage collector found it (a file that is not a database, a
            # full disk or an I/O error at startup, met again on every read).
            self._raw.close()
            raise
        #: the error of a :meth:`begin_nested` block's undo that failed (see there)
        self.undo_failed: BaseException | None = None
        self._plans = PlanCache(dialect)
        #: writes through this connection by table, and of anything (``text()`` DML,
        #: rollbacks): see :meth:`cache_token`
        self._table_writes: dict[str, int] = {}
        self._any_writes = 0
        #: the two counts as they stood when the open transaction began (everything
        #: written before it had been committed or rolled back): see :meth:`committed_token`
        self._writes_at_begin: tuple[int, dict[str, int]] = (0, {})
        # data_version compares only between calls on one connection: a token names it.
        self._serial = next(_SERIALS)
        #: ``PRAGMA data_version`` as first read in the open BEGIN IMMEDIATE transaction
        #: (None: not read yet, or no such transaction): see :meth:`_data_version`
        self._held_version: int | None = None
        self._holding = False
        #: the writes of the open group member, recorded while set (see :meth:`begin_again`)
        self._log: list[Write] | None = None

    # ---------------------------------------------------------------- transactions

    async def begin_immediate(self) -> None:
        """``BEGIN IMMEDIATE``; while another process writes, wait without blocking."""
        busy: _Busy | None = None
        while True:
            try:
                self._cur.execute("BEGIN IMMEDIATE")
                self._writes_at_begin = (self._any_writes, dict(self._table_writes))
                self._began_writing()
                return
            except sqlite3.OperationalError as exc:
                busy = busy or _Busy(self.busy_wait_s)
                await busy.wait(exc, "BEGIN IMMEDIATE")

    def begin_read(self) -> None:
        """``BEGIN`` (deferred): the read snapshot starts at the first statement."""
        self._cur.execute("BEGIN")
        self._writes_at_begin = (self._any_writes, dict(self._table_writes))
        self._holding = False

    async def begin_snapshot(self) -> None:
        """``BEGIN`` with the read snapshot taken now, SQLITE_BUSY waited out without
        blocking (see :meth:`InlineReaders.open`)."""
        busy: _Busy | None = None
        while True:
            self.begin_read()
            try:
                self._cur.execute("PRAGMA schema_version")
                return
            except sqlite3.OperationalError as exc:
                self.rollback()
                busy = busy or _Busy(self.busy_wait_s)
                await busy.wait(exc, "PRAGMA schema_version")

    def _began_writing(self) -> None:
        # This connection holds SQLite's write lock until the transaction ends: see
        # _data_version.
        self._held_version = None
        self._holding = True

    def commit(self) -> None:
        """Commit the open transaction."""
        self._holding = False
        try:
            self._cur.execute("COMMIT")
        except sqlite3.Error as exc:
            raise _wrap(exc, "COMMIT", ()) from exc

    @property
    def in_transaction(self) -> bool:
        """Whether a transaction is open."""
        return self._raw.in_transaction

    def cache_token(self, tables: Sequence[str]) -> object | None:
        """A value that is equal on two calls only if no row of ``tables`` can have
        changed in between: no commit by any other connection (``PRAGMA data_version``),
        no write to them through this one, no rollback here. Taken inside a write
        transaction (which no other connection can commit beside), it says whether
        what was read of ``tables`` under an equal token may be used again."""
        version = self._data_version()
        writes = self._table_writes
        return (self._serial, version, self._any_writes, *(writes.get(t, 0) for t in tables))

    def committed_token(self, tables: Sequence[str]) -> object | None:
        """Like :meth:`cache_token`, for reads made on *another* connection (a reader)
        after the call: it counts this connection's writes to ``tables`` only once they
        are committed, so a reader's snapshot taken after the call has seen every write
        it counts. A write still in the open transaction (not visible to readers) leaves
        it unchanged until the COMMIT; a commit by any other connection changes it. Safe
        outside a transaction too (``PRAGMA data_version`` then reads the WAL's header).
        """
        version = self._data_version()
        if self._raw.in_transaction:
            any_writes, writes = self._writes_at_begin
        else:  # every write so far has been committed or rolled back
            any_writes, writes = self._any_writes, self._table_writes
        return (self._serial, version, any_writes, *(writes.get(t, 0) for t in tables))

    def _data_version(self) -> int:
        """``PRAGMA data_version``, read once per write transaction: while this
        connection holds SQLite's write lock (from BEGIN IMMEDIATE to its end) no other
        connection can commit, so the value cannot change. Under group commit a write
        transaction holds many of ours, each taking a token."""
        if self._holding and self._raw.in_transaction:
            if self._held_version is None:
                self._held_version = self._cur.execute("PRAGMA data_version").fetchone()[0]
            return self._held_version
        version: int = self._cur.execute("PRAGMA data_version").fetchone()[0]
        return version

    def forget_reads(self) -> None:
        """What was read in the transaction may be gone (SQLite ended it by itself):
        no earlier :meth:`cache_token` equals the next one."""
        self._any_writes += 1

    def _wrote(self, table: str) -> None:
        if table == "*":
            self._any_writes += 1
        else:
            self._table_writes[table] = self._table_writes.get(table, 0) + 1

    def rollback(self) -> None:
        """Roll back the open transaction (no-op when none is open)."""
        self._any_writes += 1  # what was read since may be gone
        self._holding = False
        if self._raw.in_transaction:
            self._cur.execute("ROLLBACK")

    def savepoint(self, name: str) -> None:
        """``SAVEPOINT name`` (outside a transaction it begins one)."""
        if not self._raw.in_transaction:
            self._writes_at_begin = (self._any_writes, dict(self._table_writes))
            self._holding = False  # a deferred transaction: others may commit beside it
        self._cur.execute(f"SAVEPOINT {name}")

    def release(self, name: str) -> None:
        """``RELEASE name``: keep what was done since the savepoint."""
        try:
            self._cur.execute(f"RELEASE {name}")
        except sqlite3.Error as exc:
            raise _wrap(exc, f"RELEASE {name}", ()) from exc

    def rollback_to(self, name: str) -> None:
        """Undo what was done since the savepoint and drop it (no-op when the whole
        transaction is already gone, as after some I/O errors)."""
        self._any_writes += 1  # what was read since may be gone
        if self._raw.in_transaction:
            sql = f"ROLLBACK TO {name}"
            try:
                self._cur.execute(sql)
                sql = f"RELEASE {name}"
                self._cur.execute(sql)
            except sqlite3.Error as exc:
                raise _wrap(exc, sql, ()) from exc

    @asynccontextmanager
    async def begin_nested(self) -> AsyncIterator[None]:
        """A SAVEPOINT inside the open transaction: an error in the block undoes the
        block's writes alone (and propagates). When that undo fails, its error
        propagates instead and is kept in :attr:`undo_failed`: the block's writes are
        still in the transaction, which then fails whole whatever the caller made of the
        error (``Database.tx`` raises it at the end of the block)."""
        self._nested += 1
        name = f"lg_nested_{self._nested}"
        self.savepoint(name)
        log = self._log
        mark = len(log) if log is not None else 0
        try:
            yield
        except BaseException:
            try:
                self.rollback_to(name)
            except BaseException as failed:
                self.undo_failed = failed
                raise
            if log is not None:
                del log[mark:]  # undone: not the member's work any more
            raise
        else:
            self.release(name)
        finally:
            self._nested -= 1

    def record(self, log: list[Write] | None) -> None:
        """Append every write statement run from now on to ``log`` (None: stop)."""
        self._log = log

    def rollback_for_again(self) -> int:
        """Roll back the open write transaction for :meth:`begin_again`; returns the
        ``PRAGMA data_version`` it began on (read before the ROLLBACK, while no other
        connection can have committed since the BEGIN)."""
        version = self._data_version()
        self.rollback()
        return version

    def begin_again(self, logs: Sequence[list[Write]], version: int) -> None:
        """``BEGIN IMMEDIATE`` without waiting (SQLITE_BUSY raises), then run ``logs``'
        statements again, in order: the transaction as it stood after them.

        Sound because the new transaction begins on the database the rolled-back one
        began on (``version``, from :meth:`rollback_for_again`: if another connection
        committed in between, this raises instead), and the statements compute from the
        database alone: ids and times are parameters, and no statement calls
        ``random()`` or a clock.

        :meth:`committed_token`'s counts stay those of the first BEGIN: the writes run
        again were counted when they first ran, and until the COMMIT a reader has seen
        none of them."""
        try:
            self._cur.execute("BEGIN IMMEDIATE")
            self._began_writing()
            now = self._data_version()
        except sqlite3.Error as exc:
            raise _wrap(exc, "BEGIN IMMEDIATE", ()) from exc
        if now != version:
            raise _wrap(
                sqlite3.OperationalError("another connection committed before the redo"),
                "BEGIN IMMEDIATE",
                (),
            )
        for log in logs:
            for sql, args, many in log:
                try:
                    if many:
                        self._cur.executemany(sql, args)
                    else:
                        self._cur.execute(sql, args)
                except sqlite3.Error as exc:
                    raise _wrap(exc, sql, args) from exc

    def close(self) -> None:
        """Close the underlying connection."""
        self._raw.close()

    def set_trace(self, callback: Callable[[str], None] | None) -> None:
        """Call ``callback`` with every SQL statement run here (None: stop)."""
        self._raw.set_trace_callback(callback)

    # ------------------------------------------------------------------ statements

    async def execute(
        self,
        statement: sa.Executable,
        parameters: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    ) -> Result:
        """Run ``statement`` with ``parameters`` (a list of them: executemany); rows are
        fetched at once."""
        if parameters is not None and not isinstance(parameters, Mapping):
            return self.run_many(statement, parameters)
        return self.run(statement, parameters)

    async def scalar(
        self, statement: sa.Executable, parameters: Mapping[str, Any] | None = None
    ) -> Any:
        """The first column of the first row, or None."""
        return self.run(statement, parameters).scalar()

    def run(self, statement: sa.Executable, parameters: Mapping[str, Any] | None = None) -> Result:
        """Synchronous :meth:`execute` of one parameter set."""
        params: Mapping[str, Any] = parameters or {}
        plan, extracted = self._plans.plan(statement, frozenset(params))
        sql, args = plan.args(params, extracted)
        if plan.writes is not None:
            self._wrote(plan.writes)
        try:
            cursor = self._cur.execute(sql, args)
            description = cursor.description
            raw_rows = cursor.fetchall() if description else []
        except sqlite3.Error as exc:
            raise _wrap(exc, sql, args) from exc
        if plan.writes is not None and self._log is not None:
            # A write that changed no row (a fenced update that lost, an INSERT OR
            # IGNORE that ignored) leaves nothing to run again (no row changed, so no
            # trigger fired). Recorded whenever the count is not sure: -1 (not a row
            # write) or rows from a statement the plan does not know as RETURNING.
            if plan.returning:
                changed = len(raw_rows)
            else:
                changed = cursor.rowcount if description is None else -1
            if changed != 0:
                self._log.append((sql, args, False))
        rows = plan.rows(raw_rows, lambda: [d[0] for d in description])
        # With RETURNING, the rows returned are the rows changed.
        return Result(rows, len(rows) if plan.returning else cursor.rowcount)

    def run_many(self, statement: sa.Executable, parameters: Sequence[Mapping[str, Any]]) -> Result:
        """executemany: one statement, many parameter sets (no rows returned)."""
        if not parameters:
            return Result([], 0)
        plan, extracted = self._plans.plan(statement, frozenset(parameters[0]))
        if plan.keys is not None or plan.compiled is not None:
            raise TypeError("executemany runs no RETURNING and no expanding IN statements")
        sql = plan.sql
        batch = [plan.args(p, extracted)[1] for p in parameters]
        if plan.writes is not None:
            self._wrote(plan.writes)
        try:
            cursor = self._cur.executemany(sql, batch)
        except sqlite3.Error as exc:
            raise _wrap(exc, sql, batch[:1]) from exc
        if self._log is not None and cursor.rowcount != 0:
            self._log.append((sql, batch, True))
        return Result([], cursor.rowcount)


class _Busy:
    """SQLITE_BUSY waited out on the event loop: ``asyncio.sleep`` from 1 ms, doubling
    to 50 ms, until ``wait_s`` from the first one (the connections have
    ``busy_timeout = 0``: SQLite's own busy handler would sleep on the loop's thread)."""

    __slots__ = ("deadline", "delay")

    def __init__(self, wait_s: float) -> None:
        self.deadline = time.monotonic() + wait_s
        self.delay = 0.001

    async def wait(self, exc: sqlite3.OperationalError, sql: str) -> None:
        """Sleep before the next try; raise ``exc`` (as SQLAlchemy's) when it is not
        SQLITE_BUSY or the time is up."""
        busy = exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY  # extended codes too
        if not busy or time.monotonic() > self.deadline:
            raise _wrap(exc, sql, ()) from exc
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, 0.05)


def _wrap(exc: sqlite3.Error, sql: str, args: Any) -> sa.exc.DBAPIError:
    """The SQLAlchemy exception the async engine would have raised for ``exc`` (its
    parameters hidden, as the engine's are: they are what clients sent, message text,
    and this exception's text reaches logs and tracebacks)."""
    cls: type[sa.exc.DBAPIError] = sa.exc.DBAPIError
    if isinstance(exc, sqlite3.IntegrityError):
        cls = sa.exc.IntegrityError
    elif isinstance(exc, sqlite3.OperationalError):
        cls = sa.exc.OperationalError
    return cls(sql, args, exc, hide_parameters=True)


class _Group:
    """One SQLite transaction shared by the transactions of one loop iteration."""

    __slots__ = (
        "broken",
        "closing",
        "committed",
        "kept",
        "lock",
        "logs",
        "members",
        "pending",
        "waiters",
    )

    def __init__(self, lock: asyncio.Lock) -> None:
        self.lock = lock  # the writer lock, held by the group until it commits
        # One future per member that finished its body: cancelling one member must not
        # cancel the others' wait (a shared future would be cancelled with it).
        self.waiters: list[asyncio.Future[None]] = []
        self.committed: asyncio.Event = asyncio.Event()
        self.members = asyncio.Lock()  # one member body at a time
        self.pending = 0  # members that joined and have not finished their body
        # The writes of each member whose work is in the transaction, in order: a
        # member that fails rolls the transaction back and these run again (members
        # take no SAVEPOINT: see InlineSqlite.enter).
        self.logs: list[list[Write]] = []
        #: the waiters (see ``waiters``) of those members, in the same order
        self.kept: list[asyncio.Future[None]] = []
        self.closing = False  # commit requested while a member was still inside
        # Set when SQLite rolled back the whole transaction under the group (a conflict
        # clause such as OR ROLLBACK, disk full, I/O error): the work of every member is
        # gone, so each of them fails with this error, and nobody joins any more.
        self.broken: BaseException | None = None


@dataclass(frozen=True, slots=True)
class Member:
    """One transaction's place in a group (see :meth:`InlineSqlite.enter`) and the
    writes it ran."""

    group: _Group
    log: list[Write]


class InlineSqlite:
    """The process's inline connection to one SQLite file: group commit and the WAL
    checkpointer."""

    def __init__(self, path: str, dialect: Dialect, *, busy_wait_s: float = BUSY_WAIT_S) -> None:
        self.path = path
        self.dialect = dialect
        self.busy_wait_s = busy_wait_s
        self._conn: InlineConnection | None = None
        self._group: _Group | None = None
        self._commits = 0
        self._checkpoint: asyncio.Future[None] | None = None

    @property
    def connection(self) -> InlineConnection:
        """The connection, opened on first use."""
        if self._conn is None:
            self._conn = InlineConnection(self.path, self.dialect, busy_wait_s=self.busy_wait_s)
        return self._conn

    def committed_token(self, tables: Sequence[str]) -> object | None:
        """:meth:`InlineConnection.committed_token` of the writer; None before it is
        opened (or after :meth:`close`): nothing can be known then."""
        return None if self._conn is None else self._conn.committed_token(tables)

    async def enter(self, lock: asyncio.Lock, wait_s: float) -> Member:
        """Start a transaction: join this iteration's group (opening one, under the
        process's writer ``lock``, when there is none), then take the group's member slot
        and record the member's writes. End it with :meth:`leave`.

        A group holds ``lock`` from before ``BEGIN IMMEDIATE`` until after ``COMMIT``, so
        the process's other writers queue behind the whole group. Waiting (for ``lock``
        or the member slot) ends with :class:`TimeoutError` after ``wait_s``.
        """
        group = self._group
        if group is not None and group.pending == 0:
            # Joining an open group with nobody inside or queued: the slot is free, so
            # no timer for the bound (under load most transactions; see bench.tx_cost).
            return await self._enter(lock)
        async with asyncio.timeout(wait_s):
            return await self._enter(lock)

    async def _enter(self, lock: asyncio.Lock) -> Member:
        group = self._group
        if group is None:
            await lock.acquire()
            try:
                # The connection is taken once the lock is held: the group before may
                # have closed it while this waited (:meth:`_end_uncommitted`). Opening
                # one may fail (an I/O error), the lock held.
                conn = self.connection
                await conn.begin_immediate()
            except BaseException:
                lock.release()
                raise
            group = self._group = _Group(lock)
            # Runs after every callback already queued for this iteration: the
            # transactions those start join the group first.
            asyncio.get_running_loop().call_soon(self._commit, group)
        else:
            # The group's own connection: only a group that broke (then this one raises
            # below) or its COMMIT (after this one's turn) closes it.
            conn = self.connection
        group.pending += 1
        try:
            await group.members.acquire()
        except BaseException:
            self._done_with(group)
            raise
        if group.broken is not None:
            group.members.release()
            self._done_with(group)
            raise group.broken
        try:
            if not conn.in_transaction:
                # The members before failed and rolled it back with nothing kept.
                await conn.begin_immediate()
        except BaseException:
            group.members.release()
            self._done_with(group)
            raise
        # No SAVEPOINT: one costs a copy of every page the member then writes (SQLite's
        # statement journal), 8% of a plain turn's instructions (bench.instructions),
        # for the rare member that fails. Its writes are recorded instead: a member
        # that fails rolls the transaction back and the kept members' writes run again.
        log: list[Write] = []
        conn.record(log)
        return Member(group, log)

    def leave(self, member: Member, *, ok: bool) -> asyncio.Future[None] | None:
        """End :meth:`enter`'s transaction: keep its work (``ok``) or roll it back alone
        (the SQLite transaction rolled back, then begun again with the writes of the
        members kept so far run once more: :meth:`InlineConnection.begin_again`; a
        member that wrote nothing has nothing to roll back; if that cannot be done, the
        whole group fails: :meth:`_break`).
        Returns the future that completes once the group committed (with the commit's
        error if it failed): await it before reporting success. A member that failed
        awaits it too before reporting its error: it may have failed on what another
        member of the group wrote (a fenced update that lost to it), and whoever reads
        next must see that write."""
        group = member.group
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        group.waiters.append(waiter)
        conn = self.connection
        conn.record(None)
        try:
            if ok:
                if conn.in_transaction:
                    group.logs.append(member.log)
                    group.kept.append(waiter)
                elif group.broken is None:
                    self._break(group)  # SQLite ended the transaction under the body
            elif group.broken is None and (member.log or not conn.in_transaction):
                # A member that wrote nothing (it failed on a read: an unknown or
                # inactive agent, a request refused before its first write) left the
                # transaction as the members before it left it: nothing to undo, and the
                # kept members' writes are not run again.
                self._undo(group)
        finally:
            group.members.release()
            self._done_with(group)
        return waiter

    def _undo(self, group: _Group) -> None:
        """A member failed: undo its writes alone (see :meth:`leave`). When that fails,
        the whole group fails (:meth:`_break`), except the kept members that only read:
        they are answered (their reads stand)."""
        conn = self.connection
        # Whether a kept member changed a row. Members that only read (or whose writes
        # changed nothing: a fenced update that lost) left nothing to run again: their
        # results came from what the database held, not from the failed member's writes
        # (it ran after them).
        kept_writes = any(group.logs)
        if kept_writes and not conn.in_transaction:
            # SQLite ended the transaction under the member (a conflict clause, an I/O
            # error) and let go of its write lock: the kept work is gone, and another
            # connection may have committed since, so it cannot be redone.
            self._break(group)
            return
        try:
            if not kept_writes:
                # Nothing kept to lose: undo this member's work (a no-op if SQLite has
                # ended the transaction); the next member, if any, begins anew (a redo
                # would begin again without waiting and on the same database version,
                # and fail the group for nothing when another process wrote meanwhile).
                conn.rollback()
            else:
                conn.begin_again(group.logs, conn.rollback_for_again())
        except BaseException as exc:
            # A ROLLBACK that failed (an I/O error) left this member's writes in the
            # transaction; a redo that failed (BUSY, a commit in between, a statement)
            # left part of the kept ones. The members after would carry on in it and
            # COMMIT them: a failed member's writes stored, a kept member's half lost.
            if not kept_writes:
                # Every kept member only read: nothing of theirs is lost with the
                # transaction, and what they read was the database as it stood, so
                # they are answered now (they were told the group failed, a 503 for
                # a request that had been served).
                self._answer_kept(group)
            self._break(group, exc)
            if not isinstance(exc, Exception):
                raise

    @staticmethod
    def _answer_kept(group: _Group) -> None:
        """Tell the kept members of ``group`` (which only read) that they succeeded,
        ahead of the group's end."""
        for waiter in group.kept:
            if not waiter.done():
                waiter.set_result(None)
        group.kept.clear()
        group.logs.clear()

    def _break(self, group: _Group, cause: BaseException | None = None) -> None:
        """Fail the whole group (see :attr:`_Group.broken`): SQLite ended its transaction
        by itself, or (``cause``) a failed member's writes could not be undone alone;
        that transaction, if still open, is ended here (:meth:`_end_uncommitted`). New
        transactions queue on the writer lock for a new one."""
        conn = self.connection
        conn.forget_reads()
        if cause is None:
            why = "SQLite rolled back the whole transaction (a conflict clause or an I/O error)"
        else:
            why = (
                "rolled back the whole transaction: a failed member's writes could not be"
                " undone alone (its ROLLBACK, or the redo of the kept members' writes, failed)"
            )
        group.broken = _wrap(sqlite3.OperationalError(why), "COMMIT", ())
        group.broken.__cause__ = cause
        if self._group is group:
            self._group = None
        if conn.in_transaction:
            self._end_uncommitted(conn)

    def _done_with(self, group: _Group) -> None:
        group.pending -= 1
        if group.closing and group.pending == 0:
            self._commit(group)

    def _commit(self, group: _Group) -> None:
        if self._group is group:
            self._group = None  # later transactions start a new group
        if group.pending:
            group.closing = True  # the last member to finish commits
            return
        if group.committed.is_set():
            return
        # (Not the property: a broken group may have closed the connection, see _break,
        # and opening another here could fail with the writer lock still held.)
        conn = self._conn
        error: BaseException | None = group.broken
        try:
            # conn.in_transaction is false when every member rolled back.
            if error is None and conn is not None and conn.in_transaction:
                # On the loop's thread on purpose: a committer thread cost 15-17% more
                # CPU per lifecycle, whose small groups each paid the hand-off (README,
                # "Group commit").
                conn.commit()
        except BaseException as exc:
            # SQLite answers COMMIT with an error only for a transaction it did not
            # commit (no answer can be lost on the way: it runs in this process), so
            # every member is told the plain failure, never one in doubt.
            error = exc
            if conn is not None:
                self._end_uncommitted(conn)
        else:
            if error is None:
                self._committed(group.lock)
        finally:
            group.committed.set()
            group.lock.release()
        for waiter in group.waiters:
            if waiter.done():
                continue  # its member was cancelled
            if error is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(error)

    def _end_uncommitted(self, conn: InlineConnection) -> None:
        """End, without its writes, a transaction whose COMMIT failed or whose group
        broke (:meth:`_break`). A ROLLBACK that fails (an I/O error) leaves the
        transaction open, holding the write lock with the members' writes in it: a later
        COMMIT would land what the members were told failed, and every BEGIN in between
        fails ("within a transaction"). The connection is closed then (SQLite rolls back
        a transaction open at close) and the next transaction opens a new one."""
        try:
            conn.rollback()
        except Exception:
            if self._conn is conn:
                self._conn = None
            try:
                conn.close()
            except Exception:
                pass  # (then collected, which closes it too)

    def _committed(self, lock: asyncio.Lock) -> None:
        """Count a commit; every :data:`CHECKPOINT_EVERY`, checkpoint (see
        :meth:`_checkpoint_wal`). ``lock`` is the process's writer lock."""
        self._commits += 1
        if self._commits % CHECKPOINT_EVERY == 0 and (
            self._checkpoint is None or self._checkpoint.done()
        ):
            self._checkpoint = asyncio.ensure_future(self._checkpoint_wal(lock))

    async def _checkpoint_wal(self, lock: asyncio.Lock) -> None:
        """Copy the WAL into the database beside the writer (a passive checkpoint in a
        worker thread), then restart the WAL while this process's writers wait on
        ``lock`` (in a worker thread too: the loop keeps serving).

        The restart is what keeps the WAL bounded. SQLite restarts the log only when a
        write transaction begins with every frame checkpointed and no reader in the WAL,
        and a passive checkpoint beside a busy writer never leaves it so (the writer
        appends while it copies); with ``wal_autocheckpoint = 0`` here nothing else did:
        under 16 clients the WAL grew by ~35 MB/s (1.5 GB after 40 s for a 31 MB
        database), and every page read searched its ever longer index (a plain turn
        cost 0.39 ms of CPU in the first 4 s, 0.56 ms by the 16th). SQLite's own wait
        for the writer lock (a sleeping busy handler) almost never found a hot writer's
        lock free; taking the writer lock here does. After the passive pass there is
        little left to copy, so writers wait briefly; readers on older snapshots and
        other processes are waited for up to :data:`RESTART_WAIT_MS`, after which the
        restart gives up (SQLITE_BUSY) and the next checkpoint tries again.
        """
        await asyncio.to_thread(self._run_checkpoint)
        async with lock:
            await asyncio.to_thread(self._run_restart)

    def _run_checkpoint(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=0)
        try:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error:
            pass  # busy: the next one (or another connection's autocheckpoint) catches up
        finally:
            conn.close()

    def _run_restart(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=RESTART_WAIT_MS / 1000)
        try:
            conn.execute("PRAGMA wal_checkpoint(RESTART)")
        except sqlite3.Error:
            pass  # busy (a reader, another process): the next checkpoint tries again
        finally:
            conn.close()

    async def close(self) -> None:
        """Wait for an open group and a running checkpoint, then close the connection."""
        if self._group is not None:
            await self._group.committed.wait()
        if self._checkpoint is not None:
            try:
                await self._checkpoint
            except Exception:
                pass  # a failed checkpoint must not fail shutdown
            self._checkpoint = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class InlineReaders:
    """Read-only inline connections to one SQLite file, one per concurrent reader.

    A read transaction takes a connection for its duration (``BEGIN`` ... ``COMMIT``: one
    WAL snapshot for all its statements) and gives it back; connections are opened on
    demand and at most :attr:`keep` idle ones are kept.
    """

    def __init__(
        self, path: str, dialect: Dialect, *, keep: int = 8, busy_wait_s: float = BUSY_WAIT_S
    ) -> None:
        self.path = path
        self.dialect = dialect
        self.keep = keep
        self.busy_wait_s = busy_wait_s
        self._idle: list[InlineConnection] = []
        self._trace: Callable[[str], None] | None = None

    def take(self) -> InlineConnection | None:
        """An idle connection with a read transaction begun; None when none is idle
        (then :meth:`open` one)."""
        if not self._idle:
            return None
        conn = self._idle.pop()
        conn.set_trace(self._trace)
        conn.begin_read()
        return conn

    async def open(self) -> InlineConnection:
        """A new connection with a read transaction begun and its snapshot taken.

        A WAL reader meets SQLITE_BUSY in two moments only: while another process closes
        the file's last connection (it checkpoints and deletes the WAL under an exclusive
        lock) and while one opens the first (it rebuilds the WAL index). Neither can
        happen while this process holds a connection open, and an idle reader is one, so
        only here: when this process has none, e.g. each ``leadgate`` command (several
        commands at once failed one read in twenty with "database is locked"). Readers
        have ``busy_timeout = 0`` (SQLite's busy handler sleeps on the event loop), so
        the snapshot is taken here, retried with ``asyncio.sleep`` back-off for up to
        :attr:`busy_wait_s`, as :meth:`InlineConnection.begin_immediate` is.
        """
        conn = InlineConnection(
            self.path, self.dialect, readonly=True, busy_wait_s=self.busy_wait_s
        )
        try:
            await conn.begin_snapshot()
        except BaseException:
            conn.close()
            raise
        # Traced from here: the statements of the caller's transaction.
        conn.set_trace(self._trace)
        return conn

    def give(self, conn: InlineConnection) -> None:
        """End the read transaction and keep (or close) the connection."""
        try:
            conn.rollback()  # nothing to keep: a read-only transaction
        except Exception:
            conn.close()
            return
        conn.info.clear()
        if len(self._idle) < self.keep:
            self._idle.append(conn)
        else:
            conn.close()

    def set_trace(self, callback: Callable[[str], None] | None) -> None:
        """Trace every reader's statements (tests; see Database.record_statements)."""
        self._trace = callback

    def close(self) -> None:
        """Close every idle connection."""
        while self._idle:
            self._idle.pop().close()
