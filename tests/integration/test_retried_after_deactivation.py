"""A message taken in, offered again once its worker was deactivated or deleted: a
Slack event retried (through the signed Events API endpoint, the Slack stand-in behind
it), a mail re-delivered by the sending MTA (through the SMTP listener). It is a
duplicate, answered as it would be were the worker active still: no refusal
(``agent.inactive``, ``agent.not_found``), nothing posted, taken in once. On SQLite and
PostgreSQL (``migrated_url``). And a Teams activity sent again (through the Bot Framework
endpoint, the Bot Connector stand-in behind it).

A message breaking a message rule sent to a worker already off (never taken in) is
refused as the same message within the rules is: a Slack event, a Discord ``/ask``
(signed interaction, the Discord stand-in behind the adapter)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from email.message import EmailMessage
from typing import Any

import aiohttp
import aiosmtplib
import pytest
import sqlalchemy as sa
from aiohttp.test_utils import TestServer
from nacl.signing import SigningKey

from leadgate.app import App
from leadgate.core.clock import FakeClock
from leadgate.core.config import Settings
from leadgate.database import schema as t
from leadgate.domain import agents as agents_mod
from leadgate.domain.workitems import Status
from tests.helpers import eventually, make_agent, make_org, make_route
from tests.integration.test_channel_intake_faults import ask, routed
from tests.integration.test_email_review_replies import Env, _env
from tests.standins.connector import ConnectorStandin, message_activity, post_activity
from tests.standins.discord_api import DiscordApiStandin, config_section
from tests.standins.slack_api import SlackApiStandin, signed_headers
from tests.standins.smtp import SmtpSink

SLACK_SECRET = "slack-signing-secret"
EVENT_ID = "slack:T0STANDIN:C0ASK:1700000000.000100"
ASK = "ask@lg.example"


async def change(service: App, org_id: str, agent_ref: str, since: str) -> None:
    """The worker deactivated (``since`` "deactivated") or deleted."""
    changes: dict[str, dict[str, Any]] = {
        "deactivated": {"active": False},
        "deleted": {"delete": True},
    }
    async with service.db.tx() as conn:
        await agents_mod.save_agent(
            conn, service.clock, service.ids, org_id, agent_ref=agent_ref, **changes[since]
        )


async def taken(service: App, event_id: str) -> tuple[list[str], int]:
    """The outcomes recorded under ``event_id``, and the user messages stored."""
    e, m = t.inbound_events.c, t.messages.c
    async with service.db.read() as conn:
        outcomes = (
            await conn.execute(sa.select(e.outcome).where(e.external_event_id == event_id))
        ).scalars()
        users = await conn.scalar(sa.select(sa.func.count()).where(m.role == "user"))
    return list(outcomes), int(users or 0)


@pytest.fixture
async def slack_served(migrated_url: str) -> AsyncIterator[tuple[App, TestServer, SlackApiStandin]]:
    async with SlackApiStandin(token="xoxb-x") as slack:
        settings = Settings.model_validate(
            {
                "database": {"url": migrated_url},
                "slack": {
                    "signing_secret": SLACK_SECRET,
                    "bot_token": "xoxb-x",
                    "api_url": slack.api_url,
                },
            }
        )
        service = App(settings, clock=FakeClock())
        server = TestServer(service.web_app(), host="127.0.0.1")
        await server.start_server()
        try:
            yield service, server, slack
        finally:
            await server.close()
            await service.stop()


async def slack_event(server: TestServer, text: str, *, retry_num: int | None) -> tuple[int, str]:
    """Slack's delivery of one message event (always the same one), signed: the
    service's status and body."""
    event = {
        "type": "message",
        "channel": "C0ASK",
        "user": "U0HUMAN",
        "text": text,
        "ts": "1700000000.000100",
    }
    body = json.dumps(
        {"type": "event_callback", "team_id": "T0STANDIN", "event_id": "Ev01", "event": event}
    )
    headers = signed_headers(SLACK_SECRET, body, retry_num=retry_num)
    async with aiohttp.ClientSession() as session:
        async with session.post(
            server.make_url("/slack/events"), data=body.encode(), headers=headers
        ) as r:
            return r.status, await r.text()


@pytest.mark.parametrize("since", ["deactivated", "deleted"])
@pytest.mark.parametrize("turn", ["gated", "plain"])
async def test_a_slack_event_retried_after_its_worker_was_deactivated_is_a_duplicate(
    slack_served: tuple[App, TestServer, SlackApiStandin], turn: str, since: str
) -> None:
    """The event was taken in (``gated``: its turn submitted to the lead, the item in
    review; ``plain``: answered); the worker is deactivated or deleted; Slack retries
    the event (its answer was lost, say). Each retry gets its 200, as it would were the
    worker active: a duplicate, nothing taken in again, nothing posted. It was a 4xx
    naming ``agent.inactive`` / ``agent.not_found``, and Slack retried it again."""
    service, server, slack = slack_served
    org = await make_org(service)
    await make_agent(service, org, "lead")
    worker = await make_agent(
        service, org, "worker", **({"lead": "lead"} if turn == "gated" else {})
    )
    await make_route(service, org, worker["id"], "slack", {"team": "T0STANDIN", "channel": "C0ASK"})
    text = "ship it #complete" if turn == "gated" else "hello"
    assert (await slack_event(server, text, retry_num=None))[0] == 200

    async def turn_ended() -> bool:
        async with service.db.read() as conn:
            left = await conn.scalar(sa.select(sa.func.count()).select_from(t.turn_runs))
            answers = await conn.scalar(
                sa.select(sa.func.count()).where(t.messages.c.role == "assistant")
            )
        return left == 0 and bool(answers)

    await eventually(turn_ended)
    if turn == "gated":
        async with service.db.read() as conn:
            status = await conn.scalar(sa.select(t.work_items.c.status))
        assert status == Status.reviewQueued
    posted = list(slack.posts)
    await change(service, org.id, worker["id"], since)
    # (A deleted worker's second retry meets its miss kept by the first one's intake.)
    for retry_num in (1, 2):
        status, body = await slack_event(server, text, retry_num=retry_num)
        assert status == 200, body
    assert await taken(service, EVENT_ID) == (["accepted"], 1)
    assert slack.posts == posted  # no notice, no second answer


@pytest.mark.parametrize("since", ["deactivated", "deleted"])
async def test_a_rejected_slack_message_retried_after_its_worker_was_deleted_is_a_duplicate(
    slack_served: tuple[App, TestServer, SlackApiStandin], since: str
) -> None:
    """A Slack message that broke a message rule (a NUL) was recorded as rejected and
    answered with a notice; its worker is deactivated or deleted; Slack retries the
    event. Each retry gets its 200 as the first try did: a duplicate, nothing recorded
    again, no second notice. A deleted worker's retry was a 404 naming
    ``agent.not_found`` (and Slack retried it again)."""
    service, server, _slack = slack_served
    org = await make_org(service)
    worker = await make_agent(service, org, "worker")
    await make_route(service, org, worker["id"], "slack", {"team": "T0STANDIN", "channel": "C0ASK"})
    assert (await slack_event(server, "a\x00b", retry_num=None))[0] == 200

    async def notices() -> int:
        async with service.db.read() as conn:
            count = await conn.scalar(sa.select(sa.func.count()).select_from(t.deliveries))
        return int(count or 0)

    assert await notices() == 1
    await change(service, org.id, worker["id"], since)
    for retry_num in (1, 2):
        status, body = await slack_event(server, "a\x00b", retry_num=retry_num)
        assert status == 200, body
    assert await taken(service, EVENT_ID) == (["rejectedInvalid"], 0)
    assert await notices() == 1  # no second notice


async def test_a_slack_message_breaking_a_message_rule_to_a_deactivated_worker_is_refused_so(
    slack_served: tuple[App, TestServer, SlackApiStandin],
) -> None:
    """A message that breaks a message rule (a NUL), sent to a worker deactivated before
    it, is refused as the same message within the rules is: ``agent.inactive`` (the
    worker being off is what the person can act on), nothing recorded, nothing posted.
    It was recorded rejected and answered with the message rule's notice."""
    service, server, slack = slack_served
    org = await make_org(service)
    worker = await make_agent(service, org, "worker")
    await make_route(service, org, worker["id"], "slack", {"team": "T0STANDIN", "channel": "C0ASK"})
    await change(service, org.id, worker["id"], "deactivated")
    within = await slack_event(server, "hello", retry_num=None)
    assert within[0] == 400 and json.loads(within[1])["error"]["rule"] == "agent.inactive"
    assert await slack_event(server, "a\x00b", retry_num=None) == within
    assert await taken(service, EVENT_ID) == ([], 0)
    assert slack.posts == []
    async with service.db.read() as conn:
        assert await conn.scalar(sa.select(sa.func.count()).select_from(t.deliveries)) == 0


@pytest.fixture
async def discord_served(
    migrated_url: str, key: SigningKey, discord_api: DiscordApiStandin
) -> AsyncIterator[tuple[App, TestServer, DiscordApiStandin]]:
    """The service with ``[discord]`` (interactions verified with ``key``, the Discord
    stand-in behind it) and a route from Discord to the agent ``plain``."""
    section = config_section(discord_api, key)
    async with routed(migrated_url, "discord", section) as (service, server):
        yield service, server, discord_api


@pytest.mark.parametrize("since", ["deactivated", "deleted"])
@pytest.mark.parametrize("text", ["a\x00b", "x" * 100_001])
async def test_a_discord_ask_breaking_a_message_rule_to_a_deactivated_worker_is_refused_so(
    discord_served: tuple[App, TestServer, DiscordApiStandin],
    key: SigningKey,
    text: str,
    since: str,
) -> None:
    """An ``/ask`` that breaks a message rule (a NUL, too long), sent to a worker
    deactivated or deleted before it, gets the answer the same ``/ask`` within the rules
    gets (``agent.inactive``, ``agent.not_found``): the worker being off is what the
    person can act on, as on Slack and email. Nothing recorded, nothing posted. It was
    answered with the message rule's notice (an ephemeral 200). The refusal is an
    ephemeral message naming the rule: it was a 400 / 404, which Discord shows only as
    "This interaction failed", the person never told why."""
    service, server, standin = discord_served
    async with service.db.read() as conn:
        org_id = await conn.scalar(sa.select(t.agents.c.org_id))
    await change(service, str(org_id), "plain", since)
    within = await ask(server, key, "1", "hello")
    rule = {"deactivated": "agent.inactive", "deleted": "agent.not_found"}[since]
    assert within[0] == 200, within
    assert within[1]["type"] == 4 and within[1]["data"]["flags"] == 64
    told = within[1]["data"]["content"]
    assert told.startswith("Your message was not processed: ") and f"[{rule}]" in told
    assert await ask(server, key, "2", text) == within
    async with service.db.read() as conn:
        for table in (t.inbound_events, t.deliveries):
            assert await conn.scalar(sa.select(sa.func.count()).select_from(table)) == 0
    assert standin.posts == []


@pytest.fixture
async def mail_env(migrated_url: str, sink: SmtpSink) -> AsyncIterator[Env]:
    """The service with its SMTP listener (``[email]``), as the email review tests run it."""
    async for made in _env(migrated_url, sink):
        yield made


async def mail(port: int) -> int:
    """The same mail (one Message-ID) to :data:`ASK` over SMTP: the answer's code."""
    message = EmailMessage()
    message["From"] = "alice@acme.io"
    message["To"] = ASK
    message["Subject"] = "help"
    message["Message-ID"] = "<m1@mail.acme.io>"
    message.set_content("draft it #complete")
    try:
        await aiosmtplib.send(message, recipients=[ASK], hostname="127.0.0.1", port=port, timeout=5)
    except aiosmtplib.SMTPResponseException as exc:
        return exc.code
    return 250


@pytest.mark.parametrize("since", ["deactivated", "deleted"])
async def test_a_mail_delivered_again_after_its_worker_was_deactivated_is_taken_not_bounced(
    mail_env: Env, since: str
) -> None:
    """A mail was taken in (250) and its turn submitted to the lead; the worker is
    deactivated or deleted; the sending MTA delivers the mail again (it never saw the
    250, say). It is a duplicate, answered 250 as were the worker active: it was 554
    ``agent.inactive`` / ``agent.not_found``, a bounce telling the sender their mail
    could not be processed, though it was taken in and will be answered."""
    app = mail_env.app
    org = await make_org(app)
    await make_agent(app, org, "lead")
    worker = await make_agent(app, org, "worker", lead="lead")
    await make_route(app, org, worker["id"], "email", {"address": ASK})
    assert await mail(mail_env.port) == 250
    await change(app, org.id, worker["id"], since)
    for _ in range(2):  # (a deleted worker's second meets its miss kept by the first)
        assert await mail(mail_env.port) == 250
    assert await taken(app, f"email:{ASK}:alice@acme.io:<m1@mail.acme.io>") == (["accepted"], 1)


@pytest.mark.parametrize("since", ["deactivated", "deleted"])
async def test_a_teams_activity_sent_again_after_its_worker_was_deactivated_is_a_duplicate(
    migrated_url: str, since: str
) -> None:
    """A Teams message answered (its reply posted through the Connector); its worker is
    deactivated or deleted; the same activity comes again. It is a duplicate: 202,
    nothing posted, taken in once (it was refused, a 4xx naming the rule)."""
    connector = ConnectorStandin()
    await connector.start()
    try:
        async with routed(migrated_url, "teams", {"enabled": True}) as (service, server):
            activity = message_activity(service_url=connector.url, text="hello")
            url = str(server.make_url("/api/messages"))
            assert (await post_activity(url, activity))[0] == 202

            async def replied() -> bool:
                await service.relay.run_once()  # (once its turn queued the reply)
                return bool(connector.activities)

            await eventually(replied)
            posted = list(connector.activities)
            async with service.db.read() as conn:
                org_id = await conn.scalar(sa.select(t.agents.c.org_id))
            await change(service, str(org_id), "plain", since)
            for _ in range(2):
                status, body = await post_activity(url, activity)
                assert status == 202, body
            await service.relay.run_once()
            async with service.db.read() as conn:
                outcomes = (await conn.execute(sa.select(t.inbound_events.c.outcome))).scalars()
                assert list(outcomes) == ["accepted"]
            assert (await taken(service, ""))[1] == 1  # one user message
            assert connector.activities == posted
    finally:
        await connector.close()
