"""Discord inbound: the interactions endpoint and the gateway, against the stand-in."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import discord.gateway
import discord.http
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from nacl.signing import SigningKey

from bots import base as bots_base
from bots import discord as discord_bot
from leadgate.core.config import DiscordSettings, Settings
from leadgate.core.errors import DatabaseDamaged, ModelError, Unavailable, ValidationError
from leadgate.core.limits import validate_message
from leadgate.core.types import (
    BindingKind,
    Busy,
    Conversations,
    Duplicate,
    Gated,
    Inbound,
    Outcome,
    Recorded,
    Reply,
    Routed,
    RouteMatch,
    Trigger,
)
from tests.fakes import FakeCore, mount_adapter
from tests.standins.discord_api import DiscordApiStandin, interaction_headers

GUILD = "800000000000000001"
CHANNEL = "800000000000000002"
ROUTE = RouteMatch(route_id="r1", org_id="o1", agent_id="a1", silent=False)


@pytest.fixture(autouse=True)
def restore_discord_globals() -> Any:
    # create() sets discord.py's process-wide endpoints; put them back for other tests.
    base = discord.http.Route.BASE
    gateway = discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY
    yield
    discord.http.Route.BASE = base
    discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = gateway


@pytest.fixture
def key() -> SigningKey:
    return SigningKey.generate()


@pytest.fixture
def core() -> FakeCore:
    return FakeCore(routes=[({"guild": GUILD}, ROUTE)])


async def serve(
    settings: Settings, core: FakeCore, sleeps: list[float] | None = None
) -> TestServer:
    """The adapter as :func:`bots.discord.create` makes it, its waits recorded in
    ``sleeps`` and instant (never a real second)."""
    assert discord_bot.create(settings, core) is not None  # (it points discord.py here)
    waits = sleeps if sleeps is not None else []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    adapter = discord_bot.DiscordAdapter(settings, core, sleep=sleep)
    app = web.Application()
    mount_adapter(app, adapter)
    srv = TestServer(app, host="127.0.0.1")
    await srv.start_server()
    return srv


@pytest.fixture
def sleeps() -> list[float]:
    """The adapter's waits (instant) of the ``server`` fixture."""
    return []


@pytest.fixture
async def server(
    key: SigningKey, core: FakeCore, discord_api: DiscordApiStandin, sleeps: list[float]
) -> AsyncIterator[TestServer]:
    settings = Settings(
        discord=DiscordSettings(
            public_key=key.verify_key.encode().hex(), api_url=discord_api.api_url
        )
    )
    srv = await serve(settings, core, sleeps)
    yield srv
    await srv.close()


def ask_payload(
    text: str = "what now?",
    *,
    interaction_id: str = "900000000000000001",
    token: str = "itoken-1",
    guild: str | None = GUILD,
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "id": interaction_id,
        "application_id": "1100000000000000001",
        "type": 2,
        "token": token,
        "version": 1,
        "channel_id": CHANNEL,
        "data": {
            "id": "700000000000000001",
            "name": "ask",
            "type": 1,
            "options": [{"name": "message", "type": 3, "value": text}],
        },
    }
    if guild:
        payload["guild_id"] = guild
    return payload


async def post(
    srv: TestServer,
    payload: dict[str, Any],
    key: SigningKey,
    *,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    body = json.dumps(payload).encode()
    sent_headers = interaction_headers(key, body) if headers is None else headers
    async with aiohttp.ClientSession() as session:
        async with session.post(
            srv.make_url("/discord/interactions"), data=body, headers=sent_headers
        ) as r:
            text = await r.text()
            return r.status, (json.loads(text) if text else None)


def test_off_without_key_and_token() -> None:
    assert discord_bot.create(Settings(), FakeCore()) is None


async def test_ping(server: TestServer, key: SigningKey) -> None:
    assert await post(server, {"type": 1, "id": "1", "application_id": "2"}, key) == (
        200,
        {"type": 1},
    )


async def test_bad_or_missing_signature_is_401(
    server: TestServer, key: SigningKey, core: FakeCore
) -> None:
    other = SigningKey.generate()
    status, _ = await post(server, ask_payload(), other)
    assert status == 401
    status, _ = await post(server, ask_payload(), key, headers={"Content-Type": "application/json"})
    assert status == 401
    body = json.dumps(ask_payload()).encode()
    headers = interaction_headers(key, body)
    headers["X-Signature-Timestamp"] = str(int(headers["X-Signature-Timestamp"]) + 1)
    async with aiohttp.ClientSession() as session:
        async with session.post(
            server.make_url("/discord/interactions"), data=body, headers=headers
        ) as r:
            assert r.status == 401
    assert core.tasks == [] and core.triggers == []


async def test_refusals_name_their_rule(
    server: TestServer, key: SigningKey, core: FakeCore, discord_api: DiscordApiStandin
) -> None:
    """A forged or stale interaction and a signed one of a kind nobody answers are 4xx
    in the error envelope naming the rule (it was ``{"error": "..."}``, with no rule)."""
    status, body = await post(server, {"type": 1}, SigningKey.generate())
    assert status == 401
    assert body["error"]["rule"] == "discord.signature"
    assert "signature" in body["error"]["message"]
    # Autocomplete (4), a component that is no review card's (3), a type Discord may add.
    for payload in (
        {"type": 4, "data": {"name": "ask"}},
        {"type": 3, "data": {"custom_id": "someone-else:1"}},
        {"type": 99},
        {"type": "2"},
    ):
        status, body = await post(server, payload, key)
        assert status == 400, payload
        assert body["error"]["rule"] == "discord.interaction", payload
    assert core.tasks == [] and discord_api.posts == []


async def test_a_rule_breaking_ask_is_told_why_naming_the_rule(
    server: TestServer, key: SigningKey, core: FakeCore
) -> None:
    """An /ask whose text breaks a message rule is answered at once, ephemeral, with why
    and the rule (it said why alone), the way the core refuses it."""

    async def refusing(inbound: Inbound, *, notice: bool = True) -> Recorded | None:
        try:
            validate_message(inbound.text)
        except ValidationError as exc:
            return Recorded(ROUTE, rejected=exc)
        raise AssertionError("the text breaks no rule")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(core, "record_inbound", refusing)
        status, body = await post(server, ask_payload("a\x00b"), key)
    assert status == 200
    assert body["data"]["content"] == (
        "Your message was not processed: the message contains a NUL character [message.invalid]."
    )


async def test_ask_is_deferred_at_once_and_runs_the_turn(
    server: TestServer, key: SigningKey, core: FakeCore, discord_api: DiscordApiStandin
) -> None:
    core.submit_delay_s = 1.0
    started = time.monotonic()
    status, body = await post(server, ask_payload("what now?"), key)
    elapsed = time.monotonic() - started
    assert (status, body) == (200, {"type": 5})
    assert elapsed < 0.5
    await core.drain()
    [trigger] = core.triggers
    assert core.lookups == [("discord", {"guild": GUILD, "channel": CHANNEL})]
    assert trigger.org_id == "o1" and trigger.agent_id == "a1"
    assert trigger.text == "what now?"
    assert trigger.session_key == f"discord:{GUILD}:{CHANNEL}"
    assert trigger.external_event_id == "discord:interaction:900000000000000001"
    assert trigger.binding.kind is BindingKind.discord
    assert trigger.binding.address == {
        "channel_id": CHANNEL,
        "application_id": "1100000000000000001",
        "interaction_token": "itoken-1",
        "guild_id": GUILD,
    }
    assert trigger.binding.route_id == "r1" and trigger.binding.silent is False
    # A plain reply is left for the outbox to edit into @original: nothing deleted here.
    assert discord_api.posts == []


@pytest.mark.parametrize(
    "outcome",
    [Gated(work_item_id="w1", revision=0), Busy(work_item_id="w1")],
    ids=["gated", "busy"],
)
async def test_invisible_outcomes_delete_the_deferred_response(
    server: TestServer,
    key: SigningKey,
    core: FakeCore,
    discord_api: DiscordApiStandin,
    sleeps: list[float],
    outcome: Outcome,
) -> None:
    core.outcome = outcome
    status, body = await post(server, ask_payload(), key)
    assert (status, body) == (200, {"type": 5})
    await core.drain()
    assert discord_api.posts == [
        {"op": "delete_original", "application_id": "1100000000000000001", "token": "itoken-1"}
    ]
    # A busy /ask (known while recording) lets the deferred answer reach Discord first,
    # on the adapter's injectable sleep (it waited a real second).
    busy = isinstance(outcome, Busy)
    assert sleeps == ([discord_bot._DEFERRED_SETTLE_S] if busy else [])


@pytest.mark.parametrize("text", ["", " ", "\n\t \u3000"])
async def test_a_reply_of_blanks_deletes_the_deferred_response(
    server: TestServer, key: SigningKey, core: FakeCore, discord_api: DiscordApiStandin, text: str
) -> None:
    """A reply with nothing to show is no post (the outbox skips it): the deferred
    response is deleted as a gated /ask's is, not left "thinking..." for good."""
    core.outcome = Reply(text)
    assert await post(server, ask_payload(), key) == (200, {"type": 5})
    await core.drain()
    assert [p["op"] for p in discord_api.posts] == ["delete_original"]


async def test_a_rejected_ask_keeps_its_ephemeral_answer(
    server: TestServer, key: SigningKey, core: FakeCore, discord_api: DiscordApiStandin
) -> None:
    """A rejected message runs no turn, and its answer (ephemeral, not deferred) is left
    alone: nothing is deleted."""

    async def rejected(inbound: Inbound, *, notice: bool = True) -> Recorded | None:
        return Recorded(ROUTE, rejected=ValidationError("too long", rule="message.too_long"))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(core, "record_inbound", rejected)
        status, body = await post(server, ask_payload(), key)
        await core.drain()
    assert status == 200 and body["data"]["content"].endswith("too long [message.too_long].")
    assert core.tasks == [] and discord_api.posts == []


async def test_an_ask_left_to_recovery_ends_its_deferred_response(
    server: TestServer,
    key: SigningKey,
    core: FakeCore,
    discord_api: DiscordApiStandin,
    sleeps: list[float],
) -> None:
    """An /ask recorded while this process runs too many turns is left to the recovery
    runner, whose outcome the adapter never sees (a gated one left "thinking..." for
    good): its deferred response is deleted, as a gated /ask's, once Discord has it."""

    async def left_to_recovery(recorded: Recorded) -> Routed | None:
        return None

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(core, "run_recorded", left_to_recovery)
        assert await post(server, ask_payload(), key) == (200, {"type": 5})
        await core.drain()
    assert [p["op"] for p in discord_api.posts] == ["delete_original"]
    assert sleeps == [discord_bot._DEFERRED_SETTLE_S]


async def test_the_interaction_names_its_application_not_the_setting(
    key: SigningKey, core: FakeCore, discord_api: DiscordApiStandin
) -> None:
    """``[discord] application_id`` is not read: a verified interaction is answered at
    the application it names (the one its token was issued with), whatever the setting
    holds (here another id, as a bot's user id would be)."""
    settings = Settings(
        discord=DiscordSettings(
            public_key=key.verify_key.encode().hex(),
            application_id="1199999999999999999",
            api_url=discord_api.api_url,
        )
    )
    srv = await serve(settings, core)
    try:
        core.outcome = Gated(work_item_id="w1", revision=0)
        assert await post(srv, ask_payload(), key) == (200, {"type": 5})
        await core.drain()
    finally:
        await srv.close()
    [trigger] = core.triggers
    assert trigger.binding.address["application_id"] == "1100000000000000001"
    assert discord_api.posts == [
        {"op": "delete_original", "application_id": "1100000000000000001", "token": "itoken-1"}
    ]


async def test_a_duplicate_never_touches_the_earlier_reply(
    server: TestServer, key: SigningKey, core: FakeCore, discord_api: DiscordApiStandin
) -> None:
    # A replayed interaction (same id) is a duplicate: the reply the first one got (the
    # same interaction token) must stay, so nothing is deleted or edited.
    core.outcome = Duplicate()
    status, _ = await post(server, ask_payload(), key)
    assert status == 200
    await core.drain()
    assert discord_api.posts == []


async def test_silent_route_deletes_the_deferred_response(
    server: TestServer, key: SigningKey, core: FakeCore, discord_api: DiscordApiStandin
) -> None:
    core.routes = [({"channel": CHANNEL}, RouteMatch("r2", "o1", "a1", silent=True))]
    await post(server, ask_payload(), key)
    await core.drain()
    assert core.triggers[0].binding.silent is True
    assert [p["op"] for p in discord_api.posts] == ["delete_original"]


async def test_a_failed_turn_on_a_silent_route_deletes_the_deferred_response(
    server: TestServer, key: SigningKey, core: FakeCore, discord_api: DiscordApiStandin
) -> None:
    """A failed turn's notice fills the deferred response, but a silent route posts
    none: the deferred response is deleted (it stayed "thinking..." until Discord said
    the application did not respond). On a route that answers it is left for the
    notice."""

    async def failing(trigger: Trigger) -> Outcome:
        raise ModelError("the model failed", rule="model.error")

    for silent, token in ((True, "itoken-silent"), (False, "itoken-loud")):
        core.routes = [({"channel": CHANNEL}, RouteMatch("r2", "o1", "a1", silent=silent))]
        core.tasks.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(core, "submit", failing)
            payload = ask_payload(token=token, interaction_id=f"9000000000000000{int(silent)}")
            assert await post(server, payload, key) == (200, {"type": 5})
            with pytest.raises(ModelError):
                await core.drain()
    assert [(p["op"], p["token"]) for p in discord_api.posts] == [
        ("delete_original", "itoken-silent")
    ]


@pytest.mark.parametrize(
    "fault",
    [
        Unavailable("the database is unavailable", rule="service.unavailable"),
        DatabaseDamaged("the database file is malformed"),
    ],
    ids=["unavailable", "damaged"],
)
async def test_a_turn_stopped_on_a_database_fault_ends_the_deferred_response(
    server: TestServer,
    key: SigningKey,
    core: FakeCore,
    discord_api: DiscordApiStandin,
    sleeps: list[float],
    fault: Exception,
) -> None:
    """A turn that stops on a database fault queues no failure notice and is left to
    the recovery runner, whose outcome (a gated one's: nothing) the adapter never sees:
    its deferred response is ended, as an /ask left to the recovery runner at once, not
    left "thinking..." for good. A reply the recovered turn gives later follows up."""

    async def faulting(trigger: Trigger) -> Outcome:
        raise fault

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(core, "submit", faulting)
        assert await post(server, ask_payload(), key) == (200, {"type": 5})
        with pytest.raises(type(fault)):
            await core.drain()
    assert discord_api.posts == [
        {"op": "delete_original", "application_id": "1100000000000000001", "token": "itoken-1"}
    ]
    assert sleeps == [discord_bot._DEFERRED_SETTLE_S]


async def test_no_route_runs_no_turn_and_leaves_nothing(
    server: TestServer, key: SigningKey, core: FakeCore, discord_api: DiscordApiStandin
) -> None:
    core.routes = []
    status, body = await post(server, ask_payload(), key)
    # Known before the answer (the route lookup is part of recording): said at once, to
    # the asker alone, and nothing is deferred or left to delete.
    assert status == 200
    assert body["type"] == 4 and body["data"]["flags"] == 64
    await core.drain()
    assert core.triggers == []
    assert discord_api.posts == []


async def test_direct_message_uses_at_me(
    server: TestServer, key: SigningKey, core: FakeCore
) -> None:
    core.routes = [({}, ROUTE)]
    await post(server, ask_payload(guild=None), key)
    await core.drain()
    assert core.lookups == [("discord", {"guild": "@me", "channel": CHANNEL})]
    assert core.triggers[0].session_key == f"discord:@me:{CHANNEL}"


async def test_other_commands_run_nothing(
    server: TestServer, key: SigningKey, core: FakeCore
) -> None:
    payload = ask_payload()
    payload["data"]["name"] = "other"
    status, body = await post(server, payload, key)
    assert status == 200 and body["type"] == 4 and body["data"]["flags"] == 64
    payload = ask_payload("   ")
    status, body = await post(server, payload, key)
    assert status == 200 and body["type"] == 4
    assert core.tasks == []


async def test_interactions_route_needs_a_public_key(
    core: FakeCore, discord_api: DiscordApiStandin, key: SigningKey
) -> None:
    settings = Settings(discord=DiscordSettings(bot_token="bot-token", api_url=discord_api.api_url))
    adapter = discord_bot.create(settings, core)
    assert adapter is not None
    app = web.Application()
    mount_adapter(app, adapter)
    assert all(
        r.resource is None or r.resource.canonical != "/discord/interactions"
        for r in app.router.routes()
    )


async def test_gateway_message_becomes_a_trigger(
    core: FakeCore, discord_api: DiscordApiStandin
) -> None:
    settings = Settings(
        discord=DiscordSettings(
            bot_token="bot-token", api_url=discord_api.api_url, gateway_url=discord_api.gateway_url
        )
    )
    srv = await serve(settings, core)
    try:
        await discord_api.wait_gateway_ready(within_s=2.5)
        [identify] = discord_api.identifies
        assert identify["token"] == "bot-token"
        assert identify["intents"] & discord.Intents(message_content=True).value
        # Ignored: other bots and the bot itself.
        await discord_api.dispatch_message_create(
            channel_id=CHANNEL, guild_id=GUILD, content="beep", author_bot=True
        )
        await discord_api.dispatch_message_create(
            channel_id=CHANNEL, guild_id=GUILD, content="me", author_id=discord_api.bot_user_id
        )
        sent = await discord_api.dispatch_message_create(
            channel_id=CHANNEL, guild_id=GUILD, content=f"<@{discord_api.bot_user_id}> hi there"
        )
        async with asyncio.timeout(10):  # "it did not hang" (2 s was near a loaded machine)
            await core.submitted.wait()
        await core.drain()
    finally:
        await srv.close()
    [trigger] = core.triggers
    assert trigger.text == "hi there"
    assert trigger.session_key == f"discord:{GUILD}:{CHANNEL}"
    assert trigger.external_event_id == f"discord:message:{sent['id']}"
    assert trigger.binding.address == {
        "channel_id": CHANNEL,
        "message_id": sent["id"],
        "guild_id": GUILD,
    }
    assert core.lookups == [("discord", {"guild": GUILD, "channel": CHANNEL})]
    # Shutdown closed the gateway connection.
    assert discord_api.identifies and not discord_api._ready_sockets


def test_nonce_is_stable_and_short() -> None:
    assert discord_bot.nonce_for("delivery-1") == discord_bot.nonce_for("delivery-1")
    assert discord_bot.nonce_for("delivery-1") != discord_bot.nonce_for("delivery-2")
    assert len(discord_bot.nonce_for("x" * 500)) == 25


async def test_gateway_start_survives_an_unreachable_discord(core: FakeCore) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = Settings(
        discord=DiscordSettings(
            bot_token="bot-token",
            api_url=f"http://127.0.0.1:{port}/api/v10",
            gateway_url=f"ws://127.0.0.1:{port}/gateway",
        )
    )
    started = time.monotonic()
    srv = await serve(settings, core)
    await asyncio.sleep(0.2)  # the first login attempt fails: refused
    await srv.close()
    assert time.monotonic() - started < 2.0
    assert core.tasks == []


async def test_interaction_timestamps_have_a_freshness_window(
    key: SigningKey, core: FakeCore, discord_api: DiscordApiStandin
) -> None:
    from leadgate.core.clock import FakeClock

    clock = FakeClock()
    settings = Settings(
        discord=DiscordSettings(
            public_key=key.verify_key.encode().hex(), api_url=discord_api.api_url
        )
    )
    adapter = discord_bot.DiscordAdapter(settings, core, clock=clock)
    app = web.Application()
    mount_adapter(app, adapter)
    srv = TestServer(app, host="127.0.0.1")
    await srv.start_server()
    try:
        body = json.dumps({"type": 1}).encode()
        now_s = clock.now_ms() // 1000
        for age, expected in ((0, 200), (299, 200), (-299, 200), (301, 401), (3600, 401)):
            headers = interaction_headers(key, body, timestamp=str(now_s - age))
            status, _ = await post(srv, {"type": 1}, key, headers=headers)
            assert status == expected, (age, status)
        # The same signed body is refused once the clock has moved past the window.
        headers = interaction_headers(key, body, timestamp=str(now_s))
        clock.advance(301_000)
        assert (await post(srv, {"type": 1}, key, headers=headers))[0] == 401
        assert core.recorded == []
    finally:
        await srv.close()


def test_a_catch_up_reads_from_a_channel_s_read_point_and_a_retry_never_from_its_newest() -> None:
    """As Slack's: a channel whose point is not read through starts there; one without,
    from the newest taken in there less a minute, but not on a retry after a database
    fault; one read through, from the later of its point and that newest."""
    since, made, point = 1_780_000_000_000, 1_780_000_900_000, 1_780_000_500_000
    newest = discord_bot.snowflake_at(made)
    known = Conversations(
        since,
        {
            "discord:1:2": (f"discord:message:{newest}",),
            "discord:1:3": (f"discord:message:{newest}",),
            "discord:1:4": (f"discord:message:{newest}",),
        },
        (),
        since + 3_600_000,
        {"2": point, "4": point},
        frozenset({"4"}),
    )
    targets = sorted(discord_bot.catch_up_targets(known), key=lambda t: t.channel_id)
    pointed, fresh, through = targets
    assert (pointed.point, fresh.point, through.point) == (point, None, point)
    assert (pointed.read_through, through.read_through) == (False, True)
    assert pointed.start_point(since) == point
    assert fresh.start_point(since) == made - bots_base.CATCH_UP_OVERLAP_MS
    assert fresh.start_point(made) == made  # never before the window
    assert through.start_point(since) == made - bots_base.CATCH_UP_OVERLAP_MS
    again = sorted(discord_bot.catch_up_targets(known, again=True), key=lambda t: t.channel_id)
    assert [t.newest for t in again] == [None, None, None]
    assert [t.start_point(since) for t in again] == [point, since, point]


def test_a_catch_up_reads_a_channel_kept_by_its_point_alone_within_the_window() -> None:
    """A point not read through of a channel no session or route names (a live message
    kept for the read-back: its thread's parent untold) is read, its guild unknown (learnt
    first); one read through, one older than the window, or a channel known otherwise adds
    nothing more."""
    since = 1_780_000_000_000
    known = Conversations(
        since,
        {"discord:1:2": ()},
        ({"guild": "1", "channel": "3"},),
        since + 3_600_000,
        {
            "2": since,
            "3": since,
            "5": since + 1,
            "6": since,
            "7": since - bots_base.CATCH_UP_OVERLAP_MS - 1,
            "x": since,
        },
        frozenset({"6"}),
    )
    targets = {t.channel_id: t for t in discord_bot.catch_up_targets(known)}
    assert sorted(targets) == [2, 3, 5]
    kept = targets[5]
    assert (kept.guild_id, kept.guild_known, kept.newest, kept.point) == (
        None,
        False,
        None,
        since + 1,
    )
    assert kept.start_point(since) == since + 1


def test_a_message_kept_for_the_read_back_is_read_at_a_ready_in_the_window_s_last_minute() -> None:
    """A live message kept for the read-back stores its channel's point a minute
    (CATCH_UP_OVERLAP_MS) before it: a READY within catch_up_s of the message reads the
    channel, also in the window's last minute (its point then before the window: the
    channel was left out, and the message, promised to the next READY, was lost; with
    catch_up_s of a minute or less, at every READY)."""
    made = 1_780_000_000_000
    kept = made - bots_base.CATCH_UP_OVERLAP_MS
    for since in (made - 1, made):
        known = Conversations(since, {}, (), since + 3_600_000, {"5": kept})
        targets = discord_bot.catch_up_targets(known)
        assert [t.channel_id for t in targets] == [5]
        assert targets[0].start_point(since) == since
    too_old = Conversations(made + 1, {}, (), made + 3_600_000, {"5": kept})
    assert discord_bot.catch_up_targets(too_old) == []
