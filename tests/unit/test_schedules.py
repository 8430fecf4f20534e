"""Cron schedules (:mod:`leadgate.runners.schedules`): what an expression may be, and a
schedule whose next firing cannot be found."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any, NoReturn

import pytest
import sqlalchemy as sa

from leadgate.core.clock import FakeClock
from leadgate.core.errors import NotFound, ValidationError
from leadgate.core.runners import drain
from leadgate.core.types import BindingKind, BindingSpec, Trigger
from leadgate.database import schema as t
from leadgate.domain import agents as agents_mod
from leadgate.operations.admin import Admin
from leadgate.runners.recovery import TurnRecovery
from leadgate.runners.schedules import (
    NewScheduleView,
    ScheduleRunner,
    add_schedule,
    next_fire,
    remove_schedule,
)
from leadgate.turns.providers.base import ModelEvent, ModelRequest
from leadgate.turns.providers.script import ScriptProvider
from leadgate.turns.runs import RUN_LEASE_MS as TURN_LEASE_MS
from tests.helpers import Org, make_agent, make_org, ours
from tests.stack import Stack
from tests.unit.test_flow_recovery import Killed, Mortal, die

MIDNIGHT = int(datetime(2027, 1, 1, tzinfo=UTC).timestamp() * 1000)


def test_next_fire_is_the_first_cron_time_strictly_after() -> None:
    assert next_fire("30 2 * * *", MIDNIGHT) == MIDNIGHT + (2 * 60 + 30) * 60_000
    assert next_fire("0 0 * * *", MIDNIGHT) == MIDNIGHT + 24 * 3600_000


def test_steps_up_to_their_field_s_values_are_taken() -> None:
    assert next_fire("*/60 * * * *", MIDNIGHT) == MIDNIGHT + 3600_000
    assert next_fire("0 0 * * */7", MIDNIGHT) > MIDNIGHT
    assert next_fire("1-59/2 * * * *", MIDNIGHT) == MIDNIGHT + 60_000


@pytest.mark.parametrize(
    ("cron", "says"),
    [
        ("* * * * * *", "five fields"),  # croniter would take a sixth field as seconds
        ("* * * *", "five fields"),
        ("", "five fields"),
        ("0 0 31 2 *", "never fires"),
        ("61 * * * *", "invalid cron expression"),
        ("a b c d e", "invalid cron expression"),
        ("*/99999999999999999999 * * * *", "step 99999999999999999999 of the minute field"),
        ("0 */0 * * *", "step 0 of the hour field must be 1 to 24"),
        ("0 0 * * 1-5/8", "step 8 of the weekday field must be 1 to 7"),
        ("*/" + "9" * 5000 + " * * * *", "at most 100 characters"),
    ],
)
def test_an_expression_that_is_not_five_fields_or_never_fires_is_refused(
    cron: str, says: str
) -> None:
    with pytest.raises(ValidationError) as info:
        next_fire(cron, MIDNIGHT)
    assert info.value.rule == "schedule.cron"
    assert says in info.value.message


async def _scheduled(
    stack: Stack, cron: str, message: str
) -> tuple[Org, dict[str, Any], NewScheduleView]:
    """An organization, its agent "plain", and a schedule of it: (org, agent, schedule)."""
    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain")
    async with stack.db.tx() as conn:
        added = await add_schedule(
            conn,
            stack.clock,
            stack.ids,
            org_id=org.id,
            agent_id=agent["id"],
            cron=cron,
            message=message,
        )
    return org, agent, added


@pytest.mark.parametrize(
    ("cron", "says"),
    [
        # As if croniter could find no date any more (it searches a bounded number of
        # years): a stored expression that never fires again.
        ("0 0 31 2 *", "never fires"),
        # Stored before a rule that now refuses it: the warning said it "has no next
        # firing", which read as a scheduler bug, not as what to correct.
        ("*/90 * * * *", "step 90 of the minute field must be 1 to 60"),
    ],
)
async def test_a_schedule_with_no_next_firing_fires_once_more_and_is_deactivated(
    stack: Stack, caplog: pytest.LogCaptureFixture, cron: str, says: str
) -> None:
    _, _, added = await _scheduled(stack, "0 0 * * *", "nightly")
    async with stack.db.tx() as conn:
        await conn.execute(
            t.schedules.update()
            .where(t.schedules.c.id == added["id"])
            .values(cron=cron, next_fire_at=stack.clock.now_ms())
        )
    runner = ScheduleRunner(stack.db, stack.clock, stack.turns)
    assert await drain(runner) == 1  # one firing, not one failure per poll
    async with stack.db.read() as conn:
        active = await conn.scalar(
            sa.select(t.schedules.c.active).where(t.schedules.c.id == added["id"])
        )
        turns = await conn.scalar(
            sa.select(sa.func.count()).select_from(t.messages).where(t.messages.c.role == "user")
        )
    assert not active
    assert turns == 1
    (warning,) = [r.getMessage() for r in ours(caplog) if r.levelname == "WARNING"]
    assert f"schedule {added['id']} is deactivated after this firing" in warning
    assert says in warning and "[schedule.cron]" in warning


async def test_a_schedule_whose_agent_is_gone_is_deactivated_and_schedules_are_listed(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    # A deactivated agent's schedule failed every minute with an ERROR traceback, for
    # ever, and no command could show or stop it.
    org = await make_org(stack)
    other = await make_org(stack, "other")
    agent = await make_agent(stack, org, "plain")
    admin = Admin(stack.db, stack.clock, stack.ids, frozenset({"script"}))
    added = await admin.add_schedule(org.id, "plain", "* * * * *", "tick")
    kept = await admin.add_schedule(org.id, "plain", "0 9 * * *", "morning")
    listed = await admin.list_schedules(org.id)
    assert [(s["id"], s["agent"], s["cron"], s["active"]) for s in listed] == [
        (added["id"], "plain", "* * * * *", True),
        (kept["id"], "plain", "0 9 * * *", True),
    ]
    assert await admin.list_schedules(other.id) == []
    async with stack.db.tx() as conn:
        await conn.execute(
            t.agents.update().where(t.agents.c.id == agent["id"]).values(active=False)
        )
        await conn.execute(t.schedules.update().values(next_fire_at=stack.clock.now_ms()))
    runner = ScheduleRunner(stack.db, stack.clock, stack.turns)
    assert await drain(runner) == 2
    assert "Traceback" not in caplog.text
    assert [s["active"] for s in await admin.list_schedules(org.id)] == [False, False]
    stack.clock.advance(3_600_000)
    assert await drain(runner) == 0  # nothing fires any more
    with pytest.raises(ValidationError) as inactive:
        await admin.add_schedule(org.id, "plain", "* * * * *", "again")
    assert inactive.value.rule == "agent.inactive"
    with pytest.raises(NotFound) as elsewhere:
        await admin.remove_schedule(other.id, added["id"])
    assert elsewhere.value.rule == "schedule.not_found"
    assert (await admin.remove_schedule(org.id, added["id"]))["removed"] is True
    assert [s["id"] for s in await admin.list_schedules(org.id)] == [kept["id"]]


async def test_a_firing_cut_by_a_crash_stays_due_runs_once_and_then_advances(
    stack: Stack,
) -> None:
    # The firing's message was taken in, and the process died before the schedule moved
    # on (it used to move on first, so a crash in between lost the day's firing).
    org, agent, added = await _scheduled(stack, "0 9 * * *", "morning")
    due = stack.clock.now_ms()
    async with stack.db.tx() as conn:
        await conn.execute(t.schedules.update().values(next_fire_at=due))
    firing = Trigger(
        org_id=org.id,
        agent_id=agent["id"],
        session_key=f"schedule:{added['id']}",
        text="morning",
        binding=BindingSpec(BindingKind.scheduled, {"scheduleId": added["id"]}),
        external_event_id=f"schedule:{added['id']}:{due}",
    )
    runner = ScheduleRunner(stack.db, stack.clock, stack.turns)

    class Died(BaseException):
        """The process ends here (kill -9): nothing after it runs."""

    real = stack.turns.run

    async def dies_before_the_intake(*_: object, **__: object) -> NoReturn:
        raise Died

    stack.turns.run = dies_before_the_intake  # type: ignore[method-assign]
    with pytest.raises(Died):
        await runner.run_once()
    stack.turns.run = real  # type: ignore[method-assign]
    async with stack.db.read() as conn:
        assert await conn.scalar(sa.select(t.schedules.c.next_fire_at)) == due  # still due
    await stack.turns.run(firing)  # and once more: taken in, then died before advancing
    assert await drain(runner) == 1
    async with stack.db.read() as conn:
        turns = await conn.scalar(
            sa.select(sa.func.count()).select_from(t.messages).where(t.messages.c.role == "user")
        )
        later = await conn.scalar(sa.select(t.schedules.c.next_fire_at))
    assert turns == 1 and later > due
    assert await drain(runner) == 0


async def test_the_runner_knows_when_its_next_firing_is_due(stack: Stack) -> None:
    # The runner loop sleeps no longer than due_in_s: a firing is due with time, and no
    # commit wakes the loop then (tests/integration/test_runner_wakes.py runs it).
    runner = ScheduleRunner(stack.db, stack.clock, stack.turns)
    assert not await runner.run_once()
    assert runner.due_in_s() is None  # no schedule: the poll alone
    await _scheduled(stack, "0 * * * *", "hourly")
    away = -stack.clock.now_ms() % 3_600_000 or 3_600_000  # to the next full hour
    assert not await runner.run_once()
    assert runner.due_in_s() == away / 1000  # learned by the pass's one read
    stack.clock.advance(away - 1)
    assert runner.due_in_s() == 0.001
    assert not await runner.run_once()
    stack.clock.advance(1)
    assert runner.due_in_s() == 0
    assert await runner.run_once()
    assert not await runner.run_once()
    assert runner.due_in_s() == 3_600


@pytest.mark.parametrize("runner_after", ["the same runner", "a restarted runner"])
async def test_a_firing_a_clock_ahead_put_off_is_brought_back_and_none_runs_twice(
    stack: Stack, runner_after: str
) -> None:
    # The clock jumps a year ahead, the hour's firing is taken in and its schedule moved
    # on to an hour a year away; then the clock is put right. Nothing fired for a year.
    _, _, added = await _scheduled(stack, "0 * * * *", "hourly")
    hour = -stack.clock.now_ms() % 3_600_000 or 3_600_000  # to the next full hour
    runner = ScheduleRunner(stack.db, stack.clock, stack.turns)
    assert await drain(runner) == 0
    year = 366 * 24 * 3_600_000
    stack.clock.advance(hour - 60_000 + year)
    assert await drain(runner) == 1  # the next hour's firing, early
    stack.clock.advance(-year)  # put right: a minute before that hour
    if runner_after == "a restarted runner":
        runner = ScheduleRunner(stack.db, stack.clock, stack.turns)
    assert await drain(runner) == 0
    assert runner.due_in_s() == 60  # the hour's firing again, not a year on
    stack.clock.advance(60_000)
    assert await drain(runner) == 1  # a duplicate of the firing taken in: no second turn
    stack.clock.advance(3_600_000)
    assert await drain(runner) == 1  # the next hour's
    async with stack.db.read() as conn:
        turns = await conn.scalar(
            sa.select(sa.func.count()).select_from(t.messages).where(t.messages.c.role == "user")
        )
        listed = await conn.scalar(
            sa.select(t.schedules.c.next_fire_at).where(t.schedules.c.id == added["id"])
        )
    assert turns == 2
    assert listed == stack.clock.now_ms() + 3_600_000


async def test_the_check_for_put_off_firings_takes_a_batch_a_pass(stack: Stack) -> None:
    org, agent, _ = await _scheduled(stack, "0 * * * *", "hourly")
    async with stack.db.tx() as conn:
        for n in range(2):
            await add_schedule(
                conn,
                stack.clock,
                stack.ids,
                org_id=org.id,
                agent_id=agent["id"],
                cron="0 * * * *",
                message=f"hourly {n}",
            )
        hour = await conn.scalar(sa.select(sa.func.min(t.schedules.c.next_fire_at)))
        # Moved on by a clock a year ahead.
        await conn.execute(t.schedules.update().values(next_fire_at=hour + 366 * 24 * 3_600_000))
    runner = ScheduleRunner(stack.db, stack.clock, stack.turns)
    runner.check_batch = 2
    assert await runner.run_once()  # two brought back; the check goes on at once
    assert not await runner.run_once()  # the third, and the check is done
    async with stack.db.read() as conn:
        times = (await conn.execute(sa.select(t.schedules.c.next_fire_at))).scalars().all()
    assert times == [hour] * 3
    assert not await runner.run_once()  # nothing more to check, nothing due


class _SlowOnCue:
    """The script model, but a turn whose message is "slow" waits for ``release``
    (``entered`` set once it does)."""

    def __init__(self) -> None:
        self.script = ScriptProvider()
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        """Wait on "slow", then answer as the script model does."""
        if request.messages and request.messages[-1].content == "slow":
            self.entered.set()
            await self.release.wait()
        async for event in self.script.stream(request):
            yield event


async def test_a_blocked_schedule_turn_holds_up_no_other_due_schedule(
    make_stack: Callable[..., Stack],
) -> None:
    # One pass ran at a time: a slow turn kept every other due schedule waiting (a
    # second pass took the same firing again, a duplicate, not the next schedule).
    model = _SlowOnCue()
    stack = make_stack(providers={"script": model})
    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain")
    ids = []
    for message in ("slow", "quick"):
        async with stack.db.tx() as conn:
            added = await add_schedule(
                conn,
                stack.clock,
                stack.ids,
                org_id=org.id,
                agent_id=agent["id"],
                cron="0 9 * * *",
                message=message,
            )
        ids.append(added["id"])
        stack.clock.advance(1)  # the slow one is due first
    async with stack.db.tx() as conn:
        due = stack.clock.now_ms()
        await conn.execute(
            t.schedules.update().where(t.schedules.c.id == ids[0]).values(next_fire_at=due - 1)
        )
        await conn.execute(
            t.schedules.update().where(t.schedules.c.id == ids[1]).values(next_fire_at=due)
        )
    runner = ScheduleRunner(stack.db, stack.clock, stack.turns)
    slow = asyncio.create_task(runner.run_once())
    await asyncio.wait_for(model.entered.wait(), timeout=10)
    assert await runner.run_once()  # another loop's pass, meanwhile

    async def told() -> list[str]:
        async with stack.db.read() as conn:
            rows = await conn.execute(
                sa.select(t.messages.c.content).where(t.messages.c.role == "user")
            )
            return sorted(rows.scalars())

    async def fired() -> dict[str, int]:
        async with stack.db.read() as conn:
            rows = await conn.execute(sa.select(t.schedules.c.id, t.schedules.c.next_fire_at))
            return {row.id: int(row.next_fire_at) for row in rows}

    assert await told() == ["quick", "slow"]
    assert (await fired())[ids[1]] > due  # the quick one fired and moved on
    assert (await fired())[ids[0]] == due - 1  # the slow one's turn still runs
    model.release.set()
    assert await asyncio.wait_for(slow, timeout=10)
    assert (await fired())[ids[0]] > due
    assert await drain(runner) == 0
    assert await told() == ["quick", "slow"]  # each fired once


@pytest.mark.parametrize(
    ("turn", "since"),
    [
        ("gated", "lead_removed"),
        ("gated", "deactivated"),
        ("gated", "deleted"),
        ("gated", "removed"),
        ("cut_mid_model", "lead_removed"),
        ("cut_mid_model", "deactivated"),
        ("plain", "lead_added"),
        ("plain", "deactivated"),
        ("plain", "deleted"),
        ("plain", "removed"),
    ],
)
async def test_a_firing_taken_in_before_a_crash_goes_on_whatever_its_agent_is_now(
    make_stack: Callable[..., Stack], caplog: pytest.LogCaptureFixture, turn: str, since: str
) -> None:
    """A firing's turn was taken in (``gated``: its worker's lead got its submission;
    ``cut_mid_model``: the process died in the model, the item ``inProgress``; ``plain``:
    the worker answered) and the process died before its schedule moved on. Then the
    worker's lead is removed or added, the worker deactivated or deleted, or the schedule
    removed. The firing taken in decides, not the worker as it is now: the next poll
    finds it a duplicate and moves the schedule on, turn recovery runs a cut turn again,
    and a gated item approved is marked sent (a scheduled item), each once."""
    clock = FakeClock()
    mortal = Mortal()
    first = make_stack(clock=clock, providers={"script": mortal})
    second = make_stack(clock=clock)
    org = await make_org(first)
    await make_agent(first, org, "lead")
    led = {} if turn == "plain" else {"lead": "lead"}
    worker = await make_agent(first, org, "worker", **led)
    message = {"gated": "report #complete", "cut_mid_model": "report #die #complete"}
    async with first.db.tx() as conn:
        added = await add_schedule(
            conn,
            clock,
            first.ids,
            org_id=org.id,
            agent_id=worker["id"],
            cron="0 9 * * *",
            message=message.get(turn, "report"),
        )
    due = clock.now_ms()
    async with first.db.tx() as conn:
        await conn.execute(t.schedules.update().values(next_fire_at=due))
    first.turns.on_review_queued = die  # (a gated turn's submission committed)
    with pytest.MonkeyPatch.context() as mp:
        if turn == "plain":
            run = first.turns.run

            async def answered_then_died(trigger: Trigger) -> NoReturn:
                await run(trigger)
                raise Killed

            mp.setattr(first.turns, "run", answered_then_died)
        with pytest.raises(Killed):
            await ScheduleRunner(first.db, clock, first.turns).run_once()
    async with second.db.tx() as conn:
        if since == "removed":
            await remove_schedule(conn, org.id, added["id"])
        else:
            changes: dict[str, dict[str, Any]] = {
                "lead_removed": {"lead": None},
                "lead_added": {"lead": "lead"},
                "deactivated": {"active": False},
                "deleted": {"delete": True},
            }
            change = changes[since]
            await agents_mod.save_agent(
                conn, clock, second.ids, org.id, agent_ref=worker["id"], **change
            )
    runner = ScheduleRunner(second.db, clock, second.turns)
    assert await drain(runner) == (0 if since == "removed" else 1)
    if turn == "cut_mid_model":
        clock.advance(TURN_LEASE_MS + 1)
        assert await drain(TurnRecovery(second.turns)) == 1
    await second.settle()  # the lead approves a gated turn's submission
    s, m, e = t.schedules.c, t.messages.c, t.inbound_events.c
    async with second.db.read() as conn:
        schedule = (await conn.execute(sa.select(s.active, s.next_fire_at))).first()
        roles = (await conn.execute(sa.select(m.role).order_by(m.role))).scalars().all()
        events = (await conn.execute(sa.select(e.external_event_id))).scalars().all()
        items = (await conn.execute(sa.select(t.work_items.c.status))).scalars().all()
        deliveries = (await conn.execute(sa.select(t.deliveries.c.status))).scalars().all()
    if since == "removed":
        assert schedule is None
    else:
        # Moved on, still active (it was deactivated, its firing done, when the worker
        # was deactivated or deleted since: a firing taken in before).
        assert schedule is not None
        assert (bool(schedule.active), schedule.next_fire_at > clock.now_ms()) == (True, True)
    assert events == [f"schedule:{added['id']}:{due}"]  # one intake
    assert [r.getMessage() for r in ours(caplog) if r.name == "leadgate.schedules"] == []
    if turn == "plain":
        assert (roles, items, deliveries) == (["assistant", "user"], [], [])
    else:
        # One turn, its submission approved and marked sent (nothing posted).
        assert (roles, items, deliveries) == (
            ["assistant", "tool", "user"],
            ["completed"],
            ["sent"],
        )
    assert await drain(runner) == 0  # nothing fires again
