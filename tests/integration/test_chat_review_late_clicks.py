"""A click on a card whose item was decided elsewhere (the console here) before the
outbox's edit of that card arrived, through the real Slack and Discord adapters on the
real composition root: the clicked card shows the outcome at once, buttons gone, and
the Slack clicker is also told who decided."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import sqlalchemy as sa
from aiohttp.test_utils import TestServer
from nacl.signing import SigningKey

from bots import discord_review
from bots.slack_review import BLOCK_PREFIX, blocks
from bots.teams_review import CARD_TYPE, MESSAGE_TYPE, adaptive_card
from leadgate.app import App
from leadgate.core.runners import drain
from leadgate.database import schema as t
from leadgate.operations.chat_reviews import STALE
from leadgate.review.cards import open_episode as _open_episode
from leadgate.review.facts import review_facts
from outbox.channel import Card, Uncertain
from tests.helpers import Org, eventually, item_row
from tests.integration.test_chat_review_faults import (
    DISCORD_USER,
    TEAM,
    TEAMS_AAD,
    USER,
    answers,
    approve_click,
    link_more,
    post,
    reject_form,
    serving,
    slack_click,
)
from tests.integration.test_chat_reviews import escalated, setup
from tests.outbox_support import ScriptedChannel
from tests.review_support import add_destination
from tests.standins.connector import invoke_activity
from tests.standins.discord_api import interaction_headers
from tests.standins.slack_api import SlackApiStandin


@pytest.fixture
async def served(
    migrated_url: str, key: SigningKey, slack_api: SlackApiStandin
) -> AsyncIterator[tuple[App, TestServer]]:
    async with serving(migrated_url, key, slack_api) as pair:
        yield pair


async def remembered_teams(app: App) -> str:
    """A Teams conversation the service has a reference for (as an installation's first
    activity leaves it), so that review cards can be posted there: its id."""
    conversation = "19:rev@thread.tacv2"
    await app.chat_reviews.remember_teams_conversation(
        {
            "serviceUrl": "http://127.0.0.1:9/",
            "conversation": {"id": conversation, "tenantId": "tenant-1"},
            "bot": {"id": "28:leadgate-bot"},
            "channelId": "msteams",
        }
    )
    return conversation


async def card_message(app: App, item_id: str, channel: str) -> str:
    d = t.deliveries.c
    async with app.db.read() as conn:
        found = (
            await conn.execute(
                sa.select(d.external_id).where(
                    d.work_item_id == item_id, d.kind == "card", d.channel == channel
                )
            )
        ).scalar_one()
    return str(found)


async def decided_in_the_console(app: App, channels: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    org, worker = await setup(app)
    await link_more(app, org)
    for channel in channels[1:]:
        await add_destination(app, org.id, channel, "1000000000000000009")
    item_id = await escalated(app, org, worker, "s1")
    posted = {channel: await card_message(app, item_id, channel) for channel in channels}
    # Decided in the console; the relay has not edited the cards yet.
    await app.reviews.decide(org.principal, item_id, "approve", surface="console")
    return item_id, posted


async def test_a_late_slack_click_shows_the_outcome_on_the_clicked_card(
    served: tuple[App, TestServer], slack_api: SlackApiStandin
) -> None:
    app, server = served
    item_id, posted = await decided_in_the_console(app, ("slack",))
    click = approve_click(slack_api, item_id, "late")
    click["container"]["message_ts"] = posted["slack"]
    status, _ = await slack_click(server, click)
    assert status == 200
    await eventually(lambda: len(answers(slack_api, "late")) == 2)
    replaced, told = answers(slack_api, "late")
    # The card in place: the outcome, no buttons (it kept them until the outbox's edit).
    assert replaced["replace_original"] is True
    assert not any(b["type"] == "actions" for b in replaced["blocks"])
    [line] = replaced["blocks"][-1]["elements"]
    approved, by = line["elements"][:2]
    assert approved == {"type": "text", "text": "Approved", "style": {"bold": True}}
    assert by["text"].startswith(" by API key")
    assert told["response_type"] == "ephemeral" and told["replace_original"] is False
    assert told["text"].startswith("Already approved by API key")
    assert (await item_row(app, item_id))["status"] in ("approved", "completed")


async def discord_click(
    server: TestServer,
    key: SigningKey,
    item_id: str,
    episode: str,
    message: str,
    channel: str,
    user: str = DISCORD_USER,
    verb: str = "approve",
    *,
    form: tuple[str, dict[str, str]] | None = None,
) -> dict[str, Any]:
    """A click on button ``lg:<verb>:<item_id>:<episode>`` (``episode``: the wait, or
    ``c=<card>`` on a card that names itself) of message ``message`` in ``channel``; with
    ``form`` (a modal's custom_id, its text inputs), that modal's submission."""
    data: dict[str, Any] = {"custom_id": f"lg:{verb}:{item_id}:{episode}", "component_type": 2}
    if form is not None:
        inputs = [{"type": 4, "custom_id": k, "value": v} for k, v in form[1].items()]
        data = {"custom_id": form[0], "components": [{"type": 1, "components": inputs}]}
    interaction: dict[str, Any] = {
        "type": 3 if form is None else 5,
        "id": "900000000000000003",
        "application_id": "800000000000000001",
        "token": "itoken",
        "channel_id": channel,
        "member": {"user": {"id": user}, "flags": 0},
        "message": {"id": message},
        "data": data,
    }
    raw = json.dumps(interaction).encode()
    async with aiohttp.ClientSession() as session:
        async with session.post(
            server.make_url("/discord/interactions"),
            data=raw,
            headers=interaction_headers(key, raw),
        ) as r:
            assert r.status == 200
            answer: dict[str, Any] = await r.json()
    return answer


async def test_a_late_discord_click_shows_the_outcome_on_the_clicked_card(
    served: tuple[App, TestServer], key: SigningKey
) -> None:
    app, server = served
    item_id, posted = await decided_in_the_console(app, ("slack", "discord"))
    answer = await discord_click(
        server, key, item_id, "-", posted["discord"], "1000000000000000009"
    )
    # UPDATE_MESSAGE with the decided card (it was an ephemeral line, the buttons kept).
    assert answer["type"] == 7
    assert "**Approved** by API key" in answer["data"]["content"]
    assert all(
        c.get("style") == 5 for row in answer["data"]["components"] for c in row["components"]
    )


# ------------------------------------------------- a click on a card posted uncertainly


@pytest.fixture
def scripted() -> dict[str, ScriptedChannel]:
    return {name: ScriptedChannel(name) for name in ("slack", "discord", "teams")}


@pytest.fixture
async def uncertain_served(
    migrated_url: str,
    key: SigningKey,
    slack_api: SlackApiStandin,
    scripted: dict[str, ScriptedChannel],
) -> AsyncIterator[tuple[App, TestServer]]:
    async with serving(migrated_url, key, slack_api, scripted) as pair:
        yield pair


async def open_episode(app: App, item_id: str) -> str:
    async with app.db.read() as conn:
        found = await _open_episode(conn, item_id)
    assert found is not None
    return found


async def card_delivery(app: App, item_id: str, channel: str) -> dict[str, Any]:
    d = t.deliveries.c
    async with app.db.read() as conn:
        row = (
            await conn.execute(
                sa.select(d.id, d.status, d.external_id).where(
                    d.work_item_id == item_id, d.kind == "card", d.channel == channel
                )
            )
        ).one()
    return dict(row._mapping)


async def confirmations(app: App, delivery_id: str) -> list[tuple[str | None, str | None]]:
    a = t.audit.c
    async with app.db.read() as conn:
        rows = await conn.execute(
            sa.select(a.surface, a.identity).where(
                a.delivery_id == delivery_id, a.action == "deliveryConfirmed"
            )
        )
        return [(r.surface, r.identity) for r in rows]


async def card_statuses(app: App, item_id: str, channel: str) -> dict[str, tuple[str, str | None]]:
    """The status and message id of each card of ``item_id`` on ``channel``, by delivery."""
    d = t.deliveries.c
    async with app.db.read() as conn:
        rows = await conn.execute(
            sa.select(d.id, d.status, d.external_id).where(
                d.work_item_id == item_id, d.kind == "card", d.channel == channel
            )
        )
        return {r.id: (r.status, r.external_id) for r in rows}


async def two_uncertain_cards(
    app: App, org: Org, worker: dict[str, Any], channel: ScriptedChannel
) -> tuple[str, str, Card, Card]:
    """An item waiting with two cards on ``channel`` whose posts were both uncertain: the
    original and a reminder of the same wait. Returns the item, the wait, both cards."""
    channel.script = [Uncertain(f"{channel.name}: no answer")] * 2
    item_id = await escalated(app, org, worker, "s1")
    episode = await open_episode(app, item_id)
    async with app.db.tx() as conn:
        facts = (await review_facts(conn, [item_id]))[item_id]
        assert await app.notifier.post(conn, episode, facts, "reminder") >= 1
    await drain(app.relay)
    original, reminder = [posted.card for posted in channel.calls]
    assert original is not None and reminder is not None
    assert original.card_id and reminder.card_id and original.card_id != reminder.card_id
    uncertain = ("deliveryUnknown", None)
    assert await card_statuses(app, item_id, channel.name) == {
        original.card_id: uncertain,
        reminder.card_id: uncertain,
    }
    return item_id, episode, original, reminder


async def updates_of(app: App, delivery_id: str) -> int:
    d = t.deliveries.c
    async with app.db.read() as conn:
        rows = await conn.execute(
            sa.select(d.address).where(d.kind == "cardUpdate", d.work_item_id.is_not(None))
        )
        return sum(1 for r in rows if (r.address or {}).get("card_delivery_id") == delivery_id)


async def test_a_click_on_an_uncertain_discord_card_settles_it_and_decisions_edit_it(
    uncertain_served: tuple[App, TestServer],
    key: SigningKey,
    scripted: dict[str, ScriptedChannel],
) -> None:
    app, server = uncertain_served
    org, worker = await setup(app)
    await link_more(app, org)
    await add_destination(app, org.id, "discord", "1000000000000000009")
    scripted["discord"].script = [Uncertain("discord: no answer before the timeout")]
    item_id = await escalated(app, org, worker, "s1")
    card = await card_delivery(app, item_id, "discord")
    assert (card["status"], card["external_id"]) == ("deliveryUnknown", None)
    episode = await open_episode(app, item_id)
    message, channel = "1100000000000000001", "1000000000000000009"

    # A click by someone who may not review, or on a card of another wait, settles
    # nothing.
    outsider = await discord_click(
        server, key, item_id, episode, message, channel, user="999888777666555444"
    )
    assert outsider["type"] == 4 and "cannot review" in outsider["data"]["content"]
    assert (await card_delivery(app, item_id, "discord"))["status"] == "deliveryUnknown"
    stale = await discord_click(server, key, item_id, "rep_other", message, channel)
    assert stale["type"] == 4 and stale["data"]["flags"] == 64
    assert (await card_delivery(app, item_id, "discord"))["status"] == "deliveryUnknown"

    # The click proves the post landed: the card is confirmed delivered with the
    # clicked message's id (audited with the clicker), the decided card is shown in
    # place, and the decision's card update edits that message.
    answer = await discord_click(server, key, item_id, episode, message, channel)
    assert answer["type"] == 7, answer  # it was an ephemeral line: no card found by id
    assert "**Approved**" in answer["data"]["content"]
    settled = await card_delivery(app, item_id, "discord")
    assert (settled["status"], settled["external_id"]) == ("sent", message)
    assert await confirmations(app, card["id"]) == [("discord", f"discord:{DISCORD_USER}")]
    assert await updates_of(app, card["id"]) == 1
    await drain(app.relay)
    assert [edited for edited, _ in scripted["discord"].updates] == [message]

    # A replayed click changes nothing: no second confirmation, no second edit.
    again = await discord_click(server, key, item_id, episode, message, channel)
    assert again["type"] == 7
    assert await confirmations(app, card["id"]) == [("discord", f"discord:{DISCORD_USER}")]
    assert await updates_of(app, card["id"]) == 1
    assert (await item_row(app, item_id))["status"] in ("approved", "completed")


async def test_a_late_slack_click_on_an_uncertain_card_settles_only_its_own_channel(
    uncertain_served: tuple[App, TestServer],
    slack_api: SlackApiStandin,
    scripted: dict[str, ScriptedChannel],
) -> None:
    app, server = uncertain_served
    org, worker = await setup(app)
    scripted["slack"].script = [Uncertain("slack: no answer before the timeout")]
    item_id = await escalated(app, org, worker, "s1")
    card = await card_delivery(app, item_id, "slack")
    assert card["status"] == "deliveryUnknown"
    await app.reviews.decide(org.principal, item_id, "approve", surface="console")
    assert await updates_of(app, card["id"]) == 0  # no id to edit

    # The same ts in a channel the card was not posted to: not this card.
    elsewhere = approve_click(slack_api, item_id, "elsewhere")
    elsewhere["container"].update(message_ts="1700000000.000100", channel_id="C0OTHER")
    assert (await slack_click(server, elsewhere))[0] == 200
    await eventually(lambda: len(answers(slack_api, "elsewhere")) >= 1)
    assert (await card_delivery(app, item_id, "slack"))["status"] == "deliveryUnknown"

    click = approve_click(slack_api, item_id, "late")
    click["container"].update(message_ts="1700000000.000100", channel_id="C0R")
    assert (await slack_click(server, click))[0] == 200
    await eventually(lambda: len(answers(slack_api, "late")) == 2)
    replaced, told = answers(slack_api, "late")
    assert replaced["replace_original"] is True
    assert not any(b["type"] == "actions" for b in replaced["blocks"])
    assert told["text"].startswith("Already approved by API key")
    settled = await card_delivery(app, item_id, "slack")
    assert (settled["status"], settled["external_id"]) == ("sent", "1700000000.000100")
    assert await confirmations(app, card["id"]) == [("slack", f"slack:{TEAM}:{USER}")]
    # The decision made while the post was uncertain queued no edit of this card: the
    # settling click queues the one every other card got, showing that decision.
    assert await updates_of(app, card["id"]) == 1
    await drain(app.relay)
    [(edited, update)] = scripted["slack"].updates
    assert edited == "1700000000.000100"
    assert update.card is not None and update.card.outcome is not None
    assert update.card.outcome.title == "Approved" and update.card.outcome.surface == "console"
    # A replayed click finds the message known: no second edit.
    again = approve_click(slack_api, item_id, "again")
    again["container"].update(message_ts="1700000000.000100", channel_id="C0R")
    assert (await slack_click(server, again))[0] == 200
    await eventually(lambda: len(answers(slack_api, "again")) == 2)
    assert await updates_of(app, card["id"]) == 1


async def test_a_teams_click_on_an_uncertain_card_settles_it_and_decisions_edit_it(
    uncertain_served: tuple[App, TestServer],
    scripted: dict[str, ScriptedChannel],
) -> None:
    app, server = uncertain_served
    org, worker = await setup(app)
    await link_more(app, org)
    conversation = await remembered_teams(app)
    await add_destination(app, org.id, "teams", conversation)
    scripted["teams"].script = [Uncertain("teams: no answer before the timeout")]
    item_id = await escalated(app, org, worker, "s1")
    card = await card_delivery(app, item_id, "teams")
    assert (card["status"], card["external_id"]) == ("deliveryUnknown", None)
    episode = await open_episode(app, item_id)

    async def click(in_conversation: str) -> dict[str, Any]:
        activity = invoke_activity(
            service_url="http://127.0.0.1:9/",
            verb="approve",
            data={"item": item_id, "episode": episode},
            reply_to_id="1700000000001",
            conversation_id=in_conversation,
            aad_object_id=TEAMS_AAD,
        )
        status, body = await post(
            server,
            "/api/messages",
            json.dumps(activity).encode(),
            {"Content-Type": "application/json"},
        )
        assert status == 200
        return dict(body)

    # The same activity id in another conversation is not this card.
    assert (await click("19:other@thread.tacv2;messageid=1700000000001"))["type"] != CARD_TYPE
    assert (await card_delivery(app, item_id, "teams"))["status"] == "deliveryUnknown"
    # (that click decided the item: the uncertain card could not be edited)
    assert await updates_of(app, card["id"]) == 0
    # The late click in the card's conversation settles it, and is answered on it. A
    # card posted into a channel starts its own reply chain: Teams names the click's
    # conversation by the channel's id and ";messageid=" the card's.
    answer = await click(f"{conversation};messageid=1700000000001")
    assert answer["type"] == CARD_TYPE, answer
    settled = await card_delivery(app, item_id, "teams")
    assert (settled["status"], settled["external_id"]) == ("sent", "1700000000001")
    assert await confirmations(app, card["id"]) == [("teams", f"teams:{TEAMS_AAD}")]


async def test_a_reject_click_that_opens_the_form_settles_an_uncertain_card_deciding_nothing(
    uncertain_served: tuple[App, TestServer],
    key: SigningKey,
    slack_api: SlackApiStandin,
    scripted: dict[str, ScriptedChannel],
) -> None:
    app, server = uncertain_served
    org, worker = await setup(app)
    await link_more(app, org)
    await add_destination(app, org.id, "discord", "1000000000000000009")
    for name in ("slack", "discord"):
        scripted[name].script = [Uncertain(f"{name}: no answer before the timeout")]
    item_id = await escalated(app, org, worker, "s1")
    episode = await open_episode(app, item_id)
    slack_card = await card_delivery(app, item_id, "slack")
    discord_card = await card_delivery(app, item_id, "discord")
    assert slack_card["status"] == discord_card["status"] == "deliveryUnknown"

    # Slack: the click opens the reason form and proves the card posted.
    click = approve_click(slack_api, item_id, "reject")
    click["actions"][0].update(action_id="reject", block_id=BLOCK_PREFIX + episode)
    click["container"].update(message_ts="1700000000.000100", channel_id="C0R")
    assert (await slack_click(server, click))[0] == 200
    await eventually(lambda: any(c["method"] == "views.open" for c in slack_api.calls))
    settled = await card_delivery(app, item_id, "slack")
    assert (settled["status"], settled["external_id"]) == ("sent", "1700000000.000100")
    assert await confirmations(app, slack_card["id"]) == [("slack", f"slack:{TEAM}:{USER}")]

    # Discord: the same for the click that opens the modal.
    message, channel = "1100000000000000001", "1000000000000000009"
    answer = await discord_click(server, key, item_id, episode, message, channel, verb="reject")
    assert answer["type"] == 9, answer
    settled = await card_delivery(app, item_id, "discord")
    assert (settled["status"], settled["external_id"]) == ("sent", message)
    assert await confirmations(app, discord_card["id"]) == [("discord", f"discord:{DISCORD_USER}")]

    # Neither click decided anything: the item waits, and its cards wait with it.
    assert (await item_row(app, item_id))["status"] == "awaitingHuman"
    assert await updates_of(app, slack_card["id"]) == await updates_of(app, discord_card["id"]) == 0


async def test_a_click_names_its_own_card_among_two_uncertain_ones_of_a_wait(
    uncertain_served: tuple[App, TestServer],
    slack_api: SlackApiStandin,
    scripted: dict[str, ScriptedChannel],
) -> None:
    app, server = uncertain_served
    org, worker = await setup(app)
    item_id, episode, original, reminder = await two_uncertain_cards(
        app, org, worker, scripted["slack"]
    )
    assert original.card_id and reminder.card_id
    # Each card carries its own delivery id in its actions: Slack's block_id (255
    # characters at most) and Teams' Action.Execute data.
    [actions] = [b for b in blocks(reminder) if b["type"] == "actions"]
    assert actions["block_id"] == f"{BLOCK_PREFIX}{episode}:{reminder.card_id}"
    assert len(actions["block_id"]) <= 255
    assert json.dumps(adaptive_card(reminder)).count(f'"card": "{reminder.card_id}"') == 3

    async def statuses() -> dict[str, tuple[str, str | None]]:
        return await card_statuses(app, item_id, "slack")

    uncertain = ("deliveryUnknown", None)

    # A card posted before cards named themselves: two fit, nothing is settled.
    old = approve_click(slack_api, item_id, "old")
    old["actions"][0].update(action_id="reject", block_id=BLOCK_PREFIX + episode)
    old["container"].update(message_ts="1700000000.000200", channel_id="C0R")
    assert (await slack_click(server, old))[0] == 200
    await eventually(lambda: any(c["method"] == "views.open" for c in slack_api.calls))
    assert await statuses() == {original.card_id: uncertain, reminder.card_id: uncertain}

    # The reminder's own click settles the reminder, and only it.
    click = approve_click(slack_api, item_id, "reminder")
    click["actions"][0]["block_id"] = actions["block_id"]
    click["container"].update(message_ts="1700000000.000300", channel_id="C0R")
    assert (await slack_click(server, click))[0] == 200  # decided before the ack
    assert await statuses() == {
        original.card_id: uncertain,
        reminder.card_id: ("sent", "1700000000.000300"),
    }
    assert await confirmations(app, reminder.card_id) == [("slack", f"slack:{TEAM}:{USER}")]


async def test_a_discord_click_names_its_own_card_among_two_uncertain_ones_of_a_wait(
    uncertain_served: tuple[App, TestServer],
    key: SigningKey,
    scripted: dict[str, ScriptedChannel],
) -> None:
    app, server = uncertain_served
    org, worker = await setup(app)
    await link_more(app, org)
    channel = "1000000000000000009"
    await add_destination(app, org.id, "discord", channel)
    item_id, episode, original, reminder = await two_uncertain_cards(
        app, org, worker, scripted["discord"]
    )
    assert original.card_id and reminder.card_id
    # Each button names its card (c=<its delivery>) in place of the wait: a custom_id
    # holds 100 characters, too few for both.
    buttons = [
        c["custom_id"]
        for row in discord_review.view(reminder).to_components()
        for c in row["components"]
        if "custom_id" in c
    ]
    mine = f"c={reminder.card_id}"
    assert buttons == [f"lg:{verb}:{item_id}:{mine}" for verb in ("approve", "reject", "return")]

    async def statuses() -> dict[str, tuple[str, str | None]]:
        return await card_statuses(app, item_id, "discord")

    uncertain = ("deliveryUnknown", None)
    both = {original.card_id: uncertain, reminder.card_id: uncertain}

    # A card posted before cards named themselves (the wait in its custom_id) works as
    # before: its form opens, and it settles nothing (two cards fit).
    old = await discord_click(
        server, key, item_id, episode, "1100000000000000002", channel, verb="reject"
    )
    assert old["type"] == 9 and old["data"]["custom_id"] == f"lg:reject_modal:{item_id}:{episode}"
    assert await statuses() == both

    # A card of another item and organization names no wait of this item: refused as an
    # out-of-date card is, and nothing is settled or decided.
    other_org, other_worker = await setup(app, "other")
    other_item = await escalated(app, other_org, other_worker, "o1")
    [foreign] = [
        c.card.card_id
        for c in scripted["slack"].calls
        if c.card is not None and c.card.item_id == other_item
    ]
    refused = await discord_click(
        server, key, item_id, f"c={foreign}", "1100000000000000002", channel
    )
    assert refused["type"] == 4 and refused["data"]["content"] == STALE
    assert await statuses() == both
    assert (await item_row(app, item_id))["status"] == "awaitingHuman"

    # The reminder's own Reject click settles the reminder alone; the form it opens
    # carries the card through to its submission, which decides.
    message = "1100000000000000003"
    form = await discord_click(server, key, item_id, mine, message, channel, verb="reject")
    assert form["type"] == 9, form
    assert form["data"]["custom_id"] == f"lg:reject_modal:{item_id}:{mine}"
    assert await statuses() == {original.card_id: uncertain, reminder.card_id: ("sent", message)}
    assert await confirmations(app, reminder.card_id) == [("discord", f"discord:{DISCORD_USER}")]
    decided = await discord_click(
        server,
        key,
        item_id,
        mine,
        message,
        channel,
        form=(form["data"]["custom_id"], {"reason": "Off topic."}),
    )
    assert decided["type"] == 7 and "**Rejected** by member@acme.io" in decided["data"]["content"]
    assert (await item_row(app, item_id))["status"] == "rejected"

    # The original's own click, later, settles the original: answered on it with the
    # outcome, and the update every other card got is queued for it.
    late = await discord_click(
        server, key, item_id, f"c={original.card_id}", "1100000000000000001", channel
    )
    assert late["type"] == 7 and "**Rejected**" in late["data"]["content"]
    assert await statuses() == {
        original.card_id: ("sent", "1100000000000000001"),
        reminder.card_id: ("sent", message),
    }
    assert await confirmations(app, original.card_id) == [("discord", f"discord:{DISCORD_USER}")]
    assert await updates_of(app, original.card_id) == 1


# ------------------------------------------------------- a cancel's reason on the cards

#: A reason each platform's markup would read: Slack's control characters, Discord's
#: and Teams' markdown, a second line.
CANCEL_REASON = "*dup* of <!here> & _wi_2_\n# moved to **Q3** - see [the plan](https://x.example)"
#: Slack's notification text of an answer gives it plain, as a card's does: on the
#: answer's line, in quotation marks, ``&<>`` escaped (a notification shows no mrkdwn:
#: the ``>`` quote it had showed as typed).
SLACK_NOTIFIED = (
    " “*dup* of &lt;!here&gt; &amp; _wi_2_ # moved to **Q3** - see [the plan](https://x.example)”"
)
#: Discord quotes it (markdown escaped).
#: Slack's cards and answers show it as written: a rich_text quote.
SLACK_SAID = {"type": "rich_text_quote", "elements": [{"type": "text", "text": CANCEL_REASON}]}
DISCORD_QUOTE = (
    "> \\*dup\\* of <!here> & \\_wi\\_2\\_\n"
    "> \\# moved to \\*\\*Q3\\*\\* - see \\[the plan](https://x.example)"
)


async def test_a_cancel_reason_is_shown_quoted_and_escaped_on_every_card(
    uncertain_served: tuple[App, TestServer],
    slack_api: SlackApiStandin,
    key: SigningKey,
    scripted: dict[str, ScriptedChannel],
) -> None:
    """Cancelled in the console with a reason: the cards said who cancelled, never why.
    The relay's edit of every card and a late click's card (through each adapter) show
    it under the outcome, quoted and escaped for the platform's markup."""
    app, server = uncertain_served
    org, worker = await setup(app)
    await link_more(app, org)
    await add_destination(app, org.id, "discord", "1000000000000000009")
    conversation = await remembered_teams(app)
    await add_destination(app, org.id, "teams", conversation)
    item_id = await escalated(app, org, worker, "s1")
    posted = {c: await card_message(app, item_id, c) for c in ("slack", "discord", "teams")}
    await app.reviews.decide(org.principal, item_id, "cancel", CANCEL_REASON, surface="console")
    await drain(app.relay)
    edited = {name: channel.updates for name, channel in scripted.items()}
    assert {name: [e for e, _ in updates] for name, updates in edited.items()} == {
        name: [posted[name]] for name in posted
    }
    cards = {name: updates[0][1].card for name, updates in edited.items()}
    for card in cards.values():
        assert card is not None and card.outcome is not None
        assert (card.outcome.title, card.outcome.text) == ("Cancelled", CANCEL_REASON)

    discord_quote = DISCORD_QUOTE
    teams_said = {
        "type": "RichTextBlock",
        "inlines": [{"type": "TextRun", "text": f"“{CANCEL_REASON}”", "italic": True}],
    }
    slack_card, discord_card, teams_card = (cards[name] for name in ("slack", "discord", "teams"))
    assert slack_card is not None and discord_card is not None and teams_card is not None
    assert blocks(slack_card)[-1]["elements"][-1] == SLACK_SAID
    assert discord_review.quote(CANCEL_REASON) == discord_quote
    assert "**Cancelled** by API key" in discord_review.content(discord_card)
    assert "\n" + discord_quote + "\n" in discord_review.content(discord_card)
    assert adaptive_card(teams_card)["body"][-1] == teams_said

    # A late click on each platform gets the cancelled card with its reason.
    click = approve_click(slack_api, item_id, "late")
    click["container"]["message_ts"] = posted["slack"]
    assert (await slack_click(server, click))[0] == 200
    await eventually(lambda: len(answers(slack_api, "late")) == 2)
    replaced, told = answers(slack_api, "late")
    assert replaced["blocks"][-1]["elements"][-1] == SLACK_SAID
    assert told["text"].startswith("Already cancelled by API key")
    assert told["blocks"][0]["elements"][-1] == SLACK_SAID
    answer = await discord_click(
        server, key, item_id, "-", posted["discord"], "1000000000000000009"
    )
    assert answer["type"] == 7 and "\n" + discord_quote + "\n" in answer["data"]["content"]
    activity = invoke_activity(
        service_url="http://127.0.0.1:9/",
        verb="approve",
        data={"item": item_id, "episode": "-"},
        reply_to_id=posted["teams"],
        conversation_id=conversation,
        aad_object_id=TEAMS_AAD,
    )
    status, body = await post(
        server, "/api/messages", json.dumps(activity).encode(), {"Content-Type": "application/json"}
    )
    assert status == 200 and body["type"] == CARD_TYPE, body
    assert body["value"]["body"][-1] == teams_said
    assert (await item_row(app, item_id))["status"] == "cancelled"


async def test_a_late_clicks_words_quote_the_cancel_reason_as_its_card_does(
    uncertain_served: tuple[App, TestServer],
    slack_api: SlackApiStandin,
    key: SigningKey,
) -> None:
    """The words a late click is answered with ("Already cancelled by ...") put the
    reason after a colon as typed: on Slack its ``<!here>``, ``&`` and ``*`` read as
    mrkdwn, and its second line ran on unquoted. Now quoted and escaped as on the cards:
    Slack's ephemeral answer and a late form's notice, Discord's ephemeral answer to a
    Reject (no card shown), Teams' answer to a click on a message it has no card for."""
    app, server = uncertain_served
    org, _worker = await setup(app)
    await link_more(app, org)
    conversation = await remembered_teams(app)
    item_id = await escalated(app, org, _worker, "s1")
    posted = await card_message(app, item_id, "slack")
    await app.reviews.decide(org.principal, item_id, "cancel", CANCEL_REASON, surface="console")

    click = approve_click(slack_api, item_id, "late")
    click["container"]["message_ts"] = posted
    assert (await slack_click(server, click))[0] == 200
    await eventually(lambda: len(answers(slack_api, "late")) == 2)
    told = answers(slack_api, "late")[1]
    # The notification text: one plain line, the reason in quotation marks.
    line, said, rest = told["text"].partition(SLACK_NOTIFIED)
    assert said and not rest and "\n" not in line, told
    assert line.startswith("Already cancelled by API key") and line.endswith("."), told
    # What the clicker sees: a rich_text block, the reason's * and _ shown as written.
    [shown] = told["blocks"]
    section, quoted = shown["elements"]
    assert section["elements"][0]["text"].startswith("Already cancelled by API key"), told
    assert quoted == SLACK_SAID, told
    status, form = await slack_click(server, reject_form(item_id, "too late"))
    assert status == 200 and form["response_action"] == "update", form
    assert form["view"]["blocks"] == told["blocks"], form

    answer = await discord_click(
        server, key, item_id, "-", "1000000000000000042", "1000000000000000009", verb="reject"
    )
    assert answer["type"] == 4, answer
    line, _, said = answer["data"]["content"].partition("\n")
    assert line.startswith("Already cancelled by API key"), answer
    assert said == DISCORD_QUOTE, answer

    activity = invoke_activity(
        service_url="http://127.0.0.1:9/",
        verb="approve",
        data={"item": item_id, "episode": "-"},
        reply_to_id="1:unknown-activity",
        conversation_id=conversation,
        aad_object_id=TEAMS_AAD,
    )
    status, body = await post(
        server, "/api/messages", json.dumps(activity).encode(), {"Content-Type": "application/json"}
    )
    assert status == 200 and body["type"] == MESSAGE_TYPE, body
    line, _, said = body["value"].partition("\n")
    assert line.startswith("Already cancelled by API key"), body
    assert said == f"“{CANCEL_REASON}”", body
    assert (await item_row(app, item_id))["status"] == "cancelled"
