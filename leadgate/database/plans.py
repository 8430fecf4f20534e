"""SQLAlchemy Core statements compiled once, executed by our own thin drivers.

SQLAlchemy's asyncio layer costs several thread hops and greenlet switches per statement
(0.3-0.5 ms of event-loop time, against 10-30 us for SQLite itself and one round trip for
PostgreSQL); building a statement and its cache key costs as much again. The service
therefore runs its Core statements on two small drivers — the stdlib ``sqlite3``
connection on the loop (:mod:`.inline_sqlite`) and ``asyncpg`` directly (:mod:`.pg`) —
and only the *compilation* is SQLAlchemy's: SQL text, parameter order, the dialect's
bind and result processors, expanding ``IN`` lists, Python-side column defaults, all
exactly as SQLAlchemy would have run them.

A :class:`Plan` is cached per statement object (by ``id`` with a weak reference, see
:class:`PlanCache`) and per set of parameter names, so the hot statements, built once at
import time, compile once per process.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import sqlalchemy as sa
from sqlalchemy.engine import Dialect, Row
from sqlalchemy.engine.result import result_tuple

#: A row of any number of columns. (SQLAlchemy 2.1 types ``Row`` by its columns:
#: ``Row[Any]`` is a row of one, which made unpacking or indexing a two-column row a
#: type error, so callers read columns by name to please the checker.)
AnyRow: TypeAlias = Row[*tuple[Any, ...]]

_Processor = Callable[[Any], Any] | None


@dataclass(slots=True)
class Plan:
    """A statement compiled for one dialect and one set of parameter names."""

    sql: str
    names: tuple[str, ...]
    processors: tuple[_Processor, ...]
    defaults: Mapping[str, Any]
    # Set when the caller supplies an expanding (IN) parameter: the SQL depends on its
    # length, so it is expanded per call.
    compiled: Any | None
    bind_processors: Mapping[str, _Processor]
    #: result column keys (None: the statement returns no rows)
    keys: tuple[str, ...] | None
    result_processors: tuple[_Processor, ...] | None
    make_row: Callable[[Sequence[Any]], AnyRow] | None
    #: INSERT/UPDATE/DELETE ... RETURNING (its rowcount is the number of rows returned)
    returning: bool = False
    #: Python-side column defaults by bind name (for :meth:`args` with extracted values)
    prefetch: Mapping[str, Any] | None = None
    #: the compiled statement, kept for statements reused by cache key (see PlanCache)
    full: Any | None = None
    #: the table an INSERT/UPDATE/DELETE writes; ``"*"`` for a ``text()`` statement that
    #: is not a plain SELECT (it may write anything); None for a SELECT
    writes: str | None = None

    def args(
        self, params: Mapping[str, Any], extracted: Sequence[Any] | None = None
    ) -> tuple[str, list[Any]]:
        """(SQL, positional arguments) for one execution with ``params``.

        ``extracted`` are the literal bound values of the statement *object* executed,
        when the plan was compiled from another object with the same SQLAlchemy cache key
        (a statement built per call); the plan's own literals are then not used."""
        if extracted is not None:
            return self._args_extracted(params, extracted)
        sql, names, processors = self.sql, self.names, self.processors
        if self.compiled is not None:
            state = self.compiled.construct_expanded_state(params)
            sql, names = state.statement, tuple(state.positiontup or ())
            bind_processors = {**self.bind_processors, **state.processors}
            processors = tuple(bind_processors.get(n) for n in names)
            params = {**state.parameters, **params}
        defaults = self.defaults
        return sql, [
            (params[name] if name in params else defaults[name])
            if proc is None
            else proc(params[name] if name in params else defaults[name])
            for name, proc in zip(names, processors, strict=True)
        ]

    def _args_extracted(
        self, params: Mapping[str, Any], extracted: Sequence[Any]
    ) -> tuple[str, list[Any]]:
        full = self.full
        assert full is not None, "a plan reused by cache key keeps its compiled statement"
        values = full.construct_params(params, extracted_parameters=extracted, _no_postcompile=True)
        if self.prefetch:
            for name, value in self.prefetch.items():
                if name not in params:
                    values[name] = value
        if self.compiled is not None or full.post_compile_params:
            state = full._process_parameters_for_postcompile(values)
            names = tuple(state.positiontup or ())
            bind_processors = {**self.bind_processors, **state.processors}
            merged = state.parameters
            return state.statement, [
                merged[n] if bind_processors.get(n) is None else bind_processors[n](merged[n])
                for n in names
            ]
        return self.sql, [
            values[n] if p is None else p(values[n])
            for n, p in zip(self.names, self.processors, strict=True)
        ]

    def rows(
        self, raw_rows: Sequence[Sequence[Any]], names: Callable[[], Sequence[str]] | None = None
    ) -> list[AnyRow]:
        """Raw driver rows as SQLAlchemy :class:`Row` objects, result processors applied.

        ``names`` gives the column names the driver reported, for statements whose
        columns SQLAlchemy does not know (``text()``)."""
        if not raw_rows:
            return []
        make = self.make_row
        if make is None:
            if names is None:
                return []
            make = self.make_row = result_tuple(list(names()))
        procs = self.result_processors
        if procs is None:
            return list(map(make, raw_rows))
        return [
            make([p(v) if p is not None else v for p, v in zip(procs, raw, strict=True)])
            for raw in raw_rows
        ]


def compile_plan(
    statement: sa.Executable, keys: frozenset[str], dialect: Dialect, cache_key: Any = None
) -> Plan:
    """Compile ``statement`` for ``dialect`` given the parameter names the caller passes
    (``cache_key``: the statement's SQLAlchemy cache key, to reuse the plan for other
    statement objects with the same key)."""
    if isinstance(statement, sa.TextClause):
        compiled: Any = statement.compile(dialect=dialect)
    elif isinstance(statement, sa.Select | sa.Insert | sa.Update | sa.Delete):
        column_keys = sorted(keys) if isinstance(statement, sa.Insert | sa.Update) else None
        compiled = statement.compile(dialect=dialect, column_keys=column_keys, cache_key=cache_key)
    else:
        raise TypeError(f"only Core SELECT/INSERT/UPDATE/DELETE and text() run here: {statement!r}")
    expanding = {p.key for p in compiled.post_compile_params}
    # Expand the literal IN lists once; only caller-supplied lists expand per call.
    # (A required parameter the caller did not name fails here, in SQLAlchemy.)
    dummy: dict[str, Any] = {name: None for name in keys if name not in expanding}
    dummy.update({name: [None] for name in keys & expanding})
    state = compiled.construct_expanded_state(dummy)
    names = tuple(state.positiontup or ())
    bind_processors: dict[str, _Processor] = {
        name: bind.type.dialect_impl(dialect).bind_processor(dialect)
        for name, bind in compiled.binds.items()
    }
    bind_processors.update(state.processors)
    defaults = {n: v for n, v in state.parameters.items() if n not in keys}
    # Python-side column defaults the compiler left to the execution context.
    prefetch: dict[str, Any] = {}
    for column in getattr(compiled, "insert_prefetch", ()) + getattr(
        compiled, "update_prefetch", ()
    ):
        default = column.default if column.key in defaults else None
        if default is None or not default.is_scalar:
            raise TypeError(f"cannot evaluate the default of {column} outside SQLAlchemy")
        defaults[column.key] = prefetch[column.key] = default.arg
    result_keys: tuple[str, ...] | None = None
    result_processors = None
    make_row = None
    columns = getattr(compiled, "_result_columns", None) or []
    if columns:
        result_keys = tuple(entry[0] for entry in columns)
        procs = tuple(
            entry[3].dialect_impl(dialect).result_processor(dialect, None) for entry in columns
        )
        if any(p is not None for p in procs):
            result_processors = procs
        make_row = result_tuple(list(result_keys))
    return Plan(
        sql=state.statement,
        names=names,
        processors=tuple(bind_processors.get(n) for n in names),
        defaults=defaults,
        compiled=compiled if keys & expanding else None,
        bind_processors=bind_processors,
        keys=result_keys,
        result_processors=result_processors,
        make_row=make_row,
        returning=result_keys is not None and not isinstance(statement, sa.Select),
        prefetch=prefetch,
        full=compiled if cache_key is not None else None,
        writes=_written_table(statement, state.statement),
    )


def _written_table(statement: sa.Executable, sql: str) -> str | None:
    if isinstance(statement, sa.Insert | sa.Update | sa.Delete):
        target = statement.table
        # A join or an alias as the target: counted as "anything" (an alias's name is
        # not its table's).
        return target.name if isinstance(target, sa.TableClause) else "*"
    if isinstance(statement, sa.TextClause) and not sql.lstrip()[:6].upper() == "SELECT":
        return "*"
    return None


class PlanCache:
    """Plans by statement object, or by SQLAlchemy cache key, and parameter names.

    Two levels:

    * by ``id()`` of the statement object (hot statements are built once at import
      time; a WeakKeyDictionary lookup would cost more than running a small statement),
      with a weak reference that drops the entry when a transient statement is
      collected, before its id can be reused;
    * by the statement's SQLAlchemy cache key, for statements built per call
      (``update().where(id == item_id)``): generating the key costs a few tens of
      microseconds, compiling the statement a millisecond. Such a plan runs with the
      literal values extracted from the object at hand (``Plan.args(extracted=...)``).
    """

    #: Plans kept by cache key (least recently compiled first out).
    MAX_BY_KEY = 4096

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self._plans: dict[int, tuple[weakref.ref[Any], dict[frozenset[str], tuple[Plan, Any]]]] = {}
        self._by_key: dict[tuple[Any, frozenset[str]], Plan] = {}
        self.compiled = 0  # statements compiled (tests: hot paths compile once)

    def plan(self, statement: sa.Executable, keys: frozenset[str]) -> tuple[Plan, Any]:
        """(plan, extracted literal values or None) of ``statement`` for parameters
        named ``keys``; pass both to :meth:`Plan.args`."""
        known = self._plans.get(id(statement))
        if known is None or known[0]() is not statement:
            known = self._plans[id(statement)] = (self._watch(statement), {})
        found = known[1].get(keys)
        if found is None:
            found = known[1][keys] = self._find(statement, keys)
        return found

    def _find(self, statement: sa.Executable, keys: frozenset[str]) -> tuple[Plan, Any]:
        cache_key = None
        if not isinstance(statement, sa.TextClause):
            cache_key = statement._generate_cache_key()  # type: ignore[attr-defined]
        if cache_key is None:
            self.compiled += 1
            return compile_plan(statement, keys, self.dialect), None
        by_key = (cache_key.key, keys)
        plan = self._by_key.get(by_key)
        if plan is not None:
            # Without literal values (``t.audit.insert()`` built in two places) the plan's
            # own arguments are this object's too: take the fast path of Plan.args.
            return plan, (cache_key.bindparams or None)
        self.compiled += 1
        plan = compile_plan(statement, keys, self.dialect, cache_key)
        if len(self._by_key) >= self.MAX_BY_KEY:
            del self._by_key[next(iter(self._by_key))]
        self._by_key[by_key] = plan
        # Compiled from this very object: its literals are the plan's own.
        return plan, None

    def _watch(self, statement: Any) -> weakref.ref[Any]:
        key = id(statement)
        plans = self._plans

        def forget(ref: weakref.ref[Any]) -> None:
            known = plans.get(key)
            if known is not None and known[0] is ref:
                del plans[key]

        return weakref.ref(statement, forget)

    def __len__(self) -> int:
        return len(self._plans)


class Result:
    """The rows (already fetched) and rowcount of one statement, with the parts of
    SQLAlchemy's ``Result`` the service uses."""

    __slots__ = ("_rows", "rowcount")

    def __init__(self, rows: list[AnyRow], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    def first(self) -> AnyRow | None:
        """The first row, or None."""
        return self._rows[0] if self._rows else None

    def one(self) -> AnyRow:
        """Exactly one row (``NoResultFound``/``MultipleResultsFound`` otherwise)."""
        if not self._rows:
            raise sa.exc.NoResultFound("No row was found when one was required")
        if len(self._rows) > 1:
            raise sa.exc.MultipleResultsFound("Multiple rows were found when one was required")
        return self._rows[0]

    def one_or_none(self) -> AnyRow | None:
        """One row, None for none (``MultipleResultsFound`` for more)."""
        if len(self._rows) > 1:
            raise sa.exc.MultipleResultsFound("Multiple rows were found when one or none was")
        return self.first()

    def all(self) -> Sequence[AnyRow]:
        """Every row."""
        return self._rows

    def scalar(self) -> Any:
        """The first column of the first row, or None."""
        return self._rows[0][0] if self._rows else None

    def scalar_one(self) -> Any:
        """The first column of exactly one row (as :meth:`one`)."""
        return self.one()[0]

    def scalars(self) -> Scalars:
        """The first column of every row."""
        return Scalars([row[0] for row in self._rows])

    def mappings(self) -> list[Mapping[str, Any]]:
        """Every row as a mapping by column key."""
        return [dict(row._mapping) for row in self._rows]

    def __iter__(self) -> Iterator[AnyRow]:
        return iter(self._rows)


class Scalars:
    """:meth:`Result.scalars`."""

    __slots__ = ("_values",)

    def __init__(self, values: list[Any]) -> None:
        self._values = values

    def all(self) -> list[Any]:
        """Every value."""
        return self._values

    def first(self) -> Any:
        """The first value, or None."""
        return self._values[0] if self._values else None

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)
