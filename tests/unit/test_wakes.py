"""``leadgate.domain.wakes``: one wake-up per kind and transaction, after its commit, in
this process and (PostgreSQL) by one NOTIFY to the others; none for a rollback."""

from __future__ import annotations

import asyncio

import pytest

from leadgate.database.db import Database
from leadgate.domain import wakes
from leadgate.domain.wakes import Wake
from outbox.store import listen_all


async def test_a_transaction_wakes_each_kind_once_after_its_commit(migrated_url: str) -> None:
    db = Database(migrated_url)
    heard: list[list[Wake]] = []
    db.on_commit_payloads(wakes.TOPIC, heard.append)
    try:
        with db.record_statements() as statements:
            async with db.tx() as conn:
                for _ in range(3):  # three rows of one kind of work
                    await wakes.after_commit(conn, Wake.revision)
                await wakes.after_commit(conn, Wake.flow)
                assert heard == []  # nothing before the commit
        assert heard == [[Wake.revision, Wake.flow]]
        notifies = [s for s in statements if "pg_notify" in s]
        assert len(notifies) == (2 if db.is_postgres else 0)

        with pytest.raises(RuntimeError):
            async with db.tx() as conn:
                await wakes.after_commit(conn, Wake.leases)
                raise RuntimeError("rolled back")
        assert heard == [[Wake.revision, Wake.flow]]
    finally:
        await db.close()


async def test_other_replicas_hear_one_notification_per_transaction(migrated_pg: str) -> None:
    db = Database(migrated_pg)
    heard: asyncio.Queue[str] = asyncio.Queue()
    stop, ready = asyncio.Event(), asyncio.Event()
    listener = asyncio.create_task(
        listen_all(migrated_pg, {wakes.CHANNEL: heard.put_nowait}, stop, ready=ready.set)
    )
    try:
        await asyncio.wait_for(ready.wait(), timeout=10)
        async with db.tx() as conn:
            await wakes.after_commit(conn, Wake.revision)
            await wakes.after_commit(conn, Wake.revision)
        with pytest.raises(RuntimeError):
            async with db.tx() as conn:
                await wakes.after_commit(conn, Wake.leases)
                raise RuntimeError("rolled back: its NOTIFY is dropped")
        async with db.tx() as conn:  # a marker: notifications arrive in commit order
            await wakes.after_commit(conn, Wake.flow)
        got = [await asyncio.wait_for(heard.get(), timeout=10) for _ in range(2)]
        assert [wakes.parse(p) for p in got] == [
            (Wake.revision, db.notify_tag),
            (Wake.flow, db.notify_tag),
        ]
    finally:
        stop.set()
        await listener
        await db.close()


def test_a_kind_this_version_does_not_know_is_ignored() -> None:
    assert wakes.parse("leases abc") == (Wake.leases, "abc")
    assert wakes.parse("something-newer abc") is None


def test_an_episode_timer_notification_carries_its_sender_and_due_at() -> None:
    """``Wake.sla`` payloads carry the opened episode's earliest timer after the sender
    tag (``timer_payload``); other kinds carry none."""
    assert wakes.parse("sla abc 1700") == (Wake.sla, "abc")
    assert wakes.parse_due("sla abc 1700") == 1700
    assert wakes.parse_due("flow abc") is None
    assert wakes.parse_due("sla abc soon") is None
