"""Concurrency on both backends: one active work item per (worker, session) under a burst
of intakes, fenced transitions with exactly one winner, and no gating leak when two turns
of one item both call complete_task."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa

from leadgate.app import App
from leadgate.core.clock import FakeClock, iso
from leadgate.core.config import Settings
from leadgate.core.errors import Conflict, TransitionError
from leadgate.core.types import Busy, Gated, Reply
from leadgate.database import schema as t
from leadgate.domain import orgs, workitems
from leadgate.domain.workitems import ACTIVE, Status
from leadgate.review.runner import LeadRunner
from leadgate.turns.messages import visible_transcript
from leadgate.turns.providers.base import ModelEvent, ModelRequest, TextDelta, ToolCall
from leadgate.turns.providers.script import ScriptProvider
from tests.helpers import Org, api_trigger, eventually, make_agent, make_org

BURST = 20


async def select_all(service: App, query: sa.Select[Any]) -> list[dict[str, Any]]:
    async with service.db.read() as conn:
        return [dict(r._mapping) for r in (await conn.execute(query)).all()]


async def lead_worker(service: App, org: Org, model: str = "script") -> dict[str, Any]:
    await make_agent(service, org, "lead")
    return await make_agent(service, org, "worker", lead="lead", model=model)


async def assert_one_active_item_per_session(service: App) -> None:
    w = t.work_items.c
    dupes = await select_all(
        service,
        sa.select(w.agent_id, w.session_id, sa.func.count().label("n"))
        .where(w.status.in_([s.value for s in ACTIVE]))
        .group_by(w.agent_id, w.session_id)
        .having(sa.func.count() > 1),
    )
    assert dupes == []


async def test_a_burst_of_intakes_never_makes_two_active_items(service: App) -> None:
    org = await make_org(service)
    worker = await lead_worker(service, org)

    # Burst 1: plain messages on a brand-new session. All race to create the item; all
    # must land in one item's task context.
    texts = [f"<p{i:02d}>" for i in range(BURST)]
    outcomes = await asyncio.gather(
        *(service.turns.run(api_trigger(org, worker, text, session="fresh")) for text in texts)
    )
    assert all(isinstance(o, Reply) for o in outcomes), outcomes
    items = await select_all(
        service, sa.select(t.work_items).where(t.work_items.c.agent_id == worker["id"])
    )
    assert len(items) == 1
    assert items[0]["status"] == "inProgress"
    for text in texts:
        assert items[0]["task_context"].count(text) == 1, text
    await assert_one_active_item_per_session(service)

    # Burst 2: another new session; some messages complete the task, after which the
    # others are busy. Each message is either in the task context or rejected as busy.
    texts = [f"<c{i:02d}>" + (" #complete" if i % 4 == 3 else "") for i in range(BURST)]
    outcomes = await asyncio.gather(
        *(service.turns.run(api_trigger(org, worker, text, session="mixed")) for text in texts)
    )
    await assert_one_active_item_per_session(service)
    async with service.db.read() as conn:
        sid = await conn.scalar(
            sa.select(t.sessions.c.id).where(
                t.sessions.c.agent_id == worker["id"], t.sessions.c.key == "mixed"
            )
        )
    items = await select_all(
        service, sa.select(t.work_items).where(t.work_items.c.session_id == sid)
    )
    assert len(items) == 1
    [item] = items
    assert item["status"] == "reviewQueued"
    assert any(isinstance(o, Gated) for o in outcomes)
    busy = 0
    for text, outcome in zip(texts, outcomes, strict=True):
        tag = text[:5]
        if isinstance(outcome, Busy):
            busy += 1
            assert outcome.work_item_id == item["id"]
            assert tag not in item["task_context"], tag
        else:
            assert isinstance(outcome, Reply | Gated), outcome
            assert item["task_context"].count(tag) == 1, tag
    events = await select_all(
        service, sa.select(t.inbound_events).where(t.inbound_events.c.session_id == sid)
    )
    assert len(events) == BURST
    assert sum(e["outcome"] == "rejectedBusy" for e in events) == busy
    assert all(e["work_item_id"] == item["id"] for e in events)
    users = await select_all(
        service,
        sa.select(t.messages).where(t.messages.c.session_id == sid, t.messages.c.role == "user"),
    )
    assert len(users) == BURST - busy


async def test_concurrent_transitions_of_one_item_have_exactly_one_winner(
    service: App,
) -> None:
    org = await make_org(service)
    worker = await lead_worker(service, org)
    await service.turns.run(api_trigger(org, worker, "task"))
    async with service.db.read() as conn:
        item_id = await conn.scalar(
            sa.select(t.work_items.c.id).where(t.work_items.c.agent_id == worker["id"])
        )
    assert item_id is not None
    targets = [Status.reviewQueued, Status.cancelled, Status.abandoned, Status.awaitingHuman] * 2

    async def contend(dst: Status) -> Status:
        async with service.db.tx() as conn:
            await workitems.get(conn, item_id)  # read first, as a real caller does
            await asyncio.sleep(0)
            await workitems.transition(
                conn,
                service.clock,
                service.ids,
                item_id,
                src=Status.inProgress,
                dst=dst,
                actor="race",
                action=f"to-{dst}",
            )
        return dst

    results = await asyncio.gather(*(contend(d) for d in targets), return_exceptions=True)
    winners = [r for r in results if isinstance(r, Status)]
    losers = [r for r in results if isinstance(r, TransitionError)]
    assert len(winners) == 1, results
    assert len(losers) == len(targets) - 1, results
    async with service.db.read() as conn:
        status = (await workitems.get(conn, item_id)).status
    assert status == winners[0].value
    audit = await select_all(
        service,
        sa.select(t.audit).where(t.audit.c.work_item_id == item_id, t.audit.c.actor == "race"),
    )
    assert [a["to_status"] for a in audit] == [winners[0].value]


async def test_two_review_runners_never_claim_the_same_item(service: App) -> None:
    org = await make_org(service)
    worker = await lead_worker(service, org)
    out = await service.turns.run(api_trigger(org, worker, "done #complete"))
    assert isinstance(out, Gated)
    runners = [
        LeadRunner(service.db, service.clock, service.ids, service.providers, service.outbox)
        for _ in "ab"
    ]
    claims = await asyncio.gather(*(r.claim() for r in runners * 3))
    claimed = [c for c in claims if c is not None]
    assert len(claimed) == 1
    assert claimed[0].id == out.work_item_id
    assert claimed[0].status == "reviewing"


# ------------------------------------------------------- two complete_task calls at once


class Choreography:
    """Turn A calls complete_task; while A is still running, turn B (same item) does too.

    The provider tells the turns apart by arrival order of their first model call.
    """

    def __init__(self) -> None:
        self.arrivals = 0
        self.a_signalled = asyncio.Event()
        self.b_signalled = asyncio.Event()
        self.tool_results: dict[str, Any] = {}

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        last = request.messages[-1]
        if last.role == "tool":
            self.tool_results[str(last.tool_call_id)] = json.loads(last.content)
            if last.tool_call_id == "call_A":
                self.a_signalled.set()
                await self.b_signalled.wait()
            else:
                self.b_signalled.set()
            return
        self.arrivals += 1
        name = "A" if self.arrivals == 1 else "B"
        yield TextDelta(f"text of turn {name}")
        yield ToolCall(f"call_{name}", "complete_task", {"summary": f"summary {name}"})


@pytest.fixture
async def choreographed(migrated_url: str) -> AsyncIterator[tuple[App, Choreography]]:
    plan = Choreography()
    settings = Settings.model_validate({"database": {"url": migrated_url}})
    service = App(
        settings,
        clock=FakeClock(),
        providers={"script": ScriptProvider(), "plan": plan},
        enable_adapters=False,
    )
    yield service, plan
    await service.stop()


async def test_an_acknowledged_complete_task_never_leaks_its_text(
    choreographed: tuple[App, Choreography],
) -> None:
    service, plan = choreographed
    org = await make_org(service)
    worker = await lead_worker(service, org, model="plan")

    turn_a = asyncio.create_task(service.turns.run(api_trigger(org, worker, "task part 1")))
    await asyncio.wait_for(plan.a_signalled.wait(), 30)
    out_b = await service.turns.run(api_trigger(org, worker, "task part 2"))
    out_a = await asyncio.wait_for(turn_a, 30)

    # Both turns were told their work was submitted ...
    assert plan.tool_results["call_A"].get("ok") is True
    assert plan.tool_results["call_B"].get("ok") is True
    # ... so neither may show its text before a review.
    assert isinstance(out_b, Gated)
    assert not isinstance(out_a, Reply), f"turn A's text leaked unreviewed: {out_a}"
    async with service.db.read() as conn:
        item = (
            await conn.execute(
                sa.select(t.work_items).where(t.work_items.c.agent_id == worker["id"])
            )
        ).one()
        shown = await visible_transcript(conn, org.id, item.session_id)
    assert item.status == "reviewQueued"
    assert [r["role"] for r in shown] == ["user", "user"]
    assert all("text of turn" not in r["content"] for r in shown)


async def assert_sessions_whole(
    service: App, org: Org, agent: dict[str, Any], sent: dict[str, list[str]]
) -> None:
    """Each session (by key) holds the user messages ``sent`` to it once each, a reply
    to each, and an event log that numbers its messages 1..n without a gap or a repeat."""
    for key, texts in sent.items():
        async with service.db.read() as conn:
            sid = await conn.scalar(
                sa.select(t.sessions.c.id).where(
                    t.sessions.c.agent_id == agent["id"], t.sessions.c.key == key
                )
            )
            transcript = await visible_transcript(conn, org.id, str(sid))
        users = sorted(m["content"] for m in transcript if m["role"] == "user")
        assert users == sorted(texts), key
        assert sum(m["role"] == "assistant" for m in transcript) == len(users)
        events = await select_all(
            service,
            sa.select(t.session_events.c.seq, t.session_events.c.message_id).where(
                t.session_events.c.session_id == sid
            ),
        )
        assert sorted(e["seq"] for e in events) == list(range(1, len(transcript) + 1))
        assert sorted(e["message_id"] for e in events) == sorted(m["id"] for m in transcript)


async def test_a_burst_of_plain_turns_keeps_every_transcript_and_event_log_whole(
    service: App,
) -> None:
    """Twenty plain turns at once over four sessions (on PostgreSQL their intakes and
    replies go in shared statements): each turn's message and reply are stored once, and
    each session's event log numbers its messages 1..n without a gap or a repeat."""
    org = await make_org(service)
    plain = await make_agent(service, org, "plain")
    keys = [f"burst-{n}" for n in range(4)]
    for key in keys:  # (the sessions exist: the turns below are all plain intakes)
        await service.turns.run(api_trigger(org, plain, f"open {key}", session=key))
    texts = [(keys[i % 4], f"<b{i:02d}>") for i in range(BURST)]
    outcomes = await asyncio.gather(
        *(service.turns.run(api_trigger(org, plain, text, session=key)) for key, text in texts)
    )
    assert all(isinstance(o, Reply) for o in outcomes), outcomes
    await assert_sessions_whole(
        service,
        org,
        plain,
        {key: [f"open {key}"] + [text for k, text in texts if k == key] for key in keys},
    )
    if service.db.statements_alone:
        intakes, replies = service.turns.intake.plain, service.turns.visible.group
        assert replies is not None
        # Shared: fewer statements than turns (the first of a burst goes alone).
        assert intakes.statements < intakes.items and replies.statements < replies.items


async def test_two_replicas_bursting_into_the_same_sessions_lose_nothing(
    migrated_pg: str,
) -> None:
    """Two replicas on one PostgreSQL, each with twenty plain turns at once into the same
    four sessions: each replica groups its own turns' statements, and both take event
    numbers from the same session counters. Every turn is answered, every message and
    reply is stored once, and each session's event log runs 1..n with no gap or repeat."""
    settings = Settings.model_validate({"database": {"url": migrated_pg}})
    replicas = [App(settings, clock=FakeClock(), enable_adapters=False) for _ in range(2)]
    try:
        first = replicas[0]
        org = await make_org(first)
        plain = await make_agent(first, org, "plain")
        keys = [f"shared-{n}" for n in range(4)]
        for key in keys:
            await first.turns.run(api_trigger(org, plain, f"open {key}", session=key))
        turns = [
            (replica, keys[i % 4], f"<r{r}-{i:02d}>")
            for i in range(BURST)
            for r, replica in enumerate(replicas)
        ]
        outcomes = await asyncio.gather(
            *(
                replica.turns.run(api_trigger(org, plain, text, session=key))
                for replica, key, text in turns
            )
        )
        assert all(isinstance(o, Reply) for o in outcomes), outcomes
        await assert_sessions_whole(
            first,
            org,
            plain,
            {key: [f"open {key}"] + [text for _, k, text in turns if k == key] for key in keys},
        )
        for replica in replicas:
            intakes = replica.turns.intake.plain
            assert intakes is not None and intakes.statements < intakes.items
    finally:
        for replica in replicas:
            await replica.stop()


async def test_concurrent_revokes_of_one_key_have_exactly_one_winner(service: App) -> None:
    """A revoke reads the key, then updates it where it is not revoked yet. On PostgreSQL
    (READ COMMITTED) a second revoke that read the key before the first committed waited
    for the first's row lock, matched nothing, and answered success with a revocation
    time that was never stored. (SQLite: the second transaction starts after the first
    committed, and reads the key revoked.)"""
    org = await make_org(service)
    key_id = org.principal.key_id
    assert key_id is not None
    first_updated, release = asyncio.Event(), asyncio.Event()

    async def first() -> orgs.RevokedKeyView:
        async with service.db.tx() as conn:
            out = await orgs.revoke_key(conn, service.clock, org.id, key_id)
            first_updated.set()
            await release.wait()  # (the row lock held, uncommitted)
        return out

    async def second() -> orgs.RevokedKeyView:
        async with service.db.tx() as conn:
            return await orgs.revoke_key(conn, service.clock, org.id, key_id)

    winner = asyncio.create_task(first())
    await first_updated.wait()
    loser = asyncio.create_task(second())
    if service.db.is_postgres:

        async def second_waits() -> bool:
            async with service.db.read() as conn:
                waiting = await conn.scalar(
                    sa.text(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                    )
                )
            return bool(waiting)

        await eventually(second_waits, within=10.0)
    release.set()
    won = await winner
    with pytest.raises(Conflict) as refused:
        await loser
    assert refused.value.rule == "key.revoked"
    async with service.db.read() as conn:
        stored = await conn.scalar(
            sa.select(t.api_keys.c.revoked_at).where(t.api_keys.c.id == key_id)
        )
    assert won["revokedAt"] == iso(stored)
