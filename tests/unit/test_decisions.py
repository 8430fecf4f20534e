"""Human decisions (SPEC 5) through review/decisions.py on the real Service and database:
approve, reject, return, cancel, their text limits, their status rules and their audit."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from engine import schema as t
from engine import workitems
from engine.clock import DAY_MS, FakeClock, RandomIds, iso
from engine.config import Settings
from engine.db import upgrade
from engine.errors import TransitionError, ValidationError
from engine.runners import RevisionRunner, Sweeper, drain
from engine.service import Service
from engine.types import BindingKind, BindingSpec, Gated, Reply, Trigger
from review import decisions
from review.queue import detail
from tests.helpers import Org, api_trigger, make_agent, make_org
from tests.helpers import item_audit as audit_rows
from tests.helpers import item_deliveries as deliveries
from tests.helpers import item_row as row

SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
NON_TERMINAL = ["inProgress", "reviewQueued", "reviewing", "awaitingHuman", "approved"]
TERMINAL = ["completed", "rejected", "failed", "cancelled", "abandoned"]
_TEMPLATE: list[Path] = []


@pytest.fixture
def migrated_url(db_url: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """conftest's migrated database, but SQLite files are copies of one migrated template."""
    if not db_url.startswith("sqlite"):
        upgrade(db_url)
        return db_url
    if not _TEMPLATE:
        path = tmp_path_factory.mktemp("template") / "t.db"
        upgrade(f"sqlite+aiosqlite:///{path}")
        _TEMPLATE.append(path)
    shutil.copyfile(_TEMPLATE[0], db_url.removeprefix("sqlite+aiosqlite:///"))
    return db_url


@pytest.fixture
async def service(migrated_url: str) -> AsyncIterator[Service]:
    settings = Settings.model_validate({"database": {"url": migrated_url}})
    svc = Service(settings, clock=FakeClock(), enable_adapters=False)
    yield svc
    await svc.stop()


# --------------------------------------------------------------------------- helpers


async def setup(service: Service) -> tuple[Org, dict[str, Any]]:
    org = await make_org(service)
    await make_agent(service, org, "lead")
    return org, await make_agent(service, org, "worker", lead="lead")


async def run(service: Service, org: Org, worker: dict[str, Any], text: str, session: str) -> str:
    out = await service.turns.run(api_trigger(org, worker, text, session))
    assert isinstance(out, Gated | Reply)
    async with service.db.read() as conn:
        w = t.work_items.c
        item_id = await conn.scalar(
            sa.select(w.id)
            .select_from(t.work_items.join(t.sessions, t.sessions.c.id == w.session_id))
            .where(t.sessions.c.key == session)
            .order_by(w.created_at.desc())
        )
    assert item_id
    return str(item_id)


async def escalated(service: Service, org: Org, worker: dict[str, Any], session: str) -> str:
    item_id = await run(service, org, worker, "hard #escalate #complete", session)
    await drain(service.lead_runner)
    assert (await row(service, item_id))["status"] == "awaitingHuman"
    return item_id


async def items_in_every_status(
    service: Service, org: Org, worker: dict[str, Any]
) -> dict[str, str]:
    """One work item per status, each in its own session, made by the real code paths."""
    ids: dict[str, str] = {}
    ids["abandoned"] = await run(service, org, worker, "idle", "abandoned")
    assert isinstance(service.clock, FakeClock)
    service.clock.advance(7 * DAY_MS + 1)
    assert await drain(Sweeper(service.db, service.clock, service.ids)) == 1

    ids["awaitingHuman"] = await escalated(service, org, worker, "awaitingHuman")
    ids["rejected"] = await escalated(service, org, worker, "rejected")
    async with service.db.tx() as conn:
        item = await workitems.get(conn, ids["rejected"])
        await decisions.human_reject(conn, service.clock, service.ids, item, "user:x", "no")

    ids["completed"] = await run(service, org, worker, "done #complete", "completed")
    # A Slack binding with no Slack channel configured: the delivery fails permanently.
    out = await service.turns.run(
        Trigger(
            org_id=org.id,
            agent_id=worker["id"],
            session_key="failed",
            text="post it #complete",
            binding=BindingSpec(BindingKind.slack, {"team": "T1", "channel": "C1"}),
        )
    )
    assert isinstance(out, Gated) and out.work_item_id
    ids["failed"] = out.work_item_id
    await drain(service.lead_runner)
    await drain(service.relay)

    ids["approved"] = await run(service, org, worker, "ok #complete", "approved")
    await drain(service.lead_runner)

    ids["cancelled"] = await run(service, org, worker, "never mind", "cancelled")
    async with service.db.tx() as conn:
        item = await workitems.get(conn, ids["cancelled"])
        await decisions.cancel(conn, service.clock, service.ids, item, "user:x")

    ids["reviewing"] = await run(service, org, worker, "check #complete", "reviewing")
    assert (await service.lead_runner.claim() or {}).get("id") == ids["reviewing"]
    ids["reviewQueued"] = await run(service, org, worker, "queued #complete", "reviewQueued")
    ids["inProgress"] = await run(service, org, worker, "working on it", "inProgress")
    for status, item_id in ids.items():
        assert (await row(service, item_id))["status"] == status, status
    return ids


async def state(service: Service, item_id: str) -> tuple[Any, ...]:
    """Everything a decision could change."""
    return (
        await row(service, item_id),
        await deliveries(service, item_id),
        await audit_rows(service, item_id),
    )


async def decide(service: Service, item_id: str, action: str, text: Any = None) -> dict[str, Any]:
    async with service.db.tx() as conn:
        item = await workitems.get(conn, item_id)
        c, i = service.clock, service.ids
        if action == "approve":
            return await decisions.human_approve(conn, c, i, item, "user:alice")
        if action == "reject":
            return await decisions.human_reject(conn, c, i, item, "user:alice", text)
        if action == "return":
            return await decisions.human_return(conn, c, i, item, "user:alice", text)
        return await decisions.cancel(conn, c, i, item, "user:alice")


# --------------------------------------------------------------------------- approve


async def test_human_approve_writes_the_gating_delivery_in_the_same_transaction(
    service: Service,
) -> None:
    org, worker = await setup(service)
    item_id = await escalated(service, org, worker, "a")
    updated = await decide(service, item_id, "approve")
    assert updated["status"] == "approved"
    [dlv] = await deliveries(service, item_id)
    assert (dlv["kind"], dlv["action"], dlv["status"]) == ("gating", "reveal", "pending")
    assert dlv["text"] == "Echo: hard #escalate #complete"
    last = (await audit_rows(service, item_id))[-1]
    assert (last["actor"], last["action"], last["from_status"], last["to_status"]) == (
        "user:alice",
        "approve",
        "awaitingHuman",
        "approved",
    )
    await drain(service.relay)
    assert (await row(service, item_id))["status"] == "completed"

    # Atomicity: a delivery insert that fails rolls the approval back.
    other = await escalated(service, org, worker, "b")
    before = await state(service, other)

    class TakenIds:
        def __init__(self) -> None:
            self.ids = RandomIds()

        def new(self, prefix: str) -> str:
            return dlv["id"] if prefix == "dlv" else self.ids.new(prefix)

    with pytest.raises(IntegrityError):
        async with service.db.tx() as conn:
            item = await workitems.get(conn, other)
            await decisions.human_approve(conn, service.clock, TakenIds(), item, "user:alice")
    assert await state(service, other) == before


# ---------------------------------------------------------------------- text limits


@SQLITE_ONLY
async def test_reject_reason_must_be_1_to_2000_characters(service: Service) -> None:
    org, worker = await setup(service)
    item_id = await escalated(service, org, worker, "a")
    before = await state(service, item_id)
    for bad in (None, "", "   \n", 5, "x" * 2_001):
        with pytest.raises(ValidationError) as err:
            await decide(service, item_id, "reject", bad)
        assert err.value.status == 400
        assert err.value.rule == "decision.reason"
    assert await state(service, item_id) == before
    assert (await decide(service, item_id, "reject", "x" * 2_000))["status"] == "rejected"
    last = (await audit_rows(service, item_id))[-1]
    assert (last["action"], last["text"]) == ("reject", "x" * 2_000)
    other = await escalated(service, org, worker, "b")
    assert (await decide(service, other, "reject", "n"))["status"] == "rejected"
    assert await deliveries(service, other) == []


@SQLITE_ONLY
async def test_return_feedback_must_be_1_to_10000_characters(service: Service) -> None:
    org, worker = await setup(service)
    item_id = await escalated(service, org, worker, "a")
    before = await state(service, item_id)
    for bad in (None, "", " ", ["x"], "y" * 10_001):
        with pytest.raises(ValidationError) as err:
            await decide(service, item_id, "return", bad)
        assert err.value.rule == "decision.feedback"
    assert await state(service, item_id) == before

    feedback = "y" * 10_000
    updated = await decide(service, item_id, "return", feedback)
    assert (updated["status"], updated["revision"], updated["extra_allowance"]) == (
        "inProgress",
        1,
        1,
    )
    assert updated["pending_feedback"] == feedback
    last = (await audit_rows(service, item_id))[-1]
    assert (last["actor"], last["action"], last["text"]) == ("user:alice", "return", feedback)
    # Dispatched to the worker as an internal turn (exactly once).
    assert await drain(RevisionRunner(service.turns)) == 1
    item = await row(service, item_id)
    assert item["pending_feedback"] is None
    m = t.messages.c
    async with service.db.read() as conn:
        internal = (
            (
                await conn.execute(
                    sa.select(m.content).where(m.work_item_id == item_id, m.role == "internal")
                )
            )
            .scalars()
            .all()
        )
    assert internal == [feedback]

    other = await escalated(service, org, worker, "b")
    assert (await decide(service, other, "return", "z"))["pending_feedback"] == "z"
    assert await drain(RevisionRunner(service.turns)) == 1
    item = await row(service, other)
    assert (item["status"], item["snapshot"]) == ("reviewQueued", "Revised: z")


# ------------------------------------------------------------------- status rules


async def test_decisions_need_awaiting_human_and_cancel_needs_a_live_item(
    service: Service,
) -> None:
    org, worker = await setup(service)
    ids = await items_in_every_status(service, org, worker)
    for status, item_id in ids.items():
        before = await state(service, item_id)
        for action, text in (("approve", None), ("reject", "no"), ("return", "again")):
            if status == "awaitingHuman":
                continue
            with pytest.raises(TransitionError) as err:
                await decide(service, item_id, action, text)
            assert err.value.status == 409, (status, action)
            assert await state(service, item_id) == before, (status, action)
        if status in TERMINAL:
            with pytest.raises(TransitionError):
                await decide(service, item_id, "cancel")
            assert await state(service, item_id) == before, status

    # Cancel works from every non-terminal status and cancels unsent deliveries.
    assert (await deliveries(service, ids["approved"]))[0]["status"] == "pending"
    for status in NON_TERMINAL:
        item_id = ids[status]
        updated = await decide(service, item_id, "cancel")
        assert updated["status"] == "cancelled"
        assert updated["lease_token"] is None and updated["lease_expires_at"] is None
        last = (await audit_rows(service, item_id))[-1]
        assert (last["actor"], last["action"], last["from_status"], last["to_status"]) == (
            "user:alice",
            "cancel",
            status,
            "cancelled",
        )
    assert [d["status"] for d in await deliveries(service, ids["approved"])] == ["cancelled"]
    # Nothing is delivered or reviewed afterwards, and the sessions take new work.
    assert await drain(service.relay) == 0
    assert await drain(service.lead_runner) == 0
    assert (await row(service, ids["approved"]))["status"] == "cancelled"
    out = await service.turns.run(api_trigger(org, worker, "fresh start", "approved"))
    assert out == Reply("Echo: fresh start")


@SQLITE_ONLY
async def test_cancel_while_reviewing_drops_the_lead_verdict(service: Service) -> None:
    org, worker = await setup(service)
    item_id = await run(service, org, worker, "job #complete", "a")
    claimed = await service.lead_runner.claim()
    assert claimed is not None
    await decide(service, item_id, "cancel")
    await service.lead_runner.review(claimed)
    assert (await row(service, item_id))["status"] == "cancelled"
    assert await deliveries(service, item_id) == []


@SQLITE_ONLY
async def test_every_decision_is_audited_and_shown_in_the_detail(service: Service) -> None:
    org, worker = await setup(service)
    assert isinstance(service.clock, FakeClock)
    item_id = await escalated(service, org, worker, "a")
    service.clock.advance(1_000)
    await decide(service, item_id, "return", "Shorter, please.")
    await drain(RevisionRunner(service.turns))
    await drain(service.lead_runner)  # the task context still says #escalate
    assert (await row(service, item_id))["status"] == "awaitingHuman"
    service.clock.advance(1_000)
    await decide(service, item_id, "reject", "Out of scope.")
    async with service.db.read() as conn:
        body = await detail(conn, org.id, item_id)
    human = [a for a in body["audit"] if a["actor"] == "user:alice"]
    assert [(a["action"], a["text"], a["from"], a["to"]) for a in human] == [
        ("return", "Shorter, please.", "awaitingHuman", "inProgress"),
        ("reject", "Out of scope.", "awaitingHuman", "rejected"),
    ]
    start = 1_780_000_000_000
    assert human[0]["at"] == iso(start + 1_000)
    assert human[1]["at"] == iso(start + 2_000)
    assert body["audit"][0]["action"] == "create"
    assert body["status"] == "rejected"
