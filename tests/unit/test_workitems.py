"""Work items (SPEC 3): the one transition table, fenced transitions, lease tokens, audit;
and the storage rules underneath (SQLite recipe, migrations check)."""

from __future__ import annotations

import asyncio
import sqlite3
from itertools import product
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from leadgate.core.clock import FakeClock
from leadgate.core.errors import ConfigError, Conflict, NotMigratedError, TransitionError
from leadgate.database import schema as t
from leadgate.database.db import Database, upgrade
from leadgate.domain import workitems
from leadgate.domain.rows import WorkItem
from leadgate.domain.workitems import ACTIVE, TERMINAL, TRANSITIONS, Status, allowed
from tests.helpers import Org, api_trigger, make_agent, make_org
from tests.stack import Stack

S = Status

#: The transitions SPEC 3-6 call for, written out independently of the engine's table.
EXPECTED: dict[Status, set[Status]] = {
    # complete_task; incomplete provenance; 7 days idle; cancel
    S.inProgress: {S.reviewQueued, S.awaitingHuman, S.abandoned, S.cancelled},
    # a lead run claims it; cancel
    S.reviewQueued: {S.reviewing, S.cancelled},
    # approved; changesRequested; escalated/exhausted/3rd lease expiry; lease expiry; cancel
    S.reviewing: {S.approved, S.inProgress, S.awaitingHuman, S.reviewQueued, S.cancelled},
    # human approve; reject; return to worker; cancel
    S.awaitingHuman: {S.approved, S.rejected, S.inProgress, S.cancelled},
    # delivered; delivery failed permanently; cancel
    S.approved: {S.completed, S.failed, S.cancelled},
    S.completed: set(),
    S.rejected: set(),
    S.failed: set(),
    S.cancelled: set(),
    S.abandoned: set(),
}


# ------------------------------------------------------------------ the table itself


def test_terminal_and_active_statuses_match_the_spec() -> None:
    assert {s.value for s in TERMINAL} == {
        "completed",
        "rejected",
        "failed",
        "cancelled",
        "abandoned",
    }
    assert {s.value for s in ACTIVE} == {
        "inProgress",
        "reviewQueued",
        "reviewing",
        "awaitingHuman",
        "approved",
    }


def test_the_unique_active_index_covers_exactly_the_active_statuses() -> None:
    index = next(i for i in t.work_items.indexes if i.name == "uq_work_items_active")
    assert index.unique
    assert [c.name for c in index.columns] == ["agent_id", "session_id"]
    for dialect in ("sqlite", "postgresql"):
        where = str(index.dialect_options[dialect]["where"])
        listed = {s for s in Status if f"'{s.value}'" in where}
        assert listed == set(ACTIVE), dialect


@pytest.mark.parametrize(("src", "dst"), list(product(Status, Status)))
def test_every_pair_of_the_transition_table(src: Status, dst: Status) -> None:
    assert allowed(src, dst) is (dst in EXPECTED[src])
    if src in TERMINAL:
        assert not allowed(src, dst)
    if src == dst:
        assert not allowed(src, dst)


def test_a_one_statement_move_is_built_only_for_allowed_moves_without_an_event() -> None:
    """``moved_with_audit`` (PostgreSQL's one-statement moves, the lead's claim) writes no
    session event: it refuses a move the table forbids and one that changes the public
    status (which needs the event ``transition`` would write)."""
    head = sa.select(t.work_items.c.id).cte("head")

    def build(src: Status, dst: Status) -> Any:
        return workitems.moved_with_audit(
            head.c.id, src=src, dst=dst, actor="a", action="x", values={}, name="m"
        )

    moved, audited = build(S.reviewQueued, S.reviewing)
    assert (moved.name, audited.name) == ("m", "m_audit")
    with pytest.raises(TransitionError, match="cannot go"):
        build(S.reviewQueued, S.approved)
    with pytest.raises(TransitionError, match="public status"):
        build(S.approved, S.completed)
    # The statements that write the event themselves (the submission, the reveal)
    # require a move that changes the public status.
    workitems.require_move(S.inProgress, S.reviewQueued, event=True)
    workitems.require_move(S.approved, S.completed, event=True)
    with pytest.raises(TransitionError, match="changes no public status"):
        workitems.require_move(S.reviewQueued, S.reviewing, event=True)


def test_table_is_exactly_the_expected_one() -> None:
    assert {k: set(v) for k, v in TRANSITIONS.items()} == EXPECTED
    # every non-terminal status can be cancelled; every terminal one is a dead end
    for status in ACTIVE:
        assert allowed(status, S.cancelled)
    for status in TERMINAL:
        assert TRANSITIONS[status] == frozenset()


# ----------------------------------------------------------------- fenced transitions


async def _item_and_audit(stack: Stack, item_id: str) -> tuple[WorkItem, int]:
    async with stack.db.read() as conn:
        item = await workitems.get(conn, item_id)
        count = await conn.scalar(
            sa.select(sa.func.count()).where(t.audit.c.work_item_id == item_id)
        )
    return item, int(count or 0)


async def _audit_rows(stack: Stack, item_id: str) -> list[dict[str, Any]]:
    async with stack.db.read() as conn:
        rows = (
            await conn.execute(
                sa.select(t.audit)
                .where(t.audit.c.work_item_id == item_id)
                .order_by(t.audit.c.created_at, t.audit.c.id)
            )
        ).all()
    return [dict(r._mapping) for r in rows]


async def _new_item(stack: Stack) -> tuple[Org, str]:
    """An organization and the id of its worker's new ``inProgress`` item."""
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")
    await stack.turns.run(api_trigger(org, worker, "start the task"))
    async with stack.db.read() as conn:
        item_id = await conn.scalar(
            sa.select(t.work_items.c.id).where(t.work_items.c.agent_id == worker["id"])
        )
    assert item_id is not None
    return org, item_id


async def test_fenced_transitions_leases_and_audit(stack: Stack) -> None:
    org, item_id = await _new_item(stack)
    clock: Any = stack.clock
    clock.advance(1_000)

    async def attempt(src: Status, dst: Status, **kwargs: Any) -> None:
        # The failure is caught inside the transaction and the transaction commits:
        # a fenced update that matched nothing must have written nothing at all.
        error: TransitionError | None = None
        async with stack.db.tx() as conn:
            try:
                await workitems.transition(
                    conn,
                    stack.clock,
                    stack.ids,
                    item_id,
                    src=src,
                    dst=dst,
                    actor="test",
                    action="probe",
                    **kwargs,
                )
            except TransitionError as exc:
                error = exc
        if error is not None:
            raise error

    async def move(src: Status, dst: Status, **kwargs: Any) -> dict[str, Any]:
        async with stack.db.tx() as conn:
            moved = await workitems.transition(
                conn,
                stack.clock,
                stack.ids,
                item_id,
                src=src,
                dst=dst,
                actor="test",
                action=f"{src}->{dst}",
                text="why",
                **kwargs,
            )
        return moved._asdict()

    async def expect_unchanged(src: Status, dst: Status, rule: str, **kwargs: Any) -> None:
        before = await _item_and_audit(stack, item_id)
        clock.advance(1_000)
        with pytest.raises(TransitionError) as info:
            await attempt(src, dst, **kwargs)
        assert info.value.rule == rule
        assert isinstance(info.value, Conflict) and info.value.status == 409
        assert await _item_and_audit(stack, item_id) == before

    # Forbidden by the table: refused before any SQL.
    await expect_unchanged(S.inProgress, S.approved, "workItem.transition")
    await expect_unchanged(S.inProgress, S.completed, "workItem.transition")
    # Allowed pair, but the item is not in ``src``.
    await expect_unchanged(S.reviewQueued, S.reviewing, "workItem.status")
    await expect_unchanged(S.awaitingHuman, S.approved, "workItem.status")
    # Right status, wrong organization.
    await expect_unchanged(S.inProgress, S.cancelled, "workItem.status", org_id="org_other")

    row = await move(S.inProgress, S.reviewQueued)
    assert row["status"] == "reviewQueued"
    assert row["updated_at"] == stack.clock.now_ms()
    row = await move(S.reviewQueued, S.reviewing, values={"lease_token": "lease-1"})
    assert row["lease_token"] == "lease-1"
    # Lease-token fencing: a runner that lost its lease cannot commit.
    await expect_unchanged(S.reviewing, S.approved, "workItem.status", lease_token="lease-2")
    row = await move(S.reviewing, S.approved, lease_token="lease-1", values={"lease_token": None})
    assert row["status"] == "approved"
    await move(S.approved, S.completed)
    # Terminal: nothing moves it any more.
    for dst in Status:
        await expect_unchanged(S.completed, dst, "workItem.transition")

    audit = await _audit_rows(stack, item_id)
    assert [(a["action"], a["from_status"], a["to_status"]) for a in audit] == [
        ("create", None, "inProgress"),
        ("inProgress->reviewQueued", "inProgress", "reviewQueued"),
        ("reviewQueued->reviewing", "reviewQueued", "reviewing"),
        ("reviewing->approved", "reviewing", "approved"),
        ("approved->completed", "approved", "completed"),
    ]
    assert all(a["org_id"] == org.id for a in audit)
    assert all(a["actor"] == "test" and a["text"] == "why" for a in audit[1:])


async def test_a_move_and_the_move_after_it_in_one_update(stack: Stack) -> None:
    """``transition(..., then=Then(...))``: both moves checked against the table and
    fenced as one; each has its audit row, in order; ``between`` runs once, after the
    fence held, with the item as it ends up."""
    _, item_id = await _new_item(stack)
    seen: list[str] = []

    async def between(item: Any) -> None:
        seen.append(item.status)

    async def through(then_to: Status, **kwargs: Any) -> Any:
        async with stack.db.tx() as conn:
            return await workitems.transition(
                conn,
                stack.clock,
                stack.ids,
                item_id,
                src=S.reviewing,
                dst=S.approved,
                actor="lead:x",
                action="approve",
                text="fine",
                then=workitems.Then(then_to, "system:outbox", "delivered", between),
                **kwargs,
            )

    for src, dst, values in (
        (S.inProgress, S.reviewQueued, {}),
        (S.reviewQueued, S.reviewing, {"lease_token": "lease-1"}),
    ):
        async with stack.db.tx() as conn:
            await workitems.transition(
                conn, stack.clock, stack.ids, item_id, src=src, dst=dst, actor="t", action="t",
                values=values,
            )  # fmt: skip
    before = await _item_and_audit(stack, item_id)
    # approved -> inProgress is not in the table: refused before any SQL.
    with pytest.raises(TransitionError) as info:
        await through(S.inProgress, lease_token="lease-1")
    assert info.value.rule == "workItem.transition"
    # A lost lease fences both moves; ``between`` never ran.
    with pytest.raises(TransitionError) as info:
        await through(S.completed, lease_token="lease-2")
    assert info.value.rule == "workItem.status"
    assert await _item_and_audit(stack, item_id) == before and seen == []

    done = await through(S.completed, lease_token="lease-1", values={"lease_token": None})
    assert (done.status, done.lease_token, seen) == ("completed", None, ["completed"])
    audit = await _audit_rows(stack, item_id)
    keys = ("actor", "action", "from_status", "to_status", "text")
    assert [tuple(a[k] for k in keys) for a in audit[-2:]] == [
        ("lead:x", "approve", "reviewing", "approved", "fine"),
        ("system:outbox", "delivered", "approved", "completed", None),
    ]


async def test_a_move_by_a_clock_behind_the_item_keeps_the_trail_in_order(
    stack: Stack,
) -> None:
    """A mover whose clock reads earlier than the item's last update (read before it
    waited for a connection, or on a replica whose clock runs behind): the move, one at
    a time or in a batch, takes the item's time, and the audit trail read in time order
    still lists the moves in the order they happened. (A clock ahead of the item moves
    it to its own time: ``test_fenced_transitions_leases_and_audit``.)"""
    _, item_id = await _new_item(stack)
    clock: Any = stack.clock
    clock.advance(1_000)
    behind = FakeClock(stack.clock.now_ms() - 5_000)  # before even the item's creation
    async with stack.db.tx() as conn:
        await workitems.transition(
            conn, stack.clock, stack.ids, item_id, src=S.inProgress, dst=S.reviewQueued,
            actor="t", action="queued",
        )  # fmt: skip
    at = stack.clock.now_ms()
    async with stack.db.tx() as conn:
        moved = await workitems.transition(
            conn, behind, stack.ids, item_id, src=S.reviewQueued, dst=S.reviewing,
            actor="t", action="claimed", values={"lease_token": "lease-1"},
        )  # fmt: skip
        assert moved.updated_at == at
    async with stack.db.tx() as conn:
        done = await workitems.transition(
            conn, behind, stack.ids, item_id, src=S.reviewing, dst=S.approved,
            actor="t", action="approved", lease_token="lease-1",
        )  # fmt: skip
        assert done.updated_at == at
        assert await workitems.transition_many(
            conn, behind, stack.ids, [item_id], src=S.approved, dst=S.completed,
            actor="t", action="delivered",
        ) == [item_id]  # fmt: skip
    audit = await _audit_rows(stack, item_id)
    assert [(a["action"], a["created_at"]) for a in audit[1:]] == [
        ("queued", at),
        ("claimed", at),
        ("approved", at),
        ("delivered", at),
    ]


# ------------------------------------------------------------------------ storage


async def test_a_postgresql_read_runs_outside_a_transaction_block_and_refuses_writes(
    pg_url: str,
) -> None:
    """READ COMMITTED gives each statement its own snapshot inside a block or not, so a
    read sends no BEGIN/COMMIT (two round trips fewer); a write there is refused before
    it reaches the server."""
    await asyncio.to_thread(upgrade, pg_url)
    db = Database(pg_url)
    try:
        began = sa.text("SELECT transaction_timestamp()")
        async with db.read() as conn:
            first = (await conn.execute(began)).scalar()
            await conn.execute(sa.text("SELECT pg_sleep(0.002)"))
            # In a block both statements would report the block's start.
            assert (await conn.execute(began)).scalar() != first
            with pytest.raises(TypeError, match="only SELECT"):
                await conn.execute(
                    t.organizations.insert(), {"id": "o1", "name": "x", "created_at": 1}
                )
        async with db.read() as conn:
            assert (
                await conn.execute(sa.select(sa.func.count()).select_from(t.organizations))
            ).scalar() == 0
    finally:
        await db.close()


async def test_sqlite_pragmas_are_on(tmp_path: Path) -> None:
    db = Database(f"sqlite+aiosqlite:///{tmp_path}/p.db")
    try:
        async with db.tx() as conn:
            journal = (await conn.execute(sa.text("PRAGMA journal_mode"))).scalar()
            fks = (await conn.execute(sa.text("PRAGMA foreign_keys"))).scalar()
            # Savepoints' statement journal in memory, not spilled to temp files
            # (every group-commit member runs in a savepoint).
            temp_store = (await conn.execute(sa.text("PRAGMA temp_store"))).scalar()
        async with db.read() as conn:
            read_only = (await conn.execute(sa.text("PRAGMA query_only"))).scalar()
            # The loop never blocks in SQLite's busy handler: waiting for another
            # process's lock is an asyncio sleep (test_inline_sqlite covers it).
            busy = (await conn.execute(sa.text("PRAGMA busy_timeout"))).scalar()
        assert str(journal).lower() == "wal"
        assert fks == 1 and temp_store == 2
        assert read_only == 1 and busy == 0
    finally:
        await db.close()


async def test_sqlite_write_transactions_begin_immediate(tmp_path: Path) -> None:
    path = tmp_path / "lock.db"
    db = Database(f"sqlite+aiosqlite:///{path}")
    try:
        async with db.tx() as conn:
            await conn.execute(sa.text("CREATE TABLE probe (n INTEGER)"))

        def other_writer_can_begin() -> bool:
            raw = sqlite3.connect(path, timeout=0, isolation_level=None)
            try:
                raw.execute("BEGIN IMMEDIATE")
                raw.execute("ROLLBACK")
                return True
            except sqlite3.OperationalError as exc:
                assert "locked" in str(exc)
                return False
            finally:
                raw.close()

        # A write transaction holds the write lock from its first statement on, even
        # before it writes anything (BEGIN IMMEDIATE, not a deferred BEGIN).
        async with db.tx() as conn:
            await conn.execute(sa.text("SELECT count(*) FROM probe"))
            assert not other_writer_can_begin()
        assert other_writer_can_begin()
        # A read-only transaction does not.
        async with db.read() as conn:
            await conn.execute(sa.text("SELECT count(*) FROM probe"))
            assert other_writer_can_begin()
    finally:
        await db.close()


async def test_sqlite_concurrent_read_then_write_counters_are_exact(tmp_path: Path) -> None:
    db = Database(f"sqlite+aiosqlite:///{tmp_path}/c.db")
    try:
        async with db.tx() as conn:
            await conn.execute(sa.text("CREATE TABLE counter (id INTEGER PRIMARY KEY, n INTEGER)"))
            await conn.execute(sa.text("INSERT INTO counter VALUES (1, 0)"))

        async def bump(times: int) -> None:
            for _ in range(times):
                async with db.tx() as conn:
                    n = (await conn.execute(sa.text("SELECT n FROM counter WHERE id = 1"))).scalar()
                    await asyncio.sleep(0)  # let the other writer try to interleave
                    await conn.execute(
                        sa.text("UPDATE counter SET n = :n WHERE id = 1"), {"n": int(n or 0) + 1}
                    )

        await asyncio.gather(bump(40), bump(40), bump(40))
        async with db.read() as conn:
            final = (await conn.execute(sa.text("SELECT n FROM counter"))).scalar()
        assert final == 120
    finally:
        await db.close()


def test_only_sqlite_and_postgres_urls_are_accepted() -> None:
    for url in ("mysql+aiomysql://u@127.0.0.1/db", "not a url at all"):
        with pytest.raises(ConfigError):
            Database(url)


async def test_check_migrated_tells_to_run_db_upgrade(db_url: str) -> None:
    db = Database(db_url)
    try:
        with pytest.raises(NotMigratedError) as info:
            await db.check_migrated()
        assert "leadgate db upgrade" in info.value.message
        assert info.value.rule == "db.not_migrated"
        revision = await asyncio.to_thread(upgrade, db_url)
        assert revision
        await db.check_migrated()
        # and upgrading again is a no-op
        assert await asyncio.to_thread(upgrade, db_url) == revision
        await db.check_migrated()
    finally:
        await db.close()
