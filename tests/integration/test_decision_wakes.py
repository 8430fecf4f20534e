"""A person's decision wakes the runner it gave work to at its commit
(``leadgate.domain.wakes``): a returned item's revision and an approved flow
continuation start at once, though the runner loops poll only every 30 s here. (That
other decisions wake neither runner is what the code says; nothing here could see a
wasted pass. Across replicas: ``test_runner_wakes.py``.)"""

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
from tests.helpers import Org, api_trigger, eventually, item_row, make_agent, make_org

#: Well under the poll: only the decision's wake can make the runner act this soon.
WITHIN_S = 10.0


@pytest.fixture
async def app(migrated_url: str) -> AsyncIterator[App]:
    settings = Settings.model_validate(
        {"database": {"url": migrated_url}, "runners": {"poll_interval_s": 30}}
    )
    service = App(settings, clock=FakeClock(), enable_adapters=False)
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
