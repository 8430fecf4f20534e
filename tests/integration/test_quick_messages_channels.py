"""Two quick messages of one session to a plain worker (no lead: no busy state, both
turns run), the first's model answering only after the second was taken in: each
message gets its own reply, posted once, addressed to that message (SPEC 10). On Slack
(signed Events API in, the Slack Web API stand-in out), Teams (the Bot Framework
endpoint in, the Bot Connector stand-in out) and email (the SMTP listener in, the SMTP
sink out), through the real SDKs and the real composition root. Discord is
``test_discord_quick_messages.py``.

Before, on Teams and email (where each message has an address of its own, so the
second one's binding replaced the first's as the session's active one), the first
message's reply was stored in the transcript and never posted."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa

from bots.email import EmailAdapter
from leadgate.app import App
from leadgate.core.clock import FakeClock
from leadgate.core.config import Settings
from leadgate.core.runners import drain
from leadgate.database import schema as t
from tests.helpers import eventually, make_agent, make_org, make_route
from tests.integration.test_discord_quick_messages import HoldsFirst
from tests.integration.test_email_threads import send
from tests.integration.test_slack_catch_up import SECRET, post_event
from tests.serving import served_app
from tests.standins.connector import ConnectorStandin, message_activity, post_activity
from tests.standins.slack_api import SlackApiStandin
from tests.standins.smtp import SmtpSink

CHANNEL = "C0ASK"
ASK = "ask@lg.example"
CONVERSATION = "19:general@thread.tacv2"


async def answered(service: App) -> list[str]:
    """The assistant messages stored, whether or not they were posted."""
    async with service.db.read() as conn:
        query = sa.select(t.messages.c.content).where(t.messages.c.role == "assistant")
        return sorted(str(text) for text in (await conn.execute(query)).scalars())


async def both_answered(service: App, model: HoldsFirst) -> None:
    """Once the second message is answered, the first's model is let go; until both
    answers are stored and every queued reply was sent."""

    async def second() -> bool:
        return await answered(service) == ["to second"]

    await eventually(second, what="the second message answered")
    model.release.set()

    async def both() -> bool:
        return await answered(service) == ["to first", "to second"]

    await eventually(both, what="the first message answered")
    await drain(service.relay)


async def test_slack_two_quick_messages_in_one_thread_each_get_their_reply_in_it(
    migrated_url: str,
) -> None:
    """A Slack session is a thread (two top-level messages are two sessions: nothing of
    one could be lost to the other). The first message starts the thread, the second is
    a reply in it: both are answered in the thread. Their address is the thread, the
    same for both, so the second's binding is the first's: this passed before too, and
    guards that the first's reply is neither lost nor posted twice."""
    model = HoldsFirst()
    async with SlackApiStandin(token="xoxb-x") as slack:
        config = {
            "slack": {"signing_secret": SECRET, "bot_token": "xoxb-x", "api_url": slack.api_url}
        }
        async with served_app(
            migrated_url, config=config, adapters=True, providers={"hold": model}
        ) as (up, client):
            org = await make_org(up)
            plain = await make_agent(up, org, "plain", model="hold")
            await make_route(up, org, plain["id"], "slack")

            async def say(text: str, ts: str, thread_ts: str | None = None) -> None:
                event: dict[str, Any] = {
                    "type": "message",
                    "channel": CHANNEL,
                    "user": "U0HUMAN",
                    "text": text,
                    "ts": ts,
                }
                if thread_ts:
                    event["thread_ts"] = thread_ts
                await post_event(client, event, f"Ev{ts}")

            first = "1700000000.000100"
            await say("first", first)
            await eventually(lambda: model.asked == ["first"], what="the first turn at its model")
            await say("second", "1700000000.000200", thread_ts=first)
            await both_answered(up, model)
        posts = sorted((post["thread_ts"], post["text"]) for post in slack.posts)
    assert posts == [(first, "to first"), (first, "to second")]


async def test_teams_two_quick_messages_each_get_a_reply_to_their_own_activity(
    migrated_url: str,
) -> None:
    """A Teams session is a conversation; each reply goes to the activity that asked
    (``replyToId``). The first activity's turn is held at its model while the second
    is taken in and answered (each activity is answered 202 once recorded, its turn
    running in the background)."""
    model = HoldsFirst()
    connector = ConnectorStandin()
    await connector.start()
    try:
        async with served_app(
            migrated_url,
            config={"teams": {"enabled": True}},
            adapters=True,
            providers={"hold": model},
        ) as (up, client):
            org = await make_org(up)
            plain = await make_agent(up, org, "plain", model="hold")
            await make_route(up, org, plain["id"], "teams")
            url = str(client.make_url("/api/messages"))

            def activity(text: str) -> dict[str, Any]:
                return message_activity(
                    service_url=connector.url, text=text, conversation_id=CONVERSATION
                )

            first, second = activity("first"), activity("second")
            assert (await post_activity(url, first))[0] == 202
            await eventually(lambda: model.asked == ["first"], what="the first turn at its model")
            assert (await post_activity(url, second))[0] == 202
            await both_answered(up, model)
        replies = sorted(
            (str(post["reply_to_id"]), post["activity"]["text"]) for post in connector.activities
        )
    finally:
        await connector.close()
    assert replies == sorted([(first["id"], "to first"), (second["id"], "to second")])


@pytest.fixture
async def email_app(
    migrated_url: str, sink: SmtpSink
) -> AsyncIterator[tuple[App, int, HoldsFirst]]:
    """The service with its SMTP listener on and the sink as its relay: the app, the
    listener's port and its model ``hold``."""
    settings = Settings.model_validate(
        {
            "database": {"url": migrated_url},
            "email": {
                "listen_host": "127.0.0.1",
                "listen_port": 0,
                "smtp_host": "127.0.0.1",
                "smtp_port": sink.port,
                "from_address": "bot@lg.example",
            },
        }
    )
    model = HoldsFirst()
    app = App(settings, clock=FakeClock(), providers={"hold": model})
    [adapter] = [a for a in app.adapters if isinstance(a, EmailAdapter)]
    await adapter.start()
    assert adapter.port
    try:
        yield app, adapter.port, model
    finally:
        await adapter.stop()
        await app.stop()


async def test_email_two_quick_mails_of_one_thread_each_get_a_reply_to_their_own(
    email_app: tuple[App, int, HoldsFirst], sink: SmtpSink
) -> None:
    """An email session is a thread (a mail answering the person's own earlier one
    continues it); each answer names the mail it answers in ``In-Reply-To``."""
    app, port, model = email_app
    org = await make_org(app)
    plain = await make_agent(app, org, "plain", model="hold")
    await make_route(app, org, plain["id"], "email", {"address": ASK})

    await send(port, "<m1@mail.acme.io>", "first")
    await eventually(lambda: model.asked == ["first"], what="the first turn at its model")
    await send(port, "<m2@mail.acme.io>", "second", to="<m1@mail.acme.io>")
    await both_answered(app, model)
    replies = sorted((str(m["in_reply_to"]), m["body"].strip()) for m in sink.messages)
    assert replies == [("<m1@mail.acme.io>", "to first"), ("<m2@mail.acme.io>", "to second")]
