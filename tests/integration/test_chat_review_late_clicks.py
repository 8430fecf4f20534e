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

from leadgate.app import App
from leadgate.database import schema as t
from tests.helpers import eventually, item_row
from tests.integration.test_chat_review_faults import (
    DISCORD_USER,
    answers,
    approve_click,
    link_more,
    serving,
    slack_click,
)
from tests.integration.test_chat_reviews import escalated, setup
from tests.review_support import add_destination
from tests.standins.discord_api import interaction_headers
from tests.standins.slack_api import SlackApiStandin


@pytest.fixture
def key() -> SigningKey:
    return SigningKey.generate()


@pytest.fixture
async def slack_api() -> AsyncIterator[SlackApiStandin]:
    async with SlackApiStandin(token="xoxb-x") as standin:
        yield standin


@pytest.fixture
async def served(
    migrated_url: str, key: SigningKey, slack_api: SlackApiStandin
) -> AsyncIterator[tuple[App, TestServer]]:
    async with serving(migrated_url, key, slack_api) as pair:
        yield pair


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
    assert await eventually(lambda: len(answers(slack_api, "late")) == 2)
    replaced, told = answers(slack_api, "late")
    # The card in place: the outcome, no buttons (it kept them until the outbox's edit).
    assert replaced["replace_original"] is True
    assert not any(b["type"] == "actions" for b in replaced["blocks"])
    assert "*Approved* by API key" in json.dumps(replaced["blocks"])
    assert told["response_type"] == "ephemeral" and told["replace_original"] is False
    assert told["text"].startswith("Already approved by API key")
    assert (await item_row(app, item_id))["status"] in ("approved", "completed")


async def test_a_late_discord_click_shows_the_outcome_on_the_clicked_card(
    served: tuple[App, TestServer], key: SigningKey
) -> None:
    app, server = served
    item_id, posted = await decided_in_the_console(app, ("slack", "discord"))
    interaction: dict[str, Any] = {
        "type": 3,
        "id": "900000000000000002",
        "application_id": "800000000000000001",
        "token": "itoken",
        "channel_id": "1000000000000000009",
        "member": {"user": {"id": DISCORD_USER}, "flags": 0},
        "message": {"id": posted["discord"]},
        "data": {"custom_id": f"lg:approve:{item_id}:-", "component_type": 2},
    }
    raw = json.dumps(interaction).encode()
    async with aiohttp.ClientSession() as session:
        async with session.post(
            server.make_url("/discord/interactions"),
            data=raw,
            headers=interaction_headers(key, raw),
        ) as r:
            status, answer = r.status, await r.json()
    # UPDATE_MESSAGE with the decided card (it was an ephemeral line, the buttons kept).
    assert status == 200 and answer["type"] == 7
    assert "**Approved** by API key" in answer["data"]["content"]
    assert all(
        c.get("style") == 5 for row in answer["data"]["components"] for c in row["components"]
    )
