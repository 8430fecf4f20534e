"""Slack outbound: the real slack-sdk client against the Web API stand-in."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient

from bots.slack import SlackAdapter, SlackChannel, env_proxy
from leadgate.core.config import Settings, SlackSettings
from leadgate.operations.chat_reviews import ChatAnswer
from outbox.channel import (
    Card,
    CardOutcome,
    OutboundMessage,
    Permanent,
    Retry,
    Sent,
    Uncertain,
)
from outbox.store import SEND_DEADLINE_S
from tests.fakes import FakeCore, mount_adapter
from tests.helpers import PHISH, decided_card, eventually, marked_card, ours
from tests.standins.common import PORTAL_SESSION
from tests.standins.microsoft_login import MicrosoftLogin
from tests.standins.slack_api import SlackApiStandin, signed_headers

TOKEN = "xoxb-test-token"
ROOT = Path(__file__).resolve().parents[2]


def settings(api_url: str, token: str = TOKEN) -> SlackSettings:
    return SlackSettings(signing_secret="s", bot_token=token, api_url=api_url)


def message(channel: str = "C1", thread_ts: str | None = "1700000000.000100") -> OutboundMessage:
    return OutboundMessage(
        delivery_id="d1",
        idempotency_key="d1",
        address={"team": "T1", "channel": channel, "thread_ts": thread_ts},
        text="approved text",
    )


@pytest.fixture
async def standin() -> AsyncIterator[SlackApiStandin]:
    async with SlackApiStandin(token=TOKEN) as slack:
        yield slack


@pytest.fixture
async def channel(standin: SlackApiStandin) -> AsyncIterator[SlackChannel]:
    ch = SlackChannel(settings(standin.api_url), timeout_s=0.5)
    yield ch
    await ch.close()


async def test_post_into_the_thread(standin: SlackApiStandin, channel: SlackChannel) -> None:
    outcome = await channel.send(message())
    assert isinstance(outcome, Sent)
    assert standin.posts == [
        {
            "channel": "C1",
            "text": "approved text",
            "thread_ts": "1700000000.000100",
            "ts": outcome.external_id,
        }
    ]
    assert channel.name == "slack" and channel.max_chars == 40_000


async def test_rate_limit_is_retry_with_its_delay(
    standin: SlackApiStandin, channel: SlackChannel
) -> None:
    standin.queue("ratelimited:7")
    outcome = await channel.send(message())
    assert isinstance(outcome, Retry) and outcome.delay_s == 7.0
    assert standin.posts == []
    # The SDK's own retry handlers are off: one attempt, the relay decides.
    assert len(standin.requests) == 1


@pytest.mark.parametrize(
    "mode",
    [
        "channel_not_found",
        "error:not_in_channel",
        "error:is_archived",
        "error:token_revoked",
        "error:msg_too_long",
        "error:some_new_error",
    ],
)
async def test_permanent_errors(standin: SlackApiStandin, channel: SlackChannel, mode: str) -> None:
    standin.queue(mode)
    outcome = await channel.send(message())
    assert isinstance(outcome, Permanent), outcome
    assert standin.posts == []


async def test_invalid_auth_is_permanent(standin: SlackApiStandin) -> None:
    ch = SlackChannel(settings(standin.api_url, token="xoxb-revoked"), timeout_s=0.5)
    try:
        outcome = await ch.send(message())
    finally:
        await ch.close()
    assert isinstance(outcome, Permanent) and "invalid_auth" in outcome.error


@pytest.mark.parametrize("mode", ["500", "502", "503", "504", "error:service_unavailable"])
async def test_server_errors_are_retry(
    standin: SlackApiStandin, channel: SlackChannel, mode: str
) -> None:
    standin.queue(mode)
    outcome = await channel.send(message())
    assert isinstance(outcome, Retry), outcome
    assert len(standin.requests) == 1


async def test_a_request_timeout_is_retry(standin: SlackApiStandin, channel: SlackChannel) -> None:
    """A 408 (Slack's edge or a proxy on the way did not get the whole request in time)
    was not processed: it was a permanent failure, and approved output was dropped."""
    standin.queue("408")
    outcome = await channel.send(message())
    assert isinstance(outcome, Retry), outcome
    assert standin.posts == [] and len(standin.requests) == 1
    assert isinstance(await channel.send(message()), Sent)


async def test_a_post_answered_200_with_a_web_page_is_uncertain(
    standin: SlackApiStandin, channel: SlackChannel, caplog: pytest.LogCaptureFixture
) -> None:
    """A 200 whose body is not Slack's JSON (a captive portal's page, a proxy's) may or
    may not have come after Slack took the post: ``deliveryUnknown``, as on Teams and
    Discord. It was a permanent failure (HTTP 200 with no error code).

    The error, and a WARNING line as Discord's and Teams', name the content type and
    quote the start of the page, a session id in it left out: there was no line at all,
    and the error said only "no JSON with an ok field" (slack_sdk drops such a body)."""
    standin.queue("portal")
    with caplog.at_level(logging.WARNING, logger="bots.slack"):
        outcome = await channel.send(message())
    assert isinstance(outcome, Uncertain), outcome
    assert outcome.error == (
        "slack: HTTP 200 that is not Slack's answer (text/html; charset=utf-8: <html> <h1>Sign"
        ' in to the guest network</h1> <a href="/login?sid=…">Sign in</a> </html>): the post'
        " may or may not have reached Slack; check [slack] api_url and any proxy on the way"
    )
    assert [(r.levelno, r.getMessage()) for r in ours(caplog)] == [(logging.WARNING, outcome.error)]
    assert standin.posts == []


async def test_a_page_labelled_json_is_quoted_too(
    standin: SlackApiStandin, channel: SlackChannel
) -> None:
    """A page that says it is JSON and is not: slack_sdk keeps its body only in its
    exception's message; the error quotes it as any other page (it said "empty body")."""
    standin.queue("badjson")
    outcome = await channel.send(message())
    assert isinstance(outcome, Uncertain), outcome
    assert outcome.error.startswith(
        "slack: HTTP 200 that is not Slack's answer (application/json; charset=utf-8:"
        " <html>Bad gateway</html>): the post may or may not have reached Slack"
    )


async def test_a_cards_names_and_why_reach_slack_as_plain_text(
    standin: SlackApiStandin, channel: SlackChannel
) -> None:
    """The card's facts were one mrkdwn line: a name's ``*``, ``_``, ``~`` or backquote
    restyled them. Posted through slack_sdk, they are ``plain_text`` fields, and the
    summary's markup and link are shown as typed (``[words](url)`` is no mrkdwn link)."""
    post = OutboundMessage(
        delivery_id="d3",
        idempotency_key="d3",
        address={"team": "T1", "channel": "C1"},
        text="",
        kind="card",
        card=marked_card(),
    )
    assert isinstance(await channel.send(post), Sent)
    [posted] = standin.posts
    facts, summary = posted["blocks"][1], posted["blocks"][2]
    typed = [f["text"] for f in facts["fields"] if f["type"] == "plain_text"]
    assert typed == ["*helper*_x_", "`src` ~y~", f"The lead escalated it: {PHISH}", "1 of 3"]
    assert summary["text"] == {"type": "mrkdwn", "text": f"*Summary*\n**Done.** {PHISH}"}


async def test_a_decided_cards_who_and_why_reach_slack_as_written(
    standin: SlackApiStandin, channel: SlackChannel
) -> None:
    """The outcome line ("*Rejected* by NAME ...") and the quoted reason were mrkdwn:
    a name's or reason's ``*``, ``_``, ``~`` or backquote restyled them. Edited through
    slack_sdk's ``chat.update``, they are a ``rich_text`` block's text elements."""
    marked = "*ann* _b_ ~c~ `d`"
    outcome = CardOutcome("Rejected", marked, "teams", 1_700_000_060_000, f"_no_ {PHISH}")
    edit = OutboundMessage(
        delivery_id="d4",
        idempotency_key="d4",
        address={"team": "T1", "channel": "C1"},
        text="",
        kind="cardUpdate",
        card=dataclasses.replace(decided_card(), outcome=outcome),
    )
    assert await channel.update(edit, "1700000000.000100") == Sent("1700000000.000100")
    [update] = [c for c in standin.calls if c["method"] == "chat.update"]
    line, said = update["blocks"][-1]["elements"]
    assert [(e["type"], e.get("text")) for e in line["elements"]] == [
        ("text", "Rejected"),
        ("text", f" by {marked} (teams) "),
        ("date", None),
    ]
    assert said == {"type": "rich_text_quote", "elements": [{"type": "text", "text": outcome.text}]}
    # The stand-in checks the shape Slack documents: a date element without its format
    # (or a text element without its text) is refused, as Slack refuses it.
    client = AsyncWebClient(token=TOKEN, base_url=standin.api_url)
    broken = copy.deepcopy(update["blocks"])
    del broken[-1]["elements"][0]["elements"][2]["format"]
    with pytest.raises(SlackApiError) as refused:
        await client.chat_update(channel="C1", ts="1700000000.000100", text="t", blocks=broken)
    assert refused.value.response["error"] == "invalid_blocks"


async def test_a_card_edit_answered_200_with_a_web_page_is_tried_again(
    standin: SlackApiStandin, channel: SlackChannel, caplog: pytest.LogCaptureFixture
) -> None:
    """Editing a card twice shows what once does: an edit answered with a page is sent
    again, and its error and WARNING line say so (they said "the post may or may not
    have reached Slack", with no line at all)."""
    edit = OutboundMessage(
        delivery_id="d2",
        idempotency_key="d2",
        address={"team": "T1", "channel": "C1"},
        text="",
        kind="cardUpdate",
        card=decided_card(),
    )
    standin.queue("portal")
    with caplog.at_level(logging.WARNING, logger="bots.slack"):
        outcome = await channel.update(edit, "1700000000.000100")
    assert isinstance(outcome, Retry), outcome
    assert "the card edit may or may not have reached Slack, and is sent again" in outcome.error
    assert PORTAL_SESSION not in outcome.error
    assert [(r.levelno, r.getMessage()) for r in ours(caplog)] == [(logging.WARNING, outcome.error)]
    assert [c for c in standin.calls if c["method"] == "chat.update"] == []
    assert await channel.update(edit, "1700000000.000100") == Sent("1700000000.000100")


@pytest.mark.parametrize(
    ("mode", "outcome_class"),
    [
        ("hang", Retry),
        ("reset", Retry),
        ("500", Retry),
        ("429", Retry),
        ("408", Retry),
        ("error:internal_error", Retry),
        ("error:ratelimited", Retry),
        ("error:message_not_found", Permanent),
    ],
)
async def test_a_card_edit_whose_outcome_is_unknown_is_sent_again(
    standin: SlackApiStandin, channel: SlackChannel, mode: str, outcome_class: type
) -> None:
    """chat.update with no answer, a lost connection or an answer that may follow the
    change is sent again (editing twice shows what once does), never deliveryUnknown;
    a message Slack no longer has is a permanent failure."""
    edit = OutboundMessage(
        delivery_id="d2",
        idempotency_key="d2",
        address={"team": "T1", "channel": "C1"},
        text="",
        kind="cardUpdate",
        card=decided_card(),
    )
    standin.queue(mode)
    outcome = await channel.update(edit, "1700000000.000100")
    assert isinstance(outcome, outcome_class), outcome
    assert [c for c in standin.calls if c["method"] == "chat.update"] == []


async def test_internal_error_body_is_uncertain(
    standin: SlackApiStandin, channel: SlackChannel
) -> None:
    # Slack: "it's possible some aspect of the operation succeeded".
    standin.queue("error:internal_error")
    assert isinstance(await channel.send(message()), Uncertain)


async def test_connection_refused_is_retry() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ch = SlackChannel(settings(f"http://127.0.0.1:{port}/api/"), timeout_s=0.5)
    try:
        outcome = await ch.send(message())
    finally:
        await ch.close()
    assert isinstance(outcome, Retry), outcome


async def test_hang_after_reading_is_uncertain(
    standin: SlackApiStandin, channel: SlackChannel
) -> None:
    standin.queue("hang")
    started = time.monotonic()
    outcome = await channel.send(message())
    assert isinstance(outcome, Uncertain), outcome
    # The deadline (0.5 s), not the hang; with room for a loaded machine's scheduling
    # (1.5 s was within its reach).
    assert time.monotonic() - started < 4.0
    assert len(standin.requests) == 1


async def test_an_answer_trickled_a_byte_at_a_time_ends_at_the_timeout(
    standin: SlackApiStandin,
) -> None:
    """The session's timeout is aiohttp's total (the whole request, the answer's body
    included), not a read timeout: an answer trickled a byte at a time, each within
    any read timeout, ends the send at the timeout, uncertain (the post was taken),
    and far within the send's deadline and its lease. (Found sound: a read-only timeout
    in its place fails this.)"""
    assert SEND_DEADLINE_S > 30.0  # SlackChannel's default timeout_s
    channel = SlackChannel(settings(standin.api_url), timeout_s=1.0)
    try:
        standin.queue("trickle")
        started = time.monotonic()
        outcome = await channel.send(message())
        assert isinstance(outcome, Uncertain), outcome
        assert time.monotonic() - started < 3.0  # the whole answer takes about 5 s
        [posted] = standin.requests
        await eventually(lambda: posted["cut"], what="the connection let go")
    finally:
        await channel.close()


async def test_reset_after_reading_is_uncertain(
    standin: SlackApiStandin, channel: SlackChannel
) -> None:
    standin.queue("reset")
    outcome = await channel.send(message())
    assert isinstance(outcome, Uncertain), outcome
    # Not re-posted by the SDK's connection-error retry handler.
    assert len(standin.requests) == 1


async def test_per_channel_mode_and_recovery(
    standin: SlackApiStandin, channel: SlackChannel
) -> None:
    standin.set_channel_mode("C_BAD", "503")
    assert isinstance(await channel.send(message("C_BAD")), Retry)
    assert isinstance(await channel.send(message("C1", thread_ts=None)), Sent)
    assert standin.posts[0]["thread_ts"] is None
    await channel.close()
    await channel.close()  # idempotent


async def test_subprocess_mode_and_records_endpoint() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.standins.slack_api",
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
        # Only "it started": a cold interpreter importing aiohttp and slack_sdk took
        # most of 2.5 s on a loaded machine.
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
        assert line.startswith(b"LISTENING ")
        port = int(line.split()[1])
        ch = SlackChannel(settings(f"http://127.0.0.1:{port}/api/"), timeout_s=1.0)
        try:
            assert isinstance(await ch.send(message()), Sent)
        finally:
            await ch.close()
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/_standin/posts") as r:
                posts = await r.json()
        assert [(p["channel"], p["text"], p["thread_ts"]) for p in posts] == [
            ("C1", "approved text", "1700000000.000100")
        ]
    finally:
        proc.terminate()
        await proc.wait()


@pytest.fixture
async def proxy(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MicrosoftLogin]:
    """The CONNECT proxy in front of Microsoft's login stand-in (it passes plain HTTP for
    127.0.0.1 on, and refuses any other host), named by the environment as the service
    gets it for Teams, with ``localhost`` in ``NO_PROXY``."""
    login = MicrosoftLogin(app_id="app", app_password="pw", access_token="at")
    server = await asyncio.start_server(login.tunnel, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    for name in ("https_proxy", "http_proxy", "no_proxy", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", url)
    monkeypatch.setenv("HTTP_PROXY", url)
    monkeypatch.setenv("NO_PROXY", "example.org,localhost")
    try:
        yield login
    finally:
        server.close()
        await login.close_tunnels()
        await server.wait_closed()


async def test_a_no_proxy_host_is_called_directly(
    standin: SlackApiStandin, proxy: MicrosoftLogin
) -> None:
    """slack_sdk takes HTTPS_PROXY for every call and ignores NO_PROXY: a Slack API on a
    host NO_PROXY lists went through the proxy (here refused: 403) all the same."""
    ch = SlackChannel(settings(standin.api_url.replace("127.0.0.1", "localhost")))
    try:
        outcome = await ch.send(message())
    finally:
        await ch.close()
    assert isinstance(outcome, Sent), outcome
    assert proxy.proxied == [] and len(standin.posts) == 1


async def test_another_host_is_called_through_the_proxy(
    standin: SlackApiStandin, proxy: MicrosoftLogin
) -> None:
    ch = SlackChannel(settings(standin.api_url))
    try:
        outcome = await ch.send(message())
    finally:
        await ch.close()
    assert isinstance(outcome, Sent), outcome
    assert proxy.proxied == [f"{standin.api_url}chat.postMessage"]
    assert len(standin.posts) == 1


class DecidedAlready:
    """A review backend for which every item was decided before the click (``card``: the
    clicked card as it looks now, shown in its place; ``None``: answered in words only)."""

    said = "This item is not waiting for a decision."

    def __init__(self, card: Card | None = None) -> None:
        self.card = card

    async def decide(self, *args: Any, **kw: Any) -> ChatAnswer:
        return ChatAnswer("closed", self.said, self.card)


async def click_approve(
    api_url: str, response_url: str, backend: DecidedAlready | None = None
) -> None:
    """Click Approve on a card, through the adapter's ``/slack/events`` (signed), with
    ``response_url`` as the click's, and wait until its answers are posted."""
    core = FakeCore()
    adapter = SlackAdapter(Settings(slack=settings(api_url)), core)
    adapter.enable_reviews(backend or DecidedAlready())  # type: ignore[arg-type]
    app = web.Application()
    mount_adapter(app, adapter)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    payload = {
        "type": "block_actions",
        "team": {"id": "T1"},
        "user": {"id": "U1", "team_id": "T1"},
        "trigger_id": "trig-1",
        "response_url": response_url,
        "container": {"type": "message", "message_ts": "1.1", "channel_id": "C1"},
        "actions": [{"action_id": "approve", "value": "wi_1", "block_id": "lg_review:rep_1:d_1"}],
    }
    body = "payload=" + quote(json.dumps(payload))
    headers = {**signed_headers("s", body), "Content-Type": "application/x-www-form-urlencoded"}
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                server.make_url("/slack/events"), data=body, headers=headers
            ) as r:
                assert r.status == 200
        await core.drain()
    finally:
        await server.close()


@pytest.mark.parametrize(
    ("api_host", "response_host", "proxied"),
    [
        ("127.0.0.1", "localhost", False),  # the Web API's proxy is not the answer's
        ("localhost", "localhost", False),  # none for the Web API: HTTPS_PROXY was taken
        ("localhost", "127.0.0.1", True),  # a host NO_PROXY does not list: proxied
    ],
)
async def test_a_review_clicks_answer_takes_the_proxy_no_proxy_leaves_it(
    standin: SlackApiStandin,
    proxy: MicrosoftLogin,
    api_host: str,
    response_host: str,
    proxied: bool,
) -> None:
    """A click is answered through its ``response_url`` with the proxy chosen for that
    URL, as Web API calls are. slack-bolt's ``respond`` took the Web API client's proxy,
    or, with none, slack_sdk's pick of ``HTTPS_PROXY`` for every URL: an answer to a
    host ``NO_PROXY`` lists went to the proxy (here refused) and never arrived."""
    url = standin.response_url("click").replace("127.0.0.1", response_host)
    await click_approve(standin.api_url.replace("127.0.0.1", api_host), url)
    answers = [c for c in standin.calls if c["method"] == "response_url"]
    assert [(a["text"], a["response_type"]) for a in answers] == [
        (DecidedAlready.said, "ephemeral")
    ]
    assert proxy.proxied == ([url] if proxied else [])


async def test_an_ephemeral_answer_whose_reply_was_lost_is_not_posted_again(
    standin: SlackApiStandin, caplog: pytest.LogCaptureFixture
) -> None:
    """An ephemeral answer posts a new message each time: one that reached Slack and
    lost its reply on the way back is not sent again. slack_sdk's webhook client retried
    it (its default connection-error handler takes a reset or a server disconnect), and
    the clicker was told the same thing twice."""
    standin.lose_answer("click")
    with caplog.at_level(logging.INFO, logger="bots.slack_review"):
        await click_approve(standin.api_url, standin.response_url("click"))
    answers = [c for c in standin.calls if c["method"] == "response_url"]
    assert [(a["text"], a["response_type"]) for a in answers] == [
        (DecidedAlready.said, "ephemeral")
    ]
    [line] = [r.getMessage() for r in ours(caplog)]
    assert line.startswith("slack: could not answer a review click (")


async def test_a_card_replacement_whose_reply_was_lost_is_sent_again(
    standin: SlackApiStandin,
) -> None:
    """Replacing the clicked card is idempotent (the same card again), so a replacement
    whose reply was lost is sent once more (slack_sdk's connection-error retry), and the
    ephemeral line follows it once."""
    standin.lose_answer("click")
    await click_approve(
        standin.api_url, standin.response_url("click"), DecidedAlready(decided_card())
    )
    answers = [c for c in standin.calls if c["method"] == "response_url"]
    assert [(a.get("replace_original"), a.get("response_type")) for a in answers] == [
        (True, None),
        (True, None),
        (False, "ephemeral"),
    ]
    assert answers[0]["blocks"] == answers[1]["blocks"]


@pytest.mark.parametrize(
    ("url", "proxy"),
    [
        ("https://slack.com/api/", "http://https-proxy:3128"),
        ("http://slack.test/api/", "http://http-proxy:3128"),  # the URL's scheme decides
        ("https://api.example.org/", None),  # a suffix of a NO_PROXY entry
        ("https://localhost:8443/api/", None),  # the port plays no part
        ("https://notexample.org/", "http://https-proxy:3128"),  # not a subdomain
    ],
)
def test_env_proxy_chooses_as_aiohttp_does(
    monkeypatch: pytest.MonkeyPatch, url: str, proxy: str | None
) -> None:
    for name in ("https_proxy", "http_proxy", "no_proxy", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://https-proxy:3128")
    monkeypatch.setenv("HTTP_PROXY", "http://http-proxy:3128")
    monkeypatch.setenv("NO_PROXY", "example.org,localhost")
    assert env_proxy(url) == proxy
