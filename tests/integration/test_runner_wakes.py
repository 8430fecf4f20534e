"""Work committed in one place wakes the runner it gave work to without waiting for the
poll: in the same process at commit, and on another replica by PostgreSQL NOTIFY
(``leadgate.domain.wakes``; an expired review lease on ``leadgate_reviews``).

The runner loops poll only every 30 s here (and heartbeats do not run by themselves), so
only a wake-up makes a runner act within :data:`WITHIN_S`. Each test waits for the woken
runner's first model call or send (a queue, with a timeout) and prints the latency.
Two replicas are two :class:`App` instances on one PostgreSQL database: an ``api`` one
that decides, reaps or starts flows (no runner loops, as ``serve --role api`` or the
command line) and a ``worker`` one that runs the runners.

Work that falls due with time has no commit to wake its runner (sections 4 and 5): the
runner's loop sleeps no longer than until it is due (``due_s`` of
:func:`leadgate.core.runners.run_loop`). There a :class:`JumpingClock` puts the work a
moment ahead of the clock when the loops start, and real time makes it due. Work added
with a sooner time than the one a runner sleeps toward wakes it at its commit (section
6). A LISTEN connection's (re)connection wakes every runner a notification could have
woken (section 7).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from aiohttp import web

import leadgate.app
from leadgate.app import App
from leadgate.cli.main import main
from leadgate.core.clock import Clock, FakeClock, SystemClock
from leadgate.core.config import Settings
from leadgate.core.runners import drain
from leadgate.core.types import Gated
from leadgate.database import schema as t
from leadgate.database.pg import CHANGES_CHANNEL
from leadgate.domain.processes import Liveness
from leadgate.domain.wakes import Wake
from leadgate.domain.workitems import ABANDON_AFTER_MS, Sweeper
from leadgate.flows.recovery import FlowRecovery
from leadgate.flows.runs import create_flow
from leadgate.review.runner import EXPIRY_CHECK_MS, LEASE_MS, LeadRunner
from leadgate.review.sla import SlaRunner
from leadgate.runners.recovery import TurnRecovery
from leadgate.runners.schedules import ScheduleRunner, add_schedule
from leadgate.turns.intake import Accepted
from leadgate.turns.providers.base import ModelEvent, ModelRequest
from leadgate.turns.providers.script import ScriptProvider
from leadgate.turns.runs import RUN_LEASE_MS, RunLook
from outbox.channel import OutboundMessage, Retry, Sent, Uncertain
from outbox.relay import EXPIRY_CHECK_MS as RELAY_EXPIRY_CHECK_MS
from outbox.relay import Relay
from tests.helpers import (
    Org,
    api_trigger,
    eventually,
    item_audit,
    item_row,
    make_agent,
    make_org,
    slack_trigger,
    start_worker,
    stopped_by_a_fault,
    stops_beating,
)
from tests.outbox_support import ScriptedChannel
from tests.statement_faults import injector

POLL_S = 30
#: Well under the poll: only a wake-up can make the runner act this soon. A third of it,
#: not a sixth: a wake-up on a loaded 2-CPU machine (two test workers, each with its own
#: PostgreSQL) can take seconds, and the poll it is told from is still 20 s away.
WITHIN_S = 10.0
#: How far ahead (by the clock) the timed work of section 5 falls due when the loops start.
DUE_IN_MS = 500


class JumpingClock:
    """The wall clock, which a test can also move forward at once: work that falls due
    with time (a schedule's firing, a lease's lapse) is put a moment ahead of the clock
    and then falls due as real time passes, with no commit to wake its runner."""

    def __init__(self) -> None:
        self.offset_ms = 0

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000 + self.offset_ms

    def advance(self, ms: int) -> None:
        self.offset_ms += ms


@dataclass(frozen=True)
class Call:
    """One model call: its purpose, the text of its last message, the revision feedback
    it carries, and when it started (``time.perf_counter``)."""

    purpose: str
    text: str
    feedback: str | None
    at: float


class RecordingModel(ScriptProvider):
    """The built-in script model, noting each call as it starts (the model is the
    service's edge: which runner called it, and when, is what these tests observe)."""

    def __init__(self) -> None:
        self.calls: asyncio.Queue[Call] = asyncio.Queue()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        last = request.messages[-1].content if request.messages else ""
        self.calls.put_nowait(
            Call(request.purpose, str(last), request.revision_feedback, time.perf_counter())
        )
        async for event in super().stream(request):
            yield event


MakeApp = Callable[..., App]


@pytest.fixture
async def make_app() -> AsyncIterator[MakeApp]:
    """Build :class:`App` instances (stopped at teardown, last first)."""
    made: list[App] = []

    def make(
        url: str,
        *,
        clock: Clock | None = None,
        model: ScriptProvider | None = None,
        channels: dict[str, Any] | None = None,
        review: dict[str, str] | None = None,
    ) -> App:
        settings = Settings.model_validate(
            {
                "database": {"url": url},
                # A heartbeat that never beats by itself: the tests reap when they mean to
                # (a process is dead after two missed beats at the least).
                "runners": {"poll_interval_s": POLL_S, "heartbeat_s": 3600, "dead_after_s": 7200},
                "review": review or {},
            }
        )
        app = App(
            settings,
            clock=clock or FakeClock(),
            providers={"script": model or ScriptProvider()},
            channels=channels,
            enable_adapters=False,
        )
        made.append(app)
        return app

    yield make
    for app in reversed(made):
        await app.stop()


async def next_call(model: RecordingModel, wanted: Callable[[Call], bool]) -> Call:
    """The next model call ``wanted`` accepts (others are passed over), within
    :data:`WITHIN_S`."""

    async def find() -> Call:
        while True:
            call = await model.calls.get()
            if wanted(call):
                return call

    return await asyncio.wait_for(find(), WITHIN_S)


def report(what: str, seconds: float) -> None:
    print(f"\n{what}: {seconds * 1000:.1f} ms")


async def lead_and_worker(app: App, name: str = "acme") -> tuple[Org, dict[str, Any]]:
    org = await make_org(app, name)
    await make_agent(app, org, "lead")
    return org, await make_agent(app, org, "worker", lead="lead")


async def waiting_for_human(app: App, item_id: str) -> None:
    """Until the worker replica's lead (woken by the submission's NOTIFY) escalated it."""

    async def waiting() -> bool:
        return bool((await item_row(app, item_id))["status"] == "awaitingHuman")

    await eventually(waiting, WITHIN_S)


# ------------------------------------------------------------ 1. a person's return


async def test_a_return_on_an_api_replica_wakes_the_revision_runner_of_a_worker(
    migrated_pg: str, make_app: MakeApp
) -> None:
    clock, model = FakeClock(), RecordingModel()
    api = make_app(migrated_pg, clock=clock)
    worker = make_app(migrated_pg, clock=clock, model=model)
    await start_worker(worker)
    org, agent = await lead_and_worker(api)
    out = await api.turns.run(api_trigger(org, agent, "hard #escalate #complete"))
    assert isinstance(out, Gated) and out.work_item_id
    await waiting_for_human(api, out.work_item_id)

    decided = time.perf_counter()
    await api.reviews.decide(org.principal, out.work_item_id, "return", "add the tests")
    call = await next_call(model, lambda c: c.feedback == "add the tests")
    report("return on the api replica -> revision turn on the worker", call.at - decided)


async def test_a_delivery_retried_on_an_api_replica_wakes_the_relay_of_a_worker(
    migrated_pg: str, make_app: MakeApp
) -> None:
    """An operator's retry of a ``deliveryUnknown`` delivery on an ``api`` replica (or
    ``leadgate delivery retry``): the pending row's NOTIFY (``leadgate_outbox``) wakes a
    worker's relay, which posts again now, not at its poll. (A confirm or a retry gives
    no other runner work: see ``test_decision_wakes.py``.)"""
    sends: asyncio.Queue[float] = asyncio.Queue()

    def answer(outcome: Uncertain | Sent) -> Callable[[OutboundMessage], Uncertain | Sent]:
        def send(_: OutboundMessage) -> Uncertain | Sent:
            sends.put_nowait(time.perf_counter())
            return outcome

        return send

    channel = ScriptedChannel(
        "slack", script=[answer(Uncertain("timed out")), answer(Sent("ts-2"))]
    )
    clock = FakeClock()
    api = make_app(migrated_pg, clock=clock)
    worker = make_app(migrated_pg, clock=clock, channels={"slack": channel})
    await start_worker(worker)
    org = await make_org(api)
    plain = await make_agent(api, org, "plain")
    await api.turns.run(slack_trigger(org, plain, "hello", "1700000000.000400"))
    await asyncio.wait_for(sends.get(), WITHIN_S)  # maybe posted: deliveryUnknown
    d = t.deliveries.c

    async def unknown() -> str | None:
        async with api.db.read() as conn:
            found = await conn.scalar(sa.select(d.id).where(d.status == "deliveryUnknown"))
        return None if found is None else str(found)

    await eventually(unknown, WITHIN_S)
    delivery_id = await unknown()
    assert delivery_id is not None

    retried = time.perf_counter()
    await api.reviews.recover(org.principal, delivery_id, "retry")
    posted = await asyncio.wait_for(sends.get(), WITHIN_S)
    report("retry on the api replica -> posted again by the worker's relay", posted - retried)


# ------------------------------------------------------ 2. a review lease taken back


async def held_elsewhere(app: App, org: Org, agent: dict[str, Any]) -> Liveness:
    """Submit an item and let another replica's lead runner claim it: its review lease
    names that replica's process, returned (alive: registered, heartbeat now).

    This process's lead runner then makes its first pass before its loops start: it
    finds nothing to take back (the holder is alive, the lease fresh) and nothing
    queued, so with the loops started only a wake-up makes it look again before the
    poll (and the FakeClock keeps its lease check from falling due by itself)."""
    out = await app.turns.run(api_trigger(org, agent, "draft it #complete"))
    assert isinstance(out, Gated) and out.work_item_id
    holder = Liveness(app.db, app.clock, app.ids, role="worker")
    await holder.register()
    elsewhere = LeadRunner(app.db, app.clock, app.ids, app.providers, app.outbox)
    elsewhere.owner = holder.owner
    claimed = await elsewhere.claim()
    assert claimed is not None and claimed.id == out.work_item_id
    assert not await app.lead_runner.run_once()
    return holder


async def test_a_reaped_review_lease_is_reviewed_again_at_once(
    migrated_url: str, make_app: MakeApp
) -> None:
    model = RecordingModel()
    app = make_app(migrated_url, model=model)
    org, agent = await lead_and_worker(app)
    holder = await held_elsewhere(app, org, agent)
    await start_worker(app)
    await stops_beating(app, app.liveness.dead_after_ms, holder.id)

    reaped = time.perf_counter()
    assert await app.liveness.reap() == 1  # what this process's heartbeat does
    call = await next_call(model, lambda c: c.purpose == "lead")
    report("reap -> lead review in the same process", call.at - reaped)


async def test_a_reap_on_an_api_replica_wakes_the_lead_runner_of_a_worker(
    migrated_pg: str, make_app: MakeApp
) -> None:
    clock, model = FakeClock(), RecordingModel()
    api = make_app(migrated_pg, clock=clock)
    worker = make_app(migrated_pg, clock=clock, model=model)
    org, agent = await lead_and_worker(api)
    holder = await held_elsewhere(worker, org, agent)
    await start_worker(worker)
    await api.start_liveness("api")
    await stops_beating(api, api.liveness.dead_after_ms, holder.id)

    reaped = time.perf_counter()
    assert await api.liveness.reap() == 1  # the api replica's heartbeat found it dead
    call = await next_call(model, lambda c: c.purpose == "lead")
    report("reap on the api replica -> lead review on the worker", call.at - reaped)


async def test_an_expired_review_lease_wakes_the_lead_runners_of_other_replicas(
    migrated_pg: str, make_app: MakeApp
) -> None:
    """The replica whose lease check finds an expired lease (here one whose review loops
    do not run, as if all were busy) queues the item again; the other replicas' lead
    runners hear it as they hear a submission.

    The worker's clock stays put, so only ``busy`` finds the lease lapsed: with one
    clock, a pass of the worker's loops (the one its LISTEN connection's start asks
    for) could run its own lease check beside ``busy``'s and take the item back itself,
    and the notification would not be what woke it."""
    clock, model = FakeClock(), RecordingModel()
    busy = make_app(migrated_pg, clock=clock)
    worker = make_app(migrated_pg, clock=FakeClock(), model=model)
    org, agent = await lead_and_worker(busy)
    await held_elsewhere(worker, org, agent)
    await start_worker(worker)
    clock.advance(LEASE_MS + 1)  # the holder never gave a verdict

    expired = time.perf_counter()
    assert await busy.lead_runner.expire_leases() == 1
    call = await next_call(model, lambda c: c.purpose == "lead")
    report("lease expiry on one replica -> lead review on another", call.at - expired)


# ------------------------------------------------------ 3. an approved continuation

FLOW = [
    {"type": "agent", "agent": "worker", "prompt": "write it #complete"},
    {"type": "agent", "agent": "plain", "prompt": "after the approval"},
]


async def flow_of(app: App, nodes: list[dict[str, Any]]) -> tuple[Org, str]:
    """An organization with a lead, a reviewed worker and a plain agent, and a flow."""
    org, _ = await lead_and_worker(app)
    await make_agent(app, org, "plain")
    async with app.db.tx() as conn:
        flow = await create_flow(conn, app.clock, app.ids, org.id, "f", nodes)
    return org, str(flow["id"])


def resumed(call: Call) -> bool:
    """The resumed run's first model call: the node after the reviewed one."""
    return call.purpose == "worker" and call.text == "after the approval"


async def test_a_lead_approved_flow_continuation_resumes_at_once(
    migrated_url: str, make_app: MakeApp
) -> None:
    model = RecordingModel()
    app = make_app(migrated_url, model=model)
    org, flow_id = await flow_of(app, FLOW)
    await start_worker(app)

    started = time.perf_counter()
    await app.flows.start(org.id, flow_id)
    approved = await next_call(model, lambda c: c.purpose == "lead")
    call = await next_call(model, resumed)
    report("lead review -> resumed flow in the same process", call.at - approved.at)
    report("flow started -> resumed", call.at - started)


async def test_a_flow_run_from_another_process_resumes_after_the_leads_approval(
    migrated_pg: str, make_app: MakeApp
) -> None:
    """``leadgate flow run`` executes the flow's first node in its own process; the
    worker's lead approves and its flow resumer continues, though the approval may
    come before the command's pause is written (the pause wakes the resumer again)."""
    clock, model = FakeClock(), RecordingModel()
    command = make_app(migrated_pg, clock=clock)
    worker = make_app(migrated_pg, clock=clock, model=model)
    org, flow_id = await flow_of(command, FLOW)
    await start_worker(worker)

    started = time.perf_counter()
    await command.flows.start(org.id, flow_id)
    call = await next_call(model, resumed)
    report("flow run elsewhere -> resumed on the worker", call.at - started)


async def test_a_flow_approval_on_an_api_replica_wakes_the_flow_resumer_of_a_worker(
    migrated_pg: str, make_app: MakeApp
) -> None:
    clock, model = FakeClock(), RecordingModel()
    api = make_app(migrated_pg, clock=clock)
    worker = make_app(migrated_pg, clock=clock, model=model)
    nodes = [{**FLOW[0], "prompt": "write it #complete #escalate"}, FLOW[1]]
    org, flow_id = await flow_of(api, nodes)
    await start_worker(worker)
    await api.flows.start(org.id, flow_id)
    async with api.db.read() as conn:
        item_id = str(await conn.scalar(sa.select(t.continuations.c.work_item_id)))
    await waiting_for_human(api, item_id)

    decided = time.perf_counter()
    await api.reviews.decide(org.principal, item_id, "approve")
    call = await next_call(model, resumed)
    report("approval on the api replica -> resumed flow on the worker", call.at - decided)


async def paused_on(app: App, flow_id: str, org: Org) -> tuple[str, str]:
    """Start ``flow_id``: its reviewed node pauses the run on its work item. The paused
    run and its item."""
    paused = await app.flows.start(org.id, flow_id)
    async with app.db.read() as conn:
        item_id = str(await conn.scalar(sa.select(t.continuations.c.work_item_id)))
    return paused, item_id


async def ended(app: App, run_id: str) -> None:
    """Until flow run ``run_id`` ended (the resumer failed it), within :data:`WITHIN_S`."""

    async def failed() -> bool:
        async with app.db.read() as conn:
            status = await conn.scalar(
                sa.select(t.flow_runs.c.status).where(t.flow_runs.c.id == run_id)
            )
        return bool(status == "failed")

    await eventually(failed, WITHIN_S, what=f"flow run {run_id} failed")


async def before_the_jump(app: App) -> None:
    """Until ``app``'s SLA runner sleeps toward the episode's first timer (its reminder,
    half an hour away): the escalation's commit woke its loop, and a pass of it that
    read the clock only after the test moved it an hour on expired the item itself, its
    transaction holding the item when the test's own pass came (which left it and
    answered False). Either expiry is right (exactly one wins), but the test's pass is
    the one it asserts on and times."""
    await eventually(lambda: (app.sla_runner.due_in_s() or 0) > 600, WITHIN_S)


@pytest.mark.parametrize("action", ["cancel", "reject"])
async def test_a_flow_item_cancelled_or_rejected_ends_its_paused_run_at_once(
    migrated_url: str, make_app: MakeApp, action: str
) -> None:
    """The run paused on an item that is cancelled (or rejected) can never resume: the
    decision wakes the flow resumer, which ends the run then, not at its poll."""
    app = make_app(migrated_url)
    nodes = [{**FLOW[0], "prompt": "write it #complete #escalate"}, FLOW[1]]
    org, flow_id = await flow_of(app, nodes)
    await start_worker(app)
    paused, item_id = await paused_on(app, flow_id, org)
    await waiting_for_human(app, item_id)

    decided = time.perf_counter()
    await app.reviews.decide(org.principal, item_id, action, "not needed")
    await ended(app, paused)
    report(f"{action} -> paused flow run failed", time.perf_counter() - decided)


async def test_a_flow_item_cancelled_on_an_api_replica_ends_its_run_on_a_worker(
    migrated_pg: str, make_app: MakeApp
) -> None:
    clock = FakeClock()
    api = make_app(migrated_pg, clock=clock)
    worker = make_app(migrated_pg, clock=clock)
    nodes = [{**FLOW[0], "prompt": "write it #complete #escalate"}, FLOW[1]]
    org, flow_id = await flow_of(api, nodes)
    await start_worker(worker)
    paused, item_id = await paused_on(api, flow_id, org)
    await waiting_for_human(api, item_id)

    decided = time.perf_counter()
    await api.reviews.decide(org.principal, item_id, "cancel")
    await ended(worker, paused)
    report(
        "cancel on the api replica -> flow run failed on the worker", time.perf_counter() - decided
    )


async def test_an_abandoned_flow_item_ends_its_paused_run_at_once(
    migrated_url: str, make_app: MakeApp
) -> None:
    """The abandonment sweeper abandons a flow node's item left ``inProgress`` for a week:
    its pass wakes the flow resumer, which ends the paused run then, not at its poll."""
    clock = JumpingClock()
    app = make_app(migrated_url, clock=clock)
    org, flow_id = await flow_of(app, [{"type": "agent", "agent": "worker", "prompt": "draft"}])
    await start_worker(app)
    paused, item_id = await paused_on(app, flow_id, org)
    assert (await item_row(app, item_id))["status"] == "inProgress"  # never submitted
    clock.advance(ABANDON_AFTER_MS + 1)

    swept = time.perf_counter()
    assert await Sweeper(app.db, clock, app.ids).run_once()  # what its loop's pass does
    assert (await item_row(app, item_id))["status"] == "abandoned"
    await ended(app, paused)
    report("abandoned -> paused flow run failed", time.perf_counter() - swept)


async def test_an_expired_flow_item_ends_its_paused_run_at_once(
    migrated_url: str, make_app: MakeApp
) -> None:
    """No person decided a flow node's item within ``[review] expire_after``: the SLA
    runner's expiry rejects it and wakes the flow resumer, which ends the paused run
    then, not at its poll."""
    clock = JumpingClock()
    app = make_app(migrated_url, clock=clock, review={"expire_after": "1h"})
    nodes = [{**FLOW[0], "prompt": "write it #complete #escalate"}, FLOW[1]]
    org, flow_id = await flow_of(app, nodes)
    await start_worker(app)
    paused, item_id = await paused_on(app, flow_id, org)
    await waiting_for_human(app, item_id)
    await before_the_jump(app)
    clock.advance(3_600_000 + 1)

    expired = time.perf_counter()
    assert await app.sla_runner.run_once()  # what its loop's pass does
    assert (await item_row(app, item_id))["status"] == "rejected"
    await ended(app, paused)
    report("expired -> paused flow run failed", time.perf_counter() - expired)


async def test_a_flow_item_expired_on_one_replica_ends_its_run_on_another(
    migrated_pg: str, make_app: MakeApp
) -> None:
    """The replica whose SLA runner expires the item (here one whose loops do not run)
    wakes the flow resumers of the others by NOTIFY."""
    clock = JumpingClock()
    sla = make_app(migrated_pg, clock=clock, review={"expire_after": "1h"})
    worker = make_app(migrated_pg, clock=clock, review={"expire_after": "1h"})
    nodes = [{**FLOW[0], "prompt": "write it #complete #escalate"}, FLOW[1]]
    org, flow_id = await flow_of(sla, nodes)
    await start_worker(worker)
    paused, item_id = await paused_on(sla, flow_id, org)
    await waiting_for_human(sla, item_id)
    await before_the_jump(worker)  # its SLA runner would expire the item as well
    clock.advance(3_600_000 + 1)

    expired = time.perf_counter()
    assert await sla.sla_runner.run_once()
    assert (await item_row(sla, item_id))["status"] == "rejected"
    await ended(worker, paused)
    report("expired on one replica -> flow run failed on another", time.perf_counter() - expired)


# ------------------------------------------------------- 4. a short Retry-After


async def test_a_retry_after_shorter_than_the_poll_is_retried_when_due(
    migrated_url: str, make_app: MakeApp
) -> None:
    """A platform's 429 asks for 0.5 s: the relay posts again then, not at its poll."""
    sends: asyncio.Queue[float] = asyncio.Queue()

    def answer(outcome: Retry | Sent) -> Callable[[OutboundMessage], Retry | Sent]:
        def send(_: OutboundMessage) -> Retry | Sent:
            sends.put_nowait(time.perf_counter())
            return outcome

        return send

    channel = ScriptedChannel(
        "slack", script=[answer(Retry("HTTP 429", delay_s=0.5)), answer(Sent("ts-2"))]
    )
    # The wall clock: the retry falls due as time passes, not as a test moves a clock.
    app = make_app(migrated_url, clock=SystemClock(), channels={"slack": channel})
    app.relay.rand = lambda: 0.0  # the backoff's random half at its least (0.5 s)
    await start_worker(app)
    org = await make_org(app)
    plain = await make_agent(app, org, "plain")

    await app.turns.run(slack_trigger(org, plain, "hello", "1700000000.000100"))
    refused = await asyncio.wait_for(sends.get(), WITHIN_S)
    posted = await asyncio.wait_for(sends.get(), WITHIN_S)
    report("429 with Retry-After 0.5 s -> posted again", posted - refused)
    assert posted - refused >= 0.45  # not before the platform asked


# ------------------------------------------------------------ 5. work due with time


async def test_a_schedule_fires_at_its_time_not_at_the_poll(
    migrated_url: str, make_app: MakeApp
) -> None:
    """Nothing is committed when a schedule falls due: the schedule runner's loop sleeps
    no longer than until its next firing (``ScheduleRunner.due_in_s``)."""
    clock, model = JumpingClock(), RecordingModel()
    app = make_app(migrated_url, clock=clock, model=model)
    org = await make_org(app)
    plain = await make_agent(app, org, "plain")
    # Just before a minute starts, so that "* * * * *" first fires DUE_IN_MS from now.
    clock.advance((-clock.now_ms() - DUE_IN_MS) % 60_000)
    due = clock.now_ms() + DUE_IN_MS
    async with app.db.tx() as conn:
        await add_schedule(
            conn,
            clock,
            app.ids,
            org_id=org.id,
            agent_id=plain["id"],
            cron="* * * * *",
            message="tick",
        )
    await start_worker(app)

    call = await next_call(model, lambda c: c.text == "tick")
    called_ms = clock.now_ms() - (time.perf_counter() - call.at) * 1000
    report("schedule due -> its turn's model call", (called_ms - due) / 1000)
    assert called_ms >= due  # not before it was due


async def test_a_review_lease_is_taken_back_when_it_lapses_not_at_the_poll(
    migrated_url: str, make_app: MakeApp
) -> None:
    """A review lease whose holder is alive but never gives a verdict lapses with time, and
    nothing is committed then: the lead runner's loops sleep no longer than until the
    earliest lease its last check saw lapses (``LeadRunner.due_in_s``)."""
    clock, model = JumpingClock(), RecordingModel()
    app = make_app(migrated_url, clock=clock, model=model)
    org, agent = await lead_and_worker(app)
    holder = await held_elsewhere(app, org, agent)
    async with app.db.read() as conn:
        lapses = int(await conn.scalar(sa.select(sa.func.max(t.work_items.c.lease_expires_at))))
    # Further ahead than the lease check's interval, so that the lapse, not the check's
    # once-a-second limit, decides when the loops look again.
    clock.advance(lapses - clock.now_ms() - EXPIRY_CHECK_MS - DUE_IN_MS)
    await holder.beat()  # alive, as far as anyone can tell: no reap takes the lease back
    await start_worker(app)

    call = await next_call(model, lambda c: c.purpose == "lead")
    called_ms = clock.now_ms() - (time.perf_counter() - call.at) * 1000
    report("review lease lapsed -> lead review in the same process", (called_ms - lapses) / 1000)
    assert called_ms > lapses  # not before it lapsed


async def test_a_review_reminder_fires_at_its_time_not_at_the_poll(
    migrated_url: str, make_app: MakeApp
) -> None:
    """An item waiting for a human is reminded about after ``[review] remind_after``: the
    SLA runner's loop sleeps no longer than until the earliest timer (``SlaRunner.due_in_s``)."""
    clock = JumpingClock()
    app = make_app(migrated_url, clock=clock)
    org, agent = await lead_and_worker(app)
    out = await app.turns.run(api_trigger(org, agent, "hard #escalate #complete"))
    assert isinstance(out, Gated) and out.work_item_id
    assert await drain(app.lead_runner) == 1  # escalated: a review episode opens
    e = t.review_episodes.c
    async with app.db.read() as conn:
        due = int(await conn.scalar(sa.select(e.due_at)))  # its reminder, 30 minutes on
    clock.advance(due - clock.now_ms() - DUE_IN_MS)
    await start_worker(app)

    async def reminded() -> bool:
        async with app.db.read() as conn:
            return bool(await conn.scalar(sa.select(e.reminders)) == 1)

    await eventually(reminded, WITHIN_S)
    report(
        "reminder due -> seen reminded (the test polls every 50 ms)", (clock.now_ms() - due) / 1000
    )


async def test_an_idle_item_is_abandoned_when_its_week_is_up_not_at_the_poll(
    migrated_url: str, make_app: MakeApp
) -> None:
    """The abandonment sweeper's loop sleeps no longer than until the oldest
    ``inProgress`` item has been idle for a week (``Sweeper.due_in_s``)."""
    clock = JumpingClock()
    app = make_app(migrated_url, clock=clock)
    org, flow_id = await flow_of(app, [{"type": "agent", "agent": "worker", "prompt": "draft"}])
    _, item_id = await paused_on(app, flow_id, org)  # its item is left inProgress
    idle_since = int((await item_row(app, item_id))["last_activity_at"])
    due = idle_since + ABANDON_AFTER_MS
    clock.advance(due - clock.now_ms() - DUE_IN_MS)
    await start_worker(app)

    async def abandoned() -> bool:
        return bool((await item_row(app, item_id))["status"] == "abandoned")

    await eventually(abandoned, WITHIN_S)
    report(
        "idle for a week -> seen abandoned (the test polls every 50 ms)",
        (clock.now_ms() - due) / 1000,
    )


async def test_a_flow_run_whose_lease_lapses_is_continued_when_it_lapses(
    migrated_url: str, make_app: MakeApp
) -> None:
    """A running flow run whose executor stalled (alive, as far as anyone can tell) is
    continued when its lease lapses: the flow recovery loop sleeps no longer than until
    the earliest run lease lapses (``FlowRecovery.due_in_s``)."""
    clock, model = JumpingClock(), RecordingModel()
    app = make_app(migrated_url, clock=clock, model=model)
    org, flow_id = await flow_of(app, [{"type": "agent", "agent": "plain", "prompt": "go on"}])
    async with app.db.tx() as conn:  # leased to an executor that never runs it
        lease = await app.flows.new_run(conn, org.id, flow_id, [], 0, None)
    async with app.db.read() as conn:
        lapses = int(
            await conn.scalar(
                sa.select(t.flow_runs.c.lease_expires_at).where(t.flow_runs.c.id == lease.run_id)
            )
        )
    clock.advance(lapses - clock.now_ms() - DUE_IN_MS)
    await start_worker(app)

    call = await next_call(model, lambda c: c.text == "go on")
    called_ms = clock.now_ms() - (time.perf_counter() - call.at) * 1000
    report("flow run lease lapsed -> continued", (called_ms - lapses) / 1000)
    assert called_ms > lapses  # not before it lapsed


async def test_a_send_lease_is_taken_back_when_it_lapses_not_at_the_poll(
    migrated_url: str, make_app: MakeApp
) -> None:
    """A relay that claimed a delivery and stalled (alive, as far as anyone can tell)
    leaves it ``sending``; nothing is committed when its send lease lapses: the relay's
    loop sleeps no longer than until its lease check can find it lapsed
    (``Relay.due_in_s``), and the post becomes ``deliveryUnknown`` then."""
    clock = JumpingClock()
    channel = ScriptedChannel("slack")
    app = make_app(migrated_url, clock=clock, channels={"slack": channel})
    org = await make_org(app)
    plain = await make_agent(app, org, "plain")
    await app.turns.run(slack_trigger(org, plain, "hello", "1700000000.000100"))
    stalled = Relay(app.db, clock, app.ids, app.channels)
    (claimed,) = await stalled.claim()  # and never sends it
    async with app.db.read() as conn:
        lapses = int(
            await conn.scalar(
                sa.select(t.deliveries.c.lease_expires_at).where(t.deliveries.c.id == claimed.id)
            )
        )
    # Further ahead than the lease check's interval, so that the lapse, not the check's
    # once-a-second limit, decides when the loop looks again.
    clock.advance(lapses - clock.now_ms() - RELAY_EXPIRY_CHECK_MS - DUE_IN_MS)
    await start_worker(app)

    async def unknown() -> bool:
        async with app.db.read() as conn:
            status = await conn.scalar(
                sa.select(t.deliveries.c.status).where(t.deliveries.c.id == claimed.id)
            )
        return bool(status == "deliveryUnknown")

    await eventually(unknown, WITHIN_S)
    report("send lease lapsed -> seen deliveryUnknown", (clock.now_ms() - lapses) / 1000)
    assert channel.calls == []  # a post that may have landed is never sent again


async def test_a_revision_lease_is_taken_back_when_it_lapses_not_at_the_poll(
    migrated_url: str, make_app: MakeApp
) -> None:
    """A revision dispatcher that claimed a revision and stalled holds its lease; nothing
    is committed when it lapses: the revision loop sleeps no longer than until the
    earliest revision lease lapses (``RevisionRunner.due_in_s``)."""
    clock, model = JumpingClock(), RecordingModel()
    app = make_app(migrated_url, clock=clock, model=model)
    org, agent = await lead_and_worker(app)
    out = await app.turns.run(api_trigger(org, agent, "draft it #revise #complete"))
    assert isinstance(out, Gated) and out.work_item_id
    assert await drain(app.lead_runner) == 1  # changes requested: the feedback waits
    stalled = await app.turns.claim_revision()  # and never runs it
    assert stalled is not None and stalled.lease_expires_at is not None
    lapses = stalled.lease_expires_at
    clock.advance(lapses - clock.now_ms() - DUE_IN_MS)
    await start_worker(app)

    call = await next_call(model, lambda c: c.feedback is not None)
    called_ms = clock.now_ms() - (time.perf_counter() - call.at) * 1000
    report("revision lease lapsed -> revision turn", (called_ms - lapses) / 1000)
    assert called_ms > lapses  # not before it lapsed


async def test_a_turn_run_lease_is_taken_back_when_it_lapses_not_at_the_poll(
    migrated_url: str, make_app: MakeApp
) -> None:
    """A recorded turn whose process is alive but stalled holds its run lease; nothing is
    committed when it lapses: the turn recovery loop sleeps no longer than until the
    earliest run lease lapses (``TurnRecovery.due_in_s``)."""
    clock, model = JumpingClock(), RecordingModel()
    app = make_app(migrated_url, clock=clock, model=model)
    org = await make_org(app)
    plain = await make_agent(app, org, "plain")
    holder = Liveness(app.db, clock, app.ids, role="worker")
    await holder.register()
    app.turns.intake.owner = holder.owner
    await app.turns.take(slack_trigger(org, plain, "hi", "1700000000.000200"))  # stalls
    app.turns.intake.owner = app.liveness.owner
    async with app.db.read() as conn:
        lapses = int(await conn.scalar(sa.select(t.turn_runs.c.lease_expires_at)))
    clock.advance(lapses - clock.now_ms() - DUE_IN_MS)
    await holder.beat()  # still alive: no reap takes the run back
    await start_worker(app)

    call = await next_call(model, lambda c: c.text == "hi")
    called_ms = clock.now_ms() - (time.perf_counter() - call.at) * 1000
    report("turn run lease lapsed -> the turn run again", (called_ms - lapses) / 1000)
    assert called_ms > lapses


# ------------------------------------- 6. work added with a sooner time than the known one


R = TypeVar("R")


def runner_of(app: App, kind: type[R]) -> R:
    """``app``'s runner of type ``kind`` (its loops run it)."""
    for loop in app.loops:
        if isinstance(loop.runner, kind):
            return loop.runner
    raise AssertionError(f"no {kind.__name__} loop")


async def test_a_schedule_added_with_a_sooner_firing_wakes_the_schedule_runner(
    migrated_url: str, make_app: MakeApp
) -> None:
    """The schedule runner sleeps toward the earliest firing it read; a schedule added
    since with a sooner firing wakes it at its commit (``Wake.schedule``), so it fires at
    its time, not at the poll."""
    clock, model = JumpingClock(), RecordingModel()
    app = make_app(migrated_url, clock=clock, model=model)
    org = await make_org(app)
    plain = await make_agent(app, org, "plain")
    async with app.db.tx() as conn:  # once a year: what the runner sleeps toward
        await add_schedule(
            conn,
            clock,
            app.ids,
            org_id=org.id,
            agent_id=plain["id"],
            cron="0 0 1 1 *",
            message="yearly",
        )
    await start_worker(app)
    schedules = runner_of(app, ScheduleRunner)
    await eventually(lambda: schedules.due_in_s() is not None, WITHIN_S)  # asleep
    # Just before a minute starts, so that "* * * * *" first fires DUE_IN_MS from now.
    clock.advance((-clock.now_ms() - DUE_IN_MS) % 60_000)
    due = clock.now_ms() + DUE_IN_MS
    async with app.db.tx() as conn:
        await add_schedule(
            conn,
            clock,
            app.ids,
            org_id=org.id,
            agent_id=plain["id"],
            cron="* * * * *",
            message="tick",
        )

    call = await next_call(model, lambda c: c.text == "tick")
    called_ms = clock.now_ms() - (time.perf_counter() - call.at) * 1000
    report("schedule added with a sooner firing -> its turn's model call", (called_ms - due) / 1000)
    assert called_ms >= due  # not before it was due


@pytest.mark.parametrize("how", ["orphaned", "watched"])
async def test_a_run_a_turn_leaves_to_the_turn_recovery_wakes_it(
    migrated_url: str, make_app: MakeApp, how: str
) -> None:
    """A recorded run whose turn stopped on a database fault, or whose intake's
    read-back failed, is an orphan (``TurnService.orphaned``); one whose intake in doubt
    was not found landed is watched (``TurnService.lost``). Nothing committed wakes the
    turn recovery for either (its loop sleeps toward the run's 15-minute lease, or the
    poll): adding one does, so the orphan is taken at once and the watched token at its
    look a second on, not at the poll."""
    clock, model = JumpingClock(), RecordingModel()
    app = make_app(migrated_url, clock=clock, model=model)
    org = await make_org(app)
    plain = await make_agent(app, org, "plain")
    await app.start_liveness()
    taken = await app.turns.take(slack_trigger(org, plain, "hi", "1700000000.000300"))
    assert isinstance(taken, Accepted) and taken.ctx.run_token is not None
    await start_worker(app)
    recovery = runner_of(app, TurnRecovery)
    # Its first pass read the run's lease (not lapsed): it sleeps toward the poll now.
    await eventually(lambda: recovery._next_lapse is not None, WITHIN_S)
    if how == "orphaned":
        app.turns.intake.doubted(taken.ctx.run_token)  # (its read-back failed)
    else:  # (its read-back found nothing), as Intake._settle watches it
        intake_lost = app.turns.intake.lost
        assert intake_lost is not None
        now = clock.now_ms()
        intake_lost.watch(
            RunLook(taken.ctx.run_token, rerun=False),
            due=now + intake_lost.first_ms,
            lapses=now + RUN_LEASE_MS,
        )
    await next_call(model, lambda c: c.text == "hi")


async def test_a_schedule_added_on_an_api_replica_wakes_the_schedule_runner_of_a_worker(
    migrated_pg: str, make_app: MakeApp
) -> None:
    """``leadgate schedule add`` runs in another process than the runners: the NOTIFY of
    ``Wake.schedule`` wakes every replica's schedule runner."""
    clock, model = JumpingClock(), RecordingModel()
    api = make_app(migrated_pg, clock=clock)
    worker = make_app(migrated_pg, clock=clock, model=model)
    org = await make_org(api)
    plain = await make_agent(api, org, "plain")
    await start_worker(worker)
    schedules = runner_of(worker, ScheduleRunner)
    # The worker's first pass found no schedule: it sleeps for the poll.
    await eventually(lambda: schedules.due_in_s() is None, WITHIN_S)
    clock.advance((-clock.now_ms() - DUE_IN_MS) % 60_000)
    due = clock.now_ms() + DUE_IN_MS
    async with api.db.tx() as conn:
        await add_schedule(
            conn,
            clock,
            api.ids,
            org_id=org.id,
            agent_id=plain["id"],
            cron="* * * * *",
            message="tick",
        )

    call = await next_call(model, lambda c: c.text == "tick")
    called_ms = clock.now_ms() - (time.perf_counter() - call.at) * 1000
    report("schedule added on the api replica -> its turn on the worker", (called_ms - due) / 1000)
    assert called_ms >= due


async def test_an_episode_opened_with_a_sooner_timer_wakes_the_sla_runner(
    migrated_url: str, make_app: MakeApp
) -> None:
    """The SLA runner sleeps toward the earliest timer it read; an episode opened since in
    the same process with a sooner one wakes it at its commit
    (``SlaRunner.timers_opened``), so its reminder fires at its time, not at the poll."""
    clock = JumpingClock()
    app = make_app(migrated_url, clock=clock, review={"remind_after": "1s"})
    org, agent = await lead_and_worker(app)
    # An episode whose reminder is an hour away: opened with the clock an hour ahead.
    clock.advance(3_600_000)
    first = await app.turns.run(api_trigger(org, agent, "hard #escalate #complete"))
    assert isinstance(first, Gated)
    assert await drain(app.lead_runner) == 1
    clock.advance(-3_600_000)
    await start_worker(app)
    sla = runner_of(app, SlaRunner)
    await eventually(lambda: (sla.due_in_s() or 0) > 3_000, WITHIN_S)  # asleep

    out = await app.turns.run(api_trigger(org, agent, "hard #escalate #complete", "s2"))
    assert isinstance(out, Gated) and out.work_item_id
    await waiting_for_human(app, out.work_item_id)  # the worker's lead escalated it
    e = t.review_episodes.c

    async def reminded() -> bool:
        async with app.db.read() as conn:
            reminders = await conn.scalar(
                sa.select(e.reminders).where(e.work_item_id == out.work_item_id)
            )
            return bool(reminders == 1)

    await eventually(reminded, WITHIN_S)


async def test_an_episode_opened_on_an_api_replica_wakes_the_sla_runner_of_a_worker(
    migrated_pg: str, make_app: MakeApp
) -> None:
    """An episode opened on another replica with a sooner timer than the one the SLA
    runner sleeps toward: its INSERT's NOTIFY (``Wake.sla``, carrying the timer) wakes
    the worker's SLA runner, so its reminder fires at its time, not at the poll."""
    clock = JumpingClock()
    api = make_app(migrated_pg, clock=clock, review={"remind_after": "1s"})
    worker = make_app(migrated_pg, clock=clock, review={"remind_after": "1s"})
    org, agent = await lead_and_worker(api)
    # An episode whose reminder is an hour away (opened on the api replica before the
    # worker starts): what the worker's SLA runner sleeps toward.
    clock.advance(3_600_000)
    first = await api.turns.run(api_trigger(org, agent, "hard #escalate #complete"))
    assert isinstance(first, Gated)
    assert await drain(api.lead_runner) == 1
    clock.advance(-3_600_000)
    # A second item, claimed for review on the api replica before the worker starts.
    out = await api.turns.run(api_trigger(org, agent, "hard #escalate #complete", "s2"))
    assert isinstance(out, Gated) and out.work_item_id
    claimed = await api.lead_runner.claim()
    assert claimed is not None and claimed.id == out.work_item_id
    await start_worker(worker)
    sla = runner_of(worker, SlaRunner)
    await eventually(lambda: (sla.due_in_s() or 0) > 3_000, WITHIN_S)  # asleep

    await api.lead_runner.review(claimed)  # escalates: the episode opens on the api replica
    assert (await item_row(api, out.work_item_id))["status"] == "awaitingHuman"
    e = t.review_episodes.c

    async def reminded() -> bool:
        async with api.db.read() as conn:
            reminders = await conn.scalar(
                sa.select(e.reminders).where(e.work_item_id == out.work_item_id)
            )
            return bool(reminders == 1)

    await eventually(reminded, WITHIN_S)


# ------------------------------------------- 7. what a LISTEN connection did not hear


async def test_a_reconnected_listener_wakes_every_runner_a_notification_could_have(
    migrated_pg: str, make_app: MakeApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Notifications sent while the LISTEN connection is down (reconnecting, or not up
    yet) are lost: at each (re)connection every runner loop that a notification on its
    channels could have woken is woken once and looks (``App._listen``'s
    ``on_connect``), so what was committed meanwhile waits for no poll. The listener is
    not started: its arguments are what this test calls."""
    heard: dict[str, Any] = {}

    async def nothing() -> None:
        return None

    def listening(
        _dsn: str,
        channels: dict[str, Callable[[str], None]],
        _stop: asyncio.Event,
        *,
        on_connect: list[Callable[[], None]],
        **_: Any,
    ) -> Any:
        heard.update(channels=channels, on_connect=on_connect)
        return nothing()

    monkeypatch.setattr(leadgate.app, "listen_all", listening)
    app = make_app(migrated_pg)
    app._listen(runners=True, surfaces=False)

    def woken() -> set[str]:
        names = {loop.runner.name for loop in app.loops if loop.wake.is_set()}
        for loop in app.loops:
            loop.wake.clear()
        return names

    woken()
    payloads = ["", "another-replica", *(f"{kind.value} another-replica" for kind in Wake)]
    could: set[str] = set()
    for channel, handler in heard["channels"].items():
        if channel == CHANGES_CHANNEL:
            continue  # the configuration cache's, not a runner's
        for payload in payloads:
            handler(payload)
            could |= woken()
    assert {"outbox-relay", "lead-review", "revision-dispatch", "schedules"} <= could
    for callback in heard["on_connect"]:
        callback()
    assert could <= woken()


# ------------------------------------- 8. an api replica's turns left to the recovery


@pytest.mark.parametrize("how", ["interrupted", "intake in doubt", "watched"])
async def test_an_api_replicas_turn_left_to_recovery_is_answered_once(
    migrated_url: str, make_app: MakeApp, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """``serve --role api`` runs no runner loops, yet its REST turns leave runs to the
    turn recovery: a turn stopped on a database fault (503 ``turn.interrupted``), an
    intake in doubt whose read-back failed (503 ``intake.in_doubt``; both orphans), a
    run watched for a claim or intake in doubt that may land later. Only this process
    knows them, and their owner (it) is alive: a worker replica's recovery left them for
    the run's 15-minute lease, then closed them as a live owner's stalled turn, the
    message never answered and its item ``inProgress``. The api process reruns them
    itself (``App._start_own_recovery``): at once, or at the look a second on. Answered
    once: the worker replica never runs that turn."""
    clock, api_model, worker_model = JumpingClock(), RecordingModel(), RecordingModel()
    api = make_app(migrated_url, clock=clock, model=api_model)
    worker = make_app(migrated_url, clock=clock, model=worker_model)
    org, agent = await lead_and_worker(api)
    served = web.AppRunner(api.web_app("api", register=True))
    await served.setup()
    try:
        await start_worker(worker)
        taken = await api.turns.take(api_trigger(org, agent, "draft it #complete"))
        assert isinstance(taken, Accepted) and taken.ctx.run_token and taken.ctx.work_item_id
        if how == "interrupted":
            await stopped_by_a_fault(api.db, api.turns, taken)
        elif how == "intake in doubt":
            api.turns.intake.doubted(taken.ctx.run_token)  # (its read-back failed)
        else:  # a look at the token, a second on, as a claim in doubt leaves it
            now = clock.now_ms()
            api.turns.lost.watch(
                RunLook(taken.ctx.run_token, rerun=True),
                due=now + api.turns.lost.first_ms,
                lapses=now + RUN_LEASE_MS,
            )
        await next_call(api_model, lambda c: c.purpose == "worker")

        async def answered() -> bool:
            status = (await item_row(api, taken.ctx.work_item_id or ""))["status"]
            return bool(status != "inProgress")

        await eventually(answered, WITHIN_S)
        async with api.db.read() as conn:
            assert await conn.scalar(sa.select(sa.func.count()).select_from(t.turn_runs)) == 0
        assert api.turns.orphans == set() and not api.turns.lost
        # Nothing is left for a worker's recovery, the run's lease lapsed or not.
        clock.advance(RUN_LEASE_MS + 1)
        assert await drain(runner_of(worker, TurnRecovery)) == 0
        audit = await item_audit(api, taken.ctx.work_item_id)
        assert [a["action"] for a in audit].count("completeTask") == 1  # answered once
        while not worker_model.calls.empty():  # (the worker's lead reviews it)
            assert worker_model.calls.get_nowait().purpose == "lead"
    finally:
        await served.cleanup()


# ------------------------------- 9. what ``leadgate flow run`` leaves when it exits


async def test_a_flow_run_commands_turn_stopped_by_a_fault_is_run_again_once_it_exits(
    migrated_url: str,
    make_app: MakeApp,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``leadgate flow run`` runs no recovery: a node's turn stopped there by a database
    fault is left to a worker's (``TurnService.orphans`` ends with the command), and the
    run itself stays ``running`` for a worker's flow recovery. Both are leased to the
    command's process, registered while it runs and removed at its exit, so a worker
    takes them back at once: on PostgreSQL woken by that removal's NOTIFY (its loops
    poll every 30 s), on SQLite at its next pass. Unregistered, the command's leases
    named no owner: the run waited 2 minutes for its lease, the turn 15."""
    model = RecordingModel()
    worker = make_app(migrated_url, clock=SystemClock(), model=model)
    await flow_of(worker, FLOW)
    config = tmp_path / "config.toml"
    config.write_text(f'[database]\nurl = "{migrated_url}"\n', encoding="utf-8")
    postgres = not migrated_url.startswith("sqlite")
    if postgres:
        await start_worker(worker)
    faults = injector(migrated_url, monkeypatch)  # (the command's connections alone)
    # The node's turn's last transaction, which ends its recorded run: refused.
    faults.arm_on("DELETE FROM turn_runs")
    code = await asyncio.to_thread(
        main, ["--config", str(config), "flow", "run", "--org", "acme", "f"]
    )
    faults.disarm()
    err = capsys.readouterr().err
    assert faults.fired is not None and code == 2 and "[flow.interrupted]" in err, err
    async with worker.db.read() as conn:
        assert await conn.scalar(sa.select(sa.func.count()).select_from(t.processes)) == (
            1 if postgres else 0  # (the worker's own row)
        )
    exited = time.perf_counter()

    async def taken_back() -> bool:
        # The turn's run was taken and ended (it had signalled complete_task: its
        # handoff went to a person), and the flow run paused on the node's item.
        async with worker.db.read() as conn:
            runs = await conn.scalar(sa.select(sa.func.count()).select_from(t.turn_runs))
            status = await conn.scalar(sa.select(t.flow_runs.c.status))
        return bool(runs == 0 and status == "waitingForHitl")

    if postgres:
        await eventually(taken_back, WITHIN_S)
        report(
            "flow run exited -> its turn and run taken back on the worker",
            time.perf_counter() - exited,
        )
    else:
        assert await drain(runner_of(worker, TurnRecovery)) == 1
        assert await drain(runner_of(worker, FlowRecovery)) == 1
        assert await taken_back()
