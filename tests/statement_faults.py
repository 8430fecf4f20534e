"""A database fault at the k-th statement, the way the driver reports a real one.

:class:`SqliteFaults` patches ``sqlite3.connect`` for one database file: every
connection the service opens to it (the inline writer, the readers, the engine's) is a
stdlib connection whose cursors count the statements they execute from :meth:`arm` on
and make statement ``k`` raise ``sqlite3.OperationalError("disk I/O error")`` with
SQLite's code (``SQLITE_IOERR_WRITE``) before it runs, from the driver's own
``execute``: the product's own error handling is what runs. With ``whole_transaction``
the fault also rolls back the open transaction first, as SQLite does by itself after
some I/O errors and a full disk.

:class:`PgFaults` does the same for PostgreSQL (asyncpg): there statement ``k`` finds
its connection dropped; with ``after_commit`` (PostgreSQL only) statement ``k`` runs
first, and its answer is what is lost: a ``COMMIT`` (or a write outside a transaction
block) that reached the server and committed, whose connection then dropped, so the
service sees a failed commit that in fact landed (a commit *in doubt*).

It also tells, while counting, when a connection that wrote is left outside a
transaction (a COMMIT or a ROLLBACK): ``on_settled`` runs then, so a test can take the
committed state of every transaction boundary of a run (see
tests/integration/test_all_or_nothing.py)."""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NoReturn

import asyncpg
import pytest


class FaultySqlite(sqlite3.Connection):
    """A stdlib connection whose cursors ask :attr:`faults` before each statement."""

    faults: SqliteFaults

    def cursor(self, factory: Any = None) -> Any:
        return super().cursor(factory or _FaultyCursor)


class _FaultyCursor(sqlite3.Cursor):
    def execute(self, sql: str, parameters: Any = (), /) -> Any:
        faults = self.connection.faults  # type: ignore[attr-defined]
        faults.before(self.connection, sql)
        result = super().execute(sql, parameters)
        faults.after(self.connection)
        return result

    def executemany(self, sql: str, seq_of_parameters: Iterable[Any], /) -> Any:
        faults = self.connection.faults  # type: ignore[attr-defined]
        faults.before(self.connection, sql)
        result = super().executemany(sql, seq_of_parameters)
        faults.after(self.connection)
        return result


def io_error() -> sqlite3.OperationalError:
    """What the driver raises when a write meets an I/O error."""
    error = sqlite3.OperationalError("disk I/O error")
    error.sqlite_errorcode = sqlite3.SQLITE_IOERR_WRITE
    error.sqlite_errorname = "SQLITE_IOERR_WRITE"
    return error


class _Counting:
    """What both backends' injectors share: counting from :meth:`arm` on, and telling
    which statement is the one to fail."""

    def __init__(self) -> None:
        #: statements counted since :meth:`arm`; the SQL of each, in order
        self.statements: list[str] = []
        #: for each of them, whether it ran inside a write transaction (where a fault
        #: that rolls the whole transaction back differs from one that fails it alone)
        self.in_write: list[bool] = []
        self.fail_at: int | None = None
        #: (:meth:`arm_on`) the first statement whose SQL holds this text fails instead
        self.fail_on: str | None = None
        #: (:meth:`arm_on`) once ``fail_on`` was seen, the statement to fail after it
        self.then: str | None = None
        #: (:meth:`arm_on`, PostgreSQL) once the fault fired, every statement holding
        #: this text fails too, its connection dropped before it runs (still away)
        self.and_on: str | None = None
        self.whole_transaction = False
        self.after_commit = False
        #: (:meth:`arm_on`) what the statement that fails raises instead of the
        #: backend's fault (an I/O error, a dropped connection); it does not run
        self.error: Callable[[], Exception] | None = None
        #: the SQL of the statement that was made to fail (None: none yet)
        self.fired: str | None = None
        self._counting = False

    def arm(
        self, at: int | None, *, whole_transaction: bool = False, after_commit: bool = False
    ) -> None:
        """Count statements from now on; statement ``at`` (1-based) fails (None: none).
        ``after_commit``: it runs, and then its answer is lost (PostgreSQL only)."""
        self.statements, self.in_write = [], []
        self.fail_at, self.fail_on, self.then, self.fired = at, None, None, None
        self.and_on = None
        self.error = None
        self.whole_transaction = whole_transaction
        self.after_commit = after_commit
        self._counting = True

    def arm_on(
        self,
        text: str,
        *,
        whole_transaction: bool = False,
        then: str | None = None,
        after_commit: bool = False,
        and_on: str | None = None,
        error: Callable[[], Exception] | None = None,
    ) -> None:
        """Count statements from now on; the first whose SQL contains ``text`` fails
        (for a test about one statement, whatever comes before it). ``then``: the first
        statement holding ``then`` after that one fails instead (``then="COMMIT"`` with
        ``after_commit``: the commit of the transaction that ran ``text``, in doubt).
        ``and_on``: after that, every statement holding it fails as well, until
        :meth:`disarm` (PostgreSQL: the database still away when the service reads back;
        SQLite: the ``ROLLBACK`` after a failed ``COMMIT``, say). ``error``: the failing
        statement raises this instead of the backend's fault (the connection kept),
        without running."""
        self.arm(None, whole_transaction=whole_transaction, after_commit=after_commit)
        self.error = error
        self.fail_on = text
        self.then = then
        self.and_on = and_on

    def disarm(self) -> None:
        """Stop counting; nothing fails any more."""
        self._counting = False
        self.fail_at = self.fail_on = self.then = self.and_on = None

    @property
    def count(self) -> int:
        """Statements counted since :meth:`arm`."""
        return len(self.statements)

    def _fails(self, sql: str, in_write: Callable[[], bool]) -> bool:
        """Count ``sql`` (when counting); whether it is the statement to fail."""
        if not self._counting:
            return False
        self.statements.append(sql)
        self.in_write.append(in_write())
        if self.fail_on is not None:
            if self.fired is not None:
                return False
            if self.then is not None and self.fail_on in sql:
                self.fail_on, self.then = self.then, None  # now wait for ``then``
                return False
            if self.fail_on not in sql:
                return False
        elif self.count != self.fail_at:
            return False
        self.fired = sql
        return True


class SqliteFaults(_Counting):
    """Counts (and fails) the statements run on the SQLite file at ``path``."""

    def __init__(self, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.path = path
        #: called after a connection that changed rows is left without a transaction
        self.on_settled: Callable[[], None] | None = None
        self._settled: dict[int, int] = {}
        #: ``sqlite3.connect`` itself (for reading the file beside the service)
        self.real_connect: Callable[..., sqlite3.Connection] = sqlite3.connect
        real = self.real_connect

        def connect(database: Any, *args: Any, **kwargs: Any) -> sqlite3.Connection:
            if str(database) != path or "factory" in kwargs:
                other: sqlite3.Connection = real(database, *args, **kwargs)
                return other
            conn = real(database, *args, factory=FaultySqlite, **kwargs)
            assert isinstance(conn, FaultySqlite)
            conn.faults = self
            return conn

        monkeypatch.setattr(sqlite3, "connect", connect)

    def before(self, conn: sqlite3.Connection, sql: str) -> None:
        """Count ``sql``; raise the driver's I/O error when it is the one to fail."""
        assert not self.after_commit, "a SQLite COMMIT's answer cannot be lost"
        if not self._fails(sql, lambda: conn.in_transaction and _writer(conn)):
            if self.fired is not None and self.and_on is not None and self.and_on in sql:
                raise io_error()
            return
        if self.error is not None:
            raise self.error()
        if self.whole_transaction and conn.in_transaction:
            sqlite3.Cursor(conn).execute("ROLLBACK")
        raise io_error()

    def after(self, conn: sqlite3.Connection) -> None:
        """Tell :attr:`on_settled` when a connection that changed rows since it was last
        settled has no open transaction (it committed, or rolled back)."""
        if not self._counting or self.on_settled is None or conn.in_transaction:
            return
        changes = conn.total_changes
        if changes != self._settled.get(id(conn), 0):
            self._settled[id(conn)] = changes
            self.on_settled()


def _writer(conn: sqlite3.Connection) -> bool:
    """Whether ``conn`` may write (the service's readers are ``query_only``)."""
    return not sqlite3.Cursor(conn).execute("PRAGMA query_only").fetchone()[0]


class PgFaults(_Counting):
    """:class:`SqliteFaults` for PostgreSQL: the service's pool (``asyncpg.create_pool``,
    patched) makes connections whose ``execute``, ``executemany`` and ``fetch`` (what
    :mod:`leadgate.database.pg` and asyncpg's transactions run statements with) count
    them; statement ``k`` finds the connection dropped, as when the server restarts:
    the connection is closed (the server rolls back its open transaction) and asyncpg's
    ``ConnectionDoesNotExistError`` is raised. Armed ``after_commit``, statement ``k``
    runs first and the connection drops as its answer would come back: the same error,
    for a statement the server has carried out (a ``COMMIT`` that landed).
    :attr:`on_settled` is awaited after a statement that leaves a connection outside a
    transaction."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.on_settled: Callable[[], Awaitable[None]] | None = None
        #: the connection whose statement ran and whose answer is to be lost
        self._lose_answer: asyncpg.Connection | None = None
        real = asyncpg.create_pool
        faults = self

        class Counted(_CountedPg):
            pass

        Counted.faults = faults

        def create_pool(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("connection_class", Counted)
            return real(*args, **kwargs)

        monkeypatch.setattr(asyncpg, "create_pool", create_pool)

    def before(self, conn: asyncpg.Connection, sql: str) -> None:
        """Count ``sql``; drop the connection when it is the one to fail (a dropped
        connection always loses the whole transaction: ``whole_transaction`` changes
        nothing here)."""
        if not self._fails(sql, conn.is_in_transaction):
            if self.fired is not None and self.and_on is not None and self.and_on in sql:
                _drop(conn)
            return
        if self.error is not None:
            raise self.error()
        if self.after_commit:
            self._lose_answer = conn
            return
        _drop(conn)

    async def after(self, conn: asyncpg.Connection) -> None:
        """Drop ``conn`` when its statement's answer is the one to lose; else await
        :attr:`on_settled` when ``conn`` has no open transaction."""
        if self._lose_answer is conn:
            self._lose_answer = None
            _drop(conn)
        if self._counting and self.on_settled is not None and not conn.is_in_transaction():
            await self.on_settled()


def _drop(conn: asyncpg.Connection) -> NoReturn:
    """Close ``conn`` as a server restart does, and raise what asyncpg raises then."""
    conn.terminate()
    raise asyncpg.exceptions.ConnectionDoesNotExistError(
        "connection was closed in the middle of operation"
    )


class _CountedPg(asyncpg.Connection):  # type: ignore[misc]
    # (asyncpg's own keyword arguments, ``timeout`` and ``record_class``, pass through.)
    faults: PgFaults

    async def execute(self, query: str, *args: Any, **options: Any) -> str:
        self.faults.before(self, query)
        result: str = await super().execute(query, *args, **options)
        await self.faults.after(self)
        return result

    async def executemany(self, command: str, args: Any, **options: Any) -> None:
        self.faults.before(self, command)
        await super().executemany(command, args, **options)
        await self.faults.after(self)

    async def fetch(self, query: str, *args: Any, **options: Any) -> list[Any]:
        self.faults.before(self, query)
        rows: list[Any] = await super().fetch(query, *args, **options)
        await self.faults.after(self)
        return rows


def injector(url: str, monkeypatch: pytest.MonkeyPatch) -> SqliteFaults | PgFaults:
    """The injector for the database at ``url`` (made before the service opens it)."""
    if url.startswith("sqlite"):
        return SqliteFaults(url.removeprefix("sqlite+aiosqlite:///"), monkeypatch)
    return PgFaults(monkeypatch)
