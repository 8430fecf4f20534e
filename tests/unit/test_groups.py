"""Grouped writes (``leadgate.database.groups``) against a fake database: futures the
test resolves by hand stand for statements in flight, so nothing waits on a clock."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from leadgate.core.errors import Unavailable
from leadgate.database.groups import Grouped


class FakeWrites:
    """Writes that end when the test says so. ``alone`` and ``many`` record what each
    statement wrote; an item named in ``refused`` makes a grouped statement fail (as a
    value the database rejects does), and fails alone too."""

    def __init__(self) -> None:
        self.statements: list[tuple[str, list[str]]] = []
        self.pending: list[asyncio.Future[None]] = []
        self.refused: set[str] = set()
        self.missing: set[str] = set()
        self.fault: Exception | None = None

    async def _wait(self) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pending.append(future)
        await future

    async def alone(self, item: str) -> str:
        self.statements.append(("alone", [item]))
        await self._wait()
        if item in self.refused:
            raise ValueError(f"refused {item}")
        return f"wrote {item}"

    async def many(self, items: Sequence[str]) -> list[str | Exception]:
        self.statements.append(("many", list(items)))
        await self._wait()
        if self.fault is not None:
            raise self.fault
        if self.refused & set(items):
            raise ValueError("the statement was refused")
        return [
            RuntimeError(f"no {item}") if item in self.missing else f"wrote {item}"
            for item in items
        ]

    def finish(self) -> None:
        """End every statement in flight."""
        pending, self.pending = self.pending, []
        for future in pending:
            future.set_result(None)


async def settle() -> None:
    """Let every ready task run until all wait on a statement (or are done)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_write_that_finds_none_running_goes_alone_at_once() -> None:
    fake = FakeWrites()
    grouped: Grouped[str, str] = Grouped(fake.alone, fake.many, in_flight=1)
    call = asyncio.ensure_future(grouped("a"))
    await settle()
    assert fake.statements == [("alone", ["a"])]
    fake.finish()
    assert await call == "wrote a"
    assert (grouped.statements, grouped.items) == (1, 1)


async def test_writes_that_arrive_while_one_runs_go_in_one_statement() -> None:
    fake = FakeWrites()
    grouped: Grouped[str, str] = Grouped(fake.alone, fake.many, in_flight=1)
    calls = [asyncio.ensure_future(grouped(item)) for item in "abcd"]
    await settle()
    assert fake.statements == [("alone", ["a"])]  # b, c and d wait for it
    fake.finish()
    await settle()
    assert fake.statements[1] == ("many", ["b", "c", "d"])
    fake.finish()
    assert await asyncio.gather(*calls) == [f"wrote {item}" for item in "abcd"]
    assert (grouped.statements, grouped.items) == (2, 4)


async def test_in_flight_writes_run_alone_before_any_waits() -> None:
    fake = FakeWrites()
    grouped: Grouped[str, str] = Grouped(fake.alone, fake.many, in_flight=2)
    calls = [asyncio.ensure_future(grouped(item)) for item in "abc"]
    await settle()
    assert fake.statements == [("alone", ["a"]), ("alone", ["b"])]
    fake.finish()
    await settle()
    # One write ended first and took the queue: c alone (a group of one).
    assert fake.statements[2] == ("alone", ["c"])
    fake.finish()
    assert await asyncio.gather(*calls) == ["wrote a", "wrote b", "wrote c"]


async def test_a_group_is_at_most_most_items() -> None:
    fake = FakeWrites()
    grouped: Grouped[str, str] = Grouped(fake.alone, fake.many, in_flight=1, most=2)
    calls = [asyncio.ensure_future(grouped(item)) for item in "abcde"]
    await settle()
    for _ in range(3):
        fake.finish()
        await settle()
    assert [items for _, items in fake.statements] == [["a"], ["b", "c"], ["d", "e"]]
    assert len(await asyncio.gather(*calls)) == 5


async def test_an_item_the_statement_did_not_write_fails_only_its_caller() -> None:
    fake = FakeWrites()
    fake.missing = {"c"}
    grouped: Grouped[str, str] = Grouped(fake.alone, fake.many, in_flight=1)
    calls = [asyncio.ensure_future(grouped(item)) for item in "abcd"]
    await settle()
    fake.finish()
    await settle()
    fake.finish()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert results[:2] == ["wrote a", "wrote b"] and results[3] == "wrote d"
    assert isinstance(results[2], RuntimeError) and str(results[2]) == "no c"


async def test_a_refused_group_is_written_alone_so_only_the_refused_item_fails() -> None:
    fake = FakeWrites()
    fake.refused = {"c"}
    grouped: Grouped[str, str] = Grouped(fake.alone, fake.many, in_flight=1)
    calls = [asyncio.ensure_future(grouped(item)) for item in "abcd"]
    await settle()
    fake.finish()
    await settle()
    fake.finish()  # the group: refused
    await settle()
    assert [kind for kind, _ in fake.statements] == ["alone", "many", "alone", "alone", "alone"]
    fake.finish()  # b, c and d alone, at once
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert results[:2] == ["wrote a", "wrote b"] and results[3] == "wrote d"
    assert isinstance(results[2], ValueError)
    assert (grouped.statements, grouped.items) == (5, 4)


async def test_a_database_fault_in_a_group_reaches_every_caller_and_nothing_is_retried() -> None:
    fake = FakeWrites()
    fake.fault = Unavailable("the database went away")
    grouped: Grouped[str, str] = Grouped(fake.alone, fake.many, in_flight=1)
    calls = [asyncio.ensure_future(grouped(item)) for item in "abc"]
    await settle()
    fake.finish()
    await settle()
    fake.finish()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert results[0] == "wrote a"
    # In doubt: the statement may have committed, so no item is written again.
    assert all(isinstance(r, Unavailable) for r in results[1:]), results
    assert len(fake.statements) == 2


async def test_a_cancelled_waiting_call_is_left_out_and_others_go_on() -> None:
    fake = FakeWrites()
    grouped: Grouped[str, str] = Grouped(fake.alone, fake.many, in_flight=1)
    calls = [asyncio.ensure_future(grouped(item)) for item in "abc"]
    await settle()
    calls[1].cancel()
    fake.finish()
    await settle()
    assert fake.statements[1] == ("alone", ["c"])
    fake.finish()
    assert await calls[2] == "wrote c"
    with pytest.raises(asyncio.CancelledError):
        await calls[1]


async def test_a_caller_cancelled_while_its_group_runs_strands_nobody() -> None:
    fake = FakeWrites()
    grouped: Grouped[str, str] = Grouped(fake.alone, fake.many, in_flight=1)
    calls = [asyncio.ensure_future(grouped(item)) for item in "abc"]
    await settle()
    fake.finish()
    await settle()
    calls[1].cancel()  # its item is in the statement under way
    fake.finish()
    assert await calls[2] == "wrote c"
    await settle()  # (the group's task ends)
    assert grouped._running == 0  # the next write goes alone again
    nxt = asyncio.ensure_future(grouped("d"))
    await settle()
    assert fake.statements[-1] == ("alone", ["d"])
    fake.finish()
    assert await nxt == "wrote d"


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        Grouped(FakeWrites().alone, FakeWrites().many, in_flight=0)
