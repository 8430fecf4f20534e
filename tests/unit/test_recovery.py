"""Recorded turns and dead-process lease takeback (leadgate.turns.runs, domain.processes).

A process "dies" here by never running the turn it recorded: its ``lease_owner`` is a
process id that is not registered (the row a dead process leaves behind is reaped). On
both databases.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from leadgate.core.clock import MINUTE_MS
from leadgate.core.errors import IntakeInDoubt, ModelError, Unavailable
from leadgate.core.runners import drain
from leadgate.core.types import BindingKind, BindingSpec, Gated, Reply, Trigger
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database
from leadgate.database.schema import metadata
from leadgate.domain import agents as agents_mod
from leadgate.domain import processes
from leadgate.domain.processes import Liveness
from leadgate.runners.recovery import TurnRecovery
from leadgate.turns import runs
from leadgate.turns.intake import Accepted
from leadgate.turns.messages import store_message
from leadgate.turns.providers.base import ModelEvent, ModelRequest
from leadgate.turns.providers.script import ScriptProvider
from tests.fakes import CommitLandsLater, DownFor, HeldCommits
from tests.helpers import (
    Org,
    api_trigger,
    blocked_on_a_lock,
    item_audit,
    item_deliveries,
    item_row,
    make_agent,
    make_org,
    session_item,
    slack_trigger,
    sqlite_plan,
    stopped_by_a_fault,
)
from tests.stack import Stack
from tests.unit.test_turns import RecordingProvider

DEAD = "prc_dead_process"


async def count(stack: Stack, table: sa.Table) -> int:
    async with stack.db.read() as conn:
        return int(await conn.scalar(sa.select(sa.func.count()).select_from(table)) or 0)


async def replies(stack: Stack) -> list[str]:
    d = t.deliveries.c
    async with stack.db.read() as conn:
        rows = (await conn.execute(sa.select(d.text).where(d.kind == "reply"))).all()
    return [r.text for r in rows]


async def alive_here(stack: Stack, *, turns_too: bool = False) -> Liveness:
    """Register this process as alive and make the intake (and, ``turns_too``, the turn
    path) lease its runs to it: a live owner's runs wait for their lease to lapse."""
    live = Liveness(stack.db, stack.clock, stack.ids)
    await live.register()
    stack.turns.intake.owner = live.owner
    if turns_too:
        stack.turns.owner = live.owner
    return live


async def _claim(stack: Stack, *, owner: str | None) -> runs.Claimed | None:
    """A turn recovery claim by ``owner``, of this process's orphans and watched runs."""
    return await runs.claim(
        stack.db,
        stack.clock,
        stack.ids,
        owner=owner,
        orphans=stack.turns.orphans,
        lost=stack.turns.lost,
    )


async def test_a_recorded_channel_turn_of_a_dead_process_is_run_once(stack: Stack) -> None:
    org = await make_org(stack)
    plain = await make_agent(stack, org, "plain")
    stack.turns.intake.owner = lambda: DEAD
    taken = await stack.turns.take(slack_trigger(org, plain, "hello", "1.1"))
    assert isinstance(taken, Accepted)
    assert await count(stack, t.turn_runs) == 1
    # The process died before running it: nothing was answered yet.
    assert await replies(stack) == []
    recovery = TurnRecovery(stack.turns)
    assert await drain(recovery) == 1
    assert await replies(stack) == ["Echo: hello"]
    assert await count(stack, t.turn_runs) == 0
    # A finished turn is never run again.
    assert await drain(recovery) == 0
    # Its redelivery is a duplicate, not a second turn.
    again = await stack.turns.take(slack_trigger(org, plain, "hello", "1.1"))
    assert type(again).__name__ == "Duplicate"


async def test_a_scheduled_turn_of_a_dead_process_is_run_again(stack: Stack) -> None:
    # Nobody asks again for a firing: like a channel's, its turn is recorded and rerun.
    org = await make_org(stack)
    plain = await make_agent(stack, org, "plain")
    stack.turns.intake.owner = lambda: DEAD
    firing = Trigger(
        org_id=org.id,
        agent_id=str(plain["id"]),
        session_key="schedule:sch_1",
        text="morning report",
        binding=BindingSpec(BindingKind.scheduled, {"scheduleId": "sch_1"}),
        external_event_id="schedule:sch_1:1000",
    )
    assert isinstance(await stack.turns.take(firing), Accepted)
    async with stack.db.read() as conn:
        assert (await conn.execute(sa.select(t.turn_runs.c.policy))).scalars().all() == [runs.RERUN]
    assert await drain(TurnRecovery(stack.turns)) == 1
    assert await count(stack, t.turn_runs) == 0
    async with stack.db.read() as conn:
        answered = await conn.scalar(
            sa.select(sa.func.count())
            .select_from(t.messages)
            .where(t.messages.c.role == "assistant", t.messages.c.content == "Echo: morning report")
        )
    assert answered == 1


async def test_a_run_of_a_live_process_is_left_alone_until_its_lease_lapses(stack: Stack) -> None:
    org = await make_org(stack)
    plain = await make_agent(stack, org, "plain")
    await alive_here(stack)
    await stack.turns.take(slack_trigger(org, plain, "hi", "2.1"))
    other = TurnRecovery(stack.turns)
    stack.turns.owner = lambda: "prc_other"
    assert await drain(other) == 0  # its owner is alive: never two live runs
    stack.clock.advance(runs.RUN_LEASE_MS + 1)
    assert await drain(other) == 1  # a stalled run is taken over after its lease
    assert await replies(stack) == ["Echo: hi"]


async def test_an_api_process_recovery_takes_only_the_runs_it_left_to_it(stack: Stack) -> None:
    """``serve --role api`` runs no runners but a turn recovery of its own
    (``TurnRecovery(own_only=True)``): the runs it left to the recovery are known to it
    alone. It takes those, never a run that only a dead holder (or a lapsed lease)
    makes takeable, even an older one: that is the worker replicas' work."""
    org = await make_org(stack)
    plain = await make_agent(stack, org, "plain")
    stack.turns.intake.owner = lambda: DEAD
    assert isinstance(await stack.turns.take(slack_trigger(org, plain, "theirs", "5.1")), Accepted)
    await alive_here(stack, turns_too=True)
    stack.clock.advance(1)
    mine = await stack.turns.take(slack_trigger(org, plain, "mine", "5.2"))
    assert isinstance(mine, Accepted) and mine.ctx.run_token
    own = TurnRecovery(stack.turns, own_only=True)
    assert await drain(own) == 0  # nothing left to it here
    stack.turns.orphaned(mine.ctx.run_token)  # (its turn stopped on a database fault)
    assert await drain(own) == 1
    assert await replies(stack) == ["Echo: mine"]
    assert await count(stack, t.turn_runs) == 1  # the dead process's run: a worker's
    assert await drain(TurnRecovery(stack.turns)) == 1
    assert sorted(await replies(stack)) == ["Echo: mine", "Echo: theirs"]


async def test_the_recovery_runner_knows_when_the_earliest_run_lease_lapses(
    stack: Stack,
) -> None:
    """A run whose process is alive but stalled is takeable when its lease lapses, and
    nothing is committed then: each pass reads when the earliest lease lapses, and the
    runner loop sleeps no longer than until then (``due_in_s``), not until the poll
    (tests/integration/test_runner_wakes.py runs the loop)."""
    org = await make_org(stack)
    plain = await make_agent(stack, org, "plain")
    recovery = TurnRecovery(stack.turns)
    assert not await recovery.run_once()
    assert recovery.due_in_s() is None  # no run in flight: the poll alone
    await alive_here(stack)
    await stack.turns.take(slack_trigger(org, plain, "hi", "2.1"))  # and stalls
    stack.turns.owner = lambda: "prc_other"
    stack.clock.advance(MINUTE_MS)
    assert not await recovery.run_once()  # its owner is alive
    assert recovery.due_in_s() == (runs.RUN_LEASE_MS - MINUTE_MS + 1) / 1000
    stack.clock.advance(runs.RUN_LEASE_MS - MINUTE_MS)  # not lapsed yet (strictly past)
    assert not await recovery.run_once()
    assert recovery.due_in_s() == 0.001
    stack.clock.advance(1)
    assert await recovery.run_once()  # taken over when its lease lapsed
    assert not await recovery.run_once()
    assert recovery.due_in_s() is None
    assert await replies(stack) == ["Echo: hi"]


async def test_a_signal_committed_by_a_dead_turn_is_submitted_once_to_a_human(
    stack: Stack,
) -> None:
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")
    stack.turns.intake.owner = lambda: DEAD
    taken = await stack.turns.take(slack_trigger(org, worker, "draft it #complete", "3.1"))
    assert isinstance(taken, Accepted)
    item_id = taken.ctx.work_item_id
    assert item_id is not None
    # The dead turn got as far as its complete_task signal, then the process died.
    async with stack.db.tx() as conn:
        await conn.execute(
            t.work_items.update()
            .where(t.work_items.c.id == item_id)
            .values(signal_summary="Summary: draft it", signal_turn_id=taken.ctx.turn_id)
        )
    assert await drain(TurnRecovery(stack.turns)) == 1
    item = await item_row(stack, item_id)
    assert item["status"] == "awaitingHuman"
    assert item["summary"] == "Summary: draft it"
    assert item["signal_summary"] is None
    assert [a["action"] for a in await item_audit(stack, item_id)][-1] == "turnInterrupted"
    assert await count(stack, t.turn_runs) == 0
    assert await replies(stack) == []  # no second handoff, no model re-run


async def test_a_cut_api_turn_is_closed_for_the_client_to_retry(stack: Stack) -> None:
    """A dead process's REST run waits (unowned, RESEND_GRACE_MS) for its client's
    resend, which runs the turn; then it is closed, not run a second time."""
    org, worker, _, item_id = await _a_turn_cut(stack, "work on it")
    recovery = TurnRecovery(stack.turns)
    assert await drain(recovery) == 1
    async with stack.db.read() as conn:
        row = (await conn.execute(sa.select(t.turn_runs))).one()
    assert (row.policy, row.lease_owner, row.attempts) == (runs.AWAIT, None, 1)
    # The message stays as stored; the item waits for the client's retry.
    assert (await item_row(stack, item_id))["status"] == "inProgress"
    stack.turns.intake.owner = lambda: None
    stack.clock.advance(1_000)
    retried = await stack.turns.run(api_trigger(org, worker, "work on it #complete"))
    assert type(retried).__name__ == "Gated"
    stack.clock.advance(runs.RESEND_GRACE_MS)
    assert await drain(recovery) == 1
    assert await count(stack, t.turn_runs) == 0
    said = [r for r, _ in await item_messages(stack, item_id)]
    assert said.count("user") == 2 and said.count("assistant") == 1  # answered once


@pytest.mark.parametrize("resent", [False, True], ids=["not-resent", "resent-later"])
async def test_an_api_turn_told_not_to_resend_whose_process_died_is_still_rerun(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, resent: bool
) -> None:
    """A gated REST turn stopped by a database fault: its client got 503
    ``turn.interrupted`` ("do not send it again"), and the run's rerun was owed in that
    process's memory only (the fault refused any write). The process died before the
    database came back. Another process's recovery finds a dead owner's ``client`` run,
    stored just as a turn cut by a dying process is; it closed it, and the item sat
    ``inProgress`` until the week-long sweep, the requester never answered. Now the run
    waits RESEND_GRACE_MS for a resend (none comes) and is rerun: the item goes to its
    lead. A message the client does send in the wait is the turn instead."""
    taken = await _a_gated_api_turn_taken_in(stack)
    assert taken.ctx.run_token and taken.ctx.work_item_id
    await stopped_by_a_fault(stack.db, stack.turns, taken)
    assert stack.turns.orphans == {taken.ctx.run_token}
    # The process dies (its memory with it): another one, with its own recovery.
    async with stack.db.tx() as conn:
        await conn.execute(t.processes.delete())
    stack.turns.orphans.clear()
    stack.turns.owner = lambda: "prc_other"
    recovery = TurnRecovery(stack.turns)
    item_id = taken.ctx.work_item_id
    assert await drain(recovery) == 1  # left to wait for a resend
    assert (await item_row(stack, item_id))["status"] == "inProgress"
    assert await count(stack, t.turn_runs) == 1
    assert not await recovery.run_once()  # not before the wait is over
    due = recovery.due_in_s()
    assert due is not None and 0 < due <= runs.RESEND_GRACE_MS / 1000 + 1
    if resent:
        stack.clock.advance(5_000)
        assert isinstance(await stack.turns.run(_sent_again(taken, "work on it #complete")), Gated)
    stack.clock.advance(runs.RESEND_GRACE_MS + 1)
    assert await drain(recovery) == 1
    assert await count(stack, t.turn_runs) == 0
    assert (await item_row(stack, item_id))["status"] == "reviewQueued"
    answers = [c for r, c in await item_messages(stack, item_id) if r == "assistant"]
    assert len(answers) == 1  # run once: by recovery, or by the resend


def _sent_again(taken: Accepted, text: str) -> Trigger:
    """What the REST client of ``taken`` sends next in its session (``s1``): ``text``."""
    return Trigger(
        org_id=taken.ctx.org_id,
        agent_id=taken.ctx.agent_id,
        session_key="s1",
        text=text,
        binding=BindingSpec(BindingKind.api),
    )


async def _a_gated_api_turn_taken_in(
    stack: Stack, text: str = "work on it #complete", *, event: str | None = None
) -> Accepted:
    """A REST turn of a worker with a lead, taken in by this (live) process, not run
    (its run token and work item set); ``event``: under that external event id (an
    ``Idempotency-Key``'s)."""
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")
    await alive_here(stack, turns_too=True)
    trigger = dataclasses.replace(api_trigger(org, worker, text), external_event_id=event)
    taken = await stack.turns.take(trigger)
    assert isinstance(taken, Accepted) and taken.ctx.run_token and taken.ctx.work_item_id
    return taken


async def test_an_api_turn_told_not_to_resend_is_run_again_by_recovery(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gated REST turn taken in, then stopped by a database fault in a live process:
    its client got 503 ``turn.interrupted`` ("do not send it again"), so the recovery
    runs it (the item goes to its lead) whatever its ``client`` policy. It closed the
    run, and the item sat ``inProgress`` for good with nothing running it
    (tests/reliability/test_faults.py::test_postgres_restarted_mid_load). An intake in
    doubt whose read-back failed (``intake.in_doubt``) hands its run to the same
    orphans (``Intake.doubted``)."""
    taken = await _a_gated_api_turn_taken_in(stack)
    assert taken.ctx.run_token and taken.ctx.work_item_id
    await stopped_by_a_fault(stack.db, stack.turns, taken)
    assert len(stack.turns.orphans) == 1
    assert await count(stack, t.turn_runs) == 1
    item_id = taken.ctx.work_item_id
    assert await drain(TurnRecovery(stack.turns)) == 1
    assert await count(stack, t.turn_runs) == 0
    item = await item_row(stack, item_id)
    assert item["status"] == "reviewQueued", item["status"]
    async with stack.db.read() as conn:
        users = await conn.scalar(
            sa.select(sa.func.count())
            .select_from(t.messages)
            .where(t.messages.c.role == "user", t.messages.c.work_item_id == item_id)
        )
    assert users == 1  # taken in once, answered once


async def test_a_client_run_claimed_for_a_rerun_stays_a_rerun(stack: Stack) -> None:
    """The recovery claimed an orphaned REST turn's run to rerun it, and its process
    died before the turn ended: another process's recovery reruns it too (the claim
    wrote ``policy`` ``rerun``), rather than close it for a retry nobody will send."""
    taken = await _a_gated_api_turn_taken_in(stack)
    assert taken.ctx.run_token and taken.ctx.work_item_id
    stack.turns.orphaned(taken.ctx.run_token)
    claimed = await _claim(stack, owner=DEAD)  # the process that claimed it, then died
    assert claimed is not None and claimed.action == runs.RERUN
    async with stack.db.read() as conn:
        assert (await conn.execute(sa.select(t.turn_runs.c.policy))).scalars().all() == [runs.RERUN]
    stack.turns.owner = lambda: "prc_other"
    assert await drain(TurnRecovery(stack.turns)) == 1
    assert (await item_row(stack, taken.ctx.work_item_id))["status"] == "reviewQueued"
    assert await count(stack, t.turn_runs) == 0


async def test_a_failing_turn_leaves_a_notice_and_gives_up_after_three_attempts(
    stack: Stack,
) -> None:
    org = await make_org(stack)
    plain = await make_agent(stack, org, "plain")
    stack.turns.intake.owner = lambda: DEAD
    await stack.turns.take(slack_trigger(org, plain, "boom #fail", "4.1"))
    recovery = TurnRecovery(stack.turns)
    assert await drain(recovery) == 1
    # The model failed: the person is told, the run is closed.
    assert await replies(stack) == [runs.FAILURE_NOTICE]
    assert await count(stack, t.turn_runs) == 0
    # A run whose process keeps dying is given up after MAX_ATTEMPTS, with the notice.
    await stack.turns.take(slack_trigger(org, plain, "again", "4.2"))
    async with stack.db.tx() as conn:
        await conn.execute(t.turn_runs.update().values(attempts=runs.MAX_ATTEMPTS))
    assert await drain(recovery) == 1
    assert await replies(stack) == [runs.FAILURE_NOTICE, runs.FAILURE_NOTICE]


async def item_messages(stack: Stack, item_id: str) -> list[tuple[str, str]]:
    """A work item's messages (role, text), oldest first: what its transcript shows."""
    m = t.messages.c
    async with stack.db.read() as conn:
        rows = (
            await conn.execute(
                sa.select(m.role, m.content)
                .where(m.work_item_id == item_id)
                .order_by(m.created_at, m.id)
            )
        ).all()
    return [(r.role, r.content) for r in rows]


@pytest.mark.parametrize("why", ["orphan", "no resend"])
@pytest.mark.parametrize("end", ["gave up", "model failed"])
async def test_a_rerun_api_turn_that_cannot_finish_ends_its_item_with_a_notice(
    stack: Stack, end: str, why: str
) -> None:
    """A gated REST turn whose client was told not to send it again (503
    ``turn.interrupted``: an orphan) is rerun by recovery. When that rerun cannot finish
    (its model fails, or its runs reached MAX_ATTEMPTS), nobody is waiting for a
    response and nobody will send the message again: the failure notice is stored as the
    session's answer, and the item is abandoned (audit ``turnGaveUp``). It was closed
    silently (an api binding posts no notice) and the item sat ``inProgress`` until the
    week-long abandonment sweep, the requester never answered. (``no resend``: its
    process died, and no message came in the wait for a resend: rerun the same way.)"""
    text = "boom #fail" if end == "model failed" else "work on it #complete"
    taken = await _a_gated_api_turn_taken_in(stack, text)
    assert taken.ctx.run_token and taken.ctx.work_item_id
    recovery = TurnRecovery(stack.turns)
    if why == "orphan":
        stack.turns.orphaned(taken.ctx.run_token)  # its turn stopped on a database fault
    else:
        async with stack.db.tx() as conn:
            await conn.execute(t.processes.delete())  # its process died
        assert await drain(recovery) == 1  # waits for a resend
        stack.clock.advance(runs.RESEND_GRACE_MS + 1)
    if end == "gave up":
        async with stack.db.tx() as conn:
            await conn.execute(t.turn_runs.update().values(attempts=runs.MAX_ATTEMPTS))
    assert await drain(recovery) == 1
    assert await count(stack, t.turn_runs) == 0
    item_id = taken.ctx.work_item_id
    assert (await item_row(stack, item_id))["status"] == "abandoned"
    last = (await item_audit(stack, item_id))[-1]
    assert last["action"] == runs.GAVE_UP_ACTION
    why = runs.CLIENT_FAILED_TEXT if end == "model failed" else runs.CLIENT_GAVE_UP_TEXT
    assert last["text"] == why
    assert await item_messages(stack, item_id) == [
        ("user", text),
        ("assistant", runs.FAILURE_NOTICE),
    ]
    assert await replies(stack) == []  # an api binding posts nothing


async def test_a_live_gated_api_turn_whose_model_fails_waits_for_the_clients_retry(
    stack: Stack,
) -> None:
    """Not a bug: a gated REST turn whose model fails while its client waits gets the
    502 (``x-should-retry: false``: the message was stored, nothing resends it by
    itself). Its run is closed and the item stays ``inProgress``, as a channel's does
    after its failure notice: the client was told the model failed, and the message it
    sends again is taken into the same item and runs the turn (no second item, nothing
    left ``inProgress``; an item nobody writes to again is ended by the abandonment
    sweeper, as any idle one)."""
    taken = await _a_gated_api_turn_taken_in(stack, "boom #fail")
    assert taken.ctx.run_token and taken.ctx.work_item_id
    with pytest.raises(ModelError):
        await stack.turns.execute(taken)
    assert await count(stack, t.turn_runs) == 0
    assert stack.turns.orphans == set()
    item_id = taken.ctx.work_item_id
    assert (await item_row(stack, item_id))["status"] == "inProgress"
    assert await drain(TurnRecovery(stack.turns)) == 0  # nothing for recovery to do
    retried = await stack.turns.run(_sent_again(taken, "again #complete"))
    assert isinstance(retried, Gated) and retried.work_item_id == item_id
    assert (await item_row(stack, item_id))["status"] == "reviewQueued"


async def _a_turn_cut(
    stack: Stack, text: str, event: str | None = None
) -> tuple[Org, dict[str, Any], Trigger, str]:
    """A REST message to a worker with a lead (``event``: under that external event id,
    an ``Idempotency-Key``'s), taken in by a process that then died mid-turn (its run
    left to recovery): its organization, worker, trigger (its retry's) and work item."""
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")
    stack.turns.intake.owner = lambda: DEAD
    trigger = dataclasses.replace(api_trigger(org, worker, text), external_event_id=event)
    taken = await stack.turns.take(trigger)
    assert isinstance(taken, Accepted) and taken.ctx.work_item_id
    return org, worker, trigger, taken.ctx.work_item_id


async def _a_keyed_turn_cut(stack: Stack, text: str) -> tuple[Org, dict[str, Any], Trigger, str]:
    """:func:`_a_turn_cut` under the key event ``idem:k``, this process alive (the
    retry's)."""
    cut = await _a_turn_cut(stack, text, "idem:k")
    await alive_here(stack, turns_too=True)
    return cut


def _told_to_resend(stack: Stack, taken: Accepted) -> None:
    """``taken``'s intake was in doubt and its read-back found nothing (its client was
    told "nothing was stored, please retry"), then the server applied the commit: its
    run is watched for (``RunLook``, not owed a rerun), as ``Intake._settle`` has it."""
    assert taken.ctx.run_token
    lost, now = stack.turns.lost, stack.clock.now_ms()
    lost.watch(
        runs.RunLook(taken.ctx.run_token, rerun=False),
        due=now + lost.first_ms,
        lapses=now + runs.RUN_LEASE_MS,
    )


def _keyed_answers(stack: Stack) -> list[tuple[str, str]]:
    """What reruns store under the keys of their messages' external event ids (the
    composition root's ``Idempotency-Key`` store, here a list: event id, answer)."""
    stored: list[tuple[str, str]] = []

    async def keyed_answer(_conn: Any, event: str, outcome: Reply | Gated | Exception) -> None:
        stored.append((event, outcome.text if isinstance(outcome, Reply) else repr(outcome)))

    stack.turns.keyed_answer = keyed_answer
    return stored


@pytest.mark.parametrize("unkeyed", ["sent first", "sent second"])
async def test_a_claim_of_a_keyed_and_an_unkeyed_run_told_to_resend_reruns_the_keyed_one(
    stack: Stack, unkeyed: str
) -> None:
    """Two REST messages of one session, one under an ``Idempotency-Key`` and one
    without, each taken in with its intake in doubt and not found by its read-back (503
    "nothing was stored, please retry"), the commits then applied by the server: one
    recovery claim holds both runs. The unkeyed client sends its message again, a new
    message whose turn answers it; the keyed client's resend is its retry with the key,
    a duplicate that runs no turn. So the claim closes the unkeyed run and reruns the
    keyed one only, which answers its own message (its model is not shown the other) and
    stores that answer under the key. Each message is answered once. The claim reran
    both: the rerun answered the newest message (the unkeyed one, sent second), stored
    that answer under the key, and the unkeyed client's resend was answered again."""
    key, texts = "idem:k-1", {"keyed": "draft it", "unkeyed": "and this too"}
    order = ["unkeyed", "keyed"] if unkeyed == "sent first" else ["keyed", "unkeyed"]
    events = {"keyed": key, "unkeyed": None}
    first = await _a_gated_api_turn_taken_in(stack, texts[order[0]], event=events[order[0]])
    stack.clock.advance(1_000)
    trigger = _sent_again(first, texts[order[1]])
    second = await stack.turns.take(
        dataclasses.replace(trigger, external_event_id=events[order[1]])
    )
    assert isinstance(second, Accepted) and second.ctx.work_item_id == first.ctx.work_item_id
    item_id = first.ctx.work_item_id
    assert item_id is not None
    for taken in (first, second):
        _told_to_resend(stack, taken)
    stored = _keyed_answers(stack)
    stack.clock.advance(1_000)  # the looks are due
    claimed = await _claim(stack, owner=stack.turns.owner())
    assert claimed is not None and claimed.action == runs.RERUN
    assert len(claimed.run_ids) == 1 and claimed.external_event_ids == (key,)
    assert await count(stack, t.turn_runs) == 1  # the unkeyed run is closed
    await stack.turns.resume(claimed)
    assert stored == [(key, "Echo: draft it")]
    asked = [("user", texts[order[0]]), ("user", texts[order[1]])]
    assert await item_messages(stack, item_id) == [*asked, ("assistant", "Echo: draft it")]
    # The unkeyed client's resend: its own turn answers it, once.
    resent = await stack.turns.run(_sent_again(first, texts["unkeyed"]))
    assert isinstance(resent, Reply) and resent.text == "Echo: and this too"
    assert await item_messages(stack, item_id) == [
        *asked,
        ("assistant", "Echo: draft it"),
        ("user", "and this too"),
        ("assistant", "Echo: and this too"),
    ]
    assert await count(stack, t.turn_runs) == 0
    assert await drain(TurnRecovery(stack.turns)) == 0


async def _scripted(request: ModelRequest) -> list[ModelEvent]:
    """The built-in script model's events for ``request`` (a :class:`RecordingProvider`
    handler: the requests are recorded, the answers are the script's)."""
    return [event async for event in ScriptProvider().stream(request)]


def _a_recorded_stack(make_stack: Callable[..., Stack]) -> tuple[Stack, RecordingProvider]:
    """A stack whose script model records every request (what the model was shown)."""
    model = RecordingProvider()
    model.handler = _scripted
    return make_stack(providers={"script": model}), model


def _users_shown(model: RecordingProvider) -> list[list[str]]:
    """The user messages each model call was shown, oldest first."""
    return [[m.content for m in r.messages if m.role == "user"] for r in model.requests]


async def test_a_cut_run_claimed_with_a_run_told_to_resend_still_waits_for_its_own(
    make_stack: Callable[..., Stack],
) -> None:
    """One recovery claim holds a REST run whose client was told to resend (its intake
    in doubt, not found) and a later message's run cut by its process dying. The first
    is closed (its resend is its turn); the cut run is treated as alone: it waits for
    its own client's resend and, none coming, is rerun and answers its message, its
    model not shown the first (that claim stored it on the run: the rerun is a later
    claim's). The claim closed both at once, the cut message never answered; then the
    later claim showed the model the first message again."""
    stack, model = _a_recorded_stack(make_stack)
    told = await _a_gated_api_turn_taken_in(stack, "first")
    item_id = told.ctx.work_item_id
    stack.clock.advance(1_000)
    stack.turns.intake.owner = lambda: DEAD
    cut = await stack.turns.take(_sent_again(told, "second"))
    assert isinstance(cut, Accepted) and cut.ctx.work_item_id == item_id and item_id
    _told_to_resend(stack, told)
    stack.clock.advance(1_000)  # the look is due
    recovery = TurnRecovery(stack.turns)
    assert await drain(recovery) == 1
    async with stack.db.read() as conn:
        left = (await conn.execute(sa.select(t.turn_runs))).all()
    assert [(r.turn_id, r.policy) for r in left] == [(cut.ctx.turn_id, runs.AWAIT)]
    stack.clock.advance(runs.RESEND_GRACE_MS + 1)
    assert await drain(recovery) == 1  # no resend came: rerun
    assert await count(stack, t.turn_runs) == 0
    assert _users_shown(model) == [["second"]]
    assert await item_messages(stack, item_id) == [
        ("user", "first"),
        ("user", "second"),
        ("assistant", "Echo: second"),
    ]


async def test_a_keyed_rerun_after_an_intake_in_doubt_that_fails_says_why(stack: Stack) -> None:
    """A keyed REST request whose intake was in doubt and not found by its read-back
    (503 "nothing was stored, please retry"), the commit then applied by the server:
    recovery reruns its run (the client's resend is the key's retry, a duplicate that
    runs no turn), and the model fails in the rerun. The failure notice is the session's
    answer and the item is abandoned, its audit saying why: the client was told nothing
    was stored and resends under the key, whose retry is answered the model's error.
    It said the client "was told not to send the message again", the opposite of what
    it was told."""
    taken = await _a_gated_api_turn_taken_in(stack, "boom #fail", event="idem:k-2")
    item_id = taken.ctx.work_item_id
    assert item_id is not None
    _told_to_resend(stack, taken)
    stored = _keyed_answers(stack)
    stack.clock.advance(1_000)  # the look is due
    assert await drain(TurnRecovery(stack.turns)) == 1
    assert await count(stack, t.turn_runs) == 0
    assert (await item_row(stack, item_id))["status"] == "abandoned"
    last = (await item_audit(stack, item_id))[-1]
    assert (last["action"], last["text"]) == (runs.GAVE_UP_ACTION, runs.KEYED_RESEND_FAILED_TEXT)
    assert "told not to send" not in last["text"]
    assert await item_messages(stack, item_id) == [
        ("user", "boom #fail"),
        ("assistant", runs.FAILURE_NOTICE),
    ]
    assert [event for event, _ in stored] == ["idem:k-2"] and "ModelError" in stored[0][1]


@pytest.mark.parametrize("end", ["answered", "model failed", "gave up", "the key's retry"])
async def test_a_keyed_rerun_after_an_intake_in_doubt_keeps_why_when_its_process_dies(
    make_stack: Callable[..., Stack], end: str
) -> None:
    """Two REST messages of one session, a keyed one and an unkeyed one sent after it,
    each taken in with its intake in doubt and not found by its read-back (503 "nothing
    was stored, please retry"): one recovery claim closes the unkeyed run (its resend is
    its turn) and reruns the keyed one, and the process rerunning it dies. Another claim
    takes the run (or the key's retry does). Its model is not shown the unkeyed message
    (its resend's turn answers it), and a failure or a give-up says the client was told
    nothing was stored and resends under its key. The claim kept neither on the run row
    (``policy`` ``rerun`` only): the later turn answered the unkeyed message under the
    key, and a failure's audit said the client "was told not to send the message
    again"."""
    stack, model = _a_recorded_stack(make_stack)
    key = "idem:k-3"
    text = "boom #fail" if end == "model failed" else "draft it"
    first = await _a_gated_api_turn_taken_in(stack, text, event=key)
    item_id = first.ctx.work_item_id
    stack.clock.advance(1_000)
    second = await stack.turns.take(_sent_again(first, "and this too"))
    assert isinstance(second, Accepted) and second.ctx.work_item_id == item_id and item_id
    for taken in (first, second):
        _told_to_resend(stack, taken)
    stored = _keyed_answers(stack)
    stack.clock.advance(1_000)  # the looks are due
    claimed = await _claim(stack, owner=DEAD)  # the process that claimed it, then died rerunning it
    assert claimed is not None and claimed.action == runs.RERUN and claimed.keyed_resend
    assert len(claimed.not_answered) == 1 and claimed.external_event_ids == (key,)
    assert await count(stack, t.turn_runs) == 1  # the unkeyed run is closed
    if end == "gave up":
        async with stack.db.tx() as conn:
            await conn.execute(t.turn_runs.update().values(attempts=runs.MAX_ATTEMPTS))
    if end == "the key's retry":
        retry = dataclasses.replace(_sent_again(first, text), external_event_id=key)
        retried = await stack.turns.run(retry, retake=True)
        assert isinstance(retried, Reply) and retried.text == "Echo: draft it"
    else:
        assert await drain(TurnRecovery(stack.turns)) == 1
    assert await count(stack, t.turn_runs) == 0
    assert _users_shown(model) == ([] if end == "gave up" else [[text]])
    asked = [("user", text), ("user", "and this too")]
    if end in ("answered", "the key's retry"):
        if end == "answered":
            assert stored == [(key, "Echo: draft it")]
        assert await item_messages(stack, item_id) == [*asked, ("assistant", "Echo: draft it")]
        return
    assert (await item_row(stack, item_id))["status"] == "abandoned"
    last = (await item_audit(stack, item_id))[-1]
    assert last["action"] == runs.GAVE_UP_ACTION
    assert "told not to send" not in last["text"]
    why = runs.KEYED_RESEND_FAILED_TEXT if end == "model failed" else runs.KEYED_RESEND_GAVE_UP_TEXT
    assert last["text"] == why
    assert await item_messages(stack, item_id) == [*asked, ("assistant", runs.FAILURE_NOTICE)]
    assert [event for event, _ in stored] == [key] and "ModelError" in stored[0][1]


async def test_leases_of_a_dead_process_are_taken_back_at_once(stack: Stack) -> None:
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")
    live = Liveness(stack.db, stack.clock, stack.ids)
    await live.register()
    stack.lead_runner.owner = live.owner
    await stack.turns.run(api_trigger(org, worker, "do it #complete"))
    item = await stack.lead_runner.claim()
    assert item is not None and item.lease_owner == live.id
    # Alive: its 20-minute lease holds.
    assert await stack.lead_runner.expire_leases() == 0
    # Dead (its row reaped): taken back at once, long before the lease expires.
    await live.unregister()
    assert await stack.lead_runner.expire_leases() == 1
    assert (await item_row(stack, item.id))["status"] == "reviewQueued"
    # A send lease likewise: a post in flight when its process died stays uncertain.
    stack.relay.owner = lambda: DEAD
    out = await stack.turns.run(slack_trigger(org, worker, "post it #complete", "1.1"))
    assert isinstance(out, Gated)
    await drain(stack.lead_runner)
    rows = [r for r in await stack.relay.claim() if r.work_item_id == out.work_item_id]
    assert [r.lease_owner for r in rows] == [DEAD] and rows[0].action == "post"
    assert await stack.relay.expire_send_leases() == 1
    [dlv] = await item_deliveries(stack, str(out.work_item_id))
    assert dlv["status"] == "deliveryUnknown"


async def test_liveness_reaps_dead_processes_of_this_host_and_silent_ones(stack: Stack) -> None:
    me = Liveness(stack.db, stack.clock, stack.ids, dead_after_ms=30_000)
    await me.register()
    now = stack.clock.now_ms()
    gone_pid = max(os.getpid() + 1000, 4_000_000)  # no such pid
    async with stack.db.tx() as conn:
        for pid, host, beat, name in (
            (gone_pid, me.host, now, "prc_same_host_gone"),
            (os.getpid(), me.host, now, "prc_pid_reused"),  # same pid, other start time
            (1, "elsewhere/boot", now - MINUTE_MS, "prc_silent"),
            (1, "elsewhere/boot", now, "prc_alive_elsewhere"),
        ):
            await conn.execute(
                t.processes.insert().values(
                    id=name,
                    host=host,
                    pid=pid,
                    start_token="not-its-start",
                    role="all",
                    started_at=now,
                    heartbeat_at=beat,
                )
            )
    assert await me.reap() == 3
    async with stack.db.read() as conn:
        left = set((await conn.execute(sa.select(t.processes.c.id))).scalars())
    assert left == {me.id, "prc_alive_elsewhere"}
    assert processes.start_token(os.getpid()) is not None


async def test_a_heartbeats_reap_with_nobody_dead_writes_nothing(stack: Stack) -> None:
    """Every heartbeat of every replica reaps: when its read finds no process dead it
    opens no write transaction (on SQLite the writer's lock, on PostgreSQL a round trip
    and a commit, every few seconds per replica), and one lapsed since is reaped then."""
    me = Liveness(stack.db, stack.clock, stack.ids, dead_after_ms=30_000)
    other = Liveness(stack.db, stack.clock, stack.ids, dead_after_ms=30_000)
    await me.register()
    await other.register()
    with stack.db.record_statements() as statements:
        assert await me.reap() == 0
    # (the read alone: SQLite frames it BEGIN ... ROLLBACK, a writer's is BEGIN IMMEDIATE)
    verbs = [sql.split()[0].upper() for sql in statements if sql.split()]
    assert [v for v in verbs if v not in ("BEGIN", "ROLLBACK")] == ["SELECT"], statements
    assert not [sql for sql in statements if "IMMEDIATE" in sql.upper()], statements
    stack.clock.advance(30_001)
    await me.beat()  # its own beat: only the other has lapsed
    assert await me.reap() == 1
    async with stack.db.read() as conn:
        left = set((await conn.execute(sa.select(t.processes.c.id))).scalars())
    assert left == {me.id}
    async with stack.db.read() as conn:
        noted = set((await conn.execute(sa.select(t.gone_processes.c.id))).scalars())
    assert noted == {other.id}


@pytest.mark.parametrize("landed", [False, True], ids=["commit-lost", "commit-landed"])
async def test_a_recovery_claim_whose_commit_failed_is_taken_again_at_once(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, landed: bool
) -> None:
    """A turn stopped by a database fault is an orphan: the recovery runner takes it at
    its next pass. When that claim's COMMIT fails (lost, or landed while the connection
    died), the run is taken again at the following pass, not after its 15-minute lease."""
    org = await make_org(stack)
    plain = await make_agent(stack, org, "plain")
    await alive_here(stack)
    taken = await stack.turns.take(slack_trigger(org, plain, "hello", "7.1"))
    assert isinstance(taken, Accepted) and taken.ctx.run_token
    stack.turns.orphans.add(taken.ctx.run_token)  # its turn stopped on a database fault
    recovery = TurnRecovery(stack.turns)
    # Landed is in doubt (PostgreSQL's COMMIT whose answer was lost); on SQLite, whose
    # COMMIT cannot be lost, it runs the same handler of a failed claim (runs.claim
    # takes the claim's token back whatever the fault): it does not depend on the
    # backend.
    down = DownFor(stack.db.tx, 1, after_commit=landed, sqlite_too=True)
    monkeypatch.setattr(stack.db, "tx", down)
    with pytest.raises(Unavailable) as raised:
        await recovery.run_once()
    assert raised.value.in_doubt is landed
    monkeypatch.setattr(stack.db, "tx", down.real)
    assert await drain(recovery) == 1  # the live owner's lease has 15 minutes left
    assert await replies(stack) == ["Echo: hello"]
    assert await count(stack, t.turn_runs) == 0


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_recovery_claim_in_doubt_that_lands_after_the_next_claim_is_taken_soon(
    stack: Stack,
    monkeypatch: pytest.MonkeyPatch,
    commit_lands_later: Callable[[Database], CommitLandsLater],
) -> None:
    """The recovery claim's COMMIT answer was lost, and the next pass's claim, asking
    for the run's old token and the lost claim's, found nothing (the claim on its way
    held the rows: SKIP LOCKED passed them by); then the server applied it. The run is
    under a token nobody holds: it is looked for again a second later and run, not
    after its 15-minute lease (its owner is alive). Between looks a pass is the lease
    check's read, no claim. (PostgreSQL only: a SQLite COMMIT is never in doubt.)"""
    org = await make_org(stack)
    plain = await make_agent(stack, org, "plain")
    await alive_here(stack, turns_too=True)
    taken = await stack.turns.take(slack_trigger(org, plain, "hello", "8.1"))
    assert isinstance(taken, Accepted) and taken.ctx.run_token
    stack.turns.orphans.add(taken.ctx.run_token)  # its turn stopped on a database fault
    recovery = TurnRecovery(stack.turns)
    woken: list[bool] = []
    stack.turns.recovery_due = lambda: woken.append(True)  # (its loop's wake)
    late = commit_lands_later(stack.db)
    with pytest.raises(Unavailable) as raised:
        await recovery.run_once()
    assert raised.value.in_doubt
    assert await recovery.run_once() is False  # the rows are locked: nothing found
    # The tokens it watched since did not wake its own loop: woken, it ran the pass
    # below at once, a read for nothing (its sleep is weighed after each pass).
    assert woken == []
    await late.land()
    # Not due yet: no claim (a write transaction) on this pass, the read alone.
    monkeypatch.setattr(stack.db, "tx", DownFor(stack.db.tx, 1, after_commit=False))
    with stack.db.record_statements() as statements:
        assert await recovery.run_once() is False
    assert len(statements) == 1, statements
    monkeypatch.setattr(stack.db, "tx", late)
    due = recovery.due_in_s()
    assert due is not None and 0 < due <= 1.0  # the loop wakes for the look
    stack.clock.advance(1_000)  # a second on, not the 15-minute lease
    assert await drain(recovery) == 1
    assert await replies(stack) == ["Echo: hello"]
    assert await count(stack, t.turn_runs) == 0


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
@pytest.mark.parametrize("read_back", ["finds nothing", "fails"])
async def test_an_intake_in_doubt_that_lands_after_its_read_back_is_recovered_soon(
    stack: Stack,
    monkeypatch: pytest.MonkeyPatch,
    commit_lands_later: Callable[[Database], CommitLandsLater],
    read_back: str,
) -> None:
    """A channel message's intake lost its COMMIT's answer, and its read-back found
    nothing (or failed, and the recovery's claim of its run then found nothing); then
    the server applied it. Its run waits under a token nobody holds: the recovery looks
    for it again a second later and runs the turn, not after its 15-minute lease (its
    owner is alive; the platform's redelivery is a duplicate by then). (PostgreSQL only:
    a SQLite COMMIT is never in doubt.)"""
    org = await make_org(stack)
    plain = await make_agent(stack, org, "plain")
    await alive_here(stack, turns_too=True)
    late = commit_lands_later(stack.db)
    if read_back == "fails":
        monkeypatch.setattr(stack.db, "read", DownFor(stack.db.read, 1, after_commit=False))
    with pytest.raises(Unavailable) as raised:
        await stack.turns.take(slack_trigger(org, plain, "hello", "9.1"))
    assert raised.value.in_doubt or read_back == "fails"
    assert isinstance(raised.value, IntakeInDoubt) is (read_back == "fails")
    recovery = TurnRecovery(stack.turns)
    assert await recovery.run_once() is False  # it has not landed: nothing to take
    await late.land()
    assert await count(stack, t.turn_runs) == 1
    assert await recovery.run_once() is False  # not looked for again yet
    due = recovery.due_in_s()
    assert due is not None and 0 < due <= 1.0
    stack.clock.advance(1_000)
    assert await drain(recovery) == 1
    assert await replies(stack) == ["Echo: hello"]
    assert await count(stack, t.turn_runs) == 0


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
@pytest.mark.parametrize("read_back", ["finds nothing", "fails"])
async def test_a_rest_intake_in_doubt_that_lands_late_is_run_only_if_not_sent_again(
    stack: Stack,
    monkeypatch: pytest.MonkeyPatch,
    commit_lands_later: Callable[[Database], CommitLandsLater],
    read_back: str,
) -> None:
    """A gated REST message's intake lost its COMMIT's answer; then the server applied
    it. Its read-back found nothing: the client was told nothing was stored and sends it
    again (a message of its own), so the run found later is closed, not run (run, the
    one request was worked on twice, once for each copy). Its read-back failed
    (``intake.in_doubt``): the client was told not to send it again, so the run is run
    and its item goes to the lead. (PostgreSQL only: a SQLite COMMIT is never in
    doubt.)"""
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")
    await alive_here(stack, turns_too=True)
    late = commit_lands_later(stack.db)
    if read_back == "fails":  # the first read once the intake's COMMIT is held: its read-back
        down, read = DownFor(stack.db.read, 1, after_commit=False), stack.db.read
        monkeypatch.setattr(stack.db, "read", lambda: read() if late.held is None else down())
    with pytest.raises(Unavailable) as raised:
        await stack.turns.take(api_trigger(org, worker, "work on it #complete", "s1"))
    assert isinstance(raised.value, IntakeInDoubt) is (read_back == "fails")
    recovery = TurnRecovery(stack.turns)
    assert await recovery.run_once() is False  # it has not landed: nothing to take
    await late.land()
    assert await count(stack, t.turn_runs) == 1
    stack.clock.advance(1_000)
    assert await drain(recovery) == 1
    assert await count(stack, t.turn_runs) == 0
    item = await item_row(stack, await session_item(stack, "s1"))
    assert item["status"] == ("reviewQueued" if read_back == "fails" else "inProgress")


async def test_a_keyed_retry_takes_only_a_run_nobody_runs(stack: Stack) -> None:
    """``claim_for_retry``: an Idempotency-Key's retry takes its message's run only when
    turn recovery would run it (a dead owner's, or one waiting for its client's resend),
    under a lease of its own that recovery then leaves alone; a run a live process holds
    (recovery's rerun, or another retry's) is not the retry's (``RUN_BUSY``); no run
    left is None."""
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")
    live = await alive_here(stack)

    async def cut(text: str, event: str) -> None:
        stack.turns.intake.owner = lambda: DEAD
        trigger = api_trigger(org, worker, text, session=event)
        taken = await stack.turns.take(dataclasses.replace(trigger, external_event_id=event))
        assert isinstance(taken, Accepted) and taken.ctx.run_token

    async def retry(event: str) -> runs.Claimed | str | None:
        return await runs.claim_for_retry(
            stack.db, stack.clock, stack.ids, external_event_id=event, owner=live.id
        )

    async def recover() -> runs.Claimed | None:
        return await runs.claim(
            stack.db, stack.clock, stack.ids, owner=live.id, orphans=set(), lost=stack.turns.lost
        )

    await cut("draft it", "idem:a")
    waiting = await recover()
    assert waiting is not None and waiting.action == runs.WAITING
    retried = await retry("idem:a")
    assert isinstance(retried, runs.Claimed) and retried.action == runs.RERUN
    stack.clock.advance(runs.RESEND_GRACE_MS + 1)
    assert await recover() is None  # the retry's process is alive: never two runs
    assert await retry("idem:a") == runs.RUN_BUSY  # nor a second retry
    async with stack.db.tx() as conn:
        await runs.finish(conn, retried.token, fenced=True)
    assert await retry("idem:a") is None  # its turn ended
    # Recovery's rerun holds the run: the retry takes nothing.
    await cut("draft that", "idem:b")
    assert await recover() is not None  # waits for a resend
    stack.clock.advance(runs.RESEND_GRACE_MS + 1)
    rerun = await recover()
    assert rerun is not None and rerun.action == runs.RERUN
    assert rerun.external_event_ids == ("idem:b",)
    assert await retry("idem:b") == runs.RUN_BUSY


@pytest.mark.parametrize(
    ("cut", "db_url"),
    [
        ("its read fails", "sqlite"),
        ("its read fails", "postgres"),
        # (A SQLite COMMIT's answer cannot be lost.)
        ("its claim in doubt", "postgres"),
    ],
    indirect=["db_url"],
)
async def test_a_keyed_retry_cut_between_its_claim_and_its_turn_leaves_the_run_to_recovery(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    """A keyed retry claims its message's run (``claim_for_retry``: leased to this live
    process) and then fails before its turn starts: the read of the run's context meets
    the database gone, or the claim's COMMIT is in doubt and landed. Nothing ran the
    turn, and the run waited out its 15-minute lease (every retry of the key told it is
    in progress) to be closed as a live owner's stalled turn, the message never
    answered. It goes to recovery at once instead, which reruns it (the item to its
    lead), once."""
    _, _, trigger, item_id = await _a_keyed_turn_cut(stack, "work on it #complete")
    # (Its own patch, undone alone: the fixtures' patches stay.)
    with pytest.MonkeyPatch.context() as patch:
        if cut == "its read fails":
            patch.setattr(stack.db, "read", DownFor(stack.db.read, 1, after_commit=False))
        else:
            # The intake's transaction (a duplicate) goes through; the claim's is lost.
            real_tx = stack.db.tx
            calls: Iterator[Callable[[], Any]] = iter(
                [real_tx, DownFor(real_tx, 1, after_commit=True)]
            )
            patch.setattr(stack.db, "tx", lambda: next(calls, real_tx)())
        with pytest.raises(Unavailable):
            await stack.turns.run(trigger, retake=True)
    async with stack.db.read() as conn:
        run = (await conn.execute(sa.select(t.turn_runs))).one()
    assert run.lease_owner is not None  # claimed by the retry, alive
    assert await drain(TurnRecovery(stack.turns)) == 1
    assert await count(stack, t.turn_runs) == 0
    assert (await item_row(stack, item_id))["status"] == "reviewQueued"
    said = [r for r, _ in await item_messages(stack, item_id)]
    assert said.count("user") == 1 and said.count("assistant") == 1


@pytest.mark.parametrize("waiting", [False, True], ids=["not-found-yet", "waiting"])
async def test_a_keyed_retry_after_a_later_message_of_its_session_runs_nothing(
    stack: Stack, waiting: bool
) -> None:
    """A keyed REST message's process died mid-turn; its client then sent a follow-up in
    the session (another request), whose turn answered with the first message in its
    history, and then retried the first request with its key. Recovery closes such a
    run (the retry is told its answer was lost); the retry took it first and ran the
    turn again, the message answered a second time after the follow-up. It runs nothing
    now (recovery's to close), whether recovery had left the run waiting or not
    found it yet."""
    org, worker, trigger, item_id = await _a_keyed_turn_cut(stack, "draft it")
    recovery = TurnRecovery(stack.turns)
    if waiting:
        assert await drain(recovery) == 1  # left to wait for a resend
    stack.clock.advance(1_000)
    assert type(await stack.turns.run(api_trigger(org, worker, "and a title"))).__name__ == (
        "Reply"
    )
    retried = await stack.turns.run(trigger, retake=True)
    assert type(retried).__name__ == "Duplicate"
    said = [r for r, _ in await item_messages(stack, item_id)]
    assert said == ["user", "user", "assistant"]  # the follow-up's answer alone
    stack.clock.advance(runs.RESEND_GRACE_MS)
    assert await drain(recovery) == 1
    assert await count(stack, t.turn_runs) == 0  # closed, not rerun
    said = [r for r, _ in await item_messages(stack, item_id)]
    assert said == ["user", "user", "assistant"]


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_resend_whose_intake_is_uncommitted_when_recovery_claims_is_answered_once(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead process's REST run waited out its resend grace; its client's resend is
    being taken in on another connection (message and run stored, COMMIT not yet
    landed) when recovery claims the run. The claim's check for a later message of the
    session read before that commit, found none and reran the run, and the resend's
    turn ran too: the message answered twice. The claim now waits for the item's row
    lock, which the intake takes before it stores the message, and sees the resend:
    the run is closed, the resend's turn answers. (PostgreSQL: SQLite's one writer
    serializes the two transactions.)"""
    org, worker, _, item_id = await _a_turn_cut(stack, "work on it")
    recovery = TurnRecovery(stack.turns)
    assert await drain(recovery) == 1  # left to wait for a resend
    stack.turns.intake.owner = lambda: None
    stack.clock.advance(runs.RESEND_GRACE_MS + 1)  # the wait is over: rerun if no resend
    held = HeldCommits(stack.db)
    monkeypatch.setattr(stack.turns.intake, "db", held.database)
    resend = asyncio.create_task(stack.turns.run(api_trigger(org, worker, "work on it #complete")))
    await asyncio.wait_for(held.reached.wait(), 10)
    recovering = asyncio.create_task(drain(recovery))
    await blocked_on_a_lock(stack.db, recovering)
    held.release.set()
    assert isinstance(await resend, Gated)
    assert await recovering == 1
    assert await count(stack, t.turn_runs) == 0
    said = [r for r, _ in await item_messages(stack, item_id)]
    assert said.count("user") == 2 and said.count("assistant") == 1  # answered once


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_keyed_retry_while_a_follow_up_is_taken_in_runs_nothing(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keyed REST message's process died mid-turn; its client sent a follow-up in the
    session, and retried the first request with its key while the follow-up's intake
    was still open on another connection (its message stored, not committed). The
    retry's claim looked for a later message before that commit, found none, took the
    run and answered it, and the follow-up's turn answered it again. The claim now waits
    for the item's row lock, which that intake holds, sees the follow-up and runs
    nothing (recovery's to close). (PostgreSQL: SQLite's one writer serializes them.)"""
    org, worker, trigger, item_id = await _a_keyed_turn_cut(stack, "draft it")
    stack.clock.advance(1_000)
    held = HeldCommits(stack.db)
    monkeypatch.setattr(stack.turns.intake, "db", held.database)
    follow_up = asyncio.create_task(stack.turns.run(api_trigger(org, worker, "and a title")))
    await asyncio.wait_for(held.reached.wait(), 10)
    monkeypatch.setattr(stack.turns.intake, "db", stack.db)  # (the retry's own intake)
    retry = asyncio.create_task(stack.turns.run(trigger, retake=True))
    await blocked_on_a_lock(stack.db, retry)
    held.release.set()
    assert type(await follow_up).__name__ == "Reply"
    assert type(await retry).__name__ == "Duplicate"
    said = [r for r, _ in await item_messages(stack, item_id)]
    assert said == ["user", "user", "assistant"]  # the follow-up's answer alone


async def _lead_removed(stack: Stack, org: Org, worker: dict[str, Any]) -> None:
    """The worker's lead is cleared (``PATCH leadAgentId: null``): its next messages are
    plain turns, its session's ``inProgress`` item and run left as they were."""
    async with stack.db.tx() as conn:
        await agents_mod.save_agent(
            conn, stack.clock, stack.ids, org.id, agent_ref=worker["id"], lead=None
        )


async def session_roles(stack: Stack) -> list[str]:
    """The roles of every stored message (the test's one session), oldest first."""
    m = t.messages.c
    async with stack.db.read() as conn:
        rows = await conn.execute(sa.select(m.role).order_by(m.created_at, m.id))
    return list(rows.scalars().all())


@pytest.mark.parametrize("claimer", ["recovery", "keyed retry"])
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_follow_up_to_a_worker_whose_lead_was_removed_is_seen_by_a_claim(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, claimer: str
) -> None:
    """A REST message to a worker with a lead was cut (its process died; its run left
    to recovery, or to its keyed retry); then the worker's lead was removed, and its
    client sent a follow-up (under a key of its own), a plain turn now. Recovery's claim
    (or the first request's keyed retry) ran while that follow-up's intake was open on
    another connection, its message stored and not committed. A plain intake took no
    lock of the session's work item, so the claim's lock of it did not wait for that
    commit: the check for a later message found none, the old run was answered, and the
    follow-up's turn answered again. The intake of a REST/MCP/Studio message to a
    worker without a lead now locks the session's active item as a gated one does: the
    claim waits, sees the follow-up and runs nothing; its turn alone answers.
    (PostgreSQL: SQLite's one writer serializes them.)"""
    keyed = claimer == "keyed retry"
    org, worker, trigger, _ = await _a_turn_cut(stack, "work on it", "idem:k" if keyed else None)
    recovery = TurnRecovery(stack.turns)
    if keyed:
        await alive_here(stack, turns_too=True)
        stack.clock.advance(1_000)
    else:
        assert await drain(recovery) == 1  # left to wait for a resend
        stack.turns.intake.owner = lambda: None
        stack.clock.advance(runs.RESEND_GRACE_MS + 1)  # the wait is over: rerun if none
    await _lead_removed(stack, org, worker)
    held = HeldCommits(stack.db)
    monkeypatch.setattr(stack.turns.intake, "db", held.database)
    follow = dataclasses.replace(api_trigger(org, worker, "and a title"), external_event_id="f")
    follow_up = asyncio.create_task(stack.turns.run(follow))
    await asyncio.wait_for(held.reached.wait(), 10)
    monkeypatch.setattr(stack.turns.intake, "db", stack.db)  # (the retry's own intake)
    claiming = asyncio.create_task(
        stack.turns.run(trigger, retake=True) if keyed else drain(recovery)
    )
    await blocked_on_a_lock(stack.db, claiming)
    held.release.set()
    assert type(await follow_up).__name__ == "Reply"
    claimed = await claiming
    if keyed:
        assert type(claimed).__name__ == "Duplicate"  # (recovery's to close)
    else:
        assert claimed == 1  # claimed, and closed
    assert await session_roles(stack) == ["user", "user", "assistant"]  # answered once


class _HeldScript:
    """The script model's answers, with a rerun's call held or failed on demand: a
    :class:`RecordingProvider` handler whose next call waits for ``release`` while
    ``hold`` is set, or raises a model error while ``fail`` is set (each once);
    ``calls`` counts them."""

    def __init__(self) -> None:
        self.calls = 0
        self.hold = False
        self.fail = False
        self.held = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, request: ModelRequest) -> list[ModelEvent]:
        self.calls += 1
        if self.hold:
            self.hold = False
            self.held.set()
            await self.release.wait()
        if self.fail:
            self.fail = False
            raise ModelError("the model failed in the rerun")
        return await _scripted(request)


async def _a_gated_turn_cut_then_followed(
    make_stack: Callable[..., Stack], follow_up: str
) -> tuple[Stack, _HeldScript, Accepted, str]:
    """A gated REST turn ("work on it") stopped by a database fault in its live process
    (503 ``turn.interrupted``: an orphan, rerun by recovery), then its client's next
    message ``follow_up``, added to the same item and answered by its own turn before
    recovery claims the run: the stack, its model's script, the cut turn and its item."""
    model = RecordingProvider()
    script = model.handler = _HeldScript()
    stack = make_stack(providers={"script": model})
    taken = await _a_gated_api_turn_taken_in(stack, "work on it")
    item_id = taken.ctx.work_item_id
    assert taken.ctx.run_token and item_id
    await stopped_by_a_fault(stack.db, stack.turns, taken)
    assert stack.turns.orphans == {taken.ctx.run_token}
    stack.clock.advance(1_000)
    if follow_up:
        await stack.turns.run(_sent_again(taken, follow_up))
        stack.clock.advance(1_000)
    return stack, script, taken, item_id


@pytest.mark.parametrize("end", ["answers", "model fails", "gives up"])
async def test_a_gated_rerun_after_a_follow_up_answered_it_ends_unanswered(
    make_stack: Callable[..., Stack], end: str
) -> None:
    """A gated REST turn cut by a database fault (its client told not to send it
    again: recovery reruns it), and its client's follow-up, added to the same
    ``inProgress`` item, answered by its own turn with the cut message in its history.
    The rerun, shown the whole session, answered it a second time; its model failing
    (or its runs given up) stored the failure notice after that answer and abandoned
    the item the follow-up's turn works in. As a plain worker's rerun does, it now ends
    without an answer, its run closed, its model not called (the look comes before the
    call): the item stays ``inProgress``, answered once."""
    stack, script, _, item_id = await _a_gated_turn_cut_then_followed(make_stack, "and a title")
    said = [("user", "work on it"), ("user", "and a title"), ("assistant", "Echo: and a title")]
    assert await item_messages(stack, item_id) == said
    script.fail = end == "model fails"
    if end == "gives up":
        async with stack.db.tx() as conn:
            await conn.execute(t.turn_runs.update().values(attempts=runs.MAX_ATTEMPTS))
    calls = script.calls
    assert await drain(TurnRecovery(stack.turns)) == 1
    assert script.calls == calls
    assert await count(stack, t.turn_runs) == 0
    assert not stack.turns.orphans
    assert await item_messages(stack, item_id) == said
    assert (await item_row(stack, item_id))["status"] == "inProgress"
    assert [a["action"] for a in await item_audit(stack, item_id)] == ["create"]


async def test_a_gated_rerun_after_a_follow_up_handed_the_item_off_runs_nothing(
    make_stack: Callable[..., Stack],
) -> None:
    """Not a bug, pinned: the cut gated turn's follow-up called ``complete_task`` (the
    item went to review, its text withheld for the lead) before recovery claimed the
    cut run. The claim finds the item out of ``inProgress`` and closes the run: no
    second handoff, no answer beside the withheld one, the model not called again."""
    stack, _, _, item_id = await _a_gated_turn_cut_then_followed(
        make_stack, "and a title #complete"
    )
    assert (await item_row(stack, item_id))["status"] == "reviewQueued"
    said = await item_messages(stack, item_id)
    audit = await item_audit(stack, item_id)
    assert await drain(TurnRecovery(stack.turns)) == 1
    assert await count(stack, t.turn_runs) == 0
    assert await item_messages(stack, item_id) == said
    assert await item_audit(stack, item_id) == audit
    assert [a["action"] for a in audit].count("completeTask") == 1


@pytest.mark.parametrize(
    ("follow_up", "rerun_fails"),
    [("and a title", False), ("and a title #complete", False), ("and a title", True)],
    ids=["follow-up answers", "follow-up hands off", "rerun's model fails"],
)
async def test_a_follow_up_while_a_gated_rerun_waits_for_its_model_is_answered_once(
    make_stack: Callable[..., Stack], follow_up: str, rerun_fails: bool
) -> None:
    """The cut gated turn's client sends its next message while recovery's rerun waits
    for its model: the follow-up's turn, shown the cut message unanswered, answers the
    session (or hands the item to review). The rerun's plain answer was stored after it
    all the same (two answers; beside a handoff, shown unreviewed while the item waits
    for its lead), and its model failing stored the failure notice after it and
    abandoned the item. It now ends without either, its run closed. One handoff at
    most."""
    stack, script, taken, item_id = await _a_gated_turn_cut_then_followed(make_stack, "")
    script.hold = True
    rerun = asyncio.create_task(drain(TurnRecovery(stack.turns)))
    await asyncio.wait_for(script.held.wait(), 10)
    handed_off = "#complete" in follow_up
    outcome = await stack.turns.run(_sent_again(taken, follow_up))
    assert isinstance(outcome, Gated if handed_off else Reply)
    script.fail = rerun_fails
    script.release.set()
    assert await rerun == 1
    assert await count(stack, t.turn_runs) == 0
    roles = [role for role, _ in await item_messages(stack, item_id)]
    # (the follow-up's complete_task leaves its summary as a tool message)
    assert roles == ["user", "user", *(["tool"] if handed_off else []), "assistant"]
    item = await item_row(stack, item_id)
    assert item["status"] == ("reviewQueued" if handed_off else "inProgress")
    handoffs = [a["action"] for a in await item_audit(stack, item_id)].count("completeTask")
    assert handoffs == (1 if handed_off else 0)
    assert not script.fail  # (the rerun's model was called: the follow-up came during it)


async def test_a_gone_process_whose_runs_cannot_be_recorded_is_given_up_and_the_pass_goes_on(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The record of a gone process's plain turns fails for another reason than a
    database fault (a bug, a row the database refuses): one ERROR names the process, its
    note is dropped, and the next gone process is searched. Before, the error rose out of
    every turn recovery pass, its note kept, and the pass's claims never ran."""
    async with stack.db.tx() as conn:
        await conn.execute(
            t.gone_processes.insert(),
            [{"id": "prc_a", "heartbeat_at": 1}, {"id": "prc_b", "heartbeat_at": 1}],
        )
    real = runs._record_taken_of
    searched: list[str] = []

    async def refused(db: Database, ids: Any, process_id: str, heartbeat_at: int, now: int) -> int:
        searched.append(process_id)
        if process_id == "prc_a":
            raise ValueError("a row the database refuses")
        return await real(db, ids, process_id, heartbeat_at, now)

    monkeypatch.setattr(runs, "_record_taken_of", refused)
    caplog.set_level(logging.ERROR, logger="leadgate.turns")
    assert await runs.record_taken(stack.db, stack.ids, stack.clock.now_ms()) == 0
    assert sorted(searched) == ["prc_a", "prc_b"]
    assert await count(stack, t.gone_processes) == 0
    [error] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "prc_a" in error.getMessage() and error.exc_info is not None


def test_the_search_reads_a_keyed_messages_event_by_its_primary_key() -> None:
    """Turn recovery's search of a gone process's plain messages reads the external
    event id of a keyed one by the primary key of ``inbound_events`` (never pruned: its
    event's id is derived from the message's, ``runs.event_id_of``), no table scanned."""
    engine = sa.create_engine("sqlite://")
    metadata.create_all(engine)
    with engine.connect() as raw:
        plan = sqlite_plan(raw, runs._TAKEN.params(p_process="prc_1", p_since=0))
    assert any(
        step.startswith("SEARCH inbound_events USING INDEX sqlite_autoindex_inbound_events_1")
        for step in plan
    ), plan
    assert not any(step.startswith("SCAN inbound_events") for step in plan), plan


async def _plain_session(stack: Stack) -> tuple[Org, str]:
    """A plain worker's REST session after one exchange: its org and session id."""
    org = await make_org(stack)
    worker = await make_agent(stack, org, "plain")
    await stack.turns.run(api_trigger(org, worker, "first"))
    async with stack.db.read() as conn:
        session_id = await conn.scalar(sa.select(t.sessions.c.id))
    return org, str(session_id)


async def _taken_in(
    stack: Stack, org: Org, session_id: str, *messages: tuple[int, str | None, str]
) -> None:
    """Store messages (stamp, ``taken_by``, role) in ``session_id``, the session's event
    log numbering them in the order given, each stamped as given (its process's clock).
    SQLite stores a stamp as it is (writers one at a time): stored one after the other.
    PostgreSQL stamps a message after the session's newest committed one, so stamps go
    against the order only for messages taken in at once, neither seeing the other: the
    last is stored first, and each one before it commits before it."""

    async def store(conn: Conn, at: int, taken_by: str | None, role: str) -> None:
        await store_message(
            conn,
            stack.clock,
            stack.ids,
            org_id=org.id,
            session_id=session_id,
            work_item_id=None,
            role=role,
            content="again",
            created_at=at,
            taken_by=taken_by,
        )

    if not stack.db.is_postgres:
        for message in messages:
            async with stack.db.tx() as conn:
                await store(conn, *message)
        return
    async with contextlib.AsyncExitStack() as held:
        for message in reversed(messages):
            await store(await held.enter_async_context(stack.db.tx()), *message)


async def _gone(stack: Stack) -> None:
    """Process ``DEAD`` is known gone (as a reap notes it), its heartbeat now."""
    async with stack.db.tx() as conn:
        await conn.execute(
            t.gone_processes.insert(), {"id": DEAD, "heartbeat_at": stack.clock.now_ms()}
        )


async def test_a_gone_processs_message_followed_up_on_a_replica_behind_is_not_rerun(
    stack: Stack,
) -> None:
    """A gone process's plain message, then a follow-up taken in by a replica whose
    clock is 2 s behind (stamped before it): the follow-up's turn answers it, so no run
    is recorded. Told by the stamps, the follow-up looked older: the message was rerun
    beside the follow-up's turn, answered twice."""
    org, session_id = await _plain_session(stack)
    now = stack.clock.now_ms()
    await _taken_in(stack, org, session_id, (now + 2_000, DEAD, "user"), (now + 1, None, "user"))
    await _gone(stack)
    assert await runs.record_taken(stack.db, stack.ids, stack.clock.now_ms()) == 0
    assert await count(stack, t.turn_runs) == 0


async def test_a_gone_processs_message_after_one_stamped_by_a_replica_ahead_is_rerun(
    stack: Stack,
) -> None:
    """A message taken in by a replica whose clock is 2 s ahead, then a gone process's
    plain message (stamped before it): nothing came after that message, so its run is
    recorded (and rerun). Told by the stamps, the earlier message looked later: the
    gone process's message was never answered."""
    org, session_id = await _plain_session(stack)
    now = stack.clock.now_ms()
    await _taken_in(stack, org, session_id, (now + 2_000, None, "user"), (now + 1, DEAD, "user"))
    await _gone(stack)
    assert await runs.record_taken(stack.db, stack.ids, stack.clock.now_ms()) == 1
    async with stack.db.read() as conn:
        run_message = await conn.scalar(sa.select(t.turn_runs.c.message_id))
        taken = await conn.scalar(sa.select(t.messages.c.id).where(t.messages.c.taken_by == DEAD))
    assert run_message == taken


async def test_a_gone_processs_message_with_its_answer_stored_is_not_rerun(stack: Stack) -> None:
    """Its process stored its answer (an assistant message, announced in the session's
    event log as a user message is) and died after: nothing to rerun."""
    org, session_id = await _plain_session(stack)
    now = stack.clock.now_ms()
    await _taken_in(stack, org, session_id, (now + 1, DEAD, "user"), (now + 2, None, "assistant"))
    await _gone(stack)
    assert await runs.record_taken(stack.db, stack.ids, stack.clock.now_ms()) == 0


async def test_a_run_lease_is_renewed_only_by_its_owner_under_its_token_before_it_lapses(
    stack: Stack,
) -> None:
    """:func:`runs.renew` (the heartbeat's renewal of the runs a live process's turns are
    running) is fenced: another owner, another token, or a lease already lapsed (turn
    recovery may be taking it) renews nothing; the run's own owner and token renew it
    for a lease from now, once less than half of it is left (each beat rewrote it)."""
    org = await make_org(stack)
    plain = await make_agent(stack, org, "plain")
    live = await alive_here(stack)
    taken = await stack.turns.take(slack_trigger(org, plain, "hi", "9.1"))
    assert isinstance(taken, Accepted) and taken.ctx.run_token and live.id
    token, now = taken.ctx.run_token, stack.clock.now_ms()
    async with stack.db.tx() as conn:
        assert await runs.renew(conn, "prc_other", [token], now) == 0
        assert await runs.renew(conn, live.id, ["lease_other"], now) == 0
        assert await runs.renew(conn, live.id, [], now) == 0
        assert await runs.renew(conn, live.id, [token], now + MINUTE_MS) == 0  # most left
        half = now + runs.RUN_LEASE_MS // 2
        assert await runs.renew(conn, live.id, [token], half - 1) == 0
        assert await runs.renew(conn, live.id, [token], half + 1) == 1
        assert await runs.renew(conn, live.id, [token], half + 2) == 0  # renewed just now
        lapsed = half + 1 + runs.RUN_LEASE_MS + 1
        assert await runs.renew(conn, live.id, [token], lapsed) == 0
    async with stack.db.read() as conn:
        expires = await conn.scalar(sa.select(t.turn_runs.c.lease_expires_at))
    assert expires == half + 1 + runs.RUN_LEASE_MS
