"""PostgreSQL: a session's events are NOTIFYed to other replicas only while a reader
somewhere keeps the session watched (``sessions.watched_until``, see
leadgate/domain/session_events.py). Every statement that writes events follows the mark,
a mark that ran out stops them, and a mark and a writer racing on the session's row are
ordered by its lock: either the writer sees the mark and NOTIFYs, or it committed before
the mark did (and a reader's first read, after the mark, sees its events)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
import sqlalchemy as sa

from leadgate.core.runners import drain
from leadgate.core.types import BindingKind, BindingSpec, Gated, Reply, Trigger
from leadgate.database import schema as t
from leadgate.database.pg import asyncpg_dsn
from leadgate.domain import session_events
from leadgate.domain.session_events import NOTIFY_CHANNEL, mark_watched
from leadgate.turns.messages import store_message
from tests.helpers import api_trigger, blocked_on_a_lock, make_agent, make_org, seq_scans_only
from tests.outbox_support import ScriptedChannel
from tests.stack import Stack, build_stack

BARRIER = "~barrier"
SLACK_ADDRESS = {"team": "T1", "channel": "C1", "thread_ts": "1700000000.000100"}


class Heard:
    """A LISTEN connection on the session-event channel (another replica's ear)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        self.payloads: list[str] = []
        self.barrier = asyncio.Event()

    def _on(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        if payload == BARRIER:
            self.barrier.set()
        else:
            self.payloads.append(payload)

    async def take(self) -> list[str]:
        """What arrived up to now: notifications come in commit order, so once a NOTIFY
        committed after the writes is heard, everything they sent has been."""
        self.barrier.clear()
        await self.conn.execute("SELECT pg_notify($1, $2)", NOTIFY_CHANNEL, BARRIER)
        await asyncio.wait_for(self.barrier.wait(), 10.0)
        taken, self.payloads = self.payloads, []
        return taken


@pytest.fixture
async def pg(migrated_pg: str) -> AsyncIterator[tuple[Stack, Heard]]:
    stack = build_stack(migrated_pg, channels={"slack": ScriptedChannel()})
    conn = await asyncpg.connect(asyncpg_dsn(migrated_pg))
    heard = Heard(conn)
    await conn.add_listener(NOTIFY_CHANNEL, heard._on)
    try:
        yield stack, heard
    finally:
        await conn.close()
        await stack.stop()


async def session_id(stack: Stack, agent: dict[str, Any], key: str) -> str:
    s = t.sessions.c
    async with stack.db.read() as conn:
        found = await conn.execute(sa.select(s.id).where(s.agent_id == agent["id"], s.key == key))
        return str(found.scalar_one())


async def test_plain_turns_notify_only_while_their_session_is_watched(
    pg: tuple[Stack, Heard],
) -> None:
    """The plain intake statement and the reply's statement (both outside a transaction
    block) and a transaction over several sessions (one statement for all of them)."""
    stack, heard = pg
    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain")
    for key in ("a", "b"):
        assert await stack.turns.run(api_trigger(org, agent, "one", key)) == Reply("Echo: one")
    a, b = await session_id(stack, agent, "a"), await session_id(stack, agent, "b")
    assert await heard.take() == []  # nobody reads either session

    await mark_watched(stack.db, [a])
    for key in ("a", "b"):
        assert await stack.turns.run(api_trigger(org, agent, "two", key)) == Reply("Echo: two")
    assert await heard.take() == [f"{a} m", f"{a} m"]

    async with stack.db.tx() as conn:  # one statement for both sessions' events
        for sid in (a, b):
            await store_message(
                conn, stack.clock, stack.ids, org_id=org.id, session_id=sid,
                work_item_id=None, role="user", content="x", gated=False,
            )  # fmt: skip
    assert await heard.take() == [f"{a} m"]

    # The mark ran out (its replica went away without renewing it): silence again.
    async with stack.db.tx() as conn:
        await conn.execute(
            sa.update(t.sessions).where(t.sessions.c.id == a).values(watched_until=1)
        )
    assert await stack.turns.run(api_trigger(org, agent, "three", "a")) == Reply("Echo: three")
    assert await heard.take() == []


async def test_a_gated_lifecycle_notifies_its_statuses_only_while_watched(
    pg: tuple[Stack, Heard],
) -> None:
    """Intake, review and the relay's outcome commit (the statement that moves the posted
    items and writes their events) of a Slack-bound item, unwatched and then watched."""
    stack, heard = pg
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")
    binding = BindingSpec(BindingKind.slack, address=SLACK_ADDRESS)

    async def lifecycle(key: str) -> None:
        out = await stack.turns.run(
            Trigger(
                org_id=org.id, agent_id=worker["id"], session_key=key,
                text="write it #complete", binding=binding,
            )
        )  # fmt: skip
        assert isinstance(out, Gated)
        await drain(stack.lead_runner)
        await drain(stack.relay)

    await lifecycle("quiet")
    assert await heard.take() == []
    await lifecycle("read")
    sid = await session_id(stack, worker, "read")
    async with stack.db.read() as conn:
        log = await session_events.read(conn, sid, after=0, limit=100)
    await mark_watched(stack.db, [sid])
    assert await heard.take() == []  # the item's events were written before the mark
    await lifecycle("read")  # the same thread again: a revision of the session's work
    async with stack.db.read() as conn:
        later = await session_events.read(conn, sid, after=log[-1].seq, limit=100)
    assert [(e.kind, e.status or e.role) for e in later] == [
        ("message", "user"),
        ("review", "pending"),
        ("review", "delivered"),
    ]
    # One NOTIFY per statement that wrote them, the relay's outcome commit last.
    assert await heard.take() == [f"{sid} m", f"{sid} r", f"{sid} r"]


async def blocked(probe: asyncpg.Connection, query_start: str) -> None:
    """Until a backend running a statement that starts with ``query_start`` waits for a
    lock (bounded)."""
    for _ in range(500):
        waiting = await probe.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock'"
            " AND query LIKE $1",
            query_start + "%",
        )
        if waiting:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"nothing like {query_start!r} waited for a lock")


async def test_a_mark_and_a_writer_on_the_same_session_are_ordered_by_its_row(
    pg: tuple[Stack, Heard], migrated_pg: str
) -> None:
    """A writer that comes while a mark holds the session's row waits for it, then sees
    the mark and NOTIFYs. A mark that comes while a writer holds the row waits for the
    writer's commit: the reader's first read, after the mark, has the writer's events."""
    stack, heard = pg
    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain")
    assert await stack.turns.run(api_trigger(org, agent, "one", "s")) == Reply("Echo: one")
    sid = await session_id(stack, agent, "s")
    other = await asyncpg.connect(asyncpg_dsn(migrated_pg))
    try:
        tx = other.transaction()
        await tx.start()
        await other.execute(
            f"UPDATE sessions SET watched_until = {session_events.PG_NOW_MS} + 60000 WHERE id = $1",
            sid,
        )
        turn = asyncio.ensure_future(stack.turns.run(api_trigger(org, agent, "two", "s")))
        await blocked(heard.conn, "WITH sb AS")  # the plain intake statement waits
        await tx.commit()
        # READ COMMITTED: the waiting UPDATE re-reads the row it waited for, mark included.
        assert await asyncio.wait_for(turn, 10.0) == Reply("Echo: two")
        assert await heard.take() == [f"{sid} m", f"{sid} m"]

        await other.execute("UPDATE sessions SET watched_until = 0 WHERE id = $1", sid)
        async with stack.db.tx() as conn:
            # A writer holding the row (as its event statement does until commit).
            await conn.execute(
                sa.text("SELECT id FROM sessions WHERE id = :sid FOR UPDATE"), {"sid": sid}
            )
            await store_message(
                conn, stack.clock, stack.ids, org_id=org.id, session_id=sid,
                work_item_id=None, role="user", content="racing", gated=False,
            )  # fmt: skip
            mark = asyncio.ensure_future(mark_watched(stack.db, [sid]))
            await blocked(heard.conn, "WITH marked AS")
        await asyncio.wait_for(mark, 10.0)
        async with stack.db.read() as conn:
            log = await session_events.read(conn, sid, after=0, limit=100)
        assert log[-1].content == "racing"  # the reader's first read has it
        assert await heard.take() == []  # decided before the mark: none, none needed
    finally:
        await other.close()


async def test_a_renewal_locks_its_sessions_in_id_order(migrated_pg: str) -> None:
    """A mark (a renewal marks up to 1,000 sessions in one statement) locked its
    sessions' rows in the order its plan found them: at size a bitmap or sequential scan,
    physical order. An event writer taking the counters of several sessions in id order
    (a relay's outcome commit) held the first row while the mark held the second waiting
    for it, then waited for the second, and PostgreSQL ended one of the two (40P01
    deadlock_detected). The mark now locks its rows in id order first: it waits for the
    first row holding nothing, then marks both."""
    first, second = "ses_1", "ses_2"
    await seq_scans_only(migrated_pg)
    other = await asyncpg.connect(asyncpg_dsn(migrated_pg))
    try:
        await other.executemany(
            "INSERT INTO sessions (id, org_id, agent_id, key, created_at)"
            " VALUES ($1, 'org_1', 'agt_1', $1, 0)",
            [(first,), (second,)],
        )
        # The first row's newest version goes after the second's in the table: a scan in
        # physical order finds the second first.
        await other.execute("UPDATE sessions SET event_seq = event_seq WHERE id = $1", first)
    finally:
        await other.close()
    stack = build_stack(migrated_pg)
    try:
        lock = sa.text(
            "SELECT id FROM sessions WHERE id = ANY(CAST(:sids AS varchar[]))"
            " ORDER BY id FOR UPDATE"
        )
        async with stack.db.tx() as conn:
            await conn.execute(lock, {"sids": [first]})
            marking = asyncio.create_task(mark_watched(stack.db, [first, second]))
            await blocked_on_a_lock(stack.db, marking)
            await conn.execute(lock, {"sids": [first, second]})  # and goes on to the second
        await marking
        s = t.sessions.c
        async with stack.db.read() as conn:
            marked = (await conn.execute(sa.select(s.watched_until).order_by(s.id))).scalars()
            assert [until > 0 for until in marked] == [True, True]
    finally:
        await stack.stop()
