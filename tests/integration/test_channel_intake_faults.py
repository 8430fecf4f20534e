"""A channel message the database cannot take in, on a channel that does not deliver it
again by itself (Discord's interactions and gateway, Teams), through the real Discord
and Teams adapters on the real composition root against the Discord stand-in (REST and
gateway) and the Bot Connector stand-in.

Slack and email are told to retry instead (503, 451: they redeliver), except on Slack's
last try; a Discord interaction or gateway message is sent once, and nothing documents
that Teams sends a message again after a 5xx, so there (and on Slack's last try) the
author is told in words, naming the rule, and nothing of the driver's failure reaches the
log as a traceback.

And a busy Slack message (PostgreSQL) whose recording's COMMIT is in doubt: recorded
once, nothing posted, whichever way the COMMIT and its read-back went."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import sqlalchemy as sa
from aiohttp import web
from aiohttp.test_utils import TestServer
from nacl.signing import SigningKey

from bots import discord as discord_bot
from bots.slack import REPLY_EVENT
from leadgate.app import App
from leadgate.core.clock import FakeClock
from leadgate.core.config import Settings
from leadgate.core.errors import ModelError
from leadgate.core.types import Gated
from leadgate.database import schema as t
from leadgate.database.db import Database
from tests.fakes import DownFor, GateProvider, mount_adapter
from tests.helpers import (
    eventually,
    item_row,
    make_agent,
    make_org,
    make_route,
    session_item,
    slack_trigger,
)
from tests.integration.test_chat_review_faults import no_tracebacks
from tests.standins.connector import ConnectorStandin, message_activity, post_activity
from tests.standins.discord_api import DiscordApiStandin, config_section, interaction_headers
from tests.standins.slack_api import SlackApiStandin, signed_headers
from tests.statement_faults import injector

GUILD, CHANNEL = "1000000000000000001", "1000000000000000002"
SAID = "could not be taken in"


@contextlib.asynccontextmanager
async def routed(
    migrated_url: str, channel: str, section: dict[str, Any]
) -> AsyncIterator[tuple[App, TestServer]]:
    """The service with ``[channel]`` set to ``section`` and a route from ``channel`` to
    the agent ``plain``, served on 127.0.0.1."""
    settings = Settings.model_validate({"database": {"url": migrated_url}, channel: section})
    service = App(settings, clock=FakeClock())
    org = await make_org(service)
    plain = await make_agent(service, org, "plain")
    await make_route(service, org, plain["id"], channel)
    server = TestServer(service.web_app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield service, server
    finally:
        await server.close()
        await service.stop()


@pytest.fixture
async def served(
    migrated_url: str, key: SigningKey, discord_api: DiscordApiStandin
) -> AsyncIterator[tuple[App, TestServer]]:
    async with routed(migrated_url, "discord", config_section(discord_api, key)) as pair:
        yield pair


def down(monkeypatch: pytest.MonkeyPatch, db: Database) -> None:
    """The next read and the next transaction find the database gone."""
    monkeypatch.setattr(db, "read", DownFor(db.read, 1, after_commit=False))
    monkeypatch.setattr(db, "tx", DownFor(db.tx, 1, after_commit=False))


async def ask(server: TestServer, key: SigningKey, n: str, text: str) -> tuple[int, Any]:
    """A signed ``/ask`` slash command (interaction ``90..0{n}``, token ``itoken-{n}``)
    asking ``text`` in ``CHANNEL`` of ``GUILD``, posted to ``server``: its status and
    JSON answer."""
    payload = {
        "id": f"90000000000000000{n}",
        "application_id": "1100000000000000001",
        "type": 2,
        "token": f"itoken-{n}",
        "version": 1,
        "channel_id": CHANNEL,
        "guild_id": GUILD,
        "data": {
            "id": "700000000000000001",
            "name": "ask",
            "type": 1,
            "options": [{"name": "message", "type": 3, "value": text}],
        },
    }
    body = json.dumps(payload).encode()
    async with aiohttp.ClientSession() as session:
        async with session.post(
            server.make_url("/discord/interactions"),
            data=body,
            headers=interaction_headers(key, body),
        ) as r:
            return r.status, await r.json()


async def test_an_ask_the_database_cannot_take_is_answered_saying_so(
    served: tuple[App, TestServer],
    key: SigningKey,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, server = served
    caplog.set_level(logging.INFO)
    down(monkeypatch, served[0].db)
    status, answer = await ask(server, key, "1", "SECRET-ASK-TEXT")
    # An ephemeral answer the person reads, not a 503 Discord shows as "This
    # interaction failed" (Discord never sends the interaction again).
    assert status == 200 and answer["type"] == 4 and answer["data"]["flags"] == 64
    content = answer["data"]["content"]
    assert SAID in content and "(service.unavailable)" in content
    no_tracebacks(caplog, "SECRET-ASK-TEXT")


async def test_a_gateway_message_the_database_cannot_take_gets_a_reply_saying_so(
    served: tuple[App, TestServer],
    discord_api: DiscordApiStandin,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app, _ = served
    await discord_api.wait_gateway_ready(within_s=5)
    caplog.set_level(logging.INFO)
    down(monkeypatch, app.db)
    sent = await discord_api.dispatch_message_create(
        channel_id=CHANNEL, guild_id=GUILD, content="SECRET-GATEWAY-TEXT"
    )

    def replies() -> list[dict[str, Any]]:
        return [p for p in discord_api.posts if p.get("op") == "create_message"]

    # It was lost without a word (and logged with the driver's traceback): the gateway
    # delivers a message once. Now its author gets a reply to it saying so.
    await eventually(replies, within=5)
    [reply] = replies()
    assert reply["channel_id"] == CHANNEL and SAID in reply["content"]
    assert str(reply["message_reference"]["message_id"]) == sent["id"]
    no_tracebacks(caplog, "SECRET-GATEWAY-TEXT")


@pytest.fixture
async def teams_served(
    migrated_url: str,
) -> AsyncIterator[tuple[App, TestServer, ConnectorStandin]]:
    connector = ConnectorStandin()
    await connector.start()
    try:
        async with routed(migrated_url, "teams", {"enabled": True}) as (service, server):
            yield service, server, connector
    finally:
        await connector.close()


@pytest.mark.parametrize("reply_fails", [False, True])
async def test_a_teams_message_the_database_cannot_take_gets_a_reply_saying_so(
    teams_served: tuple[App, TestServer, ConnectorStandin],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    reply_fails: bool,
) -> None:
    app, server, connector = teams_served
    caplog.set_level(logging.INFO)
    down(monkeypatch, app.db)
    if reply_fails:
        connector.fail_next("500")
    activity = message_activity(service_url=connector.url, text="SECRET-TEAMS-TEXT")
    status, body = await post_activity(str(server.make_url("/api/messages")), activity)
    no_tracebacks(caplog, "SECRET-TEAMS-TEXT")
    if reply_fails:
        # Nobody was told: the fault is the answer (a 503 naming the rule).
        assert status == 503 and json.loads(body)["error"]["rule"] == "service.unavailable"
        assert connector.activities == []
        return
    # It was a 503 and the README said Teams redelivers, which nothing documents: the
    # person saw their message simply never answered. Now they get a reply saying so.
    assert status == 202
    [reply] = connector.activities
    assert reply["reply_to_id"] == activity["id"]
    text = reply["activity"]["text"]
    assert SAID in text and "(service.unavailable)" in text


SLACK_SECRET = "slack-signing-secret"


@pytest.fixture
async def slack_served(migrated_url: str) -> AsyncIterator[tuple[App, TestServer, SlackApiStandin]]:
    async with SlackApiStandin(token="xoxb-x") as slack:
        section = {"signing_secret": SLACK_SECRET, "bot_token": "xoxb-x", "api_url": slack.api_url}
        async with routed(migrated_url, "slack", section) as (service, server):
            yield service, server, slack


async def slack_answer(
    server: TestServer,
    *,
    retry_num: int | None,
    kind: str = "message",
    event_id: str = "Ev01",
    thread_ts: str | None = None,
) -> tuple[int, dict[str, Any]]:
    """Slack's delivery of a message event (ts ``1700000000.000100``, in ``thread_ts``),
    signed: the service's answer, its status and JSON body (``{}`` when none)."""
    event = {
        "type": kind,
        "channel": "C0ASK",
        "user": "U0HUMAN",
        "text": "SECRET-SLACK-TEXT",
        "ts": "1700000000.000100",
    }
    if thread_ts is not None:
        event["thread_ts"] = thread_ts
    body = json.dumps(
        {"type": "event_callback", "team_id": "T0STANDIN", "event_id": event_id, "event": event}
    )
    headers = signed_headers(SLACK_SECRET, body, retry_num=retry_num)
    async with aiohttp.ClientSession() as session:
        async with session.post(
            server.make_url("/slack/events"), data=body.encode(), headers=headers
        ) as r:
            text = await r.text()
    # (Bolt's 200 has an empty body; a refusal is JSON)
    return r.status, json.loads(text) if text.startswith("{") else {}


async def slack_message(
    server: TestServer, *, retry_num: int | None, kind: str = "message", event_id: str = "Ev01"
) -> int:
    """:func:`slack_answer`'s status."""
    status, _ = await slack_answer(server, retry_num=retry_num, kind=kind, event_id=event_id)
    return status


@pytest.mark.parametrize("retry_num", [None, 1, 2])
async def test_a_slack_message_the_database_cannot_take_is_left_to_slack_s_retries(
    slack_served: tuple[App, TestServer, SlackApiStandin],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    retry_num: int | None,
) -> None:
    app, server, slack = slack_served
    caplog.set_level(logging.INFO)
    down(monkeypatch, app.db)
    # Slack delivers it again (up to its third retry): nothing is said in the thread.
    assert await slack_message(server, retry_num=retry_num) == 503
    assert slack.posts == []
    no_tracebacks(caplog, "SECRET-SLACK-TEXT")


async def test_slack_s_last_try_that_the_database_cannot_take_gets_a_reply_saying_so(
    slack_served: tuple[App, TestServer, SlackApiStandin],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app, server, slack = slack_served
    caplog.set_level(logging.INFO)
    down(monkeypatch, app.db)
    # Slack drops the event after its third retry: the message was lost without a word
    # (the database down past the five minutes the retries span). Now its author is told
    # in the thread, and Slack gets its 200.
    assert await slack_message(server, retry_num=3) == 200
    [reply] = slack.posts
    assert reply["channel"] == "C0ASK" and reply["thread_ts"] == "1700000000.000100"
    assert SAID in reply["text"] and "(service.unavailable)" in reply["text"]
    # Its metadata names the message it answers: a catch-up leaves that one alone, and
    # no other message of the thread.
    assert reply["metadata"] == {
        "event_type": REPLY_EVENT,
        "event_payload": {"message_ts": "1700000000.000100"},
    }
    no_tracebacks(caplog, "SECRET-SLACK-TEXT")


@pytest.mark.parametrize("together", [True, False])
async def test_the_mention_and_message_of_one_post_on_their_last_tries_get_one_reply(
    slack_served: tuple[App, TestServer, SlackApiStandin],
    monkeypatch: pytest.MonkeyPatch,
    together: bool,
) -> None:
    app, server, slack = slack_served
    monkeypatch.setattr(app.db, "read", DownFor(app.db.read, 4, after_commit=False))
    monkeypatch.setattr(app.db, "tx", DownFor(app.db.tx, 4, after_commit=False))
    # A post that mentions the bot arrives as two events (``app_mention`` and
    # ``message``), each with its own retries; their last tries come within moments of
    # each other. chat.postMessage has no idempotency key: one reply, said once.
    mention = slack_message(server, retry_num=3, kind="app_mention", event_id="Ev01")
    message = slack_message(server, retry_num=3, kind="message", event_id="Ev02")
    if together:
        # (a list at run time; typeshed says a tuple)
        assert list(await asyncio.gather(mention, message)) == [200, 200]
    else:
        assert await mention == 200
        assert await message == 200
    [reply] = slack.posts
    assert SAID in reply["text"]


@pytest.mark.parametrize(
    ("first_reply", "second_event"),
    [("error:channel_not_found", 200), ("reset", 503)],
    ids=["refused", "maybe posted"],
)
async def test_the_other_event_of_the_post_tells_again_only_after_a_refused_reply(
    slack_served: tuple[App, TestServer, SlackApiStandin],
    monkeypatch: pytest.MonkeyPatch,
    first_reply: str,
    second_event: int,
) -> None:
    """The first event's reply is refused (nothing posted: Slack drops that event after
    its 503): the pair's other event, on its own last try, tells the person. Or it
    reached Slack and the connection was lost before its answer (uncertain: it may be in
    the thread): chat.postMessage has no idempotency key, so the other event does not
    post it again (it did, and the person could read it twice)."""
    app, server, slack = slack_served
    monkeypatch.setattr(app.db, "read", DownFor(app.db.read, 4, after_commit=False))
    monkeypatch.setattr(app.db, "tx", DownFor(app.db.tx, 4, after_commit=False))
    slack.queue(first_reply)
    assert await slack_message(server, retry_num=3, kind="app_mention", event_id="Ev01") == 503
    second = await slack_message(server, retry_num=3, kind="message", event_id="Ev02")
    assert second == second_event
    if second_event == 200:
        [reply] = slack.posts  # the refused one is not among the posts
        assert SAID in reply["text"]
    else:
        assert [r["mode"] for r in slack.requests] == ["reset"]


#: The read-back of a busy intake in doubt (leadgate.turns.intake._EVENT_LANDED).
BUSY_READ_BACK = "FROM inbound_events"


@pytest.mark.parametrize("landed", [True, False])
@pytest.mark.parametrize("read_back", ["works", "fails"])
async def test_a_busy_slack_message_whose_commit_is_in_doubt_is_recorded_once_and_posts_nothing(
    migrated_pg: str, monkeypatch: pytest.MonkeyPatch, landed: bool, read_back: str
) -> None:
    """PostgreSQL, through the signed Slack endpoint: a message in a thread whose work
    item waits for its lead is busy, and a busy message posts nothing in the thread
    (SPEC 10); it is recorded (a ``rejectedBusy`` inbound event). The transaction that
    records it loses its COMMIT (``landed``: the COMMIT ran first; else the connection
    dropped before it), and the read-back of the event works or fails too. Whichever
    way, once Slack has its answer (a 503 is delivered again, the same event) the
    message is recorded busy exactly once, no turn ran, nothing was appended to the
    item, and nothing was posted: not the message's turn, not a notice."""
    faults = injector(migrated_pg, monkeypatch)
    async with SlackApiStandin(token="xoxb-x") as slack:
        section = {"signing_secret": SLACK_SECRET, "bot_token": "xoxb-x", "api_url": slack.api_url}
        async with routed(migrated_pg, "slack", section) as (app, server):
            org = await make_org(app, "held")
            await make_agent(app, org, "lead")
            worker = await make_agent(app, org, "worker", lead="lead")
            await make_route(
                app, org, worker["id"], "slack", {"team": "T0STANDIN", "channel": "C0ASK"}
            )
            thread = "1700000000.000050"
            first = slack_trigger(
                org, worker, "ship it #complete", thread, team="T0STANDIN", channel="C0ASK"
            )
            assert isinstance(await app.turns.run(first), Gated)
            item_id = await session_item(app, first.session_key)
            held = await item_row(app, item_id)
            faults.arm_on(
                "INSERT INTO inbound_events",
                then="COMMIT",
                after_commit=landed,
                and_on=BUSY_READ_BACK if read_back == "fails" else None,
            )
            status, answer = await slack_answer(server, retry_num=None, thread_ts=thread)
            faults.disarm()
            assert faults.fired is not None and faults.fired.startswith("COMMIT")
            if landed and read_back == "works":
                assert status == 200, answer  # found: busy, as if the COMMIT had answered
            else:
                assert status == 503, answer
                rule = "intake.in_doubt" if read_back == "fails" else "service.unavailable"
                assert answer["error"]["rule"] == rule
                # Slack delivers the event again: a duplicate of the recorded one, or
                # recorded busy now.
                status, answer = await slack_answer(server, retry_num=1, thread_ts=thread)
                assert status == 200, answer
            e = t.inbound_events.c
            async with app.db.read() as conn:
                rows = await conn.execute(
                    sa.select(e.outcome).where(
                        e.external_event_id == "slack:T0STANDIN:C0ASK:1700000000.000100"
                    )
                )
                outcomes = [row.outcome for row in rows]
                stored = await conn.scalar(
                    sa.select(sa.func.count()).where(t.messages.c.content == "SECRET-SLACK-TEXT")
                )
                runs = await conn.scalar(sa.select(sa.func.count()).select_from(t.turn_runs))
            assert outcomes == ["rejectedBusy"]
            assert (stored, runs) == (0, 0)  # not taken in, no turn recorded
            now = await item_row(app, item_id)
            assert (now["status"], now["task_context"]) == (held["status"], held["task_context"])
            assert slack.posts == []


async def test_an_ask_whose_failed_turn_is_left_to_recovery_ends_its_deferred_response(
    migrated_url: str, key: SigningKey, discord_api: DiscordApiStandin
) -> None:
    """An /ask's turn fails (its model's error) and closing its run, which queues the
    failure notice that fills the deferred response, meets a database fault: no notice,
    the turn left to the recovery runner, whose outcome the adapter never sees (a gated
    one's: nothing). The Discord adapter on the real core ends the deferred response
    after its settle wait, as for a turn stopped on a fault. It kept "thinking..." until
    recovery answered it, for good when that turn was gated."""
    gate = GateProvider()
    settings = Settings.model_validate(
        {
            "database": {"url": migrated_url},
            "discord": {
                "public_key": key.verify_key.encode().hex(),
                "api_url": discord_api.api_url,
            },
        }
    )
    service = App(settings, clock=FakeClock(), providers={"gate": gate}, enable_adapters=False)
    org = await make_org(service)
    slow = await make_agent(service, org, "slow", model="gate")
    await make_route(service, org, slow["id"], "discord")
    settles: list[float] = []

    async def sleep(seconds: float) -> None:
        settles.append(seconds)  # (instant: never a real second)

    assert discord_bot.create(settings, service.messages) is not None  # (points discord.py)
    web_app = web.Application()
    mount_adapter(web_app, discord_bot.DiscordAdapter(settings, service.messages, sleep=sleep))
    server = TestServer(web_app, host="127.0.0.1")
    await server.start_server()
    try:
        assert await ask(server, key, "9", "what now?") == (200, {"type": 5})  # deferred
        await eventually(lambda: gate.calls == 1)
        gate.failure = ModelError("the provider failed", rule="model.failed")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(service.db, "tx", DownFor(service.db.tx, 1, after_commit=False))
            gate.release.set()
            await eventually(lambda: discord_api.posts)
        assert discord_api.posts == [
            {"op": "delete_original", "application_id": "1100000000000000001", "token": "itoken-9"}
        ]
        assert settles == [discord_bot._DEFERRED_SETTLE_S]
        async with service.db.read() as conn:  # (the recovery runner's)
            assert await conn.scalar(sa.select(sa.func.count()).select_from(t.turn_runs)) == 1
    finally:
        gate.release.set()
        await server.close()
        await service.stop()
