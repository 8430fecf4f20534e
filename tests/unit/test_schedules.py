"""Cron schedules (:mod:`leadgate.runners.schedules`): what an expression may be, and a
schedule whose next firing cannot be found."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from leadgate.core.errors import ValidationError
from leadgate.core.runners import drain
from leadgate.database import schema as t
from leadgate.runners.schedules import ScheduleRunner, add_schedule, next_fire
from tests.helpers import make_agent, make_org
from tests.stack import Stack

MIDNIGHT = int(datetime(2027, 1, 1, tzinfo=UTC).timestamp() * 1000)


def test_next_fire_is_the_first_cron_time_strictly_after() -> None:
    assert next_fire("30 2 * * *", MIDNIGHT) == MIDNIGHT + (2 * 60 + 30) * 60_000
    assert next_fire("0 0 * * *", MIDNIGHT) == MIDNIGHT + 24 * 3600_000


@pytest.mark.parametrize(
    ("cron", "says"),
    [
        ("* * * * * *", "five fields"),  # croniter would take a sixth field as seconds
        ("* * * *", "five fields"),
        ("", "five fields"),
        ("0 0 31 2 *", "never fires"),
        ("61 * * * *", "invalid cron expression"),
        ("a b c d e", "invalid cron expression"),
    ],
)
def test_an_expression_that_is_not_five_fields_or_never_fires_is_refused(
    cron: str, says: str
) -> None:
    with pytest.raises(ValidationError) as info:
        next_fire(cron, MIDNIGHT)
    assert info.value.rule == "schedule.cron"
    assert says in info.value.message


async def test_a_schedule_with_no_next_firing_fires_once_more_and_is_deactivated(
    stack: Stack,
) -> None:
    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain")
    async with stack.db.tx() as conn:
        added = await add_schedule(
            conn,
            stack.clock,
            stack.ids,
            org_id=org.id,
            agent_id=agent["id"],
            cron="0 0 * * *",
            message="nightly",
        )
        # As if croniter could find no date any more (it searches a bounded number of
        # years): a stored expression that never fires again.
        await conn.execute(
            t.schedules.update()
            .where(t.schedules.c.id == added["id"])
            .values(cron="0 0 31 2 *", next_fire_at=stack.clock.now_ms())
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
