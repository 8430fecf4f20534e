"""The public session event log (leadgate/domain/session_events.py) on SQLite and PostgreSQL:
what each change writes, in which order, in the same transaction, and that a resuming
reader can never see a number before the numbers below it (concurrent writers)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import sqlalchemy as sa

from leadgate.core.runners import drain
from leadgate.core.types import Gated, Reply
from leadgate.database import schema as t
from leadgate.database.db import before_commit
from leadgate.domain import session_events, workitems
from leadgate.domain.session_events import public_status
from leadgate.domain.workitems import Status
from leadgate.review import decisions
from leadgate.turns.messages import store_message
from tests.helpers import Org, api_trigger, make_agent, make_org
from tests.stack import Stack


async def store(
    conn: Any,
    stack: Stack,
    org: Org,
    session_id: str,
    content: str,
    *,
    role: str = "user",
    gated: bool = False,
) -> None:
    """One message stored in ``conn``'s transaction (as the turn path stores them)."""
    await store_message(
        conn,
        stack.clock,
        stack.ids,
        org_id=org.id,
        session_id=session_id,
        work_item_id=None,
        role=role,
        content=content,
        gated=gated,
    )


async def log_of(stack: Stack, session_id: str) -> list[tuple[Any, ...]]:
    async with stack.db.read() as conn:
        events = await session_events.read(conn, session_id, after=0, limit=1000)
    return [(e.seq, e.kind, e.status or e.role, e.content) for e in events]


async def session_of(stack: Stack, agent: dict[str, Any], key: str = "s1") -> str:
    s = t.sessions.c
    async with stack.db.read() as conn:
        return str(
            (
                await conn.execute(sa.select(s.id).where(s.agent_id == agent["id"], s.key == key))
            ).scalar_one()
        )


@pytest.mark.parametrize(
    ("status", "revision", "public"),
    [
        ("inProgress", 0, None),  # a new item: its turns answer as usual
        ("inProgress", 1, "pending"),  # back with the worker after a submission
        ("reviewQueued", 0, "pending"),
        ("reviewing", 0, "pending"),
        ("awaitingHuman", 2, "pending"),
        ("approved", 0, "pending"),
        ("completed", 0, "delivered"),
        ("rejected", 0, "rejected"),
        ("cancelled", 0, "cancelled"),
        ("failed", 0, "failed"),
        ("abandoned", 0, "abandoned"),
    ],
)
def test_public_status(status: str, revision: int, public: str | None) -> None:
    assert public_status(status, revision) == public
    assert public is None or public in session_events.PUBLIC_STATUSES


async def test_plain_turn_writes_one_message_event_per_message(stack: Stack) -> None:
    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain")
    assert await stack.turns.run(api_trigger(org, agent, "hello")) == Reply("Echo: hello")
    sid = await session_of(stack, agent)
    assert await log_of(stack, sid) == [
        (1, "message", "user", "hello"),
        (2, "message", "assistant", "Echo: hello"),
    ]


async def test_gated_turn_then_approval_reveals_then_delivers(stack: Stack) -> None:
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")
    out = await stack.turns.run(api_trigger(org, worker, "ship it #complete"))
    assert isinstance(out, Gated)
    sid = await session_of(stack, worker)
    # The user message, then the held work: no assistant text, no item id anywhere.
    assert await log_of(stack, sid) == [
        (1, "message", "user", "ship it #complete"),
        (2, "review", "pending", None),
    ]
    claimed = await stack.lead_runner.claim()  # reviewQueued -> reviewing: still pending
    assert claimed is not None
    assert len(await log_of(stack, sid)) == 2
    # The approval's transaction reveals and completes (an api reveal sends nothing).
    await stack.lead_runner.review(claimed)
    assert (await log_of(stack, sid))[2:] == [
        (3, "message", "assistant", "Echo: ship it #complete"),
        (4, "review", "delivered", None),
    ]


async def test_rejection_is_a_status_without_the_reason(stack: Stack) -> None:
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")
    out = await stack.turns.run(api_trigger(org, worker, "x #escalate #complete"))
    assert isinstance(out, Gated) and out.work_item_id
    await drain(stack.lead_runner)  # escalated -> awaitingHuman (still pending)
    async with stack.db.tx() as conn:
        item = await workitems.get(conn, out.work_item_id)
        await decisions.human_reject(
            conn, stack.clock, stack.ids, item, "user:u1", "secret reviewer reason"
        )
    sid = await session_of(stack, worker)
    log = await log_of(stack, sid)
    assert [e[2] for e in log] == ["user", "pending", "rejected"]
    async with stack.db.read() as conn:
        raw = (await conn.execute(sa.select(t.session_events))).all()
    assert "secret" not in repr(raw) and out.work_item_id not in repr(raw)


async def test_latest_review_is_the_last_review_event_after_later_messages(
    stack: Stack,
) -> None:
    """What the MCP transcript page names as ``review``: the status of the session's
    last ``review`` event (messages after it do not hide it), ``None`` when none."""
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")
    plain = await make_agent(stack, org, "plain")
    assert isinstance(await stack.turns.run(api_trigger(org, plain, "hi")), Reply)
    out = await stack.turns.run(api_trigger(org, worker, "ship it #complete"))
    assert isinstance(out, Gated)
    sid = await session_of(stack, worker)
    async with stack.db.read() as conn:
        assert await session_events.latest_review(conn, await session_of(stack, plain)) is None
        assert await session_events.latest_review(conn, sid) == "pending"
    await drain(stack.lead_runner)  # approved, revealed, delivered
    assert isinstance(await stack.turns.run(api_trigger(org, worker, "thanks")), Reply)
    async with stack.db.read() as conn:
        assert await session_events.latest_review(conn, sid) == "delivered"


async def test_events_share_their_transaction(stack: Stack) -> None:
    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain")
    await stack.turns.run(api_trigger(org, agent, "one"))
    sid = await session_of(stack, agent)
    with pytest.raises(RuntimeError, match="rolled back"):
        async with stack.db.tx() as conn:
            await store(conn, stack, org, sid, "never")
            raise RuntimeError("rolled back")
    async with stack.db.tx() as fast:
        await store(fast, stack, org, sid, "kept")
    # Nothing of the rolled-back transaction; its number went to the next writer.
    assert [(e[0], e[3]) for e in await log_of(stack, sid)] == [
        (1, "one"),
        (2, "Echo: one"),
        (3, "kept"),
    ]


async def test_hidden_messages_write_no_event(stack: Stack) -> None:
    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain")
    await stack.turns.run(api_trigger(org, agent, "one"))
    sid = await session_of(stack, agent)
    async with stack.db.tx() as conn:
        for role, gated in (("tool", False), ("internal", False), ("assistant", True)):
            await store(conn, stack, org, sid, "hidden", role=role, gated=gated)
    assert len(await log_of(stack, sid)) == 2


async def test_commit_wakes_readers_with_the_session(stack: Stack) -> None:
    seen: list[list[Any]] = []
    stack.db.on_commit_payloads(session_events.TOPIC, seen.append)
    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain")
    await stack.turns.run(api_trigger(org, agent, "hi"))
    sid = await session_of(stack, agent)
    assert seen == [[(sid, True)], [(sid, True)]]


async def test_a_resuming_reader_never_sees_a_gap(stack: Stack) -> None:
    """Concurrent writers on one session, each holding the session's counter until a
    random delay before its commit (a second before-commit step after the log's flush),
    while a reader keeps reading ``seq > last``. Every page the reader gets must continue
    exactly at ``last + 1`` with no gap: if numbers were not handed out in commit order,
    the reader would see a later number before an earlier one committed."""
    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain")
    await stack.turns.run(api_trigger(org, agent, "start"))
    sid = await session_of(stack, agent)
    rng = random.Random(12)
    writers, per_writer = 6, 8

    async def hold(_conn: Any, _items: list[Any]) -> None:
        await asyncio.sleep(rng.random() * 0.01)

    async def writer(index: int) -> None:
        for n in range(per_writer):
            async with stack.db.tx() as conn:
                await store(conn, stack, org, sid, f"w{index}-{n}")
                # Runs after the log's flush (queues flush in order): the counter's
                # row lock (PostgreSQL) is held across this sleep.
                await before_commit(conn, "test-hold", hold, None)

    seen: list[int] = [1, 2]
    done = asyncio.Event()

    async def reader() -> None:
        while True:
            finished = done.is_set()
            async with stack.db.read() as conn:
                page = await session_events.read(conn, sid, after=seen[-1], limit=1000)
            numbers = [e.seq for e in page]
            assert numbers == list(range(seen[-1] + 1, seen[-1] + 1 + len(numbers))), numbers
            seen.extend(numbers)
            if finished:
                return
            await asyncio.sleep(0)

    read_task = asyncio.create_task(reader())
    await asyncio.gather(*(writer(i) for i in range(writers)))
    done.set()
    await read_task
    assert seen == list(range(1, 2 + writers * per_writer + 1))
    contents = {e[3] for e in await log_of(stack, sid)}
    assert {f"w{i}-{n}" for i in range(writers) for n in range(per_writer)} <= contents


async def test_transition_many_writes_a_status_event_per_item(stack: Stack) -> None:
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")
    ids = []
    for key in ("a", "b"):
        out = await stack.turns.run(api_trigger(org, worker, "x #escalate #complete", key))
        assert isinstance(out, Gated) and out.work_item_id
        ids.append(out.work_item_id)
    await drain(stack.lead_runner)
    async with stack.db.tx() as conn:
        for item_id in ids:
            await conn.execute(
                t.work_items.update()
                .where(t.work_items.c.id == item_id)
                .values(status=Status.approved.value)
            )
    async with stack.db.tx() as conn:
        moved = await workitems.transition_many(
            conn,
            stack.clock,
            stack.ids,
            ids,
            src=Status.approved,
            dst=Status.failed,
            actor="test",
            action="test",
        )
    assert sorted(moved) == sorted(ids)
    for key in ("a", "b"):
        log = await log_of(stack, await session_of(stack, worker, key))
        assert [e[2] for e in log] == ["user", "pending", "failed"]


async def test_one_transaction_over_many_sessions_numbers_each_session_alone(
    stack: Stack,
) -> None:
    """A transaction that touches several sessions (a relay's outcome commit) numbers
    each session's events on from its own last number, whatever the grouping of the
    statements (on SQLite one executemany per count of events), and wakes each session's
    readers once."""
    seen: list[list[Any]] = []
    stack.db.on_commit_payloads(session_events.TOPIC, seen.append)
    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain")
    keys = ("a", "b", "c", "d")
    for key in keys:
        await stack.turns.run(api_trigger(org, agent, f"hi {key}", key))
    sids = {key: await session_of(stack, agent, key) for key in keys}
    seen.clear()
    async with stack.db.tx() as conn:
        for key, count in (("a", 1), ("b", 2), ("c", 1), ("d", 3)):
            for i in range(count):
                await store(conn, stack, org, sids[key], f"{key}{i}")
    for key, count in (("a", 1), ("b", 2), ("c", 1), ("d", 3)):
        log = await log_of(stack, sids[key])
        assert [(e[0], e[3]) for e in log] == [
            (1, f"hi {key}"),
            (2, f"Echo: hi {key}"),
            *((3 + i, f"{key}{i}") for i in range(count)),
        ]
    assert len(seen) == 1
    assert sorted(seen[0]) == sorted((sid, True) for sid in sids.values())


async def test_writers_over_the_same_sessions_in_any_order_neither_wait_in_a_cycle(
    stack: Stack,
) -> None:
    """Concurrent transactions each store messages in the same three sessions, in
    different orders, holding the counters until a random delay before commit. The
    counters are taken in session id order whatever the order of the writes (on
    PostgreSQL one statement for all of them), so no two transactions wait on each other
    in a cycle (a deadlock would fail one of them), and each session's numbers run on
    without a gap or a repeat."""
    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain")
    keys = ("x", "y", "z")
    for key in keys:
        await stack.turns.run(api_trigger(org, agent, f"start {key}", key))
    sids = [await session_of(stack, agent, key) for key in keys]
    rng = random.Random(7)
    writers, per_writer = 5, 6

    async def hold(_conn: Any, _items: list[Any]) -> None:
        await asyncio.sleep(rng.random() * 0.01)

    async def writer(index: int) -> None:
        for n in range(per_writer):
            order = sids[:]
            rng.shuffle(order)
            async with stack.db.tx() as conn:
                for sid in order:
                    await store(conn, stack, org, sid, f"w{index}-{n}")
                await before_commit(conn, "test-hold", hold, None)

    await asyncio.gather(*(writer(i) for i in range(writers)))
    for sid in sids:
        log = await log_of(stack, sid)
        assert [e[0] for e in log] == list(range(1, 3 + writers * per_writer))


def test_moved_item_events_are_written_only_when_the_public_status_changes() -> None:
    """The SQL another PostgreSQL statement embeds for the items it moved: none for a
    move between held statuses (as ``status_changed`` queues none), a ``review`` event
    with the new public status otherwise, its sessions woken after commit."""
    assert session_events.postgres_moved_item_events("moved", "reviewQueued", "reviewing") is None
    events = session_events.postgres_moved_item_events("moved", "approved", "completed")
    assert events is not None
    assert events.params["ev_status"] == "delivered"
    assert events.params["ev_kind"] == session_events.REVIEW
    assert "FROM moved" in events.ctes and "ORDER BY id FOR UPDATE" in events.ctes
    assert session_events.woken(["s1"]) == [(session_events.TOPIC, ("s1", False))]


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_messages_stored_together_are_stamped_after_the_session_newest_in_order(
    stack: Stack,
) -> None:
    """PostgreSQL: several messages of one session in one statement (the replies of
    concurrent turns, the intakes of concurrent plain turns), their clock 2 s behind the
    session's newest message (a replica ahead stamped it): each stamped after it and
    after the ones before it, so the session reads them in the order given."""
    from leadgate.core.types import BindingKind, BindingSpec
    from leadgate.turns import history

    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain")
    await stack.turns.run(api_trigger(org, agent, "opened"))
    session_id = await session_of(stack, agent)
    now = stack.clock.now_ms()
    async with stack.db.tx() as conn:
        await store(conn, stack, org, session_id, "ahead")  # (then stamped 2 s on:)
        await conn.execute(
            sa.update(t.messages)
            .where(t.messages.c.content == "ahead")
            .values(created_at=now + 2_000)
        )
    replies = [
        session_events.VisibleMessage(
            stack.ids.new("msg"), org.id, session_id, None, "assistant", f"reply {n}", now - n
        )
        for n in range(3)
    ]
    assert await session_events.store_visible_many(stack.db, replies) == [True] * 3
    intakes = [
        history.PlainIntake(
            stack.ids.new("msg"),
            org.id,
            agent["id"],
            "s1",
            BindingSpec(BindingKind.api),
            f"intake {n}",
            now,
        )
        for n in range(2)
    ]
    windows = await history.store_into_windows(stack.db, intakes)
    assert all(window is not None for window in windows)
    m = t.messages.c
    async with stack.db.read() as conn:
        rows = (
            await conn.execute(
                sa.select(m.content, m.created_at)
                .where(m.session_id == session_id)
                .order_by(m.created_at, m.id)
            )
        ).all()
    assert [r.content for r in rows][2:] == [
        "ahead",
        "reply 0",
        "reply 1",
        "reply 2",
        "intake 0",
        "intake 1",
    ]
    stamps = [r.created_at for r in rows][2:]
    assert stamps == list(range(now + 2_000, now + 2_006))
