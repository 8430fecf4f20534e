"""Grouped writes (``leadgate.database.groups``) against a fake database: futures the
test resolves by hand stand for statements in flight, so nothing waits on a clock."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leadgate.core.errors import Unavailable
from leadgate.database.groups import Grouped


class Statement:
    """One statement of :class:`FakeWrites`, in flight until the test ends it."""

    def __init__(self, kind: str, items: list[str], retry: bool) -> None:
        self.kind, self.items, self.retry = kind, items, retry
        self.end: asyncio.Future[bool] = asyncio.get_running_loop().create_future()


class FakeWrites:
    """Writes whose every statement the test ends, each with or without a fault. An
    item's name says how the database takes it: ``refused…`` makes its statement fail
    (nothing written), ``missing…`` is left out of a group (and fails alone), any other
    is written. A fault writes nothing, so an item written twice would show in
    ``written``."""

    def __init__(self) -> None:
        self.statements: list[Statement] = []
        self.written: list[str] = []
        self.seen: set[str] = set()

    def pending(self) -> list[Statement]:
        return [s for s in self.statements if not s.end.done()]

    def shapes(self) -> list[tuple[str, list[str]]]:
        """Each statement so far: its kind (``alone`` or ``many``) and its items."""
        return [(s.kind, s.items) for s in self.statements]

    def finish(self, *, fault: bool = False) -> None:
        """End every statement in flight (with a database fault if ``fault``)."""
        for statement in self.pending():
            statement.end.set_result(fault)

    async def _start(self, kind: str, items: list[str]) -> bool:
        statement = Statement(kind, items, retry=bool(self.seen & set(items)))
        self.seen.update(items)
        self.statements.append(statement)
        return await statement.end

    async def alone(self, item: str) -> str:
        if await self._start("alone", [item]):
            raise Unavailable("the database went away")
        if item.startswith("refused"):
            raise ValueError(f"refused {item}")
        if item.startswith("missing"):
            raise RuntimeError(f"no {item}")
        self.written.append(item)
        return f"wrote {item}"

    async def many(self, items: Sequence[str]) -> list[str | Exception]:
        if await self._start("many", list(items)):
            raise Unavailable("the database went away")
        if any(item.startswith("refused") for item in items):
            raise ValueError("the statement was refused")
        outcomes: list[str | Exception] = []
        for item in items:
            if item.startswith("missing"):
                outcomes.append(RuntimeError(f"no {item}"))
            else:
                self.written.append(item)
                outcomes.append(f"wrote {item}")
        return outcomes


def calling(
    items: Sequence[str], *, in_flight: int = 1, most: int = 64
) -> tuple[FakeWrites, Grouped[str, str], list[asyncio.Future[str]]]:
    """A fake, a :class:`Grouped` over it, and a call started for each of ``items``."""
    fake = FakeWrites()
    grouped: Grouped[str, str] = Grouped(fake.alone, fake.many, in_flight=in_flight, most=most)
    return fake, grouped, [asyncio.ensure_future(grouped(item)) for item in items]


async def settle() -> None:
    """Let every ready task run until all wait on a statement (or are done)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_write_that_finds_none_running_goes_alone_at_once() -> None:
    fake, grouped, [call] = calling("a")
    await settle()
    assert fake.shapes() == [("alone", ["a"])]
    fake.finish()
    assert await call == "wrote a"
    assert (grouped.statements, grouped.items) == (1, 1)


async def test_writes_that_arrive_while_one_runs_go_in_one_statement() -> None:
    fake, grouped, calls = calling("abcd")
    await settle()
    assert fake.shapes() == [("alone", ["a"])]  # b, c and d wait for it
    fake.finish()
    await settle()
    assert fake.shapes()[1] == ("many", ["b", "c", "d"])
    fake.finish()
    assert await asyncio.gather(*calls) == [f"wrote {item}" for item in "abcd"]
    assert (grouped.statements, grouped.items) == (2, 4)


async def test_in_flight_writes_run_alone_before_any_waits() -> None:
    fake, _, calls = calling("abc", in_flight=2)
    await settle()
    assert fake.shapes() == [("alone", ["a"]), ("alone", ["b"])]
    fake.finish()
    await settle()
    # One write ended first and took the queue: c alone (a group of one).
    assert fake.shapes()[2] == ("alone", ["c"])
    fake.finish()
    assert await asyncio.gather(*calls) == ["wrote a", "wrote b", "wrote c"]


async def test_a_group_is_at_most_most_items() -> None:
    fake, _, calls = calling("abcde", most=2)
    await settle()
    for _ in range(3):
        fake.finish()
        await settle()
    assert [items for _, items in fake.shapes()] == [["a"], ["b", "c"], ["d", "e"]]
    assert len(await asyncio.gather(*calls)) == 5


async def test_an_item_the_statement_did_not_write_fails_only_its_caller() -> None:
    fake, _, calls = calling(("a", "b", "missing-c", "d"))
    await settle()
    fake.finish()
    await settle()
    fake.finish()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert results[:2] == ["wrote a", "wrote b"] and results[3] == "wrote d"
    assert isinstance(results[2], RuntimeError) and str(results[2]) == "no missing-c"


async def test_a_refused_group_is_written_alone_so_only_the_refused_item_fails() -> None:
    fake, grouped, calls = calling(("a", "b", "refused-c", "d"))
    await settle()
    fake.finish()
    await settle()
    fake.finish()  # the group: refused
    await settle()
    assert [kind for kind, _ in fake.shapes()] == ["alone", "many", "alone", "alone", "alone"]
    fake.finish()  # b, c and d alone, at once
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert results[:2] == ["wrote a", "wrote b"] and results[3] == "wrote d"
    assert isinstance(results[2], ValueError)
    assert (grouped.statements, grouped.items) == (5, 4)


async def test_a_database_fault_in_a_group_reaches_every_caller_and_nothing_is_retried() -> None:
    fake, _, calls = calling("abc")
    await settle()
    fake.finish()
    await settle()
    fake.finish(fault=True)  # the group of b and c
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert results[0] == "wrote a"
    # In doubt: the statement may have committed, so no item is written again.
    assert all(isinstance(r, Unavailable) for r in results[1:]), results
    assert len(fake.statements) == 2


async def test_a_cancelled_waiting_call_is_left_out_and_others_go_on() -> None:
    fake, _, calls = calling("abc")
    await settle()
    calls[1].cancel()
    fake.finish()
    await settle()
    assert fake.shapes()[1] == ("alone", ["c"])
    fake.finish()
    assert await calls[2] == "wrote c"
    with pytest.raises(asyncio.CancelledError):
        await calls[1]


async def test_a_caller_cancelled_while_its_group_runs_strands_nobody() -> None:
    fake, grouped, calls = calling("abc")
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
    assert fake.shapes()[-1] == ("alone", ["d"])
    fake.finish()
    assert await nxt == "wrote d"


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        Grouped(FakeWrites().alone, FakeWrites().many, in_flight=0)


_ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("call"), st.sampled_from(["ok", "ok", "ok", "refused", "missing"])),
        st.tuples(st.just("finish"), st.integers(0, 7), st.booleans()),
        st.tuples(st.just("cancel"), st.integers(0, 7)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(actions=_ACTIONS, in_flight=st.integers(1, 3), most=st.sampled_from([2, 3, 64]))
def test_any_interleaving_gives_each_caller_its_own_outcome_once(
    actions: list[tuple[object, ...]], in_flight: int, most: int
) -> None:
    """Calls, ends of statements (some with a fault) and cancellations in any order:
    at most ``in_flight`` first statements run at once, an item is written at most once,
    no item is retried after a fault, nobody is stranded, and every caller that was not
    cancelled gets what its own item's write gave."""
    asyncio.run(_interleaving(actions, in_flight, most))


async def _interleaving(actions: list[tuple[object, ...]], in_flight: int, most: int) -> None:
    fake = FakeWrites()
    grouped: Grouped[str, str] = Grouped(fake.alone, fake.many, in_flight=in_flight, most=most)
    calls: dict[str, asyncio.Task[str]] = {}
    faulted: set[str] = set()

    def check_in_flight() -> None:
        # Retries of a refused group run beside each other in its place.
        first = [s for s in fake.pending() if not s.retry]
        assert len(first) <= in_flight, [s.items for s in first]
        assert all(len(s.items) <= most for s in fake.statements)

    for action in actions:
        if action[0] == "call":
            item = f"{action[1]}{len(calls)}"
            calls[item] = asyncio.ensure_future(grouped(item))
        elif action[0] == "finish" and (pending := fake.pending()):
            statement = pending[int(str(action[1])) % len(pending)]
            if action[2]:
                faulted.update(statement.items)
            statement.end.set_result(bool(action[2]))
        elif action[0] == "cancel" and (live := [t for t in calls.values() if not t.done()]):
            live[int(str(action[1])) % len(live)].cancel()
        await settle()
        check_in_flight()
    for _ in range(200):
        if not fake.pending():
            break
        fake.finish()
        await settle()
        check_in_flight()

    assert all(call.done() for call in calls.values()), "a caller was stranded"
    assert len(fake.written) == len(set(fake.written)), fake.written
    for item, call in calls.items():
        appearances = [s for s in fake.statements if item in s.items]
        # At most a group that was refused, then the item alone.
        assert len(appearances) <= 2
        if len(appearances) == 2:
            assert appearances[0].kind == "many" and not appearances[0].end.result()
        if item in faulted:
            assert appearances[-1].end.result(), "an item was written again after a fault"
        if call.cancelled():
            continue
        error = call.exception()
        if item in faulted:
            assert isinstance(error, Unavailable)
        elif item.startswith("ok"):
            assert error is None and call.result() == f"wrote {item}"
            assert item in fake.written
        elif item.startswith("refused"):
            assert isinstance(error, ValueError)
        else:
            assert isinstance(error, RuntimeError)
        assert (error is None) == (item in fake.written)
    assert grouped.statements == len(fake.statements)
    assert grouped.items == len(fake.seen)
    # Idle again: the next write goes alone at once.
    nxt = asyncio.ensure_future(grouped("ok-last"))
    await settle()
    assert fake.pending()[-1].items == ["ok-last"] and len(fake.pending()) == 1
    fake.finish()
    assert await nxt == "wrote ok-last"
