"""Fakes of the core's small ports, shared by the adapter tests (not mocks: they keep
the state a test asserts on)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, cast

from aiohttp import web

from bots.base import Adapter
from leadgate.core.errors import ModelError, Unavailable
from leadgate.core.types import (
    BindingKind,
    Conversations,
    Inbound,
    Outcome,
    Recorded,
    Reply,
    Routed,
    RouteMatch,
    Trigger,
)
from leadgate.database.db import _TOPICS, Database
from leadgate.database.faults import unavailable
from leadgate.turns.providers.base import ModelEvent, ModelRequest, TextDelta

RouteFn = Callable[[str, Mapping[str, str]], RouteMatch | None]


class GateProvider:
    """A model that answers only when released (a turn kept in flight); ``cancelled``
    counts the turns cancelled while they waited. ``failure`` set: released, the turn
    fails with it instead. ``text``: what it answers (two held models told apart)."""

    def __init__(self, text: str = "slow answer") -> None:
        self.release = asyncio.Event()
        self.calls = 0
        self.cancelled = 0
        self.failure: Exception | None = None
        self.text = text

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        self.calls += 1
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.failure is not None:
            raise self.failure
        yield TextDelta(self.text)


class FaultProvider:
    """A model whose turn meets a database fault after the message was taken in (a
    message ``once``: only its first turn does; the next answers it; ``fails later``:
    the next fails, a model error)."""

    def __init__(self) -> None:
        self.faulted: set[str] = set()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        last = request.messages[-1].content
        if last == "model":
            raise ModelError("the provider failed", rule="model.failed")
        if last == "fails later" and last in self.faulted:
            raise ModelError("the provider failed", rule="model.failed")
        if last == "once" and last in self.faulted:
            yield TextDelta("answered once the database was back")
            return
        self.faulted.add(last)
        fault = Unavailable("database is locked", rule="service.unavailable")
        fault.detail = "database is locked (what the driver said)"
        raise fault
        yield TextDelta("never")  # pragma: no cover - makes this an async generator


class FakeCore:
    """:class:`bots.base.Core` that records what an adapter asks of it.

    ``routes`` is a list of ``(match, route)`` pairs (exact match on the given keys, first
    wins) or a function ``(channel, attrs) -> route``. ``submit`` (the turn) records the
    trigger, waits for ``gate`` (set by default) and ``submit_delay_s``, and answers
    ``outcome``.
    """

    def __init__(
        self,
        routes: list[tuple[dict[str, str], RouteMatch]] | RouteFn | None = None,
        *,
        outcome: Outcome | None = None,
        submit_delay_s: float = 0.0,
    ) -> None:
        self.routes = routes if routes is not None else []
        self.outcome: Outcome = outcome if outcome is not None else Reply("fine")
        self.submit_delay_s = submit_delay_s
        self.lookups: list[tuple[str, dict[str, str]]] = []
        self.triggers: list[Trigger] = []
        self.submitted = asyncio.Event()
        self.gate = asyncio.Event()
        self.gate.set()
        self.tasks: list[asyncio.Task[object]] = []
        self.recorded: list[Inbound] = []
        self.event_lookups: list[str] = []
        self.sent_lookups: list[str] = []

    async def resolve_route(self, channel: str, attrs: Mapping[str, str]) -> RouteMatch | None:
        self.lookups.append((channel, dict(attrs)))
        if callable(self.routes):
            return self.routes(channel, attrs)
        for match, route in self.routes:
            if all(attrs.get(k) == v for k, v in match.items()):
                return route
        return None

    async def submit(self, trigger: Trigger) -> Outcome:
        self.triggers.append(trigger)
        self.submitted.set()
        await self.gate.wait()
        await asyncio.sleep(self.submit_delay_s)
        return self.outcome

    async def take_inbound(self, inbound: Inbound) -> Routed | None:
        recorded = await self.record_inbound(inbound)
        return None if recorded is None else await self.run_recorded(recorded)

    async def record_inbound(self, inbound: Inbound, *, notice: bool = True) -> Recorded | None:
        """Route (the fake's "record"); the trigger is submitted by run_recorded."""
        route = await self.resolve_route(inbound.channel.value, inbound.route_attrs)
        if route is None:
            return None
        self.recorded.append(inbound)
        return Recorded(route, turn=inbound.trigger(route))

    async def run_recorded(self, recorded: Recorded) -> Routed | None:
        return Routed(await self.submit(recorded.turn), recorded.route)

    def spawn(self, coro: Awaitable[object], *, name: str) -> None:
        async def run() -> object:
            return await coro

        self.tasks.append(asyncio.create_task(run(), name=name))

    async def drain(self) -> None:
        await asyncio.wait_for(asyncio.gather(*self.tasks), timeout=5)

    async def event_session_key(self, external_event_id: str) -> str | None:
        """The session key of the message recorded here under ``external_event_id``
        (each look-up kept in :attr:`event_lookups`)."""
        self.event_lookups.append(external_event_id)
        for inbound in self.recorded:
            if inbound.external_event_id == external_event_id:
                return inbound.session_key
        return None

    async def email_reply_session_key(
        self, org_id: str, message_id: str, *, sent_to: str, sent_from: str
    ) -> str | None:
        """None: nothing is sent here (each look-up kept in :attr:`sent_lookups`)."""
        self.sent_lookups.append(message_id)
        return None

    async def conversations(
        self, channel: BindingKind, *, key_prefix: str, window_ms: int
    ) -> Conversations:
        """Nothing taken in before and no route naming a channel: nothing to catch up."""
        return Conversations(0, {}, ())

    async def advance_read_points(
        self,
        channel: BindingKind,
        points: Mapping[str, int],
        *,
        read_through: bool = False,
        kept: bool = False,
    ) -> None:
        """No read point is kept (nothing is caught up here)."""

    @property
    def route_queries(self) -> list[dict[str, str]]:
        """The attributes of every route look-up, in order."""
        return [attrs for _, attrs in self.lookups]


def mount_adapter(app: web.Application, adapter: Adapter) -> None:
    """Mount ``adapter`` on ``app`` the way the composition root does: its routes, its
    lifespan for the app's lifetime, and its channel closed at the end."""
    adapter.mount(app)

    async def ctx(_app: web.Application) -> AsyncIterator[None]:
        async with adapter.lifespan():
            yield
        await adapter.channel.close()

    app.cleanup_ctx.append(ctx)


class DownFor:
    """``Database.read``/``tx`` replaced for the next ``n`` calls, the database "gone"
    (Unavailable) in one of the two ways a transaction meets it.

    ``after_commit=False``: before the call's work (nothing stored; ``in_doubt`` False,
    as the database layer raises a fault met before the COMMIT). ``after_commit=True``:
    the work runs and commits, and then the caller is told the connection dropped at
    the COMMIT, as the database layer tells it on PostgreSQL: an ``Unavailable`` with
    ``in_doubt`` True, the transaction's signals handed to the ``on_doubt_payloads``
    listeners instead of the commit listeners. A SQLite COMMIT runs in this process and
    cannot be lost this way (``_InlineTx.__aexit__``): on SQLite a test must say it
    runs a path that does not depend on the backend (``sqlite_too``). ``error`` (with
    ``after_commit=False``): what the call raises instead (a damaged database, say)."""

    def __init__(
        self,
        real: Callable[[], Any],
        n: int,
        *,
        after_commit: bool,
        sqlite_too: bool = False,
        error: Callable[[], Exception] | None = None,
    ) -> None:
        self.real, self.n, self.after_commit = real, n, after_commit
        self.error = error or (lambda: Unavailable("database down", rule="service.unavailable"))
        if after_commit:
            _may_lose_a_commit(real, sqlite_too)

    def __call__(self) -> Any:
        if self.n == 0:
            return self.real()
        self.n -= 1
        real, after, error = self.real, self.after_commit, self.error

        class _Ctx:
            async def __aenter__(self) -> Any:
                if not after:
                    raise error()
                self.inner = real()
                # (The work's signals: see __aexit__.)
                conn, self.topics = await _entered_unheard(self.inner)
                return conn

            async def __aexit__(self, *exc: Any) -> None:
                await self.inner.__aexit__(*exc)  # committed (or rolled back: exc)
                if exc[0] is None:  # committed, and the caller is told it is in doubt
                    fault = _lost_at_commit()
                    _database(real)._in_doubt(fault, self.topics)
                    raise fault

        return _Ctx()


class DownAloneFor:
    """``Database.write_alone`` replaced for the next ``n`` calls, as :class:`DownFor`:
    the statement runs (or not) and then the database is "gone"; after it ran, in doubt
    (``signals`` and ``in_doubt`` to the doubt listeners, as on PostgreSQL)."""

    def __init__(
        self, real: Callable[..., Any], n: int, *, after_commit: bool, sqlite_too: bool = False
    ) -> None:
        self.real, self.n, self.after_commit = real, n, after_commit
        if after_commit:
            _may_lose_a_commit(real, sqlite_too)

    async def __call__(
        self,
        statement: Any,
        parameters: Any,
        *,
        signals: Sequence[tuple[str, Any]] = (),
        signals_from: Any = None,
        in_doubt: Sequence[tuple[str, Any]] = (),
    ) -> Any:
        if self.n == 0:
            return await self.real(
                statement, parameters, signals=signals, signals_from=signals_from, in_doubt=in_doubt
            )
        self.n -= 1
        if not self.after_commit:
            raise Unavailable("database down", rule="service.unavailable")
        await self.real(statement, parameters)  # its signals: to the doubt listeners
        fault = _lost_at_commit()
        topics: dict[str, list[Any]] = {}
        for topic, payload in (*signals, *in_doubt):
            topics.setdefault(topic, []).extend(() if payload is None else (payload,))
        _database(self.real)._in_doubt(fault, topics)
        raise fault


class LandsLater:
    """``Database.write_alone`` replaced for its next call: the statement does not run
    yet, and its caller is told the connection dropped with it sent (an ``Unavailable``
    in doubt, its signals to the doubt listeners) as :class:`DownAloneFor` tells it.
    :meth:`land` runs it afterwards: the server applied it after the caller's read-back
    on a fresh connection had raced it and found nothing. Later calls run as they are.
    PostgreSQL only (a SQLite write is never in doubt).

    ``fault``: the caller is told this error instead, not in doubt (nothing goes to the
    doubt listeners): a failure that claims to have stored nothing, and the server
    applied the statement all the same."""

    def __init__(
        self, real: Callable[..., Any], *, fault: Callable[[], Exception] | None = None
    ) -> None:
        _may_lose_a_commit(real, False)
        self.real = real
        self.fault = fault
        self.held: tuple[Any, Any] | None = None
        self.lost = False

    async def __call__(
        self,
        statement: Any,
        parameters: Any,
        *,
        signals: Sequence[tuple[str, Any]] = (),
        signals_from: Any = None,
        in_doubt: Sequence[tuple[str, Any]] = (),
    ) -> Any:
        if self.lost:
            return await self.real(
                statement, parameters, signals=signals, signals_from=signals_from, in_doubt=in_doubt
            )
        self.lost = True
        self.held = (statement, parameters)
        if self.fault is not None:
            raise self.fault()
        fault = _lost_at_commit()
        topics: dict[str, list[Any]] = {}
        for topic, payload in (*signals, *in_doubt):
            topics.setdefault(topic, []).extend(() if payload is None else (payload,))
        _database(self.real)._in_doubt(fault, topics)
        raise fault

    async def land(self) -> Any:
        """Run the statement whose answer was lost (what it returns)."""
        assert self.held is not None, "no statement was lost"
        statement, parameters = self.held
        self.held = None
        return await self.real(statement, parameters)


class StallsOnce:
    """``Database.read``/``tx`` replaced for its next call: entering it waits until its
    task is cancelled (a look a shutdown, or a client gone, cuts short); ``entered`` is
    set once it waits. Later calls run as they are."""

    def __init__(self, real: Callable[[], Any]) -> None:
        self.real = real
        self.entered = asyncio.Event()
        self.used = False

    def __call__(self) -> Any:
        if self.used:
            return self.real()
        self.used = True
        entered = self.entered

        class _Ctx:
            async def __aenter__(self) -> Any:
                entered.set()
                await asyncio.Event().wait()

            async def __aexit__(self, *exc: Any) -> None:
                return None

        return _Ctx()


class HeldCommits:
    """A :class:`Database` stand-in (every other member the real one's) whose write
    transactions run their work and then hold their ``COMMIT``, their row locks held,
    until :attr:`release` is set; :attr:`reached` is set once one got there. Passed to
    one function of our own in place of its database (``monkeypatch`` its call), it holds
    that function's transaction open mid-way, as a process paused before its commit: a
    contender started meanwhile meets its locks (:func:`tests.helpers.blocked_on_a_lock`)
    or skips them. :func:`tests.helpers.held_open` holds a test's own work instead."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.reached = asyncio.Event()
        self.release = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)

    @property
    def database(self) -> Database:
        """This stand-in, typed as the database it stands in for."""
        return cast(Database, self)

    @contextlib.asynccontextmanager
    async def tx(self) -> AsyncIterator[Any]:
        async with self.db.tx() as conn:
            yield conn
            self.reached.set()
            await self.release.wait()


async def _entered_unheard(tx: Any) -> tuple[Any, dict[str, list[Any]]]:
    """Enter ``tx`` (a real ``Database.tx()``) with the signals its work raises kept in a
    dict of their own, away from the commit listeners: the fake decides whether and when
    they are heard (a commit its caller is told is in doubt, or that lands later)."""
    conn = await tx.__aenter__()
    topics: dict[str, list[Any]] = {}
    if conn.info.get(_TOPICS) is not None:
        conn.info[_TOPICS] = topics
    return conn, topics


class CommitLandsLater:
    """``Database.tx`` replaced for its next call: the transaction's work runs but its
    ``COMMIT`` waits (the transaction stays open, holding its row locks, its rows seen
    by no other connection), and its caller is told the connection dropped with the
    ``COMMIT`` sent (an ``Unavailable`` in doubt, its signals to the doubt listeners),
    as :class:`DownFor` tells it. :meth:`land` commits it afterwards: the server applied
    the ``COMMIT`` after the caller's read-back or give-back on a fresh connection had
    raced it and found nothing (a claim with ``SKIP LOCKED`` passes the locked rows by).
    Later calls run as they are. PostgreSQL only (a SQLite COMMIT is never in doubt).

    Made by the ``commit_lands_later`` fixture, which rolls back a transaction still
    held when the test ends, however it ends (:meth:`abandon`): held, it keeps a pooled
    connection checked out, and closing the pool at teardown waits for it for ever."""

    def __init__(self, real: Callable[[], Any]) -> None:
        _may_lose_a_commit(real, False)
        self.real = real
        self.held: Any = None
        self.lost = False

    def __call__(self) -> Any:
        if self.lost:
            return self.real()
        self.lost = True
        outer = self

        class _Ctx:
            async def __aenter__(self) -> Any:
                self.inner = outer.real()
                conn, self.topics = await _entered_unheard(self.inner)
                return conn

            async def __aexit__(self, *exc: Any) -> None:
                if exc[0] is not None:
                    await self.inner.__aexit__(*exc)
                    return
                outer.held = self.inner
                fault = _lost_at_commit()
                _database(outer.real)._in_doubt(fault, self.topics)
                raise fault

        return _Ctx()

    async def land(self) -> None:
        """Commit the transaction whose answer was lost."""
        assert self.held is not None, "no transaction was lost"
        held, self.held = self.held, None
        await held.__aexit__(None, None, None)

    async def abandon(self) -> None:
        """Roll back the transaction whose answer was lost, if it never landed: its
        connection goes back to the pool, its row locks with it."""
        held, self.held = self.held, None
        if held is not None:
            gone = _Abandoned("the test ended before the commit landed")
            await held.__aexit__(_Abandoned, gone, None)


class _Abandoned(Exception):
    """Rolls back a transaction :class:`CommitLandsLater` still holds (not a database
    fault: the database layer passes it through as it is)."""


def _database(method: Callable[..., Any]) -> Database:
    """The :class:`Database` whose method ``method`` is."""
    database = getattr(method, "__self__", None)
    assert isinstance(database, Database), method
    return database


def _may_lose_a_commit(real: Callable[..., Any], sqlite_too: bool) -> None:
    assert sqlite_too or _database(real).is_postgres, (
        "a SQLite COMMIT's answer cannot be lost: pass sqlite_too for a path that does"
        " not depend on the backend"
    )


def _lost_at_commit() -> Unavailable:
    """What the database layer raises when the connection dropped with the COMMIT sent
    (``leadgate.database.db._raise_fault``): the fault, in doubt."""
    fault = unavailable(ConnectionResetError("connection reset by peer"))
    assert fault is not None
    fault.in_doubt = True
    return fault


def lose_the_next_commit(
    monkeypatch: Any, db: Any, *, alone: bool, sqlite_too: bool = False
) -> None:
    """The next write of ``db`` commits and its caller is told the connection dropped at
    COMMIT (Unavailable, in doubt): the next ``write_alone`` statement when ``alone`` (a
    write PostgreSQL runs as one statement), else the next ``tx``. PostgreSQL only,
    unless ``sqlite_too`` (see :class:`DownFor`)."""
    if alone:
        fake: Any = DownAloneFor(db.write_alone, 1, after_commit=True, sqlite_too=sqlite_too)
        monkeypatch.setattr(db, "write_alone", fake)
    else:
        monkeypatch.setattr(db, "tx", DownFor(db.tx, 1, after_commit=True, sqlite_too=sqlite_too))


class ClaimInDoubt:
    """A runner's next claim meets a ``COMMIT`` in doubt (PostgreSQL) that landed at
    once (``lands`` "at its commit") or lands after the runner's next pass looked for it
    and found nothing ("after the next look"), for the tests of the look that follows
    (:class:`leadgate.core.runners.LostClaims`). Made by the ``claim_in_doubt`` fixture,
    once per case."""

    def __init__(
        self,
        lands: str,
        monkeypatch: Any,
        commit_lands_later: Callable[[Database], CommitLandsLater],
    ) -> None:
        self.lands = lands
        self.monkeypatch = monkeypatch
        self.commit_lands_later = commit_lands_later
        self.late: CommitLandsLater | None = None

    def arm(self, db: Database) -> None:
        """Make ``db``'s next transaction the claim in doubt."""
        if self.lands == "at its commit":
            lose_the_next_commit(self.monkeypatch, db, alone=False)
        else:
            self.late = self.commit_lands_later(db)

    async def until_found(self, runner: Any, clock: Any) -> None:
        """After the claim failed: a claim that lands later is not found by the next
        pass, and once it has landed the runner's next look is due a second on (not when
        the lease lapses); the clock is moved there."""
        if self.late is None:
            return
        assert not await runner.run_once()  # not landed yet: nothing found
        await self.late.land()
        if runner.due_in_s() < 1.0:
            # That pass's claim met the rows still locked by the COMMIT under way, and a
            # claim that skips locked rows looks again soon: that look finds them taken.
            assert not await runner.run_once()
        assert runner.due_in_s() == 1.0
        clock.advance(1_000)
