"""Flow runs whose executor stopped while they were ``running`` (leadgate.flows.recovery).

Two stacks on one database are two processes with one clock. A process "dies" by a
:class:`Killed` raised where it would die (in the model call, or right after a turn's
last commit): a BaseException, so none of our handlers (they catch Exception) runs, as
none would after a SIGKILL. The run is left ``running`` under a lease nobody renews. On
both databases.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import sqlalchemy as sa

from leadgate.core.clock import FakeClock
from leadgate.core.errors import ModelError, Unavailable
from leadgate.core.metrics import METRICS
from leadgate.core.runners import LEFT_AT_MOST_MS, LOCKED_RECHECK_MS, drain
from leadgate.core.types import Outcome, Trigger
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database
from leadgate.domain import agents as agents_mod
from leadgate.domain import workitems
from leadgate.flows.recovery import (
    MAX_RECOVERIES,
    RECOVERED_EVENT,
    UNRECOVERABLE_RULE,
    FlowRecovery,
    claim_lapsed,
)
from leadgate.flows.runs import (
    PAUSED_OUTPUT,
    RUN_LEASE_MS,
    WAITING_EVENT,
    FlowResumer,
    RunLeaseLost,
    RunStatus,
    RunUnreadable,
    RunView,
    create_flow,
    move_run,
    node_key,
    node_trigger,
    register_continuation,
    run_view,
    take_over,
)
from leadgate.operations.admin import Admin
from leadgate.review import decisions
from leadgate.runners.recovery import TurnRecovery
from leadgate.turns.providers.base import ModelEvent, ModelRequest
from leadgate.turns.providers.script import ScriptProvider
from leadgate.turns.runs import GAVE_UP_ACTION as TURN_GAVE_UP_ACTION
from leadgate.turns.runs import GAVE_UP_TEXT as TURN_GAVE_UP_TEXT
from leadgate.turns.runs import MAX_ATTEMPTS as TURN_MAX_ATTEMPTS
from leadgate.turns.runs import RUN_LEASE_MS as TURN_LEASE_MS
from tests.fakes import ClaimInDoubt, DownFor, lose_the_next_commit
from tests.helpers import (
    Org,
    blocked_on_a_lock,
    delete_agent,
    eventually,
    held_open,
    item_locked,
    make_agent,
    make_org,
    transitions_counted,
)
from tests.integration.test_log_leaks import MARKER, leaking
from tests.stack import Stack

LOST = (
    "its agent turn was taken in by an earlier attempt whose process stopped before the "
    "answer was stored; the turn is not run twice"
)


class Killed(BaseException):
    """The process dies here."""


class Mortal:
    """The script model, except that a worker prompt with ``#die`` kills the process (the
    first time) and one with ``#hold`` waits for :attr:`gate` (a process that stalls)."""

    def __init__(self) -> None:
        self.script = ScriptProvider()
        self.dies = True
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        last = request.messages[-1]
        if request.purpose == "worker" and last.role == "user":
            if "#die" in last.content and self.dies:
                self.dies = False
                raise Killed
            if "#hold" in last.content:
                self.entered.set()
                await self.gate.wait()
        async for event in self.script.stream(request):
            yield event


def die() -> None:
    """Wired as a callback that runs right after a commit: the process dies there."""
    raise Killed


@pytest.fixture
def clock() -> FakeClock:
    """The one clock both processes read."""
    return FakeClock()


@pytest.fixture
def mortal() -> Mortal:
    return Mortal()


@pytest.fixture
def first(make_stack: Callable[..., Stack], clock: FakeClock, mortal: Mortal) -> Stack:
    """The process that starts the run (and dies, or stalls)."""
    return make_stack(clock=clock, providers={"script": mortal})


@pytest.fixture
def second(make_stack: Callable[..., Stack], clock: FakeClock) -> Stack:
    """Another process on the same database: its recovery runner continues the run."""
    return make_stack(clock=clock)


async def _flow(stack: Stack, org: Org, nodes: list[dict[str, Any]]) -> str:
    async with stack.db.tx() as conn:
        flow = await create_flow(conn, stack.clock, stack.ids, org.id, "f", nodes)
    return str(flow["id"])


async def _reviewed_flow(
    stack: Stack, nodes: list[dict[str, Any]], org_name: str = "acme"
) -> tuple[Org, str]:
    """An organization (``org_name``) with a lead and a worker it reviews, and a flow of
    ``nodes``: the organization and the flow's id."""
    org = await make_org(stack, org_name)
    await make_agent(stack, org, "lead")
    await make_agent(stack, org, "worker", lead="lead")
    return org, await _flow(stack, org, nodes)


async def _paused_and_approved(stack: Stack, org_name: str = "acme") -> tuple[Org, str]:
    """An organization (``org_name``) with a lead and a reviewed worker, and the run of a
    flow (the worker's node, then an output) paused at the node, whose item the lead
    approved: the organization and the paused run's id."""
    org, flow_id = await _reviewed_flow(
        stack,
        [
            {"type": "agent", "agent": "worker", "prompt": "one #complete"},
            {"type": "output", "value": "end"},
        ],
        org_name,
    )
    paused_id = await stack.flows.start(org.id, flow_id)
    await stack.settle()  # the lead approves
    return org, paused_id


async def _view(stack: Stack, org: Org, run_id: str | None) -> RunView:
    # A run id read from a view (a continuation's resumedRunId) is typed optional.
    assert run_id is not None
    async with stack.db.read() as conn:
        return await run_view(conn, org.id, run_id)


async def _only_run(stack: Stack, **where: Any) -> str:
    r = t.flow_runs.c
    async with stack.db.read() as conn:
        [run_id] = (
            (await conn.execute(sa.select(r.id).filter_by(**where).order_by(r.created_at)))
            .scalars()
            .all()
        )
    return str(run_id)


async def _turns(stack: Stack, run_id: str, index: int) -> dict[str, int]:
    """Messages of node ``index``'s session by role, and the node's inbound events."""
    m, s, e = t.messages.c, t.sessions.c, t.inbound_events.c
    async with stack.db.read() as conn:
        roles = (
            await conn.execute(
                sa.select(m.role, sa.func.count().label("n"))
                .select_from(t.messages.join(t.sessions, s.id == m.session_id))
                .where(s.key == f"flow:{run_id}:{index}")
                .group_by(m.role)
            )
        ).all()
        events = await conn.scalar(
            sa.select(sa.func.count()).where(e.external_event_id == f"flow:{run_id}:{index}")
        )
    return {**{str(r.role): int(r.n) for r in roles}, "inboundEvents": int(events or 0)}


async def _lease_expires_at(stack: Stack, run_id: str) -> int | None:
    r = t.flow_runs.c
    async with stack.db.read() as conn:
        at = await conn.scalar(sa.select(r.lease_expires_at).where(r.id == run_id))
    return None if at is None else int(at)


async def _resumed(stack: Stack, org: Org, run_id: str) -> RunView:
    """The run that resumed run ``run_id`` (its one continuation's)."""
    [cont] = (await _view(stack, org, run_id))["continuations"]
    return await _view(stack, org, cont["resumedRunId"])


async def _resumes_to_the_end(stack: Stack, org: Org, run_id: str) -> None:
    """The resumer resumes run ``run_id``, paused on its gated node 0, once; the resumed
    run completes, and the node's message was taken in and answered once."""
    assert await drain(FlowResumer(stack.flows)) == 1
    done = await _resumed(stack, org, run_id)
    assert (done["status"], done["outputs"]) == (
        "completed",
        [PAUSED_OUTPUT, {"data": "after", "success": True}],
    )
    assert await _turns(stack, run_id, 0) == {
        "user": 1,
        "assistant": 1,
        "tool": 1,
        "inboundEvents": 1,
    }


async def _recovered_once(second: Stack, org: Org, run_id: str, *, turn_first: bool) -> None:
    """Both leases lapsed: turn recovery runs the node's turn again and flow recovery goes
    on from it, in either order (``turn_first``), and the lead approves. The run pauses
    on the node's one item, resumes and completes; one intake, answered once, no run
    left."""
    flow_recovery, turn_recovery = FlowRecovery(second.flows), TurnRecovery(second.turns)
    if turn_first:
        # The turn runs again and the lead approves before the run was paused: the
        # resumer waits for the pause (which wakes it).
        assert await drain(turn_recovery) == 1
        await second.settle()
        assert await drain(FlowResumer(second.flows)) == 0
        assert await drain(flow_recovery) == 1
    else:
        assert await drain(flow_recovery) == 1
        assert (await _view(second, org, run_id))["status"] == "waitingForHitl"
        assert await drain(turn_recovery) == 1
        await second.settle()
    paused = await _view(second, org, run_id)
    assert paused["status"] == "waitingForHitl"
    assert len(paused["continuations"]) == 1
    await _resumes_to_the_end(second, org, run_id)
    w = t.work_items.c
    async with second.db.read() as conn:
        assert (await conn.execute(sa.select(w.status))).scalars().all() == ["completed"]
        assert await conn.scalar(sa.select(sa.func.count()).select_from(t.turn_runs)) == 0
    assert (await drain(turn_recovery), await drain(flow_recovery)) == (0, 0)


async def _save_worker(stack: Stack, org: Org, worker: dict[str, Any], **change: Any) -> None:
    async with stack.db.tx() as conn:
        await agents_mod.save_agent(
            conn, stack.clock, stack.ids, org.id, agent_ref=worker["id"], **change
        )


async def test_a_run_killed_mid_node_is_continued_by_recovery_once_its_lease_lapses(
    first: Stack, second: Stack, clock: FakeClock
) -> None:
    org = await make_org(first)
    await make_agent(first, org, "plain")
    await make_agent(first, org, "lead")
    await make_agent(first, org, "worker", lead="lead")
    flow_id = await _flow(
        first,
        org,
        [
            {"type": "output", "value": "before"},
            {"type": "agent", "agent": "plain", "prompt": "first"},
            {"type": "agent", "agent": "worker", "prompt": "write it #complete"},
            {"type": "output", "value": "after"},
        ],
    )
    # The worker's submission commits and the process dies before the run is paused.
    first.turns.on_review_queued = die
    with pytest.raises(Killed):
        await first.flows.start(org.id, flow_id)
    run_id = await _only_run(first)
    cut = await _view(second, org, run_id)
    assert cut["status"] == "running"
    # The nodes done before it were kept.
    assert cut["outputs"] == [
        {"data": "before", "success": True},
        {"data": {"text": "Echo: first"}, "success": True},
    ]
    # The lead approves the dead turn's submission; the resumer waits for the pause (the
    # run's outputs are not its pause snapshot yet).
    await second.settle()
    assert await drain(FlowResumer(second.flows)) == 0
    recovery = FlowRecovery(second.flows)
    assert await drain(recovery) == 0  # its lease holds yet
    clock.advance(RUN_LEASE_MS + 1)
    assert await drain(recovery) == 1
    paused = await _view(second, org, run_id)
    assert paused["status"] == "waitingForHitl"
    assert paused["outputs"] == [*cut["outputs"], PAUSED_OUTPUT]
    assert paused["events"] == ["Flow run started", RECOVERED_EVENT, WAITING_EVENT]
    # The node paused on the turn the dead process took in: one turn, one continuation.
    assert len(paused["continuations"]) == 1
    assert await _turns(second, run_id, 2) == {
        "user": 1,
        "assistant": 1,
        "tool": 1,
        "inboundEvents": 1,
    }
    assert await _turns(second, run_id, 1) == {"user": 1, "assistant": 1, "inboundEvents": 1}
    assert await drain(FlowResumer(second.flows)) == 1
    done = await _resumed(second, org, run_id)
    assert done["status"] == "completed"
    assert done["outputs"] == [*paused["outputs"], {"data": "after", "success": True}]
    assert await drain(recovery) == 0


async def test_a_resumed_run_whose_process_died_is_continued(
    first: Stack, second: Stack, clock: FakeClock
) -> None:
    # The resumer commits the new run, executes it, and the process dies in its node.
    org, flow_id = await _reviewed_flow(
        first,
        [
            {"type": "agent", "agent": "worker", "prompt": "one #complete"},
            {"type": "agent", "agent": "worker", "prompt": "two #complete"},
            {"type": "output", "value": "end"},
        ],
    )
    paused_id = await first.flows.start(org.id, flow_id)
    await first.settle()
    first.turns.on_review_queued = die
    with pytest.raises(Killed):
        await FlowResumer(first.flows).run_once()
    resumed_id = await _only_run(first, resumed_from=paused_id)
    assert (await _view(second, org, resumed_id))["status"] == "running"
    clock.advance(RUN_LEASE_MS + 1)
    assert await drain(FlowRecovery(second.flows)) == 1
    resumed = await _view(second, org, resumed_id)
    assert resumed["status"] == "waitingForHitl"
    assert resumed["outputs"] == [PAUSED_OUTPUT, PAUSED_OUTPUT]
    assert (await _turns(second, resumed_id, 1))["user"] == 1
    await second.settle()
    assert await drain(FlowResumer(second.flows)) == 1
    done = await _resumed(second, org, resumed_id)
    assert (done["status"], done["outputs"][-1]) == ("completed", {"data": "end", "success": True})


@pytest.mark.parametrize("since", ["unchanged", "deactivated", "lead_added", "registered"])
async def test_a_node_whose_answer_was_stored_goes_on_with_it_without_a_second_turn(
    first: Stack, second: Stack, clock: FakeClock, since: str
) -> None:
    """The answer stored decides, whatever the worker is now: deactivated since, the run
    failed (agent.inactive) though its node had answered. ``registered``: the worker had
    a lead when the node began (its continuation registered) and none at the turn's
    intake; the continuation is closed (it waited on a completed run for ever)."""
    org = await make_org(first)
    await make_agent(first, org, "lead")
    plain = await make_agent(first, org, "plain")
    flow_id = await _flow(
        first,
        org,
        [{"type": "agent", "agent": "plain", "prompt": "one"}, {"type": "output", "value": 2}],
    )
    # The dead executor got as far as node 0's turn (its answer stored), not its output.
    async with first.db.tx() as conn:
        lease = await first.flows.new_run(conn, org.id, flow_id, [], 0, None)
        if since == "registered":
            await register_continuation(
                conn,
                first.clock,
                first.ids,
                org_id=org.id,
                run_id=lease.run_id,
                node_index=0,
                agent_id=str(plain["id"]),
                session_key=node_key(lease.run_id, 0),
            )
    await first.turns.run(node_trigger(org.id, lease.run_id, 0, str(plain["id"]), "one"))
    if since == "deactivated":
        await _save_worker(second, org, plain, active=False)
    elif since == "lead_added":
        await _save_worker(second, org, plain, lead="lead")
    clock.advance(RUN_LEASE_MS + 1)
    assert await drain(FlowRecovery(second.flows)) == 1
    run = await _view(second, org, lease.run_id)
    assert run["status"] == "completed"
    assert run["outputs"] == [
        {"data": {"text": "Echo: one"}, "success": True},
        {"data": 2, "success": True},
    ]
    assert [c["status"] for c in run["continuations"]] == (
        ["closed"] if since == "registered" else []
    )
    assert await _turns(second, lease.run_id, 0) == {"user": 1, "assistant": 1, "inboundEvents": 1}


async def test_recovery_knows_when_the_earliest_run_lease_lapses(
    first: Stack, second: Stack, clock: FakeClock
) -> None:
    """Each pass's read also learns when the earliest running run's lease lapses: the
    runner loop sleeps no longer than ``due_in_s``, so a stalled executor's run is
    continued when its lease lapses, not at the poll (test_runner_wakes runs the loop)."""
    org = await make_org(first)
    flow_id = await _flow(first, org, [{"type": "output", "value": 1}])
    recovery = FlowRecovery(second.flows)
    assert not await recovery.run_once()
    assert recovery.due_in_s() is None  # no running run: the poll alone
    async with first.db.tx() as conn:  # its executor never starts it
        lease = await first.flows.new_run(conn, org.id, flow_id, [], 0, None)
    assert not await recovery.run_once()
    assert recovery.due_in_s() == (RUN_LEASE_MS + 1) / 1000
    clock.advance(RUN_LEASE_MS)
    assert not await recovery.run_once()  # exactly the lease: still held
    assert recovery.due_in_s() == 0.001
    clock.advance(1)
    assert recovery.due_in_s() == 0
    assert await recovery.run_once()
    assert (await _view(second, org, lease.run_id))["status"] == "completed"
    assert not await recovery.run_once()
    assert recovery.due_in_s() is None


async def test_a_node_whose_answer_died_with_its_process_fails_the_run_saying_so(
    first: Stack, second: Stack, clock: FakeClock
) -> None:
    org = await make_org(first)
    await make_agent(first, org, "plain")
    flow_id = await _flow(
        first,
        org,
        [
            {"type": "agent", "agent": "plain", "prompt": "one"},
            {"type": "agent", "agent": "plain", "prompt": "two #die"},
            {"type": "output", "value": 3},
        ],
    )
    with pytest.raises(Killed):
        await first.flows.start(org.id, flow_id)
    run_id = await _only_run(first)
    clock.advance(RUN_LEASE_MS + 1)
    recovery = FlowRecovery(second.flows)
    assert await drain(recovery) == 1
    run = await _view(second, org, run_id)
    assert (run["status"], run["error"]) == ("failed", f"node 1: {LOST}")
    assert run["events"][-1] == f"Flow run failed: node 1: {LOST}"
    assert run["outputs"] == [{"data": {"text": "Echo: one"}, "success": True}]
    # The second process's model would have answered: it was never asked.
    assert await _turns(second, run_id, 1) == {"user": 1, "inboundEvents": 1}
    assert await drain(recovery) == 0  # failed once, not retried for ever


async def test_the_stalled_executor_writes_nothing_once_recovery_took_its_run(
    first: Stack, second: Stack, clock: FakeClock, mortal: Mortal
) -> None:
    org, flow_id = await _reviewed_flow(
        first,
        [
            {"type": "agent", "agent": "worker", "prompt": "slow #hold #complete"},
            {"type": "output", "value": "after"},
        ],
    )
    stalled = asyncio.create_task(first.flows.start(org.id, flow_id))
    await asyncio.wait_for(mortal.entered.wait(), 10)
    # The first process stalls in its model call past the lease (nothing renews it: its
    # renewals come every 30 real seconds); another process takes the run over.
    clock.advance(RUN_LEASE_MS + 1)
    assert await drain(FlowRecovery(second.flows)) == 1
    run_id = await _only_run(second)
    paused = await _view(second, org, run_id)
    assert paused["status"] == "waitingForHitl"
    # The stalled process comes back: its turn ends, and its pause is refused.
    mortal.gate.set()
    with pytest.raises(RunLeaseLost) as lost:
        await stalled
    assert lost.value.rule == "flowRun.lease"
    after = await _view(second, org, run_id)
    assert (after["status"], after["outputs"], after["events"]) == (
        "waitingForHitl",
        paused["outputs"],
        paused["events"],
    )
    assert len(after["continuations"]) == 1
    assert (await _turns(second, run_id, 0))["user"] == 1
    # Its turn's submission is the one the flow waits on.
    await second.settle()
    assert await drain(FlowResumer(second.flows)) == 1
    assert (await _resumed(second, org, run_id))["status"] == "completed"


async def test_two_recoverers_race_for_a_lapsed_run_and_one_wins(
    first: Stack, second: Stack, make_stack: Callable[..., Stack], clock: FakeClock
) -> None:
    third = make_stack(clock=clock)
    org = await make_org(first)
    await make_agent(first, org, "plain")
    flow_id = await _flow(
        first,
        org,
        [{"type": "agent", "agent": "plain", "prompt": "one"}, {"type": "output", "value": 2}],
    )
    # A run committed (by a start, or a resume) whose process died before executing it.
    async with first.db.tx() as conn:
        lease = await first.flows.new_run(conn, org.id, flow_id, [], 0, None)
    clock.advance(RUN_LEASE_MS + 1)
    # The fence: both saw the same lapsed lease; only the first claim matches.
    async with second.db.tx() as conn:
        won = await take_over(conn, clock, second.ids, lease.run_id, lease.token, None)
    async with third.db.tx() as conn:
        beaten = await take_over(conn, clock, third.ids, lease.run_id, lease.token, None)
    assert won is not None and beaten is None
    assert won.token != lease.token
    # The original executor, back while the run is still running: refused, not written.
    with pytest.raises(RunLeaseLost):
        await first.flows.renew(lease)
    async with first.db.tx() as conn:
        with pytest.raises(RunLeaseLost):
            await move_run(
                conn,
                clock,
                first.ids,
                lease.run_id,
                src=RunStatus.running,
                dst=RunStatus.running,
                token=lease.token,
                values={"outputs": ["stale"]},
            )
    assert (await _view(second, org, lease.run_id))["outputs"] == []
    clock.advance(RUN_LEASE_MS + 1)
    # Both runners at once (FOR UPDATE SKIP LOCKED on PostgreSQL): one claims and runs it.
    claimed = await asyncio.gather(
        FlowRecovery(second.flows).run_once(), FlowRecovery(third.flows).run_once()
    )
    assert sorted(claimed) == [False, True]
    run = await _view(second, org, lease.run_id)
    assert run["status"] == "completed"
    assert run["events"].count(RECOVERED_EVENT) == 1
    assert await _turns(second, lease.run_id, 0) == {"user": 1, "assistant": 1, "inboundEvents": 1}
    # Nor, once it ended, execute it or end it otherwise.
    with pytest.raises(RunLeaseLost):
        await first.flows.execute(lease)
    async with first.db.tx() as conn:
        with pytest.raises(RunLeaseLost):
            await move_run(
                conn,
                clock,
                first.ids,
                lease.run_id,
                src=RunStatus.running,
                dst=RunStatus.failed,
                token=lease.token,
            )


async def test_a_run_of_a_process_known_dead_is_taken_over_at_once(
    first: Stack, second: Stack
) -> None:
    org = await make_org(first)
    flow_id = await _flow(first, org, [{"type": "output", "value": 1}])
    first.turns.owner = lambda: "prc_dead_process"  # never registered: known dead
    async with first.db.tx() as conn:
        lease = await first.flows.new_run(conn, org.id, flow_id, [], 0, None)
    assert await drain(FlowRecovery(second.flows)) == 1  # no wait for the lease
    assert (await _view(second, org, lease.run_id))["status"] == "completed"


async def test_a_live_executor_renews_its_lease_while_a_node_runs(
    first: Stack, second: Stack, clock: FakeClock, mortal: Mortal
) -> None:
    org = await make_org(first)
    await make_agent(first, org, "plain")
    flow_id = await _flow(first, org, [{"type": "agent", "agent": "plain", "prompt": "#hold"}])
    first.flows.renew_every_s = 0.01
    running = asyncio.create_task(first.flows.start(org.id, flow_id))
    await asyncio.wait_for(mortal.entered.wait(), 10)
    run_id = await _only_run(second)
    # The turn runs past the lease; the renewals keep it ahead of the clock.
    clock.advance(3 * RUN_LEASE_MS)

    async def renewed() -> bool:
        at = await _lease_expires_at(second, run_id)
        return at is not None and at > clock.now_ms()

    await eventually(renewed, 10)
    assert not await FlowRecovery(second.flows).run_once()
    mortal.gate.set()
    await running
    run = await _view(second, org, run_id)
    assert run["status"] == "completed"
    assert RECOVERED_EVENT not in run["events"]
    assert await _lease_expires_at(second, run_id) is None  # given up with the run


class Faulty:
    """The script model, except that the database fails under a ``#fault`` prompt."""

    def __init__(self) -> None:
        self.script = ScriptProvider()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        if "#fault" in request.messages[-1].content:
            raise Unavailable("database is locked", rule="service.unavailable")
        async for event in self.script.stream(request):
            yield event


async def test_a_database_fault_mid_run_names_the_run_that_recovery_continues(
    make_stack: Callable[..., Stack], second: Stack, clock: FakeClock
) -> None:
    """``flow run`` met a database fault after the run was recorded: the error names
    the run and says not to start it again (a second run would do the work twice); the
    run stays running and recovery ends it (here: its node's turn was taken in and
    left no answer, so the run fails saying so rather than running the turn twice)."""
    faulty = make_stack(clock=clock, providers={"script": Faulty()})
    org = await make_org(faulty)
    await make_agent(faulty, org, "plain")
    flow_id = await _flow(faulty, org, [{"type": "agent", "agent": "plain", "prompt": "#fault"}])
    with pytest.raises(Unavailable) as info:
        await faulty.flows.start(org.id, flow_id)
    run_id = await _only_run(faulty)
    assert info.value.rule == "flow.interrupted"
    assert run_id in info.value.message and "do not start the flow again" in info.value.message
    # The fault's rule, not its message (which speaks to the request that met it).
    assert "(turn.interrupted)" in info.value.message
    assert "database is locked" not in info.value.message
    assert (await _view(second, org, run_id))["status"] == "running"
    clock.advance(RUN_LEASE_MS + 1)
    assert await FlowRecovery(second.flows).run_once()
    ended = await _view(second, org, run_id)
    assert ended["status"] == "failed" and LOST in (ended["error"] or "")
    assert await _turns(second, run_id, 0) == {"user": 1, "inboundEvents": 1}


async def test_a_second_continuation_of_a_node_is_a_no_op_that_returns_the_first(
    second: Stack,
) -> None:
    """One continuation per node (unique index, migration 0016): registering a node's
    continuation again (another attempt that got past the fence) inserts nothing and
    names the row that is there; no IntegrityError escapes."""
    org = await make_org(second)

    async def register(conn: Conn, node_index: int = 2) -> str:
        return await register_continuation(
            conn,
            second.clock,
            second.ids,
            org_id=org.id,
            run_id="run_x",
            node_index=node_index,
            agent_id="agt_x",
            session_key="flow:run_x:2",
        )

    async with second.db.tx() as conn:
        first_id = await register(conn)
    async with second.db.tx() as conn:
        again = await register(conn)
        other = await register(conn, node_index=3)
    assert again == first_id != other
    c = t.continuations.c
    async with second.db.read() as conn:
        rows = (await conn.execute(sa.select(c.id, c.node_index).where(c.run_id == "run_x"))).all()
    assert sorted((r.node_index, r.id) for r in rows) == [(2, first_id), (3, other)]


def _unrecoverable() -> float:
    return float(METRICS.flow_runs_unrecoverable._value.get())


async def _recovery_attempts(stack: Stack, run_id: str) -> int:
    r = t.flow_runs.c
    async with stack.db.read() as conn:
        return int(await conn.scalar(sa.select(r.recovery_attempts).where(r.id == run_id)))


async def _gives_up_on_an_unreadable_run(
    second: Stack, clock: FakeClock, caplog: pytest.LogCaptureFixture, run_id: str
) -> dict[str, Any]:
    """Recovery attempts the run MAX_RECOVERIES times (each a lease apart), then fails
    it once: the run as it ended."""
    recovery = FlowRecovery(second.flows)
    counted = _unrecoverable()
    for attempt in range(1, MAX_RECOVERIES):
        clock.advance(RUN_LEASE_MS + 1)
        with pytest.raises(RunUnreadable) as info:
            await recovery.run_once()
        assert info.value.rule == "flowRun.unreadable"
        assert await _recovery_attempts(second, run_id) == attempt
        r = t.flow_runs.c
        async with second.db.read() as conn:
            status = await conn.scalar(sa.select(r.status).where(r.id == run_id))
        assert status == "running"
    clock.advance(RUN_LEASE_MS + 1)
    with caplog.at_level(logging.ERROR, logger="leadgate.flows"):
        assert await recovery.run_once()
    r, e = t.flow_runs.c, t.flow_run_events.c
    async with second.db.read() as conn:
        run_row = (await conn.execute(sa.select(r.status, r.error).where(r.id == run_id))).one()
        status, error = run_row.status, run_row.error
        events = (
            (
                await conn.execute(
                    sa.select(e.text).where(e.run_id == run_id).order_by(e.created_at, e.id)
                )
            )
            .scalars()
            .all()
        )
    # Not claimed again, however long it waits; logged and counted once.
    clock.advance(10 * RUN_LEASE_MS)
    assert await drain(recovery) == 0
    assert _unrecoverable() == counted + 1
    assert len([rec for rec in caplog.records if UNRECOVERABLE_RULE in rec.getMessage()]) == 1
    assert events.count(RECOVERED_EVENT) == MAX_RECOVERIES
    assert events[-1] == f"Flow run failed: {error}"
    return {"status": status, "error": error}


async def test_a_run_whose_flow_is_gone_is_failed_after_a_few_recoveries_not_retried_for_ever(
    first: Stack, second: Stack, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    org = await make_org(first)
    flow_id = await _flow(first, org, [{"type": "output", "value": 1}])
    async with first.db.tx() as conn:
        lease = await first.flows.new_run(conn, org.id, flow_id, [], 0, None)
        await conn.execute(t.flows.delete().where(t.flows.c.id == flow_id))
    ended = await _gives_up_on_an_unreadable_run(second, clock, caplog, lease.run_id)
    assert ended == {
        "status": "failed",
        "error": f"{UNRECOVERABLE_RULE}: recovery gave up after {MAX_RECOVERIES} attempts to "
        f"continue the run: flow run {lease.run_id}: its flow {flow_id} no longer exists",
    }


async def test_a_run_whose_outputs_cannot_be_read_is_failed_not_continued_from_a_made_up_node(
    first: Stack, second: Stack, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    org = await make_org(first)
    flow_id = await _flow(
        first, org, [{"type": "output", "value": 1}, {"type": "output", "value": 2}]
    )
    async with first.db.tx() as conn:
        lease = await first.flows.new_run(conn, org.id, flow_id, [], 0, None)
        if first.db.is_sqlite:
            # SQLite stores any text: one that is no JSON at all.
            await conn.execute(
                sa.text("UPDATE flow_runs SET outputs = '{not json' WHERE id = :id"),
                {"id": lease.run_id},
            )
        else:
            # PostgreSQL refuses text that is no JSON: JSON that is not a list (list() of
            # it made the run skip a node before).
            await conn.execute(
                t.flow_runs.update()
                .where(t.flow_runs.c.id == lease.run_id)
                .values(outputs={"x": 1})
            )
    ended = await _gives_up_on_an_unreadable_run(second, clock, caplog, lease.run_id)
    assert ended["status"] == "failed"
    assert ("do not decode" if first.db.is_sqlite else "are not the lists") in ended["error"]
    assert ended["error"].startswith(
        f"{UNRECOVERABLE_RULE}: recovery gave up after {MAX_RECOVERIES} attempts to continue "
        f"the run: flow run {lease.run_id}: its outputs or its flow's nodes "
    )


async def test_a_run_whose_recoveries_all_died_silently_is_failed_without_another_attempt(
    first: Stack, second: Stack, clock: FakeClock
) -> None:
    """Attempts that kill their process count too (in the claim): the one after the last
    is not executed."""
    org = await make_org(first)
    flow_id = await _flow(first, org, [{"type": "output", "value": 1}])
    async with first.db.tx() as conn:
        lease = await first.flows.new_run(conn, org.id, flow_id, [], 0, None)
    for attempt in range(1, MAX_RECOVERIES + 1):
        clock.advance(RUN_LEASE_MS + 1)
        claim = await claim_lapsed(second.flows)  # ... and its process dies
        assert claim is not None and claim.attempt == attempt
    clock.advance(RUN_LEASE_MS + 1)
    counted = _unrecoverable()
    assert await drain(FlowRecovery(second.flows)) == 1
    run = await _view(second, org, lease.run_id)
    assert (run["status"], run["outputs"], run["error"]) == (
        "failed",
        [],
        f"{UNRECOVERABLE_RULE}: recovery gave up after {MAX_RECOVERIES} attempts to continue "
        "the run: each attempt stopped before the run could go on",
    )
    assert run["events"].count(RECOVERED_EVENT) == MAX_RECOVERIES
    assert _unrecoverable() == counted + 1


async def test_attempts_a_database_fault_ended_do_not_count_towards_giving_up(
    first: Stack, second: Stack, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outage spanning more attempts than MAX_RECOVERIES must not fail a run that can
    go on: each attempt the database failed under is taken back."""
    org = await make_org(first)
    flow_id = await _flow(first, org, [{"type": "output", "value": 1}])
    async with first.db.tx() as conn:
        lease = await first.flows.new_run(conn, org.id, flow_id, [], 0, None)
    recovery = FlowRecovery(second.flows)
    execute = second.flows.execute

    async def outage(lease: Any) -> None:
        raise Unavailable("database is locked", rule="service.unavailable")

    monkeypatch.setattr(second.flows, "execute", outage)
    for _ in range(MAX_RECOVERIES + 2):
        clock.advance(RUN_LEASE_MS + 1)
        with pytest.raises(Unavailable):
            await recovery.run_once()
        assert await _recovery_attempts(second, lease.run_id) == 0
    monkeypatch.setattr(second.flows, "execute", execute)
    clock.advance(RUN_LEASE_MS + 1)
    assert await recovery.run_once()
    run = await _view(second, org, lease.run_id)
    assert (run["status"], run["outputs"]) == ("completed", [{"data": 1, "success": True}])


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_resumer_pass_that_skips_a_locked_continuation_looks_again_soon(
    second: Stack,
) -> None:
    """PostgreSQL: the lead approved a flow node's item, but its continuation is
    row-locked by another transaction (held open here; in the service another replica's
    pass, which may end in a database fault and roll back with no wake-up to follow).
    The resumer's read finds the continuation settled, its locked pick skips it: the
    loop sleeps at most LOCKED_RECHECK_MS, not the poll, and once the lock is gone the
    next pass resumes the run. A pass that finds nothing is its one read and leaves
    nothing due."""
    org, paused_id = await _paused_and_approved(second)
    resumer = FlowResumer(second.flows)
    lock = sa.select(t.continuations.c.id).with_for_update()
    async with held_open(second.db, lambda conn: conn.execute(lock)):
        assert not await resumer.run_once()
        assert resumer.due_in_s() == LOCKED_RECHECK_MS / 1000
    assert await resumer.run_once()
    done = await _resumed(second, org, paused_id)
    assert done["status"] == "completed"
    with second.db.record_statements() as idle:
        assert not await resumer.run_once()
    assert [sql.split()[0] for sql in idle] == ["SELECT"], idle
    assert resumer.due_in_s() is None


def _node_rows(paused_id: str) -> dict[str, sa.Select[Any]]:
    """The rows the resumer's pick joins to the continuation of node 0 of run
    ``paused_id``, each as a statement that selects it: its run, the node's session and
    the node's work item."""
    r, s, w = t.flow_runs.c, t.sessions.c, t.work_items.c
    session = sa.select(s.id).where(s.key == f"flow:{paused_id}:0")
    return {
        "run": sa.select(r.id).where(r.id == paused_id),
        "session": session,
        "item": sa.select(w.id).where(w.session_id == session.scalar_subquery()),
    }


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
@pytest.mark.parametrize("joined", ["run", "session", "item"])
async def test_a_row_lock_on_a_settled_continuations_run_session_or_item_does_not_hide_it(
    second: Stack, joined: str
) -> None:
    """PostgreSQL: the lead approved a flow node's item, and another transaction holds a
    row lock on the paused run, the node's session or its item (a session event's
    counter, a decision that lost its race to the approval, any other statement). The
    pick locked every row of its join (``FOR UPDATE SKIP LOCKED``) and skipped the
    continuation at each look while that lock was held; it locks the continuation alone
    now. The pass takes it: a move that writes the locked row (the item's, and its
    session's event counter) waits for it as any writer does, the run's is not written
    at all, and the flow is resumed."""
    org, paused_id = await _paused_and_approved(second)
    resumer = FlowResumer(second.flows)
    lock = _node_rows(paused_id)[joined].with_for_update()
    async with held_open(second.db, lambda conn: conn.execute(lock)):
        passing = asyncio.create_task(resumer.run_once())
        await blocked_on_a_lock(second.db, passing)
        assert passing.done() == (joined == "run")
    assert await passing
    assert resumer.due_in_s() is None
    done = await _resumed(second, org, paused_id)
    assert (done["status"], done["outputs"][-1]) == ("completed", {"data": "end", "success": True})


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_resume_waits_for_a_held_item_no_longer_than_its_bound_and_others_go_on(
    second: Stack, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """PostgreSQL: two flows' nodes were approved, and another transaction holds the
    first one's item row-locked far longer than the resumer's lock wait is bounded
    (``lock_wait_s``; ``[database] busy_timeout_s`` in the service). The pass that takes
    that continuation gives up waiting at the bound (lock_timeout, 55P03), rolls back
    and leaves it for LOCKED_RECHECK_MS; the next pass resumes the other flow, and the
    one after finds only the left one and sleeps until its look again: no pass waits
    past the bound, nothing is logged as an error. Once the lock is gone the left flow
    is resumed. Before, the move waited for the lock with no bound, and every other
    approved flow with it."""
    left, right = [await _paused_and_approved(second, name) for name in ("left", "right")]
    async with second.db.read() as conn:
        held = str(await conn.scalar(_node_rows(left[1])["item"]))
    resumer = FlowResumer(second.flows, lock_wait_s=0.2)

    async def resumed(org_and_run: tuple[Any, str]) -> bool:
        [cont] = (await _view(second, *org_and_run))["continuations"]
        return bool(cont["status"] == "resumed")

    with caplog.at_level(logging.INFO, logger="leadgate.flows"):
        async with held_open(second.db, item_locked(held)):
            assert await asyncio.wait_for(resumer.run_once(), 5)
            assert await asyncio.wait_for(resumer.run_once(), 5)
            assert (await resumed(left), await resumed(right)) == (False, True)
            assert not await asyncio.wait_for(resumer.run_once(), 5)
            assert resumer.due_in_s() == LOCKED_RECHECK_MS / 1000
            clock.advance(LOCKED_RECHECK_MS)  # (the look again meets the lock again)
            assert await asyncio.wait_for(resumer.run_once(), 5)
            assert not await resumed(left)
    said = [r for r in caplog.records if r.name.startswith("leadgate.flows")]
    assert said and all(r.levelno == logging.INFO for r in said), said
    clock.advance(2 * LOCKED_RECHECK_MS)  # (held again when taken again: twice as long)
    assert await resumer.run_once()
    done = await _resumed(second, *left)
    assert (done["status"], done["outputs"][-1]) == ("completed", {"data": "end", "success": True})
    assert not await resumer.run_once()
    assert resumer.due_in_s() is None


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_continuation_whose_item_stays_held_is_taken_again_less_often_and_waits_no_more(
    second: Stack, clock: FakeClock
) -> None:
    """PostgreSQL: another transaction holds a flow node's approved item row-locked for
    long. The resumer's first take of its continuation waits the bound (``lock_wait_s``)
    and leaves it; every take after that, while the item is held, waited the bound again,
    LOCKED_RECHECK_MS apart: the resumer loop stayed blocked nearly all the time. A take
    again now does not wait for the held row at all (each pass ends well within the
    bound), and the continuation is left for twice as long each time, up to
    LEFT_AT_MOST_MS; the passes between take no notice of it. Once the lock is gone the
    next take (within LEFT_AT_MOST_MS) resumes the flow, once."""
    org, paused_id = await _paused_and_approved(second)
    async with second.db.read() as conn:
        held = str(await conn.scalar(_node_rows(paused_id)["item"]))
    # Real time (PostgreSQL's lock_timeout): a take again must end within half of it,
    # which a loaded machine's passes could come near at 2 s (1 s each).
    bound = 4.0
    resumer = FlowResumer(second.flows, lock_wait_s=bound)
    gaps: list[float | None] = []
    async with held_open(second.db, item_locked(held)):
        assert await asyncio.wait_for(resumer.run_once(), bound + 5)  # waits the bound
        for _ in range(7):
            assert not await resumer.run_once()  # left: nothing to take meanwhile
            gaps.append(resumer.due_in_s())
            clock.advance(round((gaps[-1] or 0) * 1000))
            assert await asyncio.wait_for(resumer.run_once(), bound / 2)  # taken again
    assert gaps == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert gaps[-1] == LEFT_AT_MOST_MS / 1000
    assert not await resumer.run_once()
    assert resumer.due_in_s() == LEFT_AT_MOST_MS / 1000
    clock.advance(LEFT_AT_MOST_MS)
    assert await resumer.run_once()
    done = await _resumed(second, org, paused_id)
    assert (done["status"], done["outputs"][-1]) == ("completed", {"data": "end", "success": True})
    assert not await resumer.run_once()
    assert resumer.due_in_s() is None
    r = t.flow_runs.c
    async with second.db.read() as conn:
        resumed = sa.select(sa.func.count()).where(r.resumed_from == paused_id)
        assert await conn.scalar(resumed) == 1


class _TickingClock(FakeClock):
    """A :class:`FakeClock` that, once ``tick_ms`` is set, moves that far at each read:
    time passing while a pass runs (its reads take some)."""

    tick_ms = 0

    def now_ms(self) -> int:
        now = super().now_ms()
        self.advance(self.tick_ms)
        return now


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_left_continuation_whose_time_comes_during_a_pass_is_not_forgotten(
    make_stack: Callable[..., Stack],
) -> None:
    """PostgreSQL: a continuation left because its item stayed held is passed over by the
    reads until its time comes. A pass that begins just before that time, and whose read
    finds nothing else, ends just after it: the continuation is still left (due now), and
    its take comes at once without waiting for the held row. The pass forgot it, reading
    the clock again after its read: the loop slept the poll, and the next take waited
    the whole bound for the row again, the resumer loop blocked meanwhile."""
    clock = _TickingClock()
    stack = make_stack(clock=clock)
    org, paused_id = await _paused_and_approved(stack)
    async with stack.db.read() as conn:
        held = str(await conn.scalar(_node_rows(paused_id)["item"]))
    bound = 2.0
    resumer = FlowResumer(stack.flows, lock_wait_s=bound)
    async with held_open(stack.db, item_locked(held)):
        assert await asyncio.wait_for(resumer.run_once(), bound + 5)  # waits the bound
        assert resumer.due_in_s() is None  # (True: the loop passes again at once)
        assert not await resumer.run_once()  # left: nothing to take meanwhile
        assert resumer.due_in_s() == LOCKED_RECHECK_MS / 1000
        clock.advance(LOCKED_RECHECK_MS - 1)
        clock.tick_ms = 1  # its time comes as the next pass reads
        assert not await resumer.run_once()
        clock.tick_ms = 0
        assert resumer.due_in_s() == 0
        assert await asyncio.wait_for(resumer.run_once(), bound / 2)  # taken again
    clock.advance(LEFT_AT_MOST_MS)
    assert await resumer.run_once()
    done = await _resumed(stack, org, paused_id)
    assert done["status"] == "completed"


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_left_continuation_settled_elsewhere_is_forgotten_under_load(
    second: Stack, clock: FakeClock
) -> None:
    """PostgreSQL: a resumer leaves a continuation whose item another transaction holds;
    once the row is free another replica resumes it. Meanwhile the reads keep finding
    work (here another settled continuation, row-locked, which each pick skips), so no
    pass of the first resumer finds nothing, the one kind of pass that forgot a left
    continuation: it kept it for as long as the load lasted. Once its time came
    LEFT_AT_MOST_MS ago, a pass looks it up, finds it settled and forgets it."""
    left, busy = [await _paused_and_approved(second, name) for name in ("left", "busy")]
    c = t.continuations.c
    async with second.db.read() as conn:
        held = str(await conn.scalar(_node_rows(left[1])["item"]))
        settled = str(await conn.scalar(sa.select(c.id).where(c.run_id == left[1])))
    busy_lock = sa.select(c.id).where(c.run_id == busy[1]).with_for_update()
    resumer = FlowResumer(second.flows, lock_wait_s=0.2)
    async with held_open(second.db, lambda conn: conn.execute(busy_lock)):
        async with held_open(second.db, item_locked(held)):
            assert await asyncio.wait_for(resumer.run_once(), 5)  # waits the bound: left
        assert list(resumer._left) == [settled]
        assert await FlowResumer(second.flows).run_once()  # another replica resumes it
        [cont] = (await _view(second, *left))["continuations"]
        assert cont["status"] == "resumed"
        clock.advance(LOCKED_RECHECK_MS + LEFT_AT_MOST_MS)
        assert not await resumer.run_once()  # the busy one found, its pick skipped
        assert resumer.due_in_s() == LOCKED_RECHECK_MS / 1000
        assert resumer._left == {}


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_cancel_that_commits_after_the_pick_read_the_item_ends_the_run_not_resumes_it(
    second: Stack,
) -> None:
    """PostgreSQL: an operator cancels a flow node's approved item (approved -> cancelled
    is a move of the table), uncommitted while the resumer's pass reads the item
    approved and takes the continuation (its pick locks the continuation alone). The
    pass's fenced move of the item waits for the cancel, then matches nothing: the pass
    is rolled back, new run and all, and the next one ends the paused run as cancelled.
    The move's failure was logged and the pass committed anyway: the flow resumed while
    its item ended cancelled, both moves won."""
    org, paused_id = await _paused_and_approved(second)
    async with second.db.read() as conn:
        item_id = str(await conn.scalar(_node_rows(paused_id)["item"]))

    async def cancel(conn: Conn) -> None:
        item = await workitems.get(conn, item_id)
        await decisions.cancel(conn, second.clock, second.ids, item, "user:ops")

    resumer = FlowResumer(second.flows)
    async with held_open(second.db, cancel):
        passing = asyncio.create_task(resumer.run_once())
        await blocked_on_a_lock(second.db, passing)
        assert not passing.done()  # it took the continuation, and waits for the item
    assert await passing  # rolled back: the loop looks again at once
    ended = await drain(resumer)
    run = await _view(second, org, paused_id)
    assert (run["status"], run["error"]) == (
        "failed",
        f"node 0: the work item {item_id} was cancelled",
    )
    [cont] = run["continuations"]
    assert (cont["status"], cont["resumedRunId"]) == ("closed", None)
    r, w = t.flow_runs.c, t.work_items.c
    async with second.db.read() as conn:
        assert await conn.scalar(sa.select(sa.func.count()).where(r.resumed_from == paused_id)) == 0
        assert await conn.scalar(sa.select(w.status).where(w.id == item_id)) == "cancelled"
        assert await _continuation_delivery(conn, item_id) == "cancelled"
    assert ended == 1


async def _continuation_delivery(conn: Conn, item_id: str) -> str:
    """The status of the delivery an approval wrote for a flow node's item."""
    d = t.deliveries.c
    return str(await conn.scalar(sa.select(d.status).where(d.work_item_id == item_id)))


async def test_an_item_cancelled_after_its_approval_ends_its_continuations_delivery(
    second: Stack,
) -> None:
    """A flow node's item approved (its approval wrote the ``continuation`` delivery the
    resumer acts on) and then cancelled by an operator: the resumer ends the paused run
    and the delivery ``cancelled``. It stayed ``continuation`` for good, a delivery
    neither sent nor ended that no runner would ever take."""
    org, paused_id = await _paused_and_approved(second)
    async with second.db.tx() as conn:
        item_id = str(await conn.scalar(_node_rows(paused_id)["item"]))
        assert await _continuation_delivery(conn, item_id) == "continuation"
        item = await workitems.get(conn, item_id)
        await decisions.cancel(conn, second.clock, second.ids, item, "user:ops")
    assert await drain(FlowResumer(second.flows)) == 1
    assert (await _view(second, org, paused_id))["status"] == "failed"
    async with second.db.read() as conn:
        assert await _continuation_delivery(conn, item_id) == "cancelled"


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_recovery_claim_in_doubt_continues_its_run_soon_counted_once(
    first: Stack, second: Stack, clock: FakeClock, claim_in_doubt: ClaimInDoubt
) -> None:
    """The recovery claim's COMMIT answer was lost: the claim landed (or lands after the
    next pass looked for it). The run sat under a token nobody held until its lease
    lapsed (2 minutes), and the next claim counted a second attempt for the outage (a
    step nearer to giving the run up). The next pass looks for the token first, and
    again a second on, and continues the run it finds under that claim. (PostgreSQL
    only: a SQLite COMMIT is never in doubt.)"""
    org = await make_org(first)
    flow_id = await _flow(first, org, [{"type": "output", "value": 1}])
    async with first.db.tx() as conn:
        lease = await first.flows.new_run(conn, org.id, flow_id, [], 0, None)
    recovery = FlowRecovery(second.flows)
    clock.advance(RUN_LEASE_MS + 1)  # its executor stopped
    claim_in_doubt.arm(second.db)
    with pytest.raises(Unavailable) as raised:
        await recovery.run_once()
    assert raised.value.in_doubt
    await claim_in_doubt.until_found(recovery, clock)
    assert await recovery.run_once()
    run = await _view(second, org, lease.run_id)
    assert (run["status"], run["outputs"]) == ("completed", [{"data": 1, "success": True}])
    assert run["events"].count(RECOVERED_EVENT) == 1
    assert await _recovery_attempts(second, lease.run_id) == 1
    assert not await recovery.run_once()
    assert recovery.due_in_s() is None


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_run_resumed_by_a_commit_in_doubt_is_continued_soon(
    first: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The resumer's COMMIT answer was lost after it inserted the resumed run, leased to
    its process: nothing executed the run until its lease lapsed (2 minutes) and flow
    recovery continued it, as a recovery attempt. The flow recovery is woken and looks
    for the run's token at once, and continues it. (PostgreSQL only: a SQLite COMMIT is
    never in doubt.)"""
    org, paused_id = await _paused_and_approved(first)
    woken: list[bool] = []
    first.flows.recovery_due = lambda: woken.append(True)  # (its loop's wake)
    lose_the_next_commit(monkeypatch, first.db, alone=False)
    completed = transitions_counted("approved", "completed")
    with pytest.raises(Unavailable) as raised:
        await FlowResumer(first.flows).run_once()
    assert raised.value.in_doubt and woken
    resumed_id = await _only_run(first, resumed_from=paused_id)
    assert (await _view(first, org, resumed_id))["status"] == "running"
    assert transitions_counted("approved", "completed") == completed  # (in doubt)
    recovery = FlowRecovery(first.flows)
    assert await recovery.run_once()  # its lease has not lapsed: the look found it
    # The resume landed: its item's move is counted once the look finds its run (it
    # was not counted at all).
    assert transitions_counted("approved", "completed") - completed == 1
    done = await _view(first, org, resumed_id)
    assert (done["status"], done["outputs"][-1]) == ("completed", {"data": "end", "success": True})
    assert RECOVERED_EVENT not in done["events"]
    assert await _recovery_attempts(first, resumed_id) == 0
    assert not await recovery.run_once()
    assert recovery.due_in_s() is None


async def test_a_run_that_makes_progress_starts_its_recovery_count_again(
    first: Stack, second: Stack, clock: FakeClock, mortal: Mortal
) -> None:
    """A long run may lose several processes in its life: only attempts that got nowhere
    add up."""
    org = await make_org(first)
    await make_agent(first, org, "plain")
    flow_id = await _flow(
        first,
        org,
        [
            {"type": "agent", "agent": "plain", "prompt": "one"},
            {"type": "agent", "agent": "plain", "prompt": "two #hold"},
        ],
    )
    async with first.db.tx() as conn:
        lease = await first.flows.new_run(conn, org.id, flow_id, [], 0, None)
    claim = None
    for _ in range(MAX_RECOVERIES - 1):
        clock.advance(RUN_LEASE_MS + 1)
        claim = await claim_lapsed(first.flows)
    assert claim is not None
    assert await _recovery_attempts(second, lease.run_id) == MAX_RECOVERIES - 1
    running = asyncio.create_task(first.flows.execute(claim.lease))
    await asyncio.wait_for(mortal.entered.wait(), 10)
    # Node 0's output was kept: the count started again.
    assert await _recovery_attempts(second, lease.run_id) == 0
    mortal.gate.set()
    await running
    assert (await _view(second, org, lease.run_id))["status"] == "completed"


@pytest.mark.parametrize("lead_removed", [False, True], ids=["lead_kept", "lead_removed"])
@pytest.mark.parametrize("turn_first", [False, True], ids=["flow_first", "turn_first"])
async def test_a_lead_reviewed_node_whose_turn_died_mid_model_is_run_again_and_the_flow_ends(
    first: Stack, second: Stack, clock: FakeClock, turn_first: bool, lead_removed: bool
) -> None:
    """The worker's turn of a lead-reviewed node dies in the model: its work item is
    ``inProgress`` with no submission. Flow recovery pauses the run on that item (the
    turn was taken in: no second intake); turn recovery runs the turn again (a flow
    node's gated turn is recorded, as a channel's is); the lead approves its submission
    and the flow resumes and completes, whichever recovery comes first. So it does when
    the worker's lead was removed after the crash (flow recovery failed the run,
    flow.turn_lost, while the item went on to its lead)."""
    org, flow_id = await _reviewed_flow(
        first,
        [
            {"type": "agent", "agent": "worker", "prompt": "write it #die #complete"},
            {"type": "output", "value": "after"},
        ],
    )
    with pytest.raises(Killed):
        await first.flows.start(org.id, flow_id)
    run_id = await _only_run(first)
    w = t.work_items.c
    async with second.db.read() as conn:
        [item_status] = (await conn.execute(sa.select(w.status))).scalars().all()
    assert item_status == "inProgress"  # taken in; nothing submitted
    assert await _turns(second, run_id, 0) == {"user": 1, "inboundEvents": 1}
    if lead_removed:
        async with second.db.read() as conn:
            worker = await conn.scalar(sa.select(t.agents.c.id).where(t.agents.c.name == "worker"))
        await _save_worker(second, org, {"id": worker}, lead=None)
    # Both leases lapse (the turn's is the longer one).
    clock.advance(TURN_LEASE_MS + 1)
    await _recovered_once(second, org, run_id, turn_first=turn_first)


class FailsOnce:
    """The script model, except that a worker prompt with ``#flaky`` fails (the model's
    error) the first time, after calling :attr:`before_failing`."""

    def __init__(self) -> None:
        self.script = ScriptProvider()
        self.fails = True
        self.before_failing: Callable[[], None] = lambda: None

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        last = request.messages[-1]
        if request.purpose == "worker" and last.role == "user" and "#flaky" in last.content:
            if self.fails:
                self.fails = False
                self.before_failing()
                raise ModelError("the provider failed", rule="model.failed")
        async for event in self.script.stream(request):
            yield event


@pytest.mark.parametrize("turn_first", [False, True], ids=["flow_first", "turn_first"])
async def test_a_lead_reviewed_node_whose_failed_turn_s_closing_met_a_fault_is_run_again_once(
    make_stack: Callable[..., Stack], second: Stack, clock: FakeClock, turn_first: bool
) -> None:
    """The worker's turn of a lead-reviewed node fails (its model's error) and closing
    its run meets a database fault: the run is left to turn recovery, and the turn
    raises the fault. The flow run stays running (``flow.interrupted``), not failed with
    the model's error while turn recovery takes the item on to its lead (whose approval
    then resumed nothing). Flow recovery pauses the run on the node's item, turn
    recovery runs the turn again; one intake, one answer, and the flow completes,
    whichever recovery comes first."""
    model = FailsOnce()
    failing = make_stack(clock=clock, providers={"script": model})
    org, flow_id = await _reviewed_flow(
        failing,
        [
            {"type": "agent", "agent": "worker", "prompt": "write it #flaky #complete"},
            {"type": "output", "value": "after"},
        ],
    )
    with pytest.MonkeyPatch.context() as mp:
        # The next transaction after the model's error is the one closing the run.
        model.before_failing = lambda: mp.setattr(
            failing.db, "tx", DownFor(failing.db.tx, 1, after_commit=False)
        )
        with pytest.raises(Unavailable) as info:
            await failing.flows.start(org.id, flow_id)
    assert info.value.rule == "flow.interrupted"
    assert isinstance(info.value.__cause__, Unavailable)
    run_id = await _only_run(failing)
    assert (await _view(second, org, run_id))["status"] == "running"
    w = t.work_items.c
    async with second.db.read() as conn:
        assert (await conn.execute(sa.select(w.status))).scalars().all() == ["inProgress"]
        assert await conn.scalar(sa.select(sa.func.count()).select_from(t.turn_runs)) == 1
    assert await _turns(second, run_id, 0) == {"user": 1, "inboundEvents": 1}
    clock.advance(TURN_LEASE_MS + 1)
    await _recovered_once(second, org, run_id, turn_first=turn_first)


@pytest.mark.parametrize(
    "change", ["lead_added_then_removed", "lead_removed", "deactivated", "deleted"]
)
async def test_a_gated_node_cut_before_its_pause_pauses_whatever_its_agent_is_now(
    first: Stack, second: Stack, clock: FakeClock, change: str
) -> None:
    """A node's gated turn submits its work item and the process dies before the run is
    paused; before recovery the worker's lead is removed (one added while the turn ran,
    or its own), or the worker is deactivated or deleted. The turn taken in decides, not
    the agent now: recovery pauses the run on that item, and its approval resumes the
    flow. Recovery read the agent as it is now: the run failed (``flow.turn_lost``, the
    agent inactive or not found) while its item still went to review, and once approved
    that item resumed nothing."""
    org = await make_org(first)
    await make_agent(first, org, "lead")
    added = change == "lead_added_then_removed"
    worker = await make_agent(first, org, "worker", **({} if added else {"lead": "lead"}))
    flow_id = await _flow(
        first,
        org,
        [
            {"type": "agent", "agent": "worker", "prompt": "write it #complete"},
            {"type": "output", "value": "after"},
        ],
    )
    first.turns.on_review_queued = die
    with pytest.MonkeyPatch.context() as mp:
        if added:
            # The lead is added after the node read the worker, before its turn's intake.
            run = first.turns.run

            async def lead_added_then_run(trigger: Trigger) -> Outcome:
                await _save_worker(first, org, worker, lead="lead")
                return await run(trigger)

            mp.setattr(first.turns, "run", lead_added_then_run)
        with pytest.raises(Killed):
            await first.flows.start(org.id, flow_id)
    run_id = await _only_run(first)
    if change == "deactivated":
        await _save_worker(second, org, worker, active=False)
    elif change == "deleted":
        await delete_agent(second, org, worker["id"])
    else:
        await _save_worker(second, org, worker, lead=None)
    clock.advance(RUN_LEASE_MS + 1)
    assert await drain(FlowRecovery(second.flows)) == 1
    paused = await _view(second, org, run_id)
    assert (paused["status"], paused["error"], paused["outputs"]) == (
        "waitingForHitl",
        None,
        [PAUSED_OUTPUT],
    )
    assert paused["events"] == ["Flow run started", RECOVERED_EVENT, WAITING_EVENT]
    await second.settle()  # the lead approves the dead turn's submission
    # One turn of the node; its item completed by the resume, no delivery left open.
    await _resumes_to_the_end(second, org, run_id)
    async with second.db.read() as conn:
        items = (await conn.execute(sa.select(t.work_items.c.status))).scalars().all()
        deliveries = (await conn.execute(sa.select(t.deliveries.c.status))).scalars().all()
    assert (items, deliveries) == (["completed"], ["sent"])


@pytest.mark.parametrize("broken", ["outputs", "flow_gone"])
async def test_an_approved_paused_run_that_cannot_be_read_fails_once_and_blocks_no_other(
    first: Stack, clock: FakeClock, caplog: pytest.LogCaptureFixture, broken: str
) -> None:
    """The resumer reads a paused run with the executor's checks: one whose outputs do
    not decode or are not a list (or whose flow is gone) is failed at once with
    ``flow.unrecoverable``, logged and counted once, instead of failing every pass on the
    same continuation (or resuming from a made-up snapshot) while the others wait."""
    org = await make_org(first)
    await make_agent(first, org, "lead")
    await make_agent(first, org, "worker", lead="lead")
    nodes = [
        {"type": "agent", "agent": "worker", "prompt": "one #complete"},
        {"type": "output", "value": "end"},
    ]
    async with first.db.tx() as conn:
        bad_flow = await create_flow(conn, first.clock, first.ids, org.id, "bad", nodes)
        good_flow = await create_flow(conn, first.clock, first.ids, org.id, "good", nodes)
    bad = await first.flows.start(org.id, bad_flow["id"])
    good = await first.flows.start(org.id, good_flow["id"])
    async with first.db.tx() as conn:
        if broken == "flow_gone":
            await conn.execute(t.flows.delete().where(t.flows.c.id == bad_flow["id"]))
        elif first.db.is_sqlite:
            await conn.execute(
                sa.text("UPDATE flow_runs SET outputs = '{not json' WHERE id = :id"), {"id": bad}
            )
        else:
            await conn.execute(
                t.flow_runs.update().where(t.flow_runs.c.id == bad).values(outputs={"x": 1})
            )
    await first.settle()  # the lead approves both nodes' submissions
    counted = _unrecoverable()
    resumer = FlowResumer(first.flows)
    with caplog.at_level(logging.ERROR, logger="leadgate.flows"):
        assert await drain(resumer) == 2
    assert await drain(resumer) == 0
    r, w = t.flow_runs.c, t.work_items.c
    async with first.db.read() as conn:
        run_row = (await conn.execute(sa.select(r.status, r.error).where(r.id == bad))).one()
    status, error = run_row.status, run_row.error
    why = (
        f"its flow {bad_flow['id']} no longer exists"
        if broken == "flow_gone"
        else (
            "its outputs or its flow's nodes do not decode"
            if first.db.is_sqlite
            else "its outputs or its flow's nodes are not the lists a run executes"
        )
    )
    assert status == "failed"
    assert error.startswith(
        f"{UNRECOVERABLE_RULE}: the approved run cannot be resumed: flow run {bad}: {why}"
    )
    events = await _raw_events(first, bad)
    assert events[-1] == f"Flow run failed: {error}"
    assert _unrecoverable() == counted + 1
    assert [rec.getMessage() for rec in caplog.records if rec.levelno == logging.ERROR] == [
        f"flow run {bad} failed: {error}"
    ]
    # No new run of it; its continuation closed, its item (whose delivery was the
    # resume) failed.
    async with first.db.read() as conn:
        assert await conn.scalar(sa.select(sa.func.count()).where(r.resumed_from == bad)) == 0
        cont = (
            await conn.execute(sa.select(t.continuations).where(t.continuations.c.run_id == bad))
        ).one()
        item_status = await conn.scalar(sa.select(w.status).where(w.id == cont.work_item_id))
        delivery = await conn.scalar(
            sa.select(t.deliveries.c.status).where(t.deliveries.c.work_item_id == cont.work_item_id)
        )
    assert (cont.status, cont.resumed_run_id, item_status, delivery) == (
        "closed",
        None,
        "failed",
        "failed",
    )
    # The other approval was not held up behind it.
    [resumed] = (await _view(first, org, good))["continuations"]
    done = await _view(first, org, resumed["resumedRunId"])
    assert (done["status"], done["outputs"]) == (
        "completed",
        [PAUSED_OUTPUT, {"data": "end", "success": True}],
    )


async def _raw_events(stack: Stack, run_id: str) -> list[str]:
    e = t.flow_run_events.c
    async with stack.db.read() as conn:
        return [
            str(text)
            for text in (
                await conn.execute(
                    sa.select(e.text).where(e.run_id == run_id).order_by(e.created_at, e.id)
                )
            )
            .scalars()
            .all()
        ]


async def test_flow_show_says_how_many_recovery_attempts_a_run_has_had(
    first: Stack, second: Stack, clock: FakeClock
) -> None:
    """``leadgate flow show`` (Admin.show_run) shows ``recoveryAttempts``: an operator
    sees a run nearing ``flow.unrecoverable`` before it is given up."""
    org = await make_org(first)
    flow_id = await _flow(first, org, [{"type": "output", "value": 1}])
    async with first.db.tx() as conn:
        lease = await first.flows.new_run(conn, org.id, flow_id, [], 0, None)
    admin = Admin(second.db, second.clock, second.ids, frozenset({"script"}))
    assert (await admin.show_run(org.id, lease.run_id))["recoveryAttempts"] == 0
    for _ in range(2):
        clock.advance(RUN_LEASE_MS + 1)
        assert await claim_lapsed(second.flows) is not None  # ... and its process dies
    shown = await admin.show_run(org.id, lease.run_id)
    assert (shown["status"], shown["recoveryAttempts"]) == ("running", 2)


@pytest.mark.parametrize("turn_first", [False, True], ids=["flow_first", "turn_first"])
async def test_a_lead_reviewed_node_whose_turn_recovery_gave_up_fails_its_flow_saying_why(
    first: Stack,
    second: Stack,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
    turn_first: bool,
) -> None:
    """Turn recovery gives a turn up after MAX_ATTEMPTS runs that each killed their
    process. A channel's person gets a failure notice and may retry; a flow node's turn
    has neither, so its item was left ``inProgress`` and the paused run waited a week
    for the abandonment sweeper, silently. Now the item is abandoned at once and the run
    fails with ``flow.unrecoverable`` naming why, logged and counted once."""
    org, flow_id = await _reviewed_flow(
        first,
        [
            {"type": "agent", "agent": "worker", "prompt": "write it #die #complete"},
            {"type": "output", "value": "after"},
        ],
    )
    with pytest.raises(Killed):
        await first.flows.start(org.id, flow_id)
    run_id = await _only_run(first)
    # Its earlier runs all died too: the next claim is the one that gives it up.
    async with second.db.tx() as conn:
        await conn.execute(t.turn_runs.update().values(attempts=TURN_MAX_ATTEMPTS))
    clock.advance(TURN_LEASE_MS + 1)
    flow_recovery, turn_recovery = FlowRecovery(second.flows), TurnRecovery(second.turns)
    resumer = FlowResumer(second.flows)
    counted = _unrecoverable()
    with caplog.at_level(logging.ERROR, logger="leadgate.flows"):
        if turn_first:
            assert await drain(turn_recovery) == 1
            assert await drain(flow_recovery) == 1  # pauses on the turn taken in
        else:
            assert await drain(flow_recovery) == 1
            assert (await _view(second, org, run_id))["status"] == "waitingForHitl"
            assert await drain(turn_recovery) == 1
        assert await drain(resumer) == 1
    run = await _view(second, org, run_id)
    [cont] = run["continuations"]
    w, a = t.work_items.c, t.audit.c
    async with second.db.read() as conn:
        [only] = (await conn.execute(sa.select(w.id, w.status))).all()
        item_id, item_status = only.id, only.status
        actions = (
            (await conn.execute(sa.select(a.action).where(a.work_item_id == item_id)))
            .scalars()
            .all()
        )
        assert await conn.scalar(sa.select(sa.func.count()).select_from(t.turn_runs)) == 0
    assert item_status == "abandoned" and TURN_GAVE_UP_ACTION in actions
    error = (
        f"node 0: {UNRECOVERABLE_RULE}: {TURN_GAVE_UP_TEXT}; the work item {item_id} was abandoned"
    )
    assert (run["status"], run["error"], run["events"][-1]) == (
        "failed",
        error,
        f"Flow run failed: {error}",
    )
    assert (cont["status"], cont["resumedRunId"]) == ("closed", None)
    assert _unrecoverable() == counted + 1
    assert [rec.getMessage() for rec in caplog.records if rec.levelno == logging.ERROR] == [
        f"flow run {run_id} failed: {error}"
    ]
    clock.advance(10 * TURN_LEASE_MS)
    assert await drain(turn_recovery) == 0
    assert await drain(flow_recovery) == 0
    assert await drain(resumer) == 0


async def refuse_run_writes_quoting_outputs(db: Database, *, renewals: bool) -> None:
    """Make the database refuse a write of a run whose outputs hold :data:`MARKER` (a
    node's answer), as the operator's own constraint would (a trigger): with
    ``renewals``, a write that leaves a running run's outputs as they are (a lease
    renewal); else the run's completion. PostgreSQL's error quotes the row in its
    ``DETAIL`` as its own constraints do; SQLite's ``RAISE`` takes no more than a fixed
    text."""
    if db.is_postgres:
        when = "NEW.status = 'running' AND NEW.outputs::text = OLD.outputs::text"
        when = when if renewals else "NEW.status = 'completed'"
        ddl = [
            "CREATE FUNCTION refuse_run() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "RAISE EXCEPTION 'refused' USING ERRCODE = 'check_violation', "
            "DETAIL = 'Failing row: ' || NEW.outputs::text; END $$",
            "CREATE TRIGGER refuse_run BEFORE UPDATE ON flow_runs FOR EACH ROW WHEN "
            f"(({when}) "
            f"AND NEW.outputs::text LIKE '%{MARKER}%') EXECUTE FUNCTION refuse_run()",
        ]
    else:
        when = "NEW.status = 'running' AND NEW.outputs = OLD.outputs"
        when = when if renewals else "NEW.status = 'completed'"
        ddl = [
            "CREATE TRIGGER refuse_run BEFORE UPDATE ON flow_runs WHEN "
            f"({when}) "
            f"AND NEW.outputs LIKE '%{MARKER}%' BEGIN SELECT RAISE(ABORT, 'refused'); END"
        ]
    async with db.tx() as conn:
        for statement in ddl:
            await conn.execute(sa.text(statement))


async def test_a_database_error_of_a_run_s_lease_is_neither_logged_nor_stored_with_its_text(
    first: Stack, second: Stack, mortal: Mortal, caplog: pytest.LogCaptureFixture
) -> None:
    """A run's lease renewals fail with a database error that is no fault (a
    constraint), which on PostgreSQL quotes the run's row in its ``DETAIL``: the nodes'
    outputs, the first node's answer among them. The renewal's WARNING logged that text,
    and the next node, failing on its own renewal, stored it as the run's error (shown by
    ``flow show`` and the API). Both name the error's type and SQLSTATE now."""
    org = await make_org(first)
    await make_agent(first, org, "plain")
    nodes = [
        {"type": "agent", "agent": "plain", "prompt": f"{MARKER} first"},
        {"type": "agent", "agent": "plain", "prompt": "#hold"},
        {"type": "agent", "agent": "plain", "prompt": "third"},
    ]
    flow_id = await _flow(first, org, nodes)
    first.flows.renew_every_s = 0.01
    caplog.set_level(logging.DEBUG)
    running = asyncio.create_task(first.flows.start(org.id, flow_id))
    await asyncio.wait_for(mortal.entered.wait(), 10)
    run_id = await _only_run(second)
    await refuse_run_writes_quoting_outputs(second.db, renewals=True)

    def renewals_failed() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "renewing flow run" in r.getMessage()]

    await eventually(renewals_failed, 10)
    mortal.gate.set()
    await running
    run = await _view(second, org, run_id)
    assert run["status"] == "failed" and MARKER in str(run["outputs"]), run
    assert (run["error"] or "").startswith("node 2: IntegrityError"), run["error"]
    assert MARKER not in (run["error"] or "") + "".join(run["events"])
    assert "IntegrityError" in renewals_failed()[0].getMessage()
    assert leaking(caplog.records, MARKER) == []


async def test_a_run_recovery_gives_up_on_for_a_database_error_is_failed_without_its_text(
    first: Stack, second: Stack, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Each recovery of a run fails on a database error that is no fault (a constraint
    refusing its completion, which on PostgreSQL quotes the row in its ``DETAIL``: the
    outputs, a node's answer among them). Recovery gives up after the last attempt with
    one ERROR and the run's error, both of which carried that text: they name the
    error's type and SQLSTATE now."""
    org = await make_org(first)
    flow_id = await _flow(
        first, org, [{"type": "output", "value": 1}, {"type": "output", "value": 2}]
    )
    async with first.db.tx() as conn:
        done = [{"data": {"text": f"{MARKER} answered"}, "success": True}]
        lease = await first.flows.new_run(conn, org.id, flow_id, done, 0, None)
    await refuse_run_writes_quoting_outputs(second.db, renewals=False)
    recovery = FlowRecovery(second.flows)
    caplog.set_level(logging.DEBUG)
    for _ in range(1, MAX_RECOVERIES):
        clock.advance(RUN_LEASE_MS + 1)
        with pytest.raises(sa.exc.IntegrityError):
            await recovery.run_once()
    clock.advance(RUN_LEASE_MS + 1)
    assert await recovery.run_once()
    run = await _view(second, org, lease.run_id)
    error = run["error"] or ""
    assert run["status"] == "failed" and "IntegrityError" in error and "own text left out" in error
    assert MARKER not in error + "".join(run["events"])
    assert [r for r in caplog.records if UNRECOVERABLE_RULE in r.getMessage()]
    assert leaking(caplog.records, MARKER) == []
