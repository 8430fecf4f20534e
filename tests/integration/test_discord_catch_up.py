"""Discord's gateway delivers a message once, to the sessions connected then: messages
posted while the service was down are read back at READY (``GET
/channels/{id}/messages?after=...``) and answered once, through the real discord.py
client and the real composition root against the Discord stand-in (REST and gateway).

"Answered" here is the reply queued in the outbox for that message (a ``deliveries`` row
whose address names it): no runner runs, so nothing is posted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, cast

import pytest
import sqlalchemy as sa

from bots import base as bots_base
from bots import discord as discord_bots
from bots.base import IN_DOUBT, NOT_TAKEN_IN
from bots.discord import DiscordAdapter
from bots.slack import SlackAdapter
from leadgate.app import App
from leadgate.core.runners import drain
from leadgate.core.types import BindingKind
from leadgate.database import schema as t
from leadgate.database.db import Conn, Database
from tests.fakes import CommitLandsLater, DownFor
from tests.helpers import counted, eventually, fake_clock, make_agent, make_org, make_route
from tests.serving import served_app
from tests.standins.discord_api import DiscordApiStandin, config_section

GUILD, CHANNEL = "1000000000000000001", "1000000000000000002"
OTHER_CHANNEL = "1000000000000000003"
OTHER_GUILD, CHANNEL_ELSEWHERE = "1000000000000000004", "1000000000000000005"
HOUR_MS = 3_600_000


@pytest.fixture(autouse=True)
def identify_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second IDENTIFY (after a session that cannot resume) without discord.py's 5 s
    pause (kept in production for Discord's identify rate limit)."""
    monkeypatch.setattr(discord_bots, "IDENTIFY_PAUSE_S", 0.0)


def gateway(discord_api: DiscordApiStandin) -> dict[str, Any]:
    """The config sections that turn the Discord gateway on, against ``discord_api``."""
    return {"discord": config_section(discord_api)}


@contextlib.asynccontextmanager
async def running(service: App, discord_api: DiscordApiStandin) -> AsyncIterator[App]:
    """Another process on ``service``'s database and clock, with the gateway on, served
    for the block (no runners)."""
    async with served_app(
        service.settings.database.url,
        config=gateway(discord_api),
        adapters=True,
        clock=fake_clock(service),
    ) as (up, _):
        yield up


async def routed(service: App, *matches: dict[str, str]) -> None:
    """Discord routes matching ``matches`` to the agent ``plain`` (the script model)."""
    org = await make_org(service)
    plain = await make_agent(service, org, "plain")
    for match in matches:
        await make_route(service, org, plain["id"], "discord", match)


def adapter_of(service: App) -> DiscordAdapter:
    [adapter] = [a for a in service.adapters if isinstance(a, DiscordAdapter)]
    return adapter


async def caught_up(service: App, *, not_this: asyncio.Task[None] | None = None) -> None:
    """Until a catch-up (not ``not_this`` one, of an earlier READY) has ended (it records
    each message before it reads on) and every turn recorded has run."""
    await catch_up_ended(service, DiscordAdapter, not_this=not_this)


async def catch_up_ended(
    service: App,
    kind: type[DiscordAdapter | SlackAdapter],
    *,
    not_this: asyncio.Task[None] | None = None,
) -> None:
    """Until the catch-up of ``service``'s adapter of ``kind`` (not ``not_this`` one) has
    ended and every turn recorded has run (a turn's ``turn_runs`` row goes with its last
    transaction)."""
    [adapter] = [a for a in service.adapters if isinstance(a, kind)]

    async def done() -> bool:
        task = adapter.catching_up
        if task is None or task is not_this or not task.done():
            return False
        async with service.db.read() as conn:
            return (await conn.execute(sa.select(t.turn_runs.c.id))).first() is None

    await eventually(done, what="the catch-up ended and its turns ran")


async def answers(service: App, message_id: str) -> list[str]:
    """The replies queued for the Discord message ``message_id``."""
    async with service.db.read() as conn:
        rows = (await conn.execute(sa.select(t.deliveries.c.address, t.deliveries.c.text))).all()
    return [row.text for row in rows if str(row.address.get("message_id")) == message_id]


async def taken_in(service: App) -> list[str]:
    """The external ids of the inbound events recorded, in the order they were."""
    async with service.db.read() as conn:
        ids = await conn.execute(
            sa.select(t.inbound_events.c.external_event_id).order_by(t.inbound_events.c.id)
        )
        return [str(i) for i in ids.scalars()]


async def message(
    discord_api: DiscordApiStandin, text: str, *, channel: str = CHANNEL, **kwargs: Any
) -> str:
    """Post ``text`` (to the gateway sessions connected now, if any); its id."""
    sent = await discord_api.dispatch_message_create(
        channel_id=channel, guild_id=GUILD, content=text, **kwargs
    )
    return str(sent["id"])


async def test_messages_posted_while_the_service_was_down_are_answered_once_after_it_starts(
    service: App, discord_api: DiscordApiStandin
) -> None:
    await routed(service, {"guild": GUILD})
    async with running(service, discord_api) as first:
        await caught_up(first)
        live = await message(discord_api, "said while up")
        await eventually(lambda: answers(first, live), what="the live message answered")
    # Down: Discord delivers these to nobody.
    missed = await message(discord_api, "said while down")
    await message(discord_api, "a bot's", author_bot=True)
    later = await message(discord_api, "said while down, later")
    elsewhere = await message(discord_api, "in another channel", channel=OTHER_CHANNEL)
    async with running(service, discord_api) as second:
        await caught_up(second)
    assert await answers(service, missed) == ["Echo: said while down"]
    assert await answers(service, later) == ["Echo: said while down, later"]
    # Read again (the overlap), and a duplicate: answered once, by the first process.
    assert await answers(service, live) == ["Echo: said while up"]
    # No message was ever taken in there and no route names it: unknown here.
    assert await answers(service, elsewhere) == []
    # Oldest first, and the bot's message not at all.
    assert await taken_in(service) == [f"discord:message:{m}" for m in (live, missed, later)]
    # Newest first (discord.py pages back from the newest, keeping those after the
    # start): one page.
    [read] = discord_api.reads
    assert read["channel_id"] == CHANNEL and read["mode"] == "ok"
    assert read["after"] is None and read["before"] is None


async def test_a_thread_started_while_the_service_was_down_is_read_back(
    service: App, discord_api: DiscordApiStandin
) -> None:
    """A route naming the guild answers a message in a thread live (its channel is the
    thread's own id), but a thread started while the service was down had no session:
    its messages were never read. The active threads of the channels caught up are read
    too, one under a channel a route names as well (that route answers in its threads);
    one under a channel nobody knows is not."""
    await routed(service, {"guild": GUILD}, {"guild": OTHER_GUILD, "channel": CHANNEL_ELSEWHERE})
    async with running(service, discord_api) as first:
        await caught_up(first)
        live = await message(discord_api, "said while up")
        await eventually(lambda: answers(first, live), what="the live message answered")
    # Down: a thread started under the known channel, and one under a channel unknown.
    thread = discord_api.start_thread(GUILD, CHANNEL)
    missed = await message(discord_api, "in a new thread", channel=thread)
    unknown = await message(
        discord_api,
        "under an unknown channel",
        channel=discord_api.start_thread(GUILD, OTHER_CHANNEL),
    )
    named = discord_api.start_thread(OTHER_GUILD, CHANNEL_ELSEWHERE)
    under_named = str(
        (
            await discord_api.dispatch_message_create(
                channel_id=named, guild_id=OTHER_GUILD, content="under a routed channel"
            )
        )["id"]
    )
    discord_api.thread_reads.clear()
    discord_api.archived_reads.clear()
    async with running(service, discord_api) as second:
        await caught_up(second)
    assert await answers(service, missed) == ["Echo: in a new thread"]
    assert await answers(service, under_named) == ["Echo: under a routed channel"]
    assert await answers(service, unknown) == []
    assert sorted(await taken_in(service)) == sorted(
        f"discord:message:{m}" for m in (live, missed, under_named)
    )
    # Once per guild caught up; the archived threads of the channel the route names.
    assert sorted(discord_api.thread_reads) == [GUILD, OTHER_GUILD]
    # (and those of the channel the guild-wide route reached: none archived)
    assert sorted(discord_api.archived_reads) == [CHANNEL, CHANNEL_ELSEWHERE]
    assert {r["channel_id"] for r in discord_api.reads} == {
        CHANNEL,
        CHANNEL_ELSEWHERE,
        thread,
        named,
    }


async def test_a_thread_archived_under_a_channel_a_guild_wide_route_reaches_is_read_back(
    service: App, discord_api: DiscordApiStandin
) -> None:
    """A route naming the guild alone answers in the threads of every channel of it; the
    archived threads of the channels it reached (those that took messages in) were not
    read, only those of a channel a route names with ``channel=``: a thread whose
    messages came while the service was down, then went quiet, was never read."""
    clock = fake_clock(service)
    await routed(service, {"guild": GUILD})
    async with running(service, discord_api) as first:
        await caught_up(first)
        live = await message(discord_api, "said while up", at_ms=clock.now_ms())
        await eventually(lambda: answers(first, live), what="the live message answered")
    clock.advance(HOUR_MS // 2)
    now = clock.now_ms()
    quiet = discord_api.start_thread(GUILD, CHANNEL, at_ms=now - 20 * 60_000)
    missed = await message(
        discord_api, "then it went quiet", channel=quiet, at_ms=now - 15 * 60_000
    )
    discord_api.archive_thread(quiet, at_ms=now - 5 * 60_000)
    discord_api.archived_reads.clear()
    async with running(service, discord_api) as second:
        await caught_up(second)
    assert await answers(service, missed) == ["Echo: then it went quiet"]
    assert await replied_in(service, missed) == [quiet]
    assert discord_api.archived_reads == [CHANNEL]


async def test_a_route_naming_a_channel_but_no_guild_reads_its_new_threads(
    service: App, discord_api: DiscordApiStandin
) -> None:
    """A route naming a channel without its guild answers in its threads; the catch-up
    read the active threads of the guilds it knew alone, so a thread started under that
    channel while the service was down was never read. The channel's guild is learnt
    first (one ``GET /channels/{id}``), then its guild's active threads are read."""
    clock = fake_clock(service)
    await message(discord_api, "long before the route", at_ms=clock.now_ms() - 2 * HOUR_MS)
    await routed(service, {"channel": CHANNEL})
    now = clock.now_ms()
    thread = discord_api.start_thread(GUILD, CHANNEL, at_ms=now - 20 * 60_000)
    clock.advance(30 * 60_000)
    missed = await message(discord_api, "in a new thread", channel=thread, at_ms=now + 10 * 60_000)
    async with running(service, discord_api) as up:
        await caught_up(up)
    assert await answers(service, missed) == ["Echo: in a new thread"]
    assert await replied_in(service, missed) == [thread]
    assert discord_api.thread_reads == [GUILD]


async def took(service: App, message_id: str) -> tuple[str, str]:
    """The agent that took the Discord message ``message_id`` in, and its session key."""
    async with service.db.read() as conn:
        row = (
            await conn.execute(
                sa.select(t.inbound_events.c.agent_id, t.sessions.c.key)
                .join(t.sessions, t.sessions.c.id == t.inbound_events.c.session_id)
                .where(t.inbound_events.c.external_event_id == f"discord:message:{message_id}")
            )
        ).one()
    return str(row.agent_id), str(row.key)


async def replied_in(service: App, message_id: str) -> list[str]:
    """The channels the replies queued for the Discord message ``message_id`` go to."""
    async with service.db.read() as conn:
        rows = (await conn.execute(sa.select(t.deliveries.c.address))).all()
    return [
        str(row.address.get("channel_id"))
        for row in rows
        if str(row.address.get("message_id")) == message_id
    ]


async def test_a_route_on_a_channel_answers_in_its_threads_unless_one_names_the_thread(
    service: App, discord_api: DiscordApiStandin
) -> None:
    """A message in a thread carries the thread's own channel id (its parent is
    ``parent_id``): a route naming the parent channel answers there as in the channel,
    the thread its own conversation and the reply posted into it; a route naming the
    thread itself wins over the parent's (here a silent one: taken in, nothing posted)."""
    org = await make_org(service)
    plain = await make_agent(service, org, "plain")
    own = await make_agent(service, org, "own")
    await make_route(service, org, plain["id"], "discord", {"guild": GUILD, "channel": CHANNEL})
    first, second = (
        discord_api.start_thread(GUILD, CHANNEL),
        discord_api.start_thread(GUILD, CHANNEL),
    )
    await make_route(service, org, own["id"], "discord", {"channel": second}, silent=True)
    async with running(service, discord_api) as up:
        await caught_up(up)
        asked = await message(discord_api, "in the thread", channel=first)
        await eventually(lambda: answers(up, asked), what="the thread's message answered")
        again = await message(discord_api, "in the thread again", channel=first)
        await eventually(lambda: answers(up, again), what="the second one answered")
        quiet = await message(discord_api, "in a thread of its own", channel=second)
        await eventually(lambda: taken_in(up), what="taken in")
        await caught_up(up)
    assert await answers(service, asked) == ["Echo: in the thread"]
    assert await replied_in(service, asked) == [first]
    session = (plain["id"], f"discord:{GUILD}:{first}")
    assert await took(service, asked) == session and await took(service, again) == session
    assert await took(service, quiet) == (own["id"], f"discord:{GUILD}:{second}")
    assert await answers(service, quiet) == []


async def test_the_catch_up_answers_a_thread_with_its_own_route_by_that_route(
    service: App, discord_api: DiscordApiStandin
) -> None:
    """Live, a route naming a thread wins over an older one naming the guild (one key
    each); the catch-up answers a missed message there by the same route (it learns the
    thread's parent from the guild's active threads)."""
    org = await make_org(service)
    plain = await make_agent(service, org, "plain")
    own = await make_agent(service, org, "own")
    await make_route(service, org, plain["id"], "discord", {"guild": GUILD})
    thread = discord_api.start_thread(GUILD, CHANNEL)
    await make_route(service, org, own["id"], "discord", {"channel": thread})
    async with running(service, discord_api) as first:
        await caught_up(first)
        live = await message(discord_api, "in the channel")
        await eventually(lambda: answers(first, live), what="the live message answered")
    missed = await message(discord_api, "in the thread while down", channel=thread)
    async with running(service, discord_api) as second:
        await caught_up(second)
    assert await answers(service, missed) == ["Echo: in the thread while down"]
    assert await took(service, missed) == (own["id"], f"discord:{GUILD}:{thread}")


async def test_a_thread_archived_while_the_service_was_down_is_read_back(
    service: App, discord_api: DiscordApiStandin
) -> None:
    """Discord archives a thread after an hour without messages: one whose messages
    came while the service was down is in no listing of active threads. The threads of
    a channel a route names archived within ``catch_up_s`` are read back; one archived
    before is not read."""
    clock = fake_clock(service)
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    async with running(service, discord_api) as first:
        await caught_up(first)
    clock.advance(3 * HOUR_MS)
    now = clock.now_ms()
    # Down: a thread archived an hour and a half ago, one half an hour ago.
    old = discord_api.start_thread(GUILD, CHANNEL, at_ms=now - 2 * HOUR_MS - 60_000)
    too_old = await message(discord_api, "long ago", channel=old, at_ms=now - 2 * HOUR_MS)
    discord_api.archive_thread(old, at_ms=now - 3 * HOUR_MS // 2)
    quiet = discord_api.start_thread(GUILD, CHANNEL, at_ms=now - HOUR_MS)
    missed = await message(
        discord_api, "then it went quiet", channel=quiet, at_ms=now - 50 * 60_000
    )
    discord_api.archive_thread(quiet, at_ms=now - HOUR_MS // 2)
    async with running(service, discord_api) as second:
        await caught_up(second)
    assert await answers(service, missed) == ["Echo: then it went quiet"]
    assert await replied_in(service, missed) == [quiet]
    assert await answers(service, too_old) == []
    assert discord_api.archived_reads == [CHANNEL, CHANNEL]
    assert [r["channel_id"] for r in discord_api.reads[-2:]] == [CHANNEL, quiet]


async def test_a_private_thread_the_bot_joined_archived_while_it_was_down_is_read_back(
    service: App, discord_api: DiscordApiStandin, caplog: pytest.LogCaptureFixture
) -> None:
    """Discord lists a channel's archived private threads apart from its public ones;
    those the bot joined (``GET /channels/{id}/users/@me/threads/archived/private``) were
    never read: a private thread whose messages came while the service was down, then
    went quiet, went unanswered. One more request per channel; a listing Discord refuses
    logs one WARNING and the channel is read on."""
    clock = fake_clock(service)
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    async with running(service, discord_api) as first:
        await caught_up(first)
    clock.advance(HOUR_MS // 2)
    now = clock.now_ms()
    quiet = discord_api.start_thread(GUILD, CHANNEL, at_ms=now - 20 * 60_000, private=True)
    missed = await message(
        discord_api, "then it went quiet", channel=quiet, at_ms=now - 15 * 60_000
    )
    discord_api.archive_thread(quiet, at_ms=now - 5 * 60_000)
    discord_api.private_reads.clear()
    async with running(service, discord_api) as second:
        await caught_up(second)
    assert await answers(service, missed) == ["Echo: then it went quiet"]
    assert await replied_in(service, missed) == [quiet]
    assert discord_api.private_reads == [CHANNEL]
    discord_api.fail_reads(f"private:{CHANNEL}", "forbidden")
    caplog.set_level(logging.WARNING)
    async with running(service, discord_api) as third:
        await caught_up(third)
    [warning] = [r for r in caplog.records if r.name == "bots.discord"]
    assert "joined private archived threads" in warning.getMessage()


async def test_archived_threads_past_the_bound_say_so(
    service: App,
    discord_api: DiscordApiStandin,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(discord_bots, "CATCH_UP_ARCHIVED", 2)
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    missed: list[str] = []
    for minutes in (30, 20, 10):  # archived that long ago, a quiet hour after its message
        thread = discord_api.start_thread(GUILD, CHANNEL)
        missed.append(await message(discord_api, f"archived {minutes} minutes ago", channel=thread))
        discord_api.archive_thread(thread, at_ms=fake_clock(service).now_ms() - minutes * 60_000)
    caplog.set_level(logging.WARNING)
    async with running(service, discord_api) as up:
        await caught_up(up)
    # The latest archived first.
    assert [await answers(service, m) for m in missed] == [
        [],
        ["Echo: archived 20 minutes ago"],
        ["Echo: archived 10 minutes ago"],
    ]
    [warning] = [r for r in caplog.records if r.name == "bots.discord"]
    assert f"channel {CHANNEL} reads the latest 2 of its archived threads" in warning.getMessage()


async def test_new_threads_past_the_limit_or_that_discord_will_not_list_say_so(
    service: App,
    discord_api: DiscordApiStandin,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(discord_bots, "CATCH_UP_THREADS", 1)
    await routed(service, {"guild": GUILD, "channel": CHANNEL}, {"guild": GUILD})
    first, second = (
        discord_api.start_thread(GUILD, CHANNEL),
        discord_api.start_thread(GUILD, CHANNEL),
    )
    older = await message(discord_api, "in the quieter thread", channel=second)
    newer = await message(discord_api, "in the latest thread", channel=first)
    discord_api.fail_reads(f"guild:{GUILD}", "forbidden")
    caplog.set_level(logging.WARNING)
    async with running(service, discord_api) as refused:
        await caught_up(refused)
    # Discord would not list them: the channel is still read, its threads at the next READY.
    [warning] = [r for r in caplog.records if r.name == "bots.discord"]
    assert f"could not read guild {GUILD}'s active threads" in warning.getMessage()
    assert "Missing Access" in warning.getMessage() and not warning.exc_info
    assert [r["channel_id"] for r in discord_api.reads] == [CHANNEL]
    caplog.clear()
    async with running(service, discord_api) as up:
        await caught_up(up)
    # The thread with the latest message first.
    assert await answers(service, newer) == ["Echo: in the latest thread"]
    assert await answers(service, older) == []
    [warning] = [r for r in caplog.records if r.name == "bots.discord"]
    assert f"channel {CHANNEL} reads the latest 1 of its 2 new threads" in warning.getMessage()


async def test_a_message_both_live_and_in_the_catch_up_is_answered_once(
    service: App, discord_api: DiscordApiStandin
) -> None:
    # A route naming the channel: caught up though no message was taken in there yet.
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    reading, release = asyncio.Event(), asyncio.Event()

    async def held(_record: dict[str, Any]) -> None:
        reading.set()
        await release.wait()

    discord_api.on_read = held
    async with running(service, discord_api) as up:
        await asyncio.wait_for(reading.wait(), 10)
        # Live while the catch-up's read is on its way: the read finds it too.
        both = await message(discord_api, "seen twice")
        await eventually(lambda: answers(up, both), what="the live message answered")
        duplicates = counted("leadgate_turns_total", outcome="duplicate")
        release.set()
        await caught_up(up)
        assert counted("leadgate_turns_total", outcome="duplicate") == duplicates + 1
    assert await answers(service, both) == ["Echo: seen twice"]
    [read] = discord_api.reads
    assert read["mode"] == "ok"


async def test_messages_older_than_the_window_or_the_route_are_not_answered(
    service: App, discord_api: DiscordApiStandin
) -> None:
    clock = fake_clock(service)
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    clock.advance(3 * HOUR_MS)
    now = clock.now_ms()
    # A route made half an hour ago, for the other channel.
    clock.advance(-HOUR_MS // 2)
    beta = await make_org(service, "beta")
    late = await make_agent(service, beta, "late")
    await make_route(
        service, beta, late["id"], "discord", {"guild": GUILD, "channel": OTHER_CHANNEL}
    )
    clock.advance(HOUR_MS // 2)
    # [discord] catch_up_s is an hour by default.
    too_old = await message(discord_api, "two hours ago", at_ms=now - 2 * HOUR_MS)
    recent = await message(discord_api, "ten minutes ago", at_ms=now - 600_000)
    before_route = await message(
        discord_api, "before the route", channel=OTHER_CHANNEL, at_ms=now - 40 * 60_000
    )
    after_route = await message(
        discord_api, "after the route", channel=OTHER_CHANNEL, at_ms=now - 20 * 60_000
    )
    async with running(service, discord_api) as up:
        await caught_up(up)
    assert await answers(service, too_old) == []
    assert await answers(service, recent) == ["Echo: ten minutes ago"]
    assert await answers(service, before_route) == []
    assert await answers(service, after_route) == ["Echo: after the route"]
    assert sorted(r["channel_id"] for r in discord_api.reads) == [CHANNEL, OTHER_CHANNEL]


async def test_a_channel_with_more_to_read_than_the_limit_answers_its_latest_messages(
    service: App,
    discord_api: DiscordApiStandin,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Past the limit the oldest are dropped: the read was oldest first and dropped the
    newest "for the next READY", which starts from the newest taken in (a live message
    by then): those between were never answered."""
    monkeypatch.setattr(discord_bots, "CATCH_UP_PAGES", 1)  # 100 messages a READY
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    fake_clock(service).advance(HOUR_MS)  # the route made an hour ago
    now = fake_clock(service).now_ms()
    oldest = await message(discord_api, "the oldest", at_ms=now - 30 * 60_000)
    for n in range(100):
        await message(discord_api, f"another bot's {n}", author_bot=True, at_ms=now - 20 * 60_000)
    newest = await message(discord_api, "the newest", at_ms=now - 10 * 60_000)
    caplog.set_level(logging.WARNING)
    async with running(service, discord_api) as up:
        await caught_up(up)
    assert await answers(service, newest) == ["Echo: the newest"]
    assert await answers(service, oldest) == []
    [warning] = [r for r in caplog.records if "catch-up of channel" in r.getMessage()]
    assert "latest 100 messages only" in warning.getMessage()


async def test_a_read_discord_refuses_is_logged_and_tried_again_at_the_next_ready(
    service: App, discord_api: DiscordApiStandin, caplog: pytest.LogCaptureFixture
) -> None:
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    missed = await message(discord_api, "said while down")
    # The bot may not read the channel's history (Read Message History not granted).
    discord_api.fail_reads(CHANNEL, "forbidden")
    caplog.set_level(logging.WARNING)
    async with running(service, discord_api) as up:
        await caught_up(up)
        assert await answers(up, missed) == []
        [warning] = [r for r in caplog.records if "catch up" in r.getMessage()]
        assert warning.levelno == logging.WARNING and not warning.exc_info
        assert CHANNEL in warning.getMessage() and "403 Missing Access" in warning.getMessage()
        assert "next READY" in warning.getMessage()
        # A reconnect that cannot resume (a new session, a new READY): tried again.
        first = adapter_of(up).catching_up
        await discord_api.invalidate_sessions()
        await caught_up(up, not_this=first)
    assert await answers(service, missed) == ["Echo: said while down"]
    assert len(discord_api.identifies) == 2
    assert [r["mode"] for r in discord_api.reads] == ["forbidden", "ok"]


@pytest.mark.parametrize("read_before", [True, False], ids=["read through before", "never read"])
async def test_messages_missed_before_a_failed_read_are_answered_after_a_live_message_there(
    service: App, discord_api: DiscordApiStandin, read_before: bool
) -> None:
    """A catch-up whose read of a channel failed, then a live message taken in there: the
    next READY read from that live message (the newest taken in there), and the messages
    missed before it were never answered. It reads from the channel's read point: where
    the last catch-up that read it through started (or, never read through, where its
    first catch-up started)."""
    clock = fake_clock(service)
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    if read_before:
        async with running(service, discord_api) as earlier:
            await caught_up(earlier)
    clock.advance(HOUR_MS // 2)
    now = clock.now_ms()
    missed = await message(discord_api, "said while down", at_ms=now - 10 * 60_000)
    discord_api.fail_reads(CHANNEL, "forbidden")
    async with running(service, discord_api) as up:
        await caught_up(up)
        live = await message(discord_api, "said once it was up", at_ms=now)
        await eventually(lambda: answers(up, live), what="the live message answered")
        failed = adapter_of(up).catching_up
        await discord_api.invalidate_sessions()  # a reconnect that cannot resume: READY
        await caught_up(up, not_this=failed)
    assert await answers(service, missed) == ["Echo: said while down"]
    assert await answers(service, live) == ["Echo: said once it was up"]
    assert await taken_in(service) == [f"discord:message:{m}" for m in (live, missed)]
    assert [r["mode"] for r in discord_api.reads] == ["ok"] * read_before + ["forbidden", "ok"]


async def test_a_ready_reads_a_channel_from_the_newest_message_taken_in_since_its_read_through(
    service: App, discord_api: DiscordApiStandin
) -> None:
    """As Slack's: a channel read through at one READY, then live messages taken in
    there: the next READY read it from that catch-up's start, the whole window again at
    every READY once the gateway stayed up longer than it. It reads from the newest
    taken in, less the overlap, and a message missed after it is still answered."""
    clock = fake_clock(service)
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    async with running(service, discord_api) as earlier:
        await caught_up(earlier)
        clock.advance(2 * HOUR_MS)
        first = await message(discord_api, "said while up", at_ms=clock.now_ms())
        clock.advance(HOUR_MS // 2)
        live = await message(discord_api, "said while up, later", at_ms=clock.now_ms())

        async def both_answered() -> bool:
            return bool(await answers(earlier, first) and await answers(earlier, live))

        await eventually(both_answered, what="the live messages answered")
    clock.advance(10 * 60_000)
    missed = await message(discord_api, "said while down", at_ms=clock.now_ms())
    duplicates = counted("leadgate_turns_total", outcome="duplicate")
    async with running(service, discord_api) as up:
        await caught_up(up)
    assert await answers(service, missed) == ["Echo: said while down"]
    assert await answers(service, first) == ["Echo: said while up"]
    assert await answers(service, live) == ["Echo: said while up, later"]
    # Read again: the latest live message alone (the overlap), a duplicate; the earlier
    # one, within the window but before it, was not read again.
    assert counted("leadgate_turns_total", outcome="duplicate") == duplicates + 1


async def test_a_new_channel_s_retry_after_a_database_fault_reads_what_its_first_try_would(
    service: App, discord_api: DiscordApiStandin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A channel without a read point yet (first taken in after the last catch-up
    started) whose catch-up met the database away before storing one: by the retry a
    live message taken in there was its newest, and the retry read from that one (less a
    minute), so the message missed before it was never answered. A retry reads such a
    channel from the window's start."""
    monkeypatch.setattr(bots_base, "CATCH_UP_RETRY_FIRST_S", 0.01)
    await routed(service, {"guild": GUILD})
    fake_clock(service).advance(HOUR_MS)  # the route made an hour ago
    now = fake_clock(service).now_ms()
    async with running(service, discord_api) as first:
        await caught_up(first)
        opened = await message(discord_api, "hello", at_ms=now - 30 * 60_000)
        await eventually(lambda: answers(first, opened), what="the live message answered")
    missed = await message(discord_api, "said while down", at_ms=now - 10 * 60_000)
    live_in = asyncio.Event()
    real_read = Database.read
    reads: list[int] = []

    @contextlib.asynccontextmanager
    async def once_live_in(db: Database) -> AsyncIterator[Conn]:
        await live_in.wait()
        async with real_read(db) as conn:
            yield conn

    def read(db: Database) -> AbstractAsyncContextManager[Conn]:
        task = asyncio.current_task()
        if task is None or task.get_name() != "discord-catch-up":
            return real_read(db)
        reads.append(1)
        if len(reads) == 1:  # the first try: the database away
            return cast(
                AbstractAsyncContextManager[Conn],
                DownFor(lambda: real_read(db), 1, after_commit=False)(),
            )
        return once_live_in(db)  # the retry, once a live message was taken in

    monkeypatch.setattr(Database, "read", read)
    async with running(service, discord_api) as up:
        await eventually(lambda: reads, what="the first try (after READY)")
        live = await message(discord_api, "said once it was up", at_ms=now)
        await eventually(lambda: answers(up, live), what="the live message answered")
        live_in.set()
        await caught_up(up)
    assert await answers(service, missed) == ["Echo: said while down"]
    assert await answers(service, live) == ["Echo: said once it was up"]


async def test_a_read_point_is_never_moved_back(service: App) -> None:
    """Two replicas' catch-ups store where the next starts in either order: the later
    point stays (the other read further), and a new channel's is added."""
    core = service.messages
    await core.advance_read_points(BindingKind.discord, {CHANNEL: 2_000})
    await core.advance_read_points(BindingKind.discord, {CHANNEL: 1_000, OTHER_CHANNEL: 500})
    await core.advance_read_points(BindingKind.slack, {f"T1:{CHANNEL}": 100})
    known = await core.conversations(BindingKind.discord, key_prefix="discord:", window_ms=0)
    assert known.points == {CHANNEL: 2_000, OTHER_CHANNEL: 500}
    await core.advance_read_points(BindingKind.discord, {CHANNEL: 3_000})
    known = await core.conversations(BindingKind.discord, key_prefix="discord:", window_ms=0)
    assert known.points == {CHANNEL: 3_000, OTHER_CHANNEL: 500}
    assert known.read_at_ms == fake_clock(service).now_ms()


async def test_a_read_point_is_marked_read_through_until_a_catch_up_starts_reading_it(
    service: App,
) -> None:
    """A read-through marks its point (the next catch-up may start from the newest
    message taken in since); a catch-up starting to read the channel unmarks it whatever
    the point (it may fail); a read-through behind a later point leaves that one's mark."""
    core = service.messages

    async def marked() -> tuple[dict[str, int], frozenset[str]]:
        known = await core.conversations(BindingKind.discord, key_prefix="discord:", window_ms=0)
        return dict(known.points), known.read_through

    await core.advance_read_points(BindingKind.discord, {CHANNEL: 2_000}, read_through=True)
    assert await marked() == ({CHANNEL: 2_000}, frozenset({CHANNEL}))
    await core.advance_read_points(BindingKind.discord, {CHANNEL: 1_000})
    assert await marked() == ({CHANNEL: 2_000}, frozenset())
    await core.advance_read_points(BindingKind.discord, {CHANNEL: 2_000}, read_through=True)
    assert await marked() == ({CHANNEL: 2_000}, frozenset({CHANNEL}))
    await core.advance_read_points(BindingKind.discord, {CHANNEL: 5_000})
    await core.advance_read_points(BindingKind.discord, {CHANNEL: 4_000}, read_through=True)
    assert await marked() == ({CHANNEL: 5_000}, frozenset())


async def test_a_kept_messages_point_moves_a_point_not_read_through_back_never_forward(
    service: App,
) -> None:
    """A live message kept for the read-back: its point replaces a read-through one
    later or not (unmarked: the next read-back starts from it), and a later kept
    message's leaves an unread one where it is (it moved it forward, past the earlier
    message); an earlier kept message's moves it back. A read-through marks it again."""
    core = service.messages

    async def marked() -> tuple[dict[str, int], frozenset[str]]:
        known = await core.conversations(BindingKind.discord, key_prefix="discord:", window_ms=0)
        return dict(known.points), known.read_through

    await core.advance_read_points(BindingKind.discord, {CHANNEL: 2_000}, read_through=True)
    await core.advance_read_points(BindingKind.discord, {CHANNEL: 3_000}, kept=True)
    assert await marked() == ({CHANNEL: 3_000}, frozenset())
    await core.advance_read_points(BindingKind.discord, {CHANNEL: 9_000}, kept=True)
    assert await marked() == ({CHANNEL: 3_000}, frozenset())
    await core.advance_read_points(BindingKind.discord, {CHANNEL: 2_500}, kept=True)
    assert await marked() == ({CHANNEL: 2_500}, frozenset())
    await core.advance_read_points(BindingKind.discord, {CHANNEL: 4_000}, read_through=True)
    await core.advance_read_points(BindingKind.discord, {CHANNEL: 1_000}, kept=True)
    assert await marked() == ({CHANNEL: 4_000}, frozenset())


async def test_a_channel_deleted_since_is_passed_over_without_a_warning_at_each_ready(
    service: App, discord_api: DiscordApiStandin, caplog: pytest.LogCaptureFixture
) -> None:
    """Its sessions stay: every READY reads it again, and a WARNING each time said
    nothing anyone could act on. One a route names still warns."""
    await routed(service, {"guild": GUILD}, {"guild": GUILD, "channel": OTHER_CHANNEL})
    async with running(service, discord_api) as first:
        await caught_up(first)
        gone = await message(discord_api, "in a thread deleted since")
        await eventually(lambda: answers(first, gone), what="the live message answered")
    discord_api.fail_reads(CHANNEL, "not_found")
    discord_api.fail_reads(OTHER_CHANNEL, "not_found")
    caplog.set_level(logging.INFO)
    async with running(service, discord_api) as up:
        await caught_up(up)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "bots.discord"]
    assert (logging.INFO, f"discord: channel {CHANNEL} is gone; not caught up") in lines
    [warning] = [m for level, m in lines if level >= logging.WARNING]
    assert OTHER_CHANNEL in warning and "404 Unknown Channel" in warning


async def test_a_route_naming_a_channel_alone_learns_its_guild_for_the_live_session(
    service: App, discord_api: DiscordApiStandin
) -> None:
    await routed(service, {"channel": CHANNEL})
    missed = await message(discord_api, "said while down")
    async with running(service, discord_api) as up:
        await caught_up(up)
    assert await answers(service, missed) == ["Echo: said while down"]
    async with service.db.read() as conn:
        keys = (await conn.execute(sa.select(t.sessions.c.key))).scalars().all()
    # The session a live message of the channel opens (its guild from the message).
    assert keys == [f"discord:{GUILD}:{CHANNEL}"]


async def test_two_replicas_answer_a_live_and_a_missed_message_once(
    service: App, discord_api: DiscordApiStandin
) -> None:
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    missed = await message(discord_api, "said while both were down")
    duplicates = counted("leadgate_turns_total", outcome="duplicate")
    async with running(service, discord_api) as one, running(service, discord_api) as two:
        # Each replica has its own gateway session, and Discord delivers to each.
        await caught_up(one)
        await caught_up(two)
        assert len(discord_api.identifies) == 2 and len(discord_api.reads) == 2
        live = await message(discord_api, "said to both")
        # Each message taken in by both: once, and once a duplicate (the same process
        # counts for both replicas).
        await eventually(
            lambda: counted("leadgate_turns_total", outcome="duplicate") == duplicates + 2,
            what="the second intake of each message found a duplicate",
        )
        await caught_up(one)
        await caught_up(two)
    assert await answers(service, missed) == ["Echo: said while both were down"]
    assert await answers(service, live) == ["Echo: said to both"]


async def notice_to(discord_api: DiscordApiStandin, message_id: str) -> str:
    """The text of the one reply the bot posted to ``message_id`` (waited for)."""

    def replies() -> list[str]:
        return [
            str(p["content"])
            for p in discord_api.posts
            if p.get("op") == "create_message"
            and str((p.get("message_reference") or {}).get("message_id")) == message_id
        ]

    await eventually(replies, what=f"a reply to {message_id}")
    [said] = replies()
    return said


async def test_a_message_the_bot_already_replied_to_is_not_answered_by_the_catch_up(
    service: App, discord_api: DiscordApiStandin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message the live path could not take in (the database down) was told so, in a
    reply to it, and its author sent it again: the catch-up at the next READY read it
    back and answered it as well (answered twice). Nor is a message answered again
    whose answer was posted but whose intake record is gone."""
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    async with running(service, discord_api) as first:
        await caught_up(first)
        answered = await message(discord_api, "answered")
        await eventually(lambda: answers(first, answered), what="the live message answered")
        # The database is down for the next intake's transaction.
        monkeypatch.setattr(first.db, "tx", DownFor(first.db.tx, 1, after_commit=False))
        refused = await message(discord_api, "said while the database was down")
        assert (await notice_to(discord_api, refused)).startswith(NOT_TAKEN_IN)
        # Back: the person sends it again, as told.
        again = await message(discord_api, "said while the database was down")
        await eventually(lambda: answers(first, again), what="the resend answered")
        await drain(first.relay)  # the answers posted, replies to their messages
        assert await notice_to(discord_api, answered) == "Echo: answered"
    # The answered message's intake record is gone (a restore of an older backup, say).
    async with service.db.tx() as conn:
        await conn.execute(
            t.inbound_events.delete().where(
                t.inbound_events.c.external_event_id == f"discord:message:{answered}"
            )
        )
    async with running(service, discord_api) as second:
        await caught_up(second)
    [read] = discord_api.reads[1:]
    assert read["mode"] == "ok"
    assert await answers(service, refused) == []
    assert await answers(service, answered) == ["Echo: answered"]
    assert await answers(service, again) == ["Echo: said while the database was down"]
    assert await taken_in(service) == [f"discord:message:{again}"]


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_message_told_it_may_or_may_not_have_been_taken_in_is_answered_once(
    service: App,
    discord_api: DiscordApiStandin,
    monkeypatch: pytest.MonkeyPatch,
    commit_lands_later: Callable[[Database], CommitLandsLater],
) -> None:
    """PostgreSQL: a live message whose intake lost its COMMIT's answer, and whose
    read-back failed too (``intake.in_doubt``), was told its answer comes once the
    service is back; the COMMIT never landed. The catch-up at the next READY answers
    it, once, though the bot replied to it (only that notice)."""
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    async with running(service, discord_api) as first:
        await caught_up(first)
        opened = await message(discord_api, "hello")  # (its session exists from now on)
        await eventually(lambda: answers(first, opened), what="the live message answered")
        late = commit_lands_later(first.db)
        monkeypatch.setattr(first.db, "read", DownFor(first.db.read, 1, after_commit=False))
        doubted = await message(discord_api, "said as the database went away")
        assert (await notice_to(discord_api, doubted)).startswith(IN_DOUBT)
        await late.abandon()  # it never landed
    assert await answers(service, doubted) == []
    async with running(service, discord_api) as second:
        await caught_up(second)
    assert await answers(service, doubted) == ["Echo: said as the database went away"]
    assert await taken_in(service) == [f"discord:message:{m}" for m in (opened, doubted)]


async def test_a_database_fault_during_the_catch_up_tells_nobody_and_is_tried_again(
    service: App, discord_api: DiscordApiStandin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missed message the catch-up cannot take in (the database away at its intake)
    is not told "could not be taken in, send it again" (the catch-up took each message
    in as a live one, and told every old message's author so, reading on), and the
    catch-up is tried again shortly, not at the next READY: answered once."""
    monkeypatch.setattr(bots_base, "CATCH_UP_RETRY_FIRST_S", 0.01)
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    async with running(service, discord_api) as first:
        await caught_up(first)
        opened = await message(discord_api, "hello")  # (its session exists from now on)
        await eventually(lambda: answers(first, opened), what="the live message answered")
    missed = await message(discord_api, "said while down")
    also = await message(discord_api, "also said while down")
    up: list[App] = []

    async def down_once(_record: dict[str, Any]) -> None:
        # The database away for the catch-up's first intake (the process is up by the
        # time its READY's read comes back).
        discord_api.on_read = None
        await eventually(lambda: up, what="the second process up")
        monkeypatch.setattr(up[0].db, "tx", DownFor(up[0].db.tx, 1, after_commit=False))

    discord_api.on_read = down_once
    async with running(service, discord_api) as second:
        up.append(second)
        await caught_up(second)
    notices = [
        p
        for p in discord_api.posts
        if str((p.get("message_reference") or {}).get("message_id")) in (missed, also)
    ]
    assert notices == []
    assert len(discord_api.reads) == 3  # the first process's READY, the fault's and the retry's
    assert await answers(service, missed) == ["Echo: said while down"]
    assert await answers(service, also) == ["Echo: also said while down"]
