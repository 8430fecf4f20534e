"""The event hub's marks of watched sessions (leadgate/operations/event_hub.py): on
PostgreSQL other replicas NOTIFY a session's events only while a reader here keeps it
marked; the mark must be committed before a reader's first read, shared by readers that
arrive together, renewed while they stay and left to run out when they are gone."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from leadgate.core.errors import Unavailable
from leadgate.operations.event_hub import EventHub


class Marks:
    """A mark that records its calls and finishes when told to (or fails once)."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.called = asyncio.Event()
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_next = False

    async def __call__(self, session_ids: Sequence[str]) -> None:
        self.calls.append(list(session_ids))
        self.called.set()
        await self.gate.wait()
        if self.fail_next:
            self.fail_next = False
            raise Unavailable("the database is unavailable", rule="database.unavailable")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_readers_arriving_together_wait_for_one_committed_mark() -> None:
    marks, clock = Marks(), Clock()
    hub = EventHub(marks, renew_s=30.0, monotonic=clock)
    marks.gate.clear()
    first = asyncio.ensure_future(hub.keep_notified("s1"))
    second = asyncio.ensure_future(hub.keep_notified("s1"))
    await asyncio.sleep(0)
    assert not first.done() and not second.done()  # neither reads before the commit
    marks.gate.set()
    await asyncio.gather(first, second)
    assert marks.calls == [["s1"]]
    clock.now += 29.0
    await hub.keep_notified("s1")  # still fresh (it holds four times as long)
    assert marks.calls == [["s1"]]
    clock.now += 1.0
    await hub.keep_notified("s1")
    assert marks.calls == [["s1"], ["s1"]]


async def test_a_failed_mark_fails_the_reader_and_the_next_one_tries_again() -> None:
    marks = Marks()
    hub = EventHub(marks, monotonic=Clock())
    marks.fail_next = True
    with pytest.raises(Unavailable):
        await hub.keep_notified("s1")
    await hub.keep_notified("s1")
    assert marks.calls == [["s1"], ["s1"]]


async def test_renewal_covers_waiters_and_sources_and_forgets_the_rest() -> None:
    marks, clock = Marks(), Clock()
    hub = EventHub(marks, monotonic=clock)
    waiter = hub.subscribe("sse")
    watched = {"mcp1", "mcp2"}
    stop = hub.watch(lambda _sid, _msg: None, lambda: watched)
    await hub.keep_notified("gone")  # read once, nobody reads it now
    await hub.renew()
    assert marks.calls[-1] == ["mcp1", "mcp2", "sse"]
    hub.unsubscribe(waiter)
    watched.discard("mcp1")
    await hub.renew()
    assert marks.calls[-1] == ["mcp2"]
    stop()
    calls = len(marks.calls)
    await hub.renew()  # nobody reads anything: no statement at all
    assert len(marks.calls) == calls
    # A session renewed a moment ago needs no mark of its own for a new reader.
    watched.add("mcp2")
    hub.watch(lambda _sid, _msg: None, lambda: watched)
    await hub.renew()
    calls = len(marks.calls)
    await hub.keep_notified("mcp2")
    assert len(marks.calls) == calls


async def test_renew_forever_renews_until_stopped_and_survives_a_failure() -> None:
    marks = Marks()
    hub = EventHub(marks, renew_s=0.0)  # no waiting between renewals: no real time
    hub.subscribe("s1")
    marks.fail_next = True
    stop = asyncio.Event()
    task = asyncio.ensure_future(hub.renew_forever(stop))
    while len(marks.calls) < 3:  # the first failed; the loop went on
        marks.called.clear()
        await marks.called.wait()
    stop.set()
    await asyncio.wait_for(task, 1.0)


async def test_without_a_mark_nothing_is_marked() -> None:
    """SQLite: no NOTIFY to keep on, so keeping notified and renewing do nothing."""
    hub = EventHub()
    hub.subscribe("s1")
    await hub.keep_notified("s1")
    await hub.renew()
