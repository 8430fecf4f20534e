"""Review cards through the outbox (leadgate/review/cards.py) on the real Stack and
database: one card per destination in the transaction that made the item wait, never
a gating delivery, updated in place after any decision, cut to each channel's limits."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import sqlalchemy as sa

from bots import discord_review, slack_review, teams_review
from leadgate.core.clock import RandomIds
from leadgate.core.errors import TransitionError, Unavailable
from leadgate.core.runners import drain
from leadgate.database import schema as t
from leadgate.database.db import Conn
from leadgate.database.schema import metadata
from leadgate.domain import workitems
from leadgate.domain.rows import Delivery
from leadgate.operations.chat_reviews import ChatAnswer
from leadgate.review import decisions, queue
from leadgate.review import destinations as dest
from leadgate.review.cards import _CARD_EPISODE, card_episode, plain_text
from leadgate.review.facts import review_facts
from leadgate.runners.revisions import RevisionRunner
from outbox.channel import Card, CardOutcome, Permanent, Retry, Sent, Uncertain
from outbox.outcomes import Done
from outbox.relay import LEASE_EXPIRED_ERROR, Relay
from outbox.store import CARD_CLOSED_AT, HANDOFF_TOPIC, SEND_LEASE_MS, get_delivery
from tests.fakes import lose_the_next_commit
from tests.helpers import (
    PHISH,
    api_trigger,
    blocked_on_a_lock,
    counted,
    deliveries_counted,
    held_open,
    item_audit,
    make_agent,
    session_item,
    sqlite_plan,
    transitions_counted,
)
from tests.review_support import (
    PUBLIC_URL,
    REVIEW_CHANNEL,
    ReviewEnv,
    add_destination,
    review_env,
    slack_trigger,
)
from tests.stack import Stack


async def approve(env: ReviewEnv, item_id: str, actor: str = "user:x", **kw: Any) -> None:
    async with env.stack.db.tx() as conn:
        item = await workitems.get(conn, item_id)
        await decisions.decide(conn, env.stack.outbox, item, "approve", actor, **kw)


async def test_an_escalation_writes_one_card_per_destination_not_a_gating_delivery(
    make_stack: Callable[..., Stack],
) -> None:
    env = await review_env(make_stack)
    item_id = await env.escalated("s1")

    cards = await env.deliveries(item_id, "card")
    # The escalate tier gets nothing yet; the notify tier one card, pending in the outbox.
    assert [(c["channel"], c["address"]["channel"], c["status"]) for c in cards] == [
        ("slack", REVIEW_CHANNEL, "pending")
    ]
    assert not await env.deliveries(item_id, "gating")
    [episode] = await env.episodes(item_id)
    assert episode["reason"] == "awaitingHuman" and episode["closed_at"] is None
    assert episode["due_at"] == episode["started_at"] + 30 * 60_000  # remind_after 30m

    card = Card.from_json(cards[0]["address"]["card"])
    assert card.item_id == item_id and card.episode_id == episode["id"]
    assert card.agent == "worker"
    assert card.why == "The lead escalated it: Needs a human."
    assert card.source == "the REST / MCP API"
    assert card.summary == "Summary: hard #escalate"
    assert (card.revision, card.rounds) == (0, 3)
    assert card.link == f"{PUBLIC_URL}/console/#/review/{item_id}"
    assert "Review it: " + card.link in cards[0]["text"]

    # The actionable queue is unchanged by cards; the detail lists the card delivery.
    async with env.stack.db.read() as conn:
        page = await queue.actionable(conn, env.org.id)
        detail = await queue.detail(conn, env.org.id, item_id)
    assert [i["id"] for i in page["items"]] == [item_id]
    assert [(d["channel"], d["status"]) for d in detail["deliveries"]] == [("slack", "pending")]

    await drain(env.stack.relay)
    [posted] = env.slack.calls
    assert posted.kind == "card" and posted.card == card
    assert (await env.deliveries(item_id, "card"))[0]["status"] == "sent"
    async with env.stack.db.read() as conn:
        assert (await workitems.get(conn, item_id)).status == "awaitingHuman"


async def test_a_decision_updates_posted_cards_and_cancels_unsent_ones(
    make_stack: Callable[..., Stack],
) -> None:
    env = await review_env(make_stack, remind_after="1m")
    item_id = await env.escalated("s1")
    await drain(env.stack.relay)  # the first card is posted (ext-1)
    env.stack.clock.advance(60_000)
    assert await env.sla.run_once()  # a reminder card, not posted yet
    reminder = (await env.deliveries(item_id, "card"))[-1]
    assert reminder["status"] == "pending"
    cancelled = deliveries_counted("slack", "cancelled")

    await approve(env, item_id, "user:x", surface="slack", identity="slack:T1:U1")

    cards = await env.deliveries(item_id, "card")
    assert [c["status"] for c in cards] == ["sent", "cancelled"]
    # The unsent one ended unsent because its item was decided: counted so, once.
    assert deliveries_counted("slack", "cancelled") - cancelled == 1
    [update] = await env.deliveries(item_id, "cardUpdate")
    assert update["address"]["card_delivery_id"] == cards[0]["id"]
    decided = Card.from_json(update["address"]["card"])
    assert decided.outcome is not None
    assert (decided.outcome.title, decided.outcome.surface) == ("Approved", "slack")
    [episode] = await env.episodes(item_id)
    assert episode["closed_at"] is not None and episode["outcome"] == "Approved"

    await drain(env.stack.relay)
    [(edited, message)] = env.slack.updates
    assert edited == cards[0]["external_id"]
    assert message.card == decided
    statuses = {d["kind"]: d["status"] for d in await env.deliveries(item_id)}
    # The approval's gating delivery is an api reveal: the item completes on it alone.
    assert statuses == {"gating": "sent", "card": "cancelled", "cardUpdate": "sent"}
    async with env.stack.db.read() as conn:
        assert (await workitems.get(conn, item_id)).status == "completed"


async def decide(env: ReviewEnv, item_id: str, action: str, text: str | None = None) -> None:
    async with env.stack.db.tx() as conn:
        item = await workitems.get(conn, item_id)
        await decisions.decide(conn, env.stack.outbox, item, action, "user:x", text)


async def test_an_earlier_waits_card_edit_is_sent_after_its_item_is_cancelled(
    make_stack: Callable[..., Stack],
) -> None:
    """A Return queues the edit of its wait's card (it shows "Returned to the worker"); the item is
    cancelled before the relay sends it. The edit is still sent: what it shows was so.
    It was cancelled with the item's unsent deliveries, and the card kept its buttons."""
    env = await review_env(make_stack)
    item_id = await env.escalated("s1")
    await drain(env.stack.relay)  # the card is posted
    await decide(env, item_id, "return", "More detail.")
    [update] = await env.deliveries(item_id, "cardUpdate")
    assert update["status"] == "pending"
    cancelled = deliveries_counted("slack", "cancelled")

    await decide(env, item_id, "cancel")

    await drain(env.stack.relay)
    [card] = await env.deliveries(item_id, "card")
    [(edited, message)] = env.slack.updates
    assert edited == card["external_id"]
    assert message.card is not None and message.card.outcome is not None
    assert message.card.outcome.title == "Returned to the worker"
    assert [d["status"] for d in await env.deliveries(item_id, "cardUpdate")] == ["sent"]
    assert deliveries_counted("slack", "cancelled") == cancelled


async def test_an_update_waits_for_its_card_and_gives_up_when_it_never_posted(
    make_stack: Callable[..., Stack],
) -> None:
    env = await review_env(make_stack)
    first = await env.escalated("s1")
    second = await env.escalated("s2")
    # Both cards are claimed (sending) when the decisions come: updates must wait.
    claimed = await env.stack.relay.claim()
    assert len(claimed) == 2
    await approve(env, first)
    await approve(env, second)
    for item_id in (first, second):
        assert len(await env.deliveries(item_id, "cardUpdate")) == 1
    await drain(env.stack.relay)  # the updates find their cards still sending: Retry
    assert not env.slack.updates
    updates = [(await env.deliveries(i, "cardUpdate"))[0] for i in (first, second)]
    assert [u["status"] for u in updates] == ["pending", "pending"]
    assert all(u["error"] == "the card is not posted yet" for u in updates)

    env.slack.script = [Sent("1700.1"), Permanent("channel_not_found")]
    for done in [await env.stack.relay.deliver(row) for row in claimed]:
        await env.stack.relay.complete([done])
    env.stack.clock.advance(10_000)
    await drain(env.stack.relay)
    posted = {m.card.item_id: ext for ext, m in env.slack.updates if m.card}
    assert posted == {claimed[0].work_item_id: "1700.1"}
    # The card was refused for good: its edit ends, never sent (it was failed, a second
    # failure about a card that was never posted).
    ended = (await env.deliveries(claimed[1].work_item_id or "", "cardUpdate"))[0]
    assert ended["status"] == "cancelled"
    assert ended["error"] == "the card was not posted (failed); nothing to update"


# ------------- cards whose relay died, or whose claim was in doubt, at decision time

REPLY_ADDRESS = "review@reviews.example.com"


async def slack_and_email_cards(make_stack: Callable[..., Stack]) -> ReviewEnv:
    """:func:`review_env` whose items also get an email card answerable by reply."""
    env = await review_env(make_stack, escalation=False)
    env.notifier.reply_address = REPLY_ADDRESS
    await add_destination(env.stack, env.org.id, "email", "lead@example.com")
    return env


async def test_cards_whose_relay_died_mid_send_end_cancelled_when_their_item_was_decided(
    make_stack: Callable[..., Stack],
) -> None:
    """A relay claims the cards of two items and dies mid-send; one item is decided
    meanwhile (the decision leaves its cards being sent to their send, and queues the
    Slack card's edit). When the send leases lapse, the decided item's cards end
    ``cancelled``, as a card whose send ended uncertain after the decision does (the
    email card's Reply-To token leaves its row), and count as ``cancelled``, not
    ``deliveryUnknown``: an operator has nothing to settle. The waiting item's cards are
    ``deliveryUnknown`` as before. Nothing is posted again."""
    env = await slack_and_email_cards(make_stack)
    decided = await env.escalated("s1")
    waiting = await env.escalated("s2")
    assert len(await env.stack.relay.claim()) == 4  # then the relay "dies"
    await approve(env, decided)
    [update] = await env.deliveries(decided, "cardUpdate")
    before = {
        (channel, outcome): deliveries_counted(channel, outcome)
        for channel in ("slack", "email")
        for outcome in ("cancelled", "deliveryUnknown")
    }
    env.stack.clock.advance(SEND_LEASE_MS + 1)
    survivor = Relay(env.stack.db, env.stack.clock, env.stack.ids, dict(env.channels))
    await drain(survivor)

    cards = {
        (i, c["channel"]): c for i in (decided, waiting) for c in await env.deliveries(i, "card")
    }
    for channel in ("slack", "email"):
        ended, unknown = cards[decided, channel], cards[waiting, channel]
        assert (ended["status"], ended["error"]) == ("cancelled", LEASE_EXPIRED_ERROR), ended
        assert (unknown["status"], unknown["error"]) == ("deliveryUnknown", LEASE_EXPIRED_ERROR)
    assert "reply_to" not in cards[decided, "email"]["address"]
    assert cards[waiting, "email"]["address"]["reply_to"].startswith("review+")  # (a retry)
    [ended_update] = await env.deliveries(decided, "cardUpdate")
    assert (ended_update["id"], ended_update["status"]) == (update["id"], "cancelled")
    assert [c for ch in env.channels.values() for c in ch.calls] == []
    assert env.slack.updates == []
    gained = {key: deliveries_counted(*key) - value for key, value in before.items()}
    assert gained == {
        ("slack", "cancelled"): 2.0,  # the card, and then its edit
        ("slack", "deliveryUnknown"): 1.0,
        ("email", "cancelled"): 1.0,
        ("email", "deliveryUnknown"): 1.0,
    }
    # Only the waiting item's cards are audited as uncertain (the decided one's are not).
    async with env.stack.db.read() as conn:
        audited = (
            await conn.execute(
                sa.select(t.audit.c.work_item_id).where(t.audit.c.action == "deliveryUnknown")
            )
        ).scalars()
        assert sorted(audited) == [waiting, waiting]


async def test_a_lapsed_card_taken_back_while_its_decision_commits_waits_for_the_decision(
    make_stack: Callable[..., Stack],
) -> None:
    """The decision has closed the card's wait (not committed yet, the card read as being
    sent: left to its send) when a relay takes back the card's lapsed send lease. It
    waits for the decision's commit (PostgreSQL: the wait's row locked; SQLite: the one
    writer) and then finds the wait closed: ``cancelled``. Reading the wait unlocked, it
    saw it open and left the card ``deliveryUnknown``, which the decision never saw."""
    env = await review_env(make_stack, escalation=False)
    item_id = await env.escalated("s1")
    [card] = await env.stack.relay.claim()  # then the relay "dies"
    env.stack.clock.advance(SEND_LEASE_MS + 1)

    async def decide(conn: Conn) -> None:
        item = await workitems.get(conn, item_id)
        await decisions.decide(conn, env.stack.outbox, item, "approve", "user:x")

    async with held_open(env.stack.db, decide):
        expiry = asyncio.create_task(env.stack.relay.expire_send_leases())
        await blocked_on_a_lock(env.stack.db, expiry)
    assert await expiry == 1
    [row] = await env.deliveries(item_id, "card")
    assert (row["id"], row["status"]) == (card.id, "cancelled")
    await drain(env.stack.relay)
    [update] = await env.deliveries(item_id, "cardUpdate")
    assert update["status"] == "cancelled" and env.slack.calls == []


async def test_a_card_recovery_that_meets_its_decision_names_the_status_and_the_decision(
    make_stack: Callable[..., Stack],
) -> None:
    """An operator confirms an email card whose post was uncertain while a decision on
    its item, not committed yet, has cancelled it (a mailed card cannot be edited or
    answered after the decision). The recovery read the card ``deliveryUnknown`` before
    the decision committed (PostgreSQL; SQLite's one writer queues it after), and its
    fenced update matched nothing: the 409 names the card's status now and the decision
    that ended it. It said "is deliveryUnknown, not deliveryUnknown", the status it had
    read, and named nobody."""
    env = await slack_and_email_cards(make_stack)
    item_id = await env.escalated("s1")
    env.channels["email"].script = [Uncertain("timeout after the DATA command")]
    await drain(env.stack.relay)
    cards = {c["channel"]: c for c in await env.deliveries(item_id, "card")}
    assert cards["email"]["status"] == "deliveryUnknown"

    async def decide(conn: Conn) -> None:
        item = await workitems.get(conn, item_id)
        await decisions.decide(conn, env.stack.outbox, item, "approve", "user:x", surface="slack")

    async def confirm() -> Delivery:
        async with env.stack.db.tx() as conn:
            stale = await get_delivery(conn, cards["email"]["id"], env.org.id)
            return await decisions.recover_delivery(
                conn, env.stack.outbox, stale, "confirm", "user:y", surface="api"
            )

    async with held_open(env.stack.db, decide):
        recovery = asyncio.create_task(confirm())
        await blocked_on_a_lock(env.stack.db, recovery)
    with pytest.raises(TransitionError) as refused:
        await recovery
    assert refused.value.rule == "delivery.status"
    assert re.fullmatch(
        f"delivery {cards['email']['id']} is cancelled, not deliveryUnknown: approve of its"
        r" work item by user:x \(slack\) at \d{4}-\S+; only an uncertain delivery can be"
        " confirmed or retried",
        str(refused.value),
    ), str(refused.value)
    [card] = [c for c in await env.deliveries(item_id, "card") if c["channel"] == "email"]
    assert card["status"] == "cancelled"


@pytest.mark.parametrize("then", ["decided", "waiting"])
async def test_a_card_claim_in_doubt_is_cancelled_not_given_back_when_its_item_was_decided(
    make_stack: Callable[..., Stack], monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """The relay's claim of the cards committed, but it was told the COMMIT's answer was
    lost (in doubt); the item is decided before the relay gives the claim back (the
    decision reads the cards as being sent and leaves them to their send). Given back
    ``pending``, they were posted and mailed after the decision, offering a decision
    already made: they end ``cancelled`` (the email card's Reply-To token leaves its row)
    and the Slack card's edit with them. Still waiting, they go back and are sent once."""
    env = await slack_and_email_cards(make_stack)
    item_id = await env.escalated("s1")
    relay = env.stack.relay
    # On PostgreSQL the claim is one statement; a SQLite COMMIT is never in doubt, but
    # the give-back of a claim that failed does not depend on the backend.
    lose_the_next_commit(monkeypatch, env.stack.db, alone=env.stack.db.is_postgres, sqlite_too=True)
    with pytest.raises(Unavailable) as raised:
        await relay.claim()
    assert raised.value.in_doubt
    assert {c["status"] for c in await env.deliveries(item_id, "card")} == {"sending"}
    if then == "decided":
        await approve(env, item_id)
    before = {ch: deliveries_counted(ch, "cancelled") for ch in ("slack", "email")}
    await drain(relay)
    gained = {ch: deliveries_counted(ch, "cancelled") - n for ch, n in before.items()}

    cards = {c["channel"]: c for c in await env.deliveries(item_id, "card")}
    if then == "waiting":
        assert {c["status"] for c in cards.values()} == {"sent"}
        assert [c["attempts"] for c in cards.values()] == [1, 1]
        assert len(env.slack.calls) == len(env.channels["email"].calls) == 1
        assert gained == {"slack": 0, "email": 0}
        return
    assert {c["status"] for c in cards.values()} == {"cancelled"}
    # Counted as they ended, once each: the give-back's two cards and the Slack edit.
    assert gained == {"slack": 2, "email": 1}
    assert [c["attempts"] for c in cards.values()] == [0, 0]  # the claim was no attempt
    assert "reply_to" not in cards["email"]["address"]
    [update] = await env.deliveries(item_id, "cardUpdate")
    assert update["status"] == "cancelled"
    assert update["error"] == "the card was not posted (cancelled); nothing to update"
    assert env.slack.calls == env.channels["email"].calls == []
    assert env.slack.updates == []


async def test_a_card_handed_over_and_not_started_ends_cancelled_at_shutdown_if_decided(
    make_stack: Callable[..., Stack],
) -> None:
    """A card written already claimed for this process's relay (the local hand-off) and
    not started when the relay shuts down goes back to ``pending``, unless its item was
    decided meanwhile (the decision left the card, being sent, to its send): then it
    ends ``cancelled``, never posted after the decision (the same give-back serves a
    hand-off whose write was in doubt)."""
    env = await review_env(make_stack, escalation=False)
    stack = env.stack
    relay = Relay(stack.db, stack.clock, stack.ids, dict(env.channels))
    stack.db.on_commit_payloads(HANDOFF_TOPIC, relay.accept)
    stack.outbox.attach(relay)
    try:
        item_id = await env.escalated("s1")
    finally:
        stack.outbox.attach(None)
        stack.db.off_commit_payloads(HANDOFF_TOPIC, relay.accept)
    [card] = await env.deliveries(item_id, "card")
    assert (card["status"], card["lease_token"]) == ("sending", relay.handoff_token)
    await approve(env, item_id)
    cancelled = deliveries_counted("slack", "cancelled")
    assert await relay.release_handoffs() == 1
    [card] = await env.deliveries(item_id, "card")
    assert (card["status"], card["lease_token"], card["attempts"]) == ("cancelled", None, 0)
    assert deliveries_counted("slack", "cancelled") - cancelled == 1
    await drain(stack.relay)
    [update] = await env.deliveries(item_id, "cardUpdate")
    assert update["status"] == "cancelled"
    assert deliveries_counted("slack", "cancelled") - cancelled == 2  # and its edit
    assert env.slack.calls == [] and env.slack.updates == []


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_decision_in_doubt_whose_post_the_relay_finds_is_counted_then_once(
    make_stack: Callable[..., Stack], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A person approves an escalated Slack item; the decision writes its post claimed
    for this process's relay, and its COMMIT lands with its answer lost (in doubt: the
    person gets a 503). Nothing else looks for a decision: the relay's give-back of the
    post it was never handed shows the decision landed, and what the decision counts
    (its move) is counted then, once. It was not counted at all. (PostgreSQL only: a
    SQLite COMMIT is never in doubt.)"""
    env = await review_env(make_stack)
    stack = env.stack
    await stack.turns.run(slack_trigger(env, "hard #escalate #complete"))
    await drain(stack.lead_runner)
    item_id = await session_item(stack, "slack:T1:C9:1.1")
    relay = stack.relay
    stack.db.on_commit_payloads(HANDOFF_TOPIC, relay.accept)
    stack.db.on_doubt_payloads(HANDOFF_TOPIC, relay.in_doubt)
    stack.outbox.attach(relay)
    try:
        lose_the_next_commit(monkeypatch, stack.db, alone=False)
        moves = transitions_counted("awaitingHuman", "approved")
        with pytest.raises(Unavailable) as raised:
            await approve(env, item_id)
        assert raised.value.in_doubt
        [post] = await env.deliveries(item_id, "gating")
        assert (post["status"], post["lease_token"]) == ("sending", relay.handoff_token)
        assert transitions_counted("awaitingHuman", "approved") == moves
        await drain(relay)
        [post] = await env.deliveries(item_id, "gating")
        assert (post["status"], post["attempts"]) == ("sent", 1)
        assert transitions_counted("awaitingHuman", "approved") - moves == 1
        await drain(relay)
        assert transitions_counted("awaitingHuman", "approved") - moves == 1
    finally:
        stack.outbox.attach(None)
        stack.db.off_commit_payloads(HANDOFF_TOPIC, relay.accept)
        stack.db.off_doubt_payloads(HANDOFF_TOPIC, relay.in_doubt)


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_an_escalation_in_doubt_whose_cards_the_relay_finds_is_counted_once(
    make_stack: Callable[..., Stack], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lead escalates; its verdict's transaction writes two review cards claimed for
    this process's relay, and its COMMIT lands with the answer lost (in doubt). The
    relay gives both cards back and sends them, and the lead runner's kept verdict,
    committed again, is dropped by the lease fence and finds its audit row: three looks
    find the one write, and what it counts (the verdict, its move) is counted once."""
    env = await slack_and_email_cards(make_stack)
    stack = env.stack
    relay = stack.relay
    stack.db.on_commit_payloads(HANDOFF_TOPIC, relay.accept)
    stack.db.on_doubt_payloads(HANDOFF_TOPIC, relay.in_doubt)
    stack.outbox.attach(relay)
    try:
        await stack.turns.run(api_trigger(env.org, env.worker, "hard #escalate #complete", "s1"))
        item_id = await session_item(stack, "s1")
        runner = stack.lead_runner
        claimed = await runner.claim()
        assert claimed is not None
        lose_the_next_commit(monkeypatch, stack.db, alone=False)

        def escalation_counted() -> tuple[float, float]:
            return (
                counted("leadgate_reviews_total", outcome="escalated"),
                transitions_counted("reviewing", "awaitingHuman"),
            )

        before = escalation_counted()
        with pytest.raises(Unavailable) as raised:
            await runner.review(claimed)
        assert raised.value.in_doubt
        cards = await env.deliveries(item_id, "card")
        assert [(c["status"], c["lease_token"]) for c in cards] == [
            ("sending", relay.handoff_token)
        ] * 2
        assert escalation_counted() == before
        await drain(relay)
        assert {c["status"] for c in await env.deliveries(item_id, "card")} == {"sent"}
        after = escalation_counted()
        assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
        await runner._commit_kept()
        assert runner._verdicts == []
        assert escalation_counted() == after
        assert "leaseReleased" not in [a["action"] for a in await item_audit(stack, item_id)]
    finally:
        stack.outbox.attach(None)
        stack.db.off_commit_payloads(HANDOFF_TOPIC, relay.accept)
        stack.db.off_doubt_payloads(HANDOFF_TOPIC, relay.in_doubt)


async def test_delivery_unknown_gets_a_recovery_card_and_confirm_closes_it(
    make_stack: Callable[..., Stack],
) -> None:
    env = await review_env(make_stack)
    org, stack = env.org, env.stack
    # A worker on a Slack binding: its approved answer is posted by the relay.
    await stack.turns.run(slack_trigger(env, "ship it #complete"))
    env.slack.script = [Uncertain("timeout after sending")]
    await drain(stack.lead_runner)
    await drain(stack.relay)
    async with stack.db.read() as conn:
        item_id = str(
            await conn.scalar(sa.select(t.work_items.c.id).where(t.work_items.c.org_id == org.id))
        )
    [gating] = await env.deliveries(item_id, "gating")
    assert gating["status"] == "deliveryUnknown"
    [card_row] = await env.deliveries(item_id, "card")
    card = Card.from_json(card_row["address"]["card"])
    assert (card.reason, card.delivery_id) == ("deliveryUnknown", gating["id"])
    assert card.why == "Delivery outcome unknown: timeout after sending"
    assert card.source == "Slack channel C9 in T1, thread 1.1"
    [episode] = await env.episodes(item_id)
    assert episode["expire_at"] is None  # never expired automatically

    await drain(stack.relay)  # post the card
    async with stack.db.tx() as conn:
        delivery = await decisions.recover_delivery(
            conn,
            stack.outbox,
            await _delivery(conn, gating["id"]),
            "confirm",
            "user:x",
            surface="slack",
        )
    assert delivery.status == "sent"
    [update] = await env.deliveries(item_id, "cardUpdate")
    outcome = Card.from_json(update["address"]["card"]).outcome
    assert outcome is not None and outcome.title == "Delivery confirmed"
    assert (await env.episodes(item_id))[0]["closed_at"] is not None


async def _delivery(conn: Any, delivery_id: str) -> Delivery:
    row = (
        await conn.execute(sa.select(t.deliveries).where(t.deliveries.c.id == delivery_id))
    ).first()
    return Delivery.from_row(row)


async def test_agent_destinations_replace_the_organizations_for_that_tier(
    make_stack: Callable[..., Stack],
) -> None:
    env = await review_env(make_stack, escalation=False)
    stack = env.stack
    async with stack.db.tx() as conn:
        await dest.add_destination(
            conn,
            stack.clock,
            stack.ids,
            org_id=env.org.id,
            agent_id=env.worker["id"],
            channel="email",
            target="Boss@Example.com",
        )
    item_id = await env.escalated("s1")
    cards = await env.deliveries(item_id, "card")
    assert [(c["channel"], c["address"]["to"]) for c in cards] == [("email", "boss@example.com")]
    assert cards[0]["address"]["subject"] == "Review needed: worker: Summary: hard #escalate"


async def test_a_failing_card_write_never_blocks_the_escalation(
    make_stack: Callable[..., Stack], caplog: pytest.LogCaptureFixture
) -> None:
    env = await review_env(make_stack)

    async def broken(conn: Any, *_: Any) -> None:
        await conn.execute(sa.text("SELECT * FROM no_such_table"))

    env.stack.outbox.on_review_needed(broken)
    item_id = await env.escalated("s1")
    async with env.stack.db.read() as conn:
        assert (await workitems.get(conn, item_id)).status == "awaitingHuman"
    assert not await env.deliveries(item_id, "card")
    assert "review cards for work item" in caplog.text


async def test_review_facts_say_why_for_each_way_to_a_human(
    make_stack: Callable[..., Stack],
) -> None:
    env = await review_env(make_stack)
    stack = env.stack
    escalated = await env.escalated("s1")
    # Rounds used up: a lead that always asks for changes on a 1-round worker.
    tight = await _make_tight_worker(env)
    async with stack.db.read() as conn:
        facts = await review_facts(conn, [escalated, tight, "wi_nope"], org_id=env.org.id)
    assert set(facts) == {escalated, tight}
    assert facts[escalated].reason == "awaitingHuman"
    assert facts[tight].why == (
        "Revision rounds used up (1 of 1); the lead asked for changes: Please revise."
    )
    assert facts[tight].detail_path == f"/console/#/review/{tight}"


async def _make_tight_worker(env: ReviewEnv) -> str:
    stack = env.stack
    worker = await make_agent(
        stack, env.org, "tight", lead="lead", review_config={"maxRevisionRounds": 1}
    )
    await stack.turns.run(api_trigger(env.org, worker, "x #revise #complete", "tight"))
    await drain(stack.lead_runner)  # changes requested: revision 1
    await drain(RevisionRunner(stack.turns))
    # The lead asks once more (revision 1 approves in the script model): make it ask.
    async with stack.db.read() as conn:
        item_id = str(
            await conn.scalar(
                sa.select(t.work_items.c.id).where(t.work_items.c.agent_id == worker["id"])
            )
        )
        item = await workitems.get(conn, item_id)
    async with stack.db.tx() as conn:
        claimed = await workitems.transition(
            conn,
            stack.clock,
            stack.ids,
            item.id,
            src=workitems.Status(item.status),
            dst=workitems.Status.reviewing,
            actor="test",
            action="claim",
            values={"lease_token": "tok"},
        )
        await decisions.commit_verdict(
            conn,
            stack.outbox,
            claimed,
            decisions.Verdict.changesRequested,
            actor="lead:x",
            feedback="Please revise.",
            src=workitems.Status.reviewing,
            lease_token="tok",
        )
    return item_id


# ------------------------------------------------------------- rendering limits


def _card(summary: str, **kw: Any) -> Card:
    base: dict[str, Any] = {
        "item_id": "wi_1",
        "episode_id": "rep_1",
        "purpose": "notify",
        "reason": "awaitingHuman",
        "delivery_id": None,
        "agent": "worker",
        "source": "Slack channel C1",
        "why": "The lead escalated it: " + "w" * 900,
        "summary": summary,
        "revision": 1,
        "rounds": 3,
        "waiting_since_ms": 1_780_000_000_000,
        "link": "https://leadgate.example/console/#/review/wi_1",
    }
    base.update(kw)
    return Card(**base)


def test_long_summaries_are_cut_to_each_channels_limits_never_dropped() -> None:
    summary = "<&>" + "s" * 11_990 + "TAIL"
    card = _card(summary)

    content = discord_review.content(card)
    assert len(content) <= 2_000 and "**Summary**\n<&>sss" in content
    assert content.endswith(f"…\n<{card.link}>") and "TAIL" not in content

    blocks = slack_review.blocks(card)
    texts = [b["text"]["text"] for b in blocks if b["type"] == "section" and "text" in b]
    assert all(len(x) <= 3_000 for x in texts)
    assert texts[0].startswith("*Summary*\n&lt;&amp;&gt;sss") and texts[0].endswith("…")
    actions = blocks[-1]
    assert actions["block_id"] == "lg_review:rep_1"
    assert [(e["action_id"], e["value"]) for e in actions["elements"]] == [
        ("approve", "wi_1"),
        ("reject", "wi_1"),
        ("return", "wi_1"),
    ]
    assert len(slack_review.fallback_text(card)) <= 3_000

    adaptive = teams_review.adaptive_card(card)
    summary_run = adaptive["body"][7]["inlines"][0]["text"]
    assert summary_run.endswith("…") and len(summary_run) <= 10_000
    verbs = [a.get("verb") or a["card"]["actions"][0]["verb"] for a in adaptive["actions"][:3]]
    assert verbs == ["approve", "reject", "return"]
    assert adaptive["actions"][-1] == {
        "type": "Action.OpenUrl",
        "title": "Open in the console",
        "url": card.link,
    }
    assert "TAIL" in plain_text(_card("short TAIL"))


def test_a_teams_card_fits_its_limit_in_any_script() -> None:
    # Teams counts the JSON it posts: a CJK character is a 6-byte escape there, and an
    # emoji 12. A summary of 2,000 emoji, a long "why" and a return's 10,000 characters
    # of CJK feedback made a card of about 100 KB, which Teams refuses (413).
    emoji, cjk = "🙂" * 2_000, "漢" * 10_000
    card = _card(emoji, why="The lead escalated it: " + cjk[:5_000])
    returned = CardOutcome("Returned to the worker", "ann@example.com", "teams", 0, cjk)
    for shown in (card, card.decided(returned)):
        posted = json.dumps({"type": "message", "attachments": [teams_review.adaptive_card(shown)]})
        assert len(posted) <= 24_000, len(posted)
    summary = teams_review.adaptive_card(card)["body"][7]["inlines"][0]["text"]
    assert summary.startswith("🙂🙂") and summary.endswith("…")
    assert teams_review.text_size(summary) <= teams_review.SUMMARY_BYTES


def test_decided_and_recovery_cards_show_no_decision_buttons() -> None:
    outcome = CardOutcome("Rejected", "ann@example.com", "teams", 1_780_000_000_000, "no")
    decided = _card("s").decided(outcome)
    [line, said] = slack_review.blocks(decided)[-1]["elements"]
    assert [e.get("text") for e in line["elements"]] == [
        "Rejected",
        " by ann@example.com (teams) ",
        None,
    ]
    assert said == {"type": "rich_text_quote", "elements": [{"type": "text", "text": "no"}]}
    assert [a["type"] for a in teams_review.adaptive_card(decided)["actions"]] == ["Action.OpenUrl"]
    assert "**Rejected** by ann@example.com (teams)" in discord_review.content(decided)

    recovery = _card("s", reason="deliveryUnknown", delivery_id="dlv_9")
    assert [
        (e["action_id"], e["value"]) for e in slack_review.blocks(recovery)[-1]["elements"]
    ] == [
        ("confirm", "dlv_9"),
        ("retry", "dlv_9"),
    ]
    assert recovery.title == "Delivery outcome unknown: worker"


#: A decider's and an agent's names as a person could write them: markup on every platform.
MARKED = "<!channel> *ann* _b_ & #x"


def test_slacks_notification_text_says_why_a_decision_was_made_escaped() -> None:
    # It said "Review needed: worker (Cancelled by ann@example.com): ..." with no reason,
    # and passed names, reason and summary to Slack as typed (<!channel> read as mrkdwn).
    reason = "duplicate of <#C1>\nand & more " + "r" * 400
    outcome = CardOutcome("Cancelled", MARKED, "console", 1_780_000_000_000, reason)
    text = slack_review.fallback_text(_card("sum <b>", agent="a<b>").decided(outcome))
    assert text.startswith(
        "Review needed: a&lt;b&gt; (Cancelled by &lt;!channel&gt; *ann* _b_ &amp; #x: "
        "“duplicate of &lt;#C1&gt; and &amp; more rrr"
    )
    assert "\n" not in text and "r" * 201 not in text and text.endswith("…”): sum &lt;b&gt;")
    long = slack_review.fallback_text(_card("&" * 5_000))
    assert len(long) <= slack_review.TEXT_MAX and long.endswith("&amp;…")


def test_slacks_late_click_answer_escapes_who_decided() -> None:
    # "Already cancelled by <!channel> ..." went out as typed: Slack read it as mrkdwn.
    line = f"Already cancelled by {MARKED} (console) at 2026-06-01T00:00:00Z."
    answer = ChatAnswer("closed", line, None, "a > b")
    escaped = "Already cancelled by &lt;!channel&gt; *ann* _b_ &amp; #x (console)"
    assert slack_review.told(answer).startswith(escaped)
    assert slack_review.told(answer).endswith("2026-06-01T00:00:00Z. “a &gt; b”")
    assert slack_review.notice(answer)["blocks"] == slack_review.told_blocks(answer)


def test_slack_outcome_lines_and_answers_show_names_and_reasons_as_written() -> None:
    # The outcome line ("*Rejected* by NAME (surface) at ...") and the quoted reason
    # were mrkdwn: a name's or reason's * _ ~ ` restyled them (mrkdwn has no escape for
    # them). They are rich_text elements, shown as written; only the outcome is bold.
    reason = "*dup* of <!here> & _wi_2_ ~x~ `y`\nsecond line"
    outcome = CardOutcome("Rejected", MARKED, "teams", 1_780_000_000_000, reason)
    block = slack_review.blocks(_card("s").decided(outcome))[-1]
    assert block == {
        "type": "rich_text",
        "elements": [
            {
                "type": "rich_text_section",
                "elements": [
                    {"type": "text", "text": "Rejected", "style": {"bold": True}},
                    {"type": "text", "text": f" by {MARKED} (teams) "},
                    {
                        "type": "date",
                        "timestamp": 1_780_000_000,
                        "format": "{date_short_pretty} at {time}",
                        "fallback": "2026-05-28T20:26:40Z",
                    },
                ],
            },
            {"type": "rich_text_quote", "elements": [{"type": "text", "text": reason}]},
        ],
    }
    # Slack's 3,000 characters, as the mrkdwn section had; no quote without a reason.
    long = CardOutcome("Returned to the worker", "k" * 5_000, None, 0, "r" * 20_000)
    [line, said] = slack_review.blocks(_card("s").decided(long))[-1]["elements"]
    texts = [e["text"] for e in line["elements"][:2]] + [said["elements"][0]["text"]]
    assert sum(len(t) for t in texts) <= slack_review.SECTION_MAX and texts[2].endswith("…")
    silent = dataclasses.replace(outcome, text=None)
    assert len(slack_review.blocks(_card("s").decided(silent))[-1]["elements"]) == 1

    # A clicker's answer ("Already rejected by NAME ...") and a late form's notice too.
    line = f"Already rejected by {MARKED} (teams) at 2026-06-01T00:00:00Z."
    answer = ChatAnswer("closed", line, None, reason)
    assert slack_review.told_blocks(answer) == [
        {
            "type": "rich_text",
            "elements": [
                {"type": "rich_text_section", "elements": [{"type": "text", "text": line}]},
                {"type": "rich_text_quote", "elements": [{"type": "text", "text": reason}]},
            ],
        }
    ]
    assert slack_review.notice(answer)["blocks"] == slack_review.told_blocks(answer)


def test_discord_cards_and_answers_show_names_and_the_leads_words_as_written() -> None:
    # A name's * or _ restyled the card and a # in "why" made a heading: they went in
    # as typed (the summary keeps its markdown; nobody is pinged either way).
    outcome = CardOutcome("Cancelled", MARKED, "console", 1_780_000_000_000, "")
    card = _card("**bold** summary", agent="a*b*", source="#src _x_", why="# loud")
    content = discord_review.content(card.decided(outcome))
    assert "**Review needed: a\\*b\\***" in content
    assert "**Agent:** a\\*b\\*\n**From:** \\#src \\_x\\_\n**Why:** \\# loud" in content
    assert "**Cancelled** by <!channel> \\*ann\\* \\_b\\_ & #x (console)" in content
    assert "**Summary**\n**bold** summary" in content
    line = f"Already cancelled by {MARKED} (console)."
    told = discord_review.told(ChatAnswer("closed", line, None, "*no*"))
    assert told == "Already cancelled by <!channel> \\*ann\\* \\_b\\_ & #x (console).\n> \\*no\\*"


def test_teams_cards_show_the_agent_and_who_decided_as_typed() -> None:
    # The headline (the agent's name) and the outcome's line (who decided) were
    # TextBlocks, which Teams reads as markdown: a name's ** or _ restyled the card.
    outcome = CardOutcome("Rejected", "**ann** _b_", "teams", 1_780_000_000_000, "")
    body = teams_review.adaptive_card(_card("s", agent="- a*b*").decided(outcome))["body"]
    run = {"type": "TextRun", "text": "Review needed: - a*b*", "weight": "Bolder"}
    assert body[0] == {"type": "RichTextBlock", "inlines": [{**run, "size": "Medium"}]}
    line = "Rejected by **ann** _b_ (teams) at 2026-05-28T20:26:40Z"
    run = {"type": "TextRun", "text": line, "weight": "Bolder", "color": "Attention"}
    assert body[-1] == {"type": "RichTextBlock", "inlines": [run]}


def test_discord_cards_show_where_every_masked_link_leads() -> None:
    # The summary went in as typed (the reviewer saw "Approve here" only), and
    # discord.py's escape_markdown escapes a line's first masked link only (the "why").
    summary = f"**Done.** {PHISH} or [the docs](https://docs.example)\n- x = [1, 2]"
    card = _card(summary, why=f"{PHISH} and [me](https://x.example)")
    content = discord_review.content(card)
    assert (
        "**Summary**\n**Done.** \\[Approve here](https://elsewhere.example) or "
        "\\[the docs](https://docs.example)\n- x = [1, 2]\n<"
    ) in content
    assert (
        "**Why:** \\[Approve here](https://elsewhere.example) and \\[me](https://x.example)\n"
    ) in content
    # Escaping makes the text longer: the content is cut after it, still within 2,000.
    long = discord_review.content(_card("[a](b)" * 1_000))
    assert len(long) <= discord_review.CONTENT_MAX and long.count("\\[a](b)") > 100
    # A [ its writer escaped stays escaped once; after an escaped backslash it opened a link.
    shown = discord_review.links_shown("\\[a](u) \\\\[b](v)")
    assert shown == "\\[a](u) \\\\\\[b](v)"


def test_discord_cards_escape_a_lone_bracket_a_later_line_would_close() -> None:
    # A requester's name "[Approve" and a summary "here](https://...)": Discord's link
    # words may span lines, so the two made one masked link from the facts to the
    # summary, the card showing words, not where it led. Every "[" of a name, a "why"
    # or a quoted reason is escaped.
    card = _card("now](https://elsewhere.example)", source="[Approve", why="see [note")
    content = discord_review.content(card)
    assert "**From:** \\[Approve\n" in content
    assert "**Why:** see \\[note\n" in content
    unescaped = [i for i, ch in enumerate(content) if ch == "[" and content[i - 1] != "\\"]
    assert unescaped == [], content


def test_slack_card_facts_are_plain_text_never_mrkdwn() -> None:
    # "*Agent:* <name>" was one mrkdwn line: a name's * _ ~ ` restyled the facts.
    card = _card(PHISH, agent="*a*_b_~c~`d`", source="<!here> & src", why="_why_ *me*")
    section = slack_review.blocks(card)[1]
    assert "text" not in section
    assert [(f["type"], f["text"]) for f in section["fields"]] == [
        ("mrkdwn", "*Agent*"),
        ("plain_text", "*a*_b_~c~`d`"),
        ("mrkdwn", "*From*"),
        ("plain_text", "<!here> & src"),
        ("mrkdwn", "*Why*"),
        ("plain_text", "_why_ *me*"),
        ("mrkdwn", "*Waiting since*"),
        ("mrkdwn", "<!date^1780000000^{date_short_pretty} at {time}|1780000000>"),
        ("mrkdwn", "*Revision*"),
        ("plain_text", "1 of 3"),
    ]
    assert all(f.get("emoji") is False for f in section["fields"] if f["type"] == "plain_text")
    # Slack's limits: ten fields, 2,000 characters each, none empty.
    fields = slack_review.blocks(_card("s", why="w" * 5_000, source=""))[1]["fields"]
    assert len(fields) == 10 and len(fields[5]["text"]) == 2_000 and fields[3]["text"] == "-"
    # The summary is mrkdwn, whose only link (<url|words>) is escaped: it shows as typed.
    mrkdwn = slack_review.blocks(_card("<https://elsewhere.example|Approve here>"))[2]
    assert mrkdwn["text"]["text"] == "*Summary*\n&lt;https://elsewhere.example|Approve here&gt;"


def test_teams_cards_show_facts_and_the_summary_as_typed() -> None:
    # The summary was a TextBlock and the facts a FactSet, both markdown in Teams: a
    # masked link showed its words only, and a name's * or _ restyled it.
    card = _card(f"**Done.** {PHISH}", agent="a*b*", source="_src_", why=PHISH)
    body = teams_review.adaptive_card(card)["body"]
    assert [b["type"] for b in body] == ["RichTextBlock"] * 6 + ["TextBlock", "RichTextBlock"]
    assert body[6]["text"] == "Summary"  # the one TextBlock: the service's own word
    facts = [[(r["text"], r.get("weight")) for r in b["inlines"]] for b in body[1:6]]
    assert facts == [
        [("Agent: ", "Bolder"), ("a*b*", None)],
        [("From: ", "Bolder"), ("_src_", None)],
        [("Why: ", "Bolder"), (PHISH, None)],
        [("Waiting since: ", "Bolder"), ("2026-05-28T20:26:40Z", None)],
        [("Revision: ", "Bolder"), ("1 of 3", None)],
    ]
    assert [b.get("spacing") for b in body[1:6]] == [None] + ["None"] * 4
    assert body[7]["inlines"] == [{"type": "TextRun", "text": f"**Done.** {PHISH}"}]


async def test_an_uncertain_card_post_is_visible_and_never_reposted_or_gating(
    make_stack: Callable[..., Stack],
) -> None:
    env = await review_env(make_stack)
    item_id = await env.escalated("s1")
    env.slack.script = [Uncertain("slack: no answer before the timeout")]
    await drain(env.stack.relay)
    env.stack.clock.advance(3_600_000)
    await drain(env.stack.relay)
    [card] = await env.deliveries(item_id, "card")
    assert (card["status"], card["error"]) == (
        "deliveryUnknown",
        "slack: no answer before the timeout",
    )
    assert len(env.slack.calls) == 1  # never retried automatically
    async with env.stack.db.read() as conn:
        page = await queue.actionable(conn, env.org.id)
        detail = await queue.detail(conn, env.org.id, item_id)
    # Visible like any delivery (with its kind), but the item is in the queue once, as
    # awaitingHuman: a card never makes an item "deliveryUnknown".
    assert [(i["id"], i["status"]) for i in page["items"]] == [(item_id, "awaitingHuman")]
    assert page["items"][0]["reason"] != "deliveryUnknown"
    assert [(d["kind"], d["status"]) for d in detail["deliveries"]] == [("card", "deliveryUnknown")]
    assert len(await env.episodes(item_id)) == 1
    # A decision cannot edit a card whose post is uncertain: nothing is queued for it.
    await approve(env, item_id)
    assert not await env.deliveries(item_id, "cardUpdate")


async def test_a_closed_click_with_no_outcome_to_show_never_brings_buttons_back() -> None:
    """A click answered "not waiting for a decision" with the card as posted (no outcome
    yet) is answered in words: showing that card in place would offer its buttons."""

    class Backend:
        def __init__(self, card: Card) -> None:
            self.card = card

        async def decide(self, *args: Any, **kw: Any) -> ChatAnswer:
            return ChatAnswer("closed", "This item is not waiting for a decision.", self.card)

    payload: dict[str, Any] = {
        "type": 3,
        "member": {"user": {"id": "1"}},
        "message": {"id": "55"},
        "data": {"custom_id": "lg:approve:wi_1:rep_1"},
    }
    undecided = await discord_review.handle(payload, Backend(_card("s")))  # type: ignore[arg-type]
    assert undecided["type"] == 4 and "not waiting" in undecided["data"]["content"]
    outcome = CardOutcome(title="Approved", by="ann@example.com", surface="console", at_ms=1)
    decided = await discord_review.handle(
        payload,
        Backend(_card("s", outcome=outcome)),  # type: ignore[arg-type]
    )
    assert decided["type"] == 7 and "**Approved** by ann@example.com" in decided["data"]["content"]


def test_a_teams_closed_click_with_no_outcome_to_show_never_brings_buttons_back() -> None:
    """As on Discord and Slack: a closed click's card replaces the clicked one only when it
    shows an outcome; the card as posted (no outcome) is answered in words."""
    said = "This item is not waiting for a decision."
    undecided = teams_review.click_answer(ChatAnswer("closed", said, _card("s")))
    assert undecided == teams_review.message_answer(said)
    outcome = CardOutcome(title="Approved", by="ann@example.com", surface="console", at_ms=1)
    shown = _card("s", outcome=outcome)
    assert teams_review.click_answer(ChatAnswer("closed", said, shown)) == (
        teams_review.card_answer(shown)
    )
    assert teams_review.click_answer(ChatAnswer("decided", "Approved.", shown)) == (
        teams_review.card_answer(shown)
    )


class Recording:
    """A chat backend that records what a Discord interaction asked of it."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str, dict[str, Any]]] = []

    async def check(self, platform: str, who: str, item: str, episode: Any, **kw: Any) -> Any:
        self.asked.append(("check", item, {"episode_id": episode, **kw}))
        return ChatAnswer("open", "")

    async def decide(
        self, platform: str, who: str, item: str, verb: str, text: Any, **kw: Any
    ) -> Any:
        self.asked.append((verb, item, {"text": text, **kw}))
        return ChatAnswer("closed", "This item is not waiting for a decision.")

    async def recover(self, platform: str, who: str, delivery: str, verb: str, **kw: Any) -> Any:
        self.asked.append((verb, delivery, kw))
        return ChatAnswer("closed", "This review no longer exists.")


def _custom_ids(card: Card) -> list[str]:
    return [
        c["custom_id"]
        for row in discord_review.view(card).to_components()
        for c in row["components"]
        if "custom_id" in c
    ]


async def _interact(backend: Recording, custom_id: str, form: str | None = None) -> Any:
    data: dict[str, Any] = {"custom_id": custom_id, "component_type": 2}
    if form is not None:
        field = "reason" if "reject" in custom_id else "feedback"
        data = {
            "custom_id": custom_id,
            "components": [
                {"type": 1, "components": [{"type": 4, "custom_id": field, "value": form}]}
            ],
        }
    payload = {
        "type": 3 if form is None else 5,
        "channel_id": "10",
        "member": {"user": {"id": "1"}},
        "message": {"id": "55"},
        "data": data,
    }
    return await discord_review.handle(payload, backend)  # type: ignore[arg-type]


async def test_discord_custom_ids_name_their_card_round_trip_and_fit_discords_limit() -> None:
    ids = RandomIds()  # the service's ids, at their real lengths
    item, wait, gating, own = ids.new("wi"), ids.new("rep"), ids.new("dlv"), ids.new("dlv")
    review = _card("s", item_id=item, episode_id=wait, card_id=own)
    recovery = replace(review, reason="deliveryUnknown", delivery_id=gating)
    mine = f"c={own}"
    assert _custom_ids(review) == [f"lg:{v}:{item}:{mine}" for v in ("approve", "reject", "return")]
    assert _custom_ids(recovery) == [f"lg:{v}:{gating}:{mine}" for v in ("confirm", "retry")]
    # A card written before cards named themselves carries its wait, as it did.
    older = replace(review, card_id=None)
    assert _custom_ids(older) == [f"lg:{v}:{item}:{wait}" for v in ("approve", "reject", "return")]

    backend = Recording()
    where = {"message_id": "55", "conversation": "10"}
    modals = []
    for custom_id in _custom_ids(review) + _custom_ids(recovery):
        answer = await _interact(backend, custom_id)
        if answer["type"] == 9:
            modals.append(answer["data"]["custom_id"])
    # Every click names its card, never a wait: the server reads the wait from the card.
    assert backend.asked == [
        ("approve", item, {"text": None, "episode_id": None, "card_id": own, **where}),
        ("check", item, {"episode_id": None, "card_id": own, **where}),
        ("check", item, {"episode_id": None, "card_id": own, **where}),
        ("confirm", gating, {"episode_id": None, "card_id": own, **where}),
        ("retry", gating, {"episode_id": None, "card_id": own, **where}),
    ]
    # The Reject / Return form carries the card through to its submission.
    assert modals == [f"lg:{v}_modal:{item}:{mine}" for v in ("reject", "return")]
    backend.asked.clear()
    for modal in modals:
        await _interact(backend, modal, form="Because.")
    assert backend.asked == [
        (verb, item, {"text": "Because.", "episode_id": None, "card_id": own, **where})
        for verb in ("reject", "return")
    ]

    # An older card's clicks and form name its wait, as before.
    backend.asked.clear()
    older_ids = _custom_ids(older)
    assert (await _interact(backend, older_ids[1]))["data"]["custom_id"] == (
        f"lg:reject_modal:{item}:{wait}"
    )
    await _interact(backend, older_ids[0])
    assert backend.asked == [
        ("check", item, {"episode_id": wait, "card_id": None, **where}),
        ("approve", item, {"text": None, "episode_id": wait, "card_id": None, **where}),
    ]
    # The mark alone names nothing: refused, nothing asked.
    backend.asked.clear()
    bare = await _interact(backend, f"lg:approve:{item}:c=")
    assert bare["type"] == 4 and "not supported" in bare["data"]["content"]
    assert backend.asked == []

    # Every custom_id fits Discord's 100 characters with room to spare (the longest is a
    # form's); the wait and the card both would not fit a form's.
    every = _custom_ids(review) + _custom_ids(recovery) + _custom_ids(older) + modals
    assert max(len(x) for x in every) == len(modals[0]) == 78
    assert max(len(x) for x in every) <= discord_review.CUSTOM_ID_MAX - 20
    assert len(f"lg:reject_modal:{item}:{wait}:{own}") == 107


async def test_a_cards_wait_is_read_from_its_row_fenced_to_its_item_and_organization(
    make_stack: Callable[..., Stack],
) -> None:
    env = await review_env(make_stack)
    item_id = await env.escalated("s1")
    other_item = await env.escalated("s2")
    [card] = await env.deliveries(item_id, "card")
    [other_card] = await env.deliveries(other_item, "card")
    [episode] = await env.episodes(item_id)
    org = env.org.id
    async with env.stack.db.read() as conn:
        assert await card_episode(conn, card["id"], item_id, org) == episode["id"]
        # A card of another item, or of another organization, names no wait of this item.
        assert await card_episode(conn, other_card["id"], item_id, org) is None
        assert await card_episode(conn, card["id"], other_item, org) is None
        assert await card_episode(conn, card["id"], item_id, "org_other") is None
        assert await card_episode(conn, "dlv_none", item_id, org) is None

    # One read by indexes, no table scanned: the card's row by its delivery id
    # (migration 0020), then its episode, fenced to the item. So is the read of when a
    # settled card's wait closed (it scanned every card).
    engine = sa.create_engine("sqlite://")
    metadata.create_all(engine)
    for bound in (
        _CARD_EPISODE.params(p_item="wi_1", p_org="org_1", p_card="dlv_1"),
        CARD_CLOSED_AT.params(p_item="wi_1", p_card="dlv_1"),
    ):
        with engine.connect() as raw:
            plan = sqlite_plan(raw, bound)
        assert plan == [
            "SEARCH review_cards USING INDEX ix_review_cards_delivery_id (delivery_id=?)",
            "SEARCH review_episodes USING INDEX sqlite_autoindex_review_episodes_1 (id=?)",
        ], plan


# --------------------------------------- lock order: the relay's outcomes and a decision


async def _a_card_and_its_post_sending(env: ReviewEnv) -> tuple[str, list[Delivery]]:
    """An escalated Slack item whose review card is being sent when a person approves it,
    and whose answer post the relay then claims: both of its deliveries ``sending``, the
    card's row first, as one relay group holds them."""
    stack = env.stack
    await stack.turns.run(slack_trigger(env, "hard #escalate #complete"))
    await drain(stack.lead_runner)
    item_id = await session_item(stack, "slack:T1:C9:1.1")
    [card] = await stack.relay.claim()
    await approve(env, item_id)
    post = next(r for r in await stack.relay.claim() if r.kind == "gating")
    assert (card.work_item_id, post.work_item_id) == (item_id, item_id)
    return item_id, [card, post]


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_cancel_while_a_relay_group_holds_a_card_and_its_post_waits_no_deadlock(
    make_stack: Callable[..., Stack],
) -> None:
    """One relay group commits the refusals (Retry) of an item's review card and of its
    answer post while a person cancels the item. The cancel locks the item, then closes
    the item's open waits; the group locks the post's item, then the card's wait (in
    the group's order it was the wait first, but the approval had closed it, and the
    cancel leaves a closed wait alone: no deadlock either way). The group waits for the
    cancel, then ends both ``cancelled`` (a post whose item was cancelled meanwhile; a
    card of a closed wait)."""
    env = await review_env(make_stack)
    item_id, rows = await _a_card_and_its_post_sending(env)
    relay = env.stack.relay
    locked = sa.select(t.work_items.c.id).where(t.work_items.c.id == item_id).with_for_update()
    async with env.stack.db.tx() as conn:
        await conn.execute(locked)  # as the cancel's move of the item holds it
        commit = asyncio.create_task(relay.complete([Done(r, Retry("rate limited")) for r in rows]))
        await blocked_on_a_lock(env.stack.db, commit)
        item = await workitems.get(conn, item_id)
        await decisions.decide(conn, env.stack.outbox, item, "cancel", "user:x")
    await commit
    for kind in ("card", "gating"):
        [row] = await env.deliveries(item_id, kind)
        assert row["status"] == "cancelled", (kind, row["error"])


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_real_deadlock_met_by_a_relay_group_keeps_it_and_it_commits_later(
    make_stack: Callable[..., Stack], caplog: pytest.LogCaptureFixture
) -> None:
    """A genuine PostgreSQL deadlock (``40P01``) between the relay's outcome commit and
    another transaction taking the same two rows in the other order (the card's wait,
    then the item; the relay's group: the post's item, then the card's wait). The
    relay's commit is the victim. It is a database fault (``Unavailable``): the group
    is kept whole, both rows stay ``sending`` (never ``deliveryUnknown``, no ERROR line,
    as an outcome the database refuses is), and the next commit records both (the card
    ended, its wait closed; the post to be retried)."""
    env = await review_env(make_stack)
    item_id, rows = await _a_card_and_its_post_sending(env)
    relay = env.stack.relay
    group = [Done(r, Retry("rate limited")) for r in rows]
    kept = list(group)
    item_row = sa.select(t.work_items.c.id).where(t.work_items.c.id == item_id)
    wait_row = sa.select(t.review_episodes.c.id).where(t.review_episodes.c.work_item_id == item_id)
    caplog.set_level("WARNING", logger="leadgate.relay")
    async with env.stack.db.tx() as conn:
        await conn.execute(wait_row.with_for_update())
        commit = asyncio.create_task(relay._commit_each(kept))
        await blocked_on_a_lock(env.stack.db, commit)  # holding the post's item
        await conn.execute(item_row.with_for_update())  # granted once the relay's ends
    with pytest.raises(Unavailable) as met:
        await commit
    assert met.value.rule == "service.unavailable"
    assert "deadlock" in met.value.detail
    assert kept == group
    for kind in ("card", "gating"):
        [row] = await env.deliveries(item_id, kind)
        assert row["status"] == "sending", (kind, row["error"])
    assert not [r for r in caplog.records if r.levelname == "ERROR"]

    await relay._commit_each(kept)
    assert kept == []
    # (The card's wait was closed by the approval: a card not posted then ends.)
    ended = {k: (await env.deliveries(item_id, k))[0]["status"] for k in ("card", "gating")}
    assert ended == {"card": "cancelled", "gating": "pending"}
