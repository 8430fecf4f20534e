"""Reminders, escalation and expiry (leadgate/review/sla.py) on a fake clock, on SQLite
and PostgreSQL: each fires exactly once, also with two runners on two connections
pools at once; deliveryUnknown is reminded about, never expired; an expiry is audited
and counted as an expiry, never as a human rejection."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import sqlalchemy as sa

from leadgate.core.clock import MINUTE_MS
from leadgate.core.durations import format_duration, parse_duration
from leadgate.core.errors import TransitionError, ValidationError
from leadgate.core.metrics import METRICS
from leadgate.core.runners import LEFT_AT_MOST_MS, LOCKED_RECHECK_MS, drain
from leadgate.database import schema as t
from leadgate.database.db import Conn
from leadgate.domain import workitems
from leadgate.review import decisions
from leadgate.review import destinations as dest
from leadgate.review.cards import TIMERS_TOPIC, ReviewNotifier
from leadgate.review.sla import SlaRunner
from outbox.channel import Card, Uncertain
from tests.helpers import held_open, item_audit, item_locked
from tests.review_support import (
    ESCALATION_CHANNEL,
    REVIEW_CHANNEL,
    ReviewEnv,
    review_env,
    slack_trigger,
)
from tests.stack import Stack

HOUR = 60 * MINUTE_MS


def purposes(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(Card.from_json(r["address"]["card"]).purpose, r["address"]["channel"]) for r in rows]


def metric(counter: Any) -> float:
    return float(counter._value.get())


async def test_reminders_escalation_and_expiry_each_fire_once_on_the_clock(
    make_stack: Callable[..., Stack],
) -> None:
    env = await review_env(
        make_stack, remind_after="30m", remind_every="1h", escalate_after="2h", expire_after="4h"
    )
    clock = env.stack.clock
    item_id = await env.escalated("s1")
    await drain(env.stack.relay)
    expiries, rejections = metric(METRICS.expiries), _decisions("reject")

    clock.advance(29 * MINUTE_MS)
    assert not await env.sla.run_once()
    clock.advance(MINUTE_MS)  # 30m
    assert await env.sla.run_once()
    assert not await env.sla.run_once()  # fired once
    clock.advance(HOUR)  # 1h30: the next reminder
    assert await env.sla.run_once()
    clock.advance(30 * MINUTE_MS)  # 2h: escalation (and the 2h30 reminder is not due yet)
    assert await env.sla.run_once()
    assert not await env.sla.run_once()
    cards = await env.deliveries(item_id, "card")
    assert purposes(cards) == [
        ("notify", REVIEW_CHANNEL),
        ("reminder", REVIEW_CHANNEL),
        ("reminder", REVIEW_CHANNEL),
        ("escalation", ESCALATION_CHANNEL),
    ]
    await drain(env.stack.relay)  # every card posted

    clock.advance(2 * HOUR)  # 4h: expiry (the reminders due meanwhile are not posted)
    assert await env.sla.run_once()
    assert not await env.sla.run_once()
    async with env.stack.db.read() as conn:
        item = await workitems.get(conn, item_id)
    assert item.status == "rejected"
    last = (await item_audit(env.stack, item_id))[-1]
    assert (last["action"], last["actor"], last["surface"], last["to_status"]) == (
        "expire",
        "system:expiry",
        "system",
        "rejected",
    )
    assert last["text"] == "expired: no decision within 4h"
    assert metric(METRICS.expiries) == expiries + 1
    assert _decisions("reject") == rejections  # not counted as a human rejection
    assert len(await env.deliveries(item_id, "card")) == 4
    updates = await env.deliveries(item_id, "cardUpdate")
    assert len(updates) == 4
    outcome = Card.from_json(updates[0]["address"]["card"]).outcome
    assert outcome is not None
    assert (outcome.title, outcome.by, outcome.text) == (
        "Expired (rejected)",
        "expiry",
        "expired: no decision within 4h",
    )
    clock.advance(24 * HOUR)
    assert not await env.sla.run_once()


async def test_the_runner_knows_when_its_next_timer_falls_due(
    make_stack: Callable[..., Stack],
) -> None:
    """A pass that leaves nothing due reads the earliest timer to come: the runner loop
    sleeps no longer than ``due_in_s``, so a reminder fires at its time, not at the poll
    (tests/integration/test_runner_wakes.py runs the loop)."""
    env = await review_env(make_stack, remind_after="30m", escalate_after="2h")
    clock = env.stack.clock
    assert not await env.sla.run_once()
    assert env.sla.due_in_s() is None  # no episode open: the poll alone
    await env.escalated("s1")
    assert not await env.sla.run_once()
    assert env.sla.due_in_s() == 30 * 60  # the reminder
    clock.advance(30 * MINUTE_MS - 1)
    assert env.sla.due_in_s() == 0.001
    clock.advance(1)
    assert env.sla.due_in_s() == 0
    assert await env.sla.run_once()  # the reminder fired; the loop runs again at once
    assert not await env.sla.run_once()
    assert env.sla.due_in_s() == 90 * 60  # the escalation


async def test_a_reminder_missed_for_ages_fires_once_and_at_once_then_keeps_its_interval(
    make_stack: Callable[..., Stack],
) -> None:
    """A stopped service (or a clock jump forward) passes any number of reminders: one
    fires, and the next falls on the interval after now. It was stepped to one interval
    at a time in the event loop: a 1 s interval a thousand years on never finished."""
    env = await review_env(make_stack, remind_after="30m", remind_every="1s")
    clock = env.stack.clock
    item_id = await env.escalated("s1")
    await drain(env.stack.relay)
    clock.advance(30 * MINUTE_MS + 1000 * 366 * 24 * HOUR + 400)
    assert await env.sla.run_once()
    assert not await env.sla.run_once()  # one reminder for all those missed
    assert env.sla.due_in_s() == 0.6  # the next on the 1 s interval after now
    clock.advance(600)
    assert await env.sla.run_once()
    cards = await env.deliveries(item_id, "card")
    assert purposes(cards) == [("notify", REVIEW_CHANNEL)] + [("reminder", REVIEW_CHANNEL)] * 2


async def test_an_episode_opened_with_a_sooner_timer_wakes_the_runner(
    make_stack: Callable[..., Stack],
) -> None:
    """An episode committed with a timer sooner than the one the runner sleeps toward (or
    while it knows of none) wakes its loop (``timers_opened``, on ``TIMERS_TOPIC``); one
    with a later timer does not: the pass that fires the known one reads it."""
    env = await review_env(make_stack, remind_after="30m")
    wakes: list[None] = []
    env.sla.wake = lambda: wakes.append(None)
    env.stack.db.on_commit_payloads(TIMERS_TOPIC, env.sla.timers_opened)
    assert not await env.sla.run_once()
    await env.escalated("s1")
    assert len(wakes) == 1  # it knew of no timer
    assert not await env.sla.run_once()
    assert env.sla.due_in_s() == 30 * 60
    env.stack.clock.advance(10 * MINUTE_MS)
    await env.escalated("s2")  # reminded 40 minutes on: later than the known one
    assert len(wakes) == 1
    env.sla.timers_opened([env.stack.clock.now_ms() + 20 * MINUTE_MS - 1])  # sooner
    assert len(wakes) == 2


def _decisions(verdict: str) -> float:
    return sum(
        sample.value
        for family in METRICS.decisions.collect()
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels.get("verdict") == verdict
    )


async def test_delivery_unknown_is_reminded_about_and_never_expired(
    make_stack: Callable[..., Stack],
) -> None:
    env = await review_env(make_stack, remind_after="10m", expire_after="20m")
    stack = env.stack
    trigger = slack_trigger(env, "ship it #complete")
    await stack.turns.run(trigger)
    env.slack.script = [Uncertain("reset after sending")]
    await drain(stack.lead_runner)
    await drain(stack.relay)
    [episode] = await env.episodes(_only(await _items(env)))
    assert episode["reason"] == "deliveryUnknown" and episode["expire_at"] is None
    stack.clock.advance(10 * MINUTE_MS)
    assert await env.sla.run_once()
    stack.clock.advance(30 * 24 * HOUR)
    assert not await env.sla.run_once()
    item_id = _only(await _items(env))
    assert purposes(await env.deliveries(item_id, "card")) == [
        ("notify", REVIEW_CHANNEL),
        ("reminder", REVIEW_CHANNEL),
    ]
    async with stack.db.read() as conn:
        assert (await workitems.get(conn, item_id)).status == "approved"


async def _items(env: ReviewEnv) -> list[str]:
    async with env.stack.db.read() as conn:
        return [
            str(r)
            for r in (
                await conn.execute(
                    sa.select(t.work_items.c.id).where(t.work_items.c.org_id == env.org.id)
                )
            ).scalars()
        ]


def _only(values: list[str]) -> str:
    assert len(values) == 1, values
    return values[0]


async def test_two_runners_at_once_fire_each_timer_exactly_once(
    make_stack: Callable[..., Stack],
) -> None:
    env = await review_env(make_stack, remind_after="10m", escalate_after="20m", expire_after="30m")
    # A second process: its own engine (connection pool), outbox and notifier.
    other = make_stack(clock=env.stack.clock)
    notifier = ReviewNotifier(
        other.clock,
        other.ids,
        other.outbox,
        public_url="https://x",
        defaults=env.notifier.defaults,
    )
    runners = [env.sla, SlaRunner(other.db, other.clock, other.ids, other.outbox, notifier)]
    items = [await env.escalated(f"s{i}") for i in range(6)]
    clock = env.stack.clock
    for step in (10, 10, 10):
        clock.advance(step * MINUTE_MS)
        await asyncio.gather(*(r.run_once() for r in runners))
        await asyncio.gather(*(r.run_once() for r in runners))
    for item_id in items:
        counts = Counter(p for p, _ in purposes(await env.deliveries(item_id, "card")))
        assert counts == {"notify": 1, "reminder": 1, "escalation": 1}, counts
        actions = [a["action"] for a in await item_audit(env.stack, item_id)]
        assert actions.count("expire") == 1
        [episode] = await env.episodes(item_id)
        assert (episode["reminders"], episode["closed_at"] is not None) == (1, True)


async def test_a_decision_racing_the_expiry_makes_one_outcome(
    make_stack: Callable[..., Stack],
) -> None:
    env = await review_env(make_stack, expire_after="1h")
    items = [await env.escalated(f"s{i}") for i in range(4)]
    env.stack.clock.advance(HOUR)

    async def approve(item_id: str) -> str:
        try:
            async with env.stack.db.tx() as conn:
                item = await workitems.get(conn, item_id)
                await decisions.decide(conn, env.stack.outbox, item, "approve", "user:x")
        except TransitionError:
            return "lost"
        return "won"

    await asyncio.gather(env.sla.run_once(), *(approve(i) for i in items))
    for item_id in items:
        actions = [a["action"] for a in await item_audit(env.stack, item_id)]
        assert actions.count("expire") + actions.count("approve") == 1, actions
        [episode] = await env.episodes(item_id)
        assert episode["closed_at"] is not None


async def _status(env: ReviewEnv, item_id: str) -> str:
    async with env.stack.db.read() as conn:
        return (await workitems.get(conn, item_id)).status


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_an_expiry_whose_item_another_transaction_holds_waits_for_nothing(
    make_stack: Callable[..., Stack],
) -> None:
    """PostgreSQL: two items' waits expire at once, and one item is row-locked by another
    transaction (held open here; in the service a turn's intake on it, or a fenced move
    that lost its race for it, keeps the lock to its commit, with no wake-up after). The
    pass does not wait for it: it expires the other and returns (waiting, it stalled
    with every episode due after that one). The loop looks again LOCKED_RECHECK_MS on,
    not at the poll, and the pass after the lock is gone expires the held item. Each
    expiry is audited, counted and closes its cards once."""
    env = await review_env(make_stack, expire_after="1h")
    held, free = [await env.escalated(session) for session in ("held", "free")]
    await drain(env.stack.relay)
    expiries = metric(METRICS.expiries)
    env.stack.clock.advance(HOUR)
    async with held_open(env.stack.db, item_locked(held)):
        assert await asyncio.wait_for(env.sla.run_once(), 5)
        assert (await _status(env, held), await _status(env, free)) == (
            "awaitingHuman",
            "rejected",
        )
        assert not await asyncio.wait_for(env.sla.run_once(), 5)
        assert env.sla.due_in_s() == LOCKED_RECHECK_MS / 1000
    env.stack.clock.advance(LOCKED_RECHECK_MS)  # (passed over until then)
    assert await env.sla.run_once()
    assert await _status(env, held) == "rejected"
    assert not await env.sla.run_once()
    assert env.sla.due_in_s() is None
    assert metric(METRICS.expiries) == expiries + 2
    for item_id in (held, free):
        actions = [a["action"] for a in await item_audit(env.stack, item_id)]
        assert actions.count("expire") == 1, actions
        [episode] = await env.episodes(item_id)
        assert episode["outcome"] == "Expired (rejected)"
        cards = await env.deliveries(item_id, "card")
        assert len(await env.deliveries(item_id, "cardUpdate")) == len(cards) == 1


async def _free_behind_held(
    make_stack: Callable[..., Stack], n: int, *, spaced: bool
) -> tuple[ReviewEnv, list[str], str, SlaRunner, Callable[[Conn], Awaitable[None]]]:
    """``n`` items waiting for a person (``spaced``: each due a millisecond after the one
    before) and one due after them, all their waits expired by the clock; an SLA runner
    of batches of 2; and what holds the ``n`` items' rows (for ``held_open``): the env,
    the held items, the free one, the runner, the holder."""
    env = await review_env(make_stack, expire_after="1h")
    held = []
    for i in range(n):
        held.append(await env.escalated(f"held-{i}"))
        if spaced:
            env.stack.clock.advance(1)  # (the batch is the earliest, the held ones)
    free = await env.escalated("free")
    await drain(env.stack.relay)
    sla = SlaRunner(
        env.stack.db, env.stack.clock, env.stack.ids, env.stack.outbox, env.notifier, batch=2
    )
    env.stack.clock.advance(HOUR)
    locks = [item_locked(item_id) for item_id in held]

    async def hold_them(conn: Conn) -> None:
        for lock in locks:
            await lock(conn)

    return env, held, free, sla, hold_them


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_batch_of_held_expiries_does_not_hold_back_the_episodes_due_after_it(
    make_stack: Callable[..., Stack],
) -> None:
    """PostgreSQL: more items' waits expire than a pass's batch holds (2 here, 100 in
    the service), the earliest of them all row-locked by other transactions, and one
    item due after them is free. The pass read one batch, found every episode of it
    held, fired nothing and read that same batch at every look while the locks were
    held: the free item waited behind them. It reads on past the held ones now and
    expires the free item in the same pass; once the locks are gone the look again
    (LOCKED_RECHECK_MS on) expires the held ones, a batch a pass, each once."""
    env, held, free, sla, hold_them = await _free_behind_held(make_stack, 3, spaced=True)
    clock = env.stack.clock
    expiries = metric(METRICS.expiries)
    async with held_open(env.stack.db, hold_them):
        assert await asyncio.wait_for(sla.run_once(), 5)
        assert await _status(env, free) == "rejected"
        assert [await _status(env, item_id) for item_id in held] == ["awaitingHuman"] * 3
        assert sla.due_in_s() == LOCKED_RECHECK_MS / 1000
    clock.advance(LOCKED_RECHECK_MS)
    assert await sla.run_once()  # a batch,
    assert await sla.run_once()  # and the rest
    assert [await _status(env, item_id) for item_id in held] == ["rejected"] * 3
    assert not await sla.run_once()
    assert sla.due_in_s() is None
    assert metric(METRICS.expiries) == expiries + 4
    for item_id in (*held, free):
        actions = [a["action"] for a in await item_audit(env.stack, item_id)]
        assert actions.count("expire") == 1, actions


def _tries(statements: list[str]) -> int:
    """How many expiries ``statements`` (a pass's) tried: each locks its item first, or
    skips it when another transaction holds it."""
    return sum("SKIP LOCKED" in sql for sql in statements)


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_held_episodes_are_tried_again_less_often_and_a_free_one_still_fires(
    make_stack: Callable[..., Stack],
) -> None:
    """PostgreSQL: the waits of several items expire while other transactions hold the
    items (a long transaction, say), and one item due after them is free. Every pass
    tried every held episode (a transaction, and two statements, each) and the loop
    looked again LOCKED_RECHECK_MS on: with N held, 20 passes a second of N firings
    each, for as long as the rows were held. A held episode is now left, as the flow
    resumer leaves a held continuation: the pages pass it over until it is tried again,
    LOCKED_RECHECK_MS on, then twice as long each time it is still held, up to
    LEFT_AT_MOST_MS. The free one expires in the first pass; once the rows are free each
    held one expires at its next try, once."""
    env, held, free, sla, hold_them = await _free_behind_held(make_stack, 5, spaced=False)
    clock = env.stack.clock
    expiries = metric(METRICS.expiries)
    tries: list[int] = []
    gaps: list[float | None] = []
    async with held_open(env.stack.db, hold_them):
        with env.stack.db.record_statements() as first:
            assert await asyncio.wait_for(sla.run_once(), 5)
        assert await _status(env, free) == "rejected"
        assert _tries(first) == len(held) + 1
        for _ in range(6):
            gaps.append(sla.due_in_s())
            with env.stack.db.record_statements() as early:
                assert not await sla.run_once()  # before their time: passed over
            assert _tries(early) == 0 and len(early) <= 2, early
            clock.advance(round((gaps[-1] or 0) * 1000))
            with env.stack.db.record_statements() as statements:
                assert not await sla.run_once()  # their time: tried again, held still
            tries.append(_tries(statements))
    assert gaps == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0]
    assert gaps[-1] == LEFT_AT_MOST_MS / 1000
    assert tries == [len(held)] * 6
    assert [await _status(env, item_id) for item_id in held] == ["awaitingHuman"] * 5
    clock.advance(LEFT_AT_MOST_MS)
    assert await sla.run_once()  # a batch,
    assert await sla.run_once()  # another,
    assert await sla.run_once()  # and the rest
    assert not await sla.run_once()
    assert sla.due_in_s() is None
    assert [await _status(env, item_id) for item_id in held] == ["rejected"] * 5
    assert metric(METRICS.expiries) == expiries + 6
    for item_id in (*held, free):
        actions = [a["action"] for a in await item_audit(env.stack, item_id)]
        assert actions.count("expire") == 1, actions


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_decision_holding_an_expiring_item_makes_the_one_outcome(
    make_stack: Callable[..., Stack],
) -> None:
    """PostgreSQL: a person's approval of an item whose wait has just expired is not
    committed yet when the SLA runner's pass comes (it holds the item's row lock, and
    the episode's). The pass skips the item rather than waiting for the decision (and
    keeping the row locked to its own commit after the decision's); once the approval
    commits, the look again finds the episode closed: the item is approved, never
    expired, and nothing more is due."""
    env = await review_env(make_stack, expire_after="1h")
    item_id = await env.escalated("s1")
    expiries = metric(METRICS.expiries)
    env.stack.clock.advance(HOUR)

    async def approve(conn: Conn) -> None:
        item = await workitems.get(conn, item_id)
        await decisions.decide(conn, env.stack.outbox, item, "approve", "user:x")

    async with held_open(env.stack.db, approve):
        assert not await asyncio.wait_for(env.sla.run_once(), 5)
        assert env.sla.due_in_s() == LOCKED_RECHECK_MS / 1000
    env.stack.clock.advance(LOCKED_RECHECK_MS)  # (passed over until then)
    assert not await env.sla.run_once()
    assert env.sla.due_in_s() is None
    actions = [a["action"] for a in await item_audit(env.stack, item_id)]
    assert (actions.count("approve"), actions.count("expire")) == (1, 0), actions
    assert metric(METRICS.expiries) == expiries


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_decision_holding_an_episode_due_a_reminder_stalls_no_pass(
    make_stack: Callable[..., Stack],
) -> None:
    """PostgreSQL: reminders fall due on two items' episodes at once, and a person's
    approval of one is not committed yet (it closed that episode and holds its row
    lock to its commit, however long its transaction runs). The pass does not wait for
    it: it reminds about the other and returns (waiting, the reminder's fenced update
    stalled the pass, every episode due after it with it). The loop looks again
    LOCKED_RECHECK_MS on, and once the approval commits that look finds the episode
    closed: no reminder for it, nothing more due."""
    env = await review_env(make_stack, remind_after="30m")
    held, free = [await env.escalated(session) for session in ("held", "free")]
    reminders = metric(METRICS.reminders)
    env.stack.clock.advance(30 * MINUTE_MS)

    async def approve(conn: Conn) -> None:
        item = await workitems.get(conn, held)
        await decisions.decide(conn, env.stack.outbox, item, "approve", "user:x")

    async with held_open(env.stack.db, approve):
        assert await asyncio.wait_for(env.sla.run_once(), 5)
        assert env.sla.due_in_s() == LOCKED_RECHECK_MS / 1000
    env.stack.clock.advance(LOCKED_RECHECK_MS)  # (passed over until then)
    assert not await env.sla.run_once()
    assert env.sla.due_in_s() is None
    assert [p for p, _ in purposes(await env.deliveries(free, "card"))] == ["notify", "reminder"]
    assert [p for p, _ in purposes(await env.deliveries(held, "card"))] == ["notify"]
    assert metric(METRICS.reminders) == reminders + 1
    [episode] = await env.episodes(held)
    assert (episode["reminders"], episode["closed_at"] is not None) == (0, True)


async def test_agent_and_organization_overrides_apply_when_the_wait_starts(
    make_stack: Callable[..., Stack],
) -> None:
    env = await review_env(make_stack)  # [review] defaults: remind 30m, nothing else
    stack = env.stack
    async with stack.db.tx() as conn:
        common = {"org_id": env.org.id}
        await dest.set_sla(
            conn, stack.clock, stack.ids, agent_id=None, changes={"expire_after": HOUR}, **common
        )
        await dest.set_sla(
            conn,
            stack.clock,
            stack.ids,
            agent_id=env.worker["id"],
            changes={"remind_after": 5 * MINUTE_MS, "escalate_after": None},
            **common,
        )
        view = await dest.sla_view(conn, env.org.id, env.worker["id"])
    assert view == {
        "remindAfter": "5m",
        "remindEvery": "inherit",
        "escalateAfter": "off",
        "expireAfter": "inherit",
    }
    item_id = await env.escalated("s1")
    [episode] = await env.episodes(item_id)
    start = episode["started_at"]
    assert (episode["next_remind_at"], episode["escalate_at"], episode["expire_at"]) == (
        start + 5 * MINUTE_MS,
        None,
        start + HOUR,
    )


def test_durations_parse_and_format() -> None:
    assert parse_duration("1h30m") == 90 * MINUTE_MS
    assert parse_duration(" 45S ") == 45_000
    assert parse_duration("off") is None and parse_duration("0") is None
    # Zero in any unit is off too: "0s" was refused ("between 1s and 366d") while "0" was off.
    assert parse_duration("0s") is None and parse_duration("0h0m") is None
    with pytest.raises(ValidationError) as too_long:
        parse_duration("367d", name="review.expire_after")
    assert (
        too_long.value.message == "review.expire_after must be between 1s and 366d, or off (or 0)"
    )
    assert format_duration(90 * MINUTE_MS) == "1h30m" and format_duration(None) == "off"
    for bad in ("30", "soon", "1h 30m", "-5m", "400d"):
        with pytest.raises(ValidationError):
            parse_duration(bad)


async def test_an_expiry_read_before_its_wait_ended_leaves_the_items_next_wait_alone(
    make_stack: Callable[..., Stack], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass reads an episode due to expire; before its expiry's transaction, a person
    returns the item (closing that episode) and the worker hands it in again, escalated
    to a person: a new wait, a new episode, its expiry an hour on. The expiry of the
    closed episode found the item awaiting a person and rejected it (``expired: no
    decision within 1h``), the new wait a second old. It leaves the item alone now: the
    episode it read is closed."""
    env = await review_env(make_stack, expire_after="1h")
    item_id = await env.escalated("s1")
    env.stack.clock.advance(HOUR)
    real_tx = env.stack.db.tx

    async def meanwhile() -> None:
        async with real_tx() as conn:
            item = await workitems.get(conn, item_id)
            await decisions.decide(conn, env.stack.outbox, item, "return", "user:x", "redo")
        assert await env.escalated("s1") == item_id

    class _AfterMeanwhile:
        """The pass's first transaction, entered once :func:`meanwhile` ran."""

        async def __aenter__(self) -> Conn:
            monkeypatch.setattr(env.stack.db, "tx", real_tx)
            await meanwhile()
            self.inner = real_tx()
            conn: Conn = await self.inner.__aenter__()
            return conn

        async def __aexit__(self, *exc: Any) -> None:
            await self.inner.__aexit__(*exc)

    monkeypatch.setattr(env.stack.db, "tx", _AfterMeanwhile)
    await env.sla.run_once()
    assert await _status(env, item_id) == "awaitingHuman"
    first, second = await env.episodes(item_id)
    assert first["outcome"] != "Expired (rejected)"
    assert second["closed_at"] is None and second["expire_at"] is not None
    actions = [a["action"] for a in await item_audit(env.stack, item_id)]
    assert "expire" not in actions, actions
