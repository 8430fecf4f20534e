"""Chat decisions (leadgate/operations/chat_reviews.py) on the real composition root:
only linked users whose role grants agent:review decide, through the fenced commit path,
audited with the platform; everyone else is told and nothing changes; a late or second
click is told who decided."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa

from bots.discord import DiscordChannel, configure_endpoints
from bots.slack import SlackChannel
from leadgate.app import App
from leadgate.core.clock import FakeClock
from leadgate.core.config import DiscordSettings, Settings, SlackSettings
from leadgate.core.metrics import METRICS
from leadgate.core.runners import drain
from leadgate.database import schema as t
from leadgate.domain import links, orgs
from leadgate.operations.chat_reviews import FORBIDDEN
from leadgate.runners.revisions import RevisionRunner
from outbox.channel import Card, Channel, OutboundMessage, SendOutcome, Sent, Uncertain
from outbox.store import IN_FLIGHT_AFTER_LAPSE_MS, SEND_LEASE_MS
from tests.helpers import (
    Org,
    api_trigger,
    deliveries_counted,
    item_audit,
    item_row,
    make_agent,
    make_org,
    slack_trigger,
)
from tests.outbox_support import ScriptedChannel
from tests.review_support import add_destination
from tests.standins.common import StandinBase
from tests.standins.discord_api import DiscordApiStandin
from tests.standins.slack_api import SlackApiStandin

MEMBER = "T0001:U0MEMBER"
VIEWER = "T0001:U0VIEWER"
DISCORD_CHANNEL = "1000000000000000009"


@pytest.fixture
async def app(migrated_url: str) -> AsyncIterator[App]:
    settings = Settings.model_validate(
        {"database": {"url": migrated_url}, "server": {"public_url": "https://lg.example"}}
    )
    service = App(
        settings,
        clock=FakeClock(),
        enable_adapters=False,
        channels={"slack": ScriptedChannel("slack")},
    )
    yield service
    await service.stop()


async def setup(app: App, name: str = "acme") -> tuple[Org, dict[str, Any]]:
    org = await make_org(app, name)
    await make_agent(app, org, "lead")
    worker = await make_agent(app, org, "worker", lead="lead")
    await add_destination(app, org.id, "slack", "C0R")
    async with app.db.tx() as conn:
        for email, role, identity in (
            (f"member@{name}.io", "Member", MEMBER),
            (f"viewer@{name}.io", "Viewer", VIEWER),
        ):
            await orgs.create_user(
                conn, app.clock, app.ids, org.id, email, role, orgs.hash_password("password1")
            )
            await links.link(
                conn,
                app.clock,
                app.ids,
                org_id=org.id,
                email=email,
                platform="slack",
                identity=identity,
            )
    return org, worker


async def escalated(app: App, org: Org, worker: dict[str, Any], session: str) -> str:
    await app.turns.run(api_trigger(org, worker, "hard #escalate #complete", session))
    await drain(app.lead_runner)
    await drain(app.relay)  # the card is posted
    detail = (await app.reviews.queue(org.principal))["items"]
    return str(next(i["id"] for i in detail if i["status"] == "awaitingHuman"))


async def test_a_linked_member_decides_and_the_audit_names_the_platform(app: App) -> None:
    org, worker = await setup(app)
    item_id = await escalated(app, org, worker, "s1")
    slack = app.channels["slack"]
    assert isinstance(slack, ScriptedChannel)
    [posted] = slack.calls
    assert posted.card is not None and posted.card.item_id == item_id

    decided = _sample(METRICS.decisions, surface="slack", verdict="approve")
    waited = _sample(METRICS.time_to_decision, "_count", reason="awaitingHuman")
    answer = await app.chat_reviews.decide("slack", MEMBER, item_id, "approve", message_id="ext-1")
    assert answer.decided
    assert _sample(METRICS.decisions, surface="slack", verdict="approve") == decided + 1
    assert _sample(METRICS.time_to_decision, "_count", reason="awaitingHuman") == waited + 1
    assert answer.card is not None and answer.card.outcome is not None
    assert answer.card.outcome.by == "member@acme.io"
    assert (await item_row(app, item_id))["status"] in ("approved", "completed")
    approve = next(a for a in await item_audit(app, item_id) if a["action"] == "approve")
    assert approve["surface"] == "slack" and approve["identity"] == f"slack:{MEMBER}"
    assert approve["actor"].startswith("user:")
    # The clicked card (and any other) is edited by the outbox.
    await drain(app.relay)
    [(edited, message)] = slack.updates
    assert edited == "ext-1" and isinstance(message.card, Card)
    assert message.card.outcome is not None and message.card.outcome.title == "Approved"


async def test_a_click_before_its_cards_message_id_is_recorded_shows_it_decided(
    app: App,
) -> None:
    """A click naming its own card (its delivery id) that comes before the outbox
    recorded the card's message id (the platform answered the post; the record follows)
    is answered on that card, decided: found by the message id alone, it was not found,
    and the clicker's card was not shown decided in place (nor a second clicker's)."""
    org, worker = await setup(app)
    await app.turns.run(api_trigger(org, worker, "hard #escalate #complete", "s1"))
    await drain(app.lead_runner)  # the card is queued, its message id not known yet
    d = t.deliveries.c
    async with app.db.read() as conn:
        row = (await conn.execute(sa.select(d.id, d.work_item_id).where(d.kind == "card"))).one()
    card_id, item_id = str(row.id), str(row.work_item_id)
    first = await app.chat_reviews.decide(
        "slack", MEMBER, item_id, "approve", message_id="ext-1", card_id=card_id
    )
    assert first.decided
    assert first.card is not None and first.card.outcome is not None
    assert first.card.outcome.by == "member@acme.io"
    late = await app.chat_reviews.decide(
        "slack", MEMBER, item_id, "approve", message_id="ext-1", card_id=card_id
    )
    assert late.kind == "closed" and late.text.startswith("Already approved by member@acme.io")
    assert late.card is not None and late.card.outcome is not None


def _sample(metric: Any, suffix: str = "_total", **labels: str) -> float:
    return float(
        sum(
            s.value
            for family in metric.collect()
            for s in family.samples
            if s.name.endswith(suffix) and all(s.labels.get(k) == v for k, v in labels.items())
        )
    )


async def test_unlinked_viewer_and_other_org_users_change_nothing(app: App) -> None:
    org, worker = await setup(app)
    other_org, _ = await setup(app, "other")  # MEMBER is linked there too, as its member
    item_id = await escalated(app, org, worker, "s1")
    async with app.db.tx() as conn:
        await links.unlink(
            conn, org_id=org.id, email="member@acme.io", platform="slack", identity=MEMBER
        )
    before = await item_audit(app, item_id)
    for who in (MEMBER, VIEWER, "T0001:U0STRANGER"):
        for action in ("approve", "reject"):
            answer = await app.chat_reviews.decide("slack", who, item_id, action, "no")
            assert (answer.kind, answer.text) == ("forbidden", FORBIDDEN)
        assert (await app.chat_reviews.check("slack", who, item_id)).kind == "forbidden"
    assert (await item_row(app, item_id))["status"] == "awaitingHuman"
    assert await item_audit(app, item_id) == before
    assert other_org.id != org.id


async def test_two_clicks_at_once_make_one_decision_and_the_other_is_told(app: App) -> None:
    org, worker = await setup(app)
    item_id = await escalated(app, org, worker, "s1")
    answers = await asyncio.gather(
        *(app.chat_reviews.decide("slack", MEMBER, item_id, "approve") for _ in range(3))
    )
    kinds = sorted(a.kind for a in answers)
    assert kinds == ["closed", "closed", "decided"]
    told = [a.text for a in answers if a.kind == "closed"]
    assert all(t.startswith("Already approved by member@acme.io (slack) at ") for t in told), told
    actions = [a["action"] for a in await item_audit(app, item_id)]
    assert actions.count("approve") == 1


async def test_reasons_are_checked_and_late_clicks_answer_the_outcome(app: App) -> None:
    org, worker = await setup(app)
    item_id = await escalated(app, org, worker, "s1")
    for bad in (None, "   ", "x" * 2_001):
        answer = await app.chat_reviews.decide("slack", MEMBER, item_id, "reject", bad)
        assert answer.kind == "invalid" and "reason" in answer.text
    answer = await app.chat_reviews.decide("slack", MEMBER, item_id, "reject", "off topic")
    assert answer.decided
    row = next(a for a in await item_audit(app, item_id) if a["action"] == "reject")
    assert (row["text"], row["surface"]) == ("off topic", "slack")

    late = await app.chat_reviews.decide("slack", MEMBER, item_id, "approve")
    assert late.kind == "closed"
    assert late.text.startswith("Already rejected by member@acme.io (slack)")
    assert late.text.endswith("Z.") and late.said == "off topic"


async def test_a_console_decision_is_what_a_late_click_hears(app: App) -> None:
    org, worker = await setup(app)
    item_id = await escalated(app, org, worker, "s1")
    await app.reviews.decide(org.principal, item_id, "return", "add tests", surface="console")
    answer = await app.chat_reviews.decide("slack", MEMBER, item_id, "approve")
    assert answer.kind == "closed"
    assert answer.text.startswith(
        f"Already returned to the worker by API key {org.principal.key_id}"
    )
    slack = app.channels["slack"]
    await drain(app.relay)
    assert isinstance(slack, ScriptedChannel)
    [(_, update)] = slack.updates
    assert update.card is not None and update.card.outcome is not None
    assert (update.card.outcome.title, update.card.outcome.surface) == (
        "Returned to the worker",
        "console",
    )


async def test_a_card_of_an_earlier_wait_is_out_of_date(app: App) -> None:
    org, worker = await setup(app)
    item_id = await escalated(app, org, worker, "s1")
    slack = app.channels["slack"]
    assert isinstance(slack, ScriptedChannel)
    old = slack.calls[0].card
    assert old is not None
    # Returned; the revision escalates again (#escalate is still in the task context).
    await app.reviews.decide(org.principal, item_id, "return", "again", surface="api")
    await drain(RevisionRunner(app.turns))
    await drain(app.lead_runner)
    assert (await item_row(app, item_id))["status"] == "awaitingHuman"
    answer = await app.chat_reviews.decide(
        "slack", MEMBER, item_id, "approve", episode_id=old.episode_id
    )
    assert answer.kind == "stale"
    # A card that names only itself (a Discord card) is of its own row's wait: the old
    # one is out of date too, and so is a card of another item or organization.
    other_org, other_worker = await setup(app, "other")
    await escalated(app, other_org, other_worker, "o1")
    foreign = slack.calls[-1].card
    assert foreign is not None and foreign.item_id != item_id
    for card_id in (old.card_id, foreign.card_id, "dlv_none"):
        checked = await app.chat_reviews.check("slack", MEMBER, item_id, card_id=card_id)
        decided = await app.chat_reviews.decide(
            "slack", MEMBER, item_id, "approve", card_id=card_id
        )
        assert checked.kind == decided.kind == "stale", card_id
    assert (await item_row(app, item_id))["status"] == "awaitingHuman"
    # The new wait's own card decides.
    new = next(c.card for c in reversed(slack.calls) if c.card and c.card.item_id == item_id)
    assert new.episode_id != old.episode_id
    answer = await app.chat_reviews.decide("slack", MEMBER, item_id, "approve", card_id=new.card_id)
    assert answer.kind == "decided", answer


async def test_a_recovery_card_of_an_earlier_unknown_send_is_out_of_date(app: App) -> None:
    # A Retry that ends unknown again opens a new card; a click on the first card's
    # buttons came from someone looking at the old state and must change nothing.
    org, worker = await setup(app)
    slack = app.channels["slack"]
    assert isinstance(slack, ScriptedChannel)

    def answer(message: OutboundMessage) -> SendOutcome:
        if message.kind == "card":
            return Sent(f"card-{len(slack.calls)}")
        return Uncertain("read timeout after the request was written")

    slack.script = [answer] * 10
    await app.turns.run(slack_trigger(org, worker, "post it #complete", "1700.1"))
    await drain(app.lead_runner)
    await drain(app.relay)  # the post times out: deliveryUnknown, and its card is posted
    first = next(c.card for c in slack.calls if c.card is not None)
    delivery_id = first.delivery_id
    assert delivery_id is not None
    retried = await app.chat_reviews.recover(
        "slack", MEMBER, delivery_id, "retry", episode_id=first.episode_id
    )
    assert retried.kind == "decided"
    await drain(app.relay)  # unknown again: a second card
    second = [c.card for c in slack.calls if c.card is not None][-1]
    assert second.episode_id != first.episode_id
    attempts = len([c for c in slack.calls if c.card is None])
    for verb in ("retry", "confirm"):
        # (the first card names its wait, or only itself, as a Discord card does)
        for named in ({"episode_id": first.episode_id}, {"card_id": first.card_id}):
            stale = await app.chat_reviews.recover("slack", MEMBER, delivery_id, verb, **named)
            assert stale.kind == "stale", named
    await drain(app.relay)
    assert len([c for c in slack.calls if c.card is None]) == attempts  # no third post
    confirmed = await app.chat_reviews.recover(
        "slack", MEMBER, delivery_id, "confirm", card_id=second.card_id
    )
    assert confirmed.kind == "decided"


async def test_a_card_retry_while_a_lapsed_send_may_still_post_says_how_long_to_wait(
    app: App,
) -> None:
    """A Retry clicked on the card of a post whose send lease lapsed a moment ago (its
    relay stalled mid-send, and may still post it) is refused with the seconds left
    (``delivery.in_flight``), not answered "already ..." as if someone had decided;
    nothing changes, and after the wait the Retry is taken."""
    org, worker = await setup(app)
    slack = app.channels["slack"]
    assert isinstance(slack, ScriptedChannel)
    clock = app.clock
    assert isinstance(clock, FakeClock)
    await app.turns.run(slack_trigger(org, worker, "post it #complete", "1700.1"))
    await drain(app.lead_runner)
    d = t.deliveries.c
    async with app.db.read() as conn:
        post = (await conn.execute(sa.select(t.deliveries).where(d.kind == "gating"))).one()
    if post.status == "pending":
        assert len(await app.relay.claim()) == 1
    clock.advance(SEND_LEASE_MS + 1)
    assert await app.relay.expire_send_leases() == 1
    await drain(app.relay)  # the uncertain post's card
    card = next(c.card for c in slack.calls if c.card is not None)
    assert card.delivery_id == post.id
    answer = await app.chat_reviews.recover(
        "slack", MEMBER, post.id, "retry", episode_id=card.episode_id
    )
    assert answer.kind == "invalid" and "retry in 60 s" in answer.text, answer
    async with app.db.read() as conn:
        status = (await conn.execute(sa.select(d.status).where(d.id == post.id))).scalar()
    assert status == "deliveryUnknown"
    clock.advance(IN_FLIGHT_AFTER_LAPSE_MS)
    answer = await app.chat_reviews.recover(
        "slack", MEMBER, post.id, "retry", episode_id=card.episode_id
    )
    assert answer.kind == "decided", answer


async def test_teams_conversations_are_remembered_for_notify_add(app: App) -> None:
    org, _ = await setup(app)
    reference: dict[str, object] = {
        "serviceUrl": "http://127.0.0.1:9/",
        "conversation": {"id": "19:rev@thread.tacv2", "tenantId": "t1"},
        "bot": {"id": "28:bot"},
        "channelId": "msteams",
    }
    await app.chat_reviews.remember_teams_conversation(reference)
    added = await add_destination(app, org.id, "teams", "19:rev@thread.tacv2")
    assert added.address == {"reference": reference}
    # A whole reference as JSON works too (named by its conversation id).
    other = {**reference, "conversation": {"id": "19:json@thread.tacv2"}, "padding": "x" * 600}
    by_json = await add_destination(app, org.id, "teams", json.dumps(other))
    assert (by_json.target, by_json.address) == ("19:json@thread.tacv2", {"reference": other})
    # What an unauthenticated local-mode activity may carry never fails the write
    # (PostgreSQL refused the NUL, and a tenant longer than its column).
    for conversation in (
        {"id": "19:a\x00b@thread.tacv2"},
        {"id": "19:" + "x" * 400},
        {"id": "19:odd@thread.tacv2", "tenantId": "t\x00" + "y" * 200},
    ):
        await app.chat_reviews.remember_teams_conversation(
            {**reference, "conversation": conversation}
        )
    async with app.db.read() as conn:
        kept = {
            row.conversation_id: row.tenant_id
            for row in await conn.execute(sa.select(t.teams_conversations))
        }
    assert kept == {"19:rev@thread.tacv2": "t1", "19:odd@thread.tacv2": None}


async def test_a_click_naming_ids_no_card_carries_changes_nothing(app: App) -> None:
    # A NUL failed the lookups on PostgreSQL (a 500 to Slack, Discord and Teams).
    org, worker = await setup(app)
    item_id = await escalated(app, org, worker, "s1")
    reviews = app.chat_reviews
    nul = "\x00"
    assert (await reviews.check("slack", MEMBER, item_id + nul)).kind == "closed"
    assert (await reviews.check("slack", MEMBER + nul, item_id)).kind == "forbidden"
    for answer in (
        await reviews.decide("slack", MEMBER, item_id + nul, "approve"),
        await reviews.decide("slack", MEMBER, item_id, "approve", episode_id="ep" + nul),
        await reviews.decide("slack", MEMBER, item_id, "approve", message_id=nul),
        await reviews.recover("slack", MEMBER, "dl" + nul, "confirm"),
    ):
        assert answer.kind == "closed", answer
    forbidden = await reviews.decide("slack", MEMBER + nul, item_id, "approve")
    assert forbidden.kind == "forbidden"
    # JSON of another type where a card puts a string (a Teams invoke's `episode` as an
    # object, a Slack modal's `ts` as a number): an AttributeError, a 500, before.
    odd: Any = {"episode": "x"}
    odd_ts: Any = 1.5
    assert (await reviews.decide("teams", MEMBER, item_id, "approve", episode_id=odd)).kind == (
        "closed"
    )
    assert (await reviews.decide("slack", MEMBER, item_id, "approve", message_id=odd_ts)).kind == (
        "closed"
    )
    assert (await reviews.check("slack", odd, item_id)).kind == "forbidden"
    assert (await item_row(app, item_id))["status"] == "awaitingHuman"
    # The same click with the card's own ids decides.
    assert (await reviews.decide("slack", MEMBER, item_id, "approve")).decided


# ------------------------------------- a card whose post is in flight at decision time


@pytest.fixture
async def slack_app(migrated_url: str, slack_api: SlackApiStandin) -> AsyncIterator[App]:
    """:func:`app` posting through the real Slack adapter to the Web API stand-in."""
    settings = Settings.model_validate(
        {"database": {"url": migrated_url}, "server": {"public_url": "https://lg.example"}}
    )
    slack = SlackChannel(
        SlackSettings(signing_secret="s", bot_token="xoxb-x", api_url=slack_api.api_url),
        timeout_s=10.0,
    )
    service = App(settings, clock=FakeClock(), enable_adapters=False, channels={"slack": slack})
    yield service
    await service.stop()


async def card_rows(app: App, item_id: str, channel: str) -> dict[str, list[dict[str, Any]]]:
    """The item's card deliveries on ``channel`` by kind (``card``, ``cardUpdate``)."""
    d = t.deliveries.c
    async with app.db.read() as conn:
        rows = (
            await conn.execute(
                sa.select(d.id, d.kind, d.status, d.external_id, d.error)
                .where(
                    d.work_item_id == item_id,
                    d.kind.in_(["card", "cardUpdate"]),
                    d.channel == channel,
                )
                .order_by(d.created_at, d.id)
            )
        ).all()
    found: dict[str, list[dict[str, Any]]] = {"card": [], "cardUpdate": []}
    for row in rows:
        found[row.kind].append(dict(row._mapping))
    return found


async def decided_while_posting(
    app: App, org: Org, worker: dict[str, Any], standin: StandinBase, answer: str, channel: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """An item of ``worker`` escalates; while ``standin`` holds the post of its card on
    ``channel`` (read, not answered yet), the item is approved through the API; the post
    is then answered with ``answer``, and an hour later the relay runs again. The card's
    row and its edit's row."""
    await app.turns.run(api_trigger(org, worker, "hard #escalate #complete", "s1"))
    await drain(app.lead_runner)
    [item] = (await app.reviews.queue(org.principal))["items"]
    item_id = str(item["id"])

    async def decide_meanwhile(record: dict[str, Any]) -> None:
        standin.on_post = None
        await app.reviews.decide(org.principal, item_id, "approve", surface="api")

    standin.on_post = decide_meanwhile
    standin.queue(answer)
    await drain(app.relay)
    assert standin.on_post is None  # the decision was made while the post was in flight
    assert (await item_row(app, item_id))["status"] == "completed"
    clock = app.clock
    assert isinstance(clock, FakeClock)
    clock.advance(3_600_000)  # a post refused for now would be due again by now
    await drain(app.relay)
    rows = await card_rows(app, item_id, channel)
    [card], [update] = rows["card"], rows["cardUpdate"]
    # Posted (or tried) once, never after the decision (Discord also records its edits).
    posts = [r for r in standin.requests if r.get("op", "create_message") == "create_message"]
    assert len(posts) == 1, standin.requests
    assert (await app.reviews.uncertain(org.principal))["deliveries"] == []
    return card, update


@pytest.mark.parametrize("answer", ["ratelimited:7", "reset", "channel_not_found", "ok"])
async def test_a_slack_card_being_posted_when_the_item_is_decided(
    slack_app: App, slack_api: SlackApiStandin, answer: str
) -> None:
    """The relay is posting the card (Slack has read the request and not answered yet)
    when the item is approved through the API, which queues the card's edit. Refused
    for now or maybe posted, the card ends ``cancelled`` as a card not yet sent at
    decision time does: it is not posted after the decision (a card asking to decide
    what is decided) nor left ``deliveryUnknown`` for an operator, and its edit ends
    with it, never sent. Refused for good, the card is ``failed`` and its edit
    ``cancelled`` (not a second failure). Posted, it is edited to show the outcome."""
    org, worker = await setup(slack_app)
    # (an edit may also be retried while its card is on its way: not counted here)
    outcomes = ("deliveryUnknown", "permanent", "cancelled")
    before = [deliveries_counted("slack", outcome) for outcome in outcomes]
    card, update = await decided_while_posting(slack_app, org, worker, slack_api, answer, "slack")
    expected = {
        "ratelimited:7": ("cancelled", "cancelled"),
        "reset": ("cancelled", "cancelled"),
        "channel_not_found": ("failed", "cancelled"),
        "ok": ("sent", "sent"),
    }
    assert (card["status"], update["status"]) == expected[answer], (card, update)
    # Each is counted as what became of it: an ended card and an ended edit as
    # ``cancelled`` (not ``retry`` nor ``deliveryUnknown``, nor ``permanent``).
    counted = {
        outcome: n - was
        for outcome, was in zip(outcomes, before, strict=True)
        if (n := deliveries_counted("slack", outcome)) != was
    }
    assert (
        counted
        == {
            "ratelimited:7": {"cancelled": 2.0},
            "reset": {"cancelled": 2.0},
            "channel_not_found": {"permanent": 1.0, "cancelled": 1.0},
            "ok": {},
        }[answer]
    )
    edits = [c for c in slack_api.calls if c["method"] == "chat.update"]
    if answer == "ok":
        [edit] = edits
        assert edit["ts"] == card["external_id"] == slack_api.posts[0]["ts"]
        assert "Approved" in edit["text"]
    else:
        assert edits == [] and slack_api.posts == []
        assert update["error"] == f"the card was not posted ({card['status']}); nothing to update"


@pytest.fixture
async def discord_app(migrated_url: str, discord_api: DiscordApiStandin) -> AsyncIterator[App]:
    """:func:`app` posting Discord cards through the real adapter to the stand-in."""
    settings = Settings.model_validate(
        {"database": {"url": migrated_url}, "server": {"public_url": "https://lg.example"}}
    )
    endpoints = DiscordSettings(bot_token="bot-token", api_url=discord_api.api_url)
    configure_endpoints(endpoints)
    discord_out = DiscordChannel(endpoints, timeout_s=10.0)
    channels: dict[str, Channel] = {"slack": ScriptedChannel("slack"), "discord": discord_out}
    service = App(settings, clock=FakeClock(), enable_adapters=False, channels=channels)
    yield service
    await service.stop()
    await discord_out.close()


@pytest.mark.parametrize("answer", ["reset", "ok"])
async def test_a_discord_card_being_posted_when_the_item_is_decided(
    discord_app: App, discord_api: DiscordApiStandin, answer: str
) -> None:
    """The same on Discord: maybe posted, the card and its edit end ``cancelled``;
    posted, the card is edited (``PATCH``) to show the outcome."""
    org, worker = await setup(discord_app)
    await add_destination(discord_app, org.id, "discord", DISCORD_CHANNEL)
    card, update = await decided_while_posting(
        discord_app, org, worker, discord_api, answer, "discord"
    )
    edits = [p for p in discord_api.posts if p["op"] == "edit_message"]
    if answer == "ok":
        assert (card["status"], update["status"]) == ("sent", "sent")
        [edit] = edits
        assert edit["message_id"] == card["external_id"]
        assert "**Approved** by API key" in edit["content"]
    else:
        assert (card["status"], update["status"]) == ("cancelled", "cancelled")
        assert edits == []
