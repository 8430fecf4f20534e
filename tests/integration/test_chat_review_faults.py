"""Review clicks that meet a database fault, through the real adapters (Slack Bolt,
Discord interactions, the Bot Framework SDK) mounted on the real composition root, with
the Slack stand-in as the interaction's ``response_url``.

A platform never sends a click or a modal again by itself, so the reviewer must be told
in words that the decision may not have been recorded (and which rule), the item stays
as it was, nothing of the driver's failure reaches the log as a traceback, and a click
once the database is back decides."""

from __future__ import annotations

import json
import logging
import urllib.parse
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
import sqlalchemy as sa
from aiohttp.test_utils import TestServer
from nacl.signing import SigningKey

from leadgate.app import App
from leadgate.core.clock import FakeClock
from leadgate.core.config import Settings
from leadgate.database import schema as t
from leadgate.database.db import Database
from leadgate.domain import links
from outbox.channel import Channel
from tests.fakes import DownFor
from tests.helpers import Org, eventually, item_row
from tests.integration.test_chat_reviews import escalated, setup
from tests.outbox_support import ScriptedChannel
from tests.standins.connector import invoke_activity, message_activity
from tests.standins.discord_api import interaction_headers
from tests.standins.slack_api import SlackApiStandin, signed_headers

SECRET = "slack-signing-secret"
TEAM, USER = "T0001", "U0MEMBER"  # tests.integration.test_chat_reviews.MEMBER
DISCORD_USER = "222333444555666777"
TEAMS_AAD = "00000000-0000-0000-0000-00000000a11e"
SAID = "may not have been recorded"


@asynccontextmanager
async def serving(
    migrated_url: str,
    key: SigningKey,
    slack_api: SlackApiStandin,
    channels: Mapping[str, Channel] | None = None,
) -> AsyncIterator[tuple[App, TestServer]]:
    """The service with Slack, Discord and Teams review clicks taken in (outbound Slack
    and Discord posts go to scripted channels, ``channels`` when given), served on
    127.0.0.1."""
    settings = Settings.model_validate(
        {
            "database": {"url": migrated_url},
            "server": {"public_url": "https://lg.example"},
            "slack": {
                "signing_secret": SECRET,
                "bot_token": "xoxb-x",
                "api_url": slack_api.api_url,
            },
            "discord": {"public_key": key.verify_key.encode().hex()},
            "teams": {"enabled": True},
        }
    )
    service = App(
        settings,
        clock=FakeClock(),
        channels=dict(
            channels or {"slack": ScriptedChannel("slack"), "discord": ScriptedChannel("discord")}
        ),
    )
    server = TestServer(service.web_app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield service, server
    finally:
        await server.close()
        await service.stop()


@pytest.fixture
async def served(
    migrated_url: str, key: SigningKey, slack_api: SlackApiStandin
) -> AsyncIterator[tuple[App, TestServer]]:
    async with serving(migrated_url, key, slack_api) as pair:
        yield pair


async def link_more(app: App, org: Org) -> None:
    async with app.db.tx() as conn:
        for platform, identity in (("discord", DISCORD_USER), ("teams", TEAMS_AAD)):
            await links.link(
                conn,
                app.clock,
                app.ids,
                org_id=org.id,
                email="member@acme.io",
                platform=platform,
                identity=identity,
            )


async def post(server: TestServer, path: str, body: bytes, headers: dict[str, str]) -> Any:
    async with aiohttp.ClientSession() as session:
        async with session.post(server.make_url(path), data=body, headers=headers) as r:
            text = await r.text()
            return r.status, (json.loads(text) if text else None)


async def slack_click(server: TestServer, payload: dict[str, Any]) -> Any:
    body = "payload=" + urllib.parse.quote(json.dumps(payload))
    headers = {**signed_headers(SECRET, body), "Content-Type": "application/x-www-form-urlencoded"}
    return await post(server, "/slack/events", body.encode(), headers)


def approve_click(slack_api: SlackApiStandin, item_id: str, name: str) -> dict[str, Any]:
    return {
        "type": "block_actions",
        "team": {"id": TEAM},
        "user": {"id": USER, "team_id": TEAM},
        "trigger_id": "trig-1",
        "response_url": slack_api.response_url(name),
        "container": {"type": "message", "message_ts": "1.1", "channel_id": "C0R"},
        "actions": [{"action_id": "approve", "value": item_id, "type": "button"}],
    }


def reject_form(item_id: str, reason: str) -> dict[str, Any]:
    return {
        "type": "view_submission",
        "team": {"id": TEAM},
        "user": {"id": USER, "team_id": TEAM},
        "view": {
            "type": "modal",
            "callback_id": "lg_reject",
            "private_metadata": json.dumps({"item": item_id}),
            "state": {"values": {"reason_b": {"reason": {"type": "x", "value": reason}}}},
        },
    }


def answers(slack_api: SlackApiStandin, name: str) -> list[dict[str, Any]]:
    return [c for c in slack_api.calls if c["method"] == "response_url" and c["name"] == name]


def down(monkeypatch: pytest.MonkeyPatch, db: Database) -> None:
    """The next read (every click's first step) finds the database gone."""
    monkeypatch.setattr(db, "read", DownFor(db.read, 1, after_commit=False))


def no_tracebacks(caplog: pytest.LogCaptureFixture, *secrets: str) -> None:
    for record in caplog.records:
        assert record.exc_info is None, record.getMessage()
        for secret in secrets:
            assert secret not in record.getMessage()


async def test_a_slack_click_and_form_meeting_a_database_fault_are_told_so(
    served: tuple[App, TestServer],
    slack_api: SlackApiStandin,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app, server = served
    org, worker = await setup(app)
    item_id = await escalated(app, org, worker, "s1")
    caplog.set_level(logging.INFO)

    down(monkeypatch, app.db)
    status, body = await slack_click(server, approve_click(slack_api, item_id, "down"))
    # Acknowledged (Slack shows no failure icon), and told ephemerally why nothing moved:
    # it was Bolt's 500 with the listener's traceback in the log.
    assert (status, body) == (200, None)
    await eventually(lambda: answers(slack_api, "down"))
    [said] = answers(slack_api, "down")
    assert said["response_type"] == "ephemeral" and said["replace_original"] is False
    assert SAID in said["text"] and "(service.unavailable)" in said["text"]

    down(monkeypatch, app.db)
    status, body = await slack_click(server, reject_form(item_id, "SECRET-REASON-TEXT"))
    # The modal stays open with the reason in it, saying why under the field.
    assert status == 200 and body["response_action"] == "errors"
    assert SAID in body["errors"]["reason_b"]
    assert (await item_row(app, item_id))["status"] == "awaitingHuman"
    no_tracebacks(caplog, "SECRET-REASON-TEXT")

    # The database is back: the same click decides.
    status, _ = await slack_click(server, approve_click(slack_api, item_id, "back"))
    assert status == 200
    assert (await item_row(app, item_id))["status"] in ("approved", "completed")


@pytest.mark.parametrize("mode", ["drop", "reset", "500", "portal", "error:expired_trigger_id"])
async def test_a_reject_form_slack_could_not_open_is_told_so(
    served: tuple[App, TestServer],
    slack_api: SlackApiStandin,
    caplog: pytest.LogCaptureFixture,
    mode: str,
) -> None:
    """Reject opens its form with views.open; whatever stops the form from opening (the
    connection lost without an answer, a 5xx, a page that is not Slack's, Slack's error),
    the click is acknowledged and the clicker told, with a WARNING line and no
    traceback. A lost connection was Bolt's 500 with the listener's traceback: the
    clicker saw Slack's failure icon and nothing else."""
    app, server = served
    org, worker = await setup(app)
    item_id = await escalated(app, org, worker, "s1")
    caplog.set_level(logging.INFO)

    click = approve_click(slack_api, item_id, mode)
    click["actions"][0]["action_id"] = "reject"
    slack_api.set_channel_mode(click["trigger_id"], mode)  # views.open's answer
    assert await slack_click(server, click) == (200, None)
    await eventually(lambda: answers(slack_api, mode), what="the clicker told")
    [said] = answers(slack_api, mode)
    assert said["response_type"] == "ephemeral" and said["replace_original"] is False
    assert said["text"] == "Could not open the form; please try again."
    assert not [c for c in slack_api.calls if c["method"] == "views.open"]
    [warned] = [r for r in caplog.records if "could not open the reject modal" in r.getMessage()]
    assert warned.levelno == logging.WARNING
    no_tracebacks(caplog)
    assert (await item_row(app, item_id))["status"] == "awaitingHuman"

    # Slack answers again: the next click opens the form.
    slack_api.set_channel_mode(click["trigger_id"], None)
    assert await slack_click(server, click) == (200, None)
    assert [c["method"] for c in slack_api.calls if c["method"] == "views.open"] == ["views.open"]


async def test_discord_and_teams_clicks_meeting_a_database_fault_are_told_so(
    served: tuple[App, TestServer],
    key: SigningKey,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app, server = served
    org, worker = await setup(app)
    await link_more(app, org)
    item_id = await escalated(app, org, worker, "s1")
    caplog.set_level(logging.INFO)

    interaction = {
        "type": 3,
        "id": "900000000000000001",
        "application_id": "800000000000000001",
        "token": "itoken",
        "channel_id": "700000000000000001",
        "guild_id": "600000000000000001",
        "member": {"user": {"id": DISCORD_USER}, "flags": 0},
        "message": {"id": "500000000000000001"},
        "data": {"custom_id": f"lg:approve:{item_id}:-", "component_type": 2},
    }
    raw = json.dumps(interaction).encode()
    down(monkeypatch, app.db)
    status, body = await post(server, "/discord/interactions", raw, interaction_headers(key, raw))
    # An ephemeral answer, not a 503 Discord shows as "This interaction failed".
    assert status == 200 and body["type"] == 4 and body["data"]["flags"] == 64
    assert SAID in body["data"]["content"]

    activity = invoke_activity(
        service_url="http://127.0.0.1:9/",
        verb="approve",
        data={"item": item_id},
        reply_to_id="card-1",
        conversation_id="19:review@thread.tacv2",
        aad_object_id=TEAMS_AAD,
    )
    down(monkeypatch, app.db)
    status, body = await post(
        server,
        "/api/messages",
        json.dumps(activity).encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 200 and body["type"] == "application/vnd.microsoft.activity.message"
    assert SAID in body["value"]
    assert (await item_row(app, item_id))["status"] == "awaitingHuman"
    no_tracebacks(caplog)


async def test_a_teams_conversation_not_kept_for_a_database_fault_is_kept_on_its_next_activity(
    served: tuple[App, TestServer],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The app added to a review channel (a conversationUpdate) while the database is
    down: its conversation is written when the channel is next heard from. Before, the
    process took it as kept and never wrote it (``notify add`` could not name it)."""
    app, server = served
    conversation = "19:review@thread.tacv2"
    update = message_activity(
        service_url="http://127.0.0.1:9/", text="", conversation_id=conversation
    )
    update.update(type="conversationUpdate", membersAdded=[{"id": "28:leadgate-bot"}])
    headers = {"Content-Type": "application/json"}

    async def kept() -> list[str]:
        async with app.db.read() as conn:
            rows = await conn.execute(sa.select(t.teams_conversations.c.conversation_id))
            return [row.conversation_id for row in rows]

    monkeypatch.setattr(app.db, "tx", DownFor(app.db.tx, 1, after_commit=False))
    assert (await post(server, "/api/messages", json.dumps(update).encode(), headers))[0] == 202
    await eventually(
        lambda: any("teams-remember" in r.getMessage() for r in caplog.records),
        what="the write's failure logged",
    )
    assert await kept() == []

    # The database is back; the conversation's next activity (here the same update again).
    assert (await post(server, "/api/messages", json.dumps(update).encode(), headers))[0] == 202
    await eventually(kept, what="the conversation written")
    assert await kept() == [conversation]
