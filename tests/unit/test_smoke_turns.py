from __future__ import annotations

from engine.runners import drain
from engine.types import Busy, Gated, Reply
from tests.helpers import api_trigger, make_agent, make_org


async def test_gated_turn_is_reviewed_and_revealed(service) -> None:  # type: ignore[no-untyped-def]
    org = await make_org(service)
    await make_agent(service, org, "lead")
    worker = await make_agent(service, org, "worker", lead="lead")
    out = await service.turns.run(api_trigger(org, worker, "write it #complete"))
    assert isinstance(out, Gated)
    busy = await service.turns.run(api_trigger(org, worker, "more"))
    assert isinstance(busy, Busy)
    await drain(service.lead_runner)
    await drain(service.relay)
    async with service.db.read() as conn:
        from review.queue import detail

        body = await detail(conn, org.id, str(out.work_item_id))
    assert body["status"] == "completed"
    assert body["deliveries"][0]["action"] == "reveal"
    again = await service.turns.run(api_trigger(org, worker, "next"))
    assert again == Reply("Echo: next")
