"""What a gated work item's whole life costs the database, counted: a regression in the
fast path shows up here as a failed count, not as a slower benchmark.

One lifecycle = a REST turn that calls ``complete_task`` on a fresh session (intake,
model, submit), the lead's review (claim, the lead's turn, verdict), and the delivery
(the api binding reveals the stored answer and the item completes, in the approval's
transaction). The budgets are the
counts measured when they were set; lowering one is progress (tighten it), raising one
needs a reason in the commit (see docs/performance.md).
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa

from leadgate.core.config import ReviewSettings
from leadgate.core.errors import NotFound
from leadgate.core.runners import drain
from leadgate.core.types import Gated
from leadgate.database import schema as t
from leadgate.operations.reviews import Reviews
from leadgate.review.cards import ReviewNotifier
from tests.helpers import Org, api_trigger, make_agent, make_org, slack_trigger
from tests.outbox_support import ScriptedChannel
from tests.stack import Stack, build_stack

#: Statements (BEGIN/COMMIT/SAVEPOINT/RELEASE not counted) per lifecycle, by backend.
#: PostgreSQL's one more: the submission's NOTIFY to the lead runners of other replicas.
#: (The api binding's reveal is done in the approval's transaction: 34 -> 32 and 7 -> 5
#: transactions on SQLite, 37 -> 33 on PostgreSQL, which also sent the relays a NOTIFY.)
#: (PostgreSQL's agent and policy rules reads kept between turns while the process
#: LISTENs for their changes, as on SQLite: 33 -> 31, and 43 -> 41 round trips.)
#: (The lead runner's claim keeps the lead agent as the intake keeps the worker: no
#: agents read at all once warm; 31 -> 30 on PostgreSQL, a ``PRAGMA data_version`` in
#: place of the SELECT on SQLite.)
#: (PostgreSQL: the lead runner's claim is one statement outside a transaction block,
#: where it was the head, the move and the audit row in a transaction: 30 -> 28
#: statements, 5 -> 4 transactions, 40 -> 36 round trips; complete_task's signal and its
#: tool message likewise: 28 -> 27, 4 -> 3, 36 -> 33; and the submission, which was
#: a transaction of eight statements: 27 -> 20, 3 -> 2, 33 -> 24; and the intake of
#: the new session, a transaction of nine: 20 -> 12, 2 -> 1, 24 -> 14; and the lead's
#: approval with its reveal, a transaction of eight: 12 -> 5, 1 -> 0, 14 -> 5. Every
#: step is then one statement outside a transaction block: the new session's intake,
#: complete_task's signal, the submission, the claim, the approval.)
#: (SQLite: the lead's approval moves the item on to ``completed`` in its own UPDATE,
#: ``workitems.Then``, where the reveal's move was a second one: 32 -> 31.)
#: (SQLite: ``PRAGMA data_version`` read once per write transaction, where the intake's
#: agent and rules lookups each read it: 31 -> 30. Not counted above, SAVEPOINT and
#: RELEASE went too for a transaction that runs first in its group: 51 -> 40 statements
#: sent to SQLite in all, with one transaction per group as here.)
STATEMENT_BUDGET = {"sqlite": 30, "postgres": 5}
#: Transactions (``BEGIN``) per lifecycle. On PostgreSQL a statement run alone
#: (``Database.write_alone``: a new session's intake, complete_task's signal, the
#: submission, the lead's claim and approval, the relay's claim and outcome commit) is
#: none.
TRANSACTION_BUDGET = {"sqlite": 5, "postgres": 0}
#: PostgreSQL round trips per lifecycle: every statement, BEGIN and COMMIT.
ROUND_TRIP_BUDGET = 5
#: The same lifecycle from a Slack thread (a channel binding: the message is recorded
#: as a run and de-duplicated by its event id; the approved answer is posted). On
#: PostgreSQL the relay's claim and the outcome commit of the post are one statement
#: each: 37 statements, 7 transactions, 51 round trips before, 32, 5 and 42 after;
#: with the intake's agent and rules kept (above), 30 and 40; with the lead agent kept,
#: 29 and 39; with the lead's claim one statement (above), 27, 4 and 35; with
#: complete_task's signal one statement, 26, 3 and 32; with the submission one
#: statement, 19, 2 and 23; with the lead's approval one statement (the delivery a
#: channel post), 15, 1 and 17; with the new session's intake one statement, 7, 0 and
#: 7: every step of the lifecycle is one statement outside a transaction block.
#: (SQLite: one ``PRAGMA data_version`` per write transaction, above: 34 -> 33.)
SLACK_STATEMENT_BUDGET = {"sqlite": 33, "postgres": 7}
SLACK_TRANSACTION_BUDGET = {"sqlite": 7, "postgres": 0}
SLACK_ROUND_TRIP_BUDGET = 7

_FRAMING = ("BEGIN", "COMMIT", "SAVEPOINT", "RELEASE", "ROLLBACK")


@pytest.fixture
async def stack(migrated_url: str) -> AsyncIterator[Stack]:
    built = build_stack(migrated_url)
    # Wired as the service wires it: every submission pokes the lead runner, which then
    # skips the claim while its queue is known empty.
    built.turns.on_review_queued = built.lead_runner.poke
    built.lead_runner.poked_on_enqueue = True
    await built.listen_for_changes()  # PostgreSQL: the intake keeps agents and rules
    yield built
    await built.stop()


async def _lifecycle(stack: Stack, org: Org, worker: dict[str, Any], session: str) -> str:
    trigger = api_trigger(org, worker, f"write {session} #complete", session=session)
    out = await stack.turns.run(trigger)
    assert isinstance(out, Gated) and out.work_item_id
    assert await drain(stack.lead_runner) == 1
    # The reveal is done in the approval's transaction: nothing left for the relay.
    assert await drain(stack.relay) == 0
    return out.work_item_id


async def test_a_gated_lifecycle_stays_within_its_statement_budget(stack: Stack) -> None:
    org = await make_org(stack)
    await make_agent(stack, org, "worker-lead")
    worker = await make_agent(stack, org, "worker", lead="worker-lead")
    await _lifecycle(stack, org, worker, "warm")  # caches (agents, plans) as in a running service
    with stack.db.record_statements() as statements:
        item_id = await _lifecycle(stack, org, worker, "measured")
    async with stack.db.read() as conn:
        status = await conn.scalar(
            sa.select(t.work_items.c.status).where(t.work_items.c.id == item_id)
        )
    assert status == "completed"
    _assert_within(stack, statements, STATEMENT_BUDGET, TRANSACTION_BUDGET, ROUND_TRIP_BUDGET)


def _assert_within(
    stack: Stack,
    statements: list[str],
    budget: dict[str, int],
    transactions: dict[str, int],
    round_trips: int,
) -> None:
    """``statements`` (framing aside) within ``budget`` for the backend, at most
    ``transactions`` transactions, and on PostgreSQL (where each traced line, BEGIN and
    COMMIT included, is one round trip) at most ``round_trips``."""
    verbs = Counter(sql.split()[0].upper() for sql in statements)
    work = sum(n for verb, n in verbs.items() if verb not in _FRAMING)
    backend = "postgres" if stack.db.is_postgres else "sqlite"
    assert work <= budget[backend], (work, verbs, statements)
    # The worker (intake) and the lead (claim) are kept between lifecycles.
    assert not [sql for sql in statements if "FROM agents" in sql], statements
    assert verbs["BEGIN"] <= transactions[backend], (verbs, statements)
    if stack.db.is_postgres:
        assert len(statements) <= round_trips, (len(statements), verbs, statements)


async def test_a_slack_lifecycle_stays_within_its_statement_budget(migrated_url: str) -> None:
    channel = ScriptedChannel("slack")
    stack = build_stack(migrated_url, channels={"slack": channel})
    stack.turns.on_review_queued = stack.lead_runner.poke
    stack.lead_runner.poked_on_enqueue = True
    await stack.listen_for_changes()  # PostgreSQL: the intake keeps agents and rules

    async def lifecycle(ts: str) -> None:
        assert isinstance(
            await stack.turns.run(slack_trigger(org, worker, f"write {ts} #complete", ts)),
            Gated,
        )
        assert await drain(stack.lead_runner) == 1
        assert await drain(stack.relay) >= 1

    try:
        org = await make_org(stack)
        await make_agent(stack, org, "worker-lead")
        worker = await make_agent(stack, org, "worker", lead="worker-lead")
        await lifecycle("1.1")  # caches, as in a running service
        with stack.db.record_statements() as statements:
            await lifecycle("2.2")
        # Each event names the item its message opened (a new session's event is written
        # once, with the new item's id).
        async with stack.db.read() as conn:
            events = (
                await conn.execute(
                    sa.select(t.inbound_events.c.external_event_id, t.work_items.c.task_context)
                    .join(t.work_items, t.work_items.c.id == t.inbound_events.c.work_item_id)
                    .order_by(t.inbound_events.c.external_event_id)
                )
            ).all()
    finally:
        await stack.stop()
    assert channel.texts() == ["Echo: write 1.1 #complete", "Echo: write 2.2 #complete"]
    _assert_within(
        stack, statements, SLACK_STATEMENT_BUDGET, SLACK_TRANSACTION_BUDGET, SLACK_ROUND_TRIP_BUDGET
    )
    assert [tuple(e) for e in events] == [
        ("slack:T1:C1:1.1", "write 1.1 #complete"),
        ("slack:T1:C1:2.2", "write 2.2 #complete"),
    ]


async def test_the_active_item_lookup_uses_the_unique_partial_index(stack: Stack) -> None:
    """Intake looks up a session's active item on every gated turn: it must use the
    ``(agent_id, session_id)`` partial index, not scan the active items (a scan grows
    with the review backlog). The lookup repeats the index's predicate literally."""
    from leadgate.database.schema import ACTIVE_ITEM_PREDICATE
    from leadgate.domain.workitems import _ACTIVE_FOR, ACTIVE

    assert set(re.findall(r"'(\w+)'", ACTIVE_ITEM_PREDICATE)) == {s.value for s in ACTIVE}
    sql = str(_ACTIVE_FOR.compile(dialect=stack.db.engine.dialect))
    if stack.db.is_postgres:
        plan_sql = "EXPLAIN " + re.sub(r"\$\d+::VARCHAR", "'x'", sql)
        # Without statistics PostgreSQL may still pick a scan on an empty table: turn
        # sequential scans off to ask whether the index is usable at all.
        async with stack.db.engine.connect() as conn:  # SQLAlchemy's own: EXPLAIN's rows
            await conn.execute(sa.text("SET enable_seqscan = off"))
            plan = " ".join(str(r[0]) for r in (await conn.execute(sa.text(plan_sql))).all())
    else:
        async with stack.db.read() as conn:
            rows = await conn.execute(
                sa.text("EXPLAIN QUERY PLAN " + sql.replace("?", "'x'")),
            )
            plan = " ".join(str(r[-1]) for r in rows.all())
    assert "uq_work_items_active" in plan, plan


#: A person's approval through ``Reviews.decide`` (the operator API's, the console's
#: and the CLI's path), answered with the item's detail, in one transaction: the item,
#: the fenced move with its audit row, the binding, the delivery, the reveal (the api
#: binding's delivery is done in the same transaction: the message, the move to
#: completed with its audit row, the session event), the review episode closed and its
#: cards read, and the detail's three reads. (The detail was nine reads: 21 -> 15 on
#: both backends; the episode was read, then closed by a list of ids and its cards read
#: by that list: 15 -> 14. The move goes on to completed in the approval's UPDATE
#: (``workitems.Then``) and both audit rows are one executemany, which SQLite's trace
#: counts per row: 14 -> 13 on SQLite, 14 -> 12 on PostgreSQL.)
APPROVAL_STATEMENT_BUDGET = {"sqlite": 13, "postgres": 12}


async def test_a_human_approval_stays_within_its_statement_budget(stack: Stack) -> None:
    org = await make_org(stack)
    await make_agent(stack, org, "worker-lead")
    worker = await make_agent(stack, org, "worker", lead="worker-lead")
    reviews = Reviews(stack.db, stack.clock, stack.ids, stack.outbox)
    # As in the app: an escalation opens a review episode (its SLA timers; no cards
    # without destinations), and the approval closes it.
    notifier = ReviewNotifier(
        stack.clock, stack.ids, stack.outbox, public_url="https://x", defaults=ReviewSettings()
    )
    stack.outbox.on_review_needed(notifier.open)
    escalated = []
    for session in ("warm", "measured"):
        trigger = api_trigger(org, worker, f"hard {session} #escalate #complete", session=session)
        out = await stack.turns.run(trigger)
        assert isinstance(out, Gated) and out.work_item_id
        escalated.append(out.work_item_id)
    assert await drain(stack.lead_runner) == 2
    await reviews.decide(org.principal, escalated[0], "approve")  # plans, as when warm
    with stack.db.record_statements() as statements:
        detail = await reviews.decide(org.principal, escalated[1], "approve")
    assert detail["status"] == "completed"
    assert [r["actorName"] for r in detail["reviews"]] == [
        "lead agent worker-lead",
        f"API key owner ({org.principal.key_id})",
    ]
    verbs = Counter(sql.split()[0].upper() for sql in statements)
    work = sum(n for verb, n in verbs.items() if verb not in _FRAMING)
    backend = "postgres" if stack.db.is_postgres else "sqlite"
    assert work <= APPROVAL_STATEMENT_BUDGET[backend], (work, verbs, statements)
    assert verbs["BEGIN"] == 1, verbs
    async with stack.db.read() as conn:
        episodes = (
            await conn.execute(
                sa.select(t.review_episodes.c.closed_at).where(
                    t.review_episodes.c.work_item_id == escalated[1]
                )
            )
        ).all()
    assert [e.closed_at for e in episodes] == [stack.clock.now_ms()]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_refused_intakes_beside_plain_turns_cost_those_turns_nothing(stack: Stack) -> None:
    """Turns for an agent the organization does not have fail in their intake having
    written nothing: in a group-commit transaction with other turns they roll nothing
    back, so those turns' writes run once (a client sending a wrong model name made every
    turn grouped with it write twice, or more)."""
    org = await make_org(stack)
    plain = await make_agent(stack, org, "plain")
    ghost = {"id": "no-such-agent"}
    await stack.turns.run(api_trigger(org, plain, "warm", session="warm"))

    async def good(c: int) -> None:
        await stack.turns.run(api_trigger(org, plain, f"hello {c}", session=f"p{c}"))

    async def refused(c: int) -> None:
        with pytest.raises(NotFound):
            await stack.turns.run(api_trigger(org, ghost, "hello", session=f"x{c}"))

    with stack.db.record_statements() as statements:
        # Interleaved: refused intakes run first, between and last in the groups.
        await asyncio.gather(*(f(c) for c in range(4) for f in (refused, good)), refused(9))
    assert "ROLLBACK" not in statements, statements
    stored = [sql for sql in statements if sql.startswith("INSERT INTO messages")]
    assert len(stored) == 8, stored  # each good turn's message and answer, once
