"""Discord outbound: the real discord.py HTTP client against the REST stand-in."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import discord.http
import pytest
from aiohttp import web
from aiohttp.test_utils import RawTestServer

from bots.discord import DiscordChannel, configure_endpoints, nonce_for
from bots.discord_out import described
from leadgate.core.config import DiscordSettings
from outbox.channel import OutboundMessage, Permanent, Retry, Sent, Uncertain
from tests.helpers import marked_card, ours
from tests.standins.common import PORTAL_SESSION
from tests.standins.discord_api import DiscordApiStandin

TOKEN = "bot-token"
APP = "1100000000000000001"
CHANNEL = "800000000000000002"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def restore_route_base() -> Iterator[None]:
    base = discord.http.Route.BASE
    yield
    discord.http.Route.BASE = base


def gated(key: str = "delivery-1", **address: Any) -> OutboundMessage:
    addr = {"channel_id": CHANNEL, "guild_id": "800000000000000001", **address}
    return OutboundMessage(delivery_id=key, idempotency_key=key, address=addr, text="approved")


def interaction_reply(key: str = "delivery-r", token: str = "itoken") -> OutboundMessage:
    return OutboundMessage(
        delivery_id=key,
        idempotency_key=key,
        address={
            "channel_id": CHANNEL,
            "application_id": APP,
            "interaction_token": token,
            "guild_id": "800000000000000001",
        },
        text="plain reply",
        kind="reply",
    )


#: The most a send with a 0.6 s deadline may take: several times the deadline (a loaded
#: machine's scheduling), far below what the deadline stops (a hang, discord.py's retries).
HANG_BOUND_S = 4.0


def make_channel(
    api_url: str, token: str = TOKEN, timeout_s: float = 0.6, *, checked: bool = True
) -> DiscordChannel:
    # checked=False: settings the load-time check of api_url would refuse, to show
    # that the adapter copes with them all the same.
    if checked:
        st = DiscordSettings(bot_token=token, api_url=api_url)
    else:
        st = DiscordSettings.model_construct(bot_token=token, api_url=api_url)
    configure_endpoints(st)
    return DiscordChannel(st, timeout_s=timeout_s)


@pytest.fixture
async def channel(discord_api: DiscordApiStandin) -> AsyncIterator[DiscordChannel]:
    ch = make_channel(discord_api.api_url)
    yield ch
    await ch.close()


async def test_channel_post_with_nonce_and_reply_reference(
    discord_api: DiscordApiStandin, channel: DiscordChannel
) -> None:
    outcome = await channel.send(gated(message_id="800000000000000077"))
    assert isinstance(outcome, Sent) and outcome.external_id
    [post] = discord_api.posts
    assert post["op"] == "create_message" and post["channel_id"] == CHANNEL
    assert post["content"] == "approved" and post["id"] == outcome.external_id
    assert post["nonce"] == nonce_for("delivery-1") and len(post["nonce"]) <= 25
    assert post["enforce_nonce"] is True
    assert str(post["message_reference"]["message_id"]) == "800000000000000077"
    assert post["message_reference"]["fail_if_not_exists"] is False
    assert channel.name == "discord" and channel.max_chars == 2000


async def test_a_cards_masked_links_reach_discord_showing_where_they_lead(
    discord_api: DiscordApiStandin, channel: DiscordChannel
) -> None:
    """The summary was posted as typed: ``[Approve here](https://elsewhere.example)``
    showed its words only, on the card asking the reviewer to decide. Posted through
    discord.py, every masked link is escaped (its URL in view); the summary keeps its
    bold, and names and "why" are escaped as before."""
    post = dataclasses.replace(gated("delivery-c"), kind="card", card=marked_card())
    assert isinstance(await channel.send(post), Sent)
    [posted] = discord_api.posts
    link = "\\[Approve here](https://elsewhere.example)"
    assert f"**Why:** The lead escalated it: {link}\n" in posted["content"]
    assert f"**Summary**\n**Done.** {link}\n<https://" in posted["content"]
    assert "**Agent:** \\*helper\\*\\_x\\_\n" in posted["content"]


async def test_gating_without_message_id_posts_plainly(
    discord_api: DiscordApiStandin, channel: DiscordChannel
) -> None:
    # Approved output of an /ask interaction: a bot message in the channel.
    message = gated(application_id=APP, interaction_token="itoken")
    assert isinstance(await channel.send(message), Sent)
    [post] = discord_api.posts
    assert post["op"] == "create_message" and post["message_reference"] is None


async def test_duplicate_nonce_posts_once(
    discord_api: DiscordApiStandin, channel: DiscordChannel
) -> None:
    first = await channel.send(gated())
    again = await channel.send(gated())
    assert isinstance(first, Sent) and isinstance(again, Sent)
    assert first.external_id == again.external_id
    assert len(discord_api.requests) == 2 and len(discord_api.posts) == 1


async def test_interaction_reply_edits_the_deferred_original(
    discord_api: DiscordApiStandin, channel: DiscordChannel
) -> None:
    outcome = await channel.send(interaction_reply())
    assert isinstance(outcome, Sent)
    # Retrying the same delivery edits again (idempotent); a next part follows up.
    assert isinstance(await channel.send(interaction_reply()), Sent)
    assert isinstance(await channel.send(interaction_reply("delivery-r2")), Sent)
    assert [(p["op"], p["token"], p["content"]) for p in discord_api.posts] == [
        ("edit_original", "itoken", "plain reply"),
        ("edit_original", "itoken", "plain reply"),
        ("followup", "itoken", "plain reply"),
    ]


async def test_a_later_part_follows_up_after_a_restart(discord_api: DiscordApiStandin) -> None:
    """A reply's second part (key ``<delivery>.1``) sent by a process that did not send
    the first (a restart between the parts, another replica) follows up: it edited
    @original, overwriting the first part, which the asker then never saw."""
    first = make_channel(discord_api.api_url)
    try:
        assert isinstance(await first.send(interaction_reply()), Sent)
    finally:
        await first.close()
    second_part = dataclasses.replace(
        interaction_reply(), idempotency_key="delivery-r.1", text="second part"
    )
    after_restart = make_channel(discord_api.api_url)
    try:
        assert isinstance(await after_restart.send(second_part), Sent)
    finally:
        await after_restart.close()
    assert [(p["op"], p["content"]) for p in discord_api.posts] == [
        ("edit_original", "plain reply"),
        ("followup", "second part"),
    ]


async def test_a_reply_whose_token_expired_is_posted_in_the_channel(
    discord_api: DiscordApiStandin, channel: DiscordChannel
) -> None:
    """An /ask's interaction token lives 15 minutes: a reply sent later (a slow turn,
    retries through an outage) was refused for good (401 Invalid Webhook Token) and
    lost. With a bot token it is posted in the channel instead, with its nonce (a
    retry posts it once); a later part too."""
    discord_api.set_channel_mode("itoken", "expired")
    later_part = dataclasses.replace(interaction_reply(), idempotency_key="delivery-r.1")
    for message in (interaction_reply(), interaction_reply(), later_part):
        assert isinstance(await channel.send(message), Sent)
    assert [r["op"] for r in discord_api.requests] == [
        "edit_original",
        "create_message",
        "edit_original",
        "create_message",
        "followup",
        "create_message",
    ]
    assert [(p["op"], p["channel_id"], p["nonce"]) for p in discord_api.posts] == [
        ("create_message", CHANNEL, nonce_for("delivery-r")),
        ("create_message", CHANNEL, nonce_for("delivery-r.1")),
    ]
    assert discord_api.posts[0]["message_reference"] is None
    # Without a bot token nothing can post it: refused for good, saying why.
    no_bot = make_channel(discord_api.api_url, token="")
    try:
        outcome = await no_bot.send(interaction_reply())
    finally:
        await no_bot.close()
    assert isinstance(outcome, Permanent), outcome
    assert "token has expired" in outcome.error and "15 minutes" in outcome.error


async def test_a_follow_up_answered_5xx_is_sent_once_and_uncertain(
    discord_api: DiscordApiStandin, channel: DiscordChannel
) -> None:
    """A follow-up carries no nonce: one Discord made before its edge answered 502 is
    not sent again (discord.py's webhook call sent it again by itself, and the relay's
    retry after that: posted twice or more). It is ``deliveryUnknown``; a 503 is a
    retry, and the next follow-up goes out as usual."""
    owner = await channel.send(interaction_reply())
    assert isinstance(owner, Sent)
    discord_api.queue("made_502")
    outcome = await channel.send(interaction_reply("delivery-r2"))
    assert isinstance(outcome, Uncertain), outcome
    assert "HTTP 502" in outcome.error and "may have been posted" in outcome.error
    discord_api.queue("503")
    assert isinstance(await channel.send(interaction_reply("delivery-r3")), Retry)
    assert isinstance(await channel.send(interaction_reply("delivery-r4")), Sent)
    assert [r["op"] for r in discord_api.requests] == [
        "edit_original",
        "followup",
        "followup",
        "followup",
    ]
    assert [p["op"] for p in discord_api.posts] == ["edit_original", "followup", "followup"]


async def test_rate_limit_is_retry_with_its_delay(
    discord_api: DiscordApiStandin, channel: DiscordChannel
) -> None:
    discord_api.queue("ratelimited:60")
    outcome = await channel.send(gated())
    assert isinstance(outcome, Retry) and outcome.delay_s == 60.0
    discord_api.queue("ratelimited_novia:5")
    outcome = await channel.send(gated())
    assert isinstance(outcome, Retry) and outcome.delay_s == 5.0
    assert discord_api.posts == []


async def test_a_rate_limit_discord_py_cannot_read_is_a_retry(
    discord_api: DiscordApiStandin, channel: DiscordChannel, caplog: pytest.LogCaptureFixture
) -> None:
    """A 429 with ``Via`` but no ``retry_after`` in its JSON (a proxy on the way that
    limits by itself) makes discord.py fail on a KeyError: nothing was posted, so the
    send is a retry, not ``deliveryUnknown`` (a person asked to check a post that never
    happened) with an ERROR line logged as a bug. A bot's post and an interaction's
    reply alike."""
    discord_api.queue("ratelimited_proxy", "ratelimited_proxy")
    with caplog.at_level(logging.WARNING):
        by_bot = await channel.send(gated())
        reply = await channel.send(interaction_reply())
    for outcome in (by_bot, reply):
        assert isinstance(outcome, Retry), outcome
        assert "HTTP 429" in outcome.error and outcome.delay_s == 5.0
    assert discord_api.posts == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_long_rate_limit_on_a_reply_waits_it_out(
    discord_api: DiscordApiStandin, channel: DiscordChannel
) -> None:
    """discord.py's webhook calls sleep out a 429's ``retry_after`` however long, so a
    reply's send ends at its deadline: a retry that now waits the 429's ``Retry-After``
    (it came back at the relay's backoff, often sooner, to meet the same 429)."""
    discord_api.queue("ratelimited:60")
    outcome = await channel.send(interaction_reply())
    assert isinstance(outcome, Retry), outcome
    assert "HTTP 429" in outcome.error and outcome.delay_s == 60.0
    assert discord_api.posts == []


async def test_short_rate_limit_is_handled_by_discord_py(
    discord_api: DiscordApiStandin, channel: DiscordChannel
) -> None:
    discord_api.queue("ratelimited:0.1", "ok")
    assert isinstance(await channel.send(gated()), Sent)
    assert len(discord_api.posts) == 1


@pytest.mark.parametrize("mode", ["forbidden", "not_found", "unauthorized"])
async def test_permanent_errors(
    discord_api: DiscordApiStandin, channel: DiscordChannel, mode: str
) -> None:
    discord_api.queue(mode)
    outcome = await channel.send(gated())
    assert isinstance(outcome, Permanent), outcome


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("not_found", "the channel was deleted, or the bot cannot see it"),
        ("no_route", "Discord has no such route; check [discord] api_url"),
        ("not_discord", "the server is not Discord's API; check [discord] api_url"),
    ],
)
async def test_a_404_says_whether_the_channel_or_the_api_url_is_wrong(
    discord_api: DiscordApiStandin,
    channel: DiscordChannel,
    mode: str,
    reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Discord's 10003 Unknown Channel is the channel gone; its code-0 404 is a route it
    does not have, and a 404 without Discord's JSON error is a server that is not Discord:
    all three fail for good, each saying which, in the error and the log."""
    discord_api.set_channel_mode(CHANNEL, mode)
    outcome = await channel.send(gated())
    assert isinstance(outcome, Permanent), outcome
    assert reason in outcome.error
    assert reason in caplog.text
    assert discord_api.posts == []


async def test_a_403_says_the_bot_lacks_access_or_a_permission(
    discord_api: DiscordApiStandin, channel: DiscordChannel, caplog: pytest.LogCaptureFixture
) -> None:
    """Discord's 403 Missing Access (50001) or Missing Permissions (50013) fails for
    good saying what to check (it said ``HTTP 403 code 50001`` only, in the error and
    the log)."""
    discord_api.set_channel_mode(CHANNEL, "forbidden")
    outcome = await channel.send(gated())
    assert isinstance(outcome, Permanent), outcome
    reason = "the bot cannot see the channel, or lacks a permission there"
    assert reason in outcome.error and reason in caplog.text
    assert discord_api.posts == []


@pytest.mark.parametrize("path", ["", "/api/v10/nothing-here"])
async def test_an_api_url_where_every_route_is_404_fails_for_good(
    discord_api: DiscordApiStandin, path: str
) -> None:
    """A URL that is not Discord's API (the stand-in's root, a wrong path: aiohttp's text
    404 for every route, login included) fails the delivery, by the bot and by an
    interaction's webhook, instead of being retried as if Discord were down."""
    ch = make_channel(f"{discord_api.base_url}{path}")
    try:
        by_bot = await ch.send(gated())
        by_webhook = await ch.send(interaction_reply())
    finally:
        await ch.close()
    for outcome in (by_bot, by_webhook):
        assert isinstance(outcome, Permanent), outcome
        assert "HTTP 404 without a Discord error" in outcome.error
        assert "check [discord] api_url" in outcome.error
    assert discord_api.posts == []


async def test_a_login_answered_200_by_something_else_fails_for_good() -> None:
    """A web server answering every path 200 with a page is not Discord's API either:
    the login (GETs only, nothing posted) cannot read the bot's user from it. Before,
    that was an unexpected error, ``deliveryUnknown`` for a post that never left."""

    async def page(request: web.BaseRequest) -> web.Response:
        return web.Response(text="<html>welcome</html>", content_type="text/html")

    async with RawTestServer(page, host="127.0.0.1") as server:
        ch = make_channel(str(server.make_url("/api/v10")))
        try:
            outcome = await ch.send(gated())
        finally:
            await ch.close()
    assert isinstance(outcome, Permanent), outcome
    assert "not Discord's API" in outcome.error and "[discord] api_url" in outcome.error


async def test_rejected_token_is_permanent(discord_api: DiscordApiStandin) -> None:
    ch = make_channel(discord_api.api_url, token="wrong")
    try:
        outcome = await ch.send(gated())
    finally:
        await ch.close()
    assert isinstance(outcome, Permanent), outcome


async def test_no_token_and_no_interaction_is_permanent(discord_api: DiscordApiStandin) -> None:
    ch = make_channel(discord_api.api_url, token="")
    try:
        assert isinstance(await ch.send(gated()), Permanent)
        # With an interaction token, the follow-up webhook still works without a bot.
        outcome = await ch.send(gated(application_id=APP, interaction_token="itoken"))
    finally:
        await ch.close()
    assert isinstance(outcome, Sent)
    assert [p["op"] for p in discord_api.posts] == ["followup"]


@pytest.mark.parametrize("mode", ["500", "503"])
async def test_server_errors_are_retry_within_the_deadline(
    discord_api: DiscordApiStandin, channel: DiscordChannel, mode: str
) -> None:
    # discord.py retries 500/502/504 itself after 1, 3, 5... seconds; the send's
    # deadline (0.6 s) cuts that short while nothing is on the wire: Retry.
    discord_api.set_channel_mode(CHANNEL, mode)
    started = time.monotonic()
    outcome = await channel.send(gated())
    assert isinstance(outcome, Retry), outcome
    # Under the 1 + 3 s discord.py sleeps before its third try, with room for a loaded
    # machine (1.5 s was within its reach).
    assert time.monotonic() - started < HANG_BOUND_S
    assert discord_api.posts == []


async def test_a_408_is_a_retry_not_a_failure(
    discord_api: DiscordApiStandin, channel: DiscordChannel
) -> None:
    """A 408 (the request not read in full in time, by Discord's edge or a proxy on the
    way: not carried out) failed the delivery for good, its item with it, as a 400
    does. Now it is a retry, as Slack's and Teams' 408 are."""
    discord_api.set_channel_mode(CHANNEL, "408")
    outcome = await channel.send(gated())
    assert isinstance(outcome, Retry), outcome
    assert outcome.error == "discord: HTTP 408 code 0"
    assert discord_api.posts == []


async def test_connection_refused_is_retry() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ch = make_channel(f"http://127.0.0.1:{port}/api/v10")
    try:
        assert isinstance(await ch.send(gated()), Retry)  # via the bot (login first)
        assert isinstance(await ch.send(interaction_reply()), Retry)  # via the webhook
    finally:
        await ch.close()


@pytest.mark.parametrize(
    "api_url",
    [
        "http://127.0.0.1:99999/api/v10",  # a port out of range
        "ftp://127.0.0.1/api/v10",  # not HTTP
        "127.0.0.1:8080/api/v10",  # no scheme
    ],
)
async def test_a_misconfigured_api_url_never_quotes_the_interaction_token(
    api_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp's error for a URL it cannot use quotes the URL, and an interaction's is
    ``/webhooks/{application}/{token}``: the delivery's error (stored, shown to
    operators, logged by the relay) and the log name the setting, never the token.
    (Such a URL is refused when the configuration is loaded; settings built otherwise
    are not checked.)"""
    token = "zqinteractiontoken"
    ch = make_channel(api_url, checked=False)
    try:
        outcome = await ch.send(interaction_reply(token=token))
        deleted = await ch.delete_original(APP, token)
    finally:
        await ch.close()
    # The URL will not become usable by waiting: failed for good, naming the setting.
    assert isinstance(outcome, Permanent) and deleted is False
    assert "[discord] api_url" in outcome.error
    assert token not in outcome.error and token not in caplog.text
    assert "could not delete the deferred response" in caplog.text


def test_described_errors_lose_a_webhook_token() -> None:
    """Any other error quoting an interaction webhook's URL keeps all of it but the token."""
    url = f"https://discord.com/api/v10/webhooks/{APP}/zqtoken/messages/@original"
    for exc in (OSError(f"failed on {url}"), aiohttp.ClientPayloadError(f"<{url}>")):
        text = described(exc)
        assert "zqtoken" not in text
        assert f"/webhooks/{APP}/<token>/messages/@original" in text


async def test_hang_after_reading_is_uncertain(
    discord_api: DiscordApiStandin, channel: DiscordChannel
) -> None:
    discord_api.queue("hang")
    started = time.monotonic()
    outcome = await channel.send(gated())
    assert isinstance(outcome, Uncertain), outcome
    assert time.monotonic() - started < HANG_BOUND_S  # the deadline, not the hang
    discord_api.queue("hang")
    assert isinstance(await channel.send(interaction_reply()), Uncertain)


async def test_a_part_gets_what_is_left_of_its_deliverys_deadline(
    discord_api: DiscordApiStandin,
) -> None:
    """A later part of a long text had the channel's whole timeout, whatever earlier
    parts took of the delivery's send deadline; now it ends within what is left of it
    (``within_s``), here well before the channel's own 20 s."""
    ch = make_channel(discord_api.api_url, timeout_s=20.0)
    try:
        discord_api.queue("hang")
        started = time.monotonic()
        outcome = await ch.send(dataclasses.replace(gated(), within_s=0.6))
        assert isinstance(outcome, Uncertain), outcome
        assert "no answer within 0.6s" in outcome.error
        assert time.monotonic() - started < HANG_BOUND_S  # what was left, not the 20 s
    finally:
        await ch.close()


async def test_reset_after_reading_is_uncertain(
    discord_api: DiscordApiStandin, channel: DiscordChannel
) -> None:
    discord_api.queue("reset")
    assert isinstance(await channel.send(gated()), Uncertain)
    discord_api.queue("reset")
    assert isinstance(await channel.send(interaction_reply()), Uncertain)
    assert discord_api.posts == []


async def test_a_write_answered_2xx_with_a_web_page_is_uncertain(
    discord_api: DiscordApiStandin, channel: DiscordChannel, caplog: pytest.LogCaptureFixture
) -> None:
    """A post answered 200 with a page (a captive portal's, a proxy's), not Discord's
    JSON, may or may not have reached Discord: ``deliveryUnknown``, as Slack and Teams
    treat such an answer, by the bot and by each interaction webhook. Before, a webhook's
    was ``Sent`` (with no message id) and the bot's an unexpected error, logged as a bug.

    The error and the WARNING line quote the start of the page with the session id in
    its login link left out, as Slack's and Teams' do (they quoted it whole)."""
    discord_api.queue("portal", "portal", "portal")
    with caplog.at_level(logging.WARNING, logger="bots.discord_out"):
        by_bot = await channel.send(gated())
        original = await channel.send(interaction_reply())
        follow_up = await channel.send(interaction_reply("delivery-r2"))
    error = (
        "discord: HTTP 200 that is not Discord's answer (<html> <h1>Sign in to the guest"
        ' network</h1> <a href="/login?sid=…">Sign in</a> </html>): the post may or may'
        " not have reached Discord; check [discord] api_url and any proxy on the way"
    )
    for outcome in (by_bot, original, follow_up):
        assert isinstance(outcome, Uncertain), outcome
        assert outcome.error == error
    assert [r.getMessage() for r in ours(caplog)] == [error] * 3
    assert PORTAL_SESSION not in caplog.text
    assert [r["op"] for r in discord_api.requests] == [
        "create_message",
        "edit_original",
        "followup",
    ]
    assert discord_api.posts == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_delete_original_is_best_effort(
    discord_api: DiscordApiStandin, channel: DiscordChannel
) -> None:
    assert await channel.delete_original(APP, "itoken") is True
    assert await channel.delete_original(APP, "itoken") is True  # already gone: fine
    # aiohttp itself re-sends an idempotent DELETE once after a dropped connection.
    discord_api.queue("reset", "reset")
    assert await channel.delete_original(APP, "other") is False
    assert [p["op"] for p in discord_api.posts] == ["delete_original"]


async def test_an_unanswered_ask_ended_before_its_reply_gets_the_reply_as_a_follow_up(
    discord_api: DiscordApiStandin, channel: DiscordChannel
) -> None:
    """An /ask left to the recovery runner has its deferred response deleted at once;
    its reply, later, follows up (this process, or another one whose edit of the
    deleted @original Discord answers 404 Unknown Message) instead of failing for good."""
    assert await channel.end_unanswered(APP, "itoken") is True
    assert isinstance(await channel.send(interaction_reply(token="itoken")), Sent)
    other = make_channel(discord_api.api_url)
    try:
        assert await other.delete_original(APP, "itoken2") is True
        assert isinstance(await other.send(interaction_reply(token="itoken2")), Sent)
    finally:
        await other.close()
    assert [(p["op"], p["token"], p.get("content")) for p in discord_api.posts] == [
        ("delete_original", "itoken", None),
        ("followup", "itoken", "plain reply"),
        ("delete_original", "itoken2", None),
        ("followup", "itoken2", "plain reply"),
    ]


async def test_an_unanswered_ask_whose_reply_came_first_keeps_it(
    discord_api: DiscordApiStandin, channel: DiscordChannel
) -> None:
    """The recovery runner may answer an /ask left to it before the adapter ends its
    deferred response: the reply that filled it stays."""
    assert isinstance(await channel.send(interaction_reply(token="itoken")), Sent)
    assert await channel.end_unanswered(APP, "itoken") is False
    assert [p["op"] for p in discord_api.posts] == ["edit_original"]


async def test_a_delete_answered_2xx_with_a_web_page_is_not_known_done(
    discord_api: DiscordApiStandin, channel: DiscordChannel, caplog: pytest.LogCaptureFixture
) -> None:
    """The DELETE of a deferred response answered 200 with a page (a captive portal's, a
    proxy's), not Discord's answer, deleted nothing known: False, as a send so answered
    is not known posted, and a WARNING line quoting the page (the session id in its
    login link left out) and saying what to check (never the interaction's token). It
    returned True without a word."""
    discord_api.queue("portal")
    with caplog.at_level(logging.WARNING, logger="bots.discord_out"):
        assert await channel.delete_original(APP, "itoken") is False
    [line] = [r.getMessage() for r in ours(caplog)]
    assert line == (
        "discord: could not delete the deferred response: HTTP 200 that is not Discord's"
        ' answer (<html> <h1>Sign in to the guest network</h1> <a href="/login?sid=…">Sign'
        " in</a> </html>): it may or may not be gone; check [discord] api_url and any proxy"
        " on the way"
    ), line
    assert "itoken" not in caplog.text
    assert discord_api.posts == []
    assert await channel.delete_original(APP, "itoken") is True  # Discord's own answer
    assert [p["op"] for p in discord_api.posts] == ["delete_original"]


async def test_subprocess_mode_and_records_endpoint() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.standins.discord_api",
        "--port",
        "0",
        "--latency-ms",
        "5",
        "--token",
        TOKEN,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        # Only "it started": a cold interpreter importing aiohttp and PyNaCl took
        # most of 2.5 s on a loaded machine.
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
        assert line.startswith(b"LISTENING ")
        port = int(line.split()[1])
        ch = make_channel(f"http://127.0.0.1:{port}/api/v10", timeout_s=2.0)
        try:
            assert isinstance(await ch.send(gated()), Sent)
        finally:
            await ch.close()
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/_standin/posts") as r:
                posts = await r.json()
        assert [(p["op"], p["channel_id"], p["content"]) for p in posts] == [
            ("create_message", CHANNEL, "approved")
        ]
    finally:
        proc.terminate()
        await proc.wait()
