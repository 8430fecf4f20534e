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
continuation row; it is not copied into the node output. The turn decides: a plain node
whose turn comes back gated (a lead added meanwhile) pauses on its item the same way, and
a lead-reviewed node whose turn made no work item (its lead removed meanwhile) closes its
continuation and goes on with the turn's answer.

A ``running`` run is leased to the process executing it (``lease_token``,
``lease_expires_at``, ``lease_owner``; :data:`RUN_LEASE_MS`): the run is inserted leased,
the executor renews the lease every :data:`RENEW_EVERY_S` while nodes run and at every
node, and every write of the run's progress and outcome is one move of
:data:`RUN_TRANSITIONS`, a conditional ``UPDATE`` fenced by status and lease token that
raises :class:`RunLeaseLost` when it matches nothing. The run's ``outputs`` hold one entry
per node done (written after every agent node), so the next node is ``len(outputs)``.
When the executor's process dies, :class:`leadgate.flows.recovery.FlowRecovery` claims
the run once its lease lapsed (or its holder is known dead) and continues it from there;
the old executor, should it come back, can write nothing more. An agent node's turn is
taken in under the external event id ``flow:<run>:<node>`` (the intake's
de-duplication), so a node executed again never makes a second turn, and the turn taken
in decides, not the worker as it is now (its lead added or removed, or itself deactivated
or deleted, since): a turn that made a work item pauses on it (a gated turn is recorded
as a ``rerun`` turn run: turn recovery runs it again if it was cut off before its
submission), one that made none takes the answer it stored, and one whose answer was
lost with its process fails the run saying so (``flow.turn_lost``).

A run that fails (:func:`move_run` to ``failed``: its node broke, recovery gave it up,
its paused item ended) closes its waiting continuations and ends the work items its node
turns opened that are still open (:func:`end_owned_items`), in the same transaction: no
person or lead is left deciding an item whose flow will never resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import sqlalchemy as sa

from binding.bindings import find_session
from leadgate.core.clock import MINUTE_MS, Clock, IdFactory, iso
from leadgate.core.errors import (
    Conflict,
    DatabaseDamaged,
    LeadgateError,
    NotFound,
    TransitionError,
    Unavailable,
    ValidationError,
    quoted,
)
from leadgate.core.limits import MESSAGE_LIMIT, validate_message
from leadgate.core.logs import error_text, loggable
from leadgate.core.metrics import METRICS
from leadgate.core.runners import (
    LEFT_AT_MOST_MS,
    LOCKED_RECHECK_MS,
    Left,
    LostClaims,
    leave,
    seconds_until,
)
from leadgate.core.tasks import alongside
from leadgate.core.types import (
    BindingKind,
    BindingSpec,
    Duplicate,
    Gated,
    Reply,
    Trigger,
)
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database, Held, held_counts
from leadgate.database.faults import lock_not_granted
from leadgate.database.sql import bound_lock_waits, insert_ignore_stmt
from leadgate.domain import agents as agents_mod
from leadgate.domain import wakes, workitems
from leadgate.domain.orgs import validate_name
from leadgate.domain.wakes import Wake
from leadgate.domain.workitems import Status
from leadgate.turns import runs as turn_runs
from leadgate.turns.intake import taken_in
from outbox.store import DeliveryStatus, cancel_for_item

if TYPE_CHECKING:
    # The turn path is handed in (the composition root makes it): an operator command
    # that reads or decides flow items never loads it.
    from leadgate.turns.path import TurnService

log = logging.getLogger("leadgate.flows")

WAITING_EVENT = "Flow run is waiting for Lead review"
STARTED_EVENT = "Flow run started"
RESUMED_EVENT = "Flow run resumed"
PAUSED_OUTPUT: dict[str, Any] = {"data": {}, "success": True}
MAX_NODES = 100
#: The keys each node type has (any other is refused: ``flow.node_key``).
_NODE_KEYS = {
    "agent": frozenset({"type", "agent", "prompt"}),
    "output": frozenset({"type", "value"}),
}
R = t.flow_runs.c
C = t.continuations.c
_M = t.messages.c

#: How long a running run's lease holds without a renewal: after it, recovery continues
#: the run. Short, because the executor renews it while a node's turn runs.
RUN_LEASE_MS = 2 * MINUTE_MS
#: How often an executor renews its run's lease while nodes run (real seconds: a
#: background task; a node's agent turn may take minutes).
RENEW_EVERY_S = 30.0


class RunStatus(enum.StrEnum):
    """The status of a flow run."""

    running = "running"
    waitingForHitl = "waitingForHitl"
    completed = "completed"
    failed = "failed"


_RS = RunStatus
#: The one table of a flow run's moves. ``running -> running`` is progress (the outputs
#: of the nodes done, the lease renewed); every move from ``running`` is fenced by the
#: executor's lease token as well as the status.
RUN_TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    _RS.running: frozenset({_RS.running, _RS.waitingForHitl, _RS.completed, _RS.failed}),
    _RS.waitingForHitl: frozenset({_RS.failed}),
    _RS.completed: frozenset(),
    _RS.failed: frozenset(),
}
#: A lease given up: the run left ``running``.
_NO_LEASE: dict[str, Any] = {"lease_token": None, "lease_expires_at": None, "lease_owner": None}


class RunLeaseLost(TransitionError):
    """A fenced write of a running flow run matched nothing: its lease lapsed and another
    process took the run over (or finished it). Nothing was written."""


#: The rule of :class:`RunUnreadable`.
UNREADABLE_RULE = "flowRun.unreadable"
#: The rule in the error and event of a run that was given up on as unreadable (by
#: recovery after a few attempts, by the resumer at once: resuming it again gives the
#: same).
UNRECOVERABLE_RULE = "flow.unrecoverable"


class RunUnreadable(LeadgateError):
    """A running flow run cannot be executed as stored: its flow is gone, or its outputs
    or its flow's nodes do not decode or are not lists. Executing it again gives the
    same; recovery gives such a run up after :data:`leadgate.flows.recovery.MAX_RECOVERIES`
    attempts (rule ``flow.unrecoverable``). A paused run the resumer finds unreadable
    is given up at once the same way."""


class NewRun(TypedDict):
    """The ``flow_runs`` row of a run being started or resumed: ``running``, leased to
    the process inserting it (``lease_token``)."""

    id: str
    org_id: str
    flow_id: str
    status: str
    outputs: list[Any]
    start_index: int
    resumed_from: str | None
    created_at: int
    updated_at: int
    lease_token: str
    lease_expires_at: int
    lease_owner: str | None


@dataclass(frozen=True)
class RunLease:
    """A running flow run and the lease token its executor holds."""

    run_id: str
    token: str


@dataclass(frozen=True)
class LostRun:
    """A run this process claimed or inserted by a write in doubt, watched by its lease
    token (:attr:`FlowService.lost`)."""

    token: str
    #: what that write counted (nothing for a recovery claim; a resume's item move),
    #: counted when the run is found holding the token: the write landed
    held: Held = ()


#: PostgreSQL: a run's waiting continuations, locked in id order (:func:`move_run` to
#: ``failed``, before the run's row).
_WAITING_OF_RUN = (
    sa.select(C.id)
    .where(C.run_id == sa.bindparam("p_run"), C.status == "waiting")
    .order_by(C.id)
    .with_for_update()
)


async def move_run(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    run_id: str,
    *,
    src: RunStatus,
    dst: RunStatus,
    token: str | None = None,
    values: dict[str, Any] | None = None,
    ended: ItemEnded | None = None,
) -> None:
    """Move ``run_id`` from ``src`` to ``dst`` (a move of :data:`RUN_TRANSITIONS`), fenced
    by status and, from ``running``, by the lease ``token``; a move that stays
    ``running`` renews the lease, one that leaves it clears it; one to ``failed`` closes
    the run's continuations still ``waiting`` (it resumes nothing) and ends the work
    items its node turns opened that are still open (:func:`end_owned_items`, ``ended``
    awaited for each), in the same transaction. Raises :class:`RunLeaseLost` (from ``running``) or
    :class:`TransitionError` when nothing matched."""
    if dst not in RUN_TRANSITIONS[src]:
        raise TransitionError(
            f"a flow run cannot go from {src} to {dst}", rule="flowRun.transition"
        )
    now = clock.now_ms()
    fences = [R.id == run_id, R.status == src.value]
    changes: dict[str, Any] = {"status": dst.value, "updated_at": now, **(values or {})}
    if src is RunStatus.running:
        if token is None:
            raise TransitionError("a running flow run moves under its lease", rule="flowRun.lease")
        fences.append(R.lease_token == token)
        changes.update(
            {"lease_expires_at": now + RUN_LEASE_MS} if dst is RunStatus.running else _NO_LEASE
        )
    update = t.flow_runs.update().where(*fences).values(changes)
    if dst is RunStatus.failed:
        if conn.dialect.name == "postgresql":
            # The run's waiting continuations are locked (in id order) before the run:
            # the resumer takes a continuation first (its pick) and then the run (its
            # failure of a paused run); taking the run first, then its continuations,
            # the two met in opposite orders (40P01, one of them ended). A continuation
            # settled while this waited is no longer waiting, and not locked.
            await conn.execute(_WAITING_OF_RUN, {"p_run": run_id})
        failed = (await conn.execute(update.returning(R.org_id, R.start_index, R.error))).first()
        if failed is not None:
            # A failed run resumes nothing: a continuation registered before its node
            # failed (the worker deactivated, its turn broke) is closed with it. It
            # stayed ``waiting`` for ever, showing a failed run as waiting for a review.
            await conn.execute(
                t.continuations.update()
                .where(C.run_id == run_id, C.status == "waiting")
                .values(status="closed", updated_at=now)
            )
            await end_owned_items(
                conn, clock, ids, failed.org_id, run_id, failed.start_index, failed.error, ended
            )
            return
    elif (await conn.execute(update)).rowcount:
        return
    if src is RunStatus.running:
        raise RunLeaseLost(
            f"flow run {run_id} is no longer running under this lease (its lease lapsed and "
            "another process took it over); nothing changed",
            rule="flowRun.lease",
        )
    raise TransitionError(f"flow run {run_id} is not {src}; nothing changed", rule="flowRun.status")


#: What the review layer does, in the same transaction, for a work item a failed run
#: ended (:attr:`FlowService.item_ended`; the composition root sets it): close its open
#: review episode and show its posted review cards decided.
ItemEnded = Callable[[Conn, str], Awaitable[object]]
#: The rule named in the audit row of a work item ended because its flow run failed.
FLOW_RUN_FAILED_RULE = "flowRun.failed"
#: The audit action of that end (actor ``system:flow``).
FLOW_FAILED_ACTION = "flowFailed"
#: The open work items of the turns taken in under some of a run's node keys (the
#: intake's external event ids, unique: one index probe each), locked on PostgreSQL.
_IE = t.inbound_events.c
_OWNED = (
    sa.select(t.work_items.c.id, t.work_items.c.status)
    .select_from(t.inbound_events.join(t.work_items, t.work_items.c.id == _IE.work_item_id))
    .where(
        _IE.org_id == sa.bindparam("p_org"),
        _IE.external_event_id.in_(sa.bindparam("p_keys", expanding=True)),
        t.work_items.c.status.in_([status.value for status in workitems.ACTIVE]),
    )
    .order_by(t.work_items.c.id)
)
_OWNED_FOR_UPDATE = _OWNED.with_for_update(of=t.work_items)


async def end_owned_items(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    org_id: str,
    run_id: str,
    start_index: int,
    error: str | None,
    ended: ItemEnded | None = None,
) -> None:
    """End the work items that run ``run_id``'s node turns (nodes ``start_index`` on)
    opened and that are still open, as the run fails: ``cancelled``, fenced by the
    status read, audited ``flowFailed`` by ``system:flow`` naming
    :data:`FLOW_RUN_FAILED_RULE` and the run's ``error``; their unsent deliveries (a
    review card not posted yet, an approval's ``continuation``) are cancelled too, and
    ``ended`` is awaited for each (its review episode closed, its posted cards edited).

    Left open, nobody would decide them: the run resumes nothing, so an ``inProgress``
    item (its model failed) waited a week for the sweeper, shown open meanwhile, and one
    approved later kept a continuation delivery that nothing ever takes. PostgreSQL:
    the read locks the items, so a decision committing meanwhile is waited for and read
    as it ended (an approval: the item is cancelled from ``approved``; a rejection: it
    is left alone); one committing after this finds the item cancelled and is refused,
    naming this move. SQLite serializes writers."""
    keys = [node_key(run_id, index) for index in range(start_index, MAX_NODES)]
    query = _OWNED_FOR_UPDATE if conn.dialect.name == "postgresql" else _OWNED
    owned = (await conn.execute(query, {"p_org": org_id, "p_keys": keys})).all()
    for item in owned:
        await workitems.transition(
            conn,
            clock,
            ids,
            item.id,
            src=Status(item.status),
            dst=Status.cancelled,
            actor="system:flow",
            action=FLOW_FAILED_ACTION,
            text=f"{FLOW_RUN_FAILED_RULE}: flow run {run_id} failed: {error}",
            values={"lease_token": None, "lease_expires_at": None},
        )
        await cancel_for_item(conn, clock, item.id)
        await end_continuation_delivery(conn, clock, item.id, DeliveryStatus.cancelled.value)
        if ended is not None:
            await ended(conn, item.id)


async def end_continuation_delivery(conn: Conn, clock: Clock, item_id: str, status: str) -> None:
    """The ``continuation`` delivery of ``item_id`` (written at its approval) ends
    ``status``: the relay never takes one, so only the flow ends it."""
    await conn.execute(
        t.deliveries.update()
        .where(
            t.deliveries.c.work_item_id == item_id,
            t.deliveries.c.status == DeliveryStatus.continuation.value,
        )
        .values(status=status, updated_at=clock.now_ms())
    )


async def take_over(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    run_id: str,
    old_token: str | None,
    owner: str | None,
    *,
    token: str | None = None,
) -> RunLease | None:
    """Take running run ``run_id``'s lease over from ``old_token`` (None: it had none, a
    run left ``running`` by a version before leases) under a new token held by
    ``owner`` (``token``, or one made here): the ``running -> running`` move of a
    recovery claim, fenced by status and the old token. Counts the claim in
    ``recovery_attempts`` (reset when the run makes progress). None when nothing matched
    (another process took it over first, or the run left ``running``)."""
    token = token or ids.new("lease")
    now = clock.now_ms()
    res = await conn.execute(
        t.flow_runs.update()
        .where(
            R.id == run_id,
            R.status == RunStatus.running.value,
            R.lease_token.is_not_distinct_from(old_token),
        )
        .values(
            lease_token=token,
            lease_expires_at=now + RUN_LEASE_MS,
            lease_owner=owner,
            updated_at=now,
            # Counted with the claim, durably: a run that kills every process executing
            # it gets no chance to count its own failure.
            recovery_attempts=R.recovery_attempts + 1,
        )
    )
    return RunLease(run_id, token) if res.rowcount else None


async def register_continuation(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    *,
    org_id: str,
    run_id: str,
    node_index: int,
    agent_id: str,
    session_key: str,
) -> str:
    """The id of agent node ``node_index``'s continuation of run ``run_id``, registered
    (``waiting``) unless an earlier attempt did. One per node (the unique index of
    migration 0016): the insert is ``ON CONFLICT DO NOTHING`` and the row that is there
    wins, so a second registration of a node is a no-op, never an IntegrityError."""
    now = clock.now_ms()
    await conn.execute(
        insert_ignore_stmt(conn.dialect.name, t.continuations),
        {
            "id": ids.new("cnt"),
            "org_id": org_id,
            "run_id": run_id,
            "node_index": node_index,
            "agent_id": agent_id,
            "session_key": session_key,
            "status": "waiting",
            "created_at": now,
            "updated_at": now,
        },
    )
    return str(
        await conn.scalar(sa.select(C.id).where(C.run_id == run_id, C.node_index == node_index))
    )


def node_key(run_id: str, index: int) -> str:
    """Agent node ``index`` of run ``run_id``'s session key, and the external event id
    its turn is taken in under (once: :func:`node_trigger`)."""
    return f"flow:{run_id}:{index}"


def node_trigger(org_id: str, run_id: str, index: int, agent_id: str, prompt: str) -> Trigger:
    """The turn of agent node ``index`` of run ``run_id``: its own session, and an
    external event id the intake takes in once (a node executed again by recovery gets
    :class:`~leadgate.core.types.Duplicate`, never a second turn)."""
    return Trigger(
        org_id=org_id,
        agent_id=agent_id,
        session_key=node_key(run_id, index),
        text=prompt,
        binding=BindingSpec(BindingKind.flow, {"runId": run_id, "nodeIndex": index}),
        external_event_id=node_key(run_id, index),
    )


def validate_nodes(nodes: Any) -> list[dict[str, Any]]:
    """Check a flow definition (a non-empty list of known nodes, each with its own keys
    only, an output's value at most :data:`~leadgate.core.limits.MESSAGE_LIMIT`
    characters as JSON): bounded, since every run copies its outputs and rewrites them
    after each agent node."""
    if not isinstance(nodes, list) or not nodes or len(nodes) > MAX_NODES:
        raise ValidationError(f"a flow is a list of 1..{MAX_NODES} nodes", rule="flow.nodes")
    for index, node in enumerate(nodes):
        if not isinstance(node, dict) or node.get("type") not in _NODE_KEYS:
            raise ValidationError(
                f"node {index}: type must be agent or output", rule="flow.node_type"
            )
        unknown = sorted(str(key) for key in node if key not in _NODE_KEYS[node["type"]])
        if unknown:
            # Stored as given, unread: a misspelt key or a payload nothing bounds.
            raise ValidationError(
                f"node {index}: an {node['type']} node has no key {unknown[0][:40]!r}",
                rule="flow.node_key",
            )
        if node["type"] == "agent":
            if not isinstance(node.get("agent"), str) or not node["agent"]:
                raise ValidationError(f"node {index}: agent is required", rule="flow.node_agent")
            if not isinstance(node.get("prompt"), str):
                raise ValidationError(f"node {index}: prompt is required", rule="flow.node_prompt")
            validate_message(node["prompt"])
        elif "value" not in node:
            raise ValidationError(f"node {index}: value is required", rule="flow.node_value")
        elif len(json.dumps(node["value"], ensure_ascii=False)) > MESSAGE_LIMIT:
            raise ValidationError(
                f"node {index}: value is longer than {MESSAGE_LIMIT:,} characters as JSON",
                rule="flow.node_value",
            )
    return nodes


class NewFlowView(TypedDict):
    """A stored flow: ``nodes`` as given (checked by :func:`validate_nodes`)."""

    id: str
    name: str
    nodes: list[dict[str, Any]]


async def create_flow(
    conn: Conn, clock: Clock, ids: IdFactory, org_id: str, name: str, nodes: Any
) -> NewFlowView:
    """Store a flow after checking its name (rule ``flow.name``), its nodes and that every
    agent exists and is active (``agent.inactive``)."""
    name = validate_name(name, "flow", id_prefix="flw")
    nodes = validate_nodes(nodes)
    for index, node in enumerate(nodes):
        if node["type"] == "agent":
            agent = await agents_mod.find_agent(conn, org_id, node["agent"])
            if not agent.active:
                # Every run would fail at this node (as a schedule of it would fire).
                raise ValidationError(
                    f"node {index}: agent {quoted(agent.name)} is inactive", rule="agent.inactive"
                )
    if await conn.scalar(
        sa.select(t.flows.c.id).where(t.flows.c.org_id == org_id, t.flows.c.name == name)
    ):
        raise Conflict(f"a flow named {quoted(name)} already exists", rule="flow.name_taken")
    flow_id = ids.new("flw")
    await conn.execute(
        t.flows.insert().values(
            id=flow_id, org_id=org_id, name=name, nodes=nodes, created_at=clock.now_ms()
        )
    )
    return {"id": flow_id, "name": name, "nodes": nodes}


class FlowRow(TypedDict):
    """A ``flows`` row (its columns, in their order): ``nodes`` as stored."""

    id: str
    org_id: str
    name: str
    nodes: Any
    created_at: int


async def find_flow(conn: Conn, org_id: str, ref: str) -> FlowRow:
    """A flow of the organization by id or name."""
    row = (
        await conn.execute(
            sa.select(t.flows)
            .where(t.flows.c.org_id == org_id, sa.or_(t.flows.c.id == ref, t.flows.c.name == ref))
            .order_by(sa.case((t.flows.c.id == ref, 0), else_=1))
        )
    ).first()
    if row is None:
        raise NotFound(f"no flow {quoted(ref)}", rule="flow.not_found")
    return {
        "id": row.id,
        "org_id": row.org_id,
        "name": row.name,
        "nodes": row.nodes,
        "created_at": row.created_at,
    }


async def read_checked(conn: Conn, run_id: str, flow_id: str) -> tuple[list[Any], list[Any]]:
    """The outputs of run ``run_id`` (of flow ``flow_id``) and its flow's nodes, checked
    as a run executes them. Raises :class:`RunUnreadable` when its flow is gone, or its
    outputs or its flow's nodes do not decode or are not lists (of nodes, from the first
    one not done)."""
    try:
        outputs = await conn.scalar(sa.select(R.outputs).where(R.id == run_id))
        flow = (
            await conn.execute(sa.select(t.flows.c.nodes).where(t.flows.c.id == flow_id))
        ).first()
    except ValueError as exc:  # JSONDecodeError: a stored value that is not JSON
        raise RunUnreadable(
            f"flow run {run_id}: its outputs or its flow's nodes do not decode ({exc})",
            rule=UNREADABLE_RULE,
        ) from exc
    if flow is None:
        raise RunUnreadable(
            f"flow run {run_id}: its flow {flow_id} no longer exists", rule=UNREADABLE_RULE
        )
    nodes = flow.nodes
    # Checked, not trusted: list() of a stored object or string would "continue" the
    # run from a made-up node.
    if (
        not isinstance(outputs, list)
        or not isinstance(nodes, list)
        or not all(isinstance(node, dict) for node in nodes[len(outputs) :])
    ):
        raise RunUnreadable(
            f"flow run {run_id}: its outputs or its flow's nodes are not the lists a run executes",
            rule=UNREADABLE_RULE,
        )
    return list(outputs), nodes


class ContinuationView(TypedDict):
    """A run's continuation: the agent node it waits on, and the run that resumed it."""

    id: str
    nodeIndex: int
    status: str
    summary: str | None
    resumedRunId: str | None


class RunView(TypedDict):
    """A flow run as ``leadgate flow show`` prints it: ``outputs`` as stored (a damaged
    run's too, which need not be a list)."""

    id: str
    flowId: str
    status: str
    outputs: Any
    startIndex: int
    resumedFrom: str | None
    error: str | None
    recoveryAttempts: int
    createdAt: str | None
    events: list[str]
    continuations: list[ContinuationView]


async def run_view(conn: Conn, org_id: str, run_id: str) -> RunView:
    """A run with its events and continuations (``leadgate flow show``, and tests):
    ``recoveryAttempts`` counts recovery's claims since the run last made progress."""
    row = (
        await conn.execute(sa.select(t.flow_runs).where(R.id == run_id, R.org_id == org_id))
    ).first()
    if row is None:
        raise NotFound(f"no flow run {quoted(run_id)}", rule="flowRun.not_found")
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
        # Claims by recovery since the run last made progress: how close a running run
        # is to being given up (flow.unrecoverable at MAX_RECOVERIES).
        "recoveryAttempts": row.recovery_attempts,
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
    """Starts, executes and resumes flow runs, each under the lease of its executor."""

    def __init__(
        self,
        db: Database,
        clock: Clock,
        ids: IdFactory,
        turns: TurnService,
        *,
        renew_every_s: float = RENEW_EVERY_S,
    ) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.turns = turns
        #: how often a running node's lease is renewed (real seconds)
        self.renew_every_s = renew_every_s
        #: Set by the composition root to the flow recovery's wake: a token added to
        #: :attr:`lost` outside that runner's passes is due sooner than its sleep.
        self.recovery_due: Callable[[], None] = lambda: None
        #: Set by the composition root to the review layer's end of a work item's
        #: review episode and cards: awaited for each item a failed run ends.
        self.item_ended: ItemEnded | None = None
        #: the runs (by lease token: :class:`LostRun`) this process claimed or inserted
        #: by a write whose ``COMMIT`` was in doubt (a recovery claim, a resumed run):
        #: landed, the run would sit ``running`` with nothing executing it until its
        #: lease lapsed. The flow recovery looks for them and continues the run it finds
        #: under that token (:func:`leadgate.flows.recovery.claim_lapsed`).
        self.lost: LostClaims[LostRun] = LostClaims(
            name="flow-recovery", on_watch=lambda: self.recovery_due()
        )

    def owner(self) -> str | None:
        """This process (``lease_owner`` of the runs it executes; None unregistered)."""
        return self.turns.owner()

    async def _event(self, conn: Conn, run_id: str, text: str) -> None:
        await conn.execute(
            t.flow_run_events.insert().values(
                id=self.ids.new("fre"), run_id=run_id, text=text, created_at=self.clock.now_ms()
            )
        )

    async def start(self, org_id: str, flow_ref: str) -> str:
        """Start a new run of a flow and execute it until it pauses or ends. A database
        fault once the run is recorded names the run (``flow.interrupted``): it stays
        ``running`` and recovery continues it, so starting the flow again would run it
        twice. It names the fault's rule, not its message: that one speaks of the
        request that met it ("retry", "check whether it was stored"), not of the run.

        A start whose ``COMMIT`` is in doubt is settled by the database, as every
        ``leadgate`` command's write is (``leadgate flow run``, the caller, sets
        :attr:`~leadgate.database.db.Database.settle_doubt`): the server says it
        committed, and the run is executed here, once; it rolled back, and the fault
        says nothing was stored; the server cannot say, and the fault stays in doubt,
        for the command to name the run it may have started (landed, a worker's flow
        recovery continues it once its lease lapsed)."""
        async with self.db.tx() as conn:
            flow = await find_flow(conn, org_id, flow_ref)
            row = self._run_row(org_id, flow["id"], [], 0, None)
            await self._insert_run(conn, row)
        lease = RunLease(row["id"], row["lease_token"])
        try:
            await self.execute(lease)
        except Unavailable as exc:
            raise Unavailable(
                f"flow run {lease.run_id} was started, but the database failed while it ran "
                f"({exc.rule}); it stays running and a worker's flow recovery continues "
                f"it once this process is gone (leadgate flow show --org {org_id} "
                f"{lease.run_id}): do not start the flow again, it would run twice",
                rule="flow.interrupted",
            ) from exc
        return lease.run_id

    async def new_run(
        self,
        conn: Conn,
        org_id: str,
        flow_id: str,
        outputs: list[Any],
        start_index: int,
        resumed_from: str | None,
    ) -> RunLease:
        """Insert a run (``running``) starting at node ``start_index``, leased to this
        process: execute it with the lease returned once ``conn`` committed (if the
        process dies first, recovery does once the lease lapsed)."""
        row = self._run_row(org_id, flow_id, outputs, start_index, resumed_from)
        await self._insert_run(conn, row)
        return RunLease(row["id"], row["lease_token"])

    def _run_row(
        self,
        org_id: str,
        flow_id: str,
        outputs: list[Any],
        start_index: int,
        resumed_from: str | None,
    ) -> NewRun:
        """The row of a new run, leased to this process under a new token."""
        now = self.clock.now_ms()
        return {
            "id": self.ids.new("run"),
            "org_id": org_id,
            "flow_id": flow_id,
            "status": RunStatus.running.value,
            "outputs": outputs,
            "start_index": start_index,
            "resumed_from": resumed_from,
            "created_at": now,
            "updated_at": now,
            "lease_token": self.ids.new("lease"),
            "lease_expires_at": now + RUN_LEASE_MS,
            "lease_owner": self.owner(),
        }

    async def _insert_run(self, conn: Conn, row: NewRun) -> None:
        await conn.execute(t.flow_runs.insert().values(**row))
        await self._event(
            conn, row["id"], STARTED_EVENT if row["resumed_from"] is None else RESUMED_EVENT
        )

    async def renew(self, lease: RunLease) -> None:
        """Renew ``lease`` (fenced; :class:`RunLeaseLost` when it was lost)."""
        async with self.db.tx() as conn:
            await self._renew_in(conn, lease.run_id, lease.token)

    async def _renew_in(
        self, conn: Conn, run_id: str, token: str, values: dict[str, Any] | None = None
    ) -> None:
        """Renew the lease ``token`` of running run ``run_id`` in ``conn``'s transaction,
        with ``values`` (fenced; :class:`RunLeaseLost` when it was lost)."""
        await move_run(
            conn,
            self.clock,
            self.ids,
            run_id,
            src=_RS.running,
            dst=_RS.running,
            token=token,
            values=values,
        )

    @contextlib.asynccontextmanager
    async def _renewing(self, lease: RunLease) -> AsyncIterator[None]:
        """Renew ``lease`` every :attr:`renew_every_s` while the body runs (a node's agent
        turn may outlast the lease). A lost lease stops the renewals quietly: the
        executor's next fenced write raises, loudly (and a renewal that lands just after
        the run's last write finds it ended, which is no news)."""

        async def renew() -> None:
            while True:
                await asyncio.sleep(self.renew_every_s)
                try:
                    await self.renew(lease)
                except RunLeaseLost:
                    log.info("flow run %s: no longer leased here; renewals stop", lease.run_id)
                    return
                except Exception as exc:  # a database fault: the next round tries again
                    log.warning("renewing flow run %s failed: %s", lease.run_id, error_text(exc))

        async with alongside(renew(), name=f"flow-lease-{lease.run_id}"):
            yield

    async def execute(self, lease: RunLease) -> None:
        """Run the nodes not done yet (from ``len(outputs)``) until a pause, the end, or a
        failure, under ``lease``. Raises :class:`RunLeaseLost` when the lease was lost
        (another process continues the run), and a database fault as it is: the run
        stays ``running`` and recovery continues it once the lease lapsed."""
        run, outputs, nodes = await self._load(lease)
        async with self._renewing(lease):
            for index in range(len(outputs), len(nodes)):
                node = nodes[index]
                if node["type"] == "output":
                    # Not written alone: executed again after a crash, it gives the same.
                    outputs.append({"data": node["value"], "success": True})
                    continue
                try:
                    paused = await self._agent_node(run, lease, index, node, outputs)
                except (RunLeaseLost, Unavailable, DatabaseDamaged):
                    # Not the node's failure: another process holds the run now, or the
                    # database is away or damaged (the run stays running; recovery
                    # continues it). A damaged file ended the run as failed, as if the
                    # node had broken a rule.
                    raise
                except LeadgateError as exc:
                    # A rule the node broke (its agent deleted or inactive, say): one line.
                    log.warning("flow run %s failed at node %d: [%s]", run["id"], index, exc.rule)
                    await self._finish(lease, outputs, _RS.failed, f"node {index}: {exc.message}")
                    return
                except Exception as exc:
                    log.error(
                        "flow run %s failed at node %d", run["id"], index, exc_info=loggable(exc)
                    )
                    # (Stored and shown as the run's error: a database error's text
                    # quotes the row, the nodes' outputs among it.)
                    error = f"node {index}: {error_text(exc)}"
                    await self._finish(lease, outputs, _RS.failed, error)
                    return
                if paused:
                    return
                # The node's output is kept before the next node starts: executed again,
                # the run goes on from here (and renews its lease).
                async with self.db.tx() as conn:
                    # Progress: recovery's count of attempts that got nowhere starts
                    # again (a run may lose several processes in its life).
                    progress = {"outputs": outputs, "recovery_attempts": 0}
                    await self._renew_in(conn, lease.run_id, lease.token, progress)
            await self._finish(lease, outputs, _RS.completed, None)

    async def _load(self, lease: RunLease) -> tuple[dict[str, Any], list[Any], list[Any]]:
        """The run under ``lease`` (``id``, ``org_id``), the outputs of its nodes done and
        its flow's nodes. Raises :class:`RunLeaseLost` when it is not running under
        ``lease``, and :class:`RunUnreadable` when its outputs or its flow cannot be read
        (gone, not decoding, not the shape a run executes)."""
        run_id = lease.run_id
        async with self.db.read() as conn:
            # The lease first, from columns that always decode.
            row = (
                await conn.execute(
                    sa.select(R.id, R.org_id, R.flow_id, R.status, R.lease_token).where(
                        R.id == run_id
                    )
                )
            ).first()
            if row is None or row.status != _RS.running.value or row.lease_token != lease.token:
                raise RunLeaseLost(
                    f"flow run {run_id} is not running under this lease", rule="flowRun.lease"
                )
            outputs, nodes = await read_checked(conn, run_id, row.flow_id)
        return {"id": row.id, "org_id": row.org_id}, outputs, nodes

    async def _finish(
        self, lease: RunLease, outputs: list[Any], status: RunStatus, error: str | None
    ) -> None:
        async with self.db.tx() as conn:
            await move_run(
                conn,
                self.clock,
                self.ids,
                lease.run_id,
                src=_RS.running,
                dst=status,
                token=lease.token,
                values={"outputs": outputs, "error": error},
                ended=self.item_ended,
            )
            text = f"Flow run {status}" if error is None else f"Flow run {status}: {error}"
            await self._event(conn, lease.run_id, text)

    # One body: registering the continuation, the turn and the pause are one ordered
    # protocol (the continuation must exist before the turn can be approved).
    async def _agent_node(
        self,
        run: dict[str, Any],
        lease: RunLease,
        index: int,
        node: dict[str, Any],
        outputs: list[Any],
    ) -> bool:
        async with self.db.read() as conn:
            taken = await taken_in(conn, run["org_id"], node_key(run["id"], index))
            if taken is None:
                agent = await agents_mod.find_agent(conn, run["org_id"], node["agent"])
                lead = await agents_mod.resolve_lead(conn, agent)
        if taken is not None:
            # Executed again (recovery): the turn an earlier attempt took in decides, not
            # the worker as it is now. Its lead removed (or added) since, or the worker
            # deactivated or deleted, the node failed (flow.turn_lost, agent.inactive,
            # agent.not_found) while the turn's work item went to review, and its
            # approval resumed nothing.
            return await self._taken(run, lease, index, taken.agent_id, taken.work_item_id, outputs)
        trigger = node_trigger(run["org_id"], run["id"], index, agent.id, node["prompt"])
        session_key = trigger.session_key
        if lead is None:
            # The lease is checked (and renewed) before the turn: a process that lost
            # the run takes no turn in for it.
            await self.renew(lease)
            outcome = await self.turns.run(trigger)
            if isinstance(outcome, Duplicate):
                # Taken in since the read above (by another executor of the run, racing
                # this one: the fenced writes let one of them go on).
                item_id = await self._item_of(agent.id, session_key)
                return await self._taken(run, lease, index, agent.id, item_id, outputs)
            if isinstance(outcome, Gated):
                # A lead was added while the turn ran: its item waits for review like a
                # lead-reviewed node's, and the run pauses on it (failing here left the
                # approved item's continuation delivery open for ever). Registered after
                # the turn: an approval before the pause is found by the pause's wake.
                continuation_id = await self._register(run, lease, index, agent.id, session_key)
                return await self._pause(
                    run,
                    lease,
                    agent.id,
                    session_key,
                    outcome.work_item_id,
                    continuation_id,
                    outputs,
                )
            if not isinstance(outcome, Reply):
                raise Conflict("the agent did not answer", rule="flow.agent_busy")
            outputs.append({"data": {"text": outcome.text}, "success": True})
            return False
        continuation_id = await self._register(run, lease, index, agent.id, session_key)
        # A Duplicate: an earlier attempt took the turn in; the node pauses on it.
        outcome = await self.turns.run(trigger)
        item_id = (
            outcome.work_item_id
            if isinstance(outcome, Gated)
            else await self._item_of(agent.id, session_key)
        )
        if item_id is None:
            # The lead was removed while the turn ran: no item was made, so no review
            # will come. The node answered as a plain one does, and the run goes on
            # (paused, it waited for ever on a continuation with no item). A turn that
            # kept its item open (no complete_task yet) still pauses on it.
            text = (
                outcome.text
                if isinstance(outcome, Reply)
                else await self._answer(agent.id, session_key)
            )
            await self._no_review(run, lease, index)
            outputs.append({"data": {"text": text}, "success": True})
            return False
        return await self._pause(
            run, lease, agent.id, session_key, item_id, continuation_id, outputs
        )

    async def _taken(
        self,
        run: dict[str, Any],
        lease: RunLease,
        index: int,
        agent_id: str,
        item_id: str | None,
        outputs: list[Any],
    ) -> bool:
        """Node ``index`` of ``run``, whose turn an earlier attempt took in (for
        ``agent_id``), goes on from that turn without a second one: a turn that made a
        work item (``item_id``: its worker had a lead at its intake) pauses the run on
        it, whatever the worker's lead or activity is now (turn recovery runs the turn
        again if it was cut off before its submission); one that made none gives the
        node the answer it stored (``flow.turn_lost`` when its process died first)."""
        session_key = node_key(run["id"], index)
        if item_id is not None:
            continuation_id = await self._register(run, lease, index, agent_id, session_key)
            return await self._pause(
                run, lease, agent_id, session_key, item_id, continuation_id, outputs
            )
        text = await self._answer(agent_id, session_key)
        # A continuation an earlier attempt registered (its lead removed since) waits on
        # nothing.
        await self._no_review(run, lease, index)
        outputs.append({"data": {"text": text}, "success": True})
        return False

    async def _no_review(self, run: dict[str, Any], lease: RunLease, index: int) -> None:
        """Close node ``index``'s continuation if one is waiting (fenced by the run's
        lease): its turn made no work item, so no review will resume it."""
        async with self.db.tx() as conn:
            await self._renew_in(conn, run["id"], lease.token)
            await conn.execute(
                t.continuations.update()
                .where(C.run_id == run["id"], C.node_index == index, C.status == "waiting")
                .values(status="closed", updated_at=self.clock.now_ms())
            )

    async def _item_of(self, agent_id: str, session_key: str) -> str | None:
        """The work item of the node's session (of ``agent_id``, ``session_key``), open or
        ended; None when it has none (its turn was plain)."""
        async with self.db.read() as conn:
            found = await conn.scalar(
                sa.select(_W.id)
                .select_from(t.work_items.join(t.sessions, _W.session_id == _S.id))
                .where(_S.agent_id == agent_id, _S.key == session_key)
                .limit(1)
            )
        return None if found is None else str(found)

    async def _register(
        self, run: dict[str, Any], lease: RunLease, index: int, agent_id: str, session_key: str
    ) -> str:
        """Register the continuation of the agent node ``index``, fenced by the run's
        lease: its id."""
        async with self.db.tx() as conn:
            # Fenced with the continuation: a process that lost the run registers none
            # (a second waiting continuation of one node would resume the flow twice;
            # the unique index on the node makes a second registration a no-op too).
            await self._renew_in(conn, run["id"], lease.token)
            return await register_continuation(
                conn,
                self.clock,
                self.ids,
                org_id=run["org_id"],
                run_id=run["id"],
                node_index=index,
                agent_id=agent_id,
                session_key=session_key,
            )

    async def _pause(
        self,
        run: dict[str, Any],
        lease: RunLease,
        agent_id: str,
        session_key: str,
        item_id: str | None,
        continuation_id: str,
        outputs: list[Any],
    ) -> bool:
        """Pause the run on its node's work item (``item_id``, else the session's active
        one) after the turn: True."""
        async with self.db.tx() as conn:
            if item_id is None:
                session = await find_session(conn, agent_id, session_key)
                active = (
                    None
                    if session is None
                    else await workitems.active_for(conn, agent_id, session.id)
                )
                item_id = active.id if active else None
            await move_run(
                conn,
                self.clock,
                self.ids,
                run["id"],
                src=_RS.running,
                dst=_RS.waitingForHitl,
                token=lease.token,
                values={"outputs": [*outputs, PAUSED_OUTPUT]},
            )
            await conn.execute(
                t.continuations.update()
                .where(C.id == continuation_id)
                .values(work_item_id=item_id, updated_at=self.clock.now_ms())
            )
            await self._event(conn, run["id"], WAITING_EVENT)
            # The lead may have approved before this pause was written (the resumer,
            # woken by the approval, then found no paused run): wake it again.
            await wakes.after_commit(conn, Wake.flow)
        return True

    async def _answer(self, agent_id: str, session_key: str) -> str:
        """The answer an earlier attempt's turn of this node stored; a node whose turn was
        cut off with its process (taken in, nothing answered) fails: it is not run twice."""
        async with self.db.read() as conn:
            session = await find_session(conn, agent_id, session_key)
            text = (
                None
                if session is None
                else await conn.scalar(
                    sa.select(_M.content)
                    .where(
                        _M.session_id == session.id,
                        _M.role == "assistant",
                        sa.not_(_M.lead_gated),
                    )
                    .order_by(_M.created_at.desc(), _M.id.desc())
                    .limit(1)
                )
            )
        if text is None:
            raise Conflict(
                "its agent turn was taken in by an earlier attempt whose process stopped "
                "before the answer was stored; the turn is not run twice",
                rule="flow.turn_lost",
            )
        return str(text)


_W = t.work_items.c
_S = t.sessions.c
_A = t.audit.c
#: A waiting continuation of a paused run with its node's work item, found through the
#: node's session: the item id is written on the continuation only after the turn, so a
#: crash between the two left an approved item that nothing resumed (and no queue
#: showed). Only a paused run: until its pause is written the run's outputs are not the
#: pause snapshot a resumed run starts from, and a run left ``running`` by a crash is
#: paused by recovery first (flows.recovery). A lead's approval wakes the resumer at
#: once, possibly before the pause; the pause wakes it again.
_WITH_ITEM = (
    t.continuations.join(
        t.flow_runs, sa.and_(R.id == C.run_id, R.status == RunStatus.waitingForHitl.value)
    )
    .join(t.sessions, sa.and_(_S.agent_id == C.agent_id, _S.key == C.session_key))
    .join(
        t.work_items,
        sa.and_(_W.session_id == _S.id, sa.or_(C.work_item_id.is_(None), C.work_item_id == _W.id)),
    )
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
#: PostgreSQL: the pick, which locks (and skips when locked) the continuation row alone.
#: Locking every joined row hid a settled continuation whenever its run, session or work
#: item was row-locked by anything (a session event's counter, a decision that lost its
#: race, another statement), and the resumer skipped it at every look while that went on.
#: The moves that follow need none of those locks: each is fenced in its own ``WHERE``
#: (see :meth:`FlowResumer.run_once`). SQLite has no row locks: it runs :data:`_SETTLED`.
_PICK = _SETTLED.with_for_update(of=t.continuations, skip_locked=True)
#: PostgreSQL: the read and the pick but for the continuations in ``p_left``, whose last
#: pass met a lock wait past its bound (:attr:`FlowResumer.lock_wait_s`): the other
#: approved flows go on meanwhile. (Only then: the expanding list is compiled again at
#: every execution.)
_LEFT = C.id.not_in(sa.bindparam("p_left", expanding=True))
_SETTLED_BUT = _SETTLED.where(_LEFT)
_PICK_BUT = _PICK.where(_LEFT)
#: PostgreSQL: which of the continuations in ``p_ids`` (left ones whose time came a
#: while ago and that no pass took since) are still waiting: one that is not was settled
#: elsewhere, and is forgotten (:meth:`FlowResumer.run_once`).
_STILL_WAITING = sa.select(C.id).where(
    C.id.in_(sa.bindparam("p_ids", expanding=True)), C.status == "waiting"
)
#: PostgreSQL: how long the moves of a continuation taken again after a wait wait for a
#: held row: not at all (1 ms, the least ``lock_timeout`` takes: 0 turns it off). Its
#: first take waited :attr:`FlowResumer.lock_wait_s` already; each take again that waited
#: as long blocked the resumer loop as long, every other approved flow with it.
_TAKEN_AGAIN_WAIT_S = 0.001


class _ItemMoved(TransitionError):
    """A resume's fenced move of its approved work item matched nothing: another
    transaction moved the item after the pick read it (an operator's cancel; the pick
    locks only the continuation). Raised to roll the resume back: the next pass reads
    the item's end."""


class FlowResumer:
    """Resumes paused flows whose continuation's work item was approved."""

    name = "flow-resume"

    def __init__(self, flows: FlowService, *, lock_wait_s: float | None = None) -> None:
        self.flows = flows
        #: PostgreSQL: how long a pass's moves wait for a row lock another transaction
        #: holds (``lock_timeout``) before the pass gives up and leaves that continuation
        #: (for :data:`LOCKED_RECHECK_MS`, doubling up to :data:`LEFT_AT_MOST_MS`; taken
        #: again, its moves do not wait); ``[database] busy_timeout_s`` unless given
        self.lock_wait_s = flows.db.busy_timeout_s if lock_wait_s is None else lock_wait_s
        #: when to look again after a pass whose locked pick skipped the settled
        #: continuation its read found (PostgreSQL; None: the last pass did not)
        self._locked_look: int | None = None
        #: PostgreSQL: continuations whose pass met a held row (a lock wait past its
        #: bound), each with when it is taken again; the reads pass them over until then
        self._left: dict[str, Left] = {}
        #: when the left continuations whose time came a while ago may be looked up
        #: next (see :meth:`run_once`: at most every :data:`LEFT_AT_MOST_MS`)
        self._left_lookup = 0

    def due_in_s(self) -> float | None:
        """Seconds (by the clock) until the look again after a pass whose read found a
        settled continuation and whose pick (``FOR UPDATE OF continuations SKIP
        LOCKED``) took none: the continuation row was row-locked by another transaction
        (another replica's pass, or the executor writing the pause), or another replica
        settled it first. None otherwise: the resumer's work comes with commits that
        wake it. The runner loop sleeps no longer than this
        (:func:`leadgate.core.runners.run_loop`): the lock's holder may end with no
        wake-up to follow (another replica's pass that met a database fault and rolled
        back), and the run would wait for the poll. Row locks on the continuation's run,
        session or work item hide nothing from the pick: a move that needs such a row
        waits for it, up to :attr:`lock_wait_s`. A pass that waited longer left its
        continuation for a while (:meth:`run_once`); when nothing else is settled, this
        is until the soonest such continuation is taken again."""
        return seconds_until(self.flows.clock.now_ms(), self._locked_look)

    async def run_once(self) -> bool:
        """Resume one approved continuation, or end the run of one whose item ended
        without an approval (fenced: exactly one replica wins either).

        On PostgreSQL the pick row-locks the continuation alone, so every move after it
        is fenced in its own ``WHERE``, not by a lock taken with the pick: the
        continuation leaves ``waiting`` (``status = 'waiting'``; a pass that finds it
        gone writes nothing), and only that winner inserts the new run (leased to this
        process), ends the paused run (``waitingForHitl -> failed``, fenced by status:
        raises when it matched nothing) or moves the approved item (``approved ->
        completed`` or ``failed``, fenced by status), before the continuation's delivery
        (``status = 'continuation'``). An item that is no longer approved (a cancel
        committed after the pick read it) rolls the pass back (:class:`_ItemMoved`):
        True, the loop looks again at once and ends the run as the item ended. A resumed
        run's paused run is only read; the node's session is written only as any item
        move writes it (its event counter, waited for when another holds it).

        The moves wait for a row another transaction holds no longer than
        :attr:`lock_wait_s` (PostgreSQL ``lock_timeout``): past it (``55P03``, a fault
        not in doubt) the pass rolls back, logs it at INFO, leaves that continuation for
        :data:`LOCKED_RECHECK_MS` and returns True: the next pass, at once, takes any
        other settled one. Waiting with no bound, one item held by a long transaction
        stalled this loop, every other approved flow with it. A continuation left so is
        taken again once its time comes, and its moves then do not wait for a held row
        at all: held still, it is left again for twice as long (up to
        :data:`LEFT_AT_MOST_MS`). Each take again waited :attr:`lock_wait_s` before, 50
        ms apart: one item held for long kept the loop blocked almost all the time.

        A left continuation settled elsewhere (another replica resumed it once its row
        was free) is forgotten by the first pass whose read finds nothing; while reads
        keep finding work, one whose time came :data:`LEFT_AT_MOST_MS` ago and that no
        pass took since is looked up (one read of such continuations, at most every
        :data:`LEFT_AT_MOST_MS`) and forgotten when it no longer waits. Only an idle
        pass forgot them: under steady load they were kept for as long as it lasted."""
        db = self.flows.db
        clock = self.flows.clock
        self._locked_look = None
        read, pick, args = _SETTLED, _PICK, {}
        # One time for the pass: a continuation the read passed over as still left is
        # kept as left below, though its time comes while the read runs.
        now = clock.now_ms()
        if self._left:  # (almost never: only after a lock wait past its bound)
            waiting = [cont for cont, left in self._left.items() if left.due > now]
            if waiting:
                read, pick, args = _SETTLED_BUT, _PICK_BUT, {"p_left": waiting}
        # Read first: every approval wakes this runner, and almost none of them concerns
        # a continuation; a read takes no write lock (the claim below is fenced).
        async with db.read() as conn:
            if self._left and now >= self._left_lookup:
                await self._forget_settled(conn, now)
            if (await conn.execute(read, args)).first() is None:
                # A left continuation whose time had come and that the read did not find
                # is no longer waiting (resumed or ended elsewhere): forgotten. (Read
                # again here, the clock forgot one whose time came during the read,
                # passed over by it: its take waited the whole bound again, after the
                # poll.)
                self._left = {c: left for c, left in self._left.items() if left.due > now}
                self._locked_look = min((left.due for left in self._left.values()), default=None)
                return False
        outcome: RunLease | str | None = None  # (set before the commit)
        held: Held = ()
        taken: str | None = None
        again: Left | None = None
        try:
            async with db.tx() as conn:
                held = held_counts(conn)
                row = (await conn.execute(pick if db.is_postgres else read, args)).first()
                if row is None:
                    # Locked (or settled by another replica since the read: the look
                    # again then finds nothing, one read).
                    self._locked_look = clock.now_ms() + LOCKED_RECHECK_MS
                    return False
                taken = row.id
                again = self._left.pop(taken, None)
                # The moves wait for rows another transaction holds (the item, its
                # session), bounded: unbounded, one held item stalled this loop, every
                # other approved flow with it, for as long as its holder ran. Taken again
                # after such a wait, they do not wait: its first take waited already.
                await bound_lock_waits(
                    conn, self.lock_wait_s if again is None else _TAKEN_AGAIN_WAIT_S
                )
                if row.item_status != Status.approved.value:
                    outcome = await self._end(conn, row)
                else:
                    outcome = await self._resume(conn, row)
        except _ItemMoved as moved:
            # Rolled back, the new run with it: the next pass reads how the item ended.
            log.info("%s; looking again", moved.message)
            return True
        except Unavailable as fault:
            if taken is not None and not fault.in_doubt and lock_not_granted(fault):
                # Rolled back, nothing of it stored: the holder may commit with no
                # wake-up for this runner. The others go on meanwhile (True: at once).
                self._left[taken] = leave(again, clock.now_ms())
                if again is None:  # (held still when taken again: said once)
                    log.info(
                        "flow continuation %s: a row it moves stayed locked by another "
                        "transaction past %.3g s; looking again",
                        taken,
                        self.lock_wait_s,
                    )
                return True
            if fault.in_doubt and isinstance(outcome, RunLease):
                # The new run may have landed, leased to this process with nothing
                # executing it: the flow recovery looks for it (at once, then at
                # doubling gaps) and continues it, not after its lease.
                # Its item's move, which a commit in doubt does not count, is counted
                # if the look finds the run.
                now = clock.now_ms()
                lost = LostRun(outcome.token, tuple(held))
                self.flows.lost.watch(lost, due=now, lapses=now + RUN_LEASE_MS)
            raise
        if isinstance(outcome, RunLease):
            await self.flows.execute(outcome)
        elif outcome is not None:  # the error of a run given up as unrecoverable
            # Once, after the commit: only the replica whose fenced close of the
            # continuation matched gets here.
            METRICS.flow_runs_unrecoverable.inc()
            log.error("flow run %s failed: %s", row.run_id, outcome)
        return True

    async def _forget_settled(self, conn: Conn, now: int) -> None:
        """Forget the left continuations whose time came :data:`LEFT_AT_MOST_MS` or more
        before ``now`` and that no longer wait (settled elsewhere): one read, when there
        are any; the next look at most :data:`LEFT_AT_MOST_MS` on."""
        overdue = [c for c, left in self._left.items() if left.due + LEFT_AT_MOST_MS <= now]
        if not overdue:
            return
        self._left_lookup = now + LEFT_AT_MOST_MS
        waiting = set((await conn.execute(_STILL_WAITING, {"p_ids": overdue})).scalars())
        for cont in overdue:
            if cont not in waiting:
                del self._left[cont]

    async def _close(self, conn: Conn, row: Any) -> bool:
        """Close the waiting continuation ``row`` (fenced by its status): False when
        another replica settled it first."""
        res = await conn.execute(
            t.continuations.update()
            .where(C.id == row.id, C.status == "waiting")
            .values(status="closed", work_item_id=row.item_id, updated_at=self.flows.clock.now_ms())
        )
        return bool(res.rowcount)

    async def _end(self, conn: Conn, row: Any) -> str | None:
        """The paused run of a continuation whose item was rejected, cancelled, abandoned
        or failed ends ``failed``, saying why (it waited for an approval for ever). The
        error when it was given up as unrecoverable (its item abandoned because turn
        recovery gave the node's turn up: :data:`UNRECOVERABLE_RULE`), to log and count
        once committed; else None."""
        if not await self._close(conn, row):
            return None
        why = f"node {row.node_index}: the work item {row.item_id} was {row.item_status}"
        gave_up = None
        if row.item_status == Status.abandoned.value:
            # Abandoned by turn recovery (its turn kept killing its process), not after a
            # week of silence: the run says so, and is given up as recovery gives up.
            gave_up = await conn.scalar(
                sa.select(_A.text)
                .where(_A.work_item_id == row.item_id, _A.action == turn_runs.GAVE_UP_ACTION)
                .limit(1)
            )
        if gave_up is not None:
            why = (
                f"node {row.node_index}: {UNRECOVERABLE_RULE}: {gave_up}; the work item "
                f"{row.item_id} was abandoned"
            )
        await self._fail_paused(conn, row, why)
        # An item cancelled (or failed) after its approval has its continuation's
        # delivery still written: it is not to be acted on any more.
        await end_continuation_delivery(
            conn, self.flows.clock, row.item_id, DeliveryStatus.cancelled.value
        )
        return None if gave_up is None else why

    async def _fail_paused(self, conn: Conn, row: Any, error: str) -> None:
        """The paused run of ``row`` (its continuation closed) fails with ``error``."""
        await move_run(
            conn,
            self.flows.clock,
            self.flows.ids,
            row.run_id,
            src=RunStatus.waitingForHitl,
            dst=RunStatus.failed,
            values={"error": error},
            ended=self.flows.item_ended,
        )
        await self.flows._event(conn, row.run_id, f"Flow run failed: {error}")

    async def _resume(self, conn: Conn, row: Any) -> RunLease | str | None:
        """Resume an approved continuation in ``conn``: the new run (leased here), to
        execute once committed; the error of a paused run that cannot be resumed, failed
        here (:meth:`_give_up`); None: another replica resumed it."""
        clock = self.flows.clock
        # The paused run as an executor would read it (the checks of FlowService._load):
        # a snapshot that does not decode, or is not a list, must not become a new run's
        # outputs, nor fail every pass on the same row while other approvals wait.
        paused = (await conn.execute(sa.select(R.id, R.flow_id).where(R.id == row.run_id))).one()
        try:
            outputs, _ = await read_checked(conn, paused.id, paused.flow_id)
        except RunUnreadable as exc:
            return await self._give_up(conn, row, exc)
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
        lease = await self.flows.new_run(
            conn,
            row.org_id,
            paused.flow_id,
            outputs,
            row.node_index + 1,
            paused.id,
        )
        await conn.execute(
            t.continuations.update().where(C.id == row.id).values(resumed_run_id=lease.run_id)
        )
        await self._settle(
            conn,
            row,
            delivery="sent",
            dst=Status.completed,
            action="flowResumed",
            text=lease.run_id,
        )
        return lease

    async def _settle(
        self, conn: Conn, row: Any, *, delivery: str, dst: Status, action: str, text: str
    ) -> None:
        """The continuation's approved item (``dst``, audited as ``action`` with
        ``text``) and its delivery (``sent`` or ``failed``) settled with the paused run.
        Raises :class:`_ItemMoved` when the item is no longer approved: the pick read it
        without locking it, and a cancel may have committed since (carrying on, the flow
        resumed a cancelled item). The item first: its move is the fence, and nothing
        more is written when it fails."""
        clock = self.flows.clock
        try:
            await workitems.transition(
                conn,
                clock,
                self.flows.ids,
                row.item_id,
                src=Status.approved,
                dst=dst,
                actor="system:flow",
                action=action,
                text=text,
            )
        except TransitionError as exc:
            raise _ItemMoved(f"flow continuation {row.id}: {exc.message}", rule=exc.rule) from exc
        await end_continuation_delivery(conn, clock, row.item_id, delivery)

    async def _give_up(self, conn: Conn, row: Any, exc: RunUnreadable) -> str | None:
        """End the paused run of an approved continuation that cannot be resumed (its flow
        gone, its outputs not decoding or not a list) as recovery ends an unreadable run:
        ``failed`` with an error naming :data:`UNRECOVERABLE_RULE`; the continuation is
        closed, its item (approved: the resume was its delivery) and the continuation's
        delivery fail. Resuming it again would give the same, so there is no retry. The
        error, to log and count once committed; None when another replica took the
        continuation first."""
        if not await self._close(conn, row):
            return None
        error = f"{UNRECOVERABLE_RULE}: the approved run cannot be resumed: {exc.message}"
        # The item first: the run's failure ends the items it still has open, and would
        # have cancelled this one before its own move, as a failed delivery, could.
        await self._settle(
            conn, row, delivery="failed", dst=Status.failed, action="flowUnrecoverable", text=error
        )
        await self._fail_paused(conn, row, error)
        return error
