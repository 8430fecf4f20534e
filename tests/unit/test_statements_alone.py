"""PostgreSQL runs many writes of a gated work item's life as one statement outside a
transaction block (``Database.statements_alone``); their transactions are what SQLite
runs and what PostgreSQL runs when a statement declines. Here the same conversations run
twice on one database, each in its own organization: once with the statements, once
with every such write as its transaction. Every row either run wrote must be the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from leadgate.core.runners import drain
from leadgate.core.types import Busy, Gated, Reply, Trigger
from leadgate.database import schema as t
from leadgate.domain import workitems
from leadgate.domain.workitems import Status
from leadgate.review import decisions
from leadgate.runners.revisions import RevisionRunner
from leadgate.turns.intake import Accepted
from outbox.store import HANDOFF_TOPIC, Handoff
from tests.helpers import Anonymizer, Org, api_trigger, make_agent, make_org, slack_trigger
from tests.outbox_support import ScriptedChannel
from tests.stack import Stack

pytestmark = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)

#: How each one-statement write begins: a new session's intake, a plain turn's intake, its
#: visible reply, complete_task's signal, the submission, the approval (a post or a
#: reveal) and the relay's outcome commit.
_STATEMENTS = (
    "WITH new_session AS",
    "WITH sb AS",
    "WITH src AS",
    "WITH tool_message AS",
    "WITH run_locked AS",
    "WITH b AS MATERIALIZED",
    "WITH input AS",
)

#: Tables whose rows hold a hash of a random secret: equal in no two runs.
_SECRETS = {"api_keys", "users", "organizations"}


async def org_rows(stack: Stack, org_id: str, *marks: str) -> dict[str, list[Any]]:
    """Every row of ``org_id`` in every table (a session's events through its session),
    :class:`Anonymizer`'d with ``marks``. Rows are put in an order that does not depend
    on ids (sorted by their other columns) before the ids are numbered."""
    sessions = sa.select(t.sessions.c.id).where(t.sessions.c.org_id == org_id)
    raw: dict[str, list[dict[str, Any]]] = {}
    async with stack.db.read() as conn:
        for table in t.metadata.sorted_tables:
            if table.name in _SECRETS:
                continue
            if "org_id" in table.c:
                where = table.c.org_id == org_id
            elif "session_id" in table.c:
                where = table.c.session_id.in_(sessions)
            else:
                continue
            rows = (await conn.execute(sa.select(table).where(where))).all()
            raw[table.name] = [dict(r._mapping) for r in rows]
    anonymize = Anonymizer(*marks)

    def shape(row: dict[str, Any]) -> str:
        return _ID_IN.sub("<id>", json.dumps(row, sort_keys=True, default=str))

    return {
        name: [anonymize.within(r) for r in sorted(rows, key=shape)]
        for name, rows in sorted(raw.items())
    }


_ID_IN = Anonymizer.ID_IN


async def conversations(
    stack: Stack, thread: str, *, local: bool, back_ms: int = 0
) -> tuple[list[dict[str, list[Any]]], list[str], int]:
    """The same conversations, step by step, with the clock moving between steps: a
    gated worker on the api binding and in Slack threads (approvals, a busy message, a
    revision, an escalation a person approves, a silent thread, follow-ups that open new
    items), and a plain agent on both, whose session moves from a Slack thread to the
    api and back. ``local``: posts are written claimed for this process's relay and
    handed to it after commit, as in a process that runs one. Returns the organization's
    rows after each step (:func:`org_rows`), the turns' outcomes and how many posts
    were handed over. ``back_ms``: taken off the 1 s the clock moves before each step (a
    step's writer read its clock before the previous step's writes, as on a replica
    whose clock runs behind)."""
    await stack.listen_for_changes()  # as the service: the intake keeps the agents
    stack.turns.owner = lambda: f"process-{thread}"  # (revision leases name their owner)
    handed: list[Any] = []
    if local:

        def accept(rows: list[Handoff]) -> None:
            handed.extend(rows)
            stack.relay.accept(rows)

        stack.db.on_commit_payloads(HANDOFF_TOPIC, accept)
        stack.outbox.attach(stack.relay)
    org: Org = await make_org(stack, f"org-{thread}")
    await make_agent(stack, org, "lead", model="script")
    worker = await make_agent(stack, org, "worker", lead="lead")
    plain = await make_agent(stack, org, "plain")
    outcomes: list[str] = []
    snapshots: list[dict[str, list[Any]]] = []

    async def run(trigger: Trigger) -> None:
        stack.clock.advance(1_000)
        outcomes.append(type(await stack.turns.run(trigger)).__name__)

    def slack(agent: dict[str, Any], text: str, n: int, *, silent: bool = False) -> Trigger:
        trigger = slack_trigger(org, agent, text, f"{thread}.{n}")
        # (one event id per message, as Slack's are)
        return dataclasses.replace(
            trigger,
            external_event_id=f"{thread}-{text}",
            binding=dataclasses.replace(trigger.binding, silent=silent),
        )

    async def people_approve() -> None:
        async with stack.db.tx() as conn:
            waiting = await conn.execute(
                sa.select(t.work_items.c.id).where(
                    t.work_items.c.org_id == org.id,
                    t.work_items.c.status == Status.awaitingHuman.value,
                )
            )
            for item_id in waiting.scalars().all():
                item = await workitems.get(conn, item_id)
                await decisions.human_approve(conn, stack.outbox, item, "user:alice")

    # Warm-up: a turn of each agent, so that both are kept from here on.
    await run(api_trigger(org, plain, "warm", "warm-plain"))
    await run(api_trigger(org, worker, "warm #complete", "warm-worker"))
    await stack.settle(relay=True)
    for step in (
        lambda: run(api_trigger(org, worker, "write it #complete", "api-1")),
        lambda: run(api_trigger(org, worker, "and one more thing", "api-1")),  # busy
        lambda: run(slack(worker, "post it #complete", 1)),
        lambda: stack.settle(),  # (the approvals' rows before the relay sends)
        lambda: stack.settle(relay=True),
        lambda: run(api_trigger(org, worker, "again #revise #complete", "api-1")),
        lambda: run(slack(worker, "thanks, more #complete", 1)),
        # One at a time: the changes requested, the revision's submission, the approvals.
        lambda: drain(stack.lead_runner),
        lambda: drain(RevisionRunner(stack.turns)),
        lambda: stack.settle(relay=True),
        lambda: run(api_trigger(org, plain, "hello", "plain-1")),
        lambda: run(api_trigger(org, plain, "hello again", "plain-1")),
        lambda: run(slack(plain, "hi there", 2)),
        lambda: run(slack(plain, "hi again", 2)),
        lambda: run(slack(worker, "ask a person #escalate #complete", 3)),
        lambda: run(slack(worker, "quietly #complete", 4, silent=True)),
        lambda: stack.settle(),
        lambda: stack.settle(relay=True),
        lambda: people_approve(),
        lambda: stack.settle(relay=True),
        lambda: run(slack(worker, "after the person #complete", 3)),
        lambda: run(api_trigger(org, plain, "from the api now", f"slack:T1:C1:{thread}.2")),
        lambda: run(slack(plain, "back in slack", 2)),
        lambda: stack.settle(relay=True),
    ):
        stack.clock.advance(1_000 - back_ms)
        await step()
        snapshots.append(await org_rows(stack, org.id, thread))
    return snapshots, outcomes, len(handed)


@pytest.mark.parametrize("local", [False, True], ids=["relay-claims", "handed-over"])
async def test_every_statement_writes_what_its_transaction_writes(
    make_stack: Callable[..., Stack], local: bool
) -> None:
    posted, posted_by_tx = ScriptedChannel(), ScriptedChannel()
    alone = make_stack(channels={"slack": posted})
    by_tx = make_stack(channels={"slack": posted_by_tx}, statements_alone=False)
    assert alone.db.statements_alone and not by_tx.db.statements_alone

    with alone.db.record_statements() as alone_sql:
        written, alone_outcomes, a_handed = await conversations(alone, "1111", local=local)
    with by_tx.db.record_statements() as tx_sql:
        expected, tx_outcomes, b_handed = await conversations(by_tx, "2222", local=local)

    assert alone_outcomes == tx_outcomes
    # Handed over: the gating posts and the plain replies of the Slack threads.
    assert a_handed == b_handed == (7 if local else 0)
    assert alone_outcomes.count(Gated.__name__) == 8, alone_outcomes
    assert alone_outcomes.count(Busy.__name__) == 1, alone_outcomes
    assert alone_outcomes.count(Reply.__name__) == 7, alone_outcomes
    # The first run took every statement, the second none.
    for mark in _STATEMENTS:
        assert any(sql.startswith(mark) for sql in alone_sql), mark
        assert not any(sql.startswith(mark) for sql in tx_sql), mark

    # Seven posts (no silent one), in the same order, and every item done.
    texts = [m.text.replace("1111", "#") for m in posted.calls]
    assert len(texts) == 7 and not any("quietly" in text for text in texts), texts
    assert texts == [m.text.replace("2222", "#") for m in posted_by_tx.calls]
    final = written[-1]["work_items"]
    assert {item["status"] for item in final} == {Status.completed.value}
    # Every row, after every step.
    assert len(written) == len(expected)
    for step, (one, other) in enumerate(zip(written, expected, strict=True)):
        assert one.keys() == other.keys()
        for name, rows in other.items():
            assert one[name] == rows, f"after step {step}: " + _difference(name, one[name], rows)


async def test_moves_by_a_clock_behind_write_what_their_transactions_write(
    make_stack: Callable[..., Stack],
) -> None:
    """The same conversations with the clock going back 1.5 s before each step (net
    half a second back per step; a turn moves it on 1 s): every move takes the item's
    last update when the mover's clock reads earlier, in the statements as in the
    transactions, so each item's audit trail, read in time order, is the order its moves
    were made in."""
    alone = make_stack(channels={"slack": ScriptedChannel()})
    by_tx = make_stack(channels={"slack": ScriptedChannel()}, statements_alone=False)
    written, alone_outcomes, _ = await conversations(alone, "1111", local=True, back_ms=2_500)
    expected, tx_outcomes, _ = await conversations(by_tx, "2222", local=True, back_ms=2_500)
    assert alone_outcomes == tx_outcomes
    for step, (one, other) in enumerate(zip(written, expected, strict=True)):
        for name, rows in other.items():
            assert one[name] == rows, f"after step {step}: " + _difference(name, one[name], rows)
    for stack in (alone, by_tx):
        a = t.audit.c
        async with stack.db.read() as conn:
            audited = (
                await conn.execute(
                    sa.select(a.work_item_id, a.id, a.action, a.from_status, a.to_status)
                    .where(a.work_item_id.is_not(None))
                    .order_by(a.work_item_id, a.created_at, a.id)
                )
            ).all()
        trails: dict[str, list[Any]] = {}
        for row in audited:
            trails.setdefault(row.work_item_id, []).append(row)
        assert len(trails) >= 8
        for trail in trails.values():
            assert trail[0].action == "create", trail
            for before, after in itertools.pairwise(trail):
                assert after.from_status == before.to_status, trail


def _difference(table: str, written: list[Any], expected: list[Any]) -> str:
    """The first row of ``table`` that differs, column by column (a readable failure)."""
    if len(written) != len(expected):
        return f"{table}: {len(written)} rows written, {len(expected)} by the transactions"
    for one, other in zip(written, expected, strict=True):
        if one != other:
            columns = {k: (one.get(k), other.get(k)) for k in one if one.get(k) != other.get(k)}
            return f"{table}: {columns} (statement, transaction) in {other}"
    return table


async def test_replies_written_together_write_what_their_transactions_write(
    make_stack: Callable[..., Stack],
) -> None:
    """Replies of concurrent API turns go in one statement (``VisibleWrites``): five
    replies, three in one session, while another is in flight. Their rows are the ones
    five transactions write one after another, the events of a session in the order the
    replies were given; a reply whose session does not exist fails alone."""
    alone = make_stack()
    by_tx = make_stack(statements_alone=False)
    written: list[dict[str, list[Any]]] = []
    for stack, thread in ((alone, "1111"), (by_tx, "2222")):
        org: Org = await make_org(stack, f"org-{thread}")
        plain = await make_agent(stack, org, "plain")
        # (sessions a, b and c at different event counts: no two event rows alike)
        for key in "abbbcccc":
            stack.clock.advance(1_000)
            await stack.turns.run(api_trigger(org, plain, "hello", f"{thread}-{key}"))
        async with stack.db.read() as conn:
            sessions = {
                str(r.key): str(r.id)
                for r in (
                    await conn.execute(
                        sa.select(t.sessions.c.key, t.sessions.c.id).where(
                            t.sessions.c.org_id == org.id
                        )
                    )
                ).all()
            }
        order = [sessions[f"{thread}-{key}"] for key in "abaca"] + ["no-such-session"]
        stack.clock.advance(1_000)
        stores = [
            stack.turns.visible.store(
                org_id=org.id,
                session_id=session_id,
                work_item_id=None,
                role="assistant",
                content=f"reply {n}",
            )
            for n, session_id in enumerate(order)
        ]
        grouped = stack.turns.visible.group
        before = (0, 0) if grouped is None else (grouped.statements, grouped.items)
        with stack.db.record_statements() as sql:
            if stack is alone:
                results = await asyncio.gather(*stores, return_exceptions=True)
            else:
                results = [await store for store in stores[:-1]]
                stores[-1].close()
        assert all(isinstance(r, str) for r in results[:-1]), results
        if stack is alone:
            # The first alone, the other five in one statement (refused there for the
            # missing session only), and nothing written for it.
            assert grouped is not None
            assert (grouped.statements - before[0], grouped.items - before[1]) == (2, 6)
            assert [s[:16] for s in sql] == ["WITH src AS (SEL", "WITH visible AS "]
            assert isinstance(results[-1], RuntimeError)
            # Alone too (nothing under way), a missing session stores nothing at all.
            with pytest.raises(RuntimeError, match="does not exist"):
                await stack.turns.visible.store(
                    org_id=org.id,
                    session_id="no-such-session",
                    work_item_id=None,
                    role="assistant",
                    content="lost",
                )
            async with stack.db.read() as conn:
                orphans = await conn.scalar(
                    sa.select(sa.func.count()).where(t.messages.c.session_id == "no-such-session")
                )
            assert orphans == 0
        written.append(await org_rows(stack, org.id, thread))
    assert written[0].keys() == written[1].keys()
    for name, rows in written[1].items():
        assert written[0][name] == rows, _difference(name, written[0][name], rows)


async def test_plain_intakes_taken_together_write_what_their_transactions_write(
    make_stack: Callable[..., Stack],
) -> None:
    """The intakes of concurrent plain turns go in one statement (``PlainIntakes``):
    six turns while another's intake is in flight, two of them in one session, one opening a
    session and one whose session is bound to a Slack thread (both declined by the
    statement, taken by the transaction). Their rows are the ones the transactions
    write one after another, and so is each turn's history but the second of the shared
    session's (taken together, neither sees the other's message, as when their
    statements run at the same time)."""
    alone = make_stack(channels={"slack": ScriptedChannel()})
    by_tx = make_stack(channels={"slack": ScriptedChannel()}, statements_alone=False)
    written: list[dict[str, list[Any]]] = []
    histories: list[list[list[str]]] = []
    for stack, thread in ((alone, "1111"), (by_tx, "2222")):
        await stack.listen_for_changes()  # (the agent comes from the cache: no read first)
        org: Org = await make_org(stack, f"org-{thread}")
        plain = await make_agent(stack, org, "plain")
        # Sessions at different event counts: no two event rows alike.
        for key in ["a", "b", "b", "b", "c", "c", "c", "c", "c"]:
            stack.clock.advance(1_000)
            await stack.turns.run(api_trigger(org, plain, f"hello {key}", f"{thread}-{key}"))
        for n in range(2):
            stack.clock.advance(1_000)
            await stack.turns.run(slack_trigger(org, plain, f"in slack {n}", f"{thread}.9"))
        stack.clock.advance(1_000)
        triggers = [
            api_trigger(org, plain, "first", f"{thread}-a"),
            api_trigger(org, plain, "second", f"{thread}-b"),
            api_trigger(org, plain, "third", f"{thread}-a"),
            api_trigger(org, plain, "fourth", f"{thread}-new"),
            api_trigger(org, plain, "fifth", f"slack:T1:C1:{thread}.9"),
            api_trigger(org, plain, "sixth", f"{thread}-c"),
            api_trigger(org, plain, "seventh", f"{thread}-b"),
        ]
        group = stack.turns.intake.plain
        before = (group.statements, group.items)
        if stack is alone:
            taken = await asyncio.gather(*(stack.turns.intake.take(tr) for tr in triggers))
            # The first alone, the other six in one statement.
            assert (group.statements - before[0], group.items - before[1]) == (2, 7)
        else:
            taken = [await stack.turns.intake.take(tr) for tr in triggers]
            assert (group.statements, group.items) == before
        accepted = [turn for turn in taken if isinstance(turn, Accepted)]
        assert len(accepted) == len(taken), taken
        histories.append([[m.content for m in turn.history] for turn in accepted])
        written.append(await org_rows(stack, org.id, thread))
    assert written[0].keys() == written[1].keys()
    for name, rows in written[1].items():
        assert written[0][name] == rows, _difference(name, written[0][name], rows)
    together, apart = histories
    assert together[:6] == apart[:6]
    assert together[6] == [h for h in apart[6] if h != "second"]
