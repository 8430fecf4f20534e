"""Flow definitions, runs, and the resume-after-approval runner.

A flow is an ordered list of nodes:

* ``{"type": "agent", "agent": "<name or id>", "prompt": "..."}`` — an Action Agent node;
* ``{"type": "output", "value": <any JSON>}`` — records a literal value (useful as a last
  step and in tests).

An Action Agent node whose worker has a resolved lead registers a continuation,
dispatches the prompt on the shared turn path (binding kind ``flow``), stores the node
output ``{"data": {}, "success": true}``, sets the run to ``waitingForHitl`` and records
the event ``Flow run is waiting for Lead review``. No HITL request is created. The outbox
never delivers such an approval; :class:`FlowResumer` starts a **new** run from the pause
snapshot, continuing after the agent node. The approved summary stays on the
continuation row; it is not copied into the node output.
"""

from __future__ import annotations

import logging
from typing import Any

import sqlalchemy as sa

from binding.bindings import find_session
from leadgate.core.clock import Clock, IdFactory, iso
from leadgate.core.errors import (
    Conflict,
    LeadgateError,
    NotFound,
    TransitionError,
    ValidationError,
)
from leadgate.core.limits import validate_message
from leadgate.core.types import BindingKind, BindingSpec, Gated, Reply, Trigger
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database
from leadgate.domain import agents as agents_mod
from leadgate.domain import workitems
from leadgate.domain.orgs import validate_name
from leadgate.domain.workitems import Status
from leadgate.turns.path import TurnService

log = logging.getLogger("leadgate.flows")

WAITING_EVENT = "Flow run is waiting for Lead review"
PAUSED_OUTPUT: dict[str, Any] = {"data": {}, "success": True}
MAX_NODES = 100
R = t.flow_runs.c
C = t.continuations.c


def validate_nodes(nodes: Any) -> list[dict[str, Any]]:
    """Check a flow definition (a non-empty list of known nodes)."""
    if not isinstance(nodes, list) or not nodes or len(nodes) > MAX_NODES:
        raise ValidationError(f"a flow is a list of 1..{MAX_NODES} nodes", rule="flow.nodes")
    for index, node in enumerate(nodes):
        if not isinstance(node, dict) or node.get("type") not in ("agent", "output"):
            raise ValidationError(
                f"node {index}: type must be agent or output", rule="flow.node_type"
            )
        if node["type"] == "agent":
            if not isinstance(node.get("agent"), str) or not node["agent"]:
                raise ValidationError(f"node {index}: agent is required", rule="flow.node_agent")
            if not isinstance(node.get("prompt"), str):
                raise ValidationError(f"node {index}: prompt is required", rule="flow.node_prompt")
            validate_message(node["prompt"])
        elif "value" not in node:
            raise ValidationError(f"node {index}: value is required", rule="flow.node_value")
    return nodes


async def create_flow(
    conn: Conn, clock: Clock, ids: IdFactory, org_id: str, name: str, nodes: Any
) -> dict[str, Any]:
    """Store a flow after checking its name (rule ``flow.name``), its nodes and that every
    agent exists."""
    name = validate_name(name, "flow", id_prefix="flw")
    nodes = validate_nodes(nodes)
    for node in nodes:
        if node["type"] == "agent":
            await agents_mod.find_agent(conn, org_id, node["agent"])
    if await conn.scalar(
        sa.select(t.flows.c.id).where(t.flows.c.org_id == org_id, t.flows.c.name == name)
    ):
        raise Conflict(f"a flow named {name!r} already exists", rule="flow.name_taken")
    flow_id = ids.new("flw")
    await conn.execute(
        t.flows.insert().values(
            id=flow_id, org_id=org_id, name=name, nodes=nodes, created_at=clock.now_ms()
        )
    )
    return {"id": flow_id, "name": name, "nodes": nodes}


async def find_flow(conn: Conn, org_id: str, ref: str) -> dict[str, Any]:
    """A flow of the organization by id or name."""
    row = (
        await conn.execute(
            sa.select(t.flows)
            .where(t.flows.c.org_id == org_id, sa.or_(t.flows.c.id == ref, t.flows.c.name == ref))
            .order_by(sa.case((t.flows.c.id == ref, 0), else_=1))
        )
    ).first()
    if row is None:
        raise NotFound(f"no flow {ref!r}", rule="flow.not_found")
    return dict(row._mapping)


async def run_view(conn: Conn, org_id: str, run_id: str) -> dict[str, Any]:
    """A run with its events and continuations (for the CLI and tests)."""
    row = (
        await conn.execute(sa.select(t.flow_runs).where(R.id == run_id, R.org_id == org_id))
    ).first()
    if row is None:
        raise NotFound(f"no flow run {run_id}", rule="flowRun.not_found")
    events = (
        await conn.execute(
            sa.select(t.flow_run_events.c.text, t.flow_run_events.c.created_at)
            .where(t.flow_run_events.c.run_id == run_id)
            .order_by(t.flow_run_events.c.created_at, t.flow_run_events.c.id)
        )
    ).all()
    conts = (await conn.execute(sa.select(t.continuations).where(C.run_id == run_id))).all()
    return {
        "id": row.id,
        "flowId": row.flow_id,
        "status": row.status,
        "outputs": row.outputs,
        "startIndex": row.start_index,
        "resumedFrom": row.resumed_from,
        "error": row.error,
        "createdAt": iso(row.created_at),
        "events": [e.text for e in events],
        "continuations": [
            {
                "id": c.id,
                "nodeIndex": c.node_index,
                "status": c.status,
                "summary": c.summary,
                "resumedRunId": c.resumed_run_id,
            }
            for c in conts
        ],
    }


class FlowService:
    """Starts, executes and resumes flow runs."""

    def __init__(self, db: Database, clock: Clock, ids: IdFactory, turns: TurnService) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.turns = turns

    async def _event(self, conn: Conn, run_id: str, text: str) -> None:
        await conn.execute(
            t.flow_run_events.insert().values(
                id=self.ids.new("fre"), run_id=run_id, text=text, created_at=self.clock.now_ms()
            )
        )

    async def start(self, org_id: str, flow_ref: str) -> str:
        """Start a new run of a flow and execute it until it pauses or ends."""
        async with self.db.tx() as conn:
            flow = await find_flow(conn, org_id, flow_ref)
            run_id = await self.new_run(conn, org_id, flow["id"], [], 0, None)
        await self.execute(run_id)
        return run_id

    async def new_run(
        self,
        conn: Conn,
        org_id: str,
        flow_id: str,
        outputs: list[Any],
        start_index: int,
        resumed_from: str | None,
    ) -> str:
        """Insert a run (``running``) starting at node ``start_index``."""
        run_id = self.ids.new("run")
        now = self.clock.now_ms()
        await conn.execute(
            t.flow_runs.insert().values(
                id=run_id,
                org_id=org_id,
                flow_id=flow_id,
                status="running",
                outputs=outputs,
                start_index=start_index,
                resumed_from=resumed_from,
                created_at=now,
                updated_at=now,
            )
        )
        await self._event(
            conn, run_id, "Flow run started" if resumed_from is None else "Flow run resumed"
        )
        return run_id

    async def execute(self, run_id: str) -> None:
        """Run nodes from the run's start index until a pause, the end, or a failure."""
        async with self.db.read() as conn:
            run = dict(
                (await conn.execute(sa.select(t.flow_runs).where(R.id == run_id))).one()._mapping
            )
            flow = dict(
                (await conn.execute(sa.select(t.flows).where(t.flows.c.id == run["flow_id"])))
                .one()
                ._mapping
            )
        outputs: list[Any] = list(run["outputs"])
        nodes = flow["nodes"]
        for index in range(run["start_index"], len(nodes)):
            node = nodes[index]
            if node["type"] == "output":
                outputs.append({"data": node["value"], "success": True})
                continue
            try:
                paused = await self._agent_node(run, index, node, outputs)
            except LeadgateError as exc:
                # A rule the node broke (its agent deleted or inactive, say): one line.
                log.warning("flow run %s failed at node %d: [%s]", run_id, index, exc.rule)
                await self._finish(run_id, outputs, "failed", f"node {index}: {exc.message}")
                return
            except Exception as exc:
                log.exception("flow run %s failed at node %d", run_id, index)
                await self._finish(run_id, outputs, "failed", f"node {index}: {exc}")
                return
            if paused:
                return
        await self._finish(run_id, outputs, "completed", None)

    async def _finish(
        self, run_id: str, outputs: list[Any], status: str, error: str | None
    ) -> None:
        async with self.db.tx() as conn:
            await conn.execute(
                t.flow_runs.update()
                .where(R.id == run_id)
                .values(status=status, outputs=outputs, error=error, updated_at=self.clock.now_ms())
            )
            await self._event(conn, run_id, f"Flow run {status}")

    # One body: registering the continuation, the turn and the pause are one ordered
    # protocol (the continuation must exist before the turn can be approved).
    async def _agent_node(
        self, run: dict[str, Any], index: int, node: dict[str, Any], outputs: list[Any]
    ) -> bool:
        async with self.db.read() as conn:
            agent = await agents_mod.find_agent(conn, run["org_id"], node["agent"])
            lead = await agents_mod.resolve_lead(conn, agent)
        session_key = f"flow:{run['id']}:{index}"
        binding = BindingSpec(BindingKind.flow, {"runId": run["id"], "nodeIndex": index})
        trigger = Trigger(
            org_id=run["org_id"],
            agent_id=agent.id,
            session_key=session_key,
            text=node["prompt"],
            binding=binding,
        )
        if lead is None:
            outcome = await self.turns.run(trigger)
            if not isinstance(outcome, Reply):
                raise Conflict("the agent did not answer", rule="flow.agent_busy")
            outputs.append({"data": {"text": outcome.text}, "success": True})
            return False
        continuation_id = self.ids.new("cnt")
        now = self.clock.now_ms()
        async with self.db.tx() as conn:
            await conn.execute(
                t.continuations.insert().values(
                    id=continuation_id,
                    org_id=run["org_id"],
                    run_id=run["id"],
                    node_index=index,
                    agent_id=agent.id,
                    session_key=session_key,
                    status="waiting",
                    created_at=now,
                    updated_at=now,
                )
            )
        outcome = await self.turns.run(trigger)
        async with self.db.tx() as conn:
            item_id = outcome.work_item_id if isinstance(outcome, Gated) else None
            if item_id is None:
                session = await find_session(conn, agent.id, session_key)
                active = (
                    None
                    if session is None
                    else await workitems.active_for(conn, agent.id, session.id)
                )
                item_id = active.id if active else None
            await conn.execute(
                t.continuations.update()
                .where(C.id == continuation_id)
                .values(work_item_id=item_id, updated_at=self.clock.now_ms())
            )
            await conn.execute(
                t.flow_runs.update()
                .where(R.id == run["id"])
                .values(
                    status="waitingForHitl",
                    outputs=[*outputs, PAUSED_OUTPUT],
                    updated_at=self.clock.now_ms(),
                )
            )
            await self._event(conn, run["id"], WAITING_EVENT)
        return True


_W = t.work_items.c
_S = t.sessions.c
#: A waiting continuation with its node's work item, found through the node's session:
#: the item id is written on the continuation only after the turn, so a crash between
#: the two left an approved item that nothing resumed (and no queue showed).
_WITH_ITEM = t.continuations.join(
    t.sessions, sa.and_(_S.agent_id == C.agent_id, _S.key == C.session_key)
).join(
    t.work_items,
    sa.and_(_W.session_id == _S.id, sa.or_(C.work_item_id.is_(None), C.work_item_id == _W.id)),
)
#: Work item ends that no approval follows: the paused run can never resume.
ENDED_WITHOUT_APPROVAL = (
    Status.rejected.value,
    Status.cancelled.value,
    Status.abandoned.value,
    Status.failed.value,
)
#: One whose work item was settled: approved (the flow resumes) or ended without an
#: approval (the run fails). One statement for both, built once: every approval runs it.
_SETTLED = (
    sa.select(
        t.continuations,
        _W.id.label("item_id"),
        _W.summary.label("item_summary"),
        _W.status.label("item_status"),
    )
    .select_from(_WITH_ITEM)
    .where(
        C.status == "waiting",
        _W.status.in_((Status.approved.value, *ENDED_WITHOUT_APPROVAL)),
    )
    .limit(1)
)


class FlowResumer:
    """Resumes paused flows whose continuation's work item was approved."""

    name = "flow-resume"

    def __init__(self, flows: FlowService) -> None:
        self.flows = flows

    async def run_once(self) -> bool:
        """Resume one approved continuation, or end the run of one whose item ended
        without an approval (fenced: exactly one replica wins either)."""
        db = self.flows.db
        # Read first: every approval wakes this runner, and almost none of them concerns
        # a continuation; a read takes no write lock (the claim below is fenced).
        async with db.read() as conn:
            if (await conn.execute(_SETTLED)).first() is None:
                return False
        async with db.tx() as conn:
            row = (await conn.execute(db.skip_locked(_SETTLED))).first()
            if row is None:
                return False
            if row.item_status != Status.approved.value:
                await self._end(conn, row)
                return True
            new_run = await self._resume(conn, row)
        if new_run is not None:
            await self.flows.execute(new_run)
        return True

    async def _end(self, conn: Conn, row: Any) -> None:
        """The paused run of a continuation whose item was rejected, cancelled, abandoned
        or failed ends ``failed``, saying why (it waited for an approval for ever)."""
        clock = self.flows.clock
        res = await conn.execute(
            t.continuations.update()
            .where(C.id == row.id, C.status == "waiting")
            .values(status="closed", work_item_id=row.item_id, updated_at=clock.now_ms())
        )
        if not res.rowcount:
            return
        why = f"node {row.node_index}: the work item {row.item_id} was {row.item_status}"
        await conn.execute(
            t.flow_runs.update()
            .where(R.id == row.run_id, R.status == "waitingForHitl")
            .values(status="failed", error=why, updated_at=clock.now_ms())
        )
        await self.flows._event(conn, row.run_id, f"Flow run failed: {why}")

    async def _resume(self, conn: Conn, row: Any) -> str | None:
        """Resume an approved continuation in ``conn``: the new run's id, to execute
        once committed (None: another replica resumed it)."""
        clock, ids = self.flows.clock, self.flows.ids
        res = await conn.execute(
            t.continuations.update()
            .where(C.id == row.id, C.status == "waiting")
            .values(
                status="resumed",
                summary=row.item_summary,
                work_item_id=row.item_id,
                updated_at=clock.now_ms(),
            )
        )
        if not res.rowcount:
            return None
        paused = (await conn.execute(sa.select(t.flow_runs).where(R.id == row.run_id))).one()
        new_run = await self.flows.new_run(
            conn,
            row.org_id,
            paused.flow_id,
            list(paused.outputs),
            row.node_index + 1,
            paused.id,
        )
        await conn.execute(
            t.continuations.update().where(C.id == row.id).values(resumed_run_id=new_run)
        )
        await conn.execute(
            t.deliveries.update()
            .where(
                t.deliveries.c.work_item_id == row.item_id,
                t.deliveries.c.status == "continuation",
            )
            .values(status="sent", updated_at=clock.now_ms())
        )
        try:
            await workitems.transition(
                conn,
                clock,
                ids,
                row.item_id,
                src=Status.approved,
                dst=Status.completed,
                actor="system:flow",
                action="flowResumed",
                text=new_run,
            )
        except TransitionError:
            log.warning("continuation %s: item no longer approved", row.id)
        return new_run
