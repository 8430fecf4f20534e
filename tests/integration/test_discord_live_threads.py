"""A live gateway message in a thread discord.py has not cached: its parent is looked up
(``GET /channels/{id}``), and a route naming the parent answers it. Through the real
discord.py client and the real composition root against the Discord stand-in.

"Answered" is the reply queued in the outbox for that message (no runner runs)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from bots import discord as discord_bots
from bots.discord import GatewayPost
from leadgate.app import App
from leadgate.core.types import Inbound, Recorded
from tests.helpers import eventually, fake_clock
from tests.integration.test_discord_catch_up import (
    CHANNEL,
    GUILD,
    adapter_of,
    answers,
    caught_up,
    message,
    routed,
    running,
    taken_in,
)
from tests.standins.discord_api import DiscordApiStandin


@pytest.fixture(autouse=True)
def instant_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """No 5 s pause before a second IDENTIFY, and the look-up's waits between tries
    pass at once (their length is production's; that they are made is what is tested)."""
    monkeypatch.setattr(discord_bots, "IDENTIFY_PAUSE_S", 0.0)
    monkeypatch.setattr(discord_bots, "THREAD_LOOKUP_RETRY_S", (0.0, 0.0, 0.0))


async def test_a_thread_whose_parent_discord_tells_late_is_answered_by_the_parents_route(
    service: App, discord_api: DiscordApiStandin
) -> None:
    """Discord does not answer the first two look-ups of the thread (a 503): the third
    tells its parent, whose route answers. Before, the first failure
    routed the message as the thread's own channel's, which no route names: nobody
    answered it, and nothing said so."""
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    async with running(service, discord_api) as up:
        await caught_up(up)
        thread = discord_api.start_thread(GUILD, CHANNEL)
        discord_api.fail_lookups(thread, "503", "503")
        said = await message(discord_api, "in a thread", channel=thread)
        await eventually(lambda: answers(up, said), what="the thread's message answered")
    assert await answers(service, said) == ["Echo: in a thread"]
    assert discord_api.lookups == [(thread, "503"), (thread, "503"), (thread, "ok")]


async def test_a_thread_discord_never_tells_about_is_read_back_at_the_next_ready(
    service: App, discord_api: DiscordApiStandin, caplog: pytest.LogCaptureFixture
) -> None:
    """Discord never answers the live look-up, and no route names the thread: a WARNING
    names the message and the thread (never its text), and the message
    is kept for the read-back (a read point for the thread), and the next READY reads the
    thread, learns its parent and answers it by the parent's route, though Discord will
    not list the guild's active threads at that READY. Before, only such a listing could
    find the thread (or none: past 20 threads of the channel, a listing refused): the
    message was lost, a WARNING its only trace."""
    caplog.set_level(logging.WARNING)
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    async with running(service, discord_api) as up:
        await caught_up(up)
        thread = discord_api.start_thread(GUILD, CHANNEL)
        discord_api.fail_lookups(thread, *["503"] * (len(discord_bots.THREAD_LOOKUP_RETRY_S) + 1))
        said = await message(discord_api, "in a thread", channel=thread)

        def kept() -> list[str]:
            return [
                r.getMessage()
                for r in caplog.records
                if r.name == "bots.discord" and "was not taken in" in r.getMessage()
            ]

        await eventually(kept, what="the WARNING that the message was not taken in yet")
        assert f"discord:message:{said}" not in await taken_in(up)
        [line] = kept()
        assert said in line and "the next READY's read-back reads it" in line
        assert thread in line and "in a thread" not in line  # (ids, never the text)
        discord_api.fail_reads(f"guild:{GUILD}", "forbidden")
        first = adapter_of(up).catching_up
        await discord_api.invalidate_sessions()  # a reconnect that cannot resume: READY
        await caught_up(up, not_this=first)
    assert await answers(service, said) == ["Echo: in a thread"]
    assert discord_api.lookups == [(thread, "503")] * 4 + [(thread, "ok")]


@pytest.mark.parametrize("cached", [False, True], ids=["looked-up", "cached-meanwhile"])
async def test_a_second_message_waits_for_the_threads_look_up_under_way(
    service: App, discord_api: DiscordApiStandin, cached: bool
) -> None:
    """The thread's first message meets a 503 and waits to ask again; a second one comes
    meanwhile, either looked up too or (``cached``) as a thread discord.py cached in
    between (a GUILD_CREATE with it), which needs no look-up. Before, the second was
    recorded first (its own look-up succeeded, or it needed none): the person's two
    messages reached the session in the wrong order. Now it waits (the look-up is asked
    once, shared; a channel's messages are recorded in the order they came)."""
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    async with running(service, discord_api) as up:
        await caught_up(up)
        adapter = adapter_of(up)
        gate = asyncio.Event()

        async def gated(seconds: float) -> None:
            await gate.wait()

        thread = discord_api.start_thread(GUILD, CHANNEL)
        discord_api.fail_lookups(thread, "503")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(adapter, "_sleep", gated)
            first = await message(discord_api, "first", channel=thread)
            await eventually(lambda: discord_api.lookups == [(thread, "503")], what="the 503")
            if cached:
                await discord_api.dispatch_guild_create(GUILD)
                client = adapter.gateway
                assert client is not None
                await eventually(lambda: client.get_channel(int(thread)), what="the thread cached")
            second = await message(discord_api, "second", channel=thread)
            name = f"discord-record:message:{second}"

            async def received() -> bool:
                # (its task waiting, or on the old code already recorded)
                if any(task.get_name() == name for task in asyncio.all_tasks()):
                    return True
                return f"discord:message:{second}" in await taken_in(up)

            await eventually(received, what="the second message taken from the gateway")
            gate.set()

            async def both() -> bool:
                ids = await taken_in(up)
                return len([i for i in ids if i.endswith((first, second))]) == 2

            await eventually(both, what="both messages recorded")
        mine = [i for i in await taken_in(service) if i.endswith((first, second))]
    assert mine == [f"discord:message:{first}", f"discord:message:{second}"]
    assert discord_api.lookups == [(thread, "503"), (thread, "ok")]


async def test_a_channels_messages_are_recorded_in_the_order_the_gateway_delivered_them(
    service: App, discord_api: DiscordApiStandin
) -> None:
    """The first of two quick messages of a channel is slow to record (held here before
    its intake, as a busy database or a slow look-up holds it); the second waits for it,
    and the person's two messages reach the session in the order they sent them. Before,
    each message's task recorded it as soon as it could: the second was taken in first
    (on PostgreSQL, two intakes begun in order also committed either way round, and the
    order-of-look-ups test failed now and then under load)."""
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    async with running(service, discord_api) as up:
        await caught_up(up)
        adapter = adapter_of(up)
        take_post = adapter._take_post
        gate = asyncio.Event()
        held: list[str] = []

        async def first_held(inbound: Inbound, post: GatewayPost) -> Recorded | None:
            if post.text == "first":
                held.append(str(post.message_id))
                await gate.wait()
            return await take_post(inbound, post)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(adapter, "_take_post", first_held)
            first = await message(discord_api, "first")
            await eventually(lambda: held, what="the first message held")
            second = await message(discord_api, "second")
            name = f"discord-record:message:{second}"

            async def waiting() -> bool:
                # (its task waiting for the first's record; on the old code recorded)
                recorded = f"discord:message:{second}" in await taken_in(up)
                return recorded or any(t.get_name() == name for t in asyncio.all_tasks())

            await eventually(waiting, what="the second message taken from the gateway")
            assert await taken_in(up) == [], "the second message was recorded first"
            gate.set()

            async def both() -> bool:
                return len(await taken_in(up)) == 2

            await eventually(both, what="both messages recorded")
    assert await taken_in(service) == [f"discord:message:{first}", f"discord:message:{second}"]


async def test_the_stop_ends_a_thread_look_up_under_way_and_keeps_its_message(
    service: App,
    discord_api: DiscordApiStandin,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The service stops while a thread's shared look-up waits inside its request
    (discord.py waiting out Discord's 429 before it asks again): the stop cancels it and
    waits for it, and its message, whose channel was never told, is kept for the next
    READY's read-back. Before, the look-up was left running past the service's stop (up
    to THREAD_LOOKUP_S, here longer than the test), a task nobody awaited."""
    monkeypatch.setattr(discord_bots, "THREAD_LOOKUP_S", 3600.0)
    caplog.set_level(logging.WARNING)
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    async with running(service, discord_api) as up:
        await caught_up(up)
        adapter = adapter_of(up)
        thread = discord_api.start_thread(GUILD, CHANNEL)
        discord_api.fail_lookups(thread, "ratelimited:600")
        said = await message(discord_api, "in a thread", channel=thread)
        await eventually(lambda: discord_api.lookups, what="the look-up")
        [lookup] = adapter._looking_up.values()
    assert lookup.done()
    assert discord_api.lookups == [(thread, "ratelimited:600")]
    kept = [r.getMessage() for r in caplog.records if "was not taken in" in r.getMessage()]
    assert len(kept) == 1 and said in kept[0] and "read-back reads it" in kept[0]


def untold_thread(discord_api: DiscordApiStandin, *, messages: int) -> str:
    """A new thread of the routed channel whose live look-ups Discord fails for
    ``messages`` messages in a row (every retry of each): each is kept for the read-back."""
    thread = discord_api.start_thread(GUILD, CHANNEL)
    tries = len(discord_bots.THREAD_LOOKUP_RETRY_S) + 1
    discord_api.fail_lookups(thread, *["503"] * (messages * tries))
    return thread


def kept_count(caplog: pytest.LogCaptureFixture) -> int:
    """How many live messages were kept for the read-back (their WARNINGs)."""
    return sum("was not taken in" in r.getMessage() for r in caplog.records)


async def test_two_messages_kept_for_the_read_back_minutes_apart_are_both_read_back(
    service: App, discord_api: DiscordApiStandin, caplog: pytest.LogCaptureFixture
) -> None:
    """Two live messages of a thread Discord never tells about, made ten minutes apart,
    are both kept for the read-back, and the next READY answers both. The second's read
    point (a minute before it) replaced the first's, a stored point moving only
    forward: the read-back started after the first message, lost though its WARNING
    said the next READY reads it."""
    caplog.set_level(logging.WARNING)
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    async with running(service, discord_api) as up:
        await caught_up(up)
        thread = untold_thread(discord_api, messages=2)
        # (the stand-in makes ids by the wall clock, as Discord does)
        ten_minutes_ago = int(time.time() * 1000) - 600_000

        first = await message(discord_api, "first", channel=thread, at_ms=ten_minutes_ago)
        await eventually(lambda: kept_count(caplog) == 1, what="the first message kept")
        second = await message(discord_api, "second", channel=thread)
        await eventually(lambda: kept_count(caplog) == 2, what="the second message kept")
        discord_api.fail_reads(f"guild:{GUILD}", "forbidden")
        ready = adapter_of(up).catching_up
        await discord_api.invalidate_sessions()  # a reconnect that cannot resume: READY
        await caught_up(up, not_this=ready)
    assert await answers(service, first) == ["Echo: first"]
    assert await answers(service, second) == ["Echo: second"]


async def test_a_message_kept_after_one_kept_past_the_window_is_read_back(
    service: App, discord_api: DiscordApiStandin, caplog: pytest.LogCaptureFixture
) -> None:
    """A thread Discord never tells about had a message kept for the read-back two hours
    ago (past ``catch_up_s``, an hour: no READY came in time, so it is lost, as its
    WARNING's rule says). A second message of the thread kept now is read back at the
    next READY. A kept point left an earlier one not read through where it was, stale
    or not, and the read-back leaves out a channel whose point is past the window: the
    second message was lost too, though its WARNING said the next READY reads it."""
    caplog.set_level(logging.WARNING)
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    async with running(service, discord_api) as up:
        await caught_up(up)
        thread = untold_thread(discord_api, messages=2)
        now = fake_clock(service).now_ms()

        await message(discord_api, "stale", channel=thread, at_ms=now - 2 * 3_600_000)
        await eventually(lambda: kept_count(caplog) == 1, what="the first message kept")
        second = await message(discord_api, "second", channel=thread, at_ms=now)
        await eventually(lambda: kept_count(caplog) == 2, what="the second message kept")
        discord_api.fail_reads(f"guild:{GUILD}", "forbidden")
        ready = adapter_of(up).catching_up
        await discord_api.invalidate_sessions()  # a reconnect that cannot resume: READY
        await caught_up(up, not_this=ready)
    assert await answers(service, second) == ["Echo: second"]


async def test_a_message_kept_after_one_that_leaves_the_window_first_is_read_back(
    service: App, discord_api: DiscordApiStandin, caplog: pytest.LogCaptureFixture
) -> None:
    """Two messages of a thread Discord never tells about, kept for the read-back 50
    minutes apart (``catch_up_s`` an hour): the channel's point stays at the first's.
    A READY 20 minutes after the second is past the first's window, not the second's:
    the second is read back. The read-back took a channel not read through by its
    point alone, the first's, past the window: the second was lost, though its WARNING
    said the next READY reads it."""
    caplog.set_level(logging.WARNING)
    await routed(service, {"guild": GUILD, "channel": CHANNEL})
    clock = fake_clock(service)
    async with running(service, discord_api) as up:
        await caught_up(up)
        thread = untold_thread(discord_api, messages=2)
        now = clock.now_ms()

        await message(discord_api, "first", channel=thread, at_ms=now - 50 * 60_000)
        await eventually(lambda: kept_count(caplog) == 1, what="the first message kept")
        second = await message(discord_api, "second", channel=thread, at_ms=now)
        await eventually(lambda: kept_count(caplog) == 2, what="the second message kept")
        clock.advance(20 * 60_000)
        discord_api.fail_reads(f"guild:{GUILD}", "forbidden")
        ready = adapter_of(up).catching_up
        await discord_api.invalidate_sessions()  # a reconnect that cannot resume: READY
        await caught_up(up, not_this=ready)
    assert await answers(service, second) == ["Echo: second"]
