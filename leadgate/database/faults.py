"""Which database errors mean "the database cannot take this now" (503), not a bug.

:func:`unavailable` looks through an exception (SQLAlchemy's wrapper, the DBAPI error
and their causes) and answers an :class:`leadgate.core.errors.Unavailable` for:

* SQLite: busy/locked past the bound (another process holds the write lock), disk full,
  I/O errors, a file that cannot be opened, and a group transaction that SQLite rolled
  back under us (:mod:`leadgate.database.inline_sqlite`, caused by one of those);
* PostgreSQL: no connection (refused, reset, closed by the server, terminated by an
  administrator: ``pg_terminate_backend``), the server starting up or shutting down,
  too many connections, disk full (SQLSTATE classes 08, 53, 57P), pool timeouts; and
  the errors that end one statement or transaction for a passing reason, where the same
  request a moment later goes through: a statement cancelled (``57014``
  query_canceled: ``statement_timeout``, ``pg_cancel_backend``), a lock not granted
  (``55P03`` lock_not_available: ``lock_timeout``, ``NOWAIT``), a session ended for
  sitting idle in its transaction (``25P03``
  idle_in_transaction_session_timeout), a deadlock (``40P01``) or a serialization
  failure (``40001``), the last two retryable by definition.

Anything else (an integrity error, a syntax error: a bug) is not unavailability and
stays what it is. PostgreSQL reporting damaged data or a damaged index (SQLSTATE
``XX001``, ``XX002``) is no more transient than a damaged SQLite file: :func:`pg_damage`
finds it, for :class:`leadgate.core.errors.DatabaseDamaged`.
"""

from __future__ import annotations

import socket
import sqlite3

import sqlalchemy as sa

from leadgate.core.errors import NOTHING_STORED, DatabaseDamaged, Unavailable
from leadgate.core.logs import exception_chain

#: The errors a write raises when the database failed it, not what was written: the
#: same write may go through later (:class:`Unavailable`), or nothing will until an
#: operator repairs the database (:class:`DatabaseDamaged`). Anything else a write
#: raises is about the write itself (a bug, a value the database refuses).
DATABASE_FAULTS = (Unavailable, DatabaseDamaged)

# SQLite primary result codes that say "not now".
_SQLITE_CODES = frozenset(
    {
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_READONLY,
    }
)
_SQLITE_TEXT = (
    "database is locked",
    "database table is locked",
    "disk is full",
    "disk i/o error",
    "unable to open database",
    "rolled back the whole transaction",
    "attempt to write a readonly database",
)
_PG_STATES = ("08", "53", "57P", "57014", "55P03", "25P03", "40P01", "40001")
_PG_TEXT = (
    "connection was closed",
    "connection is closed",
    "terminating connection",
    "the database system is",
    "connection refused",
    "cannot connect",
    "connection reset",
    "server closed the connection",
    "underlying connection is closed",
    # asyncpg, on a connection the server dropped in the middle of an operation
    "another operation is in progress",
    "cannot switch to state",
    # asyncpg's pool proxy, once the server closed its connection while a transaction
    # waited between statements (idle_in_transaction_session_timeout, FATAL 25P03;
    # pg_terminate_backend): asyncpg took the connection back by itself
    "connection has been released back to the pool",
)


def _text(item: BaseException) -> str:
    """What the driver said, without SQLAlchemy's ``[SQL: ...]`` and ``[parameters: ...]``
    lines: the parameters hold what clients sent (message text), which stays out of the
    log."""
    if isinstance(item, sa.exc.StatementError) and item.orig is not None:
        item = item.orig
    return str(item).split("\n", 1)[0] or type(item).__name__


def _why(exc: BaseException) -> str | None:
    for item in exception_chain(exc):
        if isinstance(item, sa.exc.TimeoutError):
            return "no database connection became free in time"
        code = getattr(item, "sqlite_errorcode", None)
        if isinstance(code, int) and code & 0xFF in _SQLITE_CODES:
            return _text(item)
        state = getattr(item, "sqlstate", None) or getattr(item, "pgcode", None)
        if isinstance(state, str) and state.startswith(_PG_STATES):
            return _text(item)
        if isinstance(item, sa.exc.DBAPIError) and item.connection_invalidated:
            return "the database connection was lost"
        # socket.gaierror: the database's host name did not resolve (DNS away, or a typo:
        # either way the database cannot be reached now; it was answered as a bug).
        if isinstance(item, ConnectionError | TimeoutError | socket.gaierror):
            return _text(item)
        if type(item).__module__.startswith("asyncpg") and (
            "Connection" in type(item).__name__ or "Shutdown" in type(item).__name__
        ):
            return _text(item)
        if isinstance(item, sa.exc.OperationalError | sa.exc.InterfaceError | OSError):
            text = str(item).lower()
            if any(t in text for t in _SQLITE_TEXT + _PG_TEXT):
                return _text(item)
    return None


#: Faults PostgreSQL answers with an ERROR (not by ending the session): the statement,
#: or the COMMIT, failed and its transaction rolled back, so a write that met one at its
#: COMMIT did not land. Disk full and too many connections (class 53), a statement
#: cancelled, a lock not granted, a deadlock, a serialization failure.
_PG_REFUSED = ("53", "57014", "55P03", "40P01", "40001")


def refused(exc: BaseException) -> bool:
    """Whether ``exc`` is PostgreSQL's ERROR answer to a statement (see
    :data:`_PG_REFUSED`): met at a COMMIT, the write is known not to have landed; only
    a fault without such an answer (the connection lost, the session terminated) leaves
    it in doubt."""
    for item in exception_chain(exc):
        state = getattr(item, "sqlstate", None) or getattr(item, "pgcode", None)
        if isinstance(state, str) and state.startswith(_PG_REFUSED):
            return True
    return False


def lock_not_granted(exc: BaseException) -> bool:
    """Whether ``exc`` is PostgreSQL's ``55P03`` lock_not_available: a lock waited for
    past the transaction's ``lock_timeout`` (or asked for ``NOWAIT``). The statement
    failed and its transaction rolls back; the row is held by another transaction, so a
    runner that bounded its wait on purpose looks again rather than reporting a fault."""
    for item in exception_chain(exc):
        state = getattr(item, "sqlstate", None) or getattr(item, "pgcode", None)
        if state == "55P03":
            return True
    return False


#: PostgreSQL's corruption codes (class XX, "internal error"): what each says to do.
_PG_DAMAGE = {
    "XX001": ("data_corrupted", "restore the damaged data from a backup"),
    "XX002": ("index_corrupted", "REINDEX the index it names"),
}


def pg_damage(exc: BaseException) -> str | None:
    """PostgreSQL's own words when ``exc`` is its report of damaged data or a damaged
    index (``XX001`` data_corrupted, ``XX002`` index_corrupted; asyncpg's or
    SQLAlchemy's wrapping of it): ``SQLSTATE XX001 data_corrupted: <the server's text>
    [(hint: ...)]; <what to do>``, without the statement or its parameters. None for
    anything else (``XX000``, a plain internal error, is a server bug, not damage)."""
    for item in exception_chain(exc):
        state = getattr(item, "sqlstate", None) or getattr(item, "pgcode", None)
        if not isinstance(state, str) or state not in _PG_DAMAGE:
            continue
        name, remedy = _PG_DAMAGE[state]
        said = _text(item)[:300]
        hint = getattr(item, "hint", None)
        if isinstance(hint, str) and hint:
            said = f"{said} (hint: {hint[:100]})"
        return f"SQLSTATE {state} {name}: {said}; {remedy}"
    return None


def unavailable(exc: BaseException) -> Unavailable | None:
    """An :class:`Unavailable` when ``exc`` is a database fault of the kinds above."""
    if isinstance(exc, Unavailable):
        return exc
    why = _why(exc)
    if why is None:
        return None
    # The detail (file paths, server text) is for the log, not for clients.
    # (A request that only reads is told CANNOT_READ instead: the surfaces know which.)
    error = Unavailable(NOTHING_STORED, rule="service.unavailable")
    error.detail = why[:300]
    return error


#: What a PostgreSQL server answers a connection whose URL names a user, password or
#: database it does not take: the configuration's mistake, neither a passing fault nor
#: a bug. The server's own text (which names the user) is left out, as elsewhere.
_PG_LOGIN = {
    "28000": "invalid_authorization_specification: the server takes no such user from "
    "this host (a role that does not exist, or pg_hba.conf)",
    "28P01": "invalid_password: the password is wrong",
    "3D000": "invalid_catalog_name: the server has no database of that name",
}


def login_refused(exc: BaseException) -> str | None:
    """``SQLSTATE <code> <what it means>`` when ``exc`` is PostgreSQL refusing the
    connection for its user, password or database name (:data:`_PG_LOGIN`), else None."""
    for item in exception_chain(exc):
        state = getattr(item, "sqlstate", None) or getattr(item, "pgcode", None)
        if isinstance(state, str) and state in _PG_LOGIN:
            return f"SQLSTATE {state} {_PG_LOGIN[state]}"
    return None
