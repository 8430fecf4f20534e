"""The turn path (SPEC 3): intake, complete_task, gating, fail closed, provenance, sweeper."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest
import sqlalchemy as sa

from binding.bindings import (
    active_binding,
    deactivate_session,
    find_session,
    is_unchanged,
    unchanged_params,
)
from leadgate.core.clock import DAY_MS
from leadgate.core.errors import ModelError, TransitionError, ValidationError
from leadgate.core.limits import SNAPSHOT_LIMIT, SUMMARY_LIMIT, TASK_CONTEXT_LIMIT
from leadgate.core.metrics import METRICS
from leadgate.core.runners import LOCKED_RECHECK_MS, drain
from leadgate.core.types import BindingKind, BindingSpec, Busy, Duplicate, Gated, Reply, Trigger
from leadgate.database import schema as t
from leadgate.database.db import Conn
from leadgate.database.pg import asyncpg_dsn
from leadgate.domain import agents, session_events
from leadgate.domain.rows import WorkItem
from leadgate.domain.workitems import REVIEW_CHANNEL, Status, Sweeper
from leadgate.turns.context import TurnContext
from leadgate.turns.history import _STORE_INTO_WINDOW, PlainIntake, store_into_window
from leadgate.turns.intake import Accepted, Intake
from leadgate.turns.messages import visible_transcript
from leadgate.turns.path import TurnService
from leadgate.turns.providers.base import ModelEvent, ModelRequest, TextDelta, ToolCall
from leadgate.turns.providers.script import ScriptProvider
from tests.helpers import (
    Anonymizer,
    Org,
    api_trigger,
    eventually,
    fake_clock,
    held_open,
    item_audit,
    item_locked,
    make_agent,
    make_org,
    ours,
    slack_trigger,
    transitions_counted,
)
from tests.stack import Stack, build_stack

Handler = Callable[[ModelRequest], Awaitable[list[ModelEvent]]]


class RecordingProvider:
    """A provider whose behaviour each test scripts; it records every request."""

    def __init__(self) -> None:
        self.requests: list[ModelRequest] = []
        self.handler: Handler = self.default

    @staticmethod
    async def default(request: ModelRequest) -> list[ModelEvent]:
        if request.messages[-1].role == "tool":
            return []
        return [TextDelta("plain answer")]

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        self.requests.append(request)
        for event in await self.handler(request):
            yield event


def completing(text: str, summary: Any, after_tool: str = "") -> Handler:
    """A handler: ``text`` plus complete_task(summary); after the tool result, ``after_tool``."""

    async def handler(request: ModelRequest) -> list[ModelEvent]:
        if request.messages[-1].role == "tool":
            return [TextDelta(after_tool)] if after_tool else []
        return [TextDelta(text), ToolCall("call_1", "complete_task", {"summary": summary})]

    return handler


def then_complete(meddle: Callable[[], Awaitable[None]]) -> Handler:
    """A handler: ``meddle()`` while the model runs, then ``finished`` and
    complete_task("done")."""

    async def handler(request: ModelRequest) -> list[ModelEvent]:
        if request.messages[-1].role == "tool":
            return []
        await meddle()
        return [TextDelta("finished"), ToolCall("c1", "complete_task", {"summary": "done"})]

    return handler


@pytest.fixture
async def rig(migrated_url: str) -> AsyncIterator[tuple[Stack, RecordingProvider]]:
    """A Stack (FakeClock) with the script model and a recorder."""
    rec = RecordingProvider()
    stack = build_stack(migrated_url, providers={"script": ScriptProvider(), "rec": rec})
    yield stack, rec
    await stack.stop()


async def count(stack: Stack, table: sa.Table) -> int:
    async with stack.db.read() as conn:
        return int(await conn.scalar(sa.select(sa.func.count()).select_from(table)) or 0)


async def select_all(stack: Stack, query: sa.Select[Any]) -> list[dict[str, Any]]:
    async with stack.db.read() as conn:
        return [dict(r._mapping) for r in (await conn.execute(query)).all()]


async def session_id(stack: Stack, agent: dict[str, Any], key: str = "s1") -> str:
    async with stack.db.read() as conn:
        sid = await conn.scalar(
            sa.select(t.sessions.c.id).where(
                t.sessions.c.agent_id == agent["id"], t.sessions.c.key == key
            )
        )
    assert sid is not None
    return str(sid)


async def items(stack: Stack, agent: dict[str, Any]) -> list[dict[str, Any]]:
    w = t.work_items.c
    return await select_all(
        stack,
        sa.select(t.work_items).where(w.agent_id == agent["id"]).order_by(w.created_at, w.id),
    )


async def messages(stack: Stack, agent: dict[str, Any], key: str = "s1") -> list[dict[str, Any]]:
    m = t.messages.c
    sid = await session_id(stack, agent, key)
    return await select_all(
        stack, sa.select(t.messages).where(m.session_id == sid).order_by(m.created_at, m.id)
    )


async def transcript(stack: Stack, org: Org, agent: dict[str, Any], key: str = "s1") -> Any:
    sid = await session_id(stack, agent, key)
    async with stack.db.read() as conn:
        rows = await visible_transcript(conn, org.id, sid)
    return [(r["role"], r["content"]) for r in rows]


async def force_status(stack: Stack, item_id: str, status: Status) -> None:
    async with stack.db.tx() as conn:
        await conn.execute(
            t.work_items.update().where(t.work_items.c.id == item_id).values(status=status.value)
        )


async def lead_worker(
    stack: Stack, org: Org, name: str = "worker", model: str = "script"
) -> dict[str, Any]:
    await make_agent(stack, org, f"{name}-lead")
    return await make_agent(stack, org, name, lead=f"{name}-lead", model=model)


# --------------------------------------------------------------------------- intake


async def test_plain_turn_on_an_existing_session_is_cheap(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    """A plain turn of an existing session with an unchanged binding, by the agent's slug
    (as REST and MCP pass it): one intake and one finish transaction, the agent, session
    (+ binding), policy and history reads, and only the user and assistant messages: no
    inbound-event row (nothing to de-duplicate, no work item to audit). Each of the two
    transactions adds one statement: the session event of its visible message (an INSERT
    on SQLite; on PostgreSQL one ``WITH`` statement: counter, rows and NOTIFY). On
    PostgreSQL each message is that one ``WITH`` statement with the message in it, run
    outside a transaction block (one round trip); the intake's also finds the session,
    checks its binding and reads the window. The
    agent and the policy rules come from the intake's cache (on PostgreSQL while the
    process LISTENs for their changes, as the service does)."""
    stack, _ = rig
    await stack.listen_for_changes()
    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain")
    first = await stack.turns.run(api_trigger(org, {"id": "plain"}, "hello"))
    assert first == Reply("Echo: hello")
    uses = stack.db.connection_uses
    with stack.db.record_statements() as statements:
        again = await stack.turns.run(api_trigger(org, {"id": "plain"}, "hello again"))
    assert again == Reply("Echo: hello again")
    uses = stack.db.connection_uses - uses
    work = sorted(
        verb
        for verb in (sql.split()[0].upper() for sql in statements)
        if verb not in ("BEGIN", "COMMIT", "SAVEPOINT", "RELEASE", "PRAGMA")
    )
    # The agent and the policy rules were read by the first turn and nothing of them
    # changed since (leadgate.domain.config_cache): session and history only.
    assert not [sql for sql in statements if "FROM agents" in sql or "policy_rules" in sql]
    if stack.db.statements_alone:
        # No transaction block (Intake._take_plain): the session with its binding and
        # history window and the user message with its event in one statement, then
        # the finish: two round trips.
        assert "LATERAL" in statements[0], statements
        assert "INSERT INTO messages" in statements[0], statements
        assert "INSERT INTO messages" in statements[-1], statements  # the finish
        assert work == ["WITH"] * 2, statements
        assert len(statements) == 2, statements
        # ...and a pooled connection for each of them alone: none for the kept agent
        # and rules (ConfigCache.known).
        assert uses == 2
    else:
        assert work == sorted(["INSERT"] * 4 + ["SELECT"] * 2), statements
        # The agent's and the rules' lookups check for changes by other connections;
        # in a write transaction (no other connection can commit) the two share one.
        assert statements.count("PRAGMA data_version") == 1
    assert len([sql for sql in statements if "session_events" in sql]) == 2
    assert not [sql for sql in statements if "inbound_events" in sql]
    assert [m["role"] for m in await messages(stack, agent)] == ["user", "assistant"] * 2


async def test_a_plain_turn_writes_and_sees_what_the_transaction_would(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    """On PostgreSQL a plain turn of an existing session is taken in without a
    transaction block (Intake._take_plain); on both backends the model sees the history
    with the new message last, the session's events are numbered in order, and whatever
    makes the turn not plain (a new binding, a deactivated agent, a lead) goes through
    the transaction with its rules."""
    stack, rec = rig
    await stack.listen_for_changes()
    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain", model="rec")
    await make_agent(stack, org, "plain-lead")
    assert await stack.turns.run(api_trigger(org, agent, "one")) == Reply("plain answer")
    assert await stack.turns.run(api_trigger(org, agent, "two")) == Reply("plain answer")
    seen = [(m.role, m.content) for m in rec.requests[-1].messages if m.role != "system"]
    assert seen == [("user", "one"), ("assistant", "plain answer"), ("user", "two")]
    sid = await session_id(stack, agent)
    async with stack.db.read() as conn:
        events = await session_events.read(conn, sid, after=0, limit=10)
    assert [(e.seq, e.role, e.content) for e in events] == [
        (1, "user", "one"),
        (2, "assistant", "plain answer"),
        (3, "user", "two"),
        (4, "assistant", "plain answer"),
    ]
    # Another binding for the session: written by the transaction.
    studio = Trigger(
        org_id=org.id,
        agent_id=agent["id"],
        session_key="s1",
        text="three",
        binding=BindingSpec(BindingKind.studio),
    )
    assert await stack.turns.run(studio) == Reply("plain answer")
    async with stack.db.read() as conn:
        active = await active_binding(conn, sid)
    assert active is not None and active.kind == "studio"
    # A lead now: the next message opens a work item.
    async with stack.db.tx() as conn:
        await agents.save_agent(
            conn, stack.clock, stack.ids, org.id, agent_ref="plain", lead="plain-lead"
        )
    await stack.turns.run(api_trigger(org, agent, "four"))
    assert [i["status"] for i in await items(stack, agent)] == ["inProgress"]
    async with stack.db.tx() as conn:
        await conn.execute(
            t.agents.update().where(t.agents.c.id == agent["id"]).values(active=False)
        )
    with pytest.raises(ValidationError, match="inactive"):
        await stack.turns.run(api_trigger(org, agent, "five"))
    assert [m["content"] for m in await messages(stack, agent) if m["role"] == "user"] == [
        "one",
        "two",
        "three",
        "four",
    ]


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_the_one_statement_intake_stores_only_into_the_same_binding(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    """PostgreSQL's plain intake statement (history.store_into_window) compares the
    active binding in SQL: the same JSON address in another key order is the same
    binding; another address, another silence or a missing session write nothing (the
    turn then takes the transaction); what it stores is numbered after what was there,
    and the window it returns is the one from before the message."""
    stack, _ = rig
    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain")
    address = {"a": 1, "b": [1, {"c": "d"}]}
    first = Trigger(
        org_id=org.id,
        agent_id=agent["id"],
        session_key="s1",
        text="one",
        binding=BindingSpec(BindingKind.api, address=address),
    )
    assert await stack.turns.run(first) == Reply("Echo: one")
    sid = await session_id(stack, agent)

    async def store(binding: BindingSpec, key: str = "s1", text: str = "x") -> object:
        return await store_into_window(
            stack.db,
            PlainIntake(
                stack.ids.new("msg"), org.id, agent["id"], key, binding, text, stack.clock.now_ms()
            ),
        )

    async with stack.db.read() as conn:
        current = await active_binding(conn, sid)
    assert current is not None
    others = [
        BindingSpec(BindingKind.api, address={"a": 1, "b": [1]}),
        BindingSpec(BindingKind.api, address={"a": 1.5, "b": [1, {"c": "d"}]}),
        BindingSpec(BindingKind.api, address=address, silent=True),
        BindingSpec(BindingKind.studio, address=address),
    ]
    for other in others:
        # The SQL test (bindings.UNCHANGED_SQL) answers as bindings.is_unchanged does.
        assert not is_unchanged(current, other)
        assert await store(other) is None, other
    assert await store(BindingSpec(BindingKind.api, address=address), key="s2") is None
    assert [m["content"] for m in await messages(stack, agent)] == ["one", "Echo: one"]

    reordered = BindingSpec(BindingKind.api, address={"b": [1, {"c": "d"}], "a": 1})
    assert is_unchanged(current, reordered)
    found = await store(reordered, text="two")
    assert isinstance(found, tuple)
    session, window = found
    assert session.id == sid and session.binding is not None
    assert session.binding.address == address
    assert [(m.role, m.content) for m in window.messages] == [
        ("user", "one"),
        ("assistant", "Echo: one"),
    ]
    assert [m["content"] for m in await messages(stack, agent)] == ["one", "Echo: one", "two"]
    async with stack.db.read() as conn:
        events = await session_events.read(conn, sid, after=0, limit=10)
    assert [(e.seq, e.content) for e in events] == [(1, "one"), (2, "Echo: one"), (3, "two")]


async def _two_quick_discord_messages(
    rig: tuple[Stack, RecordingProvider],
    meanwhile: Callable[[Stack, Trigger], Awaitable[None]] | None = None,
    *,
    second_silent: bool = False,
) -> list[tuple[str, dict[str, Any]]]:
    """A plain worker's Discord conversation: a first message whose model answers only
    once a second message (Discord: its own message id, so its own binding, the
    session's active one from then on) was taken in and answered; ``meanwhile`` runs
    before the first's turn ends. The deliveries queued (text, address), by text."""
    stack, rec = rig
    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain", model="rec")
    second_taken = asyncio.Event()

    def discord_trigger(text: str, message_id: str, silent: bool = False) -> Trigger:
        return Trigger(
            org_id=org.id,
            agent_id=str(agent["id"]),
            session_key="discord:G1:C1",
            text=text,
            binding=BindingSpec(BindingKind.discord, _discord_address(message_id), silent),
            external_event_id=f"discord:message:{message_id}",
        )

    async def answer(request: ModelRequest) -> list[ModelEvent]:
        if request.messages[-1].content == "first":
            await second_taken.wait()
        return [TextDelta(f"to {request.messages[-1].content}")]

    rec.handler = answer
    first = asyncio.ensure_future(stack.turns.run(discord_trigger("first", "1")))
    await eventually(lambda: len(rec.requests) == 1, what="the first turn at its model")
    second = discord_trigger("second", "2", silent=second_silent)
    assert await stack.turns.run(second) == Reply("to second")
    if meanwhile is not None:
        await meanwhile(stack, second)
    second_taken.set()
    assert await first == Reply("to first")
    # Both answers are in the transcript, whatever is posted.
    assert [m["content"] for m in await messages(stack, agent, "discord:G1:C1")] == [
        "first",
        "second",
        "to second",
        "to first",
    ]
    rows = await select_all(stack, sa.select(t.deliveries.c.text, t.deliveries.c.address))
    return sorted((row["text"], row["address"]) for row in rows)


def _discord_address(message_id: str) -> dict[str, Any]:
    return {"guild_id": "G1", "channel_id": "C1", "message_id": message_id}


async def test_a_channel_reply_goes_to_its_own_message_after_a_later_one_was_taken_in(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    """SPEC 10: a plain channel turn's reply is posted threaded to the message that ran
    it. Two quick messages to a plain worker (no busy state: both turns run), the first
    turn ending after the second's binding became the session's active one: each gets
    its own reply, on its own message's address. Before, the first's reply was stored
    but never posted (its binding was no longer the session's active one)."""
    assert await _two_quick_discord_messages(rig) == [
        ("to first", _discord_address("1")),
        ("to second", _discord_address("2")),
    ]


async def test_a_channel_reply_of_a_deactivated_session_is_not_posted(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    """The session's bindings deactivated while the first turn ran (no active binding):
    its reply is stored, not posted."""

    async def deactivate(stack: Stack, second: Trigger) -> None:
        async with stack.db.tx() as conn:
            session = await find_session(conn, second.agent_id, second.session_key)
            assert session is not None
            assert await deactivate_session(conn, session.id) == 1

    assert await _two_quick_discord_messages(rig, deactivate) == [
        ("to second", _discord_address("2"))
    ]


async def test_a_channel_reply_is_not_posted_once_the_route_was_made_silent(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    """The route made silent while the first turn ran: the next message's binding, the
    session's active one, is silent. The operator wants nothing posted there any more:
    the first message's reply (its own binding not silent) is stored, not posted, as is
    the second's."""
    assert await _two_quick_discord_messages(rig, second_silent=True) == []


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_the_window_of_a_long_session_reads_50_rows_not_the_session(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    """The history window is read by walking the session's index backwards for 50 rows,
    whatever PostgreSQL guesses a session's length to be. Without statistics (a new
    database) or with many short sessions it guesses a few rows and, left to itself,
    reads every message of the session and sorts them: each turn of a long session
    cost more than the one before (leadgate.database.pg.PLANNER_SETTINGS)."""
    stack, _ = rig
    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain")
    sessions = [
        {"id": f"ses_{n:04d}", "org_id": org.id, "agent_id": agent["id"], "key": f"k{n}"}
        for n in range(16)
    ]
    # As sixteen clients' turns write them: the sessions' messages interleaved.
    rows = [
        {
            "id": f"msg_{s['id']}_{i:04d}",
            "org_id": org.id,
            "session_id": s["id"],
            "role": "user",
            "content": "x",
            "created_at": i,
        }
        for i in range(500)
        for s in sessions
    ]
    async with stack.db.tx() as conn:
        await conn.execute(
            t.sessions.insert(), [{**s, "created_at": 0, "event_seq": 0} for s in sessions]
        )
        await conn.execute(
            t.messages.insert(),
            [{**r, "work_item_id": None, "lead_gated": False, "tool_name": None} for r in rows],
        )
    # The intake's own statement, explained (not run: nothing is written).
    statement = sa.text("EXPLAIN " + _STORE_INTO_WINDOW.text)
    params = {
        "p_agent_id": agent["id"],
        "p_key": "k0",
        **unchanged_params(BindingSpec(BindingKind.api)),
        "id": "msg_x",
        "org_id": org.id,
        "work_item_id": None,
        "role": "user",
        "content": "x",
        "created": 1,
        "taken_by": "prc_x",
        "kind": "message",
        "channel": "c",
    }
    async with stack.db.tx() as conn:  # EXPLAIN is no SELECT for Database.read()
        plan = "\n".join(r[0] for r in await conn.execute(statement, params))
    assert "Index Scan Backward" in plan and "Sort" not in plan, plan


_OPENED = (
    t.sessions,
    t.bindings,
    t.inbound_events,
    t.work_items,
    t.messages,
    t.turn_runs,
    t.session_events,
)


async def opened_rows(stack: Stack, session_id: str, key: str, ts: str) -> list[Any]:
    """Every row an intake wrote for a new session (:class:`Anonymizer`'d with the
    session key and thread), so that two sessions' rows compare."""
    norm = Anonymizer(key, ts)

    out: list[Any] = []
    async with stack.db.read() as conn:
        for table in (*_OPENED, t.audit):
            if table is t.sessions:
                where = table.c.id == session_id
            elif table is t.audit:
                items = sa.select(t.work_items.c.id).where(t.work_items.c.session_id == session_id)
                where = table.c.work_item_id.in_(items)
            else:
                where = table.c.session_id == session_id
            rows = (await conn.execute(sa.select(table).where(where))).all()
            out.append((table.name, [{k: norm(v) for k, v in r._mapping.items()} for r in rows]))
    return out


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
@pytest.mark.parametrize(
    ("gated", "kind"), [(True, "api"), (True, "slack"), (False, "slack"), (False, "api")]
)
async def test_a_new_session_is_opened_in_one_statement_with_the_transactions_rows(
    rig: tuple[Stack, RecordingProvider], monkeypatch: pytest.MonkeyPatch, gated: bool, kind: str
) -> None:
    """PostgreSQL: a message that opens a session is taken in by one statement outside a
    transaction block (Intake._take_new), which writes exactly the rows the intake
    transaction writes, and the turn runs with the same context and history."""
    stack, _ = rig
    await stack.listen_for_changes()  # as the service: the intake keeps the agent
    org = await make_org(stack)
    agent = await lead_worker(stack, org) if gated else await make_agent(stack, org, "plain")

    def trigger(n: int) -> Trigger:
        if kind == "api":
            return api_trigger(org, agent, "hello there", session=f"key-{n}")
        return slack_trigger(org, agent, "hello there", f"{n}.1")

    await stack.turns.take(trigger(0))  # the agent and the rules are kept from here on
    with stack.db.record_statements() as statements:
        alone = await stack.turns.take(trigger(1))
    # (a plain REST turn first tries the existing session's one statement: none)
    assert len(statements) == (2 if kind == "api" and not gated else 1), statements
    assert "new_session" in statements[-1]

    async def by_transaction(self: Intake, trigger: Trigger) -> None:
        return None

    monkeypatch.setattr(Intake, "_take_new", by_transaction)
    with stack.db.record_statements() as statements:
        taken = await stack.turns.take(trigger(2))
    assert "BEGIN" in [sql.split()[0] for sql in statements]
    assert isinstance(alone, Accepted) and isinstance(taken, Accepted)
    assert await opened_rows(stack, alone.ctx.session_id, trigger(1).session_key, "1.1") == (
        await opened_rows(stack, taken.ctx.session_id, trigger(2).session_key, "2.1")
    )
    for field in ("revision", "binding_posts", "run_fenced"):
        assert getattr(alone.ctx, field) == getattr(taken.ctx, field), field
    assert (alone.ctx.run_token is None) == (taken.ctx.run_token is None)
    assert (alone.ctx.work_item_id is None) == (taken.ctx.work_item_id is None) == (not gated)
    assert (alone.gated, alone.rules, alone.history) == (taken.gated, taken.rules, taken.history)


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_session_another_process_opened_is_left_to_the_transaction(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    """Another process's intake, which has not seen the session: its one statement finds
    the session and writes nothing; the transaction then de-duplicates a redelivered
    event and appends a new message to the session's item."""
    stack, _ = rig
    await stack.listen_for_changes()
    org = await make_org(stack)
    worker = await lead_worker(stack, org)
    other = TurnService(stack.db, stack.clock, stack.ids, stack.providers, stack.outbox)
    await other.take(slack_trigger(org, worker, "warm up", "9.0"))  # keeps the agent
    first = slack_trigger(org, worker, "draft it", "9.1")
    taken = await stack.turns.take(first)
    assert isinstance(taken, Accepted)
    with stack.db.record_statements() as statements:
        assert isinstance(await other.take(first), Duplicate)
    assert "new_session" in statements[0] and statements[1] == "BEGIN"
    follow_up = dataclasses.replace(
        first, text="and add tests", external_event_id=f"{first.external_event_id}:2"
    )
    appended = await other.take(follow_up)
    assert isinstance(appended, Accepted)
    assert (appended.ctx.session_id, appended.ctx.work_item_id) == (
        taken.ctx.session_id,
        taken.ctx.work_item_id,
    )
    sessions = await select_all(
        stack, sa.select(t.sessions).where(t.sessions.c.key == first.session_key)
    )
    assert len(sessions) == 1
    [item] = [i for i in await items(stack, worker) if i["id"] == taken.ctx.work_item_id]
    assert item["task_context"] == "draft it\n\nand add tests"


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_two_replicas_opening_the_same_session_at_once_open_it_once(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    """Two processes take the first two messages of one new session at the same time:
    one statement opens the session; the other finds it (its insert waits for the first
    commit, then does nothing) and its transaction appends to the same item."""
    stack, _ = rig
    await stack.listen_for_changes()
    org = await make_org(stack)
    worker = await lead_worker(stack, org)
    replicas = [
        TurnService(stack.db, stack.clock, stack.ids, stack.providers, stack.outbox)
        for _ in range(2)
    ]
    for n, replica in enumerate(replicas):  # each keeps the agent, as a running service
        await replica.take(api_trigger(org, worker, "warm up", session=f"warm-{n}"))
    with stack.db.record_statements() as statements:
        taken = await asyncio.gather(
            *(
                replica.take(api_trigger(org, worker, text, session="together"))
                for replica, text in zip(replicas, ("first", "second"), strict=True)
            )
        )
    assert all(isinstance(one, Accepted) for one in taken)
    # both tried the one statement; one of them then took the transaction
    assert sum("new_session" in sql for sql in statements) == 2
    assert statements.count("BEGIN") == 1
    sessions = await select_all(stack, sa.select(t.sessions).where(t.sessions.c.key == "together"))
    [session] = sessions
    assert {one.ctx.session_id for one in taken if isinstance(one, Accepted)} == {session["id"]}
    [item] = [i for i in await items(stack, worker) if i["session_id"] == session["id"]]
    assert sorted(item["task_context"].split("\n\n")) == ["first", "second"]
    user = [m["content"] for m in await messages(stack, worker, "together") if m["role"] == "user"]
    assert sorted(user) == ["first", "second"]


async def test_intake_creates_then_appends_with_the_50k_cap(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    stack, _ = rig
    org = await make_org(stack)
    worker = await lead_worker(stack, org)
    plain = await make_agent(stack, org, "plain")

    # 1. No active item: one is created inProgress; the task context is the message,
    #    truncated to 50,000 characters (the stored user message is not truncated).
    long = "a" * 60_000
    out = await stack.turns.run(api_trigger(org, worker, long, session="long"))
    assert out == Reply("Echo: " + long)
    [item] = await items(stack, worker)
    assert item["status"] == "inProgress"
    assert item["revision"] == 0
    assert item["task_context"] == long[:TASK_CONTEXT_LIMIT]
    assert len(item["task_context"]) == 50_000
    assert item["completion_policy"] == "requestHumanApproval"
    assert item["max_revision_rounds"] == 3
    user_rows = [m for m in await messages(stack, worker, "long") if m["role"] == "user"]
    assert [len(m["content"]) for m in user_rows] == [60_000]
    assert user_rows[0]["work_item_id"] == item["id"]

    # 2. Active item inProgress: the message is appended (a blank line between).
    fake_clock(stack).advance(5_000)
    await stack.turns.run(api_trigger(org, worker, "first", session="s1"))
    fake_clock(stack).advance(5_000)
    await stack.turns.run(api_trigger(org, worker, "second", session="s1"))
    appended = [i for i in await items(stack, worker) if i["id"] != item["id"]]
    assert len(appended) == 1, "one active work item per (worker, session)"
    assert appended[0]["task_context"] == "first\n\nsecond"
    assert appended[0]["last_activity_at"] == stack.clock.now_ms()

    # The 50,000 cap applies to the whole task context: whatever an append would add
    # beyond it is dropped (the start of the task is kept, the tail is cut).
    await stack.turns.run(api_trigger(org, worker, "b" * 49_990, session="cap"))
    await stack.turns.run(api_trigger(org, worker, "c" * 100, session="cap"))
    cap = [i for i in await items(stack, worker) if i["task_context"].startswith("b")]
    assert len(cap) == 1
    assert cap[0]["task_context"] == "b" * 49_990 + "\n\n" + "c" * 8
    assert len(cap[0]["task_context"]) == TASK_CONTEXT_LIMIT
    await stack.turns.run(api_trigger(org, worker, "d" * 10, session="cap"))
    cap = [i for i in await items(stack, worker) if i["task_context"].startswith("b")]
    assert len(cap[0]["task_context"]) == TASK_CONTEXT_LIMIT
    assert "d" not in cap[0]["task_context"]

    # Every accepted message is an inbound event linked to its item.
    events = await select_all(
        stack, sa.select(t.inbound_events).where(t.inbound_events.c.agent_id == worker["id"])
    )
    assert len(events) == 6
    assert {e["outcome"] for e in events} == {"accepted"}
    assert all(e["work_item_id"] for e in events)

    # A worker without a lead: plain chat, no work item at all.
    assert await stack.turns.run(api_trigger(org, plain, "hi")) == Reply("Echo: hi")
    assert await items(stack, plain) == []


async def test_busy_rejects_records_and_runs_nothing(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    stack, rec = rig
    org = await make_org(stack)
    worker = await lead_worker(stack, org, model="rec")
    rec.handler = completing("the work", "did the work")
    gated = await stack.turns.run(api_trigger(org, worker, "please work"))
    assert isinstance(gated, Gated)
    [item] = await items(stack, worker)
    assert item["status"] == "reviewQueued"

    for status in (Status.reviewQueued, Status.reviewing, Status.awaitingHuman, Status.approved):
        await force_status(stack, item["id"], status)
        calls = len(rec.requests)
        message_count = await count(stack, t.messages)
        text = f"more while {status}"
        out = await stack.turns.run(api_trigger(org, worker, text))
        assert out == Busy(work_item_id=item["id"]), status
        assert len(rec.requests) == calls, "no model call on a busy turn"
        assert await count(stack, t.messages) == message_count, "no message stored"
        [now] = await items(stack, worker)
        assert now["task_context"] == "please work", "a busy message is not appended"
        assert now["status"] == status.value
        rejected = await select_all(
            stack, sa.select(t.inbound_events).where(t.inbound_events.c.content == text)
        )
        assert len(rejected) == 1
        assert rejected[0]["outcome"] == "rejectedBusy"
        assert rejected[0]["work_item_id"] == item["id"]

    # Once the item is terminal, the next message starts a new item.
    await force_status(stack, item["id"], Status.completed)
    rec.handler = RecordingProvider.default
    assert await stack.turns.run(api_trigger(org, worker, "new task")) == Reply("plain answer")
    second = [i for i in await items(stack, worker) if i["id"] != item["id"]]
    assert [(i["status"], i["task_context"], i["revision"]) for i in second] == [
        ("inProgress", "new task", 0)
    ]


async def test_duplicate_external_event_runs_no_second_turn(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    stack, rec = rig
    org = await make_org(stack)
    worker = await lead_worker(stack, org, model="rec")
    plain = await make_agent(stack, org, "plain", model="rec")

    for agent, event_id in ((worker, "slack:Ev1"), (plain, "slack:Ev2")):
        trigger = Trigger(
            org_id=org.id,
            agent_id=agent["id"],
            session_key="thread-1",
            text="hello once",
            binding=api_trigger(org, agent, "x").binding,
            external_event_id=event_id,
        )
        assert await stack.turns.run(trigger) == Reply("plain answer")
        calls = len(rec.requests)
        stored = await count(stack, t.messages)
        assert await stack.turns.run(trigger) == Duplicate()
        assert len(rec.requests) == calls
        assert await count(stack, t.messages) == stored
        events = await select_all(
            stack,
            sa.select(t.inbound_events).where(t.inbound_events.c.external_event_id == event_id),
        )
        assert len(events) == 1
    [item] = await items(stack, worker)
    assert item["task_context"] == "hello once", "a duplicate is not appended"


# ------------------------------------------------------------------- complete_task


async def test_complete_task_is_offered_only_with_a_resolved_lead(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    stack, rec = rig
    org = await make_org(stack)
    lead = await make_agent(stack, org, "lead")
    plain = await make_agent(stack, org, "plain", model="rec")
    worker = await make_agent(stack, org, "worker", lead="lead", model="rec")
    async with stack.db.tx() as conn:
        from leadgate.domain.agents import create_preset

        await create_preset(conn, stack.clock, stack.ids, org_id=org.id, name="p", lead="lead")
        await create_preset(conn, stack.clock, stack.ids, org_id=None, name="plat")
    via_preset = await make_agent(stack, org, "via-preset", preset="p", model="rec")
    via_platform = await make_agent(stack, org, "via-platform", preset="plat", model="rec")

    async def tools_for(agent: dict[str, Any]) -> list[str]:
        rec.requests.clear()
        await stack.turns.run(api_trigger(org, agent, "what tools?"))
        assert len(rec.requests) == 1
        return [tool.name for tool in rec.requests[0].tools]

    assert await tools_for(plain) == []
    assert await tools_for(via_platform) == []
    assert await tools_for(worker) == ["complete_task"]
    assert await tools_for(via_preset) == ["complete_task"]
    spec = rec.requests[0].tools[0]
    assert spec.parameters["required"] == ["summary"]
    assert set(spec.parameters["properties"]) == {"summary"}

    # The trusted context is server-side only: the model never sees the work item id.
    [item] = await items(stack, via_preset)
    for request in rec.requests:
        assert all(item["id"] not in m.content for m in request.messages)
        assert all(lead["id"] not in m.content for m in request.messages)

    # A plain worker's model calling complete_task anyway gets a tool error; nothing gated.
    rec.handler = completing("plain text", "sneaky", after_tool="!")
    out = await stack.turns.run(api_trigger(org, plain, "try it"))
    assert out == Reply("plain text!")
    tool_result = json.loads(rec.requests[-1].messages[-1].content)
    assert "error" in tool_result
    assert not any(m["lead_gated"] for m in await messages(stack, plain))
    assert await items(stack, plain) == []


async def test_complete_task_summary_rules(rig: tuple[Stack, RecordingProvider]) -> None:
    stack, rec = rig
    org = await make_org(stack)
    worker = await lead_worker(stack, org, model="rec")
    bad_summaries: list[Any] = ["", "   \n\t ", "x" * (SUMMARY_LIMIT + 1), 123, None, ["a"]]
    for index, bad in enumerate(bad_summaries):
        rec.handler = completing(f"answer {index}", bad, after_tool=" (noted)")
        out = await stack.turns.run(api_trigger(org, worker, f"task {index}"))
        assert out == Reply(f"answer {index} (noted)"), bad
        # the model received the violation as a tool error
        tool_message = rec.requests[-1].messages[-1]
        assert tool_message.role == "tool"
        assert tool_message.tool_call_id == "call_1"
        assert "error" in json.loads(tool_message.content)
        [item] = await items(stack, worker)
        assert item["status"] == "inProgress"
        assert item["signal_summary"] is None
        assert item["summary"] is None
    # Unparseable arguments are a tool error too.

    async def broken(request: ModelRequest) -> list[ModelEvent]:
        if request.messages[-1].role == "tool":
            return []
        return [
            TextDelta("broken args"),
            ToolCall("call_9", "complete_task", {}, arguments_error="not JSON"),
        ]

    rec.handler = broken
    assert await stack.turns.run(api_trigger(org, worker, "again")) == Reply("broken args")
    assert "error" in json.loads(rec.requests[-1].messages[-1].content)
    assert not any(m["lead_gated"] for m in await messages(stack, worker))

    # Exactly 2,000 characters is accepted.
    ok = "y" * SUMMARY_LIMIT
    rec.handler = completing("final answer", ok)
    out = await stack.turns.run(api_trigger(org, worker, "finish"))
    assert isinstance(out, Gated)
    assert json.loads(rec.requests[-1].messages[-1].content)["ok"] is True
    [item] = await items(stack, worker)
    assert (item["status"], item["summary"], item["snapshot"]) == (
        "reviewQueued",
        ok,
        "final answer",
    )
    assert item["signal_summary"] is None


async def test_complete_task_records_its_signal_and_its_tool_message(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    """complete_task writes its signal on the turn's in-progress item and stores its tool
    message (no session event: a tool message is not visible), in one transaction, on
    PostgreSQL one statement. When the item is no longer in progress (cancelled while
    the model ran) the tool answers an error and no signal is written, and the tool
    message is stored all the same."""
    stack, rec = rig
    org = await make_org(stack)
    worker = await lead_worker(stack, org, model="rec")
    rec.handler = completing("final answer", "the summary")
    with stack.db.record_statements() as statements:
        assert isinstance(await stack.turns.run(api_trigger(org, worker, "do it")), Gated)
    if stack.db.statements_alone:
        # The signal and the tool message: one statement, no transaction block of its own.
        [signal] = [sql for sql in statements if "SET signal_summary" in sql]
        assert signal.startswith("WITH") and "INSERT INTO messages" in signal, signal
        at = statements.index(signal)
        assert (statements[at - 1], statements[at + 1]) != ("BEGIN", "COMMIT"), statements
    [item] = await items(stack, worker)
    assert (item["status"], item["summary"]) == ("reviewQueued", "the summary")
    tool = [m for m in await messages(stack, worker) if m["role"] == "tool"]
    assert [(m["content"], m["tool_name"], m["work_item_id"]) for m in tool] == [
        ("the summary", "complete_task", item["id"])
    ]
    sid = await session_id(stack, worker)
    async with stack.db.read() as conn:
        events = await session_events.read(conn, sid, after=0, limit=20)
    assert tool[0]["id"] not in {e.message_id for e in events}

    async def cancel_then_complete(request: ModelRequest) -> list[ModelEvent]:
        if request.messages[-1].role == "tool":
            return [TextDelta(" (after the tool)")]
        async with stack.db.tx() as conn:
            await conn.execute(
                t.work_items.update()
                .where(t.work_items.c.session_id == await session_id(stack, worker, "s2"))
                .values(status="cancelled")
            )
        return [TextDelta("late"), ToolCall("c2", "complete_task", {"summary": "too late"})]

    rec.handler = cancel_then_complete
    # The turn meant its text for review: withheld, though no review will see it.
    late_turn = await stack.turns.run(api_trigger(org, worker, "another", session="s2"))
    assert isinstance(late_turn, Gated), late_turn
    answer = json.loads(rec.requests[-1].messages[-1].content)
    assert answer == {"error": "no in-progress work item matches this turn"}
    [cancelled] = [i for i in await items(stack, worker) if i["id"] != item["id"]]
    assert (cancelled["status"], cancelled["signal_summary"]) == ("cancelled", None)
    late = [m for m in await messages(stack, worker, "s2") if m["role"] == "tool"]
    assert [(m["content"], m["tool_name"]) for m in late] == [("too late", "complete_task")]
    [withheld] = [m for m in await messages(stack, worker, "s2") if m["role"] == "assistant"]
    assert (withheld["content"], withheld["lead_gated"]) == ("late (after the tool)", True)
    assert ("assistant", "late (after the tool)") not in await transcript(stack, org, worker, "s2")


async def test_a_complete_task_that_comes_after_another_turn_submitted_is_withheld(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    """Two turns of one session share its inProgress item. The one whose complete_task
    comes second finds the item already submitted: its signal is refused, and its text,
    meant for review, is withheld too (it was a 200 with the unreviewed text)."""
    stack, rec = rig
    org = await make_org(stack)
    worker = await lead_worker(stack, org, model="rec")
    slow_in_model = asyncio.Event()
    fast_done = asyncio.Event()

    async def handler(request: ModelRequest) -> list[ModelEvent]:
        if request.messages[-1].role == "tool":
            return []
        if request.messages[-1].content == "slow part":
            slow_in_model.set()
            await fast_done.wait()
            return [TextDelta("SLOW WORK"), ToolCall("c1", "complete_task", {"summary": "slow"})]
        return [TextDelta("FAST WORK"), ToolCall("c2", "complete_task", {"summary": "fast"})]

    rec.handler = handler
    slow = asyncio.create_task(stack.turns.run(api_trigger(org, worker, "slow part")))
    await asyncio.wait_for(slow_in_model.wait(), 10)
    assert isinstance(await stack.turns.run(api_trigger(org, worker, "fast part")), Gated)
    fast_done.set()
    assert isinstance(await asyncio.wait_for(slow, 10), Gated)
    [item] = await items(stack, worker)
    assert (item["status"], item["summary"]) == ("reviewQueued", "fast")
    said = [(m["content"], m["lead_gated"]) for m in await messages(stack, worker)]
    assert ("SLOW WORK", True) in said and ("FAST WORK", True) in said, said
    shown = str(await transcript(stack, org, worker))
    assert "SLOW" not in shown and "FAST" not in shown, shown


# ----------------------------------------------------------------------- gating


async def test_gated_text_is_hidden_until_approved_and_revealed(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    stack, _ = rig
    org = await make_org(stack)
    worker = await lead_worker(stack, org)
    out = await stack.turns.run(api_trigger(org, worker, "write it #complete"))
    assert isinstance(out, Gated)
    assert out.revision == 0
    [item] = await items(stack, worker)
    rows = await messages(stack, worker)
    assistant = [m for m in rows if m["role"] == "assistant"]
    assert [(m["content"], m["lead_gated"]) for m in assistant] == [
        ("Echo: write it #complete", True)
    ]
    assert item["gated_message_id"] == assistant[0]["id"]
    assert item["snapshot"] == "Echo: write it #complete"
    assert item["summary"] == "Summary: write it"
    assert await transcript(stack, org, worker) == [("user", "write it #complete")]
    audit = await select_all(
        stack,
        sa.select(t.audit)
        .where(t.audit.c.work_item_id == item["id"])
        .order_by(t.audit.c.created_at, t.audit.c.id),
    )
    assert [(a["action"], a["from_status"], a["to_status"], a["actor"]) for a in audit] == [
        ("create", None, "inProgress", "system:intake"),
        ("completeTask", "inProgress", "reviewQueued", "system:turn"),
    ]
    assert audit[1]["text"] == "Summary: write it"

    claimed = await stack.lead_runner.claim()
    assert claimed is not None
    assert await transcript(stack, org, worker) == [("user", "write it #complete")]
    # Approved: the same transaction reveals the text and completes the item.
    await stack.lead_runner.review(claimed)
    [item] = await items(stack, worker)
    assert item["status"] == "completed"
    assert await transcript(stack, org, worker) == [
        ("user", "write it #complete"),
        ("assistant", "Echo: write it #complete"),
    ]


class UnreadableSignal(TurnService):
    """Reading the completion signal fails (database hiccup, bug...)."""

    async def read_signal(self, conn: Conn, ctx: TurnContext) -> str | None:
        raise RuntimeError("signal store unavailable")

    async def signalled_item(self, conn: Conn, ctx: TurnContext) -> tuple[str | None, WorkItem]:
        raise RuntimeError("signal store unavailable")

    async def _submit_alone(
        self, ctx: TurnContext, text: str, revision_item: WorkItem | None
    ) -> bool:
        # PostgreSQL reads the signal inside the one-statement submission.
        raise RuntimeError("signal store unavailable")


async def test_fail_closed_when_the_signal_cannot_be_read(
    rig: tuple[Stack, RecordingProvider], caplog: pytest.LogCaptureFixture
) -> None:
    stack, _ = rig
    org = await make_org(stack)
    worker = await lead_worker(stack, org)
    plain = await make_agent(stack, org, "plain")
    turns = UnreadableSignal(stack.db, stack.clock, stack.ids, stack.providers, stack.outbox)

    for text in ("just chatting", "done #complete"):
        out = await turns.run(api_trigger(org, worker, text))
        assert isinstance(out, Gated), text
    assistant = [m for m in await messages(stack, worker) if m["role"] == "assistant"]
    assert [(m["content"], m["lead_gated"]) for m in assistant] == [
        ("Echo: just chatting", True),
        ("Echo: done #complete", True),
    ]
    assert await transcript(stack, org, worker) == [
        ("user", "just chatting"),
        ("user", "done #complete"),
    ]
    # Nothing was handed off: no review sees work whose signal could not be read.
    [item] = await items(stack, worker)
    assert item["status"] == "inProgress"
    # ... because the signal could not be read (not because the stand-in was called
    # wrongly: a TypeError would fail closed as well).
    raised = [r.exc_info[1] for r in ours(caplog) if r.exc_info]
    assert all(str(e) == "signal store unavailable" for e in raised), raised
    # A worker without a lead never reads a signal: unaffected.
    assert await turns.run(api_trigger(org, plain, "hello")) == Reply("Echo: hello")


async def test_snapshot_is_capped_at_100k(rig: tuple[Stack, RecordingProvider]) -> None:
    stack, rec = rig
    org = await make_org(stack)
    worker = await lead_worker(stack, org, model="rec")
    text = "".join(chr(ord("a") + i % 26) for i in range(SNAPSHOT_LIMIT + 50))
    rec.handler = completing(text, "big output")
    out = await stack.turns.run(api_trigger(org, worker, "produce a lot"))
    assert isinstance(out, Gated)
    [item] = await items(stack, worker)
    assert item["snapshot"] == text[:SNAPSHOT_LIMIT]
    assert len(item["snapshot"]) == 100_000
    gated = [m for m in await messages(stack, worker) if m["role"] == "assistant"]
    assert gated[0]["content"] == text  # the withheld message itself is whole
    assert gated[0]["lead_gated"] is True


async def test_a_model_the_config_lost_is_a_model_error_logged_and_counted(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent naming a model no longer configured: 502 ``model.unknown``, and one log
    line and one ``turns{error}`` like any model error (it was neither)."""
    org = await make_org(stack)
    orphan = await make_agent(stack, org, "orphan", model="gone")
    before = METRICS.registry.get_sample_value("leadgate_turns_total", {"outcome": "error"}) or 0
    with caplog.at_level("WARNING", logger="leadgate"), pytest.raises(ModelError) as info:
        await stack.turns.run(api_trigger(org, orphan, "hello"))
    assert info.value.rule == "model.unknown"
    assert "model error: model 'gone' is not configured [model.unknown]" in caplog.text
    after = METRICS.registry.get_sample_value("leadgate_turns_total", {"outcome": "error"})
    assert after == before + 1


async def test_incomplete_provenance_goes_to_a_human(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    stack, rec = rig
    org = await make_org(stack)
    worker = await lead_worker(stack, org, model="rec")

    async def unbind() -> None:
        async with stack.db.tx() as conn:
            assert await deactivate_session(conn, await session_id(stack, worker)) == 1

    rec.handler = then_complete(unbind)
    stack.wakes.clear()
    out = await stack.turns.run(api_trigger(org, worker, "task"))
    assert isinstance(out, Gated)
    [item] = await items(stack, worker)
    assert item["status"] == "awaitingHuman"
    assert item["snapshot"] == "finished"
    audit = await select_all(
        stack,
        sa.select(t.audit)
        .where(t.audit.c.work_item_id == item["id"])
        .order_by(t.audit.c.created_at, t.audit.c.id),
    )
    assert audit[-1]["action"] == "incompleteProvenance"
    assert (audit[-1]["from_status"], audit[-1]["to_status"]) == ("inProgress", "awaitingHuman")
    assert "binding" in audit[-1]["text"]
    # no lead review was queued
    assert "lead-review" not in stack.wakes or not stack.wakes["lead-review"].is_set()
    assert await drain(stack.lead_runner) == 0
    # the text stays withheld
    assert await transcript(stack, org, worker) == [("user", "task")]

    # Control: the same turn with the binding intact queues a review.
    rec.handler = completing("finished", "done")
    await stack.turns.run(api_trigger(org, worker, "task", session="s2"))
    assert stack.wakes["lead-review"].is_set()
    second = [i for i in await items(stack, worker) if i["id"] != item["id"]]
    assert second[0]["status"] == "reviewQueued"


async def test_a_binding_of_another_organization_is_inconsistent_provenance(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    """SPEC 3: a binding that is there but does not belong with the item (here its row
    changed by hand to another organization mid-turn) is incomplete provenance too, on
    the transaction's path and on PostgreSQL's one-statement submission."""
    stack, rec = rig
    org, other = await make_org(stack), await make_org(stack, "other")
    worker = await lead_worker(stack, org, model="rec")

    async def move_binding() -> None:
        sid = await session_id(stack, worker)
        async with stack.db.tx() as conn:
            await conn.execute(
                t.bindings.update()
                .where(t.bindings.c.session_id == sid, t.bindings.c.active)
                .values(org_id=other.id)
            )

    rec.handler = then_complete(move_binding)
    out = await stack.turns.run(api_trigger(org, worker, "task"))
    assert isinstance(out, Gated)
    [item] = await items(stack, worker)
    assert item["status"] == "awaitingHuman"
    [last] = await select_all(
        stack,
        sa.select(t.audit)
        .where(t.audit.c.work_item_id == item["id"])
        .order_by(t.audit.c.created_at.desc(), t.audit.c.id.desc())
        .limit(1),
    )
    assert last["action"] == "incompleteProvenance"
    assert last["text"] == "binding inconsistent with the work item"


async def test_a_submission_writes_its_event_and_wakes_the_lead_runners_of_every_replica(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    stack, _ = rig
    org = await make_org(stack)
    worker = await lead_worker(stack, org)
    listener = None
    heard: list[str] = []
    if stack.db.is_postgres:
        listener = await asyncpg.connect(asyncpg_dsn(stack.db.url))
        await listener.add_listener(REVIEW_CHANNEL, lambda *args: heard.append(args[3]))
    try:
        with stack.db.record_statements() as statements:
            out = await stack.turns.run(api_trigger(org, worker, "write it #complete"))
        assert isinstance(out, Gated)
        [item] = await items(stack, worker)
        assert item["status"] == "reviewQueued"
        async with stack.db.read() as conn:
            events = await session_events.read(
                conn, await session_id(stack, worker), after=0, limit=10
            )
        # The user's message, then the item held for review; the withheld answer has none.
        assert [(e.kind, e.status) for e in events] == [
            ("message", None),
            (session_events.REVIEW, "pending"),
        ]
        if listener is not None:
            await eventually(lambda: heard, what="the submission's NOTIFY")
            # Other replicas' runners hear the submission; this process's own listener
            # skips its tag (it poked its runner at commit).
            assert heard == [stack.db.notify_tag]
            # The whole submission is one statement outside a transaction block: the
            # turn's only transaction is its intake.
            submissions = [sql for sql in statements if "run_locked" in sql]
            assert len(submissions) == 1
            assert [sql.split()[0] for sql in statements].count("BEGIN") == 1, statements
    finally:
        if listener is not None:
            await listener.close()


async def test_a_channel_turn_whose_run_was_taken_over_submits_nothing(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    stack, rec = rig
    org = await make_org(stack)
    worker = await lead_worker(stack, org, model="rec")

    async def taken_over() -> None:
        # Another process took the run over (its lease lapsed) while the model ran.
        async with stack.db.tx() as conn:
            await conn.execute(t.turn_runs.update().values(lease_token="another-process"))

    rec.handler = then_complete(taken_over)
    with pytest.raises(TransitionError) as raised:
        await stack.turns.run(slack_trigger(org, worker, "task", "7.1"))
    assert raised.value.rule == "run"
    # Nothing of the submission was written: the process that holds the run now decides.
    [item] = await items(stack, worker)
    assert (item["status"], item["gated_message_id"]) == ("inProgress", None)
    assert item["signal_summary"] == "done"
    rows = await select_all(stack, sa.select(t.messages).where(t.messages.c.role == "assistant"))
    assert rows == []
    assert await count(stack, t.turn_runs) == 1


# ---------------------------------------------------------------------- sweeper


async def test_the_sweeper_knows_when_the_oldest_idle_item_becomes_abandonable(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    """``Sweeper.due_in_s`` (its loop's sleep): a week after the oldest ``inProgress``
    item's last activity; none without such an item; read again once it has passed."""
    stack, _ = rig
    org = await make_org(stack)
    worker = await lead_worker(stack, org)
    sweeper = Sweeper(stack.db, stack.clock, stack.ids)
    clock = fake_clock(stack)
    week_s = 7 * DAY_MS / 1000

    assert await drain(sweeper) == 0
    assert sweeper.due_in_s() is None  # nothing in progress
    await stack.turns.run(api_trigger(org, worker, "idle task", session="idle"))
    assert await drain(sweeper) == 0
    assert sweeper.due_in_s() == week_s
    clock.advance(DAY_MS)
    await stack.turns.run(api_trigger(org, worker, "later task", session="later"))
    assert await drain(sweeper) == 0
    assert sweeper.due_in_s() == week_s - DAY_MS / 1000  # the oldest one's, not the newer

    clock.advance(6 * DAY_MS)
    assert await drain(sweeper) == 1  # the oldest: the next is the later one's
    assert sweeper.due_in_s() == DAY_MS / 1000
    clock.advance(DAY_MS)
    assert await drain(sweeper) == 1
    assert sweeper.due_in_s() is None


async def test_the_sweeper_reads_the_next_due_again_after_the_clock_went_back(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    """An item that enters ``inProgress`` after the clock stepped back has an activity
    before the one the sweeper knew of: ``due_in_s`` is its week, not the known one's
    (that was late by the size of the step)."""
    stack, _ = rig
    org = await make_org(stack)
    worker = await lead_worker(stack, org)
    sweeper = Sweeper(stack.db, stack.clock, stack.ids)
    clock = fake_clock(stack)
    week_s = 7 * DAY_MS / 1000
    await stack.turns.run(api_trigger(org, worker, "first task", session="first"))
    assert await drain(sweeper) == 0
    assert sweeper.due_in_s() == week_s
    clock.advance(-DAY_MS)  # stepped back a day
    await stack.turns.run(api_trigger(org, worker, "after the step", session="after"))
    assert await drain(sweeper) == 0
    assert sweeper.due_in_s() == week_s


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_the_sweeper_skips_an_idle_item_another_transaction_holds_and_looks_again_soon(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    """PostgreSQL: of two items idle for a week, one is row-locked by another transaction
    (held open here; in the service an intake appending to it, or a move that lost its
    race for it, keeps the lock to its commit, and no wake-up follows that commit). The
    sweep does not wait for it: it abandons the other one and returns (waiting, its pass
    stalled with every due item after the locked one, and held the rows it had moved).
    The loop looks again LOCKED_RECHECK_MS on, not at the poll, and the pass after the
    lock is gone abandons the held item; each move is audited and counted once. An idle
    pass is one statement (with BEGIN and COMMIT)."""
    stack, _ = rig
    org = await make_org(stack)
    worker = await lead_worker(stack, org)
    sweeper = Sweeper(stack.db, stack.clock, stack.ids)
    await stack.turns.run(api_trigger(org, worker, "held task", session="held"))
    await stack.turns.run(api_trigger(org, worker, "free task", session="free"))
    ids = {i["task_context"].split()[0]: i["id"] for i in await items(stack, worker)}
    abandoned = transitions_counted("inProgress", "abandoned")

    async def statuses() -> dict[str, str]:
        return {i["task_context"].split()[0]: i["status"] for i in await items(stack, worker)}

    fake_clock(stack).advance(7 * DAY_MS)
    async with held_open(stack.db, item_locked(ids["held"])):
        assert await asyncio.wait_for(sweeper.run_once(), 5) is True
        assert await statuses() == {"held": "inProgress", "free": "abandoned"}
        assert await asyncio.wait_for(sweeper.run_once(), 5) is False
        assert sweeper.due_in_s() == LOCKED_RECHECK_MS / 1000
    assert await sweeper.run_once() is True
    assert await statuses() == {"held": "abandoned", "free": "abandoned"}
    assert await sweeper.run_once() is False
    assert sweeper.due_in_s() is None
    for item_id in ids.values():
        actions = [a["action"] for a in await item_audit(stack, item_id)]
        assert actions.count("abandon") == 1, actions
    assert transitions_counted("inProgress", "abandoned") == abandoned + 2
    # An idle pass (an item in progress, not due yet, its time known) is its pick alone:
    # whether locked items were left is part of it, not a statement more.
    await stack.turns.run(api_trigger(org, worker, "new task", session="new"))
    assert await sweeper.run_once() is False
    with stack.db.record_statements() as idle:
        assert await sweeper.run_once() is False
    assert (idle[0], len(idle), idle[-1]) == ("BEGIN", 3, "COMMIT"), idle


async def test_idle_in_progress_items_are_abandoned_after_7_days(
    rig: tuple[Stack, RecordingProvider],
) -> None:
    stack, _ = rig
    org = await make_org(stack)
    worker = await lead_worker(stack, org)
    sweeper = Sweeper(stack.db, stack.clock, stack.ids)
    clock = fake_clock(stack)

    await stack.turns.run(api_trigger(org, worker, "idle task", session="idle"))
    await stack.turns.run(api_trigger(org, worker, "busy task", session="busy"))
    gated = await stack.turns.run(api_trigger(org, worker, "queued #complete", session="q"))
    assert isinstance(gated, Gated)
    clock.advance(6 * DAY_MS)
    await stack.turns.run(api_trigger(org, worker, "still here", session="busy"))

    async def statuses() -> dict[str, str]:
        return {i["task_context"].split()[0]: i["status"] for i in await items(stack, worker)}

    clock.advance(DAY_MS - 1)  # the idle item is 7 days minus 1 ms old
    assert await drain(sweeper) == 0
    assert await statuses() == {
        "idle": "inProgress",
        "busy": "inProgress",
        "queued": "reviewQueued",
    }

    clock.advance(1)  # exactly 7 days
    assert await drain(sweeper) == 1
    assert await statuses() == {"idle": "abandoned", "busy": "inProgress", "queued": "reviewQueued"}

    clock.advance(6 * DAY_MS)  # 7 days since the append to "busy"
    assert await drain(sweeper) == 1
    assert await statuses() == {"idle": "abandoned", "busy": "abandoned", "queued": "reviewQueued"}
    clock.advance(30 * DAY_MS)
    assert await drain(sweeper) == 0  # only inProgress items are abandoned

    audit = await select_all(
        stack, sa.select(t.audit).where(t.audit.c.action == "abandon").order_by(t.audit.c.id)
    )
    assert len(audit) == 2
    assert {(a["from_status"], a["to_status"], a["actor"]) for a in audit} == {
        ("inProgress", "abandoned", "system:sweeper")
    }
    # The session is free again: the next message starts a new item.
    await stack.turns.run(api_trigger(org, worker, "fresh start", session="idle"))
    assert (await statuses())["fresh"] == "inProgress"
