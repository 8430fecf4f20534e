"""A person's decision wakes the runner it gave work to at its commit
(``leadgate.domain.wakes``): a returned item's revision and an approved flow
continuation start at once, though the runner loops poll only every 30 s here. (That
other decisions wake neither runner is what the code says; nothing here could see a
wasted pass. Across replicas: ``test_runner_wakes.py``.) A delivery's recovery wakes
the relay alone, and only when it gave it work (a retry)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa

from leadgate.app import App
from leadgate.core.clock import FakeClock
from leadgate.core.config import Settings
from leadgate.core.types import Gated
from leadgate.database import schema as t
from leadgate.flows.runs import create_flow
from outbox.channel import Uncertain
from tests.helpers import (
    Org,
    api_trigger,
    eventually,
    item_row,
    make_agent,
    make_org,
    slack_trigger,
)
from tests.outbox_support import ScriptedChannel

#: Well under the poll: only the decision's wake can make the runner act this soon.
WITHIN_S = 10.0


#: The channel of :func:`app`: its first two posts are maybe posted (deliveryUnknown).
@pytest.fixture
def slack() -> ScriptedChannel:
    return ScriptedChannel("slack", script=[Uncertain("timed out"), Uncertain("timed out")])


@pytest.fixture
async def app(migrated_url: str, slack: ScriptedChannel) -> AsyncIterator[App]:
    settings = Settings.model_validate(
        {"database": {"url": migrated_url}, "runners": {"poll_interval_s": 30}}
    )
    service = App(settings, clock=FakeClock(), enable_adapters=False, channels={"slack": slack})
    await service.start_runners()
    yield service
    await service.stop()


async def setup(app: App) -> tuple[Org, dict[str, Any]]:
    org = await make_org(app)
    await make_agent(app, org, "lead")
    return org, await make_agent(app, org, "worker", lead="lead")


async def awaiting_human(app: App, item_id: str) -> None:
    # The submission pokes the lead runner: its review needs no poll either.
    async def waiting() -> bool:
        return bool((await item_row(app, item_id))["status"] == "awaitingHuman")

    await eventually(waiting, WITHIN_S)


async def test_a_returned_item_is_revised_at_once(app: App) -> None:
    org, worker = await setup(app)
    out = await app.turns.run(api_trigger(org, worker, "hard #escalate #complete", "s1"))
    assert isinstance(out, Gated) and out.work_item_id
    item_id = out.work_item_id
    await awaiting_human(app, item_id)
    await app.reviews.decide(org.principal, item_id, "return", "add the tests")

    async def revised() -> bool:
        row = await item_row(app, item_id)
        # The revision runner took the feedback to the worker, whose revised work
        # (escalated again by the script lead) came back for review.
        return row["pending_feedback"] is None and row["status"] != "inProgress"

    await eventually(revised, WITHIN_S)
    assert (await item_row(app, item_id))["revision"] == 1


async def test_an_approved_flow_continuation_resumes_at_once(app: App) -> None:
    org, _ = await setup(app)
    nodes = [
        {"type": "agent", "agent": "worker", "prompt": "write it #complete #escalate"},
        {"type": "output", "value": "after"},
    ]
    async with app.db.tx() as conn:
        flow = await create_flow(conn, app.clock, app.ids, org.id, "f", nodes)
    await app.flows.start(org.id, str(flow["id"]))
    c = t.continuations.c
    async with app.db.read() as conn:
        item_id = str(await conn.scalar(sa.select(c.work_item_id)))
    await awaiting_human(app, item_id)
    await app.reviews.decide(org.principal, item_id, "approve")

    async def resumed() -> bool:
        async with app.db.read() as conn:
            return await conn.scalar(sa.select(c.resumed_run_id)) is not None

    await eventually(resumed, WITHIN_S)


async def test_a_delivery_recovery_wakes_the_relay_alone_and_only_for_a_retry(
    app: App, slack: ScriptedChannel
) -> None:
    """A Confirm or Retry of a ``deliveryUnknown`` delivery gives the relay work (a
    retry's row due again; the card edits a confirm of a gating delivery queues), which
    those rows wake at commit, and no other runner any. It woke the revision dispatcher
    and the flow resumer as well, each to run a pass that found nothing. The retried
    post goes out at once, not at the poll."""
    org = await make_org(app)
    plain = await make_agent(app, org, "plain")
    for thread in ("1700000000.000100", "1700000000.000200"):
        await app.turns.run(slack_trigger(org, plain, "hello", thread))
    d = t.deliveries.c

    async def unknown() -> list[str]:
        async with app.db.read() as conn:
            query = sa.select(d.id).where(d.status == "deliveryUnknown").order_by(d.id)
            return [str(row.id) for row in (await conn.execute(query)).all()]

    async def both_unknown() -> bool:
        return len(await unknown()) == 2

    await eventually(both_unknown, WITHIN_S)
    confirmed, retried = await unknown()
    wakes = {loop.runner.name: loop.wake for loop in app.loops}

    async def woken_by(delivery_id: str, action: str) -> set[str]:
        # The loops are idle (all posted); what is set right after the recovery returns
        # was set by it (no loop ran in between to clear it).
        for wake in wakes.values():
            wake.clear()
        await app.reviews.recover(org.principal, delivery_id, action)
        return {name for name, wake in wakes.items() if wake.is_set()}

    assert await woken_by(confirmed, "confirm") == set()
    assert await woken_by(retried, "retry") == {"outbox-relay"}
    await eventually(lambda: len(slack.calls) == 3, WITHIN_S)
