"""PostgreSQL straight on asyncpg, running the same Core statements compiled once.

Through SQLAlchemy's asyncio layer each statement cost about a millisecond of event-loop
time on top of its round trip (greenlet switches, the adapted DBAPI cursor, per-call
compilation cache lookups); a plain turn was 0.04 of a bare endpoint. Here a statement
is one ``asyncpg`` call: SQL text and parameter order come from a :class:`Plan`
(SQLAlchemy's compiler for the asyncpg dialect, once per statement object), asyncpg
prepares the text once per connection (its statement cache), and rows come back as
SQLAlchemy :class:`~sqlalchemy.engine.Row` objects. JSON codecs are the ones SQLAlchemy's
asyncpg dialect installs (bind: ``json.dumps`` by the dialect's processor, then UTF-8;
result: ``json.loads``), so values round-trip exactly as before.

Errors are raised as SQLAlchemy's exceptions: ``IntegrityError`` for constraint
violations (the intake's retry and the fenced inserts rely on it), ``OperationalError``
when the server cannot be reached or the connection dropped, ``DBAPIError`` otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.compiler import OPERATORS
from sqlalchemy.sql.elements import BindParameter

from leadgate.database.faults import unavailable
from leadgate.database.plans import Plan, PlanCache, Result

#: asyncpg's per-connection prepared-statement cache (the service runs ~150 distinct
#: statements; the default of 100 would evict hot ones).
STATEMENT_CACHE_SIZE = 1024
CONNECT_TIMEOUT_S = 10.0
#: A connection on the pool's idle list unused this long goes back to asyncpg's pool,
#: which closes it after its own 300 s of inactivity (see :meth:`PgPool._acquire`).
IDLE_S = 60.0
#: Tables whose writes PostgreSQL announces on :data:`CHANGES_CHANNEL`, whoever writes
#: them (a statement trigger each, migrations 0010 and 0012; payload: the table's name).
NOTIFYING_TABLES = frozenset({"agents", "presets", "policy_rules", "routes"})
CHANGES_CHANNEL = "leadgate_table_changes"
#: Planner settings of the pool's connections. No bitmap scans: every hot statement
#: looks rows up by an index that also gives their order, and the one that hurt was the
#: history window (the newest 50 messages of a session, ``ORDER BY ... LIMIT``). Its
#: session is a join parameter, so PostgreSQL plans for an average session: a few rows
#: while the statistics are missing (a new database) or most sessions are short. It
#: then read every message of the session with a bitmap scan and sorted them, where
#: walking the index backwards reads 50; a long session's turns grew dearer with each
#: message (PostgreSQL's CPU per plain turn 0.42 -> 0.97 ms over three rounds of 4,800
#: turns on 16 sessions). Without bitmap scans the index walk is the plan. What a bitmap
#: scan would serve here (ORs across two indexes) runs on small tables or behind an
#: organization's index.
PLANNER_SETTINGS = {"enable_bitmapscan": "off"}
#: The session setting the triggers put into the payload, after the table's name.
SENDER_SETTING = "leadgate.sender"
# The target of a text() write; one that names none may write anything.
_WRITE_TARGET = re.compile(
    r"\b(?:INSERT\s+INTO|UPDATE|DELETE\s+FROM|TRUNCATE(?:\s+TABLE)?(?:\s+ONLY)?)\s+\"?(\w+)",
    re.IGNORECASE,
)


def asyncpg_dsn(url: str) -> str:
    """A libpq DSN for asyncpg from an SQLAlchemy ``postgresql+asyncpg://`` URL."""
    parsed = sa.engine.make_url(url)
    return parsed.set(drivername="postgresql").render_as_string(hide_password=False)


class TableChanges:
    """What this process knows of writes to :data:`NOTIFYING_TABLES`, as a token that
    changes with each: what lets a cache of their rows (the intake's agents and policy
    rules) be used again on PostgreSQL, as ``PRAGMA data_version`` does on SQLite.

    Writes reach it two ways. Through this process's connections: a statement that
    writes one of the tables counts when its transaction has ended (committed or rolled
    back), so nothing read before the commit is used after it; inside that transaction
    the connection gives no token at all (its reads see its own uncommitted rows). From
    every other writer (other replicas, the CLI, ``psql``): the tables' triggers NOTIFY
    :data:`CHANGES_CHANNEL` at commit, and the process's LISTEN connection calls
    :meth:`notified` (its own writes' notifications are skipped by tag). A change
    committed elsewhere is therefore seen by this process's reads at once and by its
    cache once the notification arrived (on one host, well under a millisecond after
    the writer's commit returned). Without a LISTEN connection, or while it reconnects,
    :meth:`token` is None: nothing is cached, every intake reads.
    """

    __slots__ = ("_counts", "_epoch", "_listening", "_targets", "tag")

    def __init__(self, tag: str = "") -> None:
        #: this process's connections' ``leadgate.sender`` (the triggers put it into the
        #: payload): its own writes are counted when their transaction ends, not again
        #: when their notification comes back
        self.tag = tag
        self._counts: dict[str, int] = {}
        self._listening = 0
        # Bumped when a LISTEN connection comes or goes: tokens from before never match.
        self._epoch = 0
        self._targets: dict[str, frozenset[str]] = {}

    def token(self, tables: Sequence[str]) -> object | None:
        """Equal on two calls only if no write to ``tables`` became known in between;
        None when that cannot be known (no LISTEN connection, or a table that does not
        notify)."""
        if self._listening <= 0 or not NOTIFYING_TABLES.issuperset(tables):
            return None
        counts = self._counts
        return (self._epoch, *(counts.get(t, 0) for t in tables))

    def wrote(self, tables: Iterable[str]) -> None:
        """Rows of ``tables`` changed (or may have)."""
        counts = self._counts
        for table in tables:
            counts[table] = counts.get(table, 0) + 1

    def notified(self, payload: str) -> None:
        """A notification on :data:`CHANGES_CHANNEL`: ``"<table> <sender tag>"``."""
        table, _, sender = payload.partition(" ")
        if sender and sender == self.tag:
            return
        if table in NOTIFYING_TABLES:
            self.wrote((table,))
        else:
            self._epoch += 1

    def connected(self) -> None:
        """A LISTEN connection on :data:`CHANGES_CHANNEL` is up (what was committed while
        none was is read again: the epoch changes)."""
        self._listening += 1
        self._epoch += 1

    def lost(self) -> None:
        """A LISTEN connection :meth:`connected` before is gone."""
        self._listening = max(0, self._listening - 1)
        self._epoch += 1

    def tracked(self, plan: Plan) -> frozenset[str]:
        """The notifying tables ``plan`` writes (all of them for a ``text()`` write that
        names no table); empty for reads and other tables. Kept per SQL text."""
        if plan.writes is None:
            return frozenset()
        known = self._targets.get(plan.sql)
        if known is None:
            if plan.writes != "*":
                targets = {plan.writes}
            else:
                targets = {m.lower() for m in _WRITE_TARGET.findall(plan.sql)} or {"*"}
            known = NOTIFYING_TABLES if "*" in targets else NOTIFYING_TABLES & targets
            if len(self._targets) >= 4096:  # expanded IN lists make texts per length
                self._targets.clear()
            self._targets[plan.sql] = known
        return known


async def _init(conn: asyncpg.Connection) -> None:
    # The codecs SQLAlchemy's asyncpg dialect sets up (see its setup_asyncpg_json_codec):
    # the dialect's JSON bind processor already produced the JSON text.
    await conn.set_type_codec(
        "json",
        encoder=str.encode,
        decoder=lambda raw: json.loads(raw.decode()),
        schema="pg_catalog",
        format="binary",
    )
    await conn.set_type_codec(
        "jsonb",
        encoder=lambda text: b"\x01" + text.encode(),
        decoder=lambda raw: json.loads(raw[1:].decode()),
        schema="pg_catalog",
        format="binary",
    )


#: What asyncpg raises: server errors, client-side misuse or a connection in a broken
#: state (InternalClientError: "cannot switch to state ...", after the server dropped it
#: mid-operation), and socket errors (TimeoutError included).
_DRIVER_ERRORS = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
)


def _wrap(exc: BaseException, sql: str, args: Any) -> sa.exc.DBAPIError:
    """The SQLAlchemy exception the async engine would have raised for ``exc`` (its
    parameters hidden, as the engine's are)."""
    cls: type[sa.exc.DBAPIError] = sa.exc.DBAPIError
    if isinstance(exc, asyncpg.IntegrityConstraintViolationError):
        cls = sa.exc.IntegrityError
    elif isinstance(
        exc,
        OSError
        | asyncpg.ConnectionDoesNotExistError
        | asyncpg.CannotConnectNowError
        | asyncpg.InterfaceError
        | asyncpg.InternalClientError
        | asyncpg.PostgresConnectionError,
    ):
        cls = sa.exc.OperationalError
    # hide_parameters, as the engine is made: the parameters are what clients sent
    # (message text), and this exception's text reaches logs and tracebacks.
    orig = exc if isinstance(exc, Exception) else Exception(str(exc))
    return cls(sql, args, orig, hide_parameters=True)


class PgConnection:
    """One pooled asyncpg connection inside a transaction, running Core statements."""

    __slots__ = (
        "_changes",
        "_plans",
        "_raw",
        "_readonly",
        "_reconnect",
        "_trace",
        "aborted",
        "dialect",
        "info",
        "undo_failed",
        "wrote",
    )

    def __init__(
        self,
        raw: asyncpg.Connection,
        plans: PlanCache,
        trace: Callable[[str], None] | None,
        *,
        readonly: bool = False,
        changes: TableChanges | None = None,
        reconnect: Callable[[asyncpg.Connection], Awaitable[asyncpg.Connection]] | None = None,
    ) -> None:
        self._raw = raw
        self._plans = plans
        self._trace = trace
        #: a read (no transaction block): only SELECT statements
        self._readonly = readonly
        self._changes = changes
        #: a read's way to a fresh connection when the server dropped this one (a
        #: SELECT outside a transaction block runs again safely); used once
        self._reconnect = reconnect
        self.dialect: Dialect = plans.dialect
        self.info: dict[Any, Any] = {}
        #: notifying tables written here (counted in ``changes`` when the pool's
        #: transaction or single statement ends)
        self.wrote: set[str] = set()
        #: the error of a :meth:`begin_nested` block's undo that failed (see there)
        self.undo_failed: BaseException | None = None
        #: the error of the last statement that failed and that no savepoint's undo
        #: took back since: PostgreSQL has aborted the transaction, and its ``COMMIT``
        #: would be answered ``ROLLBACK`` without an error (see :meth:`PgPool.transaction`);
        #: the next statement raises it again instead of being sent
        #: (:meth:`_refuse_if_aborted`)
        self.aborted: BaseException | None = None

    def raise_aborted(self) -> None:
        """Raise again the error that aborted this transaction (:attr:`aborted`), if a
        statement failed and its caller went on: the whole transaction failed, before
        its ``COMMIT`` (nothing of it is in doubt)."""
        error, self.aborted = self.aborted, None
        if error is not None:
            error.add_note(
                "raised again at the end of its transaction, which PostgreSQL aborted at "
                "this error (caught outside a savepoint): nothing of the transaction committed"
            )
            raise error

    @property
    def raw(self) -> asyncpg.Connection:
        """The asyncpg connection this one runs on now (a read that met a dropped
        connection has moved to a fresh one): what the pool takes back."""
        return self._raw

    async def execute(
        self,
        statement: sa.Executable,
        parameters: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    ) -> Result:
        """Run ``statement`` (a list of parameter sets: executemany)."""
        if parameters is not None and not isinstance(parameters, Mapping):
            return await self._many(statement, parameters)
        params: Mapping[str, Any] = parameters or {}
        if self._readonly and not _is_select(statement):
            raise TypeError("a read runs only SELECT statements; write in Database.tx()")
        self._refuse_if_aborted()
        plan, extracted = self._plans.plan(statement, frozenset(params))
        if plan.writes is not None and self._changes is not None:
            self.wrote.update(self._changes.tracked(plan))
        sql, args = plan.args(params, extracted)
        if self._trace is not None:
            self._trace(sql)
        while True:
            try:
                if plan.keys is not None or _is_text_query(statement, sql):
                    records = await self._raw.fetch(sql, *args)
                    # (called inside plan.rows, never kept: the loop cannot rebind it)
                    rows = plan.rows(records, lambda: list(records[0].keys()))  # noqa: B023
                    return Result(rows, len(rows))
                status = await self._raw.execute(sql, *args)
                return Result([], _rowcount(status))
            except _DRIVER_ERRORS as exc:
                reconnect, self._reconnect = self._reconnect, None
                if reconnect is None or _usable(self._raw):
                    error = _wrap(exc, sql, args)
                    self.aborted = error
                    raise error from exc
            self._raw = await reconnect(self._raw)

    def _refuse_if_aborted(self) -> None:
        """Raise :attr:`aborted` again, in a transaction block that a failed statement
        aborted and whose caller caught the error and went on (outside a savepoint, or
        inside one before its undo): PostgreSQL would refuse the statement with
        ``25P02`` (in_failed_sql_transaction), an error that names only the symptom
        (a 500, where the error it stands for may be a database fault: a 503) and
        costs a round trip. Raised inside a savepoint's block, its undo takes the
        failure back as it does the first time. A read (no transaction block) has
        nothing to abort."""
        error = self.aborted
        if error is None or self._readonly:
            return
        if _AGAIN not in getattr(error, "__notes__", ()):
            error.add_note(_AGAIN)
        raise error

    def cache_token(self, tables: Sequence[str]) -> object | None:
        """:meth:`TableChanges.token`: None without a LISTEN connection (other replicas
        change rows without telling this connection), and in a transaction that wrote
        one of ``tables`` (what it reads of them is its own, not yet committed)."""
        if self._changes is None or (self.wrote and not self.wrote.isdisjoint(tables)):
            return None
        return self._changes.token(tables)

    async def scalar(
        self, statement: sa.Executable, parameters: Mapping[str, Any] | None = None
    ) -> Any:
        """The first column of the first row, or None."""
        return (await self.execute(statement, parameters)).scalar()

    @asynccontextmanager
    async def begin_nested(self) -> AsyncIterator[None]:
        """A SAVEPOINT inside the open transaction (asyncpg nests transactions as
        savepoints): an error in the block undoes the block's writes alone. When that
        undo (``ROLLBACK TO SAVEPOINT``) fails, its error propagates and is kept in
        :attr:`undo_failed`: the block's writes may still be in the transaction, which
        then fails whole whatever the caller made of the error (``Database.tx`` raises
        it at the end of the block). An undo that ran takes back what failed in the
        block (:attr:`aborted`); a ``SAVEPOINT`` or ``RELEASE`` that fails aborts the
        transaction. A ``RELEASE`` refused because a statement of the block failed and
        the block caught its error raises that error again (not PostgreSQL's
        ``25P02``, which names only the symptom)."""
        self._refuse_if_aborted()
        failed: BaseException | None = None
        aborted = self.aborted
        try:
            async with self._raw.transaction():
                try:
                    yield
                except BaseException as exc:
                    failed = exc
                    raise
        except _DRIVER_ERRORS as exc:
            error = _wrap(exc, "SAVEPOINT", ())
            caught = self.aborted
            if exc is failed:
                self.aborted = aborted
            elif failed is None and caught is not None and caught is not aborted:
                # The RELEASE, refused (25P02) because a statement of the block failed
                # and the block caught its error: that error is what failed, not the
                # RELEASE (the transaction stays aborted, as for a failed RELEASE).
                if _RELEASED not in getattr(caught, "__notes__", ()):
                    caught.add_note(_RELEASED)
                raise caught from caught.__cause__  # (its own cause: the driver's error)
            else:
                self.aborted = error
                if failed is not None:  # the undo's own error
                    self.undo_failed = error
            raise error from exc
        except BaseException as exc:
            if exc is failed:  # the block's error, undone by ROLLBACK TO
                self.aborted = aborted
            raise

    async def _many(
        self, statement: sa.Executable, parameters: Sequence[Mapping[str, Any]]
    ) -> Result:
        if not parameters:
            return Result([], 0)
        self._refuse_if_aborted()
        plan, extracted = self._plans.plan(statement, frozenset(parameters[0]))
        if plan.keys is not None or plan.compiled is not None:
            raise TypeError("executemany runs no RETURNING and no expanding IN statements")
        if plan.writes is not None and self._changes is not None:
            self.wrote.update(self._changes.tracked(plan))
        batch = [plan.args(p, extracted)[1] for p in parameters]
        if self._trace is not None:
            self._trace(plan.sql)
        try:
            await self._raw.executemany(plan.sql, batch)
        except _DRIVER_ERRORS as exc:
            error = _wrap(exc, plan.sql, batch[:1])
            self.aborted = error
            raise error from exc
        return Result([], len(batch))


def array_in_dialect(dialect: Dialect) -> Dialect:
    """``dialect`` compiling ``column IN (<a list the caller passes>)`` as
    ``column = ANY($n::type[])``: one parameter, whatever the list's length.

    SQLAlchemy expands such a list into ``IN ($3, $4, ...)``, a different SQL text for
    every length: asyncpg prepares each text once per connection (a round trip of its
    own, and a plan for PostgreSQL to make), and the expansion costs Python work per
    call. The relay's batch statements (one id per delivery of a group of any size)
    missed the prepared-statement cache most of the time.
    """
    planned = copy.copy(dialect)
    base = dialect.statement_compiler

    class ArrayInCompiler(base):  # type: ignore[misc,valid-type]
        def visit_in_op_binary(self, binary: Any, operator: Any, **kw: Any) -> str:
            right = binary.right
            # Only a list the caller passes by name: a literal list (``in_([...])``) of a
            # statement built per call must keep SQLAlchemy's own per-object values.
            if (
                isinstance(right, BindParameter)
                and right.expanding
                and not right.literal_execute
                and right.value is None
                and right.callable is None
            ):
                array = sa.bindparam(right.key, type_=ARRAY(right.type))
                left = self.process(binary.left, **kw)
                return f"{left} = ANY({self.process(array, **kw)})"
            # What SQLAlchemy's compiler does for IN when no visit_in_op_binary exists.
            text: str = self._generate_generic_binary(binary, OPERATORS[operator], **kw)
            return text

    planned.statement_compiler = ArrayInCompiler
    return planned


def _is_select(statement: sa.Executable) -> bool:
    """A statement that only reads (a Core SELECT, or text starting with SELECT)."""
    if isinstance(statement, sa.TextClause):
        return statement.text.lstrip().upper().startswith("SELECT")
    return isinstance(statement, sa.Select | sa.CompoundSelect)


def _is_text_query(statement: sa.Executable, sql: str) -> bool:
    # SQLAlchemy knows the columns of Core statements; for text() only the SQL tells
    # whether rows come back (asyncpg's fetch would hide a command's row count).
    return isinstance(statement, sa.TextClause) and sql.lstrip().upper().startswith(
        ("SELECT", "WITH", "VALUES", "SHOW", "EXPLAIN")
    )


async def _keep_session(conn: asyncpg.Connection) -> None:
    """The pool's reset on release: nothing beyond asyncpg's own (it rolls back an open
    transaction and drops listeners first).

    asyncpg's default runs ``SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *;
    RESET ALL;`` on every release: one more round trip per transaction, undoing session
    state this pool never creates (its connections take no advisory locks, declare no
    cursors, LISTEN nowhere (listeners have their own connections, see
    :func:`outbox.store.pg_listen`) and SET nothing outside a transaction)."""


#: The note :meth:`PgConnection._refuse_if_aborted` adds to the error it raises again.
_AGAIN = (
    "raised again at a later statement of its transaction, which PostgreSQL aborted at "
    "this error (caught outside a savepoint): the statement was not sent"
)


#: The note :meth:`PgConnection.begin_nested` adds to the error a block caught, raised
#: again at the block's end.
_RELEASED = (
    "raised again at the end of its savepoint's block, which caught it: PostgreSQL "
    "refused the RELEASE, and the transaction stays aborted"
)


def _usable(raw: asyncpg.Connection) -> bool:
    """Whether a pooled connection is still open. When the server drops one, asyncpg
    takes it back into its pool by itself, and the proxy we hold then raises."""
    try:
        return not raw.is_closed()
    except asyncpg.InterfaceError:
        return False


def _rowcount(status: str) -> int:
    """The row count of an asyncpg command status (``"UPDATE 3"``, ``"INSERT 0 1"``)."""
    tail = status.rsplit(" ", 1)[-1]
    return int(tail) if tail.isdigit() else 0


class PoolFloorFaults(logging.Filter):
    """asyncpg's pool keeps a floor of one connection (``min_size``): once the server
    dropped them all, a background task of asyncpg's reconnects, and logs each failed
    attempt as a WARNING with the driver's traceback (``Failed to restore the pool
    connection floor; retrying``; at 1, 2, 4 ... 60 s). A database fault among them
    (:func:`leadgate.database.faults.unavailable`: the server down or restarting) is
    one line naming the rule and what the database said, as every other path says it;
    anything else keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        """``record``, its traceback replaced by one line when it is a database fault."""
        exc = record.exc_info[1] if record.exc_info else None
        fault = unavailable(exc) if exc is not None else None
        if fault is not None:
            record.msg = "database: could not reconnect the pool's idle connection (%s): %s"
            record.args = (fault.rule, fault.detail)
            record.exc_info = None
            record.exc_text = None
        return True


_POOL_FLOOR_FAULTS = PoolFloorFaults()


class PgPool:
    """The process's asyncpg pool and the plans compiled for it."""

    def __init__(
        self,
        url: str,
        dialect: Dialect,
        *,
        size: int,
        acquire_timeout_s: float | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        tag: str = "",
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dsn = asyncpg_dsn(url)
        self.plans = PlanCache(array_in_dialect(dialect))
        self.size = size
        self.acquire_timeout_s = acquire_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._pool: asyncpg.Pool | None = None
        #: connections whose last use ended cleanly (and when), still checked out of
        #: ``_pool``; the oldest first
        self._idle: list[tuple[asyncpg.Connection, float]] = []
        self.monotonic = monotonic
        #: tasks in asyncpg's acquire (while any wait, connections go back to asyncpg)
        self._waiting = 0
        #: connections handed out so far (tests count them)
        self.uses = 0
        self._making = asyncio.Lock()
        self.trace: Callable[[str], None] | None = None
        #: writes to the notifying tables, for caches of their rows
        self.changes = TableChanges(tag)

    async def _ensure(self) -> asyncpg.Pool:
        if self._pool is not None:
            return self._pool
        # One pool, however many callers arrive while it is being made (each would
        # otherwise make its own and all but the last would leak their connections).
        async with self._making:
            if self._pool is None:
                self._pool = await self._make()
        return self._pool

    async def _make(self) -> asyncpg.Pool:
        # Added once (a filter already there is not added again).
        logging.getLogger("asyncpg.pool").addFilter(_POOL_FLOOR_FAULTS)
        try:
            return await asyncpg.create_pool(
                self.dsn,
                min_size=1,
                max_size=2 * self.size,
                statement_cache_size=STATEMENT_CACHE_SIZE,
                init=_init,
                reset=_keep_session,
                timeout=self.connect_timeout_s,
                # Sent with the connection's startup (no round trip of its own).
                server_settings={SENDER_SETTING: self.changes.tag, **PLANNER_SETTINGS},
            )
        except _DRIVER_ERRORS as exc:
            raise _wrap(exc, "CONNECT", ()) from exc

    async def _give_back(self, raw: asyncpg.Connection) -> None:
        """The end of a clean use of ``raw``: onto the idle list, or back to asyncpg."""
        if (
            self._waiting == 0
            and self._pool is not None
            and _usable(raw)
            and not raw.is_in_transaction()
        ):
            idle = self._idle
            now = self.monotonic()
            idle.append((raw, now))
            if idle[0][1] < now - IDLE_S:
                await self._trim(now - IDLE_S)
        else:
            # Someone waits in asyncpg's queue: only a release there wakes them (a
            # connection parked here would leave them waiting until their timeout).
            await self._release(raw)

    async def _renew(self) -> None:
        """Replace every pooled connection opened so far: one the server dropped says
        the others are likely gone too (a restart, a failover, ``pg_terminate_backend``),
        though the process learns of each only when it reads from it. The idle ones are
        closed now and asyncpg's own reconnect on their next acquire
        (``expire_connections``). One in use meanwhile is kept if its use ends cleanly
        (it answered after the fault), else it fails and renews in turn. Several uses
        failing at once renew more than once: bounded by the pool's size."""
        idle = self._idle
        while idle:
            raw, _ = idle.pop()
            if _usable(raw):  # (asyncpg takes back one it saw closed by itself)
                raw.terminate()  # no round trip: it may be as dead as the one that failed
            await self._hand_back(raw)
        if self._pool is not None:
            await self._pool.expire_connections()

    async def _reconnect(self, lost: asyncpg.Connection) -> asyncpg.Connection:
        """A fresh connection in place of ``lost``, which the server dropped while the
        caller had sent nothing that could have changed data (a read, a ``BEGIN``)."""
        await self._release(lost)
        return await self._acquire()

    async def _trim(self, cutoff: float) -> None:
        """Hand connections idle since before ``cutoff`` back to asyncpg's pool."""
        idle = self._idle
        while idle and idle[0][1] < cutoff:
            raw, _ = idle.pop(0)
            await self._hand_back(raw)

    async def _acquire(self) -> asyncpg.Connection:
        """A connection from the pool, for :meth:`_give_back` after a clean use and
        :meth:`_release` after an error.

        Connections that ended their last use cleanly wait in :attr:`_idle` (last in,
        first out: its prepared statements are warm) and are handed out from there with
        no await. asyncpg's own acquire and release cost about a sixth of a plain
        PostgreSQL turn's event-loop time (py-spy: ``wait_for`` for the acquire timeout,
        a ``shield`` task and a timeout scope for each release, four times per turn);
        they remain the way in when no connection is idle (with the timeout: a 503 past
        it), the way out while anyone waits in that way in (so that they are served in
        asyncpg's order, not starved by later callers served from here), and the way
        out after an error, where asyncpg finishes a cancelled query or terminates a
        broken connection. A connection left on the list for :data:`IDLE_S` goes back to
        asyncpg, whose inactivity timeout closes it: a burst's connections are not kept
        open for ever (any use, the heartbeat's too, trims the list).
        """
        self.uses += 1
        idle = self._idle
        while idle:
            raw, _ = idle.pop()
            if _usable(raw):
                return raw
            await self._release(raw)  # the server dropped it meanwhile: renew them all
        pool = await self._ensure()
        self._waiting += 1
        try:
            return await pool.acquire(timeout=self.acquire_timeout_s)
        except _DRIVER_ERRORS as exc:
            raise _wrap(exc, "CONNECT", ()) from exc
        finally:
            self._waiting -= 1

    async def _release(self, raw: asyncpg.Connection) -> None:
        """``raw`` back to asyncpg (after an error, asyncpg finishes a cancelled query
        or cleans up a broken connection), the pool renewed first if the server dropped
        ``raw``."""
        if not _usable(raw):
            await self._renew()
        await self._hand_back(raw)

    async def _hand_back(self, raw: asyncpg.Connection) -> None:
        pool = self._pool
        try:
            if pool is None:
                raise asyncpg.InterfaceError("pool is closed")
            await pool.release(raw)
        except _DRIVER_ERRORS:
            # A connection the server dropped mid-operation cannot be reset: close it
            # (asyncpg may already have taken it back); the pool opens a new one.
            with contextlib.suppress(Exception):
                raw.terminate()

    @asynccontextmanager
    async def transaction(self, *, readonly: bool = False) -> AsyncIterator[PgConnection]:
        """A pooled connection inside ``BEGIN`` ... ``COMMIT`` (rolled back on error).

        A ``BEGIN`` that finds the connection dropped by the server has changed nothing:
        it runs once more on a fresh connection (:meth:`_reconnect`). A block that ends
        without an error after one of its statements failed outside a savepoint (the
        caller caught the error) is rolled back and that error raised again
        (:meth:`PgConnection.raise_aborted`): PostgreSQL aborted the transaction at the error and
        answers its ``COMMIT`` with ``ROLLBACK``, which asyncpg does not report, so the
        caller was told its writes committed while none had."""
        trace = self.trace
        raw = await self._acquire()
        try:
            tr = raw.transaction(readonly=readonly)
            if trace is not None:
                trace("BEGIN")  # each its own round trip, counted like statements
            try:
                await tr.start()
            except _DRIVER_ERRORS as exc:
                if _usable(raw):
                    raise _wrap(exc, "BEGIN", ()) from exc
                raw = await self._reconnect(raw)
                tr = raw.transaction(readonly=readonly)
                try:
                    await tr.start()
                except _DRIVER_ERRORS as again:
                    raise _wrap(again, "BEGIN", ()) from again
            conn = PgConnection(raw, self.plans, trace, changes=self.changes)
            try:
                try:
                    yield conn
                    conn.raise_aborted()
                except BaseException:
                    if trace is not None:
                        trace("ROLLBACK")
                    try:
                        await tr.rollback()
                    except _DRIVER_ERRORS:
                        pass  # the connection is gone; the server rolled back already
                    raise
                if trace is not None:
                    trace("COMMIT")
                try:
                    await tr.commit()
                except _DRIVER_ERRORS as exc:
                    raise _wrap(exc, "COMMIT", ()) from exc
            finally:
                if conn.wrote:  # committed or not, what was read meanwhile may be stale
                    self.changes.wrote(conn.wrote)
        except BaseException:
            await self._release(raw)
            raise
        await self._give_back(raw)

    async def execute_alone(
        self, statement: sa.Executable, parameters: Mapping[str, Any]
    ) -> Result:
        """One statement on a pooled connection outside a transaction block, as a
        transaction by itself (PostgreSQL runs a single statement atomically): one round
        trip instead of ``BEGIN``, the statement, ``COMMIT``. Not a context manager (as
        :meth:`read` is): an async generator per ``async with`` (each also
        registered with the event loop and dropped again) costs a few microseconds,
        and a plain turn runs two of these."""
        raw = await self._acquire()
        conn = PgConnection(raw, self.plans, self.trace, changes=self.changes)
        try:
            result = await conn.execute(statement, parameters)
        except BaseException:
            await self._release(raw)
            raise
        finally:
            if conn.wrote:
                self.changes.wrote(conn.wrote)
        await self._give_back(raw)
        return result

    @asynccontextmanager
    async def read(self) -> AsyncIterator[PgConnection]:
        """A pooled connection for SELECT statements, outside a transaction block.

        At PostgreSQL's READ COMMITTED level every statement sees the data committed when
        it started, inside ``BEGIN READ ONLY`` ... ``COMMIT`` or not: the block added two
        round trips per read (a Slack event's route lookup was three instead of one) and
        no consistency. Writes are refused here instead of by the server. A statement
        that finds the connection dropped by the server runs once more on a fresh one."""
        conn = PgConnection(
            await self._acquire(),
            self.plans,
            self.trace,
            readonly=True,
            changes=self.changes,
            reconnect=self._reconnect,
        )
        try:
            yield conn
        except BaseException:
            await self._release(conn.raw)
            raise
        await self._give_back(conn.raw)

    async def close(self) -> None:
        """Close every pooled connection."""
        if self._pool is not None:
            idle, self._idle = self._idle, []
            for raw, _ in idle:
                await self._hand_back(raw)
            pool, self._pool = self._pool, None
            await pool.close()
