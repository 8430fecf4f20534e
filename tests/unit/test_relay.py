"""The outbox relay against a scripted fake channel, on SQLite and on PostgreSQL.

Covers every row of SPEC 6's delivery table (through the real turn path and lead
runner), the four outcome classes, backoff, bounded attempts, send-lease expiry,
message splitting, idempotency keys, operator recovery at the store level, the batched
pipeline and the in-process wake-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from binding.bindings import deactivate_session
from bots import teams_review
from leadgate.app import App
from leadgate.core.clock import FakeClock
from leadgate.core.config import Settings
from leadgate.core.errors import TransitionError, Unavailable
from leadgate.core.metrics import METRICS
from leadgate.core.runners import LOCKED_RECHECK_MS, drain
from leadgate.core.types import BindingKind, BindingSpec, Gated, Reply, Trigger
from leadgate.database import schema as t
from leadgate.database.db import Conn
from leadgate.domain import session_events, workitems
from leadgate.domain.rows import Delivery
from leadgate.review import decisions, queue
from outbox import outcomes as outcomes_mod
from outbox import relay as relay_mod
from outbox import store as store_mod
from outbox.channel import OutboundMessage, Permanent, Retry, SendOutcome, Sent, Uncertain
from outbox.outcomes import Done
from outbox.relay import (
    Relay,
    part_key,
    split_spans,
    split_text,
)
from outbox.store import (
    HANDOFF_TOPIC,
    OUTBOX_TOPIC,
    SEND_DEADLINE_S,
    SEND_LEASE_MS,
    DeliveryStatus,
    ended_meanwhile,
    for_item,
    recover,
)
from tests.fakes import LandsLater, lose_the_next_commit
from tests.helpers import (
    Env,
    Org,
    blocked_on_a_lock,
    deliveries_counted,
    eventually,
    held_open,
    item_row,
    make_agent,
    make_org,
    transitions_counted,
)
from tests.outbox_support import (
    MigratedTemplates,
    ScriptedChannel,
    binding_row,
    delivery_counts,
    seed_items,
)
from tests.stack import Stack, build_stack

SLACK_ADDRESS = {"team": "T1", "channel": "C1", "thread_ts": "1700000000.000100"}

# ------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def templates(tmp_path_factory: pytest.TempPathFactory) -> MigratedTemplates:
    return MigratedTemplates(tmp_path_factory.mktemp("outbox-templates"))


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, templates: MigratedTemplates, tmp_path: Path) -> Any:
    if request.param == "sqlite":
        yield templates.sqlite_url(tmp_path / "t.db")
        return
    yield templates.pg_url(request.getfixturevalue("postgres_server"))


@pytest.fixture
def channel() -> ScriptedChannel:
    return ScriptedChannel("slack")


@pytest.fixture
async def app(url: str, channel: ScriptedChannel) -> AsyncIterator[App]:
    """The composition root on ``url`` (runner loops poll every 30 s)."""
    settings = Settings.model_validate(
        {"database": {"url": url}, "runners": {"poll_interval_s": 30}}
    )
    app = App(settings, clock=FakeClock(), channels={"slack": channel}, enable_adapters=False)
    yield app
    await app.stop()


@pytest.fixture
async def stack(url: str, channel: ScriptedChannel) -> AsyncIterator[Stack]:
    stack = build_stack(url, channels={"slack": channel})
    yield stack
    await stack.stop()


def relay_for(stack: Stack, **kwargs: Any) -> Relay:
    kwargs.setdefault("rand", lambda: 0.0)
    return Relay(stack.db, stack.clock, stack.ids, stack.channels, **kwargs)


def fake_clock(stack: Stack) -> FakeClock:
    assert isinstance(stack.clock, FakeClock)
    return stack.clock


async def delivery(stack: Stack, delivery_id: str) -> dict[str, Any]:
    async with stack.db.read() as conn:
        row = (
            await conn.execute(sa.select(t.deliveries).where(t.deliveries.c.id == delivery_id))
        ).first()
    assert row is not None
    return dict(row._mapping)


async def item(stack: Env, item_id: str) -> dict[str, Any]:
    return await item_row(stack, item_id)


async def audit_actions(stack: Stack, item_id: str) -> list[str]:
    async with stack.db.read() as conn:
        rows = (
            await conn.execute(
                sa.select(t.audit.c.action)
                .where(t.audit.c.work_item_id == item_id)
                .order_by(t.audit.c.created_at, t.audit.c.id)
            )
        ).all()
    return [r.action for r in rows]


async def actionable_ids(stack: Stack, org_id: str) -> list[str]:
    async with stack.db.read() as conn:
        page = await queue.actionable(conn, org_id)
    return [i["id"] for i in page["items"]]


async def seed_one(stack: Stack, **kwargs: Any) -> tuple[str, dict[str, Any]]:
    """One approved item with its pending gating delivery: (item id, delivery row)."""
    seeded = await seed_items(stack.db, stack.clock, stack.ids, 1, **kwargs)
    return seeded.items[0]["id"], seeded.deliveries[0]


# ------------------------------------------------- SPEC 6 table, through the real path


async def gated_item(
    stack: Stack, org: Org, binding: BindingSpec, text: str = "write it #complete"
) -> str:
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")
    out = await stack.turns.run(
        Trigger(org_id=org.id, agent_id=worker["id"], session_key="s1", text=text, binding=binding)
    )
    assert isinstance(out, Gated)
    return str(out.work_item_id)


async def test_api_binding_reveals_in_the_approval_transaction_without_a_channel_call(
    stack: Stack, channel: ScriptedChannel
) -> None:
    org = await make_org(stack)
    item_id = await gated_item(stack, org, BindingSpec(BindingKind.api))
    async with stack.db.read() as conn:
        row = await item(stack, item_id)
        gated = await conn.scalar(
            sa.select(t.messages.c.lead_gated).where(t.messages.c.id == row["gated_message_id"])
        )
    assert row["status"] == "reviewQueued" and gated is True
    await drain(stack.lead_runner)
    row = await item(stack, item_id)
    async with stack.db.read() as conn:
        gated = await conn.scalar(
            sa.select(t.messages.c.lead_gated).where(t.messages.c.id == row["gated_message_id"])
        )
        (dlv,) = [d._asdict() for d in await for_item(conn, item_id)]
    assert gated is False
    assert row["status"] == "completed"
    assert (dlv["action"], dlv["status"], dlv["attempts"]) == ("reveal", "sent", 1)
    assert "delivered" in await audit_actions(stack, item_id)
    assert await drain(stack.relay) == 0
    assert channel.calls == []


async def test_an_internal_delivery_left_pending_is_still_done_by_the_relay(
    stack: Stack, channel: ScriptedChannel
) -> None:
    """Rows an older version wrote ``pending`` (reveal, silent, scheduled) before an
    upgrade are done by the relay as before: no channel call, item completed."""
    seeded = await seed_items(stack.db, stack.clock, stack.ids, 3, kind=BindingKind.api)
    async with stack.db.tx() as conn:
        for action, d in zip(("reveal", "silent", "scheduled"), seeded.deliveries, strict=True):
            await conn.execute(
                t.deliveries.update().where(t.deliveries.c.id == d["id"]).values(action=action)
            )
    assert await drain(stack.relay) >= 1
    assert channel.calls == []
    for seeded_item in seeded.items:
        assert (await item(stack, seeded_item["id"]))["status"] == "completed"
    async with stack.db.read() as conn:
        for d in seeded.deliveries:
            [row] = [r._asdict() for r in await for_item(conn, d["work_item_id"])]
            assert row["status"] == "sent"


async def test_channel_binding_posts_the_snapshot_into_the_thread(
    stack: Stack, channel: ScriptedChannel
) -> None:
    org = await make_org(stack)
    item_id = await gated_item(stack, org, BindingSpec(BindingKind.slack, address=SLACK_ADDRESS))
    await drain(stack.lead_runner)
    await drain(stack.relay)
    assert [(m.text, m.address, m.kind) for m in channel.calls] == [
        ("Echo: write it #complete", SLACK_ADDRESS, "gating")
    ]
    async with stack.db.read() as conn:
        (dlv,) = [d._asdict() for d in await for_item(conn, item_id)]
    assert (dlv["status"], dlv["external_id"], dlv["attempts"]) == ("sent", "ext-1", 1)
    assert channel.calls[0].idempotency_key == dlv["id"]
    assert (await item(stack, item_id))["status"] == "completed"


async def test_empty_snapshot_posts_the_summary(stack: Stack, channel: ScriptedChannel) -> None:
    org = await make_org(stack)
    binding = BindingSpec(BindingKind.slack, address=SLACK_ADDRESS)
    item_id = await gated_item(stack, org, binding, text="#escalate do it #complete")
    await drain(stack.lead_runner)
    async with stack.db.tx() as conn:
        await conn.execute(
            t.work_items.update().where(t.work_items.c.id == item_id).values(snapshot="")
        )
        row = await workitems.get(conn, item_id)
        assert row.status == "awaitingHuman"
        await decisions.human_approve(conn, stack.outbox, row, "user:test")
    await drain(stack.relay)
    assert channel.texts() == ["Summary: #escalate do it"]
    assert (await item(stack, item_id))["status"] == "completed"


@pytest.mark.parametrize(
    ("binding", "action"),
    [
        (BindingSpec(BindingKind.slack, address=SLACK_ADDRESS, silent=True), "silent"),
        (BindingSpec(BindingKind.scheduled), "scheduled"),
    ],
    ids=["silent", "scheduled"],
)
async def test_silent_and_scheduled_post_nothing_and_complete(
    stack: Stack, channel: ScriptedChannel, binding: BindingSpec, action: str
) -> None:
    org = await make_org(stack)
    item_id = await gated_item(stack, org, binding)
    await drain(stack.lead_runner)
    # Done by the approval's own transaction (SPEC 6): nothing is left for the relay.
    async with stack.db.read() as conn:
        (dlv,) = [d._asdict() for d in await for_item(conn, item_id)]
    assert (dlv["action"], dlv["status"], dlv["attempts"]) == (action, "sent", 1)
    assert (await item(stack, item_id))["status"] == "completed"
    assert (await audit_actions(stack, item_id))[-2:] == ["approve", "delivered"]
    assert await drain(stack.relay) == 0
    assert channel.calls == []


async def test_flow_continuation_is_never_picked_up(stack: Stack, channel: ScriptedChannel) -> None:
    org = await make_org(stack)
    item_id = await gated_item(stack, org, BindingSpec(BindingKind.flow))
    await drain(stack.lead_runner)
    assert await stack.relay.run_once() is False
    fake_clock(stack).advance(SEND_LEASE_MS * 10)
    await drain(stack.relay)
    async with stack.db.read() as conn:
        (dlv,) = [d._asdict() for d in await for_item(conn, item_id)]
    assert (dlv["action"], dlv["status"], dlv["attempts"]) == ("continuation", "continuation", 0)
    assert channel.calls == []
    assert (await item(stack, item_id))["status"] == "approved"


async def test_no_active_binding_fails_delivery_and_item(
    stack: Stack, channel: ScriptedChannel
) -> None:
    org = await make_org(stack)
    binding = BindingSpec(BindingKind.slack, address=SLACK_ADDRESS)
    item_id = await gated_item(stack, org, binding, text="#escalate do it #complete")
    await drain(stack.lead_runner)
    async with stack.db.tx() as conn:
        row = await workitems.get(conn, item_id)
        await deactivate_session(conn, row.session_id)
        await decisions.human_approve(conn, stack.outbox, row, "user:test")
    await drain(stack.relay)
    async with stack.db.read() as conn:
        (dlv,) = [d._asdict() for d in await for_item(conn, item_id)]
    assert dlv["status"] == "failed" and "no active binding" in dlv["error"]
    assert (await item(stack, item_id))["status"] == "failed"
    assert channel.calls == []
    assert "deliveryFailed" in await audit_actions(stack, item_id)


async def test_plain_channel_reply_rides_the_outbox(stack: Stack, channel: ScriptedChannel) -> None:
    org = await make_org(stack)
    agent = await make_agent(stack, org, "plain")
    out = await stack.turns.run(
        Trigger(
            org_id=org.id,
            agent_id=agent["id"],
            session_key="s1",
            text="hello",
            binding=BindingSpec(BindingKind.slack, address=SLACK_ADDRESS),
        )
    )
    assert out == Reply("Echo: hello")
    await drain(stack.relay)
    assert [(m.text, m.kind) for m in channel.calls] == [("Echo: hello", "reply")]


async def test_a_reply_of_whitespace_only_is_no_post(
    stack: Stack, channel: ScriptedChannel
) -> None:
    """A reply that is only blanks says nothing: it is not posted (Discord refuses it for
    good, 400 50006, and Slack answers no_text), and its delivery ends sent, as an empty
    one's does."""
    async with stack.db.tx() as conn:
        queued = await stack.outbox.enqueue_reply(
            conn, org_id="org_x", binding=binding_row("bnd_x"), text=" \n\t "
        )
    assert queued is not None
    await drain(stack.relay)
    assert channel.calls == []
    async with stack.db.read() as conn:
        status = await conn.scalar(
            sa.select(t.deliveries.c.status).where(t.deliveries.c.id == queued.id)
        )
    assert status == DeliveryStatus.sent.value


# -------------------------------------------------------------------- outcome classes


async def test_success_commits_delivery_and_item_in_one_transaction(
    stack: Stack, channel: ScriptedChannel
) -> None:
    item_id, dlv = await seed_one(stack)
    relay = relay_for(stack)

    async def broken(*args: Any, **kwargs: Any) -> list[str]:
        raise Unavailable("database went away mid-commit")

    # The item's move fails: the delivery's move to sent is rolled back with it. (On
    # PostgreSQL the posts' outcomes are one statement: it fails after its moves.)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(workitems, "transition_many", broken)
        failing = outcomes_mod._COMMIT_POSTS.text.replace(
            " AS ev_notified", " AS ev_notified, (SELECT 1 / (count(*) - count(*)) FROM moved) AS b"
        )
        assert failing != outcomes_mod._COMMIT_POSTS.text
        mp.setattr(outcomes_mod, "_COMMIT_POSTS", sa.text(failing))
        # (the division by zero stands for a database fault: an error of the statement
        # itself is met again at every try, and is recorded deliveryUnknown instead)
        mp.setattr(relay_mod, "DATABASE_FAULTS", (Unavailable, sa.exc.DBAPIError))
        mp.setattr(relay_mod, "COMMIT_RETRY_DELAYS_S", (0.0,))
        counts = (deliveries_counted("slack", "sent"), transitions_counted("approved", "completed"))
        await relay.run_once()
        assert (await delivery(stack, dlv["id"]))["status"] == "sending"
        assert (await item(stack, item_id))["status"] == "approved"
    # The row is still leased: nothing is claimed (and nothing posted) a second time; the
    # outcome the relay kept is committed at its next run, within the send lease.
    assert await relay.run_once() is True
    assert len(channel.calls) == 1
    assert (await delivery(stack, dlv["id"]))["status"] == "sent"
    assert (await item(stack, item_id))["status"] == "completed"
    assert await relay.run_once() is False
    # Counted once, as it committed: not also by the attempts that rolled back (SQLite's
    # outcome transaction counted inside itself, three times here).
    now = (deliveries_counted("slack", "sent"), transitions_counted("approved", "completed"))
    assert (now[0] - counts[0], now[1] - counts[1]) == (1, 1)


async def test_an_uncertain_send_whose_commit_failed_is_counted_once_when_it_commits(
    stack: Stack, channel: ScriptedChannel
) -> None:
    """An outcome committed one by one (here uncertain) whose transaction fails is kept
    and committed at the next run: ``deliveryUnknown`` is counted then, once, not by each
    transaction that rolled back (on both backends it is a transaction)."""
    item_id, dlv = await seed_one(stack)
    channel.script = [Uncertain("read timeout after the request was written")]
    relay = relay_for(stack)

    async def broken(*args: Any, **kwargs: Any) -> None:
        raise Unavailable("database went away mid-commit")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(workitems, "audit", broken)  # after the delivery's fenced update
        mp.setattr(relay_mod, "COMMIT_RETRY_DELAYS_S", (0.0,))
        unknown = deliveries_counted("slack", "deliveryUnknown")
        await relay.run_once()
        assert (await delivery(stack, dlv["id"]))["status"] == "sending"
        assert deliveries_counted("slack", "deliveryUnknown") == unknown
    assert await relay.run_once() is True
    assert (await delivery(stack, dlv["id"]))["status"] == "deliveryUnknown"
    assert (await item(stack, item_id))["status"] == "approved"
    assert deliveries_counted("slack", "deliveryUnknown") - unknown == 1


async def test_outcomes_no_database_takes_as_sent_are_stored_made_storable(
    stack: Stack, channel: ScriptedChannel
) -> None:
    """What a channel's answer puts into an outcome is made storable where outcomes are
    committed: a NUL (PostgreSQL's text refuses it), a lone surrogate (no UTF-8 for
    it), a page of error text, a message id over its column's 200 characters. Before,
    the group's commit failed on every pass and the relay kept it, claiming nothing more
    and taking back no lapsed lease: every other outcome of the group waited too."""
    seeded = await seed_items(stack.db, stack.clock, stack.ids, 5)
    ids = [str(d["id"]) for d in seeded.deliveries]
    answers: dict[str, SendOutcome] = {
        ids[0]: Retry("HTTP 429\x00", 1.0, said="slow down\x00 \ud800 please"),
        ids[1]: Permanent("HTTP 400", said="x" * 100_000),
        ids[2]: Sent("y" * 201),
        ids[3]: Sent("ts\x00 1"),
        ids[4]: Sent("1700000001.000100"),
    }

    def answer(message: OutboundMessage) -> SendOutcome:
        return answers[message.delivery_id]

    channel.script = [answer] * len(ids)
    relay = relay_for(stack)
    await drain(relay)
    rows = [await delivery(stack, i) for i in ids]
    assert [r["status"] for r in rows] == ["pending", "failed", "sent", "sent", "sent"]
    assert rows[0]["error"] == "HTTP 429\ufffd: slow down\ufffd ? please"
    assert rows[1]["error"] == "HTTP 400: " + "x" * (outcomes_mod.ERROR_CHARS - 1) + "\u2026"
    # An id changed to fit would name another message: none is kept instead.
    assert [r["external_id"] for r in rows[2:]] == [None, None, "1700000001.000100"]
    assert [(await item(stack, str(i["id"])))["status"] for i in seeded.items] == [
        "approved",
        "failed",
        "completed",
        "completed",
        "completed",
    ]
    assert len(channel.calls) == len(ids)


async def test_an_outcome_whose_commit_can_never_succeed_is_recorded_delivery_unknown(
    stack: Stack, channel: ScriptedChannel, caplog: pytest.LogCaptureFixture
) -> None:
    """An error committing a group that is not a database fault is met again at every
    try: the group's members are committed one by one, and the one that still cannot be
    is recorded ``deliveryUnknown`` (never sent again: it may have been posted), with a
    fixed error naming the rule and one ERROR line. The rest of the group commits, and
    the relay goes on claiming. Before, the whole group was kept and committed again at
    every run, for good."""
    seeded = await seed_items(stack.db, stack.clock, stack.ids, 3)
    ids = [str(d["id"]) for d in seeded.deliveries]
    refused, bad = seeded.items[1]["id"], "unstorable"
    answers: dict[str, SendOutcome] = {
        ids[0]: Sent("1700000001.000100"),
        ids[1]: Permanent(bad),
        ids[2]: Retry("HTTP 503"),
    }

    def answer(message: OutboundMessage) -> SendOutcome:
        return answers[message.delivery_id]

    real = workitems.transition

    async def transition(conn: Conn, *args: Any, **kwargs: Any) -> Any:
        if args[2] == refused and kwargs.get("text") == bad:
            raise ValueError("a value the database refuses")
        return await real(conn, *args, **kwargs)

    channel.script = [answer] * len(ids)
    relay = relay_for(stack)
    unknown = deliveries_counted("slack", "deliveryUnknown")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(workitems, "transition", transition)
        mp.setattr(relay_mod, "COMMIT_RETRY_DELAYS_S", (0.0,))
        caplog.set_level("ERROR", logger="leadgate.relay")
        await drain(relay)
    rows = [await delivery(stack, i) for i in ids]
    assert [r["status"] for r in rows] == ["sent", "deliveryUnknown", "pending"]
    assert rows[1]["error"] == relay_mod.NOT_RECORDED_ERROR
    assert "outbox.outcome_not_recorded" in relay_mod.NOT_RECORDED_ERROR
    assert rows[1]["lease_token"] is None
    assert [(await item(stack, str(i["id"])))["status"] for i in seeded.items] == [
        "completed",
        "approved",
        "approved",
    ]
    assert deliveries_counted("slack", "deliveryUnknown") - unknown == 1
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].exc_info is not None
    assert ids[1] in errors[0].getMessage()
    assert bad not in caplog.text  # (what the platform said stays out of logs)
    assert relay._uncommitted == []
    # Nothing is held: the relay claims and posts what comes due next, and never posts
    # the unrecorded one again.
    more = await seed_items(stack.db, stack.clock, stack.ids, 1)
    channel.script = []
    await drain(relay)
    assert (await delivery(stack, str(more.deliveries[0]["id"])))["status"] == "sent"
    assert [m.delivery_id for m in channel.calls].count(ids[1]) == 1


async def test_a_post_whose_sent_can_never_be_recorded_is_not_posted_again_by_a_retry(
    stack: Stack, channel: ScriptedChannel
) -> None:
    """A text posted in full whose ``sent`` the database refused (not a fault) is
    recorded ``deliveryUnknown``; that record said nothing of what was posted, and an
    operator's Retry posted the text again. Now it records every part posted: a Retry
    posts nothing and completes it."""
    item_id, dlv = await seed_one(stack)
    real_alone = outcomes_mod.OutcomeCommitter.commit_alone

    async def commit_alone(self: Any, db: Any, done: list[Done], now: int) -> bool:
        if any(isinstance(d.outcome, Sent) for d in done):
            raise ValueError("a value the database refuses")
        return await real_alone(self, db, done, now)

    async def commit_sent(self: Any, conn: Conn, sent: list[Done], now: int) -> None:
        raise ValueError("a value the database refuses")

    channel.script = [Sent("1700000001.000100")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(outcomes_mod.OutcomeCommitter, "commit_alone", commit_alone)
        mp.setattr(outcomes_mod.OutcomeCommitter, "_commit_sent", commit_sent)
        mp.setattr(relay_mod, "COMMIT_RETRY_DELAYS_S", (0.0,))
        await drain(relay_for(stack))
    row = await delivery(stack, dlv["id"])
    assert (row["status"], row["error"]) == ("deliveryUnknown", relay_mod.NOT_RECORDED_ERROR)
    assert row["address"]["next_part_at"] == len(row["text"]) > 0
    async with stack.db.tx() as conn:
        await recover(
            conn, stack.clock, stack.ids, Delivery(**row), action="retry", actor="user:op"
        )
    await drain(relay_for(stack))
    assert len(channel.calls) == 1
    assert (await delivery(stack, dlv["id"]))["status"] == "sent"
    assert (await item(stack, item_id))["status"] == "completed"


async def test_a_kept_group_that_then_meets_another_error_is_committed_one_by_one(
    stack: Stack, channel: ScriptedChannel
) -> None:
    """A group kept for a database fault is committed again at the next run; when that
    commit meets an error of another kind, its members are committed one by one too (the
    one that cannot be: ``deliveryUnknown``). Before, the next run raised the error at
    every pass, the group kept for good."""
    seeded = await seed_items(stack.db, stack.clock, stack.ids, 2)
    ids = [str(d["id"]) for d in seeded.deliveries]
    refused = seeded.items[1]["id"]
    answers: dict[str, SendOutcome] = {ids[0]: Sent("1700000001.000100"), ids[1]: Permanent("no")}

    def answer(message: OutboundMessage) -> SendOutcome:
        return answers[message.delivery_id]

    real = workitems.transition
    down = True

    async def transition(conn: Conn, *args: Any, **kwargs: Any) -> Any:
        if down:
            raise Unavailable("database went away mid-commit")
        if args[2] == refused:
            raise ValueError("a value the database refuses")
        return await real(conn, *args, **kwargs)

    channel.script = [answer] * len(ids)
    relay = relay_for(stack)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(workitems, "transition", transition)
        mp.setattr(relay_mod, "COMMIT_RETRY_DELAYS_S", (0.0,))
        await relay.run_once()
        assert [(await delivery(stack, i))["status"] for i in ids] == ["sending", "sending"]
        assert len(relay._uncommitted) == 2
        down = False
        await drain(relay)
    rows = [await delivery(stack, i) for i in ids]
    assert [r["status"] for r in rows] == ["sent", "deliveryUnknown"]
    assert rows[1]["error"] == relay_mod.NOT_RECORDED_ERROR
    assert relay._uncommitted == []
    assert len(channel.calls) == 2


async def test_a_database_fault_met_one_by_one_keeps_only_the_outcomes_not_committed(
    stack: Stack, channel: ScriptedChannel, caplog: pytest.LogCaptureFixture
) -> None:
    """Committing one by one stops at a database fault, and what is committed again is
    what was not committed yet: the outcome already recorded is not met again (no second
    ERROR line, no lost lease)."""
    seeded = await seed_items(stack.db, stack.clock, stack.ids, 3)
    ids = [str(d["id"]) for d in seeded.deliveries]
    answers: dict[str, SendOutcome] = {i: Permanent(f"p{n}") for n, i in enumerate(ids)}

    def answer(message: OutboundMessage) -> SendOutcome:
        return answers[message.delivery_id]

    real = workitems.transition
    faults = [Unavailable("database went away mid-commit")]

    async def transition(conn: Conn, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("text") == "p0":
            raise ValueError("a value the database refuses")
        if kwargs.get("text") == "p1" and faults:
            raise faults.pop()
        return await real(conn, *args, **kwargs)

    channel.script = [answer] * len(ids)
    relay = relay_for(stack)
    caplog.set_level("WARNING", logger="leadgate.relay")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(workitems, "transition", transition)
        mp.setattr(relay_mod, "COMMIT_RETRY_DELAYS_S", (0.0,))
        await drain(relay)
    assert faults == []
    rows = [await delivery(stack, i) for i in ids]
    assert [r["status"] for r in rows] == ["deliveryUnknown", "failed", "failed"]
    assert [r.levelname for r in caplog.records].count("ERROR") == 1
    assert "send lease lost" not in caplog.text


@pytest.mark.parametrize(
    ("url", "sent"),
    [("postgres", False), ("postgres", True)],
    indirect=["url"],
    ids=["refusals", "posts"],
)
async def test_a_group_locks_its_posts_items_in_the_order_a_lease_expiry_does(
    stack: Stack, sent: bool
) -> None:
    """A relay commits the outcomes of two posts, the later item's first, while another
    replica takes back lapsed send leases, which locks the posts' items in id order
    (:func:`outbox.store.ended_meanwhile`). The group locked them in its own order: it
    held the later item waiting for the earlier one, which the expiry held waiting for
    the later one, and PostgreSQL ended one of the two (40P01 deadlock_detected). It now
    locks them in the expiry's order: it waits, then commits. For refusals (Retry), and
    for successful posts (``sent``), committed on PostgreSQL as one statement
    (``commit_alone``), whose move of the items to ``completed`` locked them in the
    order its scan of the approved items found them (by status and updated_at): it now
    locks its deliveries, then the items, by id."""
    seeded = await seed_items(stack.db, stack.clock, stack.ids, 2)
    relay = relay_for(stack)
    rows = sorted(await relay.claim(), key=lambda r: str(r.work_item_id), reverse=True)
    assert len(rows) == 2
    first = min(str(r.work_item_id) for r in rows)
    posts = t.deliveries.c.id.in_([r.id for r in rows])
    locked = sa.select(t.work_items.c.id).where(t.work_items.c.id == first).with_for_update()
    group = [Done(r, Sent(f"ts-{n}") if sent else Retry("busy")) for n, r in enumerate(rows)]
    if sent:
        async with stack.db.tx() as conn:
            # The first item approved after the other: the scan finds the later item first.
            w = t.work_items.c
            await conn.execute(
                t.work_items.update().where(w.id == first).values(updated_at=w.updated_at + 1)
            )
    async with stack.db.tx() as conn:
        await conn.execute(locked)  # the expiry's statement has locked the first item
        commit = asyncio.create_task(relay.complete(group))
        await blocked_on_a_lock(stack.db, commit)
        assert await ended_meanwhile(conn, posts) == []  # and goes on to the second
    await commit
    for d in seeded.deliveries:
        assert (await delivery(stack, str(d["id"])))["status"] == ("sent" if sent else "pending")
    for i in seeded.items:
        assert (await item(stack, str(i["id"])))["status"] == ("completed" if sent else "approved")


@pytest.mark.parametrize(
    ("url", "table"),
    [("postgres", t.deliveries), ("postgres", t.work_items)],
    indirect=["url"],
    ids=["deliveries", "items"],
)
async def test_a_group_commit_in_a_transaction_locks_its_rows_in_id_order(
    stack: Stack, table: sa.Table
) -> None:
    """A group of posts committed in a transaction (a reveal's group, or PostgreSQL's
    statements in transactions) marks its deliveries sent and moves their items with one
    update each, by a set of ids (``_mark_sent``, ``workitems.transition_many``). Each
    locked its rows in the order its plan found them: at size a bitmap or sequential
    scan, physical order. Another transaction locking the same rows in id order (as a
    lease expiry locks items) held the first row while the commit held the second
    waiting for it, then waited for the second, and PostgreSQL ended one of the two
    (40P01 deadlock_detected). Each update now locks its rows in id order first: the
    commit waits for the first row holding nothing, then commits."""
    await seed_items(stack.db, stack.clock, stack.ids, 2)
    relay = relay_for(stack)
    rows = await relay.claim()
    assert len(rows) == 2
    ids = [r.id for r in rows] if table is t.deliveries else [str(r.work_item_id) for r in rows]
    c = table.c
    async with stack.db.tx() as conn:
        first, second = [
            r.id for r in await conn.execute(sa.select(c.id).where(c.id.in_(ids)).order_by(c.id))
        ]
        # The first row's newest version goes after the second's in the table: a scan in
        # physical order finds the second first.
        await conn.execute(table.update().where(c.id == first).values(updated_at=c.updated_at))
    group = [Done(r, Sent(f"ts-{n}")) for n, r in enumerate(rows)]

    async def commit() -> None:
        async with stack.db.tx() as conn:
            # The plan PostgreSQL chooses at size (here, with two rows, forced).
            await conn.execute(sa.text("SET LOCAL enable_indexscan = off"))
            await conn.execute(sa.text("SET LOCAL enable_bitmapscan = off"))
            await relay.committer.commit(conn, group, stack.clock.now_ms())

    lock = sa.select(c.id).where(c.id.in_([first, second])).order_by(c.id).with_for_update()
    async with stack.db.tx() as conn:
        await conn.execute(lock.where(c.id == first))
        committing = asyncio.create_task(commit())
        await blocked_on_a_lock(stack.db, committing)
        await conn.execute(lock)  # and goes on to the second
    await committing
    for r in rows:
        assert (await delivery(stack, r.id))["status"] == "sent"
        assert (await item(stack, str(r.work_item_id)))["status"] == "completed"


async def test_a_group_of_posts_commits_fenced_moves_audit_and_events(
    stack: Stack, channel: ScriptedChannel
) -> None:
    """A group of successful posts (on PostgreSQL one statement outside a transaction
    block, on SQLite the outcome transaction) writes the same rows: each delivery fenced
    by its lease token (a lost lease moves nothing), the item ``approved -> completed``
    only if it still is approved, its ``delivered`` audit row, the session's ``review``
    event after the events already there, the platform's message id, and the in-process
    wake-up of the session's readers."""
    seeded = await seed_items(stack.db, stack.clock, stack.ids, 3)
    relay = relay_for(stack)
    rows = {r.work_item_id: r for r in await relay.claim()}
    ok_id, lost_id, moved_away_id = (str(i["id"]) for i in seeded.items)
    ok, lost, moved_away = rows[ok_id], rows[lost_id], rows[moved_away_id]
    async with stack.db.tx() as conn:
        await conn.execute(
            t.work_items.update()
            .where(t.work_items.c.id == moved_away.work_item_id)
            .values(status="cancelled")
        )
        await conn.execute(
            t.deliveries.update()
            .where(t.deliveries.c.id == moved_away.id)
            .values(external_id="posted-earlier")
        )
        for session_id in (seeded.items[0]["session_id"], seeded.items[2]["session_id"]):
            await session_events.message_visible(conn, stack.clock, session_id, "msg_before")
    woken: list[list[Any]] = []
    stack.db.on_commit_payloads(session_events.TOPIC, woken.append)
    done = [
        Done(ok, Sent("1700000001.000100")),
        Done(lost._replace(lease_token="lease_someone_else"), Sent("x")),
        Done(moved_away, Sent(None)),
    ]
    with stack.db.record_statements() as statements:
        await relay.complete(done)
    if stack.db.is_postgres:
        assert [s.split()[0] for s in statements] == ["WITH"], statements

    first = await delivery(stack, ok.id)
    assert (first["status"], first["external_id"], first["lease_token"]) == (
        "sent",
        "1700000001.000100",
        None,
    )
    # A lost lease writes nothing, not even the message id; no id keeps the row's own.
    assert [(await delivery(stack, lost.id))[k] for k in ("status", "external_id")] == [
        "sending",
        None,
    ]
    assert [(await delivery(stack, moved_away.id))[k] for k in ("status", "external_id")] == [
        "sent",
        "posted-earlier",
    ]
    assert (await item(stack, ok_id))["status"] == "completed"
    assert (await item(stack, lost_id))["status"] == "approved"
    assert (await item(stack, moved_away_id))["status"] == "cancelled"
    assert "delivered" in await audit_actions(stack, ok_id)
    assert "delivered" not in await audit_actions(stack, moved_away_id)
    async with stack.db.read() as conn:
        events = (
            await conn.execute(
                sa.select(
                    t.session_events.c.session_id,
                    t.session_events.c.seq,
                    t.session_events.c.kind,
                    t.session_events.c.status,
                )
                .where(t.session_events.c.session_id.in_([i["session_id"] for i in seeded.items]))
                .order_by(t.session_events.c.session_id, t.session_events.c.seq)
            )
        ).all()
        audit = (
            await conn.execute(
                sa.select(t.audit.c.actor, t.audit.c.from_status, t.audit.c.to_status).where(
                    t.audit.c.work_item_id == ok.work_item_id, t.audit.c.action == "delivered"
                )
            )
        ).one()
    first_session, _, third_session = (i["session_id"] for i in seeded.items)
    assert first_session < third_session  # ids follow creation: the events' order
    assert [tuple(e) for e in events] == [
        (first_session, 1, "message", None),
        (first_session, 2, "review", "delivered"),
        (third_session, 1, "message", None),
    ]
    assert tuple(audit) == ("system:relay", "approved", "completed")
    assert [p for payloads in woken for p in payloads] == [(first_session, False)]


async def test_retry_honours_retry_after_and_keeps_the_idempotency_key(
    stack: Stack, channel: ScriptedChannel
) -> None:
    item_id, dlv = await seed_one(stack)
    clock = fake_clock(stack)
    channel.script = [Retry("HTTP 429 ratelimited", delay_s=30), Retry("HTTP 503"), Sent("ts-9")]
    relay = relay_for(stack, rand=lambda: 1.0)
    t0 = clock.now_ms()
    await drain(relay)
    row = await delivery(stack, dlv["id"])
    assert (row["status"], row["attempts"], row["error"]) == ("pending", 1, "HTTP 429 ratelimited")
    assert row["next_attempt_at"] == t0 + 30_000  # Retry-After beats the 1 s backoff
    assert (await item(stack, item_id))["status"] == "approved"
    clock.advance(29_999)
    assert await relay.run_once() is False
    clock.advance(1)
    await drain(relay)
    row = await delivery(stack, dlv["id"])
    # Second attempt: no Retry-After, backoff 2 s * (0.5 + 0.5 * rand=1.0).
    assert (row["status"], row["attempts"]) == ("pending", 2)
    assert row["next_attempt_at"] == clock.now_ms() + 2_000
    clock.advance(2_000)
    await drain(relay)
    row = await delivery(stack, dlv["id"])
    assert (row["status"], row["external_id"], row["error"]) == ("sent", "ts-9", None)
    assert (await item(stack, item_id))["status"] == "completed"
    assert {m.idempotency_key for m in channel.calls} == {dlv["id"]}
    assert len(channel.calls) == 3


@pytest.mark.parametrize("asked_s", [float("inf"), 1e300, 1e12])
async def test_a_retry_after_past_any_sense_waits_an_hour_and_holds_nothing_up(
    stack: Stack, asked_s: float
) -> None:
    """A Retry-After of "inf" or "1e400" (a hostile platform or proxy: Slack's and
    Teams' headers are read with ``float``, discord.py's JSON takes ``Infinity``) made
    the outcome's commit raise (no integer time, or one past the column's): the relay
    kept the outcome to commit again, raised on every pass, and neither claimed nor took
    back a lapsed lease again. Now a Retry-After counts for at most an hour."""
    small = ScriptedChannel("slack", script=[Retry("HTTP 429", asked_s)])
    stack.channels["slack"] = small
    seeded = await seed_items(stack.db, stack.clock, stack.ids, 2)
    relay = relay_for(stack, concurrency=1)
    now = fake_clock(stack).now_ms()
    await drain(relay)
    first, second = [await delivery(stack, d["id"]) for d in seeded.deliveries]
    assert first["status"] == "pending" and second["status"] == "sent"
    assert first["next_attempt_at"] == now + int(relay_mod.RETRY_AFTER_CAP_S * 1000)


async def test_backoff_is_exponential_with_injectable_jitter(stack: Stack) -> None:
    jitter = iter([0.0, 1.0, 0.5, 0.25])
    relay = relay_for(stack, rand=lambda: next(jitter))
    assert relay.backoff_s(1, None) == 0.5  # 1 s * (0.5 + 0)
    assert relay.backoff_s(2, None) == 2.0  # 2 s * (0.5 + 0.5)
    assert relay.backoff_s(3, None) == 3.0  # 4 s * 0.75
    assert relay.backoff_s(4, 100.0) == 100.0  # Retry-After wins
    capped = relay_for(stack, rand=lambda: 1.0)
    assert capped.backoff_s(30, None) == relay_mod.BACKOFF_CAP_S


async def test_retryable_failures_never_give_up_and_are_reported_once_stalled(
    stack: Stack, channel: ScriptedChannel, caplog: pytest.LogCaptureFixture
) -> None:
    """A platform down for a long while: the approved output is posted when it is back
    (it was ``failed`` after 8 attempts, about two minutes, in no queue). Past
    ``stalled_after`` attempts each retry is a WARNING and the ``stalled`` outcome."""
    item_id, dlv = await seed_one(stack)
    clock = fake_clock(stack)
    channel.script = [Retry("HTTP 503")] * 12
    relay = relay_for(stack, stalled_after=3)

    def stalled() -> float:
        labels = {"channel": "slack", "outcome": "stalled"}
        return METRICS.registry.get_sample_value("leadgate_deliveries_total", labels) or 0.0

    before = stalled()
    for _ in range(12):
        await drain(relay)
        row = await delivery(stack, dlv["id"])
        assert row["status"] == "pending" and row["error"] == "HTTP 503", row
        # the backoff is capped: the next attempt is never more than 5 minutes away
        assert row["next_attempt_at"] - clock.now_ms() <= 300_000
        assert (await item(stack, item_id))["status"] == "approved"
        clock.advance(300_000)
    assert len(channel.calls) == 12 and row["attempts"] == 12
    assert stalled() - before == 10  # attempts 3..12
    assert "still not posted after 12 attempts (HTTP 503)" in caplog.text
    await drain(relay)  # the platform is back (the script is spent: Sent)
    assert (await delivery(stack, dlv["id"]))["status"] == "sent"
    assert (await item(stack, item_id))["status"] == "completed"


async def test_permanent_fails_with_the_error_recorded(
    stack: Stack, channel: ScriptedChannel
) -> None:
    item_id, dlv = await seed_one(stack)
    channel.script = [Permanent("slack: HTTP 200 channel_not_found")]
    await drain(relay_for(stack))
    row = await delivery(stack, dlv["id"])
    assert (row["status"], row["error"]) == ("failed", "slack: HTTP 200 channel_not_found")
    wi = await item(stack, item_id)
    assert wi["status"] == "failed"
    assert "deliveryFailed" in await audit_actions(stack, item_id)
    fake_clock(stack).advance(3_600_000)
    await drain(relay_for(stack))
    assert len(channel.calls) == 1


@pytest.mark.parametrize(
    "answer",
    [Uncertain("slack: no answer before the timeout"), ConnectionResetError("adapter bug")],
    ids=["uncertain", "adapter-raises"],
)
async def test_uncertain_is_delivery_unknown_and_never_retried(
    stack: Stack, channel: ScriptedChannel, answer: Any
) -> None:
    item_id, dlv = await seed_one(stack)
    org_id = (await item(stack, item_id))["org_id"]
    channel.script = [answer]
    await drain(relay_for(stack))
    row = await delivery(stack, dlv["id"])
    assert row["status"] == "deliveryUnknown" and row["error"]
    assert (await item(stack, item_id))["status"] == "approved"
    assert await actionable_ids(stack, org_id) == [item_id]
    assert "deliveryUnknown" in await audit_actions(stack, item_id)
    for _ in range(3):
        fake_clock(stack).advance(SEND_LEASE_MS * 2)
        await drain(relay_for(stack))
    assert len(channel.calls) == 1


async def test_expired_send_lease_posts_unknown_internal_pending(
    stack: Stack, channel: ScriptedChannel
) -> None:
    post_item, post = await seed_one(stack)
    reveal_item, reveal = await seed_one(stack, kind=BindingKind.api)
    org_id = (await item(stack, post_item))["org_id"]
    crashed = relay_for(stack)  # claims, then "dies" before sending or committing
    claimed = await crashed.claim()
    assert {r.id for r in claimed} == {post["id"], reveal["id"]}
    clock = fake_clock(stack)
    survivor = relay_for(stack)
    clock.advance(SEND_LEASE_MS)  # not yet expired (strictly past the lease)
    assert await survivor.expire_send_leases() == 0
    clock.advance(1)
    await drain(survivor)
    row = await delivery(stack, post["id"])
    assert row["status"] == "deliveryUnknown" and "send lease expired" in row["error"]
    assert (await item(stack, post_item))["status"] == "approved"
    assert await actionable_ids(stack, org_id) == [post_item]
    # The internal action is idempotent: back to pending, then done.
    assert (await delivery(stack, reveal["id"]))["status"] == "sent"
    assert (await item(stack, reveal_item))["status"] == "completed"
    assert channel.calls == []  # the expired post is never re-sent
    # The crashed relay's late commit is fenced off by its lost lease.
    await crashed.complete([Done(r, Sent("late")) for r in claimed])
    assert (await delivery(stack, post["id"]))["status"] == "deliveryUnknown"


async def test_the_relay_knows_when_the_earliest_send_lease_lapses(
    stack: Stack, channel: ScriptedChannel
) -> None:
    """A relay that stopped mid-send without dying (or died unannounced) leaves its rows
    ``sending``: the lease check reads when the earliest send lease lapses, and the relay
    loop sleeps no longer than until its next check can take it back (``due_in_s``), not
    until the poll (tests/integration/test_runner_wakes.py runs the loop)."""
    clock = fake_clock(stack)
    survivor = relay_for(stack)
    assert not await survivor.run_once()
    assert survivor.due_in_s() is None  # nothing sending, no retry: the poll alone
    await seed_one(stack)
    stalled = relay_for(stack)
    claimed = await stalled.claim()  # then never sends
    clock.advance(10_000)
    assert not await survivor.run_once()
    assert claimed and survivor.due_in_s() == (SEND_LEASE_MS - 10_000 + 1) / 1000
    clock.advance(SEND_LEASE_MS - 10_000)  # not lapsed yet (strictly past the lease)
    assert survivor.due_in_s() == 0.001
    clock.advance(1)
    assert await survivor.run_once()  # taken back: deliveryUnknown
    assert survivor.due_in_s() is None
    assert channel.calls == []


async def test_long_messages_are_split_in_order_with_nothing_dropped(stack: Stack) -> None:
    small = ScriptedChannel("slack", max_chars=100)
    stack.channels["slack"] = small
    words = [f"word{i:03d}" for i in range(120)]
    text = " ".join(words[:60]) + "\n" + " ".join(words[60:])
    item_id, dlv = await seed_one(stack, text=lambda _: text)
    await drain(relay_for(stack))
    parts = small.texts()
    assert len(parts) > 8 and all(len(p) <= 100 for p in parts)
    assert " ".join(" ".join(parts).split()) == " ".join(words)
    assert [m.idempotency_key for m in small.calls] == part_keys(dlv["id"], text, 100)
    assert (await item(stack, item_id))["status"] == "completed"


async def test_a_channel_that_counts_bytes_gets_parts_that_fit_in_bytes(stack: Stack) -> None:
    # Teams counts the JSON it posts: 30,000 CJK characters are 180,000 bytes there,
    # and a part of 26,000 characters was refused (413).
    teams = ScriptedChannel("slack", max_chars=teams_review.MAX_TEXT_BYTES)
    teams.text_size = teams_review.text_size  # type: ignore[attr-defined]
    stack.channels["slack"] = teams
    text = "漢字かな交じり文。" * 3_000 + "🙂" * 2_000 + " tail"
    item_id, _ = await seed_one(stack, text=lambda _: text)
    await drain(relay_for(stack))
    parts = teams.texts()
    assert all(teams_review.text_size(p) <= teams_review.MAX_TEXT_BYTES for p in parts)
    assert "".join(parts).replace(" ", "") == text.replace(" ", "")
    assert len(parts) == -(-teams_review.text_size(text) // teams_review.MAX_TEXT_BYTES)
    assert (await item(stack, item_id))["status"] == "completed"


def test_split_text_by_a_size_that_is_not_characters() -> None:
    def size(text: str) -> int:
        return len(text.encode())

    assert split_text("ab", 1, size) == ["a", "b"]
    assert split_text("€", 1, size) == ["€"]  # too large alone: still sent, not lost
    assert split_text("€€€ €€€ €€€", 10, size) == ["€€€", "€€€", "€€€"]  # at the spaces
    assert split_text("€" * 7, 10, size) == ["€€€", "€€€", "€"]


def part_keys(delivery_id: str, text: str, limit: int) -> list[str]:
    """The idempotency keys of ``text``'s parts, split whole under ``limit``."""
    return [part_key(delivery_id, s, e) for s, e in split_spans(text, limit)]


def keys_sent(channel: ScriptedChannel) -> list[str]:
    """The idempotency keys of every send, in order (a part's key: ``{id}.{start}-{end}``,
    the first's the delivery's id)."""
    return [m.idempotency_key for m in channel.calls]


async def test_a_later_part_not_posted_is_retried_from_there_not_resent(stack: Stack) -> None:
    """A later part refused (nothing of it posted) made the delivery deliveryUnknown, for
    an operator to settle, and a retry there posted the first part again. Now the parts
    posted are recorded with the retry, which posts the rest only."""
    small = ScriptedChannel("slack", max_chars=100, script=[Sent("a"), Retry("HTTP 429", 1)])
    stack.channels["slack"] = small
    item_id, dlv = await seed_one(stack, text=lambda _: "x" * 250)
    await drain(relay_for(stack))
    row = await delivery(stack, dlv["id"])
    assert (row["status"], row["error"]) == ("pending", "part 2 of 3: HTTP 429")
    assert (row["address"]["parts_posted"], row["external_id"]) == (1, "a")
    fake_clock(stack).advance(60_000)
    await drain(relay_for(stack))
    k = part_keys(dlv["id"], "x" * 250, 100)
    assert keys_sent(small) == [k[0], k[1], k[1], k[2]]
    assert "".join(small.texts()[n] for n in (0, 2, 3)) == "x" * 250
    row = await delivery(stack, dlv["id"])
    assert (row["status"], row["external_id"]) == ("sent", "a")
    assert (await item(stack, item_id))["status"] == "completed"


async def test_a_later_part_maybe_posted_is_uncertain_and_a_retry_posts_from_it(
    stack: Stack,
) -> None:
    """A later part that may have been posted leaves the delivery deliveryUnknown (never
    sent again by the relay); an operator's retry posts from that part on, not the parts
    surely posted before it."""
    small = ScriptedChannel("slack", max_chars=100, script=[Sent("a"), Uncertain("timeout")])
    stack.channels["slack"] = small
    item_id, dlv = await seed_one(stack, text=lambda _: "x" * 250)
    await drain(relay_for(stack))
    row = await delivery(stack, dlv["id"])
    assert (row["status"], row["error"]) == ("deliveryUnknown", "part 2 of 3: timeout")
    fake_clock(stack).advance(600_000)
    await drain(relay_for(stack))
    assert len(small.calls) == 2  # never sent again by the relay
    async with stack.db.tx() as conn:
        await recover(
            conn, stack.clock, stack.ids, Delivery(**row), action="retry", actor="user:op"
        )
    await drain(relay_for(stack))
    k = part_keys(dlv["id"], "x" * 250, 100)
    assert keys_sent(small) == [k[0], k[1], k[1], k[2]]
    assert (await item(stack, item_id))["status"] == "completed"


@pytest.mark.parametrize("url", ["postgres"], indirect=True)
async def test_a_confirm_of_an_uncertain_post_while_its_item_is_cancelled_waits_no_deadlock(
    stack: Stack,
) -> None:
    """An operator confirms an uncertain post while a person cancels its item. The
    cancel locks the item, then cancels the item's uncertain deliveries; the confirm
    locked the delivery, then waited for the item to complete it: each held what the
    other waited for, and PostgreSQL ended one of the two (40P01 deadlock_detected).
    The confirm now locks the item first, as the cancel does: it waits for the cancel,
    then finds the delivery ``cancelled`` and says so (409 ``delivery.status``)."""
    stack.channels["slack"] = ScriptedChannel("slack", script=[Uncertain("timeout")])
    item_id, dlv = await seed_one(stack)
    await drain(relay_for(stack))
    row = await delivery(stack, dlv["id"])
    assert row["status"] == "deliveryUnknown"
    locked = sa.select(t.work_items.c.id).where(t.work_items.c.id == item_id).with_for_update()

    async def confirm() -> None:
        async with stack.db.tx() as conn:
            await recover(
                conn, stack.clock, stack.ids, Delivery(**row), action="confirm", actor="user:op"
            )

    async with stack.db.tx() as conn:
        await conn.execute(locked)  # the cancel's move of the item holds it
        confirming = asyncio.create_task(confirm())
        await blocked_on_a_lock(stack.db, confirming)
        await decisions.decide(
            conn, stack.outbox, await workitems.get(conn, item_id), "cancel", "user:x"
        )
    with pytest.raises(TransitionError) as refused:
        await confirming
    assert refused.value.rule == "delivery.status"
    assert (await delivery(stack, dlv["id"]))["status"] == "cancelled"
    assert (await item(stack, item_id))["status"] == "cancelled"


#: A long text of distinct words, so that a part posted twice, or skipped, shows.
WORDS = " ".join(f"w{n:04d}" for n in range(60))


@pytest.mark.parametrize(("first", "then"), [(100, 1000), (200, 100)])
async def test_a_retry_posts_the_rest_when_the_split_changed(
    stack: Stack, first: int, then: int
) -> None:
    """Parts posted were recorded as a count of the first attempt's split: a retry under
    another split (a channel's limit changed by an upgrade) posted again what the count
    pointed at in the new split (a longer limit: the whole text again; a shorter one:
    the second half of the first part again). Now the retry posts the text from where
    the parts posted ended, split again."""
    small = ScriptedChannel("slack", max_chars=first, script=[Sent("a"), Retry("HTTP 429", 1)])
    stack.channels["slack"] = small
    item_id, dlv = await seed_one(stack, text=lambda _: WORDS)
    await drain(relay_for(stack))
    row = await delivery(stack, dlv["id"])
    assert row["status"] == "pending" and row["address"]["parts_posted"] == 1
    small.max_chars = then
    fake_clock(stack).advance(60_000)
    await drain(relay_for(stack))
    posted = small.texts()[:1] + small.texts()[2:]  # (the second was refused)
    assert " ".join(posted).split() == WORDS.split()
    assert (await item(stack, item_id))["status"] == "completed"


@pytest.mark.parametrize(("first", "then"), [(100, 100), (100, 1000), (200, 100), (100, 70)])
async def test_part_keys_name_the_text_whatever_the_retry_s_split(
    stack: Stack, first: int, then: int
) -> None:
    """A later part's key was its number: a retry resumes from where the parts posted
    ended and splits the rest again, so under another split (a channel's limit changed
    by an upgrade) its part 2 was another text than the first attempt's part 2, under
    the same key, and a channel that de-duplicates by key (Discord's nonce, email's
    Message-ID) dropped it as a repeat of a part that may have been posted: the text
    between their ends was lost. Now a part's key names where it lies in the text: the
    same text always has the same key (a repeat is de-duplicated), another text never
    has it."""
    small = ScriptedChannel(
        "slack", max_chars=first, script=[Sent("a"), Uncertain("timeout after write")]
    )
    stack.channels["slack"] = small
    item_id, dlv = await seed_one(stack, text=lambda _: WORDS)
    await drain(relay_for(stack))
    row = await delivery(stack, dlv["id"])
    assert row["status"] == "deliveryUnknown" and row["address"]["parts_posted"] == 1
    small.max_chars = then
    async with stack.db.tx() as conn:
        await recover(
            conn, stack.clock, stack.ids, Delivery(**row), action="retry", actor="user:op"
        )
    await drain(relay_for(stack))
    assert (await item(stack, item_id))["status"] == "completed"
    sends = list(zip(keys_sent(small), small.texts(), strict=True))
    assert len({key for key, _ in sends}) == len(set(sends))  # one text per key
    assert len({text for _, text in sends}) == len(set(sends))  # one key per text
    # (the part that may have been posted, sent again: the same key when the same text)
    assert (sends[1][0] == sends[2][0]) is (first == then)
    i, at = dlv["id"], row["address"]["next_part_at"]
    retry = [part_key(i, at + s, at + e) for s, e in split_spans(WORDS[at:], then)]
    assert keys_sent(small)[2:] == retry
    first_keys = part_keys(i, WORDS, first)
    assert keys_sent(small)[:2] == first_keys[:2] and first_keys[0] == i


@pytest.mark.parametrize(
    ("posted", "from_part"),
    [
        ({"parts_posted": 1}, 1),  # an older row's count, without the offset
        ({"parts_posted": 0}, 0),
        ({"parts_posted": 9}, None),  # more parts than the text has
        ({"parts_posted": -1}, None),
        ({"parts_posted": "1"}, None),
        ({"parts_posted": True}, None),
        ({"parts_posted": 1, "next_part_at": len(WORDS) + 1}, None),  # past the text
        ({"parts_posted": 1, "next_part_at": len(WORDS)}, len(split_text(WORDS, 100))),  # all
        ({"parts_posted": 1, "next_part_at": -5}, None),
        ({"parts_posted": 0, "next_part_at": 100}, None),
        ({"next_part_at": 100}, None),
    ],
)
async def test_a_record_of_parts_posted_that_does_not_fit_is_not_followed(
    stack: Stack, posted: dict[str, Any], from_part: int | None
) -> None:
    """A ``parts_posted`` past the text's parts (hand-edited, or recorded under another
    split) posted the last part again; a negative or non-numeric one posted the whole
    text again. Now a record that does not fit the text posts nothing and leaves the
    delivery deliveryUnknown, for an operator; an older row's count alone is placed by
    the split as it is now."""
    small = ScriptedChannel("slack", max_chars=100)
    stack.channels["slack"] = small
    item_id, dlv = await seed_one(stack, text=lambda _: WORDS)
    async with stack.db.tx() as conn:
        await conn.execute(
            t.deliveries.update()
            .where(t.deliveries.c.id == dlv["id"])
            .values(address={**dlv["address"], **posted})
        )
    await drain(relay_for(stack))
    row = await delivery(stack, dlv["id"])
    if from_part is not None:
        sent = split_text(WORDS, 100)[from_part:]
        assert " ".join(small.texts()).split() == " ".join(sent).split()
        assert row["status"] == "sent"
        return
    assert small.calls == []
    assert row["status"] == "deliveryUnknown"
    assert "does not fit the text" in row["error"] and "nothing was sent" in row["error"]
    assert (await item(stack, item_id))["status"] == "approved"


async def test_a_lease_lapsed_mid_send_keeps_the_parts_posted_and_posts_no_more(
    stack: Stack,
) -> None:
    """A relay whose send lease lapsed between two parts (by another replica's clock) went
    on posting the rest after the delivery was taken back as deliveryUnknown, and the
    parts it posted were recorded nowhere: an operator's Retry posted the whole text
    again. Now each part posted is recorded before the next is sent, the record lands
    on the row taken back, and nothing more is sent: the Retry posts the rest only."""
    ahead = FakeClock(fake_clock(stack).now_ms() + SEND_LEASE_MS + 1)

    async def lease_lapses(message: OutboundMessage) -> SendOutcome:
        # Another replica, its clock ahead, takes the delivery back meanwhile.
        other = Relay(stack.db, ahead, stack.ids, stack.channels)
        assert await other.expire_send_leases() == 1
        return Sent("b")

    small = ScriptedChannel("slack", max_chars=100, script=[Sent("a"), lease_lapses])
    stack.channels["slack"] = small
    item_id, dlv = await seed_one(stack, text=lambda _: WORDS)
    await drain(relay_for(stack))
    assert len(small.calls) == 2
    row = await delivery(stack, dlv["id"])
    assert row["status"] == "deliveryUnknown"
    assert (row["address"]["parts_posted"], row["external_id"]) == (2, "a")
    async with stack.db.tx() as conn:
        await recover(
            conn, stack.clock, stack.ids, Delivery(**row), action="retry", actor="user:op"
        )
    await drain(relay_for(stack))
    assert " ".join(small.texts()).split() == WORDS.split()
    i = dlv["id"]
    assert keys_sent(small) == part_keys(i, WORDS, 100)
    assert (await delivery(stack, i))["external_id"] == "a"
    assert (await item(stack, item_id))["status"] == "completed"


@pytest.mark.parametrize("text", ["one part", WORDS[:150]])
async def test_a_lease_lost_after_the_last_part_records_it_and_a_retry_posts_nothing(
    stack: Stack, text: str
) -> None:
    """A relay whose send lease lapsed while its last part was on its way (the delivery
    taken back as deliveryUnknown by another replica) could not commit its ``sent``, and
    the row kept the record of the parts before the last one only (a one-part text:
    none): an operator's Retry posted the last part, or the whole text, again. Now the
    relay records on the row taken back that every part was posted: it stays
    deliveryUnknown for the operator, and a Retry posts nothing and completes it."""
    ahead = FakeClock(fake_clock(stack).now_ms() + SEND_LEASE_MS + 1)

    async def lease_lapses(message: OutboundMessage) -> SendOutcome:
        other = Relay(stack.db, ahead, stack.ids, stack.channels)
        assert await other.expire_send_leases() == 1
        return Sent("b")

    parts = len(split_text(text, 100))
    script: list[Any] = [Sent("a")] * (parts - 1) + [lease_lapses]
    small = ScriptedChannel("slack", max_chars=100, script=script)
    stack.channels["slack"] = small
    item_id, dlv = await seed_one(stack, text=lambda _: text)
    await drain(relay_for(stack))
    assert len(small.calls) == parts
    row = await delivery(stack, dlv["id"])
    assert row["status"] == "deliveryUnknown" and row["error"] == outcomes_mod.ALL_POSTED_ERROR
    assert (row["address"]["parts_posted"], row["address"]["next_part_at"]) == (parts, len(text))
    assert row["external_id"] == ("a" if parts > 1 else "b")
    assert (await item(stack, item_id))["status"] == "approved"  # an operator's to settle
    async with stack.db.tx() as conn:
        await recover(
            conn, stack.clock, stack.ids, Delivery(**row), action="retry", actor="user:op"
        )
    await drain(relay_for(stack))
    assert small.texts() == split_text(text, 100)  # nothing posted twice
    assert (await delivery(stack, dlv["id"]))["status"] == "sent"
    assert (await item(stack, item_id))["status"] == "completed"


async def test_a_text_recorded_all_posted_completes_at_a_retry_once_its_channel_is_gone(
    stack: Stack,
) -> None:
    """A delivery recorded as fully posted (its send lease lapsed after its last part)
    whose channel was since removed from the configuration: an operator's Retry left it
    deliveryUnknown "after the parts posted", the missing channel checked before the
    "nothing left to send". Nothing is left: it completes, as with the channel there."""

    async def lease_lapses(message: OutboundMessage) -> SendOutcome:
        ahead = FakeClock(fake_clock(stack).now_ms() + SEND_LEASE_MS + 1)
        assert await Relay(stack.db, ahead, stack.ids, stack.channels).expire_send_leases() == 1
        return Sent("a")

    small = ScriptedChannel("slack", max_chars=100, script=[lease_lapses])
    stack.channels["slack"] = small
    item_id, dlv = await seed_one(stack, text=lambda _: "one part")
    await drain(relay_for(stack))
    row = await delivery(stack, dlv["id"])
    assert row["status"] == "deliveryUnknown" and row["error"] == outcomes_mod.ALL_POSTED_ERROR
    del stack.channels["slack"]
    async with stack.db.tx() as conn:
        await recover(
            conn, stack.clock, stack.ids, Delivery(**row), action="retry", actor="user:op"
        )
    await drain(relay_for(stack))
    assert small.texts() == ["one part"]  # nothing posted twice
    done = await delivery(stack, dlv["id"])
    assert done["status"] == "sent", done["error"]
    assert (await item(stack, item_id))["status"] == "completed"


async def retry_at(stack: Stack, clock: FakeClock, delivery_id: str) -> Delivery:
    """An operator's Retry of ``delivery_id`` at ``clock``'s time."""
    async with stack.db.tx() as conn:
        return await recover(
            conn,
            clock,
            stack.ids,
            Delivery(**await delivery(stack, delivery_id)),
            action="retry",
            actor="user:op",
        )


@pytest.mark.parametrize("text", ["one part", WORDS[:150]])
async def test_a_retry_while_a_lapsed_send_may_still_post_is_refused_until_it_records(
    stack: Stack, text: str
) -> None:
    """A send lease lapsed while the last part (a one-part text: the text) was on its
    way, and the expiry made the row deliveryUnknown. An operator's Retry clicked before
    that send ended and recorded every part posted put the row back ``pending``: another
    relay posted the part again, and the record found the row changed (posted twice).
    Now such a Retry is a 409 ``delivery.in_flight`` naming the seconds left (the send's
    deadline after the lapse); a Confirm is still taken. Once the send records what it
    posted, a Retry is taken and posts nothing."""
    ahead = FakeClock(fake_clock(stack).now_ms() + SEND_LEASE_MS + 1)
    refused: list[TransitionError] = []

    async def lease_lapses(message: OutboundMessage) -> SendOutcome:
        other = Relay(stack.db, ahead, stack.ids, stack.channels)
        assert await other.expire_send_leases() == 1
        try:
            await retry_at(stack, ahead, message.delivery_id)
        except TransitionError as exc:  # (raised here, it would end the relay's send)
            refused.append(exc)
        return Sent("b")

    parts = len(split_text(text, 100))
    small = ScriptedChannel("slack", max_chars=100, script=[Sent("a")] * (parts - 1))
    small.script.append(lease_lapses)
    stack.channels["slack"] = small
    item_id, dlv = await seed_one(stack, text=lambda _: text)
    await drain(relay_for(stack))
    assert len(refused) == 1, "the Retry was taken while the send was posting"
    error = refused[0]
    assert error.rule == "delivery.in_flight" and error.status == 409
    window_s = -(-store_mod.IN_FLIGHT_AFTER_LAPSE_MS // 1000)
    assert error.retry_after_s == window_s and f"retry in {window_s} s" in error.message
    row = await delivery(stack, dlv["id"])
    assert row["status"] == "deliveryUnknown" and row["error"] == outcomes_mod.ALL_POSTED_ERROR
    assert row["lease_expires_at"] is None  # recorded: the send is over
    await retry_at(stack, fake_clock(stack), dlv["id"])
    await drain(relay_for(stack))
    assert small.texts() == split_text(text, 100)  # nothing posted twice
    assert (await delivery(stack, dlv["id"]))["status"] == "sent"
    assert (await item(stack, item_id))["status"] == "completed"


@pytest.mark.parametrize("action", ["retry", "confirm"])
async def test_a_lapsed_send_that_never_ends_holds_a_retry_for_its_deadline_only(
    stack: Stack, action: str
) -> None:
    """A relay that claimed a post and then stopped (no outcome, no record): its Retry
    is refused until the lapsed send's deadline has passed, to the second, and then
    taken; a Confirm is taken at once."""
    relay = relay_for(stack)
    _, dlv = await seed_one(stack)
    [claimed] = await relay.claim()
    lapse = int(claimed.lease_expires_at or 0)
    assert await relay_for(stack).expire_send_leases() == 0
    fake_clock(stack).advance(lapse + 1 - stack.clock.now_ms())
    assert await relay_for(stack).expire_send_leases() == 1
    assert (await delivery(stack, dlv["id"]))["lease_expires_at"] == lapse
    end = lapse + store_mod.IN_FLIGHT_AFTER_LAPSE_MS
    if action == "confirm":
        async with stack.db.tx() as conn:
            row = Delivery(**await delivery(stack, dlv["id"]))
            done = await recover(conn, stack.clock, stack.ids, row, action="confirm", actor="u")
        assert done.status == "sent" and done.lease_expires_at is None
        return
    with pytest.raises(TransitionError) as caught:
        await retry_at(stack, FakeClock(end - 1), dlv["id"])
    assert (caught.value.rule, caught.value.retry_after_s) == ("delivery.in_flight", 1)
    assert (await delivery(stack, dlv["id"]))["status"] == "deliveryUnknown"
    done = await retry_at(stack, FakeClock(end), dlv["id"])
    assert done.status == "pending" and done.lease_expires_at is None


async def test_an_all_posted_record_that_meets_a_database_fault_is_kept_and_holds_a_retry(
    stack: Stack,
) -> None:
    """The record that every part was posted (its send lease lapsed meanwhile) met a
    database fault: the row stayed as the expiry left it, and an operator's Retry put it
    back ``pending`` and another send posted the text again. Now the relay keeps the
    record and writes it once the database answers; until then a Retry is refused
    (``delivery.in_flight``); then it is taken and posts nothing."""
    ahead = FakeClock(fake_clock(stack).now_ms() + SEND_LEASE_MS + 1)

    async def lease_lapses(message: OutboundMessage) -> SendOutcome:
        assert await Relay(stack.db, ahead, stack.ids, stack.channels).expire_send_leases() == 1
        return Sent("a")

    small = ScriptedChannel("slack", max_chars=100, script=[lease_lapses])
    stack.channels["slack"] = small
    item_id, dlv = await seed_one(stack, text=lambda _: "one part")
    real = outcomes_mod.OutcomeCommitter._record_all_posted
    down = [True]

    async def record(self: Any, conn: Conn, lost: list[Done], now: int) -> None:
        if down[0]:
            raise Unavailable("database went away mid-record", rule="service.unavailable")
        await real(self, conn, lost, now)

    relay = relay_for(stack)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(outcomes_mod.OutcomeCommitter, "_record_all_posted", record)
        mp.setattr(relay_mod, "COMMIT_RETRY_DELAYS_S", (0.0,))
        with contextlib.suppress(Unavailable):
            await relay.run_once()
        row = await delivery(stack, dlv["id"])
        assert row["status"] == "deliveryUnknown"
        assert row["error"] == relay_mod.LEASE_EXPIRED_ERROR  # not recorded yet
        with pytest.raises(TransitionError) as caught:
            await retry_at(stack, ahead, dlv["id"])
        assert caught.value.rule == "delivery.in_flight"
        down[0] = False
        await drain(relay)
    row = await delivery(stack, dlv["id"])
    assert row["error"] == outcomes_mod.ALL_POSTED_ERROR and row["lease_expires_at"] is None
    await retry_at(stack, fake_clock(stack), dlv["id"])
    await drain(relay_for(stack))
    assert small.texts() == ["one part"]  # nothing posted twice
    assert (await delivery(stack, dlv["id"]))["status"] == "sent"
    assert (await item(stack, item_id))["status"] == "completed"


@pytest.mark.parametrize("url", ["postgres"], indirect=True)
async def test_a_group_committed_again_after_its_record_fault_counts_its_sent_posts_once(
    stack: Stack,
) -> None:
    """PostgreSQL commits a group of posts in one statement, then records the posts
    whose send lease was lost meanwhile (all posted, left ``deliveryUnknown``) in a
    transaction of its own. When that record met a database fault, the relay committed
    the whole group again: the posts the statement had marked sent were no longer
    ``sending``, and each was counted (and logged) a second time, as a lease lost. Now
    only the record is committed again: each post is counted once, as what became of
    it."""
    _, lapsing = await seed_one(stack)
    [lost_row] = await relay_for(stack).claim()
    assert lost_row.id == lapsing["id"]
    fake_clock(stack).advance(SEND_LEASE_MS // 2)
    _, kept = await seed_one(stack)
    [sent_row] = await relay_for(stack).claim()
    assert sent_row.id == kept["id"]
    lapse = FakeClock(int(lost_row.lease_expires_at or 0) + 1)
    assert await Relay(stack.db, lapse, stack.ids, stack.channels).expire_send_leases() == 1
    group = [
        Done(sent_row, Sent("p1"), 1, "p1", 10),
        Done(lost_row, Sent("p2"), 1, "p2", 10),
    ]
    real = outcomes_mod.OutcomeCommitter._record_all_posted
    down = [True]

    async def record(self: Any, conn: Conn, lost: list[Done], now: int) -> None:
        if down[0]:
            down[0] = False
            raise Unavailable("database went away mid-record", rule="service.unavailable")
        await real(self, conn, lost, now)

    before = (deliveries_counted("slack", "sent"), deliveries_counted("slack", "leaseLost"))
    relay = relay_for(stack)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(outcomes_mod.OutcomeCommitter, "_record_all_posted", record)
        with pytest.raises(Unavailable):
            await relay.complete(group)
        assert [d.row.id for d in group] == [lost_row.id]  # only its record is left
        await relay.complete(group)
    after = (deliveries_counted("slack", "sent"), deliveries_counted("slack", "leaseLost"))
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
    assert (await delivery(stack, sent_row.id))["status"] == "sent"
    row = await delivery(stack, lost_row.id)
    assert row["status"] == "deliveryUnknown" and row["error"] == outcomes_mod.ALL_POSTED_ERROR


async def test_a_text_partly_posted_whose_channel_is_gone_is_left_to_an_operator(
    stack: Stack,
) -> None:
    """A delivery with parts posted whose channel was no longer configured at its retry
    (a configuration reload) ended failed, its item with it: "never posted", though
    parts were, and no Retry could post the rest once the channel was back. Now it is
    deliveryUnknown, and an operator's Retry posts the rest."""
    small = ScriptedChannel("slack", max_chars=100, script=[Sent("a"), Retry("HTTP 429", 1)])
    stack.channels["slack"] = small
    item_id, dlv = await seed_one(stack, text=lambda _: WORDS)
    await drain(relay_for(stack))
    del stack.channels["slack"]
    fake_clock(stack).advance(60_000)
    await drain(relay_for(stack))
    row = await delivery(stack, dlv["id"])
    assert row["status"] == "deliveryUnknown"
    assert row["error"] == "after the parts posted (1): channel slack is not configured"
    assert (await item(stack, item_id))["status"] == "approved"
    stack.channels["slack"] = small
    async with stack.db.tx() as conn:
        await recover(
            conn, stack.clock, stack.ids, Delivery(**row), action="retry", actor="user:op"
        )
    await drain(relay_for(stack))
    posted = small.texts()[:1] + small.texts()[2:]  # (the second was refused)
    assert " ".join(posted).split() == WORDS.split()
    assert (await item(stack, item_id))["status"] == "completed"


async def test_one_send_deadline_covers_the_whole_delivery(stack: Stack) -> None:
    """Each part of a long text had its channel's whole send deadline: parts that were
    each slow kept the delivery past its send lease, whose lapse made it deliveryUnknown
    and threw the send's outcome away. Now the delivery has one deadline: each part gets
    what is left of it (``within_s``), and a part with nothing left is not sent, the
    parts before it recorded, the rest sent on the next attempt."""
    clock = fake_clock(stack)

    def slow(ms: int) -> Any:
        def answer(message: OutboundMessage) -> SendOutcome:
            clock.advance(ms)
            return Sent(f"ext-{message.idempotency_key}")

        return answer

    deadline_ms = int(SEND_DEADLINE_S * 1000)
    small = ScriptedChannel("slack", max_chars=100, script=[slow(20_000), slow(deadline_ms)])
    stack.channels["slack"] = small
    item_id, dlv = await seed_one(stack, text=lambda _: "x" * 350)
    await drain(relay_for(stack))
    i = dlv["id"]
    keys = part_keys(i, "x" * 350, 100)
    assert keys_sent(small) == keys[:2]
    assert [m.within_s for m in small.calls] == [None, SEND_DEADLINE_S - 20]
    row = await delivery(stack, i)
    assert row["status"] == "pending" and row["address"]["parts_posted"] == 2
    assert row["error"] == (
        f"part 3 of 4: the delivery's send deadline ({SEND_DEADLINE_S:g} s) ran out: "
        "not sent, on the next attempt"
    )
    clock.advance(60_000)
    await drain(relay_for(stack))
    assert keys_sent(small) == keys
    assert "".join(small.texts()) == "x" * 350
    row = await delivery(stack, i)
    assert (row["status"], row["external_id"]) == ("sent", f"ext-{i}")
    assert (await item(stack, item_id))["status"] == "completed"


async def test_a_clock_set_back_mid_send_gives_no_part_more_than_the_deadline(
    stack: Stack,
) -> None:
    """The time a delivery's parts took was the clock's now less its start: a clock set
    back a minute during the first part gave the next more than the whole send
    deadline. Now a step back counts as no time spent."""
    clock = fake_clock(stack)

    def set_back(message: OutboundMessage) -> SendOutcome:
        clock.advance(-60_000)
        return Sent("a")

    small = ScriptedChannel("slack", max_chars=100, script=[set_back])
    stack.channels["slack"] = small
    await seed_one(stack, text=lambda _: "x" * 250)
    await drain(relay_for(stack))
    assert [m.within_s for m in small.calls] == [None, SEND_DEADLINE_S, SEND_DEADLINE_S]


def test_split_text_edges() -> None:
    assert split_text("short", 100) == ["short"]
    assert split_text("x" * 250, 100) == ["x" * 100, "x" * 100, "x" * 50]
    assert "".join(split_text("x" * 40_001, 40_000)) == "x" * 40_001
    text = ("a" * 60 + " ") * 5
    parts = split_text(text, 100)
    assert all(len(p) <= 100 for p in parts)
    assert "".join(parts).replace(" ", "") == text.replace(" ", "")


# ----------------------------------------------------------------- operator recovery


async def unknown_delivery(stack: Stack, channel: ScriptedChannel) -> tuple[str, dict[str, Any]]:
    item_id, dlv = await seed_one(stack)
    channel.script = [Uncertain("timeout after writing")]
    await drain(relay_for(stack))
    row = await delivery(stack, dlv["id"])
    assert row["status"] == "deliveryUnknown"
    return item_id, row


async def test_recover_confirm_completes_the_item(stack: Stack, channel: ScriptedChannel) -> None:
    item_id, row = await unknown_delivery(stack, channel)
    async with stack.db.tx() as conn:
        await recover(
            conn, stack.clock, stack.ids, Delivery(**row), action="confirm", actor="user:op"
        )
    assert (await delivery(stack, row["id"]))["status"] == "sent"
    assert (await item(stack, item_id))["status"] == "completed"
    assert "deliveryConfirmed" in await audit_actions(stack, item_id)
    with pytest.raises(TransitionError):
        async with stack.db.tx() as conn:
            await recover(
                conn, stack.clock, stack.ids, Delivery(**row), action="retry", actor="user:op"
            )
    await drain(relay_for(stack))
    assert len(channel.calls) == 1


async def test_recover_retry_posts_once_more(stack: Stack, channel: ScriptedChannel) -> None:
    item_id, row = await unknown_delivery(stack, channel)
    woken: list[str] = []
    stack.db.on_commit(OUTBOX_TOPIC, lambda: woken.append("relay"))
    async with stack.db.tx() as conn:
        await recover(
            conn, stack.clock, stack.ids, Delivery(**row), action="retry", actor="user:op"
        )
    assert (await delivery(stack, row["id"]))["status"] == "pending"
    # Due again: the relays are told at commit, as for any enqueue (not at their poll).
    assert woken == ["relay"]
    await drain(relay_for(stack))
    await drain(relay_for(stack))
    final = await delivery(stack, row["id"])
    assert (final["status"], final["attempts"]) == ("sent", 2)
    assert (await item(stack, item_id))["status"] == "completed"
    assert [m.idempotency_key for m in channel.calls] == [row["id"], row["id"]]
    assert "deliveryRetried" in await audit_actions(stack, item_id)


# ------------------------------------------------------------------------- pipeline


async def test_pipeline_drains_many_with_bounded_concurrency_and_grouped_commits(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = ScriptedChannel("slack", delay_s=0.002)
    stack.channels["slack"] = slow
    seeded = await seed_items(stack.db, stack.clock, stack.ids, 300)
    replies = []
    async with stack.db.tx() as conn:
        for i in range(20):
            binding = binding_row(f"bnd_reply{i}", address=SLACK_ADDRESS)
            replies.append(
                await stack.outbox.enqueue_reply(
                    conn, org_id=seeded.org_id, binding=binding, text=f"r{i}"
                )
            )
    relay = relay_for(stack, batch=50, concurrency=8)
    commits: list[int] = []
    original = relay.committer.commit

    async def counting(conn: Any, done: list[Any], now: int) -> None:
        commits.append(len(done))
        await original(conn, done, now)

    alone = relay.committer.commit_alone

    async def counting_alone(db: Any, done: list[Any], now: int) -> bool:
        committed = await alone(db, done, now)
        if committed:
            commits.append(len(done))
        return committed

    monkeypatch.setattr(relay.committer, "commit", counting)
    monkeypatch.setattr(relay.committer, "commit_alone", counting_alone)
    assert await drain(relay) >= 1
    assert slow.max_in_flight <= 8
    assert sorted(slow.texts()) == sorted(
        [f"approved output #{i}" for i in range(300)] + [f"r{i}" for i in range(20)]
    )
    assert sum(commits) == 320 and len(commits) < 320
    async with stack.db.read() as conn:
        statuses = {
            str(r.status): int(r.n)
            for r in (
                await conn.execute(
                    sa.select(t.work_items.c.status, sa.func.count().label("n")).group_by(
                        t.work_items.c.status
                    )
                )
            ).all()
        }
        sent = await conn.scalar(
            sa.select(sa.func.count()).where(t.deliveries.c.status == DeliveryStatus.sent.value)
        )
        audits = await conn.scalar(
            sa.select(sa.func.count()).where(t.audit.c.action == "delivered")
        )
    assert statuses == {"completed": 300}
    assert sent == 320 and audits == 300


async def test_a_replica_holds_about_two_rounds_of_sends_not_a_whole_batch(
    stack: Stack, channel: ScriptedChannel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relay whose sends are slow (concurrency 2, batch 100) claims what it can start
    within about two rounds (2 in flight + 4 queued), not a whole batch: another replica
    takes the rest meanwhile instead of waiting for this one to work through it."""
    await seed_items(stack.db, stack.clock, stack.ids, 40)
    channel.gate = asyncio.Event()
    both_sending = asyncio.Event()
    send = channel.send

    async def counted(message: OutboundMessage) -> SendOutcome:
        if len(channel.calls) == 1:  # this is the second send
            both_sending.set()
        return await send(message)

    monkeypatch.setattr(channel, "send", counted)
    slow = relay_for(stack, batch=100, concurrency=2)
    other = relay_for(stack, batch=100, concurrency=64)
    run = asyncio.create_task(slow.run_once())
    try:
        async with asyncio.timeout(5):
            await both_sending.wait()
        counts = await delivery_counts(stack.db)
        assert counts == {"sending": 6, "pending": 34}, counts
        assert len(await other.claim()) == 34  # the other replica's, to send meanwhile
    finally:
        channel.gate.set()
        await run
    assert len(channel.calls) == 6
    assert await delivery_counts(stack.db) == {"sent": 6, "sending": 34}


async def test_a_claim_takes_at_most_its_limit(stack: Stack) -> None:
    # On PostgreSQL, UPDATE ... WHERE id IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)
    # may evaluate the subquery repeatedly and claim everything: it must not.
    await seed_items(stack.db, stack.clock, stack.ids, 40)
    relay = relay_for(stack)
    first = await relay.claim(10)
    second = await relay.claim(10)
    assert len(first) == 10 and len(second) == 10
    assert not {r.id for r in first} & {r.id for r in second}
    assert len({r.lease_token for r in first}) == 1
    assert (await delivery_counts(stack.db)) == {"pending": 20, "sending": 20}


@pytest.mark.parametrize("url", ["sqlite"], indirect=True)
async def test_batch_statements_look_rows_up_by_id_not_by_status(stack: Stack) -> None:
    """SQLite plans without statistics: ``WHERE id IN (...) AND status = 'pending'`` used
    the status index and read every row in that status (the whole backlog, on every
    batch), and ``ORDER BY next_attempt_at, id`` sorted every row sharing a timestamp
    before the claim's ``LIMIT``. The relay's batch statements (claim, mark sent, the items'
    move to completed) must look their rows up by primary key, and the claims read their
    order off the index. (PostgreSQL plans from statistics; the same statements run there
    in every other test of this module.)"""
    await seed_items(stack.db, stack.clock, stack.ids, 30)  # one timestamp: one burst
    with stack.db.record_statements() as statements:
        assert await drain(relay_for(stack, batch=10)) >= 1
    assert await delivery_counts(stack.db) == {"sent": 30}
    batch = [
        sql
        for sql in statements
        if sql.startswith(("UPDATE deliveries", "UPDATE work_items")) and " IN (" in sql
    ]
    claims = [sql for sql in batch if "status='sending'" in sql.replace(" ", "")]
    assert claims and len(batch) > len(claims)
    async with stack.db.read() as conn:
        for sql in batch:
            table = sql.split()[1]
            plan = [
                str(r[-1]) for r in (await conn.execute(sa.text("EXPLAIN QUERY PLAN " + sql))).all()
            ]
            assert plan[0] == f"SEARCH {table} USING INDEX sqlite_autoindex_{table}_1 (id=?)", (
                sql,
                plan,
            )
            assert not any("TEMP B-TREE" in step for step in plan), (sql, plan)


async def test_run_once_is_false_when_idle(stack: Stack) -> None:
    assert await relay_for(stack).run_once() is False


async def test_in_process_wake_delivers_without_waiting_for_the_poll(
    app: App, channel: ScriptedChannel
) -> None:
    stack = app  # the composition root's wiring is what this test is about
    seeded = await seed_items(stack.db, stack.clock, stack.ids, 1, status="awaitingHuman")
    posted = asyncio.Event()

    def mark(_: Any) -> Sent:
        posted.set()
        return Sent("x")

    channel.script = [mark]
    await stack.start_runners()  # poll interval 30 s: only a wake-up can be this fast
    # A delivery the local hand-off does not carry (as when the relay has no room): the
    # row is written pending, and only the wake at commit (or NOTIFY) reaches the relay.
    # Handed over, the row would reach the relay whatever the wake did.
    stack.outbox.attach(None)
    await asyncio.sleep(0.2)  # let the loops go idle
    async with stack.db.tx() as conn:
        row = await workitems.get(conn, seeded.items[0]["id"])
        await decisions.human_approve(conn, stack.outbox, row, "user:test")
    started = time.perf_counter()
    await asyncio.wait_for(posted.wait(), timeout=10)
    # Woken at commit, not at the 30 s poll: a tenth of it (0.1 s, a wake-up's time on an
    # idle machine, was within reach of a loaded one).
    assert time.perf_counter() - started < 3.0


def test_relay_rejects_nonsense_settings() -> None:
    with pytest.raises(ValueError):
        Relay(None, None, None, {}, send_lease_ms=0)  # type: ignore[arg-type]


# ------------------------------------------------------------------ local hand-off


async def test_running_service_hands_approvals_to_its_relay_without_a_claim(
    app: App, channel: ScriptedChannel, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = app  # the composition root's wiring is what this test is about
    seeded = await seed_items(stack.db, stack.clock, stack.ids, 3, status="awaitingHuman")
    # Rows claimed per claim, on either backend (SQLite claims inside the outcome
    # transaction, PostgreSQL in a statement of its own).
    claims: list[int] = []
    claim_in, claim_alone = stack.relay._claim_in, stack.relay._claim_alone

    async def counting_in(conn: Conn, limit: int, token: str) -> list[Delivery]:
        rows = await claim_in(conn, limit, token)
        claims.append(len(rows))
        return rows

    async def counting_alone(limit: int, token: str) -> list[Delivery]:
        rows = await claim_alone(limit, token)
        claims.append(len(rows))
        return rows

    monkeypatch.setattr(stack.relay, "_claim_in", counting_in)
    monkeypatch.setattr(stack.relay, "_claim_alone", counting_alone)
    posted = asyncio.Event()

    def mark(_: Any) -> Sent:
        if len(channel.calls) == 2:
            posted.set()
        return Sent("ts")

    channel.script = [mark, mark]
    await stack.start_runners()
    await asyncio.sleep(0.2)
    async with stack.db.tx() as conn:
        row = await workitems.get(conn, seeded.items[0]["id"])
        await decisions.human_approve(conn, stack.outbox, row, "user:test")
        async with stack.db.read() as peek:  # not visible (nor handed over) before commit
            assert await for_item(peek, row.id) == []
    # A transaction that rolls back hands nothing over and posts nothing.
    with pytest.raises(RuntimeError):
        async with stack.db.tx() as conn:
            row = await workitems.get(conn, seeded.items[1]["id"])
            await decisions.human_approve(conn, stack.outbox, row, "user:test")
            raise RuntimeError("rolled back")
    async with stack.db.tx() as conn:
        row = await workitems.get(conn, seeded.items[2]["id"])
        await decisions.human_approve(conn, stack.outbox, row, "user:test")
    await asyncio.wait_for(posted.wait(), timeout=5)

    async def completed() -> bool:
        return bool((await item(stack, seeded.items[2]["id"]))["status"] == "completed")

    await eventually(completed, what="the third item completed")
    assert [m.text for m in channel.calls] == [
        seeded.items[0]["snapshot"],
        seeded.items[2]["snapshot"],
    ]
    async with stack.db.read() as conn:
        first = (await for_item(conn, seeded.items[0]["id"]))[0]._asdict()
        assert await for_item(conn, seeded.items[1]["id"]) == []
    assert (first["status"], first["attempts"], first["lease_token"]) == ("sent", 1, None)
    assert (await item(stack, seeded.items[0]["id"]))["status"] == "completed"
    assert (await item(stack, seeded.items[1]["id"]))["status"] == "awaitingHuman"
    assert all(n == 0 for n in claims), claims  # never needed a claim


async def test_handed_over_rows_not_started_go_back_to_pending_at_shutdown(
    stack: Stack, channel: ScriptedChannel
) -> None:
    relay = relay_for(stack)
    seeded = await seed_items(stack.db, stack.clock, stack.ids, 1, with_deliveries=False)
    stack.db.on_commit_payloads(HANDOFF_TOPIC, relay.accept)
    stack.outbox.attach(relay)
    try:
        async with stack.db.tx() as conn:
            item_row = await workitems.get(conn, seeded.items[0]["id"])
            gating = await stack.outbox.gating_row(conn, item_row)
            values = (await stack.outbox.write_gating(conn, gating))._asdict()
    finally:
        stack.outbox.attach(None)
        stack.db.off_commit_payloads(HANDOFF_TOPIC, relay.accept)
    row = await delivery(stack, values["id"])
    assert (row["status"], row["lease_token"], row["attempts"]) == (
        "sending",
        relay.handoff_token,
        1,
    )
    assert [r.id for r in relay._handed] == [values["id"]]
    assert await relay.release_handoffs() == 1
    row = await delivery(stack, values["id"])
    assert (row["status"], row["lease_token"], row["attempts"]) == ("pending", None, 0)
    await drain(relay_for(stack))
    assert len(channel.calls) == 1
    assert (await delivery(stack, values["id"]))["status"] == "sent"


@pytest.mark.parametrize("url", ["postgres"], indirect=True)
async def test_a_claim_that_skips_a_locked_due_row_claims_again_soon(
    stack: Stack, channel: ScriptedChannel
) -> None:
    """PostgreSQL: the one due delivery is row-locked by another transaction (held open
    here; in the service a fenced move that lost its race for the row keeps the lock to
    its commit, with no wake-up after it: an outcome commit beside the send lease expiry
    that put the row back to ``pending``, or a second operator retry of the same
    delivery). A claim beside it takes nothing, but does not take the outbox for empty:
    the relay's loop sleeps at most LOCKED_RECHECK_MS, not the poll, and its next pass
    claims though nothing poked it. Once the lock is gone that pass sends the row; then
    an idle pass makes no statement and nothing is due."""
    relay = stack.relay  # poked on every enqueue: an empty claim is believed
    _, row = await seed_one(stack)  # bulk insert: no poke
    lock = sa.select(t.deliveries.c.id).where(t.deliveries.c.id == row["id"]).with_for_update()
    async with held_open(stack.db, lambda conn: conn.execute(lock)):
        with stack.db.record_statements() as statements:
            assert await relay.run_once() is False
        # the send lease check, then the claim: one statement
        assert [sql.split()[0] for sql in statements] == ["SELECT", "WITH"], statements
        assert (await delivery(stack, row["id"]))["status"] == "pending"
        assert relay.due_in_s() == LOCKED_RECHECK_MS / 1000
    assert await relay.run_once() is True  # not poked since, not past the recheck
    assert (await delivery(stack, row["id"]))["status"] == "sent"
    assert len(channel.calls) == 1
    with stack.db.record_statements() as statements:
        assert await relay.run_once() is False
    assert statements == []
    assert relay.due_in_s() is None


async def test_a_poked_relay_claims_and_an_idle_one_does_not_spin(
    stack: Stack, channel: ScriptedChannel
) -> None:
    relay = stack.relay  # the stack pokes it on every committed enqueue
    assert relay.poked_on_enqueue
    assert await relay.run_once() is False  # nothing due: one empty claim
    await seed_items(stack.db, stack.clock, stack.ids, 1)  # bulk insert: no poke
    assert await relay.run_once() is False  # found nothing a moment ago, not poked
    fake_clock(stack).advance(relay_mod.CLAIM_RECHECK_MS)
    assert await relay.run_once() is True  # periodic re-check finds it
    async with stack.db.tx() as conn:
        await stack.outbox.enqueue_reply(
            conn, org_id="org_x", binding=binding_row("bnd_x"), text="poked"
        )
    assert await relay.run_once() is True  # the enqueue poked it
    assert channel.texts()[-1] == "poked"
    # Its own retries are claimed as soon as they are due, without waiting for the
    # periodic re-check.
    relay.rand = lambda: 0.0  # backoff 0.5 s; Retry-After 0.6 s wins
    channel.script = [Retry("HTTP 503", delay_s=0.6)]
    await seed_items(stack.db, stack.clock, stack.ids, 1, text=lambda _: "retried")
    fake_clock(stack).advance(relay_mod.CLAIM_RECHECK_MS)
    await drain(relay)
    assert channel.texts()[-1] == "retried"
    fake_clock(stack).advance(600)
    await drain(relay)
    assert channel.texts()[-2:] == ["retried", "retried"]


async def test_a_claim_whose_commit_is_uncertain_is_sent_once_without_waiting_the_lease(
    stack: Stack, channel: ScriptedChannel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim committed but the relay was told it failed (the connection dropped at
    COMMIT): its rows go back to pending at the next run, not after the 2-minute send
    lease, and are posted exactly once."""
    org = await make_org(stack)
    item_id = await gated_item(stack, org, BindingSpec(BindingKind.slack, address=SLACK_ADDRESS))
    await drain(stack.lead_runner)
    # (on PostgreSQL the claim is one statement there.) A SQLite COMMIT is never in
    # doubt; on SQLite this runs the same give-back of a claim that failed, which does
    # not depend on the backend (nor on the fault's being in doubt).
    lose_the_next_commit(monkeypatch, stack.db, alone=stack.db.is_postgres, sqlite_too=True)
    with pytest.raises(Unavailable) as raised:
        await stack.relay.claim()
    assert raised.value.in_doubt
    async with stack.db.read() as conn:
        (dlv,) = [d._asdict() for d in await for_item(conn, item_id)]
    assert dlv["status"] == "sending"  # the claim did land
    await drain(stack.relay)
    assert len(channel.calls) == 1
    async with stack.db.read() as conn:
        (dlv,) = [d._asdict() for d in await for_item(conn, item_id)]
    assert (dlv["status"], dlv["attempts"]) == ("sent", 1)
    assert (await item(stack, item_id))["status"] == "completed"


@pytest.mark.parametrize("url", ["postgres"], indirect=True)
async def test_a_claim_in_doubt_that_lands_after_its_give_back_is_sent_once_soon(
    stack: Stack, channel: ScriptedChannel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim's answer was lost, the next pass's give-back found nothing under its
    token, and then the server applied the claim: the row is ``sending`` under a token
    nobody holds. The give-back is tried again a second later and the post is sent
    once; it sat there for the 2-minute send lease and then went to an operator as an
    uncertain send (``deliveryUnknown``), though nothing had been sent. (PostgreSQL
    only: a SQLite COMMIT is never in doubt.)"""
    org = await make_org(stack)
    item_id = await gated_item(stack, org, BindingSpec(BindingKind.slack, address=SLACK_ADDRESS))
    await drain(stack.lead_runner)
    late = LandsLater(stack.db.write_alone)
    monkeypatch.setattr(stack.db, "write_alone", late)
    with pytest.raises(Unavailable) as raised:
        await stack.relay.claim()
    assert raised.value.in_doubt
    # The next pass's give-back finds nothing (its claim would come next; the claim on
    # its way holds the row, and SKIP LOCKED passes it by, which LandsLater does not
    # model).
    assert await stack.relay.release_uncertain_claims() == 0
    await late.land()
    async with stack.db.read() as conn:
        (dlv,) = await for_item(conn, item_id)
    assert dlv.status == "sending"
    due = stack.relay.due_in_s()
    fake_clock(stack).advance(1_000)  # a second on, not the send lease's 2 minutes
    await drain(stack.relay)
    assert len(channel.calls) == 1
    async with stack.db.read() as conn:
        (dlv,) = await for_item(conn, item_id)
    assert (dlv.status, dlv.attempts) == ("sent", 1)
    assert (await item(stack, item_id))["status"] == "completed"
    assert due is not None and due <= 1.0  # the relay's loop woke for the try
