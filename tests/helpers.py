"""Test helpers that create real rows through the real engine functions."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import re
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import pytest
import sqlalchemy as sa

from binding import routes
from leadgate.core.auth import Principal, Scope
from leadgate.core.clock import Clock, FakeClock, IdFactory
from leadgate.core.errors import Unavailable
from leadgate.core.metrics import METRICS
from leadgate.core.types import BindingKind, BindingSpec, Trigger
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database
from leadgate.domain import agents as agents_mod
from leadgate.domain import orgs, workitems
from outbox.channel import Card, CardOutcome
from outbox.store import for_item
from tests.fakes import DownAloneFor, DownFor

if TYPE_CHECKING:
    from mcp import ClientSession

    from leadgate.app import App
    from leadgate.turns.intake import Accepted
    from leadgate.turns.path import TurnService

#: ``resources/subscribe`` is what 2025-era MCP clients send, and MCP tests send it
#: on purpose (the 2026-07-28 protocol replaced it with ``subscriptions/listen``, tested
#: too); the SDK's client warns that the call is deprecated.
LEGACY_SUBSCRIBE = pytest.mark.filterwarnings(
    "ignore:resources/(un)?subscribe is removed:mcp.shared.exceptions.MCPDeprecationWarning"
)


async def eventually(check: Callable[[], object], within: float = 10.0, *, what: str = "") -> None:
    """Poll ``check`` (a function, or an async one) every 50 ms until its answer is true
    (a non-empty list counts); ``AssertionError`` naming what was waited for (``what``,
    else ``check``'s source) and its last answer if ``within`` seconds pass first.

    It raises rather than returning a bool: a wait written as a statement was a check
    that passed when the thing waited for never happened.

    The default only says "it did not hang": it returns as soon as ``check`` holds, and
    2 s was within reach of a loaded 2-CPU machine running two test workers. A test whose
    point is *how soon* passes its own ``within``."""

    async def answer() -> object:
        result = check()
        return await result if inspect.isawaitable(result) else result

    for _ in range(int(within / 0.05)):
        if await answer():
            return
        await asyncio.sleep(0.05)
    last = await answer()
    if not last:
        raise AssertionError(
            f"not within {within:g} s: {what or _described(check)} (last answer: {last!r})"
        )


def _described(check: Callable[[], object]) -> str:
    """``check``'s source for a lambda (its name says nothing), else its name."""
    if getattr(check, "__name__", "") == "<lambda>":
        with contextlib.suppress(OSError, TypeError, ValueError):
            source = " ".join(inspect.getsource(check).split())
            text = source[source.index("lambda") :]
            depth = 0
            for end, char in enumerate(text):
                depth += (char in "([{") - (char in ")]}")
                # The lambda ends at the call's next argument or its closing bracket.
                if depth < 0 or (depth == 0 and char == ","):
                    return text[:end]
            return text
    return str(getattr(check, "__qualname__", repr(check)))


async def blocked_on_a_lock(db: Database, task: asyncio.Task[Any]) -> None:
    """Until ``task`` waits on a row lock of ``db`` (PostgreSQL; within 10 s, else
    ``AssertionError``) or finishes first: a test holding a transaction open sees its
    contender reach the lock before letting go. SQLite has no row locks (its one writer
    queues): at once."""
    if not db.is_postgres:
        return

    async def waits_or_done() -> bool:
        async with db.read() as conn:
            waiting = await conn.scalar(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
            )
        return bool(waiting) or task.done()

    await eventually(waits_or_done, 10.0, what="a transaction waiting on a row lock")


async def seq_scans_only(pg_url: str) -> None:
    """Every connection made from now on to ``pg_url``'s database plans sequential scans
    (index and bitmap scans off): the plan PostgreSQL chooses at size, in a test's few
    rows, so that a statement finds its rows in physical order."""
    import asyncpg

    from leadgate.database.pg import asyncpg_dsn

    conn = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        name = await conn.fetchval("SELECT current_database()")
        for plan in ("enable_indexscan", "enable_bitmapscan"):
            await conn.execute(f'ALTER DATABASE "{name}" SET {plan} = off')
    finally:
        await conn.close()


async def beside_a_locker_in_key_order(
    db: Database,
    table: sa.Table,
    keys: list[tuple[Any, ...]],
    contender: Callable[[], Coroutine[Any, Any, object]],
) -> None:
    """Run ``contender`` (a statement locking many rows of ``table``) beside a
    transaction that locks the rows of ``keys`` (their primary keys, in key order) as a
    writer of several of them takes them: it holds the first while ``contender`` reaches
    a lock, then takes the rest and commits. A contender locking the rows in another
    order holds one of the rest then, and PostgreSQL ends one of the two as a deadlock
    (40P01): raised here."""
    key = list(table.primary_key.columns)
    locked = sa.select(*key).order_by(*key).with_for_update()
    contending: asyncio.Task[object] | None = None
    try:
        async with db.tx() as conn:
            await conn.execute(locked.where(sa.tuple_(*key) == keys[0]))
            contending = asyncio.create_task(contender())
            await blocked_on_a_lock(db, contending)
            await conn.execute(locked.where(sa.tuple_(*key).in_(keys)))
    finally:
        if contending is not None:  # (freed by the commit, or the rollback)
            await contending


async def listening(db: Database) -> None:
    """Until ``db``'s process has its LISTEN connection up (PostgreSQL; its table-change
    token exists only then), so that what another replica commits next is heard by it
    rather than by its start. SQLite has none: at once."""
    changes = db.table_changes
    if changes is not None:
        await eventually(lambda: changes.token(("agents",)) is not None, 10, what="LISTEN up")


async def start_worker(app: App) -> None:
    """Start ``app``'s runner loops and wait until it listens (:func:`listening`)."""
    await app.start_runners()
    await listening(app.db)


@contextlib.asynccontextmanager
async def held_open(db: Database, work: Callable[[Conn], Awaitable[object]]) -> AsyncIterator[None]:
    """Run ``work`` in a transaction of ``db`` and hold it open, uncommitted with its
    locks held, for the block (a contender started in it meets them: see
    :func:`blocked_on_a_lock`); it commits as the block ends. ``work``'s error is raised
    on entry."""
    done, release = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with db.tx() as conn:
            await work(conn)
            done.set()
            await release.wait()

    holder = asyncio.create_task(hold())
    ready = asyncio.create_task(done.wait())
    await asyncio.wait({holder, ready}, return_when=asyncio.FIRST_COMPLETED)
    ready.cancel()
    if holder.done():
        holder.result()  # (work failed: its error)
    try:
        yield
    finally:
        release.set()
        await holder


def item_locked(item_id: str) -> Callable[[Conn], Awaitable[object]]:
    """What :func:`held_open` runs to hold ``item_id``'s row lock (as a transaction that
    moved the work item, or lost a race to move it, holds it to its commit)."""
    locked = sa.select(t.work_items.c.id).where(t.work_items.c.id == item_id).with_for_update()
    return lambda conn: conn.execute(locked)


class Env(Protocol):
    """What the helpers need: a database, a clock and ids (an App or a Stack).

    Read-only members: a Stack's clock is a ``FakeClock`` and a mutable protocol member
    would have to match its type exactly."""

    @property
    def db(self) -> Database: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def ids(self) -> IdFactory: ...


async def stops_beating(env: Env, dead_after_ms: int, process_id: str | None) -> None:
    """Process ``process_id``'s last heartbeat, in ``env``'s database, is now older than
    ``dead_after_ms`` by ``env``'s clock: the next reap finds it dead (what a crash, or a
    partition from the database, leaves; nothing else notices)."""
    stale = env.clock.now_ms() - dead_after_ms - 1
    async with env.db.tx() as conn:
        await conn.execute(
            t.processes.update().where(t.processes.c.id == process_id).values(heartbeat_at=stale)
        )


async def stopped_by_a_fault(db: Database, turns: TurnService, taken: Accepted) -> None:
    """Run ``taken`` on ``turns``, its next write on ``db`` meeting the database gone,
    whichever way it goes (a transaction, or on PostgreSQL one statement alone): the turn
    stops with :class:`Unavailable` (its client told 503 ``turn.interrupted``), its run
    left to the turn recovery (``TurnService.orphans``). The faults are patched in and
    taken out here alone (a test's ``monkeypatch.undo()`` undid its fixtures' too)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(db, "tx", DownFor(db.tx, 1, after_commit=False))
        patch.setattr(db, "write_alone", DownAloneFor(db.write_alone, 1, after_commit=False))
        with pytest.raises(Unavailable):
            await turns.execute(taken)


def sqlite_plan(conn: sa.Connection, statement: sa.ClauseElement) -> list[str]:
    """SQLite's ``EXPLAIN QUERY PLAN`` of ``statement`` on ``conn`` (its values inlined):
    one line per step, e.g. ``SEARCH review_cards USING INDEX ... (delivery_id=?)``."""
    sql = str(statement.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True}))
    return [str(row[3]) for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql)]


def counted(name: str, **labels: str) -> float:
    """The process's metric sample ``name{labels}`` now (0 before its first count)."""
    return METRICS.registry.get_sample_value(name, labels) or 0.0


def deliveries_counted(channel: str, outcome: str) -> float:
    """``leadgate_deliveries_total{channel, outcome}`` now (0 before its first count)."""
    return counted("leadgate_deliveries_total", channel=channel, outcome=outcome)


def transitions_counted(src: str, dst: str) -> float:
    """``leadgate_work_item_transitions_total{from_status, to_status}`` now."""
    return counted("leadgate_work_item_transitions_total", from_status=src, to_status=dst)


def fake_clock(service: Env) -> FakeClock:
    """``service``'s clock, which the tests built as a :class:`FakeClock` (``served_app``
    does) to move it by hand."""
    assert isinstance(service.clock, FakeClock), service.clock
    return service.clock


@dataclass
class Org:
    """An organization with its Owner key and principal."""

    id: str
    key: str
    principal: Principal


async def make_org(service: Env, name: str = "acme") -> Org:
    """Create an organization (Owner key with every scope)."""
    async with service.db.tx() as conn:
        org = await orgs.create_org(conn, service.clock, service.ids, name)
    async with service.db.read() as conn:
        principal = await orgs.authenticate_key(conn, org["apiKey"])
    assert principal is not None
    return Org(org["id"], org["apiKey"], principal)


async def make_key(service: Env, org: Org, *scopes: Scope) -> str:
    """A key with exactly ``scopes``."""
    async with service.db.tx() as conn:
        key = await orgs.create_key(conn, service.clock, service.ids, org.id, frozenset(scopes))
    return str(key["key"])


async def make_agent(service: Env, org: Org, name: str, **kwargs: Any) -> dict[str, Any]:
    """Create an agent (``lead=``, ``review_config=``, ``preset=`` as in save_agent)."""
    kwargs.setdefault("model", "script")
    async with service.db.tx() as conn:
        agent = await agents_mod.save_agent(
            conn, service.clock, service.ids, org.id, name=name, **kwargs
        )
    return agent._asdict()


async def delete_agent(service: Env, org: Org, agent_id: str) -> None:
    """Delete the agent ``agent_id`` (as ``DELETE /v1/agents/{id}`` does)."""
    async with service.db.tx() as conn:
        await agents_mod.save_agent(
            conn, service.clock, service.ids, org.id, agent_ref=agent_id, delete=True
        )


async def make_route(
    service: Env,
    org: Org,
    agent_id: str,
    channel: str,
    match: dict[str, str] | None = None,
    *,
    silent: bool = False,
) -> str:
    """Route ``channel`` triggers matching ``match`` to the agent; the route's id."""
    async with service.db.tx() as conn:
        route = await routes.add_route(
            conn,
            service.clock,
            service.ids,
            org_id=org.id,
            agent_id=agent_id,
            channel=channel,
            match=match or {},
            silent=silent,
        )
    return str(route["id"])


def api_trigger(org: Org, agent: dict[str, Any], text: str, session: str = "s1") -> Trigger:
    """A REST-like trigger (api binding) for ``agent``."""
    return Trigger(
        org_id=org.id,
        agent_id=agent["id"],
        session_key=session,
        text=text,
        binding=BindingSpec(BindingKind.api),
    )


def slack_trigger(
    org: Org,
    agent: dict[str, Any],
    text: str,
    thread_ts: str,
    *,
    team: str = "T1",
    channel: str = "C1",
) -> Trigger:
    """A message in Slack thread ``thread_ts`` (of ``channel`` in ``team``) for
    ``agent``, on the thread's session, with the event id that de-duplicates
    redeliveries."""
    key = f"slack:{team}:{channel}:{thread_ts}"
    return Trigger(
        org_id=org.id,
        agent_id=str(agent["id"]),
        session_key=key,
        text=text,
        binding=BindingSpec(
            BindingKind.slack, {"team": team, "channel": channel, "thread_ts": thread_ts}
        ),
        external_event_id=key,
    )


async def item_row(service: Env, item_id: str) -> dict[str, Any]:
    """A work item as stored (as a dict)."""
    async with service.db.read() as conn:
        return (await workitems.get(conn, item_id))._asdict()


async def item_deliveries(service: Env, item_id: str) -> list[dict[str, Any]]:
    """A work item's delivery rows, oldest first."""
    async with service.db.read() as conn:
        return [d._asdict() for d in await for_item(conn, item_id)]


async def item_audit(service: Env, item_id: str) -> list[dict[str, Any]]:
    """A work item's audit rows, oldest first."""
    a = t.audit.c
    async with service.db.read() as conn:
        rows = (
            await conn.execute(
                sa.select(t.audit).where(a.work_item_id == item_id).order_by(a.created_at, a.id)
            )
        ).all()
    return [dict(r._mapping) for r in rows]


async def session_item(service: Env, session_key: str) -> str:
    """The id of the newest work item of the session ``session_key``."""
    w = t.work_items.c
    async with service.db.read() as conn:
        item_id = await conn.scalar(
            sa.select(w.id)
            .select_from(t.work_items.join(t.sessions, t.sessions.c.id == w.session_id))
            .where(t.sessions.c.key == session_key)
            .order_by(w.created_at.desc())
        )
    assert item_id, f"no work item in session {session_key}"
    return str(item_id)


class Anonymizer:
    """Makes the rows of two runs comparable: ids (``RandomIds``) numbered by first
    appearance, and each of ``marks`` (a session key, a thread) replaced, in strings and
    in JSON objects. One instance per run."""

    ID = re.compile(r"^[a-z]+_[0-9a-f]{16,}$")
    #: an id anywhere in a string
    ID_IN = re.compile(ID.pattern.strip("^$"))

    def __init__(self, *marks: str) -> None:
        self.marks = marks
        self.names: dict[str, str] = {}

    def __call__(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self(v) for k, v in value.items()}
        if isinstance(value, str) and self.ID.match(value):
            return self.names.setdefault(value, f"<id{len(self.names)}>")
        if isinstance(value, str):
            for n, mark in enumerate(self.marks):
                value = value.replace(mark, f"<mark{n}>")
        return value

    def within(self, value: Any) -> Any:
        """Like calling it, with the ids inside strings numbered too (an actor is
        ``lead:<agent id>``, a JSON column holds ids)."""
        if isinstance(value, dict):
            return {k: self.within(v) for k, v in value.items()}
        if isinstance(value, str):
            value = self.ID_IN.sub(lambda m: str(self(m.group(0))), value)
        return self(value)


def mcp_initialize(protocol: str = "2025-06-18") -> dict[str, Any]:
    """A raw MCP ``initialize`` JSON-RPC request (for tests that speak to ``/mcp`` without
    the SDK's client)."""
    return {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": protocol,
            "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"},
        },
    }


async def listened(session: ClientSession, uri: str) -> str:
    """``subscriptions/listen`` (the 2026-07-28 protocol) to ``uri``: whether it listens
    (the stream is closed at once; a refusal is raised as the client's ``MCPError``)."""
    # Imported here: the benches import this module in process, and the MCP client's
    # modules at import cost a counted plain turn 0.8% more instructions (more objects
    # for the garbage collector to walk: bench.instructions, session 41).
    from mcp.client.subscriptions import listen

    async with listen(session, resource_subscriptions=[uri]):
        return "listening"


def ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The records of the service's own loggers (``leadgate.*``, and the channel
    adapters' ``bots.*``). A check for "no traceback" or "one ERROR line" must not count
    what another test left behind: asyncio logs a client task the garbage collector found
    unfinished ("Task exception was never retrieved", ERROR, with its traceback) in
    whichever test runs then."""
    return [r for r in caplog.records if r.name.startswith(("leadgate", "bots."))]


@contextlib.contextmanager
def held_sqlite_lock(path: str) -> Iterator[None]:
    """SQLite's write lock on the file at ``path``, held by another connection (as
    another process would) until the block ends: the service's writes wait out
    ``[database] busy_timeout_s`` and fail; in WAL mode its reads go on."""
    other = sqlite3.connect(path, isolation_level=None, timeout=10)
    try:
        other.execute("BEGIN IMMEDIATE")
        yield
    finally:
        other.execute("ROLLBACK")
        other.close()


def decided_card() -> Card:
    """A review card of item ``wi_1`` (its own delivery ``d_1``) as its edit shows it:
    approved from the console."""
    return Card(
        item_id="wi_1",
        episode_id="rep_1",
        purpose="notify",
        reason="awaitingHuman",
        delivery_id=None,
        agent="helper",
        source="Slack channel C1",
        why="The lead escalated it",
        summary="a summary",
        revision=1,
        rounds=3,
        waiting_since_ms=1_700_000_000_000,
        link="https://leadgate.example/console/#/review/wi_1",
        outcome=CardOutcome("Approved", "ann@example.com", "console", 1_700_000_060_000),
        card_id="d_1",
    )


#: A masked link whose words hide where it leads.
PHISH = "[Approve here](https://elsewhere.example)"


def marked_card() -> Card:
    """:func:`decided_card` before its decision, its names, "why" and summary written
    with each platform's markup and a masked link (:data:`PHISH`) in them."""
    return dataclasses.replace(
        decided_card(),
        agent="*helper*_x_",
        source="`src` ~y~",
        why=f"The lead escalated it: {PHISH}",
        summary=f"**Done.** {PHISH}",
        outcome=None,
    )
