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
  SQLite transaction, each in its own SAVEPOINT (a failing one rolls back alone), and one
  COMMIT at the start of the next iteration; each caller returns only after that COMMIT.
  Under load this saves most of a commit's cost (about 100 us of WAL writes) per turn;
* WAL checkpoints (which fsync) never run on the loop: ``wal_autocheckpoint = 0`` here and
  :class:`InlineSqlite` runs passive checkpoints in a worker thread every
  :data:`CHECKPOINT_EVERY` commits.

Only what the turn path needs is supported: SELECT, INSERT, UPDATE and DELETE without
RETURNING; results offer ``first``/``one``/``one_or_none``/``all``/``scalar`` and
``rowcount`` like SQLAlchemy's, with real :class:`sqlalchemy.engine.Row` rows. Errors are
raised as SQLAlchemy's DBAPI exceptions (``IntegrityError`` ...), as on the async engine.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect, Row
from sqlalchemy.engine.result import result_tuple

#: Default total time ``BEGIN IMMEDIATE`` waits for another process's write lock.
BUSY_WAIT_S = 30.0
#: Passive WAL checkpoint (in a worker thread) after this many inline commits.
CHECKPOINT_EVERY = 500

_Processor = Callable[[Any], Any] | None


@dataclass(slots=True)
class _Plan:
    """A statement compiled for a given set of parameter names."""

    sql: str
    names: tuple[str, ...]
    processors: tuple[_Processor, ...]
    defaults: Mapping[str, Any]
    # Set when the caller supplies an expanding (IN) parameter: the SQL depends on its
    # length, so it is expanded per call.
    compiled: Any | None
    bind_processors: Mapping[str, _Processor]
    result_processors: tuple[_Processor, ...] | None
    # Row class for the result columns, made on the first execution.
    make_row: Callable[[Sequence[Any]], Row[Any]] | None = None


class InlineResult:
    """The rows (already fetched) and rowcount of one statement."""

    __slots__ = ("_rows", "rowcount")

    def __init__(self, rows: list[Row[Any]], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    def first(self) -> Row[Any] | None:
        """The first row, or None."""
        return self._rows[0] if self._rows else None

    def one(self) -> Row[Any]:
        """Exactly one row (``NoResultFound``/``MultipleResultsFound`` otherwise)."""
        if not self._rows:
            raise sa.exc.NoResultFound("No row was found when one was required")
        if len(self._rows) > 1:
            raise sa.exc.MultipleResultsFound("Multiple rows were found when one was required")
        return self._rows[0]

    def one_or_none(self) -> Row[Any] | None:
        """One row, None for none (``MultipleResultsFound`` for more)."""
        if len(self._rows) > 1:
            raise sa.exc.MultipleResultsFound("Multiple rows were found when one or none was")
        return self.first()

    def all(self) -> Sequence[Row[Any]]:
        """Every row."""
        return self._rows

    def scalar(self) -> Any:
        """The first column of the first row, or None."""
        return self._rows[0][0] if self._rows else None

    def __iter__(self) -> Iterator[Row[Any]]:
        return iter(self._rows)


class InlineConnection:
    """One ``sqlite3`` connection executing SQLAlchemy Core statements inline.

    Not thread-safe and not for concurrent transactions: :class:`leadgate.database.db.Database`
    hands it out under its writer lock only.
    """

    def __init__(self, path: str, dialect: Dialect, *, busy_wait_s: float = BUSY_WAIT_S) -> None:
        self.dialect = dialect
        self.busy_wait_s = busy_wait_s
        self.info: dict[Any, Any] = {}
        self._raw = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        for pragma in (
            "PRAGMA journal_mode=WAL",
            "PRAGMA synchronous=NORMAL",
            "PRAGMA busy_timeout=0",
            "PRAGMA wal_autocheckpoint=0",
            "PRAGMA foreign_keys=ON",
        ):
            self._raw.execute(pragma)
        # Plans by id() of the statement object (a WeakKeyDictionary lookup costs more
        # than running a small statement); a weak reference drops the entry when a
        # transient statement is collected, before its id can be reused.
        self._plans: dict[int, tuple[weakref.ref[Any], dict[frozenset[str], _Plan]]] = {}

    # ---------------------------------------------------------------- transactions

    async def begin_immediate(self) -> None:
        """``BEGIN IMMEDIATE``; while another process writes, wait without blocking."""
        delay = 0.001
        deadline = time.monotonic() + self.busy_wait_s
        while True:
            try:
                self._raw.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                busy = exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY  # extended codes too
                if not busy or time.monotonic() > deadline:
                    raise _wrap(exc, "BEGIN IMMEDIATE", ()) from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    def commit(self) -> None:
        """Commit the open transaction."""
        try:
            self._raw.execute("COMMIT")
        except sqlite3.Error as exc:
            raise _wrap(exc, "COMMIT", ()) from exc

    @property
    def in_transaction(self) -> bool:
        """Whether a transaction is open."""
        return self._raw.in_transaction

    def rollback(self) -> None:
        """Roll back the open transaction (no-op when none is open)."""
        if self._raw.in_transaction:
            self._raw.execute("ROLLBACK")

    def savepoint(self, name: str) -> None:
        """``SAVEPOINT name``."""
        self._raw.execute(f"SAVEPOINT {name}")

    def release(self, name: str) -> None:
        """``RELEASE name``: keep what was done since the savepoint."""
        try:
            self._raw.execute(f"RELEASE {name}")
        except sqlite3.Error as exc:
            raise _wrap(exc, f"RELEASE {name}", ()) from exc

    def rollback_to(self, name: str) -> None:
        """Undo what was done since the savepoint and drop it (no-op when the whole
        transaction is already gone, as after some I/O errors)."""
        if self._raw.in_transaction:
            self._raw.execute(f"ROLLBACK TO {name}")
            self._raw.execute(f"RELEASE {name}")

    def close(self) -> None:
        """Close the underlying connection."""
        self._raw.close()

    def set_trace(self, callback: Callable[[str], None] | None) -> None:
        """Call ``callback`` with every SQL statement run here (None: stop)."""
        self._raw.set_trace_callback(callback)

    # ------------------------------------------------------------------ statements

    async def execute(
        self, statement: sa.Executable, parameters: Mapping[str, Any] | None = None
    ) -> InlineResult:
        """Run ``statement`` with ``parameters``; rows are fetched at once."""
        return self.run(statement, parameters)

    async def scalar(
        self, statement: sa.Executable, parameters: Mapping[str, Any] | None = None
    ) -> Any:
        """The first column of the first row, or None."""
        return self.run(statement, parameters).scalar()

    def run(
        self, statement: sa.Executable, parameters: Mapping[str, Any] | None = None
    ) -> InlineResult:
        """Synchronous :meth:`execute`."""
        params: Mapping[str, Any] = parameters or {}
        keys = frozenset(params)
        known = self._plans.get(id(statement))
        if known is None or known[0]() is not statement:
            known = self._plans[id(statement)] = (self._watch(statement), {})
        per_statement = known[1]
        plan = per_statement.get(keys)
        if plan is None:
            plan = per_statement[keys] = self._compile(statement, keys)
        sql, names, processors = plan.sql, plan.names, plan.processors
        if plan.compiled is not None:
            state = plan.compiled.construct_expanded_state(params)
            sql, names = state.statement, tuple(state.positiontup or ())
            bind_processors = {**plan.bind_processors, **state.processors}
            processors = tuple(bind_processors.get(n) for n in names)
            params = {**state.parameters, **params}
        defaults = plan.defaults
        args = [
            (params[name] if name in params else defaults[name])
            if proc is None
            else proc(params[name] if name in params else defaults[name])
            for name, proc in zip(names, processors, strict=True)
        ]
        try:
            cursor = self._raw.execute(sql, args)
            description = cursor.description
            raw_rows = cursor.fetchall() if description else []
        except sqlite3.Error as exc:
            raise _wrap(exc, sql, args) from exc
        rows: list[Row[Any]] = []
        if description:
            make = plan.make_row
            if make is None:
                make = plan.make_row = result_tuple([d[0] for d in description])
            result_processors = plan.result_processors
            if result_processors is None:
                rows = list(map(make, raw_rows))
            else:
                procs = result_processors
                rows = [
                    make([p(v) if p is not None else v for p, v in zip(procs, raw, strict=True)])
                    for raw in raw_rows
                ]
        return InlineResult(rows, cursor.rowcount)

    def _watch(self, statement: Any) -> weakref.ref[Any]:
        key = id(statement)
        plans = self._plans

        def forget(ref: weakref.ref[Any]) -> None:
            known = plans.get(key)
            if known is not None and known[0] is ref:
                del plans[key]

        return weakref.ref(statement, forget)

    def _compile(self, statement: sa.Executable, keys: frozenset[str]) -> _Plan:
        if not isinstance(statement, sa.Select | sa.Insert | sa.Update | sa.Delete):
            raise TypeError(f"inline SQLite runs Core SELECT/INSERT/UPDATE/DELETE: {statement!r}")
        if not isinstance(statement, sa.Select) and statement._returning:
            raise TypeError("inline SQLite does not run RETURNING statements")
        column_keys = sorted(keys) if isinstance(statement, sa.Insert | sa.Update) else None
        compiled = statement.compile(dialect=self.dialect, column_keys=column_keys)
        expanding = {p.key for p in compiled.post_compile_params}
        # Expand the literal IN lists once; only caller-supplied lists expand per call.
        # (A required parameter the caller did not name fails here, in SQLAlchemy.)
        dummy: dict[str, Any] = {name: None for name in keys if name not in expanding}
        dummy.update({name: [None] for name in keys & expanding})
        state = compiled.construct_expanded_state(dummy)
        names = tuple(state.positiontup or ())
        bind_processors: dict[str, _Processor] = {
            name: bind.type.dialect_impl(self.dialect).bind_processor(self.dialect)
            for name, bind in compiled.binds.items()
        }
        bind_processors.update(state.processors)
        defaults = {n: v for n, v in state.parameters.items() if n not in keys}
        # Python-side column defaults the compiler left to the execution context.
        for column in getattr(compiled, "insert_prefetch", ()) + getattr(
            compiled, "update_prefetch", ()
        ):
            default = column.default if column.key in defaults else None
            if default is None or not default.is_scalar:
                raise TypeError(f"inline SQLite cannot evaluate the default of {column}")
            defaults[column.key] = default.arg
        result_processors = None
        if isinstance(statement, sa.Select):
            procs = tuple(
                col.type.dialect_impl(self.dialect).result_processor(self.dialect, None)
                for col in statement.selected_columns
            )
            if any(p is not None for p in procs):
                result_processors = procs
        return _Plan(
            sql=state.statement,
            names=names,
            processors=tuple(bind_processors.get(n) for n in names),
            defaults=defaults,
            compiled=compiled if keys & expanding else None,
            bind_processors=bind_processors,
            result_processors=result_processors,
        )


def _wrap(exc: sqlite3.Error, sql: str, args: Any) -> sa.exc.DBAPIError:
    """The SQLAlchemy exception the async engine would have raised for ``exc``."""
    cls: type[sa.exc.DBAPIError] = sa.exc.DBAPIError
    if isinstance(exc, sqlite3.IntegrityError):
        cls = sa.exc.IntegrityError
    elif isinstance(exc, sqlite3.OperationalError):
        cls = sa.exc.OperationalError
    return cls(sql, args, exc)


class _Group:
    """One SQLite transaction shared by the transactions of one loop iteration."""

    __slots__ = (
        "broken",
        "closing",
        "committed",
        "lock",
        "members",
        "pending",
        "savepoints",
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
        self.savepoints = 0
        self.closing = False  # commit requested while a member was still inside
        # Set when SQLite rolled back the whole transaction under the group (a conflict
        # clause such as OR ROLLBACK, disk full, I/O error): the work of every member is
        # gone, so each of them fails with this error, and nobody joins any more.
        self.broken: BaseException | None = None


@dataclass(frozen=True, slots=True)
class Member:
    """One transaction's place in a group (see :meth:`InlineSqlite.enter`)."""

    group: _Group
    savepoint: str


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

    async def enter(self, lock: asyncio.Lock) -> Member:
        """Start a transaction: join this iteration's group (opening one, under the
        process's writer ``lock``, when there is none), then take the group's member slot
        and set a SAVEPOINT. End it with :meth:`leave`.

        A group holds ``lock`` from before ``BEGIN IMMEDIATE`` until after ``COMMIT``, so
        the process's other writers queue behind the whole group.
        """
        conn = self.connection
        group = self._group
        if group is None:
            await lock.acquire()
            try:
                await conn.begin_immediate()
            except BaseException:
                lock.release()
                raise
            group = self._group = _Group(lock)
            # Runs after every callback already queued for this iteration: the
            # transactions those start join the group first.
            asyncio.get_running_loop().call_soon(self._commit, group)
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
            group.savepoints += 1
            name = f"lg{group.savepoints}"
            conn.savepoint(name)
        except BaseException:
            group.members.release()
            self._done_with(group)
            raise
        return Member(group, name)

    def leave(self, member: Member, *, ok: bool) -> asyncio.Future[None] | None:
        """End :meth:`enter`'s transaction: keep its work (``ok``) or roll it back alone.
        When kept, returns the future that completes once the group committed (with the
        commit's error if it failed); await it before reporting success."""
        group = member.group
        waiter: asyncio.Future[None] | None = None
        try:
            if ok:
                self.connection.release(member.savepoint)
                waiter = asyncio.get_running_loop().create_future()
                group.waiters.append(waiter)
            else:
                self.connection.rollback_to(member.savepoint)
        finally:
            if not self.connection.in_transaction and group.broken is None:
                self._break(group)
            group.members.release()
            self._done_with(group)
        return waiter

    def _break(self, group: _Group) -> None:
        """SQLite ended the group's transaction by itself: fail the group (see
        :attr:`_Group.broken`); new transactions queue on the writer lock for a new one."""
        group.broken = _wrap(
            sqlite3.OperationalError(
                "SQLite rolled back the whole transaction (a conflict clause or an I/O error)"
            ),
            "COMMIT",
            (),
        )
        if self._group is group:
            self._group = None

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
        conn = self.connection
        error: BaseException | None = group.broken
        try:
            if error is None:
                conn.commit()
        except BaseException as exc:
            conn.rollback()
            error = exc
        else:
            if error is None:
                self._committed()
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

    def _committed(self) -> None:
        """Count a commit; every :data:`CHECKPOINT_EVERY`, checkpoint in a worker thread."""
        self._commits += 1
        if self._commits % CHECKPOINT_EVERY == 0 and (
            self._checkpoint is None or self._checkpoint.done()
        ):
            self._checkpoint = asyncio.ensure_future(asyncio.to_thread(self._run_checkpoint))

    def _run_checkpoint(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=0)
        try:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error:
            pass  # busy: the next one (or another connection's autocheckpoint) catches up
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
