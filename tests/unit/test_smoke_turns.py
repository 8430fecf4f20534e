from __future__ import annotations

from leadgate.core.runners import drain
from leadgate.core.types import Busy, Gated, Reply
from tests.helpers import api_trigger, make_agent, make_org


async def test_gated_turn_is_reviewed_and_revealed(stack) -> None:  # type: ignore[no-untyped-def]
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")
    out = await stack.turns.run(api_trigger(org, worker, "write it #complete"))
    assert isinstance(out, Gated)
    busy = await stack.turns.run(api_trigger(org, worker, "more"))
    assert isinstance(busy, Busy)
    await drain(stack.lead_runner)
    await drain(stack.relay)
    async with stack.db.read() as conn:
        from leadgate.review.queue import detail

        body = await detail(conn, org.id, str(out.work_item_id))
    assert body["status"] == "completed"
    assert body["deliveries"][0]["action"] == "reveal"
    again = await stack.turns.run(api_trigger(org, worker, "next"))
    assert again == Reply("Echo: next")
