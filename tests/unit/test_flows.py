"""ActionFlows (SPEC 9) on the real engine, both backends."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import sqlalchemy as sa

from leadgate.core.config import ReviewSettings
from leadgate.core.errors import TransitionError, ValidationError
from leadgate.core.runners import drain
from leadgate.core.types import Outcome, Trigger
from leadgate.database import schema as t
from leadgate.database import sql
from leadgate.database.db import Conn
from leadgate.domain import agents as agents_mod
from leadgate.domain import orgs, workitems
from leadgate.domain.rows import WorkItem
from leadgate.flows import runs as runs_mod
from leadgate.flows.recovery import FlowRecovery
from leadgate.flows.runs import (
    FLOW_FAILED_ACTION,
    FLOW_RUN_FAILED_RULE,
    PAUSED_OUTPUT,
    WAITING_EVENT,
    FlowResumer,
    RunLease,
    RunView,
    create_flow,
    find_flow,
    run_view,
)
from leadgate.review.cards import ReviewNotifier
from leadgate.review.decisions import decide, human_approve
from tests.helpers import blocked_on_a_lock, held_open, make_agent, make_org


async def _flow(stack: Any, org: Any, nodes: list[dict[str, Any]]) -> str:
    async with stack.db.tx() as conn:
        flow = await create_flow(conn, stack.clock, stack.ids, org.id, "f", nodes)
    return str(flow["id"])


async def _view(stack: Any, org: Any, run_id: str | None) -> RunView:
    # A run id read from a view (a continuation's resumedRunId) is typed optional.
    assert run_id is not None
    async with stack.db.read() as conn:
        return await run_view(conn, org.id, run_id)


async def test_agent_without_lead_runs_through(stack: Any) -> None:
    org = await make_org(stack)
    await make_agent(stack, org, "plain")
    flow_id = await _flow(
        stack,
        org,
        [{"type": "agent", "agent": "plain", "prompt": "hi"}, {"type": "output", "value": 1}],
    )
    run = await _view(stack, org, await stack.flows.start(org.id, flow_id))
    assert run["status"] == "completed"
    assert run["outputs"] == [
        {"data": {"text": "Echo: hi"}, "success": True},
        {"data": 1, "success": True},
    ]


async def test_lead_node_pauses_then_resumes_in_a_new_run(stack: Any) -> None:
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    await make_agent(stack, org, "worker", lead="lead")
    flow_id = await _flow(
        stack,
        org,
        [
            {"type": "output", "value": "before"},
            {"type": "agent", "agent": "worker", "prompt": "write it #complete #escalate"},
            {"type": "output", "value": "after"},
        ],
    )
    run_id = await stack.flows.start(org.id, flow_id)
    paused = await _view(stack, org, run_id)
    assert paused["status"] == "waitingForHitl"
    assert paused["outputs"][1] == PAUSED_OUTPUT == {"data": {}, "success": True}
    assert WAITING_EVENT in paused["events"]
    # No HITL request: the only human path is the work item itself.
    await drain(stack.lead_runner)
    cont = paused["continuations"][0]
    assert cont["status"] == "waiting"
    async with stack.db.read() as conn:
        item_id = await conn.scalar(
            sa.select(t.continuations.c.work_item_id).where(t.continuations.c.id == cont["id"])
        )
    # The relay never delivers a continuation.
    async with stack.db.tx() as conn:
        item = await workitems.get(conn, str(item_id))
        assert item.status == "awaitingHuman"
        await human_approve(conn, stack.outbox, item, "user:test")
    assert not await drain(stack.relay)
    async with stack.db.read() as conn:
        statuses = (
            (
                await conn.execute(
                    sa.select(t.deliveries.c.status).where(t.deliveries.c.work_item_id == item_id)
                )
            )
            .scalars()
            .all()
        )
    assert statuses == ["continuation"]
    assert await drain(FlowResumer(stack.flows)) == 1
    old = await _view(stack, org, run_id)
    assert old["status"] == "waitingForHitl"  # the paused run is history; a new run resumed
    new_id = old["continuations"][0]["resumedRunId"]
    assert old["continuations"][0]["summary"] == "Summary: write it #escalate"
    new = await _view(stack, org, new_id)
    assert new["status"] == "completed"
    assert new["resumedFrom"] == run_id
    # Continues after the agent node; the summary is not copied into the node output.
    assert new["outputs"] == [
        {"data": "before", "success": True},
        {"data": {}, "success": True},
        {"data": "after", "success": True},
    ]
    async with stack.db.read() as conn:
        assert (await workitems.get(conn, str(item_id))).status == "completed"
    assert await drain(FlowResumer(stack.flows)) == 0


async def _paused_item(stack: Any, org: Any, prompt: str) -> tuple[str, str]:
    """A flow paused on a lead-reviewed node: (run id, its work item id)."""
    await make_agent(stack, org, "lead")
    await make_agent(stack, org, "worker", lead="lead")
    flow_id = await _flow(
        stack,
        org,
        [{"type": "agent", "agent": "worker", "prompt": prompt}, {"type": "output", "value": 2}],
    )
    run_id = await stack.flows.start(org.id, flow_id)
    async with stack.db.read() as conn:
        item_id = await conn.scalar(
            sa.select(t.continuations.c.work_item_id).where(t.continuations.c.run_id == run_id)
        )
    return run_id, str(item_id)


async def test_an_item_the_continuation_never_named_still_resumes_its_flow(stack: Any) -> None:
    # The continuation learns its item after the turn, in a transaction of its own: a
    # crash in between left the approved item stuck, in no queue.
    org = await make_org(stack)
    run_id, item_id = await _paused_item(stack, org, "write it #complete #escalate")
    async with stack.db.tx() as conn:
        await conn.execute(t.continuations.update().values(work_item_id=None))
    await drain(stack.lead_runner)
    async with stack.db.tx() as conn:
        await human_approve(conn, stack.outbox, await workitems.get(conn, item_id), "user:t")
    assert await drain(FlowResumer(stack.flows)) == 1
    [cont] = (await _view(stack, org, run_id))["continuations"]
    assert cont["status"] == "resumed"
    assert (await _view(stack, org, cont["resumedRunId"]))["status"] == "completed"
    async with stack.db.read() as conn:
        assert (await workitems.get(conn, item_id)).status == "completed"


async def test_a_run_whose_item_ends_without_approval_fails_saying_why(stack: Any) -> None:
    org = await make_org(stack)
    run_id, item_id = await _paused_item(stack, org, "write it #complete #escalate")
    await drain(stack.lead_runner)
    async with stack.db.tx() as conn:
        await workitems.transition(
            conn,
            stack.clock,
            stack.ids,
            item_id,
            src=workitems.Status.awaitingHuman,
            dst=workitems.Status.rejected,
            actor="user:t",
            action="reject",
            text="no",
        )
    assert await drain(FlowResumer(stack.flows)) == 1
    run = await _view(stack, org, run_id)
    assert run["status"] == "failed"
    assert run["error"] == f"node 0: the work item {item_id} was rejected"
    assert f"Flow run failed: node 0: the work item {item_id} was rejected" in run["events"]
    assert run["continuations"][0]["status"] == "closed"
    assert await drain(FlowResumer(stack.flows)) == 0


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_run_failing_and_the_resumer_lock_its_continuation_then_the_run(
    stack: Any,
) -> None:
    """The resumer takes a continuation (its pick) and then the run (a paused run whose
    item ended fails). A run's failure took its run and then its waiting continuations:
    the two transactions met in opposite orders and PostgreSQL ended one of them (40P01).
    The failure now locks the continuations first: it waits holding nothing, the
    resumer fails the run, and the failure then finds it failed (nothing changed)."""
    org = await make_org(stack)
    run_id, item_id = await _paused_item(stack, org, "write it #complete #escalate")
    await drain(stack.lead_runner)
    async with stack.db.tx() as conn:
        await workitems.transition(
            conn, stack.clock, stack.ids, item_id, src=workitems.Status.awaitingHuman,
            dst=workitems.Status.rejected, actor="user:t", action="reject", text="no",
        )  # fmt: skip
    holding, go = asyncio.Event(), asyncio.Event()
    bound = sql.bound_lock_waits

    async def held_after_the_pick(conn: Conn, seconds: float) -> None:
        # The resumer's pick holds the continuation here, before its moves.
        holding.set()
        await go.wait()
        await bound(conn, seconds)

    async def fail() -> None:
        async with stack.db.tx() as conn:
            await runs_mod.move_run(
                conn, stack.clock, stack.ids, run_id, src=runs_mod.RunStatus.waitingForHitl,
                dst=runs_mod.RunStatus.failed, values={"error": "another failure"},
            )  # fmt: skip

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runs_mod, "bound_lock_waits", held_after_the_pick)
        resuming = asyncio.create_task(FlowResumer(stack.flows, lock_wait_s=30.0).run_once())
        await asyncio.wait_for(holding.wait(), 10.0)
        failing = asyncio.create_task(fail())
        await blocked_on_a_lock(stack.db, failing)
        go.set()
        assert await resuming
    with pytest.raises(TransitionError) as lost:
        await failing
    assert lost.value.rule == "flowRun.status"
    run = await _view(stack, org, run_id)
    assert run["status"] == "failed"
    assert run["error"] == f"node 0: the work item {item_id} was rejected"
    assert run["continuations"][0]["status"] == "closed"


@pytest.mark.parametrize(
    "nodes",
    [[], [{"type": "nope"}], [{"type": "agent", "prompt": "x"}], [{"type": "output"}], "x"],
)
async def test_bad_flows_are_rejected(stack: Any, nodes: Any) -> None:
    org = await make_org(stack)
    with pytest.raises(ValidationError):
        await _flow(stack, org, nodes)


@pytest.mark.parametrize(
    ("node", "rule"),
    [
        # Every run copies its outputs and rewrites them after each agent node: a value
        # of any size was stored, and so was any key no node has.
        ({"type": "output", "value": "x" * 99_999}, "flow.node_value"),
        ({"type": "output", "value": ["é" * 50_000] * 2}, "flow.node_value"),
        ({"type": "output", "value": 1, "payload": "x"}, "flow.node_key"),
        ({"type": "agent", "agent": "a", "prompt": "x", "promt": "y"}, "flow.node_key"),
    ],
)
async def test_a_node_is_bounded_and_has_only_its_own_keys(
    stack: Any, node: dict[str, Any], rule: str
) -> None:
    org = await make_org(stack)
    await make_agent(stack, org, "a")
    with pytest.raises(ValidationError) as info:
        await _flow(stack, org, [node])
    assert info.value.rule == rule
    # At the bound, as JSON: accepted.
    await _flow(stack, org, [{"type": "output", "value": "x" * 99_998}])


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("", "flow.name"),
        ("tab\there", "flow.name"),
        ("x" * 201, "flow.name"),
        ("FLW_1", "flow.name"),
    ],
)
async def test_a_flow_name_is_checked_like_every_other_name(
    stack: Any, name: str, rule: str
) -> None:
    org = await make_org(stack)
    nodes = [{"type": "output", "value": 1}]
    with pytest.raises(ValidationError) as info:
        async with stack.db.tx() as conn:
            await create_flow(conn, stack.clock, stack.ids, org.id, name, nodes)
    assert info.value.rule == rule
    async with stack.db.tx() as conn:
        flow = await create_flow(conn, stack.clock, stack.ids, org.id, " ok ", nodes)
    assert flow["name"] == "ok"


async def test_an_id_names_its_flow_and_its_organization_before_any_name(stack: Any) -> None:
    org = await make_org(stack)
    nodes = [{"type": "output", "value": 1}]
    async with stack.db.tx() as conn:
        first = await create_flow(conn, stack.clock, stack.ids, org.id, "first", nodes)
        second = await create_flow(conn, stack.clock, stack.ids, org.id, "second", nodes)
        # Saved before names were checked: a name that is the other's id.
        await conn.execute(
            t.flows.update().where(t.flows.c.id == second["id"]).values(name=first["id"])
        )
        other = await orgs.create_org(conn, stack.clock, stack.ids, "other")
        await conn.execute(
            t.organizations.update().where(t.organizations.c.id == other["id"]).values(name=org.id)
        )
    async with stack.db.read() as conn:
        assert (await find_flow(conn, org.id, first["id"]))["id"] == first["id"]
        assert (await orgs.find_org(conn, org.id))["id"] == org.id
    with pytest.raises(ValidationError) as info:
        async with stack.db.tx() as conn:
            await orgs.create_org(conn, stack.clock, stack.ids, "org_lookalike")
    assert info.value.rule == "organization.name"


async def test_a_node_whose_agent_is_inactive_fails_the_run_in_one_line(
    stack: Any, caplog: pytest.LogCaptureFixture
) -> None:
    org = await make_org(stack)
    agent = await make_agent(stack, org, "idle")
    flow_id = await _flow(stack, org, [{"type": "agent", "agent": "idle", "prompt": "hi"}])
    async with stack.db.tx() as conn:
        await conn.execute(
            t.agents.update().where(t.agents.c.id == agent["id"]).values(active=False)
        )
    run = await _view(stack, org, await stack.flows.start(org.id, flow_id))
    assert (run["status"], run["error"]) == ("failed", "node 0: agent 'idle' is inactive")
    assert "Traceback" not in caplog.text and "[agent.inactive]" in caplog.text
    # A flow made of it now is refused (every run would fail), as a schedule of it is.
    with pytest.raises(ValidationError) as refused:
        async with stack.db.tx() as conn:
            await create_flow(
                conn,
                stack.clock,
                stack.ids,
                org.id,
                "again",
                [
                    {"type": "output", "value": 1},
                    {"type": "agent", "agent": "idle", "prompt": "hi"},
                ],
            )
    assert (refused.value.rule, refused.value.message) == (
        "agent.inactive",
        "node 1: agent 'idle' is inactive",
    )


async def test_a_lead_reviewed_node_whose_worker_is_inactive_leaves_no_waiting_continuation(
    stack: Any,
) -> None:
    # Its continuation was registered before the turn refused the inactive worker: the
    # failed run showed one still waiting for a review that could never come.
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")
    flow_id = await _flow(
        stack, org, [{"type": "agent", "agent": "worker", "prompt": "draft #complete"}]
    )
    async with stack.db.tx() as conn:
        await conn.execute(
            t.agents.update().where(t.agents.c.id == worker["id"]).values(active=False)
        )
    run = await _view(stack, org, await stack.flows.start(org.id, flow_id))
    assert (run["status"], run["error"]) == ("failed", "node 0: agent 'worker' is inactive")
    assert [c["status"] for c in run["continuations"]] in ([], ["closed"])
    assert await drain(FlowResumer(stack.flows)) == 0


async def test_a_lead_reviewed_node_whose_turn_breaks_closes_its_continuation(
    stack: Any,
) -> None:
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    await make_agent(stack, org, "worker", lead="lead")
    flow_id = await _flow(
        stack,
        org,
        [
            {"type": "agent", "agent": "worker", "prompt": "draft #fail"},
            {"type": "output", "value": 1},
        ],
    )
    run = await _view(stack, org, await stack.flows.start(org.id, flow_id))
    assert run["status"] == "failed"
    assert [c["status"] for c in run["continuations"]] == ["closed"]


async def _node_item(stack: Any, run_id: str) -> WorkItem:
    """The work item of run ``run_id``'s first node's turn (its session's)."""
    async with stack.db.read() as conn:
        item_id = await conn.scalar(
            sa.select(t.work_items.c.id)
            .select_from(
                t.work_items.join(t.sessions, t.work_items.c.session_id == t.sessions.c.id)
            )
            .where(t.sessions.c.key == f"flow:{run_id}:0")
        )
        return await workitems.get(conn, str(item_id))


async def _audit_of(stack: Any, item_id: str) -> list[tuple[str, str, str, str | None]]:
    a = t.audit.c
    async with stack.db.read() as conn:
        rows = await conn.execute(
            sa.select(a.actor, a.action, a.to_status, a.text)
            .where(a.work_item_id == item_id)
            .order_by(a.created_at, a.id)
        )
        return [(r.actor, r.action, r.to_status, r.text) for r in rows]


async def _deliveries_of(stack: Any, item_id: str) -> list[str]:
    d = t.deliveries.c
    async with stack.db.read() as conn:
        rows = await conn.execute(sa.select(d.status).where(d.work_item_id == item_id))
        return sorted(rows.scalars())


async def _episodes_of(stack: Any, item_id: str) -> list[str | None]:
    """The outcomes of ``item_id``'s review episodes (None: still open)."""
    e = t.review_episodes.c
    async with stack.db.read() as conn:
        rows = await conn.execute(sa.select(e.outcome).where(e.work_item_id == item_id))
        return list(rows.scalars())


async def test_a_lead_reviewed_node_whose_model_fails_ends_its_work_item(stack: Any) -> None:
    # The model failed, the turn's run closed, the flow run failed: its node's item was
    # left inProgress, decided by nobody, shown open until the sweeper's week was up.
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    await make_agent(stack, org, "worker", lead="lead")
    flow_id = await _flow(
        stack, org, [{"type": "agent", "agent": "worker", "prompt": "draft #complete #fail"}]
    )
    run = await _view(stack, org, await stack.flows.start(org.id, flow_id))
    assert run["status"] == "failed"
    error = run["error"]
    assert error is not None and error.startswith("node 0: ")
    item = await _node_item(stack, run["id"])
    assert item.status == "cancelled"
    assert (await _audit_of(stack, item.id))[-1] == (
        "system:flow",
        FLOW_FAILED_ACTION,
        "cancelled",
        f"{FLOW_RUN_FAILED_RULE}: flow run {run['id']} failed: {error}",
    )
    assert await _deliveries_of(stack, item.id) == []
    # Nothing is left for the lead, the sweeper, the resumer or the relay.
    await stack.settle(relay=True)
    stack.clock.advance(workitems.ABANDON_AFTER_MS + 1)
    assert await drain(workitems.Sweeper(stack.db, stack.clock, stack.ids)) == 0
    assert await drain(FlowResumer(stack.flows)) == 0
    assert (await _node_item(stack, run["id"])).status == "cancelled"


async def _running_on_a_decided_item(stack: Any, org: Any) -> tuple[RunLease, str]:
    """A run whose lead-reviewed node's item waits for a person, left ``running`` (its
    process died after the turn, before the pause was written) under a lease: the lease
    and the item's id."""
    # The item's wait for a person opens a review episode, as the service's does.
    notifier = ReviewNotifier(
        stack.clock, stack.ids, stack.outbox, public_url="http://x", defaults=ReviewSettings()
    )
    stack.outbox.on_review_needed(notifier.open)
    run_id, item_id = await _paused_item(stack, org, "write it #complete #escalate")
    await drain(stack.lead_runner)
    assert await _episodes_of(stack, item_id) == [None]
    lease = RunLease(run_id, "lease_dead_executor")
    async with stack.db.tx() as conn:
        await conn.execute(
            t.flow_runs.update()
            .where(t.flow_runs.c.id == run_id)
            .values(
                status="running",
                outputs=[],
                lease_token=lease.token,
                lease_expires_at=stack.clock.now_ms(),
            )
        )
        assert (await workitems.get(conn, item_id)).status == "awaitingHuman"
    return lease, item_id


async def test_an_approval_just_before_the_run_fails_loses_to_it(stack: Any) -> None:
    # The approval commits while the run's failure waits for the item (PostgreSQL: its
    # row lock; SQLite: the one writer): the failure reads it approved and cancels it,
    # its continuation delivery with it. Nothing resumes, nothing is posted.
    org = await make_org(stack)
    lease, item_id = await _running_on_a_decided_item(stack, org)

    async def approve(conn: Conn) -> None:
        item = await workitems.get(conn, item_id)
        await decide(conn, stack.outbox, item, "approve", "user:t")

    async with held_open(stack.db, approve):
        failing = asyncio.create_task(FlowRecovery(stack.flows).give_up(lease, 3, "it broke"))
        await blocked_on_a_lock(stack.db, failing)
    await failing
    async with stack.db.read() as conn:
        assert (await workitems.get(conn, item_id)).status == "cancelled"
    assert [row[1:3] for row in (await _audit_of(stack, item_id))[-2:]] == [
        ("approve", "approved"),
        (FLOW_FAILED_ACTION, "cancelled"),
    ]
    assert await _deliveries_of(stack, item_id) == ["cancelled"]
    assert await _episodes_of(stack, item_id) == ["Approved"]
    assert await drain(FlowResumer(stack.flows)) == 0
    assert not await drain(stack.relay)
    run = await _view(stack, org, lease.run_id)
    assert run["status"] == "failed"
    assert [c["status"] for c in run["continuations"]] == ["closed"]


async def test_an_approval_just_after_the_run_failed_is_refused(stack: Any) -> None:
    org = await make_org(stack)
    lease, item_id = await _running_on_a_decided_item(stack, org)
    await FlowRecovery(stack.flows).give_up(lease, 3, "it broke")
    async with stack.db.tx() as conn:
        item = await workitems.get(conn, item_id)
        assert item.status == "cancelled"
        with pytest.raises(TransitionError) as refused:
            await human_approve(conn, stack.outbox, item, "user:t")
    assert refused.value.rule == "workItem.status"
    assert f"{FLOW_FAILED_ACTION} by system:flow" in refused.value.message
    # Its review episode closed with it: the SLA runner reminds nobody of it.
    assert await _episodes_of(stack, item_id) == ["Cancelled"]
    assert await _deliveries_of(stack, item_id) == []
    assert await drain(FlowResumer(stack.flows)) == 0
    assert not await drain(stack.relay)


def _lead_changes_before_the_turn(
    stack: Any, mp: pytest.MonkeyPatch, org: Any, worker: dict[str, Any], lead: str | None
) -> None:
    """The worker's lead becomes ``lead`` after the node read it, before its turn's
    intake resolves it (a save landing while the node runs)."""
    run: Callable[[Trigger], Awaitable[Outcome]] = stack.turns.run

    async def changed_then_run(trigger: Trigger) -> Outcome:
        async with stack.db.tx() as conn:
            await agents_mod.save_agent(
                conn, stack.clock, stack.ids, org.id, agent_ref=worker["id"], lead=lead
            )
        return await run(trigger)

    mp.setattr(stack.turns, "run", changed_then_run)


async def test_a_plain_node_whose_turn_came_back_gated_pauses_and_resumes(stack: Any) -> None:
    # It failed the run with flow.agent_busy, and the item, once approved, left its
    # continuation delivery open for ever.
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker")
    flow_id = await _flow(
        stack,
        org,
        [
            {"type": "agent", "agent": "worker", "prompt": "draft #complete"},
            {"type": "output", "value": "after"},
        ],
    )
    with pytest.MonkeyPatch.context() as mp:
        _lead_changes_before_the_turn(stack, mp, org, worker, "lead")
        run_id = await stack.flows.start(org.id, flow_id)
    paused = await _view(stack, org, run_id)
    assert (paused["status"], paused["error"]) == ("waitingForHitl", None)
    await stack.settle()  # the lead approves
    assert await drain(FlowResumer(stack.flows)) == 1
    old = await _view(stack, org, run_id)
    resumed = await _view(stack, org, old["continuations"][0]["resumedRunId"])
    assert resumed["status"] == "completed"
    assert resumed["outputs"][-1] == {"data": "after", "success": True}
    async with stack.db.read() as conn:
        statuses = (await conn.execute(sa.select(t.deliveries.c.status))).scalars().all()
    assert "continuation" not in statuses


async def test_a_lead_node_whose_lead_was_removed_mid_turn_goes_on(stack: Any) -> None:
    # The run paused on a continuation with no work item, which nothing resumed or swept.
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")
    flow_id = await _flow(
        stack,
        org,
        [
            {"type": "agent", "agent": "worker", "prompt": "draft #complete"},
            {"type": "output", "value": "after"},
        ],
    )
    with pytest.MonkeyPatch.context() as mp:
        _lead_changes_before_the_turn(stack, mp, org, worker, None)
        run = await _view(stack, org, await stack.flows.start(org.id, flow_id))
    assert run["status"] == "completed"
    assert run["outputs"] == [
        {"data": {"text": "Echo: draft #complete"}, "success": True},
        {"data": "after", "success": True},
    ]
    assert [c["status"] for c in run["continuations"]] == ["closed"]
