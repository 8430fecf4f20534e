"""Human decisions (SPEC 5) through review/decisions.py on the real Stack and database:
approve, reject, return, cancel, their text limits, their status rules and their audit."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from leadgate.core.clock import DAY_MS, FakeClock, RandomIds, iso
from leadgate.core.errors import TransitionError, ValidationError
from leadgate.core.runners import drain
from leadgate.core.types import Gated, Reply
from leadgate.database import schema as t
from leadgate.domain import workitems
from leadgate.domain.workitems import Sweeper
from leadgate.review import decisions
from leadgate.review.queue import detail
from leadgate.runners.revisions import RevisionRunner
from outbox.channel import Retry, Uncertain
from outbox.store import SEND_LEASE_MS, Outbox
from tests.helpers import (
    Org,
    api_trigger,
    deliveries_counted,
    eventually,
    make_agent,
    make_org,
    session_item,
    slack_trigger,
)
from tests.helpers import item_audit as audit_rows
from tests.helpers import item_deliveries as deliveries
from tests.helpers import item_row as row
from tests.review_support import ReviewEnv, review_env
from tests.review_support import slack_trigger as review_slack_trigger
from tests.stack import Stack

SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
NON_TERMINAL = ["inProgress", "reviewQueued", "reviewing", "awaitingHuman", "approved"]
TERMINAL = ["completed", "rejected", "failed", "cancelled", "abandoned"]


# --------------------------------------------------------------------------- helpers


async def setup(stack: Stack) -> tuple[Org, dict[str, Any]]:
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    return org, await make_agent(stack, org, "worker", lead="lead")


async def run(stack: Stack, org: Org, worker: dict[str, Any], text: str, session: str) -> str:
    out = await stack.turns.run(api_trigger(org, worker, text, session))
    assert isinstance(out, Gated | Reply)
    return await session_item(stack, session)


async def slack_run(stack: Stack, org: Org, worker: dict[str, Any], text: str, session: str) -> str:
    """A gated turn from a Slack thread (no Slack channel is configured in the stack)."""
    out = await stack.turns.run(slack_trigger(org, worker, text, session))
    assert isinstance(out, Gated) and out.work_item_id
    return out.work_item_id


async def escalated(stack: Stack, org: Org, worker: dict[str, Any], session: str) -> str:
    item_id = await run(stack, org, worker, "hard #escalate #complete", session)
    await drain(stack.lead_runner)
    assert (await row(stack, item_id))["status"] == "awaitingHuman"
    return item_id


async def items_in_every_status(stack: Stack, org: Org, worker: dict[str, Any]) -> dict[str, str]:
    """One work item per status, each in its own session, made by the real code paths."""
    ids: dict[str, str] = {}
    ids["abandoned"] = await run(stack, org, worker, "idle", "abandoned")
    assert isinstance(stack.clock, FakeClock)
    stack.clock.advance(7 * DAY_MS + 1)
    assert await drain(Sweeper(stack.db, stack.clock, stack.ids)) == 1

    ids["awaitingHuman"] = await escalated(stack, org, worker, "awaitingHuman")
    ids["rejected"] = await escalated(stack, org, worker, "rejected")
    async with stack.db.tx() as conn:
        item = await workitems.get(conn, ids["rejected"])
        await decisions.human_reject(conn, stack.clock, stack.ids, item, "user:x", "no")

    # An api item completes in its approval's transaction (the reveal sends nothing).
    ids["completed"] = await run(stack, org, worker, "done #complete", "completed")
    await drain(stack.lead_runner)
    # A Slack binding with no Slack channel configured: the delivery fails permanently.
    ids["failed"] = await slack_run(stack, org, worker, "post it #complete", "failed")
    await drain(stack.lead_runner)
    await drain(stack.relay)

    # Approved on a channel binding: its post waits for the relay (not drained here).
    ids["approved"] = await slack_run(stack, org, worker, "ok #complete", "approved")
    await drain(stack.lead_runner)

    ids["cancelled"] = await run(stack, org, worker, "never mind", "cancelled")
    async with stack.db.tx() as conn:
        item = await workitems.get(conn, ids["cancelled"])
        await decisions.cancel(conn, stack.clock, stack.ids, item, "user:x")

    ids["reviewing"] = await run(stack, org, worker, "check #complete", "reviewing")
    claimed = await stack.lead_runner.claim()
    assert claimed is not None and claimed.id == ids["reviewing"]
    ids["reviewQueued"] = await run(stack, org, worker, "queued #complete", "reviewQueued")
    ids["inProgress"] = await run(stack, org, worker, "working on it", "inProgress")
    for status, item_id in ids.items():
        assert (await row(stack, item_id))["status"] == status, status
    return ids


async def state(stack: Stack, item_id: str) -> tuple[Any, ...]:
    """Everything a decision could change."""
    return (
        await row(stack, item_id),
        await deliveries(stack, item_id),
        await audit_rows(stack, item_id),
    )


async def decide(stack: Stack, item_id: str, action: str, text: Any = None) -> dict[str, Any]:
    async with stack.db.tx() as conn:
        item = await workitems.get(conn, item_id)
        c, i = stack.clock, stack.ids
        if action == "approve":
            return (await decisions.human_approve(conn, stack.outbox, item, "user:alice"))._asdict()
        if action == "reject":
            return (await decisions.human_reject(conn, c, i, item, "user:alice", text))._asdict()
        if action == "return":
            return (await decisions.human_return(conn, c, i, item, "user:alice", text))._asdict()
        return (await decisions.cancel(conn, c, i, item, "user:alice"))._asdict()


# --------------------------------------------------------------------------- approve


async def test_human_approve_writes_the_gating_delivery_in_the_same_transaction(
    stack: Stack,
) -> None:
    org, worker = await setup(stack)
    item_id = await escalated(stack, org, worker, "a")
    updated = await decide(stack, item_id, "approve")
    # The api binding's reveal sends nothing: the approval's transaction completes it.
    assert updated["status"] == "completed"
    assert (await row(stack, item_id))["status"] == "completed"
    [dlv] = await deliveries(stack, item_id)
    assert (dlv["kind"], dlv["action"], dlv["status"]) == ("gating", "reveal", "sent")
    assert dlv["text"] == "Echo: hard #escalate #complete"
    approve, delivered = (await audit_rows(stack, item_id))[-2:]
    assert (approve["actor"], approve["action"], approve["from_status"]) == (
        "user:alice",
        "approve",
        "awaitingHuman",
    )
    assert approve["to_status"] == "approved"
    assert (delivered["actor"], delivered["action"], delivered["to_status"]) == (
        "system:outbox",
        "delivered",
        "completed",
    )
    assert await drain(stack.relay) == 0

    # Atomicity: a delivery insert that fails rolls the approval back.
    other = await escalated(stack, org, worker, "b")
    before = await state(stack, other)

    class TakenIds:
        def __init__(self) -> None:
            self.ids = RandomIds()

        def new(self, prefix: str) -> str:
            return dlv["id"] if prefix == "dlv" else self.ids.new(prefix)

    with pytest.raises(IntegrityError):
        async with stack.db.tx() as conn:
            item = await workitems.get(conn, other)
            await decisions.human_approve(conn, Outbox(stack.clock, TakenIds()), item, "user:alice")
    assert await state(stack, other) == before


# ---------------------------------------------------------------------- text limits


@SQLITE_ONLY
async def test_reject_reason_must_be_1_to_2000_characters(stack: Stack) -> None:
    org, worker = await setup(stack)
    item_id = await escalated(stack, org, worker, "a")
    before = await state(stack, item_id)
    # (a NUL or a lone surrogate: the CLI reads a reason from standard input unchecked)
    for bad in (None, "", "   \n", 5, "x" * 2_001, "no\x00pe", "lone \ud800"):
        with pytest.raises(ValidationError) as err:
            await decide(stack, item_id, "reject", bad)
        assert err.value.status == 400
        assert err.value.rule == "decision.reason"
        if bad == 5:
            assert err.value.message == "reason must be text"
    assert await state(stack, item_id) == before
    assert (await decide(stack, item_id, "reject", "x" * 2_000))["status"] == "rejected"
    last = (await audit_rows(stack, item_id))[-1]
    assert (last["action"], last["text"]) == ("reject", "x" * 2_000)
    other = await escalated(stack, org, worker, "b")
    assert (await decide(stack, other, "reject", "n"))["status"] == "rejected"
    assert await deliveries(stack, other) == []


@SQLITE_ONLY
async def test_return_feedback_must_be_1_to_10000_characters(stack: Stack) -> None:
    org, worker = await setup(stack)
    item_id = await escalated(stack, org, worker, "a")
    before = await state(stack, item_id)
    for bad in (None, "", " ", ["x"], "y" * 10_001):
        with pytest.raises(ValidationError) as err:
            await decide(stack, item_id, "return", bad)
        assert err.value.rule == "decision.feedback"
    assert await state(stack, item_id) == before

    feedback = "y" * 10_000
    updated = await decide(stack, item_id, "return", feedback)
    assert (updated["status"], updated["revision"], updated["extra_allowance"]) == (
        "inProgress",
        1,
        1,
    )
    assert updated["pending_feedback"] == feedback
    last = (await audit_rows(stack, item_id))[-1]
    assert (last["actor"], last["action"], last["text"]) == ("user:alice", "return", feedback)
    # Dispatched to the worker as an internal turn (exactly once).
    assert await drain(RevisionRunner(stack.turns)) == 1
    item = await row(stack, item_id)
    assert item["pending_feedback"] is None
    m = t.messages.c
    async with stack.db.read() as conn:
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

    other = await escalated(stack, org, worker, "b")
    assert (await decide(stack, other, "return", "z"))["pending_feedback"] == "z"
    assert await drain(RevisionRunner(stack.turns)) == 1
    item = await row(stack, other)
    assert (item["status"], item["snapshot"]) == ("reviewQueued", "Revised: z")


# ------------------------------------------------------------------- status rules


async def test_decisions_need_awaiting_human_and_cancel_needs_a_live_item(
    stack: Stack,
) -> None:
    org, worker = await setup(stack)
    ids = await items_in_every_status(stack, org, worker)
    for status, item_id in ids.items():
        before = await state(stack, item_id)
        for action, text in (("approve", None), ("reject", "no"), ("return", "again")):
            if status == "awaitingHuman":
                continue
            with pytest.raises(TransitionError) as err:
                await decide(stack, item_id, action, text)
            assert err.value.status == 409, (status, action)
            assert await state(stack, item_id) == before, (status, action)
            assert err.value.rule == "workItem.status", (status, action)
        if status in TERMINAL:
            # Refused as approving is: workItem.status, naming who ended it (it was
            # workItem.transition "cannot go from rejected to cancelled").
            with pytest.raises(TransitionError) as err:
                await decide(stack, item_id, "cancel")
            assert err.value.rule == "workItem.status", status
            assert f"work item {item_id} is {status} already" in err.value.message, status
            assert re.search(r": \S+ by \S+ at \d{4}-[^;]*; nothing changed$", err.value.message)
            assert await state(stack, item_id) == before, status

    # Cancel works from every non-terminal status and cancels unsent deliveries.
    assert (await deliveries(stack, ids["approved"]))[0]["status"] == "pending"
    for status in NON_TERMINAL:
        item_id = ids[status]
        updated = await decide(stack, item_id, "cancel")
        assert updated["status"] == "cancelled"
        assert updated["lease_token"] is None and updated["lease_expires_at"] is None
        last = (await audit_rows(stack, item_id))[-1]
        assert (last["actor"], last["action"], last["from_status"], last["to_status"]) == (
            "user:alice",
            "cancel",
            status,
            "cancelled",
        )
    assert [d["status"] for d in await deliveries(stack, ids["approved"])] == ["cancelled"]
    # Nothing is delivered or reviewed afterwards, and the sessions take new work.
    assert await drain(stack.relay) == 0
    assert await drain(stack.lead_runner) == 0
    assert (await row(stack, ids["approved"]))["status"] == "cancelled"
    out = await stack.turns.run(api_trigger(org, worker, "fresh start", "approved"))
    assert out == Reply("Echo: fresh start")


async def test_a_gating_post_ended_by_its_items_cancel_is_counted_cancelled(
    stack: Stack,
) -> None:
    """An approved item's post not sent yet (``pending``) ends ``cancelled`` with the
    item's cancel, and counts so in ``leadgate_deliveries_total``, once the cancel
    commits; it was counted nowhere (only review cards were)."""
    org, worker = await setup(stack)
    item_id = await slack_run(stack, org, worker, "ok #complete", "approved")
    await drain(stack.lead_runner)
    [gating] = await deliveries(stack, item_id)
    assert (gating["kind"], gating["status"]) == ("gating", "pending")
    cancelled = deliveries_counted("slack", "cancelled")
    await decide(stack, item_id, "cancel")
    assert [d["status"] for d in await deliveries(stack, item_id)] == ["cancelled"]
    assert deliveries_counted("slack", "cancelled") - cancelled == 1


async def _approved_slack_item(env: ReviewEnv) -> str:
    """A Slack thread's item its lead approved: its post (the gating delivery) pending."""
    stack = env.stack
    out = await stack.turns.run(review_slack_trigger(env, "ok #complete", "9.9"))
    assert isinstance(out, Gated) and out.work_item_id
    await drain(stack.lead_runner)
    [gating] = await deliveries(stack, out.work_item_id)
    assert (gating["kind"], gating["status"]) == ("gating", "pending")
    return out.work_item_id


@pytest.mark.parametrize(
    "outcome",
    [Retry("503 before the request was written"), Uncertain("read timeout")],
    ids=["not-posted", "maybe-posted"],
)
async def test_a_post_in_flight_when_its_item_is_cancelled_is_never_posted_again(
    make_stack: Callable[..., Stack], outcome: Retry | Uncertain
) -> None:
    """An approved item cancelled while its post is being sent: the cancel ends the
    unsent deliveries, and the one in flight ends ``cancelled`` with its send. Not posted
    for sure, it went back to ``pending`` and was posted after the cancel all the same;
    maybe posted, it opened a "confirm or retry" wait for the cancelled item (a Review
    card, reminders), whose Retry would post it a second time."""
    env = await review_env(make_stack)
    stack = env.stack
    item_id = await _approved_slack_item(env)
    env.slack.gate = asyncio.Event()
    env.slack.script = [outcome]
    sending = asyncio.create_task(stack.relay.run_once())
    await eventually(lambda: len(env.slack.calls) == 1)
    await decide(stack, item_id, "cancel")
    env.slack.gate.set()
    await sending

    [gating] = await deliveries(stack, item_id)
    assert gating["status"] == "cancelled"
    assert "its work item was cancelled meanwhile" in gating["error"]
    assert (await row(stack, item_id))["status"] == "cancelled"
    assert await env.episodes(item_id) == []  # no wait for an operator, no card
    assert isinstance(stack.clock, FakeClock)
    stack.clock.advance(DAY_MS)
    await drain(stack.relay)
    await drain(env.sla)
    assert [m.text for m in env.slack.calls] == ["Echo: ok #complete"]  # once, never again


async def test_a_post_whose_relay_died_after_its_item_was_cancelled_ends_cancelled(
    make_stack: Callable[..., Stack],
) -> None:
    """The same when the relay sending it died: its lapsed send lease ends the post of a
    cancelled item ``cancelled``, not ``deliveryUnknown`` with a "confirm or retry" wait
    (a Review card, reminders) for an item nobody can confirm any more."""
    env = await review_env(make_stack)
    stack = env.stack
    item_id = await _approved_slack_item(env)
    [claimed] = await stack.relay.claim()  # and then the process dies mid-send
    assert claimed.work_item_id == item_id
    await decide(stack, item_id, "cancel")
    assert isinstance(stack.clock, FakeClock)
    stack.clock.advance(SEND_LEASE_MS + 1)
    assert await stack.relay.expire_send_leases() == 1

    [gating] = await deliveries(stack, item_id)
    assert gating["status"] == "cancelled"
    assert await env.episodes(item_id) == []
    stack.clock.advance(DAY_MS)
    await drain(stack.relay)
    assert env.slack.calls == []


@SQLITE_ONLY
async def test_cancel_while_reviewing_drops_the_lead_verdict(stack: Stack) -> None:
    org, worker = await setup(stack)
    item_id = await run(stack, org, worker, "job #complete", "a")
    claimed = await stack.lead_runner.claim()
    assert claimed is not None
    await decide(stack, item_id, "cancel")
    await stack.lead_runner.review(claimed)
    assert (await row(stack, item_id))["status"] == "cancelled"
    assert await deliveries(stack, item_id) == []


@SQLITE_ONLY
async def test_every_decision_is_audited_and_shown_in_the_detail(stack: Stack) -> None:
    org, worker = await setup(stack)
    assert isinstance(stack.clock, FakeClock)
    item_id = await escalated(stack, org, worker, "a")
    stack.clock.advance(1_000)
    await decide(stack, item_id, "return", "Shorter, please.")
    await drain(RevisionRunner(stack.turns))
    await drain(stack.lead_runner)  # the task context still says #escalate
    assert (await row(stack, item_id))["status"] == "awaitingHuman"
    stack.clock.advance(1_000)
    await decide(stack, item_id, "reject", "Out of scope.")
    async with stack.db.read() as conn:
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
