"""The lead review runner (SPEC 4) through the real LeadRunner, Stack and database.

Verdict paths, revision accounting, the review lease, the lead's tools and its
execution budget. The worker is always the built-in ``script`` model; the lead is either
``script`` or :class:`FakeLead`, a provider programmed per test.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import asyncpg
import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from binding.bindings import active_binding, deactivate_session
from leadgate.core.clock import MINUTE_MS, FakeClock, RandomIds
from leadgate.core.errors import ModelError, Unavailable
from leadgate.core.runners import LOCKED_RECHECK_MS, drain
from leadgate.core.types import Gated
from leadgate.database import schema as t
from leadgate.database.db import Database
from leadgate.database.pg import asyncpg_dsn
from leadgate.domain import agents as agents_mod
from leadgate.domain import workitems
from leadgate.domain.rows import WorkItem
from leadgate.review import decisions
from leadgate.review import runner as runner_module
from leadgate.review.queue import detail
from leadgate.review.runner import LEAD_TOOLS, LeadRunner
from leadgate.runners.revisions import RevisionRunner
from leadgate.turns.messages import visible_transcript
from leadgate.turns.path import REVISION_LEASE_MS
from leadgate.turns.providers.base import ModelEvent, ModelRequest, TextDelta, ToolCall
from leadgate.turns.providers.script import ScriptProvider
from outbox.relay import Relay
from outbox.store import HANDOFF_TOPIC, NOTIFY_CHANNEL, Outbox
from tests.fakes import ClaimInDoubt, DownFor, LandsLater, lose_the_next_commit
from tests.helpers import (
    Anonymizer,
    Org,
    api_trigger,
    blocked_on_a_lock,
    counted,
    deliveries_counted,
    eventually,
    held_open,
    item_locked,
    make_agent,
    make_org,
    slack_trigger,
    transitions_counted,
)
from tests.helpers import item_audit as audit
from tests.helpers import item_deliveries as deliveries
from tests.helpers import item_row as row
from tests.outbox_support import ScriptedChannel
from tests.stack import Stack, build_stack

SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
LEAD_TOOL_NAMES = ["submit_lead_review", "inspect_lead_messages", "inspect_lead_artifacts"]

Behaviour = Callable[[ModelRequest, int], Iterable[ModelEvent] | BaseException]


# --------------------------------------------------------------------------- fixtures


class FakeLead:
    """A lead model: delegates to the ``script`` model unless ``behaviour`` is set.

    ``behaviour(request, n)`` (n = 1-based call number) returns the events of that call
    or an exception to raise. Every request is recorded.
    """

    def __init__(self) -> None:
        self.requests: list[ModelRequest] = []
        self.behaviour: Behaviour | None = None
        self._script = ScriptProvider()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        # The runner keeps appending to its message list: record a snapshot.
        request = dataclasses.replace(request, messages=list(request.messages))
        self.requests.append(request)
        if self.behaviour is None:
            async for event in self._script.stream(request):
                yield event
            return
        result = self.behaviour(request, len(self.requests))
        if isinstance(result, BaseException):
            raise result
        for event in result:
            yield event


def verdict(value: str, feedback: str | None = None, call_id: str = "v1") -> ToolCall:
    args: dict[str, Any] = {"verdict": value}
    if feedback is not None:
        args["feedback"] = feedback
    return ToolCall(call_id, "submit_lead_review", args)


@pytest.fixture
def fake_lead() -> FakeLead:
    return FakeLead()


@pytest.fixture
async def stack(migrated_url: str, fake_lead: FakeLead) -> AsyncIterator[Stack]:
    """conftest's ``stack`` plus the ``fake`` lead model."""
    stack = build_stack(migrated_url, providers={"script": ScriptProvider(), "fake": fake_lead})
    yield stack
    await stack.stop()


# --------------------------------------------------------------------------- helpers


async def setup(
    stack: Stack,
    *,
    lead_model: str = "script",
    config: dict[str, Any] | None = None,
    worker: str = "worker",
) -> tuple[Org, dict[str, Any], dict[str, Any]]:
    org = await make_org(stack)
    lead = await make_agent(stack, org, "lead", model=lead_model)
    kwargs: dict[str, Any] = {"lead": "lead"}
    if config is not None:
        kwargs["review_config"] = config
    agent = await make_agent(stack, org, worker, **kwargs)
    return org, lead, agent


async def submit(
    stack: Stack, org: Org, worker: dict[str, Any], text: str, session: str = "s1"
) -> str:
    out = await stack.turns.run(api_trigger(org, worker, f"{text} #complete", session))
    assert isinstance(out, Gated), out
    assert out.work_item_id
    return out.work_item_id


async def claimed_review(stack: Stack) -> tuple[str, WorkItem]:
    """A worker's submitted item (its id) and the lead runner's claim of its review."""
    org, _, worker = await setup(stack)
    item_id = await submit(stack, org, worker, "write the report")
    claimed = await stack.lead_runner.claim()
    assert claimed is not None
    return item_id, claimed


async def actions(stack: Stack, item_id: str) -> list[str]:
    return [a["action"] for a in await audit(stack, item_id)]


async def released(stack: Stack, item_id: str) -> list[str]:
    """The texts of the item's ``leaseReleased`` audit rows (why it went back)."""
    return [a["text"] for a in await audit(stack, item_id) if a["action"] == "leaseReleased"]


async def messages(stack: Stack, item_id: str) -> list[tuple[str, str, bool]]:
    m = t.messages.c
    async with stack.db.read() as conn:
        rows = (
            await conn.execute(
                sa.select(m.role, m.content, m.lead_gated)
                .where(m.work_item_id == item_id)
                .order_by(m.created_at, m.id)
            )
        ).all()
    return [(r.role, r.content, bool(r.lead_gated)) for r in rows]


def reviews_counted(outcome: str = "approved") -> float:
    """``leadgate_reviews_total{outcome}`` now."""
    return counted("leadgate_reviews_total", outcome=outcome)


def claims_counted() -> tuple[float, float]:
    """The moves a review claim and its give-back count: ``reviewQueued -> reviewing``,
    ``reviewing -> reviewQueued``."""
    return (
        transitions_counted("reviewQueued", "reviewing"),
        transitions_counted("reviewing", "reviewQueued"),
    )


def clock(stack: Stack) -> FakeClock:
    assert isinstance(stack.clock, FakeClock)
    return stack.clock


# --------------------------------------------------------------------------- verdicts


@SQLITE_ONLY
async def test_an_approval_completes_an_api_item_with_exactly_one_gating_delivery(
    stack: Stack,
) -> None:
    """On the api binding the approval's transaction reveals the withheld message and
    completes the item: the reveal has nothing to send, so the relay has nothing to do."""
    org, lead, worker = await setup(stack)
    item_id = await submit(stack, org, worker, "write the report")
    assert (await row(stack, item_id))["status"] == "reviewQueued"
    assert await drain(stack.lead_runner) == 1
    item = await row(stack, item_id)
    assert item["status"] == "completed"
    assert item["lease_token"] is None and item["lease_expires_at"] is None
    [dlv] = await deliveries(stack, item_id)
    assert (dlv["kind"], dlv["action"], dlv["channel"], dlv["status"], dlv["attempts"]) == (
        "gating",
        "reveal",
        "api",
        "sent",
        1,
    )
    assert dlv["text"] == "Echo: write the report #complete"
    approve, delivered = (await audit(stack, item_id))[-2:]
    assert (approve["actor"], approve["action"], approve["from_status"]) == (
        f"lead:{lead['id']}",
        "approve",
        "reviewing",
    )
    assert approve["to_status"] == "approved" and approve["created_at"] == delivered["created_at"]
    assert (delivered["actor"], delivered["action"], delivered["to_status"]) == (
        "system:outbox",
        "delivered",
        "completed",
    )
    assert await drain(stack.relay) == 0
    async with stack.db.read() as conn:
        shown = await visible_transcript(conn, org.id, item["session_id"])
    assert [m["content"] for m in shown][-1] == "Echo: write the report #complete"


class CollidingIds:
    """Random ids, except that every delivery id is ``dlv_taken``."""

    def __init__(self) -> None:
        self._ids = RandomIds()

    def new(self, prefix: str) -> str:
        return "dlv_taken" if prefix == "dlv" else self._ids.new(prefix)


async def test_approval_and_its_delivery_are_one_transaction(stack: Stack) -> None:
    """When writing the delivery fails, the approval (status and audit) rolls back too."""
    org, _, worker = await setup(stack)
    item_id = await submit(stack, org, worker, "task")
    now = stack.clock.now_ms()
    async with stack.db.tx() as conn:
        await conn.execute(
            t.deliveries.insert().values(
                id="dlv_taken",
                org_id=org.id,
                work_item_id=None,
                kind="reply",
                action="post",
                channel="slack",
                address={},
                text="occupies the id",
                status="sent",
                attempts=1,
                next_attempt_at=now,
                created_at=now,
                updated_at=now,
            )
        )
    colliding = CollidingIds()
    broken = LeadRunner(
        stack.db, stack.clock, colliding, stack.providers, Outbox(stack.clock, colliding)
    )
    claimed = await broken.claim()
    assert claimed is not None and claimed.id == item_id
    before = await audit(stack, item_id)
    with pytest.raises(IntegrityError):
        await broken.review(claimed)
    item = await row(stack, item_id)
    assert item["status"] == "reviewing"
    assert item["lease_token"] == claimed.lease_token
    assert await deliveries(stack, item_id) == []
    assert await audit(stack, item_id) == before
    # The same claim, committed with working ids, approves once.
    await stack.lead_runner.review(claimed)
    assert (await row(stack, item_id))["status"] == "completed"
    assert len(await deliveries(stack, item_id)) == 1


async def submit_slack(stack: Stack, org: Org, worker: dict[str, Any], ts: str) -> str:
    """A ``#complete`` turn in Slack thread ``ts``: the item's answer will be a post."""
    out = await stack.turns.run(slack_trigger(org, worker, f"task {ts} #complete", ts))
    assert isinstance(out, Gated) and out.work_item_id
    return out.work_item_id


@pytest.mark.parametrize("via", ["api", "slack"])
async def test_a_runner_that_lost_its_lease_commits_nothing(stack: Stack, via: str) -> None:
    """Whichever way the approval would be written (a transaction, or on PostgreSQL one
    statement: a reveal for the api binding, a post for Slack)."""
    org, _, worker = await setup(stack)
    if via == "api":
        item_id = await submit(stack, org, worker, "task")
    else:
        item_id = await submit_slack(stack, org, worker, "5.4")
    first = LeadRunner(stack.db, stack.clock, stack.ids, stack.providers, stack.outbox)
    second = LeadRunner(stack.db, stack.clock, stack.ids, stack.providers, stack.outbox)
    stale = await first.claim()
    assert stale is not None
    clock(stack).advance(20 * MINUTE_MS + 1)
    assert await second.expire_leases() == 1
    fresh = await second.claim()
    assert fresh is not None and fresh.lease_token != stale.lease_token
    audit_before = await audit(stack, item_id)
    reviews = reviews_counted()

    await first.review(stale)  # TransitionError inside: logged, verdict dropped

    item = await row(stack, item_id)
    assert item["status"] == "reviewing"
    assert item["lease_token"] == fresh.lease_token
    assert await deliveries(stack, item_id) == []
    assert await audit(stack, item_id) == audit_before

    await second.review(fresh)
    done = "completed" if via == "api" else "approved"  # (the post waits for the relay)
    assert (await row(stack, item_id))["status"] == done
    await first.review(stale)  # still nothing: the item is no longer reviewing
    assert len(await deliveries(stack, item_id)) == 1
    assert (await actions(stack, item_id)).count("approve") == 1
    # One verdict stored, one counted: the dropped ones were counted as the lead gave
    # them (three here).
    assert reviews_counted() - reviews == 1


async def test_a_slack_approval_writes_its_post_claimed_for_this_process(stack: Stack) -> None:
    """The lead approves a Slack-bound item: approved, audited, and the post written on
    the session's binding already claimed for this process's relay, which gets it after
    commit. On PostgreSQL all of it is one statement outside a transaction block."""
    org, lead, worker = await setup(stack)
    item_id = await submit_slack(stack, org, worker, "5.1")
    relay = stack.relay
    stack.db.on_commit_payloads(HANDOFF_TOPIC, relay.accept)
    stack.outbox.attach(relay)
    try:
        claimed = await stack.lead_runner.claim()
        assert claimed is not None and claimed.id == item_id
        with stack.db.record_statements() as statements:
            await stack.lead_runner.review(claimed)
    finally:
        stack.outbox.attach(None)
        stack.db.off_commit_payloads(HANDOFF_TOPIC, relay.accept)
    item = await row(stack, item_id)
    assert (item["status"], item["lease_token"]) == ("approved", None)
    [post] = await deliveries(stack, item_id)
    async with stack.db.read() as conn:
        binding = await active_binding(conn, item["session_id"])
    assert binding is not None
    assert (post["kind"], post["action"], post["channel"]) == ("gating", "post", "slack")
    assert (post["binding_id"], post["address"]) == (binding.id, binding.address)
    assert post["text"] == item["snapshot"] == "Echo: task 5.1 #complete"
    assert (post["status"], post["lease_token"], post["attempts"]) == (
        "sending",
        relay.handoff_token,
        1,
    )
    assert [r.id for r in relay.take_handed()] == [post["id"]]
    last = (await audit(stack, item_id))[-1]
    assert (last["action"], last["from_status"], last["to_status"], last["actor"]) == (
        "approve",
        "reviewing",
        "approved",
        f"lead:{lead['id']}",
    )
    if stack.db.is_postgres:
        assert [sql.split()[0] for sql in statements].count("BEGIN") == 0, statements


@pytest.mark.parametrize(
    ("alone", "db_url"),
    [
        (True, "sqlite"),
        (True, "postgres"),
        # (SQLite writes the approval in a transaction either way.)
        (False, "postgres"),
    ],
    ids=["alone-sqlite", "alone-postgres", "by-tx-postgres"],
    indirect=["db_url"],
)
async def test_a_slack_approval_without_a_local_relay_wakes_every_relay(
    stack: Stack, migrated_url: str, alone: bool
) -> None:
    """This process's relay is poked at commit; the other replicas' relays hear NOTIFY,
    on a connection of their own (so the poke cannot stand in for it). On PostgreSQL the
    approval NOTIFYs either way it is written: the one statement's own ``pg_notify``,
    and, in a transaction (``statements_alone=False``), the outbox's."""
    if not alone:
        stack = build_stack(migrated_url, statements_alone=False)
    try:
        await _approval_wakes_every_relay(stack)
    finally:
        if not alone:
            await stack.stop()


async def _approval_wakes_every_relay(stack: Stack) -> None:
    org, _, worker = await setup(stack)
    item_id = await submit_slack(stack, org, worker, "5.2")
    listener = None
    heard: list[str] = []
    if stack.db.is_postgres:
        listener = await asyncpg.connect(asyncpg_dsn(stack.db.url))
        await listener.add_listener(NOTIFY_CHANNEL, lambda *args: heard.append(args[2]))
    try:
        stack.relay.take_poke()
        assert await drain(stack.lead_runner) == 1
        [post] = await deliveries(stack, item_id)
        assert (post["status"], post["lease_token"], post["attempts"]) == ("pending", None, 0)
        assert stack.relay.take_poke()  # this process's relay, at commit
        if listener is not None:  # and the other replicas' relays
            await eventually(lambda: heard, what="the approval's NOTIFY to the relays")
            assert heard == [NOTIFY_CHANNEL]
    finally:
        if listener is not None:
            await listener.close()


async def test_an_approval_whose_binding_went_away_after_the_claim_posts_nowhere(
    stack: Stack,
) -> None:
    org, _, worker = await setup(stack)
    item_id = await submit_slack(stack, org, worker, "5.3")
    claimed = await stack.lead_runner.claim()
    assert claimed is not None
    async with stack.db.tx() as conn:
        assert await deactivate_session(conn, claimed.session_id) == 1
    await stack.lead_runner.review(claimed)
    # As the transaction decides (SPEC 6): a post with no binding, which the relay fails.
    [post] = await deliveries(stack, item_id)
    assert (post["action"], post["channel"], post["binding_id"]) == ("post", "none", None)
    assert (await row(stack, item_id))["status"] == "approved"


async def item_rows(stack: Stack, item_id: str, key: str) -> list[Any]:
    """What an item's life wrote (the item, its audit rows, deliveries and messages, its
    session's events), :class:`Anonymizer`'d with the session key."""
    norm = Anonymizer(key)

    item = await row(stack, item_id)
    e = t.session_events.c
    async with stack.db.read() as conn:
        events = (
            await conn.execute(
                sa.select(t.session_events)
                .where(e.session_id == item["session_id"])
                .order_by(e.seq)
            )
        ).all()
        texts = (
            await conn.execute(
                sa.select(t.messages)
                .where(t.messages.c.work_item_id == item_id)
                .order_by(t.messages.c.created_at, t.messages.c.id)
            )
        ).all()
    return [
        norm(item),
        [norm(a) for a in await audit(stack, item_id)],
        [norm(d) for d in await deliveries(stack, item_id)],
        [norm(dict(m._mapping)) for m in texts],
        [norm(dict(ev._mapping)) for ev in events],
    ]


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_an_api_approval_in_one_statement_writes_what_the_transaction_writes(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: the lead's approval of an api-bound item (the answer revealed, the
    item completed) is one statement outside a transaction block, which writes exactly
    what the verdict's transaction writes."""
    org, _, worker = await setup(stack)
    one = await submit(stack, org, worker, "task", session="session-one")
    claimed = await stack.lead_runner.claim()
    assert claimed is not None and claimed.id == one
    with stack.db.record_statements() as statements:
        await stack.lead_runner.review(claimed)
    # (the lead agent's read first: this stack does not LISTEN for its changes)
    assert "BEGIN" not in statements and "revealed" in statements[-1], statements

    async def by_transaction(*args: Any, **kwargs: Any) -> bool:
        return False

    monkeypatch.setattr(runner_module, "approve_alone", by_transaction)
    two = await submit(stack, org, worker, "task", session="session-two")
    claimed = await stack.lead_runner.claim()
    assert claimed is not None and claimed.id == two
    with stack.db.record_statements() as statements:
        await stack.lead_runner.review(claimed)
    assert "BEGIN" in statements
    first = await item_rows(stack, one, "session-one")
    assert first[0]["status"] == "completed"
    assert first == await item_rows(stack, two, "session-two")


async def test_the_revision_runner_knows_when_the_earliest_revision_lease_lapses(
    stack: Stack,
) -> None:
    """A dispatcher that claimed a revision and stalled (alive, never finishing) holds its
    lease, and nothing is committed when it lapses: a pass that claims nothing learns
    from the claim's one read when the earliest revision lease lapses, and the runner
    loop sleeps no longer than until then (``due_in_s``), not until the poll."""
    org, _, worker = await setup(stack)
    dispatcher = RevisionRunner(stack.turns)
    assert not await dispatcher.run_once()
    assert dispatcher.due_in_s() is None  # no revision leased: the poll alone
    item_id = await submit(stack, org, worker, "draft it #revise")
    await drain(stack.lead_runner)  # changes requested: the feedback waits
    stalled = await stack.turns.claim_revision()  # and never runs it
    assert stalled is not None and stalled.id == item_id
    clock = stack.clock
    assert isinstance(clock, FakeClock)
    clock.advance(MINUTE_MS)
    with stack.db.record_statements() as empty_pass:
        assert not await dispatcher.run_once()
    # One read (the claim's), which also tells when the lease lapses (SQLite's read
    # transaction around it aside): it was two.
    reads = [sql for sql in empty_pass if sql not in ("BEGIN", "ROLLBACK")]
    assert len(reads) == 1 and reads[0].startswith("SELECT"), reads
    assert dispatcher.due_in_s() == (REVISION_LEASE_MS - MINUTE_MS + 1) / 1000
    clock.advance(REVISION_LEASE_MS - MINUTE_MS)  # not lapsed yet (strictly past)
    assert not await dispatcher.run_once()
    assert dispatcher.due_in_s() == 0.001
    clock.advance(1)
    assert await dispatcher.run_once()  # run again when its lease lapsed
    assert (await row(stack, item_id))["status"] == "reviewQueued"
    assert not await dispatcher.run_once()
    assert dispatcher.due_in_s() is None


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_revision_claim_that_skips_a_locked_item_looks_again_soon(stack: Stack) -> None:
    """PostgreSQL: the one item whose feedback waits is row-locked by another transaction
    (held open here; in the service a person's approval or cancel that lost its race to
    the return that made the item claimable keeps the lock to its commit, and no wake-up
    follows that commit). The dispatcher's claim takes nothing, but the loop sleeps at
    most LOCKED_RECHECK_MS (and the lease lapse's 1 ms), not the poll; once the lock is
    gone the next pass runs the revision, and an empty pass after it leaves nothing
    due."""
    org, _, worker = await setup(stack)
    dispatcher = RevisionRunner(stack.turns)
    item_id = await submit(stack, org, worker, "draft it #revise")
    await drain(stack.lead_runner)  # changes requested: the feedback waits
    async with held_open(stack.db, item_locked(item_id)):
        assert not await dispatcher.run_once()
        assert (await row(stack, item_id))["pending_feedback"] is not None
        assert dispatcher.due_in_s() == (LOCKED_RECHECK_MS + 1) / 1000
    assert await dispatcher.run_once()
    assert (await row(stack, item_id))["status"] == "reviewQueued"
    assert not await dispatcher.run_once()
    assert dispatcher.due_in_s() is None


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_revision_claim_in_doubt_is_run_soon_not_after_its_lease(
    stack: Stack, claim_in_doubt: ClaimInDoubt
) -> None:
    """The revision claim's COMMIT answer was lost: the claim landed (or lands after the
    next pass looked for it). The item held the claim's token, which nobody held, for
    the revision lease (5 minutes), its feedback undispatched. The next pass looks for
    the token first, and again a second on (then at doubling gaps), and runs the
    revision it finds. (PostgreSQL only: a SQLite COMMIT is never in doubt.)"""
    org, _, worker = await setup(stack)
    dispatcher = RevisionRunner(stack.turns)
    item_id = await submit(stack, org, worker, "draft it #revise")
    await drain(stack.lead_runner)  # changes requested: the feedback waits
    claim_in_doubt.arm(stack.db)
    with pytest.raises(Unavailable) as raised:
        await dispatcher.run_once()
    assert raised.value.in_doubt
    await claim_in_doubt.until_found(dispatcher, stack.clock)
    assert await dispatcher.run_once()  # (the loop's back-off aside: no clock moved)
    item = await row(stack, item_id)
    assert (item["status"], item["pending_feedback"], item["lease_token"]) == (
        "reviewQueued",
        None,
        None,
    )
    assert not await dispatcher.run_once()
    assert dispatcher.due_in_s() is None


async def test_changes_requested_dispatches_feedback_then_approves(stack: Stack) -> None:
    org, lead, worker = await setup(stack)
    item_id = await submit(stack, org, worker, "draft it #revise")
    await drain(stack.lead_runner)
    item = await row(stack, item_id)
    assert item["status"] == "inProgress"
    assert item["revision"] == 1
    assert item["pending_feedback"] == "Please revise."
    assert item["last_feedback"] == "Please revise."
    assert item["lease_token"] is None
    assert await deliveries(stack, item_id) == []
    last = (await audit(stack, item_id))[-1]
    assert (last["actor"], last["action"], last["text"], last["to_status"]) == (
        f"lead:{lead['id']}",
        "changesRequested",
        "Please revise.",
        "inProgress",
    )

    # The feedback reaches the worker as an internal turn; it revises and completes.
    assert await drain(RevisionRunner(stack.turns)) == 1
    item = await row(stack, item_id)
    assert item["status"] == "reviewQueued"
    assert item["pending_feedback"] is None
    assert item["snapshot"] == "Revised: Please revise."
    assert item["summary"] == "Revised: Please revise."
    assert await messages(stack, item_id) == [
        ("user", "draft it #revise #complete", False),
        ("tool", "Summary: draft it #revise", False),
        ("assistant", "Echo: draft it #revise #complete", True),
        ("internal", "Please revise.", False),
        ("tool", "Revised: Please revise.", False),
        ("assistant", "Revised: Please revise.", True),
    ]

    # The next review approves revision 1 (the script lead revises only revision 0).
    await drain(stack.lead_runner)
    item = await row(stack, item_id)
    assert (item["status"], item["revision"]) == ("completed", 1)
    [dlv] = await deliveries(stack, item_id)
    assert dlv["text"] == "Revised: Please revise."
    await drain(stack.relay)
    async with stack.db.read() as conn:
        shown = [m["content"] for m in await visible_transcript(conn, org.id, item["session_id"])]
    # Only the approved revision is revealed; the first, rejected draft stays withheld.
    assert shown == ["draft it #revise #complete", "Revised: Please revise."]


@SQLITE_ONLY
async def test_escalated_goes_to_a_human(stack: Stack) -> None:
    org, lead, worker = await setup(stack)
    item_id = await submit(stack, org, worker, "risky #escalate")
    await drain(stack.lead_runner)
    item = await row(stack, item_id)
    assert item["status"] == "awaitingHuman"
    assert item["revision"] == 0
    assert item["last_feedback"] == "Needs a human."
    assert await deliveries(stack, item_id) == []
    last = (await audit(stack, item_id))[-1]
    assert (last["actor"], last["action"], last["text"]) == (
        f"lead:{lead['id']}",
        "escalate",
        "Needs a human.",
    )
    # Busy while a human decides.
    out = await stack.turns.run(api_trigger(org, worker, "anything new?"))
    assert type(out).__name__ == "Busy"


@SQLITE_ONLY
async def test_completion_policy_is_shown_and_never_branched_on(stack: Stack) -> None:
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    workers = {
        policy: await make_agent(
            stack, org, f"w-{policy}", lead="lead", review_config={"completionPolicy": policy}
        )
        for policy in ("completeAutomatically", "requestHumanApproval")
    }
    default = await make_agent(stack, org, "w-default", lead="lead")
    paths: dict[str, list[list[tuple[str, str | None, str | None]]]] = {}
    for policy, worker in workers.items():
        paths[policy] = []
        for session, text in (("a", "plain"), ("b", "again #revise"), ("c", "hard #escalate")):
            item_id = await submit(stack, org, worker, text, session)
            await stack.settle()
            await drain(stack.relay)
            async with stack.db.read() as conn:
                body = await detail(conn, org.id, item_id)
            assert body["completionPolicy"] == policy
            paths[policy].append([(a["action"], a["from"], a["to"]) for a in body["audit"]])
    assert paths["completeAutomatically"] == paths["requestHumanApproval"]
    assert [p[-1][0] for p in paths["requestHumanApproval"]] == [
        "delivered",
        "delivered",
        "escalate",
    ]
    item_id = await submit(stack, org, default, "x")
    async with stack.db.read() as conn:
        assert (await detail(conn, org.id, item_id))["completionPolicy"] == "requestHumanApproval"


# -------------------------------------------------------------- revision accounting


def always_changes(request: ModelRequest, n: int) -> list[ModelEvent]:
    envelope = json.loads(request.messages[1].content)
    return [verdict("changesRequested", f"Fix round {envelope['revision']}")]


@SQLITE_ONLY
@pytest.mark.parametrize("rounds", [None, 1, 5])
async def test_rounds_run_out_then_a_human_decides(
    stack: Stack, fake_lead: FakeLead, rounds: int | None
) -> None:
    config = None if rounds is None else {"maxRevisionRounds": rounds}
    org, _, worker = await setup(stack, lead_model="fake", config=config)
    fake_lead.behaviour = always_changes
    item_id = await submit(stack, org, worker, "task")
    await stack.settle()
    expected = 3 if rounds is None else rounds
    item = await row(stack, item_id)
    assert item["max_revision_rounds"] == expected
    assert (item["status"], item["revision"]) == ("awaitingHuman", expected)
    assert len(fake_lead.requests) == expected + 1
    acts = await actions(stack, item_id)
    assert acts.count("changesRequested") == expected
    assert acts[-1] == "roundsExhausted"
    assert item["last_feedback"] == f"Fix round {expected}"
    # Each round's feedback reached the worker as an internal turn.
    internal = [c for r, c, _ in await messages(stack, item_id) if r == "internal"]
    assert internal == [f"Fix round {n}" for n in range(expected)]
    assert await deliveries(stack, item_id) == []


@SQLITE_ONLY
async def test_a_human_return_adds_one_allowance(stack: Stack, fake_lead: FakeLead) -> None:
    org, _, worker = await setup(stack, lead_model="fake")

    def escalate_first(request: ModelRequest, n: int) -> list[ModelEvent]:
        return [verdict("escalated", "unsure")] if n == 1 else always_changes(request, n)

    fake_lead.behaviour = escalate_first
    item_id = await submit(stack, org, worker, "task")
    await drain(stack.lead_runner)
    assert (await row(stack, item_id))["status"] == "awaitingHuman"

    async with stack.db.tx() as conn:
        current = await workitems.get(conn, item_id)
        await decisions.human_return(
            conn, stack.clock, stack.ids, current, "user:alice", "Use the 2024 numbers."
        )
    item = await row(stack, item_id)
    assert (item["status"], item["revision"], item["extra_allowance"]) == ("inProgress", 1, 1)
    assert item["pending_feedback"] == "Use the 2024 numbers."

    # The return is dispatched to the worker, and the lead still has all three rounds.
    await stack.settle()
    item = await row(stack, item_id)
    assert (item["status"], item["revision"]) == ("awaitingHuman", 4)
    msgs = await messages(stack, item_id)
    assert ("internal", "Use the 2024 numbers.", False) in msgs
    assert ("assistant", "Revised: Use the 2024 numbers.", True) in msgs
    acts = await actions(stack, item_id)
    assert acts.count("changesRequested") == 3
    assert acts[-1] == "roundsExhausted"

    # A return after the rounds ran out: one more revision, and the lead can approve it.
    async with stack.db.tx() as conn:
        current = await workitems.get(conn, item_id)
        await decisions.human_return(conn, stack.clock, stack.ids, current, "user:alice", "Last go")
    item = await row(stack, item_id)
    assert (item["revision"], item["extra_allowance"]) == (5, 2)
    fake_lead.behaviour = lambda request, n: [verdict("approved")]
    await stack.settle()
    item = await row(stack, item_id)
    assert (item["status"], item["snapshot"]) == ("completed", "Revised: Last go")


# ---------------------------------------------------------------------------- lease


@SQLITE_ONLY
async def test_lease_is_twenty_minutes_and_the_third_expiry_goes_to_a_human(
    stack: Stack,
) -> None:
    org, _, worker = await setup(stack)
    item_id = await submit(stack, org, worker, "task")
    runner = stack.lead_runner
    stale: WorkItem | None = None
    for expiry in (1, 2, 3):
        claimed = await runner.claim()
        assert claimed is not None and claimed.id == item_id
        assert claimed.status == "reviewing"
        assert claimed.lease_token
        assert claimed.lease_expires_at == stack.clock.now_ms() + 20 * MINUTE_MS
        clock(stack).advance(20 * MINUTE_MS)
        assert await runner.expire_leases() == 0  # exactly 20 minutes: still held
        assert (await row(stack, item_id))["status"] == "reviewing"
        clock(stack).advance(1)
        assert await runner.expire_leases() == 1
        item = await row(stack, item_id)
        assert item["lease_expiries"] == expiry
        assert item["lease_token"] is None and item["lease_expires_at"] is None
        assert item["status"] == ("awaitingHuman" if expiry == 3 else "reviewQueued")
        last = (await audit(stack, item_id))[-1]
        assert (last["actor"], last["action"]) == ("system:lease", "leaseExpired")
        assert last["text"] == f"review lease expired ({expiry} of 3)"
        stale = claimed
    assert await runner.claim() is None  # awaitingHuman is not claimable
    assert stale is not None
    await runner.review(stale)  # its lease is gone: dropped
    assert (await row(stack, item_id))["status"] == "awaitingHuman"
    assert await deliveries(stack, item_id) == []


async def test_racing_runners_claim_an_item_exactly_once(stack: Stack) -> None:
    org, _, worker = await setup(stack)
    runners = [
        LeadRunner(stack.db, stack.clock, stack.ids, stack.providers, stack.outbox)
        for _ in range(4)
    ]
    # Two instances, one after the other.
    first_id = await submit(stack, org, worker, "one", "s1")
    claimed = await runners[0].claim()
    assert claimed is not None and claimed.id == first_id
    assert await runners[1].claim() is None
    # Concurrent tasks (separate connections; SKIP LOCKED on PostgreSQL).
    second_id = await submit(stack, org, worker, "two", "s2")
    claims = await asyncio.gather(*(r.claim() for r in runners))
    won = [c for c in claims if c is not None]
    assert [c.id for c in won] == [second_id]
    # Whole review passes, concurrently, over several items: each approved exactly once.
    ids = [await submit(stack, org, worker, f"job {n}", f"job{n}") for n in range(3)]
    for _ in range(3):
        await asyncio.gather(*(r.run_once() for r in runners))
    for item_id in ids:
        assert (await row(stack, item_id))["status"] == "completed"
        assert len(await deliveries(stack, item_id)) == 1
        acts = await actions(stack, item_id)
        assert (acts.count("claim"), acts.count("approve")) == (1, 1)


# ------------------------------------------------------------------------ lead tools


@SQLITE_ONLY
async def test_the_lead_gets_three_tools_and_a_server_built_envelope(
    stack: Stack, fake_lead: FakeLead
) -> None:
    org, _, worker = await setup(stack, lead_model="fake")
    item_id = await submit(stack, org, worker, "draft #revise")
    await stack.settle()
    assert (await row(stack, item_id))["status"] == "completed"
    first, second = fake_lead.requests
    for request in (first, second):
        assert request.purpose == "lead"
        assert [tool.name for tool in request.tools] == LEAD_TOOL_NAMES
        assert request.tools == LEAD_TOOLS
        assert [m.role for m in request.messages] == ["system", "user"]
    verdict_schema = first.tools[0].parameters["properties"]["verdict"]
    assert verdict_schema["enum"] == ["approved", "changesRequested", "escalated"]
    envelope = json.loads(first.messages[1].content)
    assert envelope["taskContext"] == "draft #revise #complete"
    assert envelope["summary"] == "Summary: draft #revise"
    assert envelope["submissionSnapshot"] == "Echo: draft #revise #complete"
    assert envelope["revision"] == 0
    assert envelope["previousFeedback"] is None
    envelope = json.loads(second.messages[1].content)
    assert envelope["taskContext"] == "draft #revise #complete"
    assert envelope["submissionSnapshot"] == "Revised: Please revise."
    assert envelope["summary"] == "Revised: Please revise."
    assert envelope["revision"] == 1
    assert envelope["previousFeedback"] == "Please revise."


@SQLITE_ONLY
async def test_inspect_tools_show_gated_messages_and_artifacts(
    stack: Stack, fake_lead: FakeLead
) -> None:
    org, _, worker = await setup(stack, lead_model="fake")

    def inspect_then_approve(request: ModelRequest, n: int) -> list[ModelEvent]:
        if n == 1:
            return [
                ToolCall("c1", "inspect_lead_messages", {}),
                ToolCall("c2", "inspect_lead_artifacts", {}),
                ToolCall("c3", "inspect_lead_messages", {"limit": 1}),
                ToolCall("c4", "http_get", {"url": "http://127.0.0.1/"}),
            ]
        return [verdict("approved")]

    fake_lead.behaviour = inspect_then_approve
    item_id = await submit(stack, org, worker, "build it")
    await drain(stack.lead_runner)
    assert (await row(stack, item_id))["status"] == "completed"
    assert len(fake_lead.requests) == 2
    results = {
        m.tool_call_id: m.content for m in fake_lead.requests[1].messages if m.role == "tool"
    }
    assert json.loads(results["c1"]) == [
        {"role": "user", "content": "build it #complete", "leadGated": False},
        {"role": "tool", "content": "Summary: build it", "leadGated": False},
        {"role": "assistant", "content": "Echo: build it #complete", "leadGated": True},
    ]
    assert json.loads(results["c2"]) == [{"tool": "complete_task", "content": "Summary: build it"}]
    assert json.loads(results["c3"]) == [
        {"role": "assistant", "content": "Echo: build it #complete", "leadGated": True}
    ]
    assert "error" in json.loads(results["c4"])


@SQLITE_ONLY
async def test_no_verdict_after_four_executions_escalates(
    stack: Stack, fake_lead: FakeLead
) -> None:
    org, lead, worker = await setup(stack, lead_model="fake")
    fake_lead.behaviour = lambda request, n: [TextDelta("Looks fine to me.")]
    item_id = await submit(stack, org, worker, "task")
    await drain(stack.lead_runner)
    assert len(fake_lead.requests) == 4
    # Each further execution was reminded to give a verdict.
    assert (
        fake_lead.requests[1].messages[-1].content == "Call submit_lead_review with your verdict."
    )
    item = await row(stack, item_id)
    assert item["status"] == "awaitingHuman"
    last = (await audit(stack, item_id))[-1]
    assert (last["actor"], last["action"]) == (f"lead:{lead['id']}", "escalate")
    assert last["text"] == "no verdict after 4 lead executions"


@SQLITE_ONLY
async def test_a_model_error_on_the_last_execution_escalates(
    stack: Stack, fake_lead: FakeLead
) -> None:
    org, _, worker = await setup(stack, lead_model="fake")

    def fail_last(request: ModelRequest, n: int) -> list[ModelEvent] | BaseException:
        return ModelError("upstream 503") if n == 4 else [TextDelta("hmm")]

    fake_lead.behaviour = fail_last
    item_id = await submit(stack, org, worker, "task")
    await drain(stack.lead_runner)
    assert len(fake_lead.requests) == 4
    assert (await row(stack, item_id))["status"] == "awaitingHuman"
    last = (await audit(stack, item_id))[-1]
    assert last["action"] == "escalate"
    assert "the lead model failed" in last["text"] and "upstream 503" in last["text"]


@SQLITE_ONLY
async def test_an_early_model_error_is_retried(stack: Stack, fake_lead: FakeLead) -> None:
    org, _, worker = await setup(stack, lead_model="fake")
    fake_lead.behaviour = lambda request, n: (
        ModelError("timeout") if n == 1 else [verdict("approved")]
    )
    item_id = await submit(stack, org, worker, "task")
    await drain(stack.lead_runner)
    assert len(fake_lead.requests) == 2
    assert (await row(stack, item_id))["status"] == "completed"


@SQLITE_ONLY
async def test_an_invalid_verdict_gets_a_tool_error_and_the_lead_retries(
    stack: Stack, fake_lead: FakeLead
) -> None:
    org, _, worker = await setup(stack, lead_model="fake")

    def bad_then_good(request: ModelRequest, n: int) -> list[ModelEvent]:
        if n == 1:
            return [ToolCall("bad1", "submit_lead_review", {"verdict": "lgtm"})]
        if n == 2:
            return [ToolCall("bad2", "submit_lead_review", {"feedback": "no verdict"})]
        return [verdict("changesRequested", "Add tests.", "ok")]

    fake_lead.behaviour = bad_then_good
    item_id = await submit(stack, org, worker, "task")
    await drain(stack.lead_runner)
    assert len(fake_lead.requests) == 3
    for request, call_id in ((fake_lead.requests[1], "bad1"), (fake_lead.requests[2], "bad2")):
        tool_msg = request.messages[-1]
        assert (tool_msg.role, tool_msg.tool_call_id) == ("tool", call_id)
        assert "verdict must be" in json.loads(tool_msg.content)["error"]
    item = await row(stack, item_id)
    assert (item["status"], item["revision"], item["pending_feedback"]) == (
        "inProgress",
        1,
        "Add tests.",
    )


@SQLITE_ONLY
@pytest.mark.parametrize("change", ["deactivate", "delete", "unconfigured model"])
async def test_a_lead_that_cannot_run_escalates(
    stack: Stack, fake_lead: FakeLead, change: str
) -> None:
    org, lead, worker = await setup(stack, lead_model="fake")
    item_id = await submit(stack, org, worker, "task")
    changes: dict[str, dict[str, Any]] = {
        "deactivate": {"active": False},
        "delete": {"delete": True},
        "unconfigured model": {"model": "gone"},
    }
    kwargs = changes[change]
    async with stack.db.tx() as conn:
        await agents_mod.save_agent(
            conn, stack.clock, stack.ids, org.id, agent_ref=lead["id"], **kwargs
        )
    await drain(stack.lead_runner)
    assert fake_lead.requests == []
    item = await row(stack, item_id)
    assert item["status"] == "awaitingHuman"
    assert await deliveries(stack, item_id) == []
    last = (await audit(stack, item_id))[-1]
    assert last["action"] == "escalate"
    expected = {
        "deactivate": "the lead agent is inactive",
        "delete": "the lead agent no longer exists",
        "unconfigured model": "model 'gone' is not configured",
    }[change]
    assert last["text"] == expected


async def test_a_lead_changed_after_it_reviewed_is_read_again(
    stack: Stack, migrated_url: str
) -> None:
    """The claim keeps the lead agent between reviews (ConfigCache.agent): a change made
    here, or committed by another process (the CLI), is seen by the next claim."""
    await stack.listen_for_changes()  # PostgreSQL: kept only while it hears of changes
    org, lead, worker = await setup(stack)
    first = await submit(stack, org, worker, "task one", session="s1")
    assert await drain(stack.lead_runner) == 1
    assert (await row(stack, first))["status"] == "completed"
    async with stack.db.tx() as conn:
        await agents_mod.save_agent(
            conn, stack.clock, stack.ids, org.id, agent_ref=lead["id"], active=False
        )
    second = await submit(stack, org, worker, "task two", session="s2")
    assert await drain(stack.lead_runner) == 1
    assert (await audit(stack, second))[-1]["text"] == "the lead agent is inactive"
    other = Database(migrated_url)
    try:
        async with other.tx() as conn:
            await agents_mod.save_agent(
                conn, stack.clock, stack.ids, org.id, agent_ref=lead["id"], active=True
            )
    finally:
        await other.close()
    await stack.heard_of("agents")
    third = await submit(stack, org, worker, "task three", session="s3")
    assert await drain(stack.lead_runner) == 1
    assert (await row(stack, third))["status"] == "completed"


# ------------------------------------------------------------------ database faults


async def test_a_review_whose_reads_fail_goes_back_to_the_queue_at_once(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    org, _, worker = await setup(stack)
    item_id = await submit(stack, org, worker, "write the report")
    # Claimed by another runner: this one has not read the lead agent in the claim's
    # transaction, so its review reads it (and that read fails).
    other = LeadRunner(stack.db, stack.clock, stack.ids, stack.providers, stack.outbox)
    item = await other.claim()
    assert item is not None and item.id == item_id
    monkeypatch.setattr(stack.db, "read", DownFor(stack.db.read, 1, after_commit=False))
    with pytest.raises(Unavailable):
        await stack.lead_runner.review(item)
    assert (await row(stack, item_id))["status"] == "reviewing"
    # The next pass (the database is back) gives it back and reviews it: no 20-minute wait.
    assert await drain(stack.lead_runner) == 1
    assert (await row(stack, item_id))["status"] == "completed"
    assert await released(stack, item_id) == [
        "the review's reads met a database fault; the review runs again"
    ]


async def test_a_verdict_whose_commit_failed_is_committed_later_without_a_second_lead_run(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lead decided; the database was away for the commit. The verdict is kept and
    committed on the next pass (the README's promise): the item was given back to the
    queue and the lead asked again, which need not answer the same."""
    item_id, claimed = await claimed_review(stack)
    runner = stack.lead_runner
    decided = 0
    real_decide = runner._decide

    async def counting(item: Any) -> Any:
        nonlocal decided
        decided += 1
        return await real_decide(item)

    async def by_transaction(*args: Any, **kwargs: Any) -> bool:
        return False  # the verdict's transaction on either backend

    monkeypatch.setattr(runner, "_decide", counting)
    monkeypatch.setattr(runner_module, "approve_alone", by_transaction)
    monkeypatch.setattr(stack.db, "tx", DownFor(stack.db.tx, 1, after_commit=False))
    reviews = reviews_counted()
    with pytest.raises(Unavailable):
        await runner.review(claimed)
    assert (await row(stack, item_id))["status"] == "reviewing"
    assert reviews_counted() == reviews  # not stored: not counted (it was, as given)
    await drain(runner)  # the database is back
    assert (await row(stack, item_id))["status"] == "completed"
    assert decided == 1
    assert "leaseReleased" not in await actions(stack, item_id)
    assert reviews_counted() - reviews == 1  # once, as it committed


async def test_a_kept_verdict_whose_lease_lapsed_is_dropped_uncounted(stack: Stack) -> None:
    """A verdict kept from its commit by a database fault, whose lease lapses before the
    database is back: another runner takes the item back and reviews it, and the kept
    verdict's commit is dropped by the lease fence. One verdict stored, one counted: the
    dropped one was counted as the lead gave it, and the item's next review again."""
    item_id, claimed = await claimed_review(stack)
    runner = stack.lead_runner

    async def by_transaction(*args: Any, **kwargs: Any) -> bool:
        return False  # the verdict's transaction on either backend

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner_module, "approve_alone", by_transaction)
        mp.setattr(stack.db, "tx", DownFor(stack.db.tx, 1, after_commit=False))
        reviews = reviews_counted()
        with pytest.raises(Unavailable):
            await runner.review(claimed)
    clock(stack).advance(runner_module.LEASE_MS + 1)
    other = LeadRunner(stack.db, stack.clock, stack.ids, stack.providers, stack.outbox)
    assert await drain(other) == 1  # the lease taken back, the item claimed and reviewed
    assert (await row(stack, item_id))["status"] == "completed"
    await runner._commit_kept()  # the fence drops the kept verdict
    assert runner._verdicts == []
    assert (await actions(stack, item_id)).count("approve") == 1
    assert reviews_counted() - reviews == 1


def approval_counted() -> tuple[float, ...]:
    """What a lead's approval of a channel post counts: the verdict and its move."""
    return reviews_counted(), transitions_counted("reviewing", "approved")


def added_to(before: tuple[float, ...], now: tuple[float, ...]) -> tuple[float, ...]:
    """What was counted from ``before`` to ``now``."""
    return tuple(b - a for b, a in zip(now, before, strict=True))


def verdict_counted() -> tuple[float, ...]:
    """What a lead's approval of an ``api`` item counts: the verdict, its two moves
    (``reviewing -> approved -> completed``) and the reveal's delivery."""
    return (
        reviews_counted(),
        transitions_counted("reviewing", "approved"),
        transitions_counted("approved", "completed"),
        deliveries_counted("api", "sent"),
    )


def added(before: tuple[float, ...]) -> tuple[float, ...]:
    """What :func:`verdict_counted` counted since ``before``."""
    return added_to(before, verdict_counted())


async def by_transaction(*args: Any, **kwargs: Any) -> bool:
    """``approve_alone`` that declines: the verdict's transaction on either backend."""
    return False


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_verdict_in_doubt_that_landed_is_counted_once_by_its_retry(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, claim_in_doubt: ClaimInDoubt
) -> None:
    """The verdict's transaction met a fault at its ``COMMIT`` (in doubt) and landed, at
    once or while its retry waited on the item's row lock. The kept verdict's retry is
    dropped by the lease fence (it does not act again), and its look finds the first
    commit's audit row: what that commit held is counted then, once. It was never
    counted: the fence cannot tell a verdict that landed from a lost lease."""
    item_id, claimed = await claimed_review(stack)
    runner = stack.lead_runner
    monkeypatch.setattr(runner_module, "approve_alone", by_transaction)
    claim_in_doubt.arm(stack.db)
    before = verdict_counted()
    with pytest.raises(Unavailable) as raised:
        await runner.review(claimed)
    assert raised.value.in_doubt
    assert added(before) == (0, 0, 0, 0)  # in doubt: nothing counted yet
    late = claim_in_doubt.late
    if late is None:
        await runner._commit_kept()
    else:
        # Not landed yet: the retry's fenced move waits for the row lock the commit
        # under way holds, and sees the item moved once it lands.
        assert (await row(stack, item_id))["status"] == "reviewing"
        retry = asyncio.create_task(runner._commit_kept())
        await blocked_on_a_lock(stack.db, retry)
        await late.land()
        await retry
    assert runner._verdicts == []
    assert added(before) == (1, 1, 1, 1)
    assert (await row(stack, item_id))["status"] == "completed"
    assert (await actions(stack, item_id)).count("approve") == 1
    assert "leaseReleased" not in await actions(stack, item_id)
    assert await drain(runner) == 0
    assert added(before) == (1, 1, 1, 1)  # once


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_one_statement_approval_in_doubt_that_landed_is_counted_once_by_its_retry(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, for the approval run as one statement (``approve_alone``): the retry's
    statement matches nothing, nor does its transaction, and the look finds the
    approval's audit row."""
    item_id, claimed = await claimed_review(stack)
    runner = stack.lead_runner
    lose_the_next_commit(monkeypatch, stack.db, alone=True)
    before = verdict_counted()
    with pytest.raises(Unavailable) as raised:
        await runner.review(claimed)
    assert raised.value.in_doubt
    assert added(before) == (0, 0, 0, 0)
    await runner._commit_kept()
    assert runner._verdicts == []
    assert added(before) == (1, 1, 1, 1)
    assert (await actions(stack, item_id)).count("approve") == 1
    assert len(await deliveries(stack, item_id)) == 1
    assert await drain(runner) == 0
    assert added(before) == (1, 1, 1, 1)


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_verdict_in_doubt_that_did_not_land_is_committed_and_counted_by_its_retry(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verdict's commit was in doubt and rolled back: the retry commits it and counts
    it at its commit; the look (none: the fence let it through) counts nothing more."""
    item_id, claimed = await claimed_review(stack)
    runner = stack.lead_runner
    monkeypatch.setattr(runner_module, "approve_alone", by_transaction)
    pool = stack.db._pg
    assert pool is not None
    real_tx = pool.transaction

    @contextlib.asynccontextmanager
    async def rolled_back_in_doubt(**kwargs: Any) -> AsyncIterator[Any]:
        monkeypatch.setattr(pool, "transaction", real_tx)
        async with real_tx(**kwargs) as conn:
            yield conn
            # The connection drops with the COMMIT sent, and the server never got it.
            raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr(pool, "transaction", rolled_back_in_doubt)
    before = verdict_counted()
    with pytest.raises(Unavailable) as raised:
        await runner.review(claimed)
    assert raised.value.in_doubt
    assert (await row(stack, item_id))["status"] == "reviewing"
    await runner._commit_kept()
    assert added(before) == (1, 1, 1, 1)
    assert (await actions(stack, item_id)).count("approve") == 1


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_claim_whose_commit_is_in_doubt_is_read_back_and_reviewed(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim (one statement outside a transaction block) landed and its answer was
    lost: the runner reads it back by its lease token and reviews the item in the same
    pass, with no give-back and no second claim. (PostgreSQL only: a SQLite COMMIT runs
    in this process and is never in doubt.)"""
    org, _, worker = await setup(stack)
    item_id = await submit(stack, org, worker, "write the report")
    lose_the_next_commit(monkeypatch, stack.db, alone=True)
    counts = claims_counted()
    assert await stack.lead_runner.run_once() is True
    assert (await row(stack, item_id))["status"] == "completed"
    assert await released(stack, item_id) == []
    assert (await actions(stack, item_id)).count("claim") == 1
    now = claims_counted()
    assert (now[0] - counts[0], now[1] - counts[1]) == (1, 0)  # the claim, once


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_claim_in_doubt_whose_read_back_fails_is_given_back(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim landed, its answer was lost, and the database is still away for the
    read-back: the claim's fault is raised, and the next pass gives back whatever holds
    the token, audited for what happened, and reviews it. (PostgreSQL only, as above.)"""
    org, _, worker = await setup(stack)
    item_id = await submit(stack, org, worker, "write the report")
    lose_the_next_commit(monkeypatch, stack.db, alone=True)
    monkeypatch.setattr(stack.db, "read", DownFor(stack.db.read, 1, after_commit=False))
    with pytest.raises(Unavailable) as raised:
        await stack.lead_runner.claim()
    assert raised.value.in_doubt  # the claim's own fault, not the read-back's
    assert (await row(stack, item_id))["status"] == "reviewing"  # the claim did land
    assert await drain(stack.lead_runner) == 1
    assert (await row(stack, item_id))["status"] == "completed"
    # Audited for what happened (it said "the verdict could not be stored").
    assert await released(stack, item_id) == [
        "the claim met a database fault at its commit (it landed); the review runs again"
    ]


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
@pytest.mark.parametrize("read_back", ["finds nothing", "fails"])
async def test_a_claim_in_doubt_that_lands_after_its_read_back_is_given_back_soon(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, read_back: str
) -> None:
    """The claim's answer was lost and the read-back (or, when it failed, the next
    pass's look) found nothing, and then the server applied the claim: the item is
    ``reviewing`` under a token nobody holds. The runner looks for that token again a
    second later and gives the item back, fenced by the token, instead of leaving it
    for the lease's 20 minutes. (PostgreSQL only: a SQLite COMMIT is never in doubt.)"""
    org, _, worker = await setup(stack)
    item_id = await submit(stack, org, worker, "write the report")
    runner = stack.lead_runner
    late = LandsLater(stack.db.write_alone)
    monkeypatch.setattr(stack.db, "write_alone", late)
    counts = claims_counted()
    if read_back == "fails":
        monkeypatch.setattr(stack.db, "read", DownFor(stack.db.read, 1, after_commit=False))
    with pytest.raises(Unavailable) as raised:
        await runner.claim()
    assert raised.value.in_doubt
    if read_back == "fails":
        # The next pass's look finds nothing either: the claim has not landed yet (its
        # pass would claim next; the claim on its way holds the row, and SKIP LOCKED
        # passes it by, which this stand-in does not model).
        await runner._release_held()
    assert (await row(stack, item_id))["status"] == "reviewQueued"
    await late.land()
    assert (await row(stack, item_id))["status"] == "reviewing"
    assert await runner.run_once() is False  # not looked for again yet
    due = runner.due_in_s()
    clock(stack).advance(1_000)  # a second on (LostClaims.first_ms), not 20 minutes
    assert await drain(runner) == 1
    assert (await row(stack, item_id))["status"] == "completed"
    assert due is not None and 0 < due <= 1.0  # the review loops woke for the look
    assert await released(stack, item_id) == [
        "the claim met a database fault at its commit (it landed); the review runs again"
    ]
    assert (await actions(stack, item_id)).count("claim") == 2
    # Both claims landed, and the give-back, each counted once: the lost claim is
    # counted when its look finds it (it was not: the give-back was counted alone).
    now = claims_counted()
    assert (now[0] - counts[0], now[1] - counts[1]) == (2, 1)


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
@pytest.mark.parametrize("then", ["lands", "never lands"])
async def test_a_claim_that_failed_not_in_doubt_is_looked_for_once_at_the_next_pass(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """The claim failed with an error that is no fault in doubt (it says nothing was
    stored), and the server applied it all the same: the item is ``reviewing`` under a
    token nobody holds. The next pass looks for that token once (at once: the review
    loops wake for it), gives the item back, fenced by the token, and reviews it, rather
    than leaving it for the lease's 20 minutes. A claim that did not land is looked for
    that once and then no more. (PostgreSQL: the claim is one statement of its own.)

    The give-back is audited for what happened: it said "the claim met a database fault
    at its commit (it landed)", the words of a claim in doubt, which this was not."""
    org, _, worker = await setup(stack)
    item_id = await submit(stack, org, worker, "write the report")
    runner = stack.lead_runner
    late = LandsLater(stack.db.write_alone, fault=lambda: RuntimeError("answer unreadable"))
    monkeypatch.setattr(stack.db, "write_alone", late)
    counts = claims_counted()
    with pytest.raises(RuntimeError):
        await runner.claim()
    assert runner.due_in_s() == 0.0  # the look is due now
    if then == "never lands":
        late.held = None
        await runner._release_held()  # the one look: nothing found
        assert runner.due_in_s() is None  # and no other look to come
        assert (await row(stack, item_id))["status"] == "reviewQueued"
        assert claims_counted() == counts  # nothing landed, nothing counted
        return
    await late.land()
    assert (await row(stack, item_id))["status"] == "reviewing"
    assert await drain(runner) == 1
    assert (await row(stack, item_id))["status"] == "completed"
    assert await released(stack, item_id) == [
        "the claim met an error and landed all the same; the review runs again"
    ]
    assert (await actions(stack, item_id)).count("claim") == 2
    now = claims_counted()
    assert (now[0] - counts[0], now[1] - counts[1]) == (2, 1)  # as committed


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_the_watch_of_a_claim_in_doubt_never_releases_another_runners_claim(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim in doubt that never lands: another runner claims the item meanwhile. The
    watch looks for its own token only (the give-back is fenced by it), so the other
    runner's claim stands through every look, and the watch ends when the lost claim's
    lease would have lapsed."""
    org, _, worker = await setup(stack)
    item_id = await submit(stack, org, worker, "write the report")
    runner = stack.lead_runner
    monkeypatch.setattr(stack.db, "write_alone", LandsLater(stack.db.write_alone))
    started = clock(stack).now_ms()
    with pytest.raises(Unavailable):
        await runner.claim()
    other = LeadRunner(stack.db, stack.clock, stack.ids, stack.providers, stack.outbox)
    held = await other.claim()
    assert held is not None and held.id == item_id
    looks = 0
    # (This runner made no lease check: what it is due for is its looks alone.)
    while (due := runner.due_in_s()) is not None and looks < 100:
        clock(stack).advance(max(1, round(due * 1000)))
        await runner._release_held()  # the looks alone: no lease check, no claim
        looks += 1
        assert (await row(stack, item_id))["lease_token"] == held.lease_token
    assert 20 < looks < 40  # 1, 2, 4 ... 32 s, then a minute apart
    assert clock(stack).now_ms() <= started + 20 * MINUTE_MS  # ended with the lease
    assert await released(stack, item_id) == []
    await other.review(held)
    assert (await row(stack, item_id))["status"] == "completed"


async def test_an_approval_whose_commit_is_uncertain_posts_once(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    org, _, worker = await setup(stack)
    item_id = await submit_slack(stack, org, worker, "6.1")
    claimed = await stack.lead_runner.claim()
    assert claimed is not None
    # On SQLite (which never loses a COMMIT's answer) this runs the same handler of a
    # verdict whose commit failed in doubt, for the verdict's transaction: it does not
    # depend on the backend.
    lose_the_next_commit(monkeypatch, stack.db, alone=stack.db.statements_alone, sqlite_too=True)
    with pytest.raises(Unavailable) as raised:
        await stack.lead_runner.review(claimed)
    assert raised.value.in_doubt
    # The approval did land: giving the item back to the queue finds it approved.
    await drain(stack.lead_runner)
    assert (await row(stack, item_id))["status"] == "approved"
    assert len(await deliveries(stack, item_id)) == 1
    assert (await actions(stack, item_id)).count("approve") == 1
    assert "leaseReleased" not in await actions(stack, item_id)


def handing_off(url: str, channel: ScriptedChannel) -> tuple[Stack, Relay]:
    """A stack whose approvals hand their posts to its relay, as the service's are (told
    of hand-offs committed and in doubt); ``stack.outbox.attach(None)`` undoes it."""
    stack = build_stack(url, channels={channel.name: channel})
    relay = stack.relay
    stack.db.on_commit_payloads(HANDOFF_TOPIC, relay.accept)
    stack.db.on_doubt_payloads(HANDOFF_TOPIC, relay.in_doubt)
    stack.outbox.attach(relay)
    return stack, relay


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_post_claimed_for_this_relay_by_an_approval_that_lands_late_is_posted_soon(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As below, but the server applies the approval only after the relay's give-back
    found nothing: the post is ``sending`` under the hand-off lease with nothing to send
    it. The give-back is tried again a second later and the post goes out once; it sat
    there for the 2-minute send lease and then went to an operator as an uncertain send.
    (PostgreSQL only: a SQLite commit is never in doubt.)"""
    channel = ScriptedChannel("slack")
    stack, relay = handing_off(migrated_url, channel)
    try:
        org, _, worker = await setup(stack)
        item_id = await submit_slack(stack, org, worker, "6.3")
        claimed = await stack.lead_runner.claim()
        assert claimed is not None
        late = LandsLater(stack.db.write_alone)
        monkeypatch.setattr(stack.db, "write_alone", late)
        with pytest.raises(Unavailable) as raised:
            await stack.lead_runner.review(claimed)
        assert raised.value.in_doubt
        assert await drain(relay) == 0  # the give-back finds nothing: not landed yet
        await late.land()
        [post] = await deliveries(stack, item_id)
        assert (post["status"], post["lease_token"]) == ("sending", relay.handoff_token)
        due = relay.due_in_s()
        clock(stack).advance(1_000)  # a second on, not the send lease's 2 minutes
        await drain(relay)
        assert channel.texts() == ["Echo: task 6.3 #complete"]
        [post] = await deliveries(stack, item_id)
        assert (post["status"], post["attempts"]) == ("sent", 1)
        assert (await row(stack, item_id))["status"] == "completed"
        assert due is not None and due <= 1.0  # the relay's loop woke for the try
    finally:
        stack.outbox.attach(None)
        await stack.stop()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
@pytest.mark.parametrize("path", ["statement", "transaction"])
async def test_a_post_claimed_for_this_relay_by_an_uncertain_approval_is_posted_once(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """The approval wrote its post already claimed for this process's relay, and its
    commit reached the database but the answer did not: the post was never handed over.
    The relay is told (Database.on_doubt_payloads) and gives the post back to the
    queue at its next pass, so it goes out once, now, instead of sitting ``sending``
    until its lease expires and then waiting for an operator as an uncertain send."""
    channel = ScriptedChannel("slack")
    stack, relay = handing_off(migrated_url, channel)
    try:
        org, _, worker = await setup(stack)
        item_id = await submit_slack(stack, org, worker, "6.2")
        claimed = await stack.lead_runner.claim()
        assert claimed is not None
        # The approval commits; the connection drops before the answer arrives. (A
        # SQLite commit is local: never in doubt this way.)
        pool = stack.db._pg
        assert pool is not None
        if path == "statement":
            real = pool.execute_alone

            async def statement_then_drop(*args: Any, **kwargs: Any) -> Any:
                await real(*args, **kwargs)
                monkeypatch.setattr(pool, "execute_alone", real)
                raise ConnectionResetError("connection reset by peer")

            monkeypatch.setattr(pool, "execute_alone", statement_then_drop)
        else:

            async def by_transaction(*args: Any, **kwargs: Any) -> bool:
                return False

            monkeypatch.setattr(runner_module, "approve_alone", by_transaction)
            real_tx = pool.transaction

            @contextlib.asynccontextmanager
            async def commit_then_drop(**kwargs: Any) -> AsyncIterator[Any]:
                async with real_tx(**kwargs) as conn:
                    yield conn
                monkeypatch.setattr(pool, "transaction", real_tx)
                raise ConnectionResetError("connection reset by peer")

            monkeypatch.setattr(pool, "transaction", commit_then_drop)
        before = approval_counted()
        with pytest.raises(Unavailable):
            await stack.lead_runner.review(claimed)
        [post] = await deliveries(stack, item_id)
        assert (post["status"], post["lease_token"]) == ("sending", relay.handoff_token)
        assert relay.take_handed() == []  # never handed over
        assert approval_counted() == before  # in doubt: nothing counted
        await drain(relay)
        assert channel.texts() == ["Echo: task 6.2 #complete"]
        [post] = await deliveries(stack, item_id)
        assert (post["status"], post["attempts"]) == ("sent", 1)
        assert (await row(stack, item_id))["status"] == "completed"
        # The post given back shows the approval landed: what it counts is counted
        # then (it was not), and the lead runner's look for the kept verdict, which
        # finds it too, counts nothing more.
        assert added_to(before, approval_counted()) == (1, 1)
        await stack.lead_runner._commit_kept()
        assert stack.lead_runner._verdicts == []
        assert added_to(before, approval_counted()) == (1, 1)
    finally:
        stack.outbox.attach(None)
        await stack.stop()


# ------------------------------------------------------------ passes that find nothing


async def test_a_poked_runner_skips_the_claim_while_its_queue_is_known_empty(
    stack: Stack,
) -> None:
    """Told of every submission (``poked_on_enqueue``, as the service wires it), a pass
    after the claim that emptied the queue runs no statement at all; a poke, or a second
    by the clock, makes the next pass claim again."""
    runner = stack.lead_runner
    runner.poked_on_enqueue = True
    stack.turns.on_review_queued = runner.poke
    org, _, worker = await setup(stack)
    first = await submit(stack, org, worker, "first", session="a")
    assert await drain(runner) == 1
    assert (await row(stack, first))["status"] == "completed"
    with stack.db.record_statements() as idle:
        assert await runner.run_once() is False
    assert idle == []
    # A submission pokes the runner: the next pass claims and reviews it.
    second = await submit(stack, org, worker, "second", session="b")
    assert await drain(runner) == 1
    assert (await row(stack, second))["status"] == "completed"
    # Queued behind the runner's back (another replica, no NOTIFY on SQLite): picked up
    # once a second has passed since the empty claim, not before.
    stack.turns.on_review_queued = lambda: None
    third = await submit(stack, org, worker, "third", session="c")
    assert await runner.run_once() is False
    assert (await row(stack, third))["status"] == "reviewQueued"
    clock(stack).advance(1_000)
    assert await drain(runner) == 1
    assert (await row(stack, third))["status"] == "completed"


async def test_one_submission_wakes_every_review_loop_but_one_claims(stack: Stack) -> None:
    """The service runs several review loops on one wake event: a submission wakes all
    of them, and only as many claims run as there were pokes since the queue was last
    seen empty; the other loops run no statement. Two submissions: two claims."""
    runner = stack.lead_runner
    runner.poked_on_enqueue = True
    stack.turns.on_review_queued = runner.poke
    org, _, worker = await setup(stack)
    assert await runner.run_once() is False  # an empty claim: the queue is known empty
    for wave, sessions in enumerate((["a"], ["b", "c"])):
        for session in sessions:
            await submit(stack, org, worker, f"task {session}", session=session)
        with stack.db.record_statements() as statements:
            results = await asyncio.gather(*(runner.run_once() for _ in range(4)))
        claims = [s for s in statements if "ORDER BY work_items.updated_at, work_items.id" in s]
        assert len(claims) == len(sessions), (wave, claims)
        assert results.count(True) == len(sessions)
    assert await runner.run_once() is False


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_poke_during_an_empty_claim_is_answered_once(stack: Stack) -> None:
    """PostgreSQL: a submission commits (and pokes) while a claim is under way that read
    the queue before it (the claim is one statement: it reports the queue when it
    returns). The loop that poke woke claims and reviews the item; the older claim then
    comes back empty, and what it saw, older than what the newer claim saw, changes
    nothing: no wake-up, and the next pass knows the queue empty and runs no statement."""
    import contextvars

    runner = stack.lead_runner
    runner.poked_on_enqueue = True
    stack.turns.on_review_queued = runner.poke
    wakes: list[int] = []
    runner.wake = lambda: wakes.append(1)
    org, _, worker = await setup(stack)
    assert await runner.run_once() is False  # the queue is known empty
    assert wakes == []
    clock(stack).advance(1_000)  # the recheck second: the next pass claims unpoked
    real_alone, late = stack.db.write_alone, []

    async def claim_then_submit(*args: Any, **kwargs: Any) -> Any:
        # The claim read an empty queue; before it returns, the item commits and pokes.
        result = await real_alone(*args, **kwargs)
        stack.db.write_alone = real_alone  # type: ignore[method-assign]
        late.append(
            await asyncio.create_task(
                submit(stack, org, worker, "late", session="late"),
                context=contextvars.Context(),
            )
        )
        # Woken by that poke, another loop claims and reviews it.
        assert await runner.run_once() is True
        return result

    stack.db.write_alone = claim_then_submit  # type: ignore[method-assign]
    assert await runner.run_once() is False  # the older claim came back empty
    assert (await row(stack, late[0]))["status"] == "completed"
    assert wakes == []
    with stack.db.record_statements() as idle:
        assert await runner.run_once() is False
    assert idle == []


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_claim_beside_another_takes_the_next_item(stack: Stack) -> None:
    """PostgreSQL: two items queued, a second claim runs while the first one's
    transaction is still open. It takes the second item: the first claim locked only the
    row it took, not the one it peeked at to learn that more were waiting (which would
    make the second claim skip it and take the queue for empty)."""
    import contextvars

    runner = stack.lead_runner
    org, _, worker = await setup(stack)
    for session in ("a", "b"):
        await submit(stack, org, worker, f"task {session}", session=session)
    # The first claim's statement, in a transaction held open: it has taken the
    # oldest item and peeked at the other, and its COMMIT is still due.
    async with stack.db.tx() as conn:
        params = {
            "p_now": stack.clock.now_ms(),
            "p_token": "lease_first",
            "p_expires": stack.clock.now_ms() + 60_000,
            "p_owner": None,
            "p_audit_id": "aud_first",
        }
        first = (await conn.execute(runner_module._CLAIM_ALONE, params)).first()
        beside = await asyncio.create_task(runner.claim(), context=contextvars.Context())
    assert first is not None and first.more
    assert beside is not None
    assert beside.id != first.id


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_claim_that_skips_a_locked_queued_item_claims_it_again_soon(
    stack: Stack,
) -> None:
    """PostgreSQL: the one queued item is row-locked by another transaction (here held
    open by the test; in the service a lease expiry that lost its race for the item to a
    give-back keeps its lock until its commit, and no wake-up follows that commit). A
    claim beside it takes nothing but does not take the queue for empty: the next pass
    claims rather than skipping, and the loops sleep at most LOCKED_RECHECK_MS, not the
    poll. Once the lock is gone that pass reviews the item; then an empty claim leaves
    nothing to look at again."""
    runner = stack.lead_runner
    runner.poked_on_enqueue = True
    stack.turns.on_review_queued = runner.poke
    org, _, worker = await setup(stack)
    item_id = await submit(stack, org, worker, "task")
    async with held_open(stack.db, item_locked(item_id)):
        assert await runner.run_once() is False
        assert (await row(stack, item_id))["status"] == "reviewQueued"
        assert runner.due_in_s() == LOCKED_RECHECK_MS / 1000
    assert await runner.run_once() is True  # no poke since: the pass claims all the same
    assert (await row(stack, item_id))["status"] == "completed"
    assert await runner.run_once() is False
    assert runner.due_in_s() is None


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_lease_check_skips_a_lease_another_check_is_taking_back(stack: Stack) -> None:
    """PostgreSQL: two replicas' lease checks find one lapsed review lease at once. The
    second does not wait on the row the first is moving (waiting, it would find the item
    queued, move nothing and keep the row lock to its commit, hiding the item from
    claims); it moves nothing and returns at once, and the first takes it back."""
    runner = stack.lead_runner
    org, _, worker = await setup(stack)
    item_id = await submit(stack, org, worker, "task")
    assert await runner.claim() is not None
    clock(stack).advance(runner_module.LEASE_MS + 1)
    async with held_open(stack.db, item_locked(item_id)):
        assert await asyncio.wait_for(runner.expire_leases(), 5) == 0
    assert (await row(stack, item_id))["status"] == "reviewing"
    assert await runner.expire_leases() == 1
    assert (await row(stack, item_id))["status"] == "reviewQueued"


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_claim_whose_clock_read_precedes_the_submission_is_audited_after_it(
    stack: Stack,
) -> None:
    """PostgreSQL: a claim reads its clock, then waits for a pooled connection; an item's
    submission commits during the wait, with a later time. The claim takes that item;
    its audit row (and the item's ``updated_at``) carry the submission's time, not the
    older one, so the trail read in time order still begins with ``create`` (the long
    crash suite once saw ``claim`` 1 ms before ``create``)."""
    runner = stack.lead_runner
    org, _, worker = await setup(stack)
    before = stack.clock.now_ms()  # the claim's clock read...
    clock(stack).advance(5)
    item_id = await submit(stack, org, worker, "task")  # ...the submission commits
    submitted = (await row(stack, item_id))["updated_at"]
    assert submitted == before + 5
    claimed = await runner._claim_alone(before, "lease_late", runner._pokes)
    assert claimed is not None and claimed.id == item_id
    assert claimed.updated_at == submitted
    trail = [(a["action"], a["created_at"]) for a in await audit(stack, item_id)]
    moves = [action for action, _ in trail if action in ("create", "claim")]
    assert moves == ["create", "claim"], trail
    assert dict(trail)["claim"] == submitted


async def test_run_once_checks_review_leases_once_a_second(stack: Stack) -> None:
    """Expired leases are looked for at most every EXPIRY_CHECK_MS by the runner's clock
    (a read, and a write transaction only when something expired)."""
    from leadgate.review.runner import EXPIRY_CHECK_MS

    runner = stack.lead_runner
    org, _, worker = await setup(stack)
    await runner.run_once()  # the first pass checks
    item_id = await submit(stack, org, worker, "held")
    other = LeadRunner(stack.db, stack.clock, stack.ids, stack.providers, stack.outbox)
    assert await other.claim() is not None  # held by a runner that never reviews it
    clock(stack).advance(20 * MINUTE_MS + 1)  # its lease is over...
    with stack.db.record_statements() as statements:
        assert await runner.run_once() is True  # ...the check is due: taken back, reviewed
    assert (await row(stack, item_id))["status"] == "completed"
    assert any("lease_expiries" in s for s in statements)
    # Within the next second no pass looks again (the check's read: runner._LEASE_CHECK).
    with stack.db.record_statements() as statements:
        await runner.run_once()
    assert not any("next_lapse" in s for s in statements)
    clock(stack).advance(EXPIRY_CHECK_MS)
    with stack.db.record_statements() as statements:
        await runner.run_once()
    assert any("next_lapse" in s for s in statements)


async def test_the_runner_knows_when_the_earliest_review_lease_lapses(stack: Stack) -> None:
    """The lease check's read also learns when the earliest review lease (any runner's)
    lapses: the review loops sleep no longer than ``due_in_s``, so a stalled holder's
    lease is taken back when it lapses, not at the next poll."""
    from leadgate.review.runner import EXPIRY_CHECK_MS, LEASE_MS

    runner = stack.lead_runner
    org, _, worker = await setup(stack)
    await runner.run_once()
    assert runner.due_in_s() is None  # no lease held: the poll alone
    item_id = await submit(stack, org, worker, "held")
    other = LeadRunner(stack.db, stack.clock, stack.ids, stack.providers, stack.outbox)
    assert await other.claim() is not None  # held by a runner that never reviews it
    clock(stack).advance(EXPIRY_CHECK_MS)
    assert not await runner.run_once()  # its check reads the other runner's lease
    assert runner.due_in_s() == (LEASE_MS - EXPIRY_CHECK_MS + 1) / 1000
    clock(stack).advance(LEASE_MS - EXPIRY_CHECK_MS)
    assert runner.due_in_s() == 0.001  # exactly 20 minutes: still held
    clock(stack).advance(1)
    assert runner.due_in_s() == 0
    assert await runner.run_once()  # taken back and reviewed
    assert (await row(stack, item_id))["status"] == "completed"
    # The check saw the lease it took back: the next one (not before a second, as ever)
    # finds none left.
    assert runner.due_in_s() == EXPIRY_CHECK_MS / 1000
    clock(stack).advance(EXPIRY_CHECK_MS)
    assert not await runner.run_once()
    assert runner.due_in_s() is None
