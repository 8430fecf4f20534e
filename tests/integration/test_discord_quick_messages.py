"""Two quick gateway messages to a plain worker (no lead: no busy state, both turns run),
the first's model answering only after the second was taken in: each message gets its
own reply, posted as a reply to it (SPEC 10). Through the real discord.py client, the
real composition root and its relay against the Discord stand-in.

Before, the first message's reply was stored in the transcript and never posted: its
binding was no longer the session's active one once the second was taken in."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import sqlalchemy as sa

from binding import routes
from leadgate.app import App
from leadgate.core.runners import drain
from leadgate.database import schema as t
from leadgate.turns.providers.base import ModelEvent, ModelRequest, TextDelta
from tests.helpers import eventually, make_agent, make_org, make_route
from tests.integration.test_discord_catch_up import (
    CHANNEL,
    GUILD,
    answers,
    caught_up,
    gateway,
    message,
)
from tests.serving import served_app
from tests.standins.discord_api import DiscordApiStandin


class HoldsFirst:
    """A model answering ``to <message>``; its answer to ``first`` waits for ``release``."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.asked: list[str] = []

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        said = request.messages[-1].content
        self.asked.append(said)
        if said == "first":
            await self.release.wait()
        yield TextDelta(f"to {said}")


async def test_two_quick_messages_each_get_their_own_reply(
    migrated_url: str, discord_api: DiscordApiStandin
) -> None:
    model = HoldsFirst()
    async with served_app(
        migrated_url, config=gateway(discord_api), adapters=True, providers={"hold": model}
    ) as (up, _):
        org = await make_org(up)
        plain = await make_agent(up, org, "plain", model="hold")
        await make_route(up, org, plain["id"], "discord", {"guild": GUILD, "channel": CHANNEL})
        await caught_up(up)
        first = await message(discord_api, "first")
        await eventually(lambda: model.asked == ["first"], what="the first turn at its model")
        second = await message(discord_api, "second")
        await eventually(lambda: answers(up, second), what="the second message answered")
        model.release.set()
        await eventually(lambda: answers(up, first), what="the first message answered")
        assert await answers(up, first) == ["to first"]
        assert await answers(up, second) == ["to second"]
        await drain(up.relay)
    replies = {
        str(post["message_reference"]["message_id"]): post["content"]
        for post in discord_api.posts
        if post["op"] == "create_message"
    }
    assert replies == {first: "to first", second: "to second"}


async def answered(service: App) -> list[str]:
    """The assistant messages stored, whether or not they were posted."""
    async with service.db.read() as conn:
        query = sa.select(t.messages.c.content).where(t.messages.c.role == "assistant")
        return sorted(str(text) for text in (await conn.execute(query)).scalars())


async def test_a_reply_is_not_posted_once_its_conversations_route_was_made_silent(
    migrated_url: str, discord_api: DiscordApiStandin
) -> None:
    """The route is made silent (replaced by a silent one) while the first message's
    model runs; the second message comes through it, its silent binding the session's
    active one. A silent route means nothing is to be posted there: the first's reply,
    on its own binding that was not silent, is stored and not posted either."""
    model = HoldsFirst()
    match = {"guild": GUILD, "channel": CHANNEL}
    async with served_app(
        migrated_url, config=gateway(discord_api), adapters=True, providers={"hold": model}
    ) as (up, _):
        org = await make_org(up)
        plain = await make_agent(up, org, "plain", model="hold")
        loud = await make_route(up, org, plain["id"], "discord", match)
        await caught_up(up)
        await message(discord_api, "first")
        await eventually(lambda: model.asked == ["first"], what="the first turn at its model")
        async with up.db.tx() as conn:
            await routes.disable_route(conn, org.id, loud)
        await make_route(up, org, plain["id"], "discord", match, silent=True)
        await message(discord_api, "second")
        await eventually(lambda: answered(up), what="the second message answered")
        model.release.set()

        async def both() -> bool:
            return await answered(up) == ["to first", "to second"]

        await eventually(both, what="the first message answered")
        await drain(up.relay)
        async with up.db.read() as conn:
            assert (await conn.execute(sa.select(t.deliveries.c.id))).all() == []
    assert [post for post in discord_api.posts if post["op"] == "create_message"] == []
