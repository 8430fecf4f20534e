"""Slack drops an event after its third retry (about five minutes): messages posted
while the service was down are read back at its start (``conversations.history``,
``conversations.replies``) and answered once, through the real slack_sdk client, the
real slack-bolt adapter (signed requests for the live messages) and the real composition
root against the Slack Web API stand-in.

"Answered" here is the reply queued in the outbox for that message (a ``deliveries`` row
whose address names its thread): no runner runs, so nothing is posted."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa

from bots import base as bots_base
from bots import slack
from bots.base import CATCH_UP_OVERLAP_MS, not_taken_in
from bots.slack import SlackAdapter, ts_at
from leadgate.app import App
from leadgate.core.errors import IntakeInDoubt, Unavailable
from leadgate.database import schema as t
from tests.fakes import DownFor
from tests.helpers import counted, eventually, fake_clock, make_agent, make_org, make_route
from tests.integration.test_discord_catch_up import catch_up_ended, taken_in
from tests.serving import Client, served_app
from tests.standins.slack_api import SlackApiStandin, signed_headers

SECRET = "slack-signing-secret"
CHANNEL, OTHER_CHANNEL, UNKNOWN_CHANNEL = "C0ASK", "C0OTHER", "C0UNKNOWN"
MINUTE_MS, HOUR_MS = 60_000, 3_600_000
COULD_NOT = not_taken_in(Unavailable("down", rule="service.unavailable"))


@pytest.fixture
async def standin() -> AsyncIterator[SlackApiStandin]:
    async with SlackApiStandin(token="xoxb-x") as api:
        yield api


@contextlib.asynccontextmanager
async def running(
    service: App, standin: SlackApiStandin, **section: Any
) -> AsyncIterator[tuple[App, Client]]:
    """Another process on ``service``'s database and clock, with Slack on against
    ``standin`` (``section``: more ``[slack]`` settings), served for the block (no
    runners)."""
    config = {
        "slack": {"signing_secret": SECRET, "bot_token": "xoxb-x", "api_url": standin.api_url}
    }
    config["slack"].update(section)
    async with served_app(
        service.settings.database.url, config=config, adapters=True, clock=fake_clock(service)
    ) as served:
        yield served


@contextlib.contextmanager
def clock_at(service: App, at_ms: int) -> Iterator[None]:
    """The fake clock at ``at_ms`` for the block (a process that ran then: its catch-up's
    read through stores that time as where the next one starts), back after it."""
    clock = fake_clock(service)
    back = clock.now_ms() - at_ms
    clock.advance(-back)
    try:
        yield
    finally:
        clock.advance(back)


async def routed(service: App, *matches: dict[str, str]) -> None:
    """Slack routes matching ``matches`` to the agent ``plain`` (the script model), made
    an hour before the clock's now (a catch-up answers nothing older than its route)."""
    org = await make_org(service)
    plain = await make_agent(service, org, "plain")
    for match in matches:
        await make_route(service, org, plain["id"], "slack", match)
    fake_clock(service).advance(HOUR_MS)


async def caught_up(service: App) -> None:
    """Until the start's catch-up has ended (it records each message before it reads
    on) and every turn recorded has run."""
    await catch_up_ended(service, SlackAdapter)


async def answers(service: App, thread: str) -> list[str]:
    """The replies queued into the Slack thread ``thread``, in the order they were."""
    async with service.db.read() as conn:
        rows = await conn.execute(
            sa.select(t.deliveries.c.address, t.deliveries.c.text).order_by(
                t.deliveries.c.created_at, t.deliveries.c.id
            )
        )
        return [row.text for row in rows if row.address.get("thread_ts") == thread]


def said(standin: SlackApiStandin, text: str, *, channel: str = CHANNEL, **kwargs: Any) -> str:
    """``text`` mentioning the bot, posted to ``channel`` (``kwargs`` as
    :meth:`SlackApiStandin.say`); its ts."""
    return str(standin.say(channel, f"<@{standin.bot_user_id}> {text}", **kwargs)["ts"])


def bot_says(
    standin: SlackApiStandin, text: str, at_ms: int, thread_ts: str, **fields: Any
) -> None:
    """The bot's post of ``text`` into thread ``thread_ts`` of ``CHANNEL`` (``fields``:
    more of the message, as its ``metadata``)."""
    standin.say(
        CHANNEL,
        text,
        at_ms=at_ms,
        user=standin.bot_user_id,
        bot_id=standin.bot_id,
        thread_ts=thread_ts,
        **fields,
    )


def event_id(ts: str, channel: str = CHANNEL) -> str:
    return f"slack:T0STANDIN:{channel}:{ts}"


async def answered_live(service: App, standin: SlackApiStandin, ts: str) -> None:
    """A process up (its catch-up done) takes in ``ts``, delivered live, and answers it."""
    async with running(service, standin) as (up, client):
        await caught_up(up)
        await deliver(client, standin, ts)
        await eventually(lambda: answers(up, ts), what="the live message answered")


async def deliver(client: Client, standin: SlackApiStandin, ts: str) -> None:
    """Slack's delivery of the kept message ``ts`` (of ``CHANNEL``) as an ``app_mention``
    event, signed; answered 200."""
    [message] = [m for m in standin.history[CHANNEL] if m["ts"] == ts]
    await post_event(client, {**message, "type": "app_mention", "channel": CHANNEL}, f"Ev{ts}")


async def post_event(client: Client, event: dict[str, Any], event_id: str) -> None:
    """Slack's signed delivery of ``event`` (team ``T0STANDIN``) to ``/slack/events``,
    answered 200."""
    body = json.dumps(
        {"type": "event_callback", "team_id": "T0STANDIN", "event_id": event_id, "event": event}
    )
    answer = await client.post("/slack/events", data=body, headers=signed_headers(SECRET, body))
    assert answer.status == 200, await answer.text()


async def test_messages_posted_while_the_service_was_down_are_answered_once_after_it_starts(
    service: App, standin: SlackApiStandin, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pages of two messages: the catch-up follows the cursor.
    monkeypatch.setattr(slack, "CATCH_UP_PAGE_SIZE", 2)
    await routed(service, {"team": "T0STANDIN"})
    now = fake_clock(service).now_ms()
    live = said(standin, "said while up", at_ms=now - 30 * MINUTE_MS)
    await answered_live(service, standin, live)
    # Down: Slack's retries of these reach nobody.
    missed = said(standin, "said while down", at_ms=now - 20 * MINUTE_MS)
    standin.say(CHANNEL, "not to the bot", at_ms=now - 19 * MINUTE_MS)
    standin.say(CHANNEL, "a bot's", at_ms=now - 18 * MINUTE_MS, bot_id="B0OTHER")
    standin.say(CHANNEL, "", at_ms=now - 17 * MINUTE_MS, subtype="channel_join")
    in_thread = said(standin, "in the thread", at_ms=now - 16 * MINUTE_MS, thread_ts=live)
    later = said(standin, "said while down, later", at_ms=now - 15 * MINUTE_MS)
    elsewhere = said(standin, "in another channel", channel=UNKNOWN_CHANNEL, at_ms=now - MINUTE_MS)
    async with running(service, standin) as (second, _):
        await caught_up(second)
    assert await answers(service, missed) == ["Echo: said while down"]
    assert await answers(service, later) == ["Echo: said while down, later"]
    # A reply in a thread is answered in its thread, as a live one is.
    assert await answers(service, live) == ["Echo: said while up", "Echo: in the thread"]
    # No message was ever taken in there and no route names it: unknown here.
    assert await answers(service, elsewhere) == []
    # Oldest first; the live one read again (the overlap) was a duplicate; neither the
    # bot's, the join nor the message that does not mention the bot taken in.
    assert await taken_in(service) == [event_id(m) for m in (live, missed, in_thread, later)]
    history = [r for r in standin.reads if r["method"] == "conversations.history"]
    assert [r["channel"] for r in history] == [CHANNEL] * 3  # 6 parents, 2 a page
    # From the channel's first read point (stored before the read: the newest taken in,
    # to the millisecond, less the overlap).
    assert {r["oldest"] for r in history} == {
        ts_at(int(Decimal(live) * 1000) - CATCH_UP_OVERLAP_MS)
    }
    [thread] = [r for r in standin.reads if r["method"] == "conversations.replies"]
    assert thread["ts"] == live


async def test_a_message_both_live_and_in_the_catch_up_is_answered_once(
    service: App, standin: SlackApiStandin
) -> None:
    # A route naming the channel: caught up though no message was taken in there yet.
    await routed(service, {"team": "T0STANDIN", "channel": CHANNEL})
    standin.say(CHANNEL, "before the service started", at_ms=fake_clock(service).now_ms())
    reading, release = asyncio.Event(), asyncio.Event()

    async def held(_record: dict[str, Any]) -> None:
        reading.set()
        await release.wait()

    standin.on_read = held
    async with running(service, standin) as (up, client):
        await asyncio.wait_for(reading.wait(), 10)
        # Live while the catch-up's read is on its way: the read finds it too.
        both = said(standin, "seen twice", at_ms=fake_clock(service).now_ms())
        await deliver(client, standin, both)
        await eventually(lambda: answers(up, both), what="the live message answered")
        duplicates = counted("leadgate_turns_total", outcome="duplicate")
        release.set()
        await caught_up(up)
        assert counted("leadgate_turns_total", outcome="duplicate") == duplicates + 1
    assert await answers(service, both) == ["Echo: seen twice"]
    assert await taken_in(service) == [event_id(both)]


async def test_messages_older_than_the_window_or_the_route_or_replied_to_are_not_answered(
    service: App, standin: SlackApiStandin
) -> None:
    clock = fake_clock(service)
    await routed(service, {"team": "T0STANDIN", "channel": CHANNEL})
    clock.advance(3 * HOUR_MS)
    now = clock.now_ms()
    # A route made half an hour ago, for the other channel (its workspace unnamed).
    clock.advance(-HOUR_MS // 2)
    beta = await make_org(service, "beta")
    late = await make_agent(service, beta, "late")
    await make_route(service, beta, late["id"], "slack", {"channel": OTHER_CHANNEL})
    clock.advance(HOUR_MS // 2)
    # [slack] catch_up_s is an hour by default.
    too_old = said(standin, "two hours ago", at_ms=now - 2 * HOUR_MS)
    recent = said(standin, "ten minutes ago", at_ms=now - 10 * MINUTE_MS)
    # On Slack's last try with the database down the person was told in the thread
    # ("could not be taken in"): they may have sent it again since.
    told = said(standin, "told on the last try", at_ms=now - 9 * MINUTE_MS)
    bot_says(standin, COULD_NOT, now - 4 * MINUTE_MS, told)
    before_route = said(
        standin, "before the route", channel=OTHER_CHANNEL, at_ms=now - 40 * MINUTE_MS
    )
    after_route = said(
        standin, "after the route", channel=OTHER_CHANNEL, at_ms=now - 20 * MINUTE_MS
    )
    async with running(service, standin) as (up, _):
        await caught_up(up)
    assert await answers(service, too_old) == []
    assert await answers(service, recent) == ["Echo: ten minutes ago"]
    assert await answers(service, told) == []
    assert await answers(service, before_route) == []
    assert await answers(service, after_route) == ["Echo: after the route"]
    oldest = {
        r["channel"]: r["oldest"] for r in standin.reads if r["method"] == "conversations.history"
    }
    assert oldest == {CHANNEL: ts_at(now - HOUR_MS), OTHER_CHANNEL: ts_at(now - HOUR_MS // 2)}


async def test_a_reply_in_a_thread_the_bot_replied_to_after_it_is_not_answered(
    service: App, standin: SlackApiStandin
) -> None:
    await routed(service, {"team": "T0STANDIN", "channel": CHANNEL})
    now = fake_clock(service).now_ms()
    parent = said(standin, "the question", at_ms=now - 30 * MINUTE_MS)
    with clock_at(service, now - 29 * MINUTE_MS):
        await answered_live(service, standin, parent)
    said(standin, "told in the thread", at_ms=now - 20 * MINUTE_MS, thread_ts=parent)
    standin.say(
        CHANNEL,
        "Your message could not be taken in: ...",
        at_ms=now - 15 * MINUTE_MS,
        user=standin.bot_user_id,
        bot_id=standin.bot_id,
        thread_ts=parent,
    )
    after = said(standin, "after the notice", at_ms=now - 10 * MINUTE_MS, thread_ts=parent)
    async with running(service, standin) as (second, _):
        await caught_up(second)
    assert await answers(service, parent) == ["Echo: the question", "Echo: after the notice"]
    assert await taken_in(service) == [event_id(parent), event_id(after)]


async def test_only_the_message_a_reply_of_the_bot_s_names_counts_as_answered(
    service: App, standin: SlackApiStandin
) -> None:
    """A later post of the bot's in a thread answered every message before it: one
    posted while the service was down, followed by the approved answer to an earlier
    one, was never answered. The bot's answers tell nothing (what they answer was taken
    in: a duplicate), and its "could not be taken in" notice tells the message its
    metadata names, no other."""
    await routed(service, {"team": "T0STANDIN", "channel": CHANNEL})
    now = fake_clock(service).now_ms()
    first = said(standin, "the question", at_ms=now - 30 * MINUTE_MS)
    with clock_at(service, now - 29 * MINUTE_MS):
        await answered_live(service, standin, first)
    # Down: a second question, then the first's answer (approved late: the outbox's
    # post carries no metadata).
    second = said(standin, "the second", at_ms=now - 20 * MINUTE_MS, thread_ts=first)
    bot_says(standin, "Echo: the question", now - 15 * MINUTE_MS, first)
    # A third told on Slack's last try; a fourth posted before that notice was not.
    third = said(standin, "the third", at_ms=now - 12 * MINUTE_MS, thread_ts=first)
    fourth = said(standin, "the fourth", at_ms=now - 11 * MINUTE_MS, thread_ts=first)
    names = {"event_type": slack.REPLY_EVENT, "event_payload": {"message_ts": third}}
    bot_says(standin, COULD_NOT, now - 10 * MINUTE_MS, first, metadata=names)
    async with running(service, standin) as (again, _):
        await caught_up(again)
    assert await answers(service, first) == [
        "Echo: the question",
        "Echo: the second",
        "Echo: the fourth",
    ]
    assert await taken_in(service) == [event_id(first), event_id(second), event_id(fourth)]


async def test_a_message_whose_only_bot_reply_is_the_in_doubt_notice_is_answered(
    service: App, standin: SlackApiStandin
) -> None:
    # The notice promised the answer once the service is back, as on Discord: a parent
    # (reply_users naming the bot) and a reply in a thread so told are taken in; one
    # told "could not be taken in" after an in-doubt notice is not.
    await routed(service, {"team": "T0STANDIN", "channel": CHANNEL})
    now = fake_clock(service).now_ms()
    in_doubt = not_taken_in(IntakeInDoubt())
    parent = said(standin, "told in doubt", at_ms=now - 30 * MINUTE_MS)
    bot_says(standin, in_doubt, now - 29 * MINUTE_MS, parent)
    reply = said(standin, "a reply told in doubt", at_ms=now - 25 * MINUTE_MS, thread_ts=parent)
    bot_says(standin, in_doubt, now - 24 * MINUTE_MS, parent)
    other = said(standin, "told twice", at_ms=now - 20 * MINUTE_MS)
    bot_says(standin, in_doubt, now - 19 * MINUTE_MS, other)
    bot_says(standin, COULD_NOT, now - 18 * MINUTE_MS, other)
    async with running(service, standin) as (up, _):
        await caught_up(up)
    assert await answers(service, parent) == ["Echo: told in doubt", "Echo: a reply told in doubt"]
    assert await answers(service, other) == []
    assert await taken_in(service) == [event_id(parent), event_id(reply)]


async def test_a_thread_with_more_replies_than_the_limit_says_so(
    service: App,
    standin: SlackApiStandin,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # One page of two: a thread's replies past it were dropped without a word.
    monkeypatch.setattr(slack, "CATCH_UP_PAGES", 1)
    monkeypatch.setattr(slack, "CATCH_UP_PAGE_SIZE", 2)
    await routed(service, {"team": "T0STANDIN", "channel": CHANNEL})
    now = fake_clock(service).now_ms()
    parent = said(standin, "a thread", at_ms=now - 30 * MINUTE_MS)
    first = said(standin, "the first reply", at_ms=now - 20 * MINUTE_MS, thread_ts=parent)
    said(standin, "the second reply", at_ms=now - 10 * MINUTE_MS, thread_ts=parent)
    caplog.set_level(logging.WARNING)
    async with running(service, standin) as (up, _):
        await caught_up(up)
    assert await answers(service, parent) == ["Echo: a thread", "Echo: the first reply"]
    assert await taken_in(service) == [event_id(parent), event_id(first)]
    [warning] = [r for r in caplog.records if r.name == "bots.slack"]
    assert f"thread {parent} in channel {CHANNEL} read its first 2 messages" in (
        warning.getMessage()
    )


async def test_the_threads_read_are_those_that_moved_last_not_those_started_last(
    service: App, standin: SlackApiStandin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past CATCH_UP_THREADS, the threads known from sessions were ranked by their first
    message: a busy old thread was dropped for a quiet newer one, and the replies posted
    there while the service was down were never answered. They rank by the newest
    message taken in there (Slack tells a thread's latest_reply on its parent, which
    the read returns only when posted after the read point)."""
    monkeypatch.setattr(slack, "CATCH_UP_THREADS", 1)
    await routed(service, {"team": "T0STANDIN", "channel": CHANNEL})
    now = fake_clock(service).now_ms()
    busy = said(standin, "an old thread", at_ms=now - 50 * MINUTE_MS)
    said(standin, "busy lately", at_ms=now - 32 * MINUTE_MS, thread_ts=busy)
    quiet = said(standin, "a newer quiet thread", at_ms=now - 35 * MINUTE_MS)
    with clock_at(service, now - 30 * MINUTE_MS):
        async with running(service, standin) as (first, _):
            await caught_up(first)
    assert await answers(service, quiet) == ["Echo: a newer quiet thread"]
    missed = said(standin, "said while down", at_ms=now - 20 * MINUTE_MS, thread_ts=busy)
    async with running(service, standin) as (again, _):
        await caught_up(again)
    assert await answers(service, busy) == [
        "Echo: an old thread",
        "Echo: busy lately",
        "Echo: said while down",
    ]
    assert event_id(missed) in await taken_in(service)
    replies = [r["ts"] for r in standin.reads if r["method"] == "conversations.replies"]
    assert replies == [busy, busy]


async def test_a_reply_under_a_parent_older_than_the_window_is_answered(
    service: App, standin: SlackApiStandin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread whose first message is older than the window, where no message was taken
    in within it, was never read: the channel's history holds no first message that old,
    and nothing was taken in there lately, so a reply posted there while the service was
    down was never answered. The threads known from older messages fill the slots the
    threads that moved leave, newest first."""
    monkeypatch.setattr(slack, "CATCH_UP_THREADS", 2)
    clock = fake_clock(service)
    await routed(service, {"team": "T0STANDIN", "channel": CHANNEL})
    clock.advance(3 * HOUR_MS)
    now = clock.now_ms()
    oldest = said(standin, "the oldest question", at_ms=now - 3 * HOUR_MS)
    old = said(standin, "a question", at_ms=now - 2 * HOUR_MS)
    for parent, at_ms in ((oldest, now - 3 * HOUR_MS), (old, now - 2 * HOUR_MS)):
        with clock_at(service, at_ms + MINUTE_MS):
            await answered_live(service, standin, parent)
    moved = said(standin, "lately", at_ms=now - 30 * MINUTE_MS)
    with clock_at(service, now - 29 * MINUTE_MS):
        await answered_live(service, standin, moved)
    # Down: a reply under each old parent, and one in the thread that moved.
    reply = said(standin, "a follow-up", at_ms=now - 10 * MINUTE_MS, thread_ts=old)
    said(standin, "past the limit", at_ms=now - 9 * MINUTE_MS, thread_ts=oldest)
    said(standin, "and here", at_ms=now - 8 * MINUTE_MS, thread_ts=moved)
    standin.reads.clear()
    async with running(service, standin) as (up, _):
        await caught_up(up)
    assert await answers(service, old) == ["Echo: a question", "Echo: a follow-up"]
    assert await answers(service, moved) == ["Echo: lately", "Echo: and here"]
    # Two threads a channel: the one that moved, then the newest known from before.
    assert await answers(service, oldest) == ["Echo: the oldest question"]
    assert event_id(reply) in await taken_in(service)
    replies = [r["ts"] for r in standin.reads if r["method"] == "conversations.replies"]
    assert replies == [moved, old]


async def test_every_message_is_answered_when_not_only_mentions_are_caught_up(
    service: App, standin: SlackApiStandin
) -> None:
    await routed(service, {"team": "T0STANDIN", "channel": CHANNEL})
    now = fake_clock(service).now_ms()
    plain = standin.say(CHANNEL, "no mention", at_ms=now - MINUTE_MS)["ts"]
    # An app subscribed to message.channels is given every message.
    async with running(service, standin, catch_up_mentions_only=False) as (up, _):
        await caught_up(up)
    assert await answers(service, plain) == ["Echo: no mention"]


async def test_a_history_slack_refuses_is_logged_and_the_other_channels_are_read_on(
    service: App, standin: SlackApiStandin, caplog: pytest.LogCaptureFixture
) -> None:
    await routed(
        service,
        {"team": "T0STANDIN", "channel": CHANNEL},
        {"team": "T0STANDIN", "channel": OTHER_CHANNEL},
    )
    now = fake_clock(service).now_ms()
    refused = said(standin, "where the bot may not read", at_ms=now - MINUTE_MS)
    limited = said(standin, "where Slack said wait", channel=OTHER_CHANNEL, at_ms=now - MINUTE_MS)
    # The app lacks channels:history; the other channel's first read is rate limited.
    standin.fail_reads(CHANNEL, "error:missing_scope")
    standin.fail_reads(OTHER_CHANNEL, "ratelimited:0")
    caplog.set_level(logging.WARNING)
    async with running(service, standin) as (up, _):
        await caught_up(up)
    assert await answers(service, refused) == []
    # The 429 waited out (Retry-After) and read again.
    assert await answers(service, limited) == ["Echo: where Slack said wait"]
    assert [(r["channel"], r["mode"]) for r in standin.reads] == [
        (CHANNEL, "error:missing_scope"),
        (OTHER_CHANNEL, "ratelimited:0"),
        (OTHER_CHANNEL, "ok"),
    ]
    [warning] = [r for r in caplog.records if "catch up" in r.getMessage()]
    assert warning.levelno == logging.WARNING and not warning.exc_info
    assert CHANNEL in warning.getMessage() and "missing_scope" in warning.getMessage()


async def test_a_channel_deleted_since_is_passed_over_without_a_warning_at_each_start(
    service: App, standin: SlackApiStandin, caplog: pytest.LogCaptureFixture
) -> None:
    # Its sessions stay, so every start reads it again; one a route names still warns.
    await routed(service, {"team": "T0STANDIN"}, {"team": "T0STANDIN", "channel": OTHER_CHANNEL})
    now = fake_clock(service).now_ms()
    gone = said(standin, "in a channel deleted since", at_ms=now - 30 * MINUTE_MS)
    await answered_live(service, standin, gone)
    del standin.history[CHANNEL]  # channel_not_found
    caplog.clear()
    caplog.set_level(logging.INFO)
    async with running(service, standin) as (up, _):
        await caught_up(up)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "bots.slack"]
    assert (logging.INFO, f"slack: channel {CHANNEL} is gone; not caught up") in lines
    [warning] = [m for level, m in lines if level >= logging.WARNING]
    assert OTHER_CHANNEL in warning and "channel_not_found" in warning


async def test_no_catch_up_when_it_is_off(service: App, standin: SlackApiStandin) -> None:
    await routed(service, {"team": "T0STANDIN", "channel": CHANNEL})
    missed = said(standin, "said while down", at_ms=fake_clock(service).now_ms() - MINUTE_MS)
    async with running(service, standin, catch_up_s=0) as (up, _):
        [adapter] = [a for a in up.adapters if isinstance(a, SlackAdapter)]
        assert adapter.catching_up is None
    assert await answers(service, missed) == [] and standin.reads == []


async def test_two_replicas_answer_a_missed_message_once(
    service: App, standin: SlackApiStandin
) -> None:
    await routed(service, {"team": "T0STANDIN", "channel": CHANNEL})
    missed = said(standin, "said while both were down", at_ms=fake_clock(service).now_ms())
    duplicates = counted("leadgate_turns_total", outcome="duplicate")
    async with running(service, standin) as (one, _), running(service, standin) as (two, _):
        await caught_up(one)
        await caught_up(two)
        assert len([r for r in standin.reads if r["method"] == "conversations.history"]) == 2
    # Taken in by both: once, and once a duplicate (the same process counts for both).
    assert counted("leadgate_turns_total", outcome="duplicate") == duplicates + 1
    assert await answers(service, missed) == ["Echo: said while both were down"]


async def test_a_start_reads_a_channel_from_the_newest_message_taken_in_since_its_read_through(
    service: App, standin: SlackApiStandin
) -> None:
    """A channel read through by one start's catch-up, then live messages taken in there:
    the next start read it from that catch-up's start (its read point), the whole window
    again at every start once the service ran longer than it (a wasted history scan per
    channel, against Slack's rate limits). It reads from the newest taken in, less the
    overlap, and a message missed after it is still answered."""
    await routed(service, {"team": "T0STANDIN", "channel": CHANNEL})
    now = fake_clock(service).now_ms()
    standin.say(CHANNEL, "not to the bot", at_ms=now - 55 * MINUTE_MS)
    with clock_at(service, now - 50 * MINUTE_MS):
        async with running(service, standin) as (earlier, client):
            await caught_up(earlier)
            live = said(standin, "said while up", at_ms=now - 40 * MINUTE_MS)
            await deliver(client, standin, live)
            await eventually(lambda: answers(earlier, live), what="the live message answered")
    missed = said(standin, "said while down", at_ms=now - 20 * MINUTE_MS)
    async with running(service, standin) as (up, _):
        await caught_up(up)
    assert await answers(service, missed) == ["Echo: said while down"]
    assert await answers(service, live) == ["Echo: said while up"]
    *_, history = [r for r in standin.reads if r["method"] == "conversations.history"]
    assert history["oldest"] == ts_at(int(Decimal(live) * 1000) - CATCH_UP_OVERLAP_MS)


@pytest.mark.parametrize("read_before", [True, False], ids=["read through before", "never read"])
async def test_messages_missed_before_a_failed_read_are_answered_after_a_live_message_there(
    service: App, standin: SlackApiStandin, read_before: bool
) -> None:
    """A start whose read of a channel failed, then a live message taken in there: the
    next start read from that live message (the newest taken in there), and the
    messages missed before it were never answered. It reads from the channel's read
    point: where the last catch-up that read it through started (or, never read
    through, where its first catch-up started)."""
    await routed(service, {"team": "T0STANDIN", "channel": CHANNEL})
    now = fake_clock(service).now_ms()
    if read_before:
        with clock_at(service, now - 50 * MINUTE_MS):
            async with running(service, standin) as (earlier, _):
                await caught_up(earlier)
    missed = said(standin, "said while down", at_ms=now - 20 * MINUTE_MS)
    standin.fail_reads(CHANNEL, "error:internal_error")
    async with running(service, standin) as (up, client):
        await caught_up(up)
        live = said(standin, "said once it was up", at_ms=now - 5 * MINUTE_MS)
        await deliver(client, standin, live)
        await eventually(lambda: answers(up, live), what="the live message answered")
    async with running(service, standin) as (again, _):
        await caught_up(again)
    assert await answers(service, missed) == ["Echo: said while down"]
    assert await answers(service, live) == ["Echo: said once it was up"]
    assert await taken_in(service) == [event_id(live), event_id(missed)]
    history = [r["mode"] for r in standin.reads if r["method"] == "conversations.history"]
    assert history == ["ok"] * read_before + ["error:internal_error", "ok"]


async def test_a_thread_slack_will_not_read_leaves_the_channel_s_other_messages_taken_in(
    service: App, standin: SlackApiStandin, caplog: pytest.LogCaptureFixture
) -> None:
    await routed(service, {"team": "T0STANDIN", "channel": CHANNEL})
    now = fake_clock(service).now_ms()
    kept = said(standin, "a thread", at_ms=now - 30 * MINUTE_MS)
    deleted = said(standin, "a thread deleted since", at_ms=now - 25 * MINUTE_MS)
    with clock_at(service, now - 24 * MINUTE_MS):
        async with running(service, standin) as (first, client):
            await caught_up(first)
            for ts in (kept, deleted):
                await deliver(client, standin, ts)
            await eventually(lambda: answers(first, deleted), what="the live messages answered")
    standin.history[CHANNEL] = [m for m in standin.history[CHANNEL] if m["ts"] != deleted]
    missed = said(standin, "said while down", at_ms=now - 10 * MINUTE_MS)
    # The history read, the deleted thread's (thread_not_found), then the other thread's.
    standin.fail_reads(CHANNEL, "ok", "ok", "error:internal_error")
    caplog.set_level(logging.WARNING)
    async with running(service, standin) as (up, _):
        await caught_up(up)
    assert await answers(service, missed) == ["Echo: said while down"]
    replies = [(r["ts"], r["mode"]) for r in standin.reads[-2:]]
    assert replies == [(deleted, "ok"), (kept, "error:internal_error")]
    # One line, for the thread Slack would not read; none for the one that is gone.
    [warning] = [r for r in caplog.records if r.name == "bots.slack"]
    assert "threads of channel C0ASK" in warning.getMessage()
    assert "internal_error" in warning.getMessage() and not warning.exc_info


async def test_a_database_fault_during_the_catch_up_is_tried_again_until_it_ends(
    service: App, standin: SlackApiStandin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The catch-up stopped by a database fault at a message's intake is tried again
    shortly (it waited for the next start, which may be days on: the message was never
    answered), and tells nobody: answered once."""
    monkeypatch.setattr(bots_base, "CATCH_UP_RETRY_FIRST_S", 0.01)
    await routed(service, {"team": "T0STANDIN", "channel": CHANNEL})
    now = fake_clock(service).now_ms()
    missed = said(standin, "said while down", at_ms=now - 20 * MINUTE_MS)
    up: list[App] = []

    async def down_once(record: dict[str, Any]) -> None:
        # The database away for the catch-up's first intake (the process is up by the
        # time its read of the channel comes back).
        if record["method"] != "conversations.history":
            return
        standin.on_read = None
        await eventually(lambda: up, what="the second process up")
        monkeypatch.setattr(up[0].db, "tx", DownFor(up[0].db.tx, 1, after_commit=False))

    standin.on_read = down_once
    async with running(service, standin) as (second, _):
        up.append(second)
        await caught_up(second)
    history = [r for r in standin.reads if r["method"] == "conversations.history"]
    assert len(history) == 2  # the fault's read, and the retry's
    assert [c for c in standin.calls if c.get("thread_ts") == missed] == []
    assert await answers(service, missed) == ["Echo: said while down"]
